"""Argo CD on the local cluster (`tpuft cluster up --argocd`), as data, and the git repository it syncs.

Argo CD's application controller and repo server (hack/argocd, built from the Go module proxy by
tpuft_local.toolchain) run as host processes like KubeRay's operator, with Redis from Debian for
their cache: no API server, UI, Dex or ApplicationSet controller, so Applications are objects you
apply and read with kubectl. Argo CD's own CRDs and the controller's ClusterRole come from the
module it is built from; `argocd-cm` carries our TPUFinetune health check exactly as the chart's
argocd/README.md tells users to install it. The controller reaches the cluster through a kubeconfig
(ARGOCD_FAKE_IN_CLUSTER: Argo CD's switch for running its in-cluster destination from outside a pod).

The git repository is a bare repo under the state dir, served read-only by `git daemon` on
loopback (git://127.0.0.1:PORT/tpuft.git); `publish` commits to it from a scratch clone.
"""
from __future__ import annotations

import contextlib
import fcntl
import socket
import subprocess
import tempfile
from pathlib import Path

import yaml

NAMESPACE = "argocd"
USER = "tpuft:argocd-application-controller"
PACKAGES = {"redis-server": "/usr/bin/redis-server"}   # Debian package -> a file it installs
HEALTH_KEY = "resource.customizations.health.tpufinetune.dev_TPUFinetune"   # chart's argocd/README.md
HEALTH_LUA = Path(__file__).resolve().parents[2] / "charts" / "tpufinetune-operator" / "argocd" / "health.lua"
# How often Argo CD looks at git and re-compares (its default is 120 s, plus up to 60 s of jitter):
# a commit shows within this. In argocd-cm, and in the environment variables Argo CD's own
# manifests fill from those keys for the controller and the repo server (ENV_FROM_CM).
RECONCILIATION = {"timeout.reconciliation": "15s", "timeout.reconciliation.jitter": "0s"}
ENV_FROM_CM = {"ARGOCD_RECONCILIATION_TIMEOUT": "timeout.reconciliation",
               "ARGOCD_RECONCILIATION_JITTER": "timeout.reconciliation.jitter"}
REPO_NAME = "tpuft.git"
VERIFY_WRAPPER = "git-verify-wrapper.sh"   # in argo-cd's hack/, on PATH in its image
IN_CLUSTER = "https://kubernetes.default.svc"   # Argo CD's name for the cluster it runs in
MANAGED = {"app.kubernetes.io/managed-by": "tpuft-local"}
GIT = ["git", "-c", "user.name=tpuft", "-c", "user.email=tpuft@localhost", "-c", "init.defaultBranch=main"]


def crd_files(manifests: Path) -> list[Path]:
    """Application and AppProject (ApplicationSet's controller is not run)."""
    return [manifests / "crds" / "application-crd.yaml", manifests / "crds" / "appproject-crd.yaml"]


def rbac(manifests: Path) -> list[dict]:
    """Argo CD's own ClusterRole for its application controller (it applies whatever git holds),
    bound to the controller's user. The repo server reads git only and gets no API access."""
    role = yaml.safe_load((manifests / "cluster-rbac" / "application-controller" /
                           "argocd-application-controller-clusterrole.yaml").read_text())
    name = role["metadata"]["name"]
    return [{**role, "metadata": {**role["metadata"], "labels": {**role["metadata"].get("labels", {}), **MANAGED}}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name, "labels": MANAGED},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}]}]


def config(manifests: Path, health_lua: str) -> list[dict]:
    """The namespace, Argo CD's argocd-cm (its base manifest plus our health check and a short
    reconciliation period) and argocd-secret, and the `default` AppProject Argo CD's API server
    would create (it is not run)."""
    base = manifests / "base" / "config"
    cm = yaml.safe_load((base / "argocd-cm.yaml").read_text())
    cm["metadata"].update(namespace=NAMESPACE)
    cm["data"] = {**(cm.get("data") or {}), HEALTH_KEY: health_lua, **RECONCILIATION}
    secret = yaml.safe_load((base / "argocd-secret.yaml").read_text())
    secret["metadata"].update(namespace=NAMESPACE)
    project = {"apiVersion": "argoproj.io/v1alpha1", "kind": "AppProject",
               "metadata": {"name": "default", "namespace": NAMESPACE, "labels": MANAGED},
               "spec": {"sourceRepos": ["*"], "destinations": [{"server": "*", "namespace": "*"}],
                        "clusterResourceWhitelist": [{"group": "*", "kind": "*"}]}}
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": MANAGED}},
            cm, secret, project]


def component_env() -> dict[str, str]:
    """What Argo CD's manifests give both components from argocd-cm."""
    return {var: RECONCILIATION[key] for var, key in ENV_FROM_CM.items()}


def redis_config(workdir: Path, port: int) -> str:
    """Redis for Argo CD's cache: loopback only, nothing persisted; its process keeps its argv
    (set-proc-title no) so `down` finds it by the config path under the state dir."""
    return (f"bind 127.0.0.1\nport {port}\nprotected-mode yes\ndir {workdir}\nsave \"\"\nappendonly no\n"
            "set-proc-title no\nlogfile \"\"\n")


def redis_ok(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


def tcp_ok(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return True


def git_daemon_argv(base: Path, port: int) -> list[str]:
    """`git daemon` serving the repositories under `base`, read-only, on loopback: git's own
    git-daemon program (`git daemon` would run it as a child, a second process to stop)."""
    exec_path = subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True).stdout.strip()
    return [str(Path(exec_path) / "git-daemon"), "--export-all", f"--base-path={base}", "--listen=127.0.0.1", f"--port={port}",
            "--reuseaddr", str(base)]


def init_repo(base: Path) -> Path:
    """The bare repository (idempotent), with a first commit so a branch exists to point at."""
    repo = base / REPO_NAME
    if not (repo / "HEAD").exists():
        base.mkdir(parents=True, exist_ok=True)
        subprocess.run([*GIT, "init", "-q", "--bare", str(repo)], check=True, capture_output=True)
        publish(repo, {"README.md": "TPUFinetune objects synced by the local Argo CD.\n"}, "first commit")
    return repo


def publish(repo: Path, files: dict[str, str | None], message: str) -> str:
    """Commit `files` (path -> text; None deletes it) to `repo`'s main branch; returns the commit.
    One publisher at a time (two test lanes share the repository), so every push fast-forwards."""
    with _locked(repo / "tpuft-publish.lock"), tempfile.TemporaryDirectory(prefix="tpuft-git-") as tmp:
        work = Path(tmp) / "work"
        subprocess.run([*GIT, "clone", "-q", str(repo), str(work)], check=True, capture_output=True)
        subprocess.run([*GIT, "checkout", "-q", "-B", "main"], cwd=work, check=True, capture_output=True)
        for rel, text in files.items():
            path = work / rel
            if text is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        subprocess.run([*GIT, "add", "-A"], cwd=work, check=True, capture_output=True)
        subprocess.run([*GIT, "commit", "-q", "--allow-empty", "-m", message], cwd=work, check=True, capture_output=True)
        subprocess.run([*GIT, "push", "-q", "origin", "main"], cwd=work, check=True, capture_output=True)
        return subprocess.run([*GIT, "rev-parse", "HEAD"], cwd=work, check=True, capture_output=True,
                              text=True).stdout.strip()


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def repo_url(port: int) -> str:
    return f"git://127.0.0.1:{port}/{REPO_NAME}"


def application(name: str, url: str, path: str, namespace: str, *, prune: bool = True) -> dict:
    """An Application syncing folder `path` of the repo into `namespace`: automated sync (self-heal,
    prune), server-side apply, as charts/tpufinetune-operator/argocd/README.md advises; a failed sync
    retried on the newest commit (retry.refresh), so a fix pushed to git is what the retry applies."""
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"project": "default",
                     "source": {"repoURL": url, "targetRevision": "main", "path": path},
                     "destination": {"server": IN_CLUSTER, "namespace": namespace},
                     "syncPolicy": {"automated": {"prune": prune, "selfHeal": True},
                                    "syncOptions": ["ServerSideApply=true"],
                                    "retry": {"limit": 5, "refresh": True,
                                              "backoff": {"duration": "5s", "factor": 2, "maxDuration": "1m"}}}}}


def summary(app: dict) -> dict:
    """Argo CD's own view of an Application: its sync and health, and each resource's."""
    status = app.get("status") or {}
    op = status.get("operationState") or {}
    return {"sync": (status.get("sync") or {}).get("status"), "health": (status.get("health") or {}).get("status"),
            "revision": (status.get("sync") or {}).get("revision"),
            "operation": op.get("phase"), "operationMessage": op.get("message"),
            "conditions": [c.get("message") for c in status.get("conditions") or []],
            "resources": {f"{r.get('kind')}/{r.get('name')}": {"sync": r.get("status"),
                                                               "health": (r.get("health") or {}).get("status"),
                                                               "message": (r.get("health") or {}).get("message")}
                          for r in status.get("resources") or []}}
