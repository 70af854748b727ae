"""`tpuft`: the command line, run on a user's laptop (the `tpuft` console script, `python -m tpuft.cli`).

It uses tpuft.api (and the controller's pure builders for `tpuft render`), and the user's own kubectl.
Each subcommand lives in the module that owns the concept; this file only wires argparse to them,
importing only the module of the command that runs."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "topology": ("tpuft.cli.cli_core", "print the slice facts for an accelerator and topology as JSON"),
    "validate": ("tpuft.cli.cli_core", "validate TPUFinetune manifests; list every problem by field path"),
    "render": ("tpuft.cli.cli_core", "print the RayCluster and RayJobs a TPUFinetune becomes"),
    "chat": ("tpuft.cli.chat_cli", "send one chat message to a served TPUFinetune (spec.serve) and print the answer"),
    "logs": ("tpuft.cli.logs_cli", "print a TPUFinetune's verification or training driver log (-f: follow it)"),
    "plot": ("tpuft.cli.plot_cli", "plot a TPUFinetune's loss and throughput per step to a PNG (matplotlib)"),
    "cluster": ("tpuft_local.cluster", "a real local cluster (node, KubeRay, simulated TPU pools): tools|up|down|status"),
    "images": ("tpuft_local.images", "build the operator and workload images from the Dockerfiles; load them into the node"),
    "demo": ("tpuft_local.demo", "run the whole system locally on the CPU example"),
}


def available() -> dict[str, tuple[str, str]]:
    """The subcommands whose package is installed: the operator image has no tpuft_local, so its
    `tpuft` offers only what makes sense inside a cluster."""
    local = importlib.util.find_spec("tpuft_local") is not None
    return {name: entry for name, entry in SUBCOMMANDS.items() if local or not entry[0].startswith("tpuft_local.")}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpuft", description="TPUFinetune operator tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _name=name)
        if name == chosen:  # import only the module that runs: `tpuft topology` stays fast
            mod = importlib.import_module(module)
            (getattr(mod, f"add_{name}_arguments", None) or getattr(mod, "add_arguments"))(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    mod = importlib.import_module(args._module)
    runner = getattr(mod, f"run_{args._name}", None) or getattr(mod, "run")
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
