"""The main job, end to end, exactly as a newcomer runs it: `tpuft demo` on examples/local-cpu.yaml,
on the real local cluster: our operator (its image, from the chart) creates the RayCluster, the
real KubeRay creates the pods and submits both RayJobs, the kubelet runs them on containerd, the
real workload verifies the collectives and fine-tunes. Run twice in a row, as a user trying it
again would: the second run is a new object and must train from step 0 (issue 19).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster_fixtures import clear_namespace
from tests.paths import EXAMPLES, REPO

PHASES_IN_ORDER = ["phase Provisioning", "phase VerifyingCollectives", "verification: passed",
                   "phase Training", "Epoch 1/3", "Epoch 3/3", "phase Succeeded"]


@pytest.fixture(autouse=True)
def _clear_demo_namespace(cluster_kubectl):
    """The demo leaves its object for the user to inspect; the next test needs the hosts free."""
    yield
    clear_namespace(cluster_kubectl, "e2e")


def _demo(tmp_path: Path, tag: str, *extra: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, dict]:
    result = tmp_path / f"result-{tag}.json"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "tpuft.cli", "demo", "--namespace", "e2e", "--result", str(result),
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(result.read_text()) if result.exists() else {})


def _check_succeeded(proc, final, storage: Path) -> list[float]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    positions = [out.find(marker) for marker in PHASES_IN_ORDER]
    assert -1 not in positions and positions == sorted(positions), out[-6000:]
    status = final["object"]["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"SliceProvisioned": "True", "CollectivesVerified": "True",
                          "TrainingSucceeded": "True", "Ready": "True", "Failed": "False"}
    assert status["verification"]["passed"] is True
    assert status["verification"]["allReduceSum"] == status["verification"]["expectedSum"] == 3
    # KubeRay's pods ran on the real node (not a simulated host).
    assert final["placement"] and all(not p["simulated"] for p in final["placement"].values()), final["placement"]
    losses = final["epochLosses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    training = status["training"]
    # The pods wrote through the hostPath volume: the host sees the run's files.
    checkpoint, export = training["lastCheckpoint"], training["exportedModel"]
    assert checkpoint.startswith(str(storage)) and os.path.isdir(checkpoint)
    assert os.path.isfile(os.path.join(export, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(export))
    return losses


def test_demo_runs_twice_and_each_run_trains(local_cluster, tmp_path):
    storage = tmp_path / "checkpoints"
    first, final1 = _demo(tmp_path, "1", "--storage-path", str(storage))
    _check_succeeded(first, final1, storage)
    run1 = Path(final1["object"]["status"]["training"]["lastCheckpoint"]).parent
    before = {p: p.stat().st_mtime_ns for p in run1.rglob("*") if p.is_file()}

    second, final2 = _demo(tmp_path, "2", "--storage-path", str(storage))
    _check_succeeded(second, final2, storage)
    run2 = Path(final2["object"]["status"]["training"]["lastCheckpoint"]).parent
    assert run2 != run1 and final2["object"]["metadata"]["uid"] != final1["object"]["metadata"]["uid"]
    assert "Epoch 1/3" in second.stdout  # trained from step 0, not "resumed" at the end
    assert {p: p.stat().st_mtime_ns for p in run1.rglob("*") if p.is_file()} == before  # first run untouched


def test_rehearse_tpu_places_the_slice_on_simulated_hosts_and_says_so(local_cluster, tmp_path):
    proc, final = _demo(tmp_path, "rehearse", "--rehearse-tpu", "--example", str(EXAMPLES / "v6e-4x4.yaml"),
                        timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "phase VerifyingCollectives" in out, out[-4000:]
    workers = {k: v for k, v in final["placement"].items() if "worker" in k}
    assert len(workers) == 4 and all(v["simulated"] for v in workers.values()), final["placement"]
    assert "SIMULATED" in out
    assert final["object"]["status"]["reason"] in ("CollectiveTimeout", "VerificationFailed")
