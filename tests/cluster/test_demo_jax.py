"""`tpuft demo` on examples/local-cpu-jax.yaml (training.framework: jax) on the real local cluster:
the same flow as tests/cluster/test_demo.py, with JaxTrainer's 2 CPU workers training, Orbax
checkpoints on the hostPath volume, and the Hugging Face export served unchanged (spec.serve: the
RayService answers the demo's chat with the JAX-trained model) and loading in transformers. Needs
the workload image rebuilt with the jax extra (Dockerfile.workload installs it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster_fixtures import clear_namespace
from tests.paths import EXAMPLES, REPO

PHASES_IN_ORDER = ["phase Provisioning", "phase VerifyingCollectives", "verification: passed",
                   "phase Training", "Epoch 1/3", "Epoch 3/3", "phase Serving", "tpuft chat", "  user:"]


@pytest.fixture(autouse=True)
def _clear_demo_namespace(cluster_kubectl):
    yield
    clear_namespace(cluster_kubectl, "e2e-jax")


@pytest.mark.timeout(1800)
def test_jax_demo_trains_checkpoints_with_orbax_and_serves_the_export(local_cluster, tmp_path):
    storage, result = tmp_path / "checkpoints", tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "tpuft.cli", "demo", "--namespace", "e2e-jax", "--result", str(result),
                           "--example", str(EXAMPLES / "local-cpu-jax.yaml"), "--storage-path", str(storage)],
                          cwd=REPO, env=dict(os.environ, RAY_AUTH_MODE="disabled"), capture_output=True, text=True,
                          timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    positions = [out.find(marker) for marker in PHASES_IN_ORDER]
    assert -1 not in positions and positions == sorted(positions), out[-6000:]
    final = json.loads(result.read_text())
    assert final["object"]["spec"]["training"]["framework"] == "jax"
    status = final["object"]["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["TrainingSucceeded"] == conditions["Serving"] == "True"
    assert status["phase"] == "Serving" and status["serving"]["modelSource"] == status["training"]["exportedModel"]
    assert final["chat"]["answer"].strip(), final["chat"]
    losses = final["epochLosses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    checkpoint, export = Path(status["training"]["lastCheckpoint"]), status["training"]["exportedModel"]
    assert checkpoint.is_relative_to(storage) and (checkpoint / "state").is_dir() and (checkpoint / "COMMITTED").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export)
    ids = tok("### Instruction:\nTell me about the cow.\n\n### Response:\n", return_tensors="pt")["input_ids"]
    assert model.generate(input_ids=ids, max_new_tokens=8, do_sample=False).shape[1] > ids.shape[1]
