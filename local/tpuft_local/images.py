"""Building the operator and workload images from the repo's Dockerfiles, on this machine,
with no Docker engine and no registry; and importing them into a node's containerd.

Builder: buildah (Debian's 1.28, `apt-get install buildah`). `buildah build` implements the
Dockerfile itself (multi-stage, ARG, COPY --from, USER, .dockerignore, RUN --mount=type=cache)
as one daemonless command with its own storage directory, so a build needs nothing running and
leaves nothing running. BuildKit would need buildkitd up (plus a Go build of it) for every
build, and podman's `build` is this same buildah code with more to install.

Base images are never pulled: `localhost/tpuft/python:3.11-bookworm` is a debootstrap'ed
Debian rootfs with Python 3.11, passed through the Dockerfiles' own build args
(`PYTHON_IMAGE`; `BASE_IMAGE` + `TORCH_SPEC`), and every build runs with `--pull=never`.
The pod sandbox image `localhost/tpuft/pause:3.10` is a static C binary compiled here.

Caching: each image carries the sha256 of its inputs (recipe, Dockerfile, the context files
.dockerignore lets through, build args, its base's hash) as the label INPUTS_LABEL; an image
whose label matches is not rebuilt, and its archive is rewritten only when its image ID
changed. PyPI's torch (~4.5 GB) is downloaded once into a wheelhouse that the workload build
mounts and TORCH_SPEC installs from, so a rebuild does not download it again; the Dockerfiles' pip
cache mounts serve Docker users (this machine's egress proxy makes pip's HTTP cache useless).
Everything lives under ``${TPUFT_CACHE:-~/.cache/tpuft}/images/``: `storage/` + `runroot/`
(buildah's), `tmp/` (its TMPDIR and cache mounts), `wheels/`, `debs/` (debootstrap's),
`archives/` (docker-archive tars for `ctr images import`), `state/`, `logs/`.
Top-level imports are stdlib only.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tpuft_local.console import say
from tpuft_local.toolchain import cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_YAML = REPO_ROOT / "charts" / "tpufinetune-operator" / "Chart.yaml"

BASE_REF = "localhost/tpuft/python:3.11-bookworm"
PAUSE_REF = "localhost/tpuft/pause:3.10"
OPERATOR_REPOSITORY = "ghcr.io/tpufinetune/tpufinetune-operator"  # charts/.../values.yaml image.repository
WORKLOAD_REF = "docker.io/tpufinetune/workload:local"  # examples/local-cpu.yaml spec.image, normalized
# PyPI's torch (the CUDA build: ~4.5 GB of wheels); download.pytorch.org is not reachable here.
TORCH_SPEC = "torch==2.13.*"
DEBIAN_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# python-is-python3: the RayJobs run `python -m tpuft_workload`, as on the official python images.
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates")
INPUTS_LABEL = "dev.tpufinetune.inputs-sha256"
# Bump when the way an image is made changes without any hashed input changing.
RECIPE_VERSION = "1"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELS_MOUNT = "/var/cache/tpuft-wheels"  # where RUN steps see the torch wheelhouse
PROGRESS_EVERY_S = 30.0

Progress = Callable[[str], None]


class Image(enum.StrEnum):
    """The images `ensure_images` can make (the base is built on the way, never asked for)."""
    PAUSE = "pause"
    OPERATOR = "operator"
    WORKLOAD = "workload"


class ImageError(RuntimeError):
    """An image could not be built, exported or loaded; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class ImageRef:
    name: str
    ref: str                # the name containerd and the kubelet see
    image_id: str           # buildah's image ID (unchanged when the cache is hit)
    inputs_hash: str
    archive: Path           # docker-archive for `ctr images import`
    config_digest: str      # digest of the archive's image config: what containerd records
    size_bytes: int         # uncompressed image size
    built: bool             # False when the cache had it


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where everything lives; one directory, so teardown is one rmtree."""
    root: Path

    storage = property(lambda self: self.root / "storage")
    runroot = property(lambda self: self.root / "runroot")
    tmp = property(lambda self: self.root / "tmp")
    archives = property(lambda self: self.root / "archives")
    state = property(lambda self: self.root / "state")
    logs = property(lambda self: self.root / "logs")
    debs = property(lambda self: self.root / "debs")
    wheels = property(lambda self: self.root / "wheels")
    policy = property(lambda self: self.root / "policy.json")
    registries = property(lambda self: self.root / "registries.conf")


def layout() -> Layout:
    return Layout(cache_dir() / "images")


def operator_ref() -> str:
    """The chart's default image: image.repository at the chart's appVersion."""
    m = re.search(r'^appVersion:\s*["\']?([^"\'\s]+)', CHART_YAML.read_text(), re.M)
    if not m:
        raise ImageError(f"{CHART_YAML}: no appVersion; the operator image tag comes from it")
    return f"{OPERATOR_REPOSITORY}:{m.group(1)}"


# --- running buildah -----------------------------------------------------------------------

def _require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise ImageError(f"{tool} not found on PATH: install it with `apt-get install {package}`")
    return path


def _prepare(lay: Layout) -> None:
    for d in (lay.storage, lay.runroot, lay.tmp, lay.archives, lay.state, lay.logs, lay.debs):
        d.mkdir(parents=True, exist_ok=True)
    # Our own policy and registries files: exporting to a docker-archive needs a policy, and
    # no registry is configured, so nothing can be pulled even by mistake.
    lay.policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    lay.registries.write_text("unqualified-search-registries = []\nshort-name-mode = \"disabled\"\n")


def _env(lay: Layout) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # buildah keeps RUN --mount=type=cache directories under $TMPDIR: this puts pip's cache
    # in the cache dir, where it outlives /tmp cleaners and goes with remove_storage().
    env.update(TMPDIR=str(lay.tmp), CONTAINERS_REGISTRIES_CONF=str(lay.registries),
               BUILDAH_ISOLATION="oci", BUILDAH_FORMAT="oci")
    return env


def _buildah_cmd(lay: Layout, *args: str) -> list[str]:
    return [_require("buildah", "buildah"), "--root", str(lay.storage), "--runroot", str(lay.runroot),
            "--storage-driver", "overlay", *args]


def buildah(*args: str, lay: Layout | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a short buildah command against this project's storage."""
    lay = lay or layout()
    proc = subprocess.run(_buildah_cmd(lay, *args), capture_output=True, text=True, env=_env(lay))
    if check and proc.returncode != 0:
        raise ImageError(f"buildah {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def _tail(path: Path, n: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


def _run_long(cmd: list[str], what: str, log: Path, progress: Progress, env: dict[str, str]) -> None:
    """Run a long command at low priority with its output in `log`, saying every ~30 s how
    far it got, so a cold build of many minutes is visibly alive."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        try:
            while True:
                try:
                    proc.wait(timeout=PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    last = (_tail(log, 1) or "...").strip()[:160]
                    progress(f"{what}: {time.monotonic() - start:.0f} s: {last}")
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
    if proc.returncode != 0:
        raise ImageError(f"{what} failed (exit {proc.returncode}); full log: {log}\n{_tail(log)}")


# --- what is in the store ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stored:
    image_id: str
    labels: dict
    size_bytes: int
    config: dict  # the OCI image config's `config` (User, Entrypoint, Cmd, Env, Labels, ...)


def stored(ref: str, lay: Layout | None = None) -> Stored | None:
    """What the project's storage holds under `ref`, or None."""
    lay = lay or layout()
    if not lay.storage.exists():
        return None
    proc = buildah("inspect", "--type", "image", ref, lay=lay, check=False)
    if proc.returncode != 0:
        return None
    info = json.loads(proc.stdout)
    config = (info.get("OCIv1") or {}).get("config") or {}
    # Layers go into local storage uncompressed: their sizes add up to the image's size
    # (`buildah images` prints only a rounded human-readable one).
    manifest = json.loads(info.get("Manifest") or "{}")
    size = sum(int(layer.get("size", 0)) for layer in manifest.get("layers", []))
    return Stored(info["FromImageID"], config.get("Labels") or {}, size, config)


def _fresh(ref: str, inputs_hash: str, lay: Layout) -> Stored | None:
    found = stored(ref, lay)
    return found if found and found.labels.get(INPUTS_LABEL) == inputs_hash else None


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# --- inputs ----------------------------------------------------------------------------

def _ignore_rules(root: Path) -> list[tuple[bool, re.Pattern, str]]:
    """The .dockerignore, as Docker reads it: `!` re-includes, `**` spans directories."""
    path = root / ".dockerignore"
    rules = []
    for raw in (path.read_text().splitlines() if path.exists() else []):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate, pat = line.startswith("!"), line.lstrip("!").strip().strip("/")
        segs = pat.split("/")
        rx = ""
        for i, seg in enumerate(segs):
            last = i == len(segs) - 1
            if seg == "**":
                rx += ".*" if last else "(?:.*/)?"
            else:
                rx += _glob_segment(seg) + ("" if last else "/")
        rules.append((negate, re.compile(f"^{rx}$", re.S), pat))
    return rules


def _glob_segment(seg: str) -> str:
    out, i = "", 0
    while i < len(seg):
        c = seg[i]
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = seg.find("]", i)
            out += seg[i:j + 1] if j > 0 else re.escape(c)
            i = j if j > 0 else i
        else:
            out += re.escape(c)
        i += 1
    return out


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern, str]]) -> bool:
    # A pattern excludes a path when it matches the path or any parent; the last match wins.
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, rx, _ in rules:
        if any(rx.match(p) for p in prefixes):
            result = not negate
    return result


def context_files(root: Path = REPO_ROOT) -> list[str]:
    """Relative paths of the files the build context holds after .dockerignore."""
    rules = _ignore_rules(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath).relative_to(root).as_posix()
        here = "" if here == "." else here + "/"
        # Skip an ignored directory (.venv, .git: huge) unless a `!pattern` could reach into it.
        dirnames[:] = sorted(d for d in dirnames if not _ignored(here + d, rules) or any(
            neg and (pat.startswith(here + d + "/") or pat.startswith("**")) for neg, _, pat in rules))
        out += [here + f for f in sorted(filenames) if not _ignored(here + f, rules)]
    return sorted(out)


def _context_hash(root: Path) -> str:
    return files_hash(root, context_files(root))


def files_hash(root: Path, files: list[str]) -> str:
    """sha256 over each file's path, executable bit and content, in the order given."""
    h = hashlib.sha256()
    for rel in files:
        p = root / rel
        h.update(f"{rel}\0{os.access(p, os.X_OK)}\0".encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def debian_mirror() -> str:
    """The apt mirror this machine uses (its deb822 sources), so debootstrap goes where apt goes."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for block in path.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", block, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", block, re.M)
            if uris and suites and DEBIAN_SUITE in suites.group(1).split():
                return uris.group(1).rstrip("/")
    return DEFAULT_MIRROR


# --- the base: Debian bookworm + Python 3.11 -----------------------------------------------

def _base_hash() -> str:
    return _digest({"recipe": RECIPE_VERSION, "suite": DEBIAN_SUITE, "mirror": debian_mirror(),
                    "packages": BASE_PACKAGES})


def _build_base(lay: Layout, inputs_hash: str, progress: Progress) -> None:
    _require("debootstrap", "debootstrap")
    work = Path(tempfile.mkdtemp(prefix="base-", dir=lay.tmp))
    try:
        rootfs = work / "rootfs"
        _run_long(["debootstrap", "--variant=minbase", f"--cache-dir={lay.debs}",
                   "--include=" + ",".join(BASE_PACKAGES), DEBIAN_SUITE, str(rootfs), debian_mirror()],
                  "base: debootstrap", lay.logs / "base.log", progress, _env(lay))
        # What python:3.11-slim also leaves out: package lists and caches; /dev is the runtime's.
        for junk in ("var/lib/apt/lists", "var/cache/apt", "var/log", "dev"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
            (rootfs / junk).mkdir(parents=True, exist_ok=True)
        _commit_rootfs(lay, rootfs, inputs_hash)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _commit_rootfs(lay: Layout, rootfs: Path, inputs_hash: str) -> None:
    ctr = buildah("from", "--pull=never", "scratch", lay=lay).stdout.strip()
    try:
        mnt = buildah("mount", ctr, lay=lay).stdout.strip()
        # tar keeps owners, modes, links and xattrs exactly as debootstrap made them.
        pack = subprocess.Popen(["tar", "-C", str(rootfs), "--xattrs", "-cf", "-", "."], stdout=subprocess.PIPE)
        unpack = subprocess.run(["tar", "-C", mnt, "--xattrs", "-xpf", "-"], stdin=pack.stdout,
                                capture_output=True, text=True)
        pack.stdout.close()
        if pack.wait() != 0 or unpack.returncode != 0:
            raise ImageError(f"copying the base rootfs into the image failed: {unpack.stderr[-2000:]}")
        buildah("umount", ctr, lay=lay)
        buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8", "--cmd", '["python3"]', "--label", f"{INPUTS_LABEL}={inputs_hash}",
                "--os", "linux", "--arch", "amd64", ctr, lay=lay)
        buildah("commit", "--quiet", ctr, BASE_REF, lay=lay)
    finally:
        buildah("rm", ctr, lay=lay, check=False)


# --- the pause image -------------------------------------------------------------------

# PID 1 of every pod sandbox: holds the pod's namespaces by existing, reaps the orphans the
# kernel re-parents to it, and exits 0 on SIGINT/SIGTERM.
PAUSE_C = r"""
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_stop(int sig) { stop = sig; }
static void on_child(int sig) { (void)sig; /* only to wake sigsuspend; main reaps */ }

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("tpuft-pause 3.10");
        return 0;
    }
    /* Blocked except inside sigsuspend: a signal arriving between the check of `stop` and
       the wait is then delivered by the wait itself, never lost. */
    sigset_t blocked, waiting;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGINT);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGCHLD);
    sigprocmask(SIG_BLOCK, &blocked, &waiting);
    sigdelset(&waiting, SIGINT);
    sigdelset(&waiting, SIGTERM);
    sigdelset(&waiting, SIGCHLD);
    /* As PID 1 a signal with the default action is ignored: handlers make them count. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_child;
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    while (!stop) {
        sigsuspend(&waiting);
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
    }
    return 0;
}
"""
PAUSE_CFLAGS = ("-static", "-Os", "-s", "-Wall", "-Werror")


def _gcc_version() -> str:
    gcc = _require("gcc", "gcc libc6-dev")
    return subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def _pause_hash() -> str:
    return _digest({"recipe": RECIPE_VERSION, "source": PAUSE_C, "cflags": PAUSE_CFLAGS, "gcc": _gcc_version()})


def _build_pause(lay: Layout, inputs_hash: str, progress: Progress) -> None:
    work = Path(tempfile.mkdtemp(prefix="pause-", dir=lay.tmp))
    try:
        (work / "pause.c").write_text(PAUSE_C)
        proc = subprocess.run(["gcc", *PAUSE_CFLAGS, "-o", str(work / "pause"), str(work / "pause.c")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageError(f"gcc -static failed (static libc: `apt-get install libc6-dev`): {proc.stderr}")
        ctr = buildah("from", "--pull=never", "scratch", lay=lay).stdout.strip()
        try:
            buildah("copy", "--chmod", "0755", ctr, str(work / "pause"), "/pause", lay=lay)
            # 65535: the unprivileged user the kubelet's own pause image runs as.
            buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535",
                    "--label", f"{INPUTS_LABEL}={inputs_hash}", "--os", "linux", "--arch", "amd64", ctr, lay=lay)
            buildah("commit", "--quiet", ctr, PAUSE_REF, lay=lay)
        finally:
            buildah("rm", ctr, lay=lay, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- images from the Dockerfiles ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one image is made: a Dockerfile of this repo and its build args."""
    name: Image
    ref: str
    dockerfile: str
    build_args: tuple[tuple[str, str], ...]
    torch_wheels: bool = False  # mount the torch wheelhouse (TORCH_SPEC installs from it)


def recipes() -> dict[Image, Recipe]:
    return {
        Image.OPERATOR: Recipe(Image.OPERATOR, operator_ref(), "Dockerfile.operator",
                               (("PYTHON_IMAGE", BASE_REF),)),
        # A CPU workload: the Debian base has no torch, so TORCH_SPEC installs PyPI's first,
        # offline from the wheelhouse (pip takes the index's copy of a file over a
        # --find-links one, so the index is switched off for this one install).
        Image.WORKLOAD: Recipe(Image.WORKLOAD, WORKLOAD_REF, "Dockerfile.workload",
                               (("BASE_IMAGE", BASE_REF),
                                ("TORCH_SPEC", f"--no-index --find-links={WHEELS_MOUNT} {TORCH_SPEC}")),
                               torch_wheels=True),
    }


def _dockerfile_hash(recipe: Recipe, base_hash: str) -> str:
    return _digest({"recipe": RECIPE_VERSION, "dockerfile": (REPO_ROOT / recipe.dockerfile).read_text(),
                    "context": _context_hash(REPO_ROOT), "args": recipe.build_args, "base": base_hash})


def _build_dockerfile(lay: Layout, recipe: Recipe, inputs_hash: str, progress: Progress) -> None:
    # --layers: each step's result is kept, so a change to the code (copied last) rebuilds the
    # last steps only, not the torch and Ray installs under them.
    args = ["build", "--pull=never", "--layers=true", "--network=host", "--format=oci",
            "-f", str(REPO_ROOT / recipe.dockerfile), "-t", recipe.ref,
            "--label", f"{INPUTS_LABEL}={inputs_hash}"]
    for key, value in recipe.build_args:
        args += ["--build-arg", f"{key}={value}"]
    args += _ca_volume()
    if recipe.torch_wheels:
        args += ["--volume", f"{_torch_wheelhouse(lay, progress)}:{WHEELS_MOUNT}:ro"]
    _run_long(_buildah_cmd(lay, *args, str(REPO_ROOT)), f"{recipe.name}: buildah build",
              lay.logs / f"{recipe.name}.log", progress, _env(lay))


def _ca_volume() -> list[str]:
    # pip inside RUN trusts what this machine trusts (its egress CA is not in Debian's
    # bundle); mounted for the build only, never part of an image.
    return ["--volume", f"{HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro"] if HOST_CA_BUNDLE.is_file() else []


def _torch_wheelhouse(lay: Layout, progress: Progress) -> Path:
    """PyPI's torch wheels (~4.5 GB with its nvidia-* dependencies), downloaded once by the
    base image's own pip (so the tags fit the image's Python and glibc). This machine's
    egress proxy strips PyPI's Cache-Control headers, so pip's HTTP cache (the Dockerfiles'
    cache mounts) never stores a file here: without this every rebuild downloads torch again."""
    marker = lay.wheels / f".complete-{_digest([TORCH_SPEC, _base_hash()])[:16]}"
    if marker.exists():
        return lay.wheels
    lay.wheels.mkdir(parents=True, exist_ok=True)
    ctr = buildah("from", "--pull=never", BASE_REF, lay=lay).stdout.strip()
    try:
        _run_long(_buildah_cmd(lay, "run", "--network=host", *_ca_volume(), "--volume", f"{lay.wheels}:/wheels",
                               ctr, "--", "python3", "-m", "pip", "download", "--disable-pip-version-check",
                               "--progress-bar=off", "--dest", "/wheels", *TORCH_SPEC.split()),
                  "workload: downloading torch wheels", lay.logs / "torch-wheels.log", progress, _env(lay))
    finally:
        buildah("rm", ctr, lay=lay, check=False)
    marker.touch()
    return lay.wheels


# --- archives for containerd -----------------------------------------------------------

def _archive_config_digest(archive: Path) -> str:
    """The image config's digest as containerd will record it (docker-archive keeps the
    config blob byte for byte; its member name is its sha256)."""
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        config = tar.extractfile(manifest[0]["Config"]).read()
    return "sha256:" + hashlib.sha256(config).hexdigest()


def _export(lay: Layout, name: str, ref: str, found: Stored, inputs_hash: str, progress: Progress,
            built: bool) -> ImageRef:
    """The docker-archive of `ref`, written again only when the image ID changed."""
    state_file = lay.state / f"{name}.json"
    archive = lay.archives / f"{name}.tar"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    if state.get("image_id") != found.image_id or state.get("ref") != ref or not archive.exists():
        partial = archive.with_suffix(".tar.partial")
        partial.unlink(missing_ok=True)
        _run_long(_buildah_cmd(lay, "push", "--quiet", "--signature-policy", str(lay.policy), found.image_id,
                               f"docker-archive:{partial}:{ref}"),
                  f"{name}: export", lay.logs / f"{name}-export.log", progress, _env(lay))
        os.replace(partial, archive)
        state = {"ref": ref, "image_id": found.image_id, "config_digest": _archive_config_digest(archive)}
        state_file.write_text(json.dumps(state, indent=1) + "\n")
    return ImageRef(name, ref, found.image_id, inputs_hash, archive, state["config_digest"],
                    found.size_bytes, built)


# --- the public API ----------------------------------------------------------------------

@contextlib.contextmanager
def _lock(lay: Layout):
    lay.root.mkdir(parents=True, exist_ok=True)
    with open(lay.root / "lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is building images in {lay.root}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _ensure(lay: Layout, ref: str, inputs_hash: str, build: Callable[[], None], what: str,
            progress: Progress) -> tuple[Stored, bool]:
    found = _fresh(ref, inputs_hash, lay)
    if found:
        return found, False
    progress(f"{what}: building {ref} (inputs {inputs_hash[:12]} not in the cache)")
    start = time.monotonic()
    build()
    found = _fresh(ref, inputs_hash, lay)
    if not found:
        raise ImageError(f"{what}: built, but {ref} with label {INPUTS_LABEL}={inputs_hash} is not in {lay.storage}")
    progress(f"{what}: {ref} {found.size_bytes / 1e6:.1f} MB in {time.monotonic() - start:.0f} s")
    return found, True


def _inputs_hash(name: Image, base_hash: str) -> str:
    return _pause_hash() if name is Image.PAUSE else _dockerfile_hash(recipes()[name], base_hash)


def inputs_hashes(names: Iterable[str]) -> dict[str, str]:
    """{name: the hash of its inputs}, as ensure_images labels the image it builds: one changes
    exactly when ensure_images would build that image again. Reads files only."""
    base_hash = _base_hash()
    return {str(name): _inputs_hash(Image(name), base_hash) for name in names}


def ensure_images(names: Iterable[str] = tuple(Image), progress: Progress = print) -> dict[str, ImageRef]:
    """Build (only what is missing or stale) and export each named image; {name: ImageRef}."""
    wanted = [Image(n) for n in names]  # ValueError names an unknown image
    lay = layout()
    out: dict[str, ImageRef] = {}
    with _lock(lay):
        _prepare(lay)
        base_hash = _base_hash()
        if Image.OPERATOR in wanted or Image.WORKLOAD in wanted:
            _ensure(lay, BASE_REF, base_hash, functools.partial(_build_base, lay, base_hash, progress),
                    "base", progress)
        for name in wanted:
            start = time.monotonic()
            inputs = _inputs_hash(name, base_hash)
            if name is Image.PAUSE:
                ref, build = PAUSE_REF, functools.partial(_build_pause, lay, inputs, progress)
            else:
                recipe = recipes()[name]
                ref, build = recipe.ref, functools.partial(_build_dockerfile, lay, recipe, inputs, progress)
            found, built = _ensure(lay, ref, inputs, build, name, progress)
            out[name] = _export(lay, name, ref, found, inputs, progress, built)
            verb = "built" if built else "cached"
            progress(f"{name}: {ref} {found.size_bytes / 1e6:.1f} MB, {verb}, {time.monotonic() - start:.1f} s")
        # A rebuilt image leaves its predecessor untagged (<none>): gigabytes per workload rebuild.
        buildah("rmi", "--prune", lay=lay, check=False)
    return out


def remove_storage(keep_downloads: bool = False) -> None:
    """Teardown: every image, container, archive and state file of this project's builder.
    `keep_downloads` keeps the downloads (torch wheelhouse, .debs, cache mounts) for the next build."""
    lay = layout()
    if not lay.root.exists():
        return
    with _lock(lay):
        if shutil.which("buildah") and lay.storage.exists():
            buildah("rm", "--all", lay=lay, check=False)
            buildah("rmi", "--all", "--force", lay=lay, check=False)
        _unmount_under(lay.root)
        keep = lay.tmp / "buildah-cache" if keep_downloads else None  # buildah 1.28: $TMPDIR/buildah-cache/<id>
        for child in lay.root.iterdir():
            if child.name == "lock" or (keep and child in (lay.tmp, lay.wheels, lay.debs)):
                continue
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
        if keep and lay.tmp.exists():
            for child in lay.tmp.iterdir():
                if child != keep:
                    shutil.rmtree(child, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    # buildah leaves the storage's overlay (and its runroot) mounted; rmtree cannot pass a mount.
    with open("/proc/self/mounts") as fh:
        points = [line.split()[1].replace("\\040", " ") for line in fh]
    for point in sorted((p for p in points if p == str(root) or p.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def run_in_image(ref: str, argv: list[str], user: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `argv` in a throwaway container of `ref` (no network), as the image's USER unless
    `user` says otherwise. For checks of what an image holds."""
    lay = layout()
    ctr = buildah("from", "--pull=never", ref, lay=lay).stdout.strip()
    try:
        extra = ["--user", user] if user else []
        return subprocess.run(_buildah_cmd(lay, "run", "--network=none", *extra, ctr, "--", *argv),
                              capture_output=True, text=True, env=_env(lay), timeout=timeout)
    finally:
        buildah("rm", ctr, lay=lay, check=False)


# --- containerd ------------------------------------------------------------------------

_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")


def _ctr(socket_path: str, namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [_require("ctr", "containerd"), "-a", str(socket_path), "-n", namespace, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ImageError(f"ctr -a {socket_path} -n {namespace} {' '.join(args)} failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-2000:]}; is containerd running on that socket?")
    return proc


def containerd_config_digest(ref: str, socket_path: str, namespace: str = "k8s.io") -> str | None:
    """The config digest of the image containerd holds as `ref` (None: it holds none)."""
    listing = _ctr(socket_path, namespace, "images", "ls", f"name=={ref}").stdout.splitlines()[1:]
    rows = [line.split() for line in listing if line.split() and line.split()[0] == ref]
    if not rows:
        return None
    digest = rows[0][2]
    for _ in range(2):  # an index, then the manifest it points at
        got = _ctr(socket_path, namespace, "content", "get", digest, check=False)
        if got.returncode != 0:
            return None  # a record without its content: import again
        doc = json.loads(got.stdout)
        if doc.get("mediaType") not in _INDEX_TYPES and "manifests" not in doc:
            return doc["config"]["digest"]
        digest = doc["manifests"][0]["digest"]
    return None


def load_into_containerd(image_ref: ImageRef, socket_path: str, namespace: str = "k8s.io") -> bool:
    """Import `image_ref`'s archive unless containerd already holds that image at that
    content hash. True when it imported."""
    previous = containerd_config_digest(image_ref.ref, socket_path, namespace)
    if previous == image_ref.config_digest:
        return False
    _ctr(socket_path, namespace, "images", "import", str(image_ref.archive))
    if previous:
        # The kubelet's CRI keeps an image record named by the old config digest; without it
        # removed, every rebuild leaves another 6 GB workload image in containerd. Content a
        # running container still uses stays (containerd's GC keeps what snapshots reference).
        _ctr(socket_path, namespace, "images", "rm", previous, check=False)
    now = containerd_config_digest(image_ref.ref, socket_path, namespace)
    if now != image_ref.config_digest:
        raise ImageError(f"imported {image_ref.archive}, but containerd lists {image_ref.ref} at config {now}, "
                         f"not {image_ref.config_digest}: the archive may be stale; rerun `tpuft images build`")
    return True


# --- command line ------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = sub.add_parser("build", help="build what is missing or stale (default: all three)")
    load = sub.add_parser("load", help="build, then import into a containerd (only what it lacks)")
    for p in (build, load):
        # `[]` among the choices: argparse checks an empty `*` positional against them too.
        p.add_argument("names", nargs="*", choices=[[], *map(str, Image)], default=[], metavar="IMAGE",
                       help=f"any of {', '.join(Image)} (default: all)")
    load.add_argument("--address", required=True, help="containerd socket, e.g. /run/tpuft/containerd.sock")
    load.add_argument("--namespace", default="k8s.io", help="containerd namespace (the kubelet's: k8s.io)")
    sub.add_parser("list", help="the images in the project's storage and their inputs hash")
    rm = sub.add_parser("rm", help="remove the builder's storage, archives and state")
    rm.add_argument("--keep-downloads", action="store_true", help="keep the downloaded wheels and .debs")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action in ("build", "load"):
            refs = ensure_images(args.names or list(Image), progress=say)
            for name, ref in refs.items():
                if args.action == "load":
                    done = load_into_containerd(ref, args.address, args.namespace)
                    say(f"{ref.ref}: {'imported' if done else 'already in containerd'}")
                print(f"{name:<9} {ref.ref:<52} {ref.size_bytes / 1e6:>8.1f} MB  {ref.image_id[:12]}  {ref.archive}")
        elif args.action == "list":
            for ref in (BASE_REF, PAUSE_REF, *(r.ref for r in recipes().values())):
                found = stored(ref)
                print(f"{ref:<52} " + (f"{found.size_bytes / 1e6:>8.1f} MB  {found.image_id[:12]}  "
                                       f"inputs {found.labels.get(INPUTS_LABEL, '?')[:12]}" if found else "not built"))
        elif args.action == "rm":
            remove_storage(keep_downloads=args.keep_downloads)
            say(f"removed {layout().root}" + (" (kept the downloads)" if args.keep_downloads else ""))
        return 0
    except ImageError as e:
        say(f"error: {e}")
        return 1
