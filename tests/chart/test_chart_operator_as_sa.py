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

Along the way, charts/tpufinetune-operator/argocd/health.lua is run on the live objects.
With TPUFT_CAPTURE_ARGOCD_FIXTURES=DIR set, each of those objects is also written to
DIR/reconcile-<case>.yaml in the fixture format of tests/chart/fixtures/argocd/ (that is how
the reconcile-*.yaml fixtures there were made).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.chart.helmlib import CHART, run_health
from tests.images.dockerfile_lib import REPO, operator_image_venv, parse

pytest.importorskip("tpuft.controller.handlers", reason="the operator's handlers are not in this checkout yet")
from tests.factories import small_object  # noqa: E402
from tests.kuberay_standin import KubeRay  # noqa: E402
from tests.waiting import wait_until  # noqa: E402
from tpuft_local.controlplane import free_port  # noqa: E402

pytestmark = pytest.mark.integration  # the real local control plane (tests/conftest.py)

NAME = "ft"
# Every RBAC denial says "forbidden" (API server: "... is forbidden: User ...", kopf: APIForbiddenError);
# a bare "403" would also match ports and log timestamps.
PERMISSION_ERRORS = re.compile(r"[Ff]orbidden|Not enough permissions")






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
ARGO_HEALTH = {"Pending": "Progressing", "Provisioning": "Progressing", "VerifyingCollectives": "Progressing",
               "Training": "Progressing", "Succeeded": "Healthy", "Failed": "Degraded", "Suspended": "Suspended"}


class OperatorRun:
    """The operator process started from the chart's Deployment, plus helpers for one TPUFinetune."""

    def __init__(self, kubectl, kube_api, team: str, log_path: Path):
        self.kubectl, self.team, self.log_path = kubectl, team, log_path
        self.kuberay = KubeRay(kube_api, team)
        self.proc: subprocess.Popen | None = None
        self.port = self.metrics_port = 0

    def healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def apply(self, name: str = NAME, **spec) -> None:
        body = small_object(name, self.team, **spec)
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=True)

    def patch(self, spec: dict) -> None:
        self.kubectl("patch", "tft", NAME, "-n", self.team, "--type=merge", "-p", json.dumps({"spec": spec}),
                     check=True)

    def get(self, name: str = NAME) -> dict:
        return json.loads(self.kubectl("get", "tft", name, "-n", self.team, "-o", "json", check=True).stdout)

    def status(self) -> dict:
        return self.get().get("status") or {}

    def wait_phase(self, phase: str, timeout: float = 45) -> dict:
        try:
            return wait_until(lambda: self.status().get("phase") == phase and self.status(), timeout, f"phase {phase}")
        except AssertionError:
            raise AssertionError(f"phase {phase} not reached; status: {json.dumps(self.status(), indent=1)}\n"
                                 f"operator log:\n{self.log_path.read_text()[-4000:]}")

    def argo_health(self, case: str, health: str, name: str = NAME) -> dict:
        """Run the Argo CD health check on the live object; optionally capture it as a fixture."""
        obj = self.get(name)
        hs = run_health(obj)
        assert hs["status"] == health, (hs, obj.get("status"))
        capture_fixture(case, obj, hs)
        return hs


def capture_fixture(case: str, obj: dict, hs: dict) -> None:
    where = os.environ.get("TPUFT_CAPTURE_ARGOCD_FIXTURES")
    if not where:
        return
    obj = json.loads(json.dumps(obj))
    meta = obj["metadata"]
    for volatile in ("managedFields", "resourceVersion", "uid", "creationTimestamp", "annotations"):
        meta.pop(volatile, None)
    meta["namespace"] = "ml-team"
    header = ("# Captured from a real reconcile run (tests/chart/test_chart_operator_as_sa.py with\n"
              "# TPUFT_CAPTURE_ARGOCD_FIXTURES set): the operator, KubeRay played by tests/kuberay_standin.py.\n")
    doc = {"expect": {"health": hs["status"], "message": hs["message"]}, "object": obj}
    Path(where, f"reconcile-{case}.yaml").write_text(header + yaml.safe_dump(doc, sort_keys=False, width=120))


@pytest.fixture
def operator_as_chart_sa(helm_cli, kubectl, kubeconfig, kube_api, namespace, extra_namespace, tmp_path):
    """operator_as_chart_sa(mode) -> context manager yielding a running OperatorRun."""
    venv, _ = operator_image_venv()

    @contextlib.contextmanager
    def start(mode: str):
        team = extra_namespace("team")
        release = f"op-{namespace[-6:]}"
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(MODES[mode](team)))
        helm_cli("install", release, str(CHART), "--namespace", namespace, "--values", str(tmp_path / "values.yaml"))
        run = OperatorRun(kubectl, kube_api, team, tmp_path / "operator.log")
        try:
            fullname = f"{release}-tpufinetune-operator"
            deployment = json.loads(kubectl("get", "deployment", fullname, "-n", namespace, "-o", "json",
                                            check=True).stdout)
            (container,) = deployment["spec"]["template"]["spec"]["containers"]
            assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"healthz": 8080, "metrics": 9090}
            run.port, run.metrics_port = free_port(), free_port()
            cmd, deploy_env = _container_command(venv / "bin" / "python", deployment, run.port)
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("KUBE", "TPUFT_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(deploy_env)
            env.update({
                "KUBECONFIG": _sa_kubeconfig(kubectl, kubeconfig, namespace, fullname, tmp_path / "sa.kubeconfig"),
                "TPUFT_METRICS_PORT": str(run.metrics_port),   # the chart's 9090 may be taken on this machine
                "TPUFT_RESYNC_SECONDS": "1",
                "TPUFT_VERIFY_GRACE_SECONDS": "1",
                "PYTHONDONTWRITEBYTECODE": "1",     # as the image's ENV
                "HOME": str(tmp_path / "nonexistent"),  # as the image's user: no home directory
            })
            # readOnlyRootFilesystem stand-in: the process must write nothing into its install tree
            # or HOME (the chart gives it only an emptyDir at /tmp).
            installed_before = _tree(venv)
            with open(run.log_path, "w") as log:
                run.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
            wait_until(run.healthy, 60, "the operator's /healthz")
            yield run
        finally:
            stop(run)
            kubectl("delete", "tft", "--all", "-n", team, "--ignore-not-found", "--wait=false")
            helm_cli("uninstall", release, "--namespace", namespace, check=False)
        assert _tree(venv) == installed_before, "the operator wrote into its install tree"
        assert not (tmp_path / "nonexistent").exists(), "the operator created its HOME"
        log = run.log_path.read_text()
        # (A cluster-wide operator may also meet objects left by earlier tests in namespaces being
        # deleted; the API server answers those creates 403 "is being terminated": not RBAC.)
        # A log record may span lines (an ApiException prints its reason, headers and body on
        # several): each record is judged whole.
        records = re.split(r"\n(?=\[\d{4}-\d\d-\d\d )", log)
        bad = [record for record in records
               if PERMISSION_ERRORS.search(record) and "being terminated" not in record]
        assert not bad, "permission errors in the operator log:\n" + "\n".join(bad)

    return start


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def stop(run: OperatorRun) -> None:
    proc = run.proc
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", MODES)
def test_operator_runs_a_tpufinetune_to_succeeded_as_the_chart_sa(mode, operator_as_chart_sa, kubectl):
    with operator_as_chart_sa(mode) as run:
        team = run.team
        run.apply(ttlSecondsAfterFinished=1)
        run.wait_phase("Provisioning")
        run.argo_health("provisioning", "Progressing")
        # The operator (as the chart SA) created the per-CR workload identity.
        for kind in ("serviceaccount", "role", "rolebinding"):
            assert kubectl("get", kind, f"{NAME}-workload", "-n", team).returncode == 0, kind
        run.kuberay.cluster_ready(f"{NAME}-ray")
        run.wait_phase("VerifyingCollectives")
        run.kuberay.job_running(f"{NAME}-verify")
        run.argo_health("verifying-collectives", "Progressing")
        run.kuberay.job_succeeded(f"{NAME}-verify")
        run.wait_phase("Training")
        run.kuberay.job_running(f"{NAME}-train")
        time.sleep(1)  # a running job changes nothing the operator writes (one status write per phase change)
        run.argo_health("training", "Progressing")
        run.kuberay.job_succeeded(f"{NAME}-train")
        st = run.wait_phase("Succeeded")
        assert st["observedGeneration"] == 1
        run.argo_health("succeeded", "Healthy")
        # ttlSecondsAfterFinished: the operator deleted the RayCluster (its `delete` verb).
        wait_until(lambda: kubectl("get", "raycluster", f"{NAME}-ray", "-n", team).returncode != 0, 30,
                   "the RayCluster's TTL deletion")
        events = json.loads(kubectl("get", "events", "-n", team, "-o", "json",
                                    f"--field-selector=involvedObject.name={NAME}", check=True).stdout)["items"]
        assert events, "the operator posted no Events"
        assert run.healthy()
        # What the chart's ServiceMonitor scrapes: /metrics on the metrics port.
        text = run.metrics()
        assert 'tpuft_objects{phase="Succeeded"} 1.0' in text, text[:2000]
        assert "tpuft_status_writes_total" in text


def test_argocd_health_on_live_suspend_failure_and_generation_lag(operator_as_chart_sa):
    with operator_as_chart_sa("namespaced") as run:
        run.apply()
        run.wait_phase("Provisioning")
        run.kuberay.cluster_ready(f"{NAME}-ray")
        run.wait_phase("VerifyingCollectives")
        run.patch({"suspend": True})
        run.wait_phase("Suspended")
        wait_until(lambda: run.status().get("observedGeneration") == run.get()["metadata"]["generation"],
                   what="the operator to observe the suspend")
        run.argo_health("suspended", "Suspended")
        run.patch({"suspend": False})
        run.wait_phase("Provisioning")
        time.sleep(1.5)
        run.kuberay.cluster_ready(f"{NAME}-ray")
        run.wait_phase("VerifyingCollectives")
        run.kuberay.job_running(f"{NAME}-verify")
        run.kuberay.job_failed(f"{NAME}-verify", "all_reduce sum 120 != expected 136")
        st = run.wait_phase("Failed")
        hs = run.argo_health("failed", "Degraded")
        failed = next(c for c in st["conditions"] if c["type"] == "Failed")
        assert failed["status"] == "True" and hs["message"] == failed["message"]
        # The operator stops; Git changes the spec: status now describes an older generation.
        stop(run)
        run.patch({"training": {"epochs": 5}})
        obj = run.get()
        assert obj["metadata"]["generation"] > obj["status"]["observedGeneration"]
        hs = run.argo_health("generation-lag", "Progressing")
        assert "observe generation" in hs["message"]
        # A new object the (stopped) operator has not seen: no status at all.
        run.apply(name=f"{NAME}-new")
        assert "status" not in run.get(f"{NAME}-new")
        run.argo_health("missing-status", "Progressing", name=f"{NAME}-new")
