"""The operator, run exactly as the chart's container would run it, authenticated as the
chart's ServiceAccount, against the real local control plane.

No kubelet runs, so the Deployment's pod never starts; this test runs its process here
instead: the image's ENTRYPOINT (parsed from Dockerfile.operator, liveness moved to a free
loopback port) in the image's Python environment (the wheel of the build context installed
with no extras into a fresh venv, tests/images/dockerfile_lib.operator_image_venv), the
Deployment's args and env as the API server stored them, and a kubeconfig holding a token
of the chart's ServiceAccount (TokenRequest). KubeRay's part is
played by tests/kuberay_standin.py. A full run to Succeeded under those credentials shows
the chart's RBAC is enough; a log without any 403 shows kopf found nothing missing either.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.chart.helmlib import CHART
from tests.images.dockerfile_lib import REPO, operator_image_venv, parse

pytest.importorskip("tpuft.handlers", reason="the operator's handlers are not in this checkout yet")
from tests.kuberay_standin import KubeRay  # noqa: E402

pytestmark = pytest.mark.integration  # the real local control plane (tests/conftest.py)

NAME = "ft"
PERMISSION_ERRORS = ("403", "Forbidden", "forbidden", "Not enough permissions")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout=45.0, what="condition", interval=0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)


def _sa_kubeconfig(kubectl, admin_kubeconfig: str, ns: str, sa: str, path) -> str:
    token = kubectl("create", "token", sa, "-n", ns, "--duration=3600s", check=True).stdout.strip()
    cfg = yaml.safe_load(open(admin_kubeconfig).read())
    ctx = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])
    cluster = next(c for c in cfg["clusters"] if c["name"] == ctx["context"]["cluster"])
    out = {
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [cluster],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": sa}}],
    }
    path.write_text(yaml.safe_dump(out))
    return str(path)


def _container_command(python: Path, deployment: dict, liveness_port: int) -> tuple[list[str], dict[str, str]]:
    entrypoint = parse(REPO / "Dockerfile.operator").final.all("ENTRYPOINT")[-1].json_args
    assert entrypoint[0] == "kopf"
    entrypoint = [a.replace("http://0.0.0.0:8080/", f"http://127.0.0.1:{liveness_port}/") for a in entrypoint]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return [str(python), "-m", "kopf", *entrypoint[1:], *container["args"]], env


MODES = {
    "namespaced": lambda team: {"watchNamespaces": [team]},
    "cluster-wide": lambda team: {},
}


@pytest.mark.parametrize("mode", MODES)
def test_operator_runs_a_tpufinetune_to_succeeded_as_the_chart_sa(
        mode, helm_cli, kubectl, kubeconfig, kube_api, namespace, extra_namespace, tmp_path, tmp_path_factory):
    venv, _ = operator_image_venv(tmp_path_factory.getbasetemp())
    team = extra_namespace("team")
    release = f"op-{namespace[-6:]}"
    values = MODES[mode](team)
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    helm_cli("install", release, str(CHART), "--namespace", namespace, "--values", str(tmp_path / "values.yaml"))
    proc = None
    log_path = tmp_path / "operator.log"
    try:
        fullname = f"{release}-tpufinetune-operator"
        deployment = json.loads(kubectl("get", "deployment", fullname, "-n", namespace, "-o", "json", check=True).stdout)
        port, metrics_port = _free_port(), _free_port()
        ports = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert ports == {"healthz": 8080, "metrics": 9090}
        cmd, deploy_env = _container_command(venv / "bin" / "python", deployment, port)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KUBE", "TPUFT_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(deploy_env)
        env.update({
            "KUBECONFIG": _sa_kubeconfig(kubectl, kubeconfig, namespace, fullname, tmp_path / "sa.kubeconfig"),
            "TPUFT_METRICS_PORT": str(metrics_port),   # the chart's 9090 may be taken on this machine
            "TPUFT_RESYNC_SECONDS": "1",
            "TPUFT_VERIFY_GRACE_SECONDS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        })
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)

        def healthy():
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, 60, "the operator's /healthz")

        body = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFinetune",
                "metadata": {"name": NAME, "namespace": team},
                "spec": {"accelerator": "v6e", "topology": "4x4", "image": "img:1", "model": "m",
                         "dataset": {"name": "d"}, "checkpoint": {"storagePath": "gs://bucket/ck"},
                         "ttlSecondsAfterFinished": 1}}
        kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=True)

        def status():
            out = kubectl("get", "tft", NAME, "-n", team, "-o", "json", check=True).stdout
            return json.loads(out).get("status") or {}

        def wait_phase(phase):
            try:
                return wait_until(lambda: status().get("phase") == phase and status(), 45, f"phase {phase}")
            except AssertionError:
                raise AssertionError(f"phase {phase} not reached; status: {json.dumps(status(), indent=1)}\n"
                                     f"operator log:\n{log_path.read_text()[-4000:]}")

        kuberay = KubeRay(kube_api, team)
        wait_phase("Provisioning")
        # The operator (as the chart SA) created the per-CR workload identity.
        for kind in ("serviceaccount", "role", "rolebinding"):
            assert kubectl("get", kind, f"{NAME}-workload", "-n", team).returncode == 0, kind
        kuberay.cluster_ready(f"{NAME}-ray")
        wait_phase("VerifyingCollectives")
        kuberay.job_running(f"{NAME}-verify")
        kuberay.job_succeeded(f"{NAME}-verify")
        wait_phase("Training")
        kuberay.job_running(f"{NAME}-train")
        kuberay.job_succeeded(f"{NAME}-train")
        st = wait_phase("Succeeded")
        assert st["observedGeneration"] == 1
        # ttlSecondsAfterFinished: the operator deleted the RayCluster (its `delete` verb).
        wait_until(lambda: kubectl("get", "raycluster", f"{NAME}-ray", "-n", team).returncode != 0, 30,
                   "the RayCluster's TTL deletion")
        events = json.loads(kubectl("get", "events", "-n", team, "-o", "json",
                                    f"--field-selector=involvedObject.name={NAME}", check=True).stdout)["items"]
        assert events, "the operator posted no Events"
        assert healthy()
        # What the chart's ServiceMonitor scrapes: /metrics on the metrics port.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'tpuft_objects{phase="Succeeded"} 1.0' in text, text[:2000]
        assert "tpuft_status_writes_total" in text
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kubectl("delete", "tft", NAME, "-n", team, "--ignore-not-found", "--wait=false")
        helm_cli("uninstall", release, "--namespace", namespace, check=False)
    log = log_path.read_text()
    bad = [line for line in log.splitlines() if any(p in line for p in PERMISSION_ERRORS)]
    assert not bad, "permission errors in the operator log:\n" + "\n".join(bad)
