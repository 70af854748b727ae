"""`python3 -m tpuft_local.prepare` (PYTHONPATH=local): what `tpuft cluster up` builds before it starts
anything, with the machine's own python3, before any venv exists: the Debian packages the builds need,
then the Go tools (Argo CD aside: `up --argocd` builds it) and the images side by side, as `up` does.

`make demo` runs it beside `make venv`: on a cold machine the compiles and the image builds take the
CPU and the disk while pip downloads, instead of after it. `up` then finds every tool and image in
the cache (and waits on their build locks, were one still building). Warm, it checks and returns in
seconds. Stdlib only, as every module it calls.
"""
from __future__ import annotations

import concurrent.futures
import sys

from tpuft_local import host, images, toolchain
from tpuft_local.console import say


def tools_and_images(tools: list[str], image_names: tuple[str, ...]) -> dict:
    """The Go builds (CPU) and the image builds (mostly downloads and disk) side by side: on a cold
    machine they are the two long steps, and neither needs the other. {name: ImageRef} of the images."""
    if not image_names:
        toolchain.ensure_tools(tools)
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="images") as pool:
        built = pool.submit(images.ensure_images, names=image_names, progress=say)
        toolchain.ensure_tools(tools)
        return built.result()


def prepare() -> None:
    host.require_root()
    host.ensure_packages(host.Journal.load(host.journal_path(host.default_state_dir())))
    tools_and_images([t for t in toolchain.TOOLS if t not in toolchain.OPTIONAL_TOOLS], tuple(images.Image))


def main() -> int:
    try:
        prepare()
    except (host.HostError, toolchain.ToolchainError, images.ImageError) as e:
        say(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
