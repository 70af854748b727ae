"""Our operator on the local cluster, installed the way users install it: `helm install` of
charts/tpufinetune-operator with its default values (the image it names was built from
Dockerfile.operator and imported into the node's containerd, so nothing is pulled), but for a
nodeSelector that pins it to the real node: the simulated (KWOK) nodes report any pod Running and
Ready without running it, and the scheduler picks one when the real node is briefly tainted (disk
pressure while a 6 GB image is imported), which leaves an operator that never reconciles."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tpuft_local.node import NODE_NAME
from tpuft_local.toolchain import tool_path

CHART = Path(__file__).resolve().parents[2] / "charts" / "tpufinetune-operator"
RELEASE = "tpufinetune-operator"
NAMESPACE = "tpufinetune-system"


class ChartError(RuntimeError):
    """helm failed or the operator pod did not become Ready; the message has the pod's state."""


def helm(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = cluster.cp.env()
    res = subprocess.run([tool_path("helm"), f"--kubeconfig={cluster.kubeconfig}", *args], capture_output=True,
                         text=True, env=env, timeout=300)
    if check and res.returncode != 0:
        raise ChartError(f"`helm {' '.join(args)}` failed: {res.stderr.strip() or res.stdout.strip()}")
    return res


def install(cluster, restart: bool = False, timeout: float = 240) -> None:
    """helm upgrade --install (idempotent), then wait until the operator pod is Ready.
    restart: a new image was imported under the same tag; roll the Deployment onto it."""
    helm(cluster, "upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
         "--set-json", "nodeSelector=" + json.dumps({"kubernetes.io/hostname": NODE_NAME}))
    if restart:
        cluster.cp.kubectl("rollout", "restart", f"deployment/{RELEASE}", "-n", NAMESPACE, check=True)
        cluster.cp.kubectl("rollout", "status", f"deployment/{RELEASE}", "-n", NAMESPACE, f"--timeout={int(timeout)}s")
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        pods = _pods(cluster)
        if any(_ready(p) for p in pods) and not any(p["metadata"].get("deletionTimestamp") for p in pods):
            return
        last = "; ".join(_describe(p) for p in pods) or "no pod yet"
        time.sleep(1)
    raise ChartError(f"the operator pod in {NAMESPACE} is not Ready after {timeout:.0f} s: {last}")


def describe(cluster) -> str:
    """One line for `tpuft cluster status`: the operator's pods and whether they are Ready."""
    pods = _pods(cluster)
    if not pods:
        return "not installed (helm)"
    return "; ".join(("pod " + _describe(p) + (" Ready" if _ready(p) else " NOT Ready")) for p in pods)


def _pods(cluster) -> list[dict]:
    res = cluster.cp.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "json")
    return json.loads(res.stdout).get("items", []) if res.returncode == 0 else []


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


def _describe(pod: dict) -> str:
    states = []
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        state = cs.get("state", {})
        waiting, term = state.get("waiting"), state.get("terminated") or cs.get("lastState", {}).get("terminated")
        if waiting:
            states.append(f"{waiting.get('reason')}: {waiting.get('message', '')}")
        elif term:
            states.append(f"terminated {term.get('reason')}: {term.get('message', '')}")
    return f"{pod['metadata']['name']} {pod.get('status', {}).get('phase')} {' '.join(states)}".strip()
