"""The main job, end to end, exactly as a newcomer runs it: `tpuft demo` on examples/local-cpu.yaml.

Real control plane, the real operator process (`kopf run -m tpuft.handlers`), the local
KubeRay stand-in running a real local Ray, the real workload (Ray Core verification, Ray Train
FSDP2 fine-tuning on 2 CPU workers). The slowest test in the suite (a few minutes).
"""
import json
import os
import subprocess
import sys
from datetime import datetime

from tests.paths import EXAMPLES, REPO

PHASES_IN_ORDER = ["phase Provisioning", "phase VerifyingCollectives", "verification: passed",
                   "phase Training", "Epoch 1/3", "Epoch 3/3", "phase Succeeded"]


def test_demo_runs_the_cpu_example_to_succeeded(tmp_path):
    home, result, ckpt = tmp_path / "home", tmp_path / "result.json", tmp_path / "checkpoints"
    env = dict(os.environ, TPUFT_HOME=str(home), RAY_AUTH_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, "-m", "tpuft.cli", "demo", "--down", "--namespace", "e2e", "--timeout", "900",
         "--example", str(EXAMPLES / "local-cpu.yaml"), "--storage-path", str(ckpt), "--result", str(result)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    # The phases stream in order, as a person watching would see them.
    positions = [out.find(marker) for marker in PHASES_IN_ORDER]
    assert -1 not in positions and positions == sorted(positions), out[-6000:]

    final = json.loads(result.read_text())
    status = final["object"]["status"]
    assert status["phase"] == "Succeeded"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"SliceProvisioned": "True", "CollectivesVerified": "True",
                          "TrainingSucceeded": "True", "Ready": "True", "Failed": "False"}
    assert status["verification"]["passed"] is True
    assert status["verification"]["allReduceSum"] == status["verification"]["expectedSum"] == 3

    losses = final["epochLosses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses

    training = status["training"]
    checkpoint, export = training["lastCheckpoint"], training["exportedModel"]
    assert checkpoint.startswith(str(ckpt)) and os.path.isdir(checkpoint)
    assert os.path.isfile(os.path.join(export, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(export))
    assert "control plane stopped" in out


def test_demo_tpu_example_without_capacity_fails_fast_with_a_reason(tmp_path):
    """The stand-in has no TPU to give: the v6e slice never provisions. The run must end
    Failed/ProvisioningTimeout at the configured bound, not sit in Provisioning forever."""
    result = tmp_path / "result.json"
    env = dict(os.environ, TPUFT_HOME=str(tmp_path / "home"), RAY_AUTH_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, "-m", "tpuft.cli", "demo", "--down", "--namespace", "e2e-tpu",
         "--example", str(EXAMPLES / "v6e-4x4.yaml"), "--provisioning-timeout", "15", "--timeout", "300",
         "--result", str(result)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    status = json.loads(result.read_text())["object"]["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "ProvisioningTimeout")
    assert "0/4 worker hosts ready" in status["message"] and "tpu-v6e-slice" in status["message"]
    provisioned = next(c for c in status["conditions"] if c["type"] == "SliceProvisioned")
    assert provisioned["status"] == "False"
    took = _seconds(status["completionTime"]) - _seconds(status["startTime"])
    assert 15 <= took <= 15 + 10, took  # the configured bound plus a small margin
    assert "Failed: ProvisioningTimeout" in out


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
