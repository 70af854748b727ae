"""The main job, end to end, exactly as a newcomer runs it: `tpuft demo` on examples/local-cpu.yaml,
on the real local cluster: our operator (its image, from the chart) creates the RayCluster, the
real KubeRay creates the pods and submits both RayJobs, the kubelet runs them on containerd, the
real workload verifies the collectives and fine-tunes. Run twice in a row, as a user trying it
again would: the second run is a new object under the same name and must train from step 0
(issue 19); it is examples/local-cpu-jax.yaml (training.framework: jax, JaxTrainer's 2 CPU
workers, Orbax checkpoints) renamed, so one run also shows the JAX path end to end. Each run
serves what it trained (spec.serve): the training RayCluster is released, KubeRay's RayService runs
Ray Serve with the workload's transformers app, the demo's chat exchange answers with the fine-tuned
model, /v1/models lists it, and Argo CD's health check calls the object Healthy (issue 14).
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.chart.helmlib import run_health
from tests.cluster_fixtures import assert_nothing_left_failed, clear_namespace, demo_command
from tests.paths import EXAMPLES, REPO

PHASES_IN_ORDER = ["phase Provisioning", "phase VerifyingCollectives", "verification: passed",
                   "phase Training", "Epoch 1/3", "Epoch 3/3", "phase Serving", "tpuft chat", "  user:"]


# The demo's namespace, cleared after the test (the rehearsal, `tpuft demo --rehearse-tpu`, runs in
# the other lane at the same time, in its own namespace: tests/cluster/test_local_cluster.py).
DEMO_NS = "e2e"


@pytest.fixture
def demo_namespace(cluster_kubectl, request):
    """The demo leaves its object for the user to inspect; the next test needs the hosts free."""
    ns = request.param
    yield ns
    clear_namespace(cluster_kubectl, ns)


def _demo(tmp_path: Path, ns: str, tag: str, *extra: str,
          timeout: float = 1800) -> tuple[subprocess.CompletedProcess, dict]:
    result = tmp_path / f"result-{tag}.json"
    argv, env = demo_command(ns, result, *extra)
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(result.read_text()) if result.exists() else {})


def _check_succeeded(proc, final, storage: Path, kubectl) -> list[float]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    positions = [out.find(marker) for marker in PHASES_IN_ORDER]
    assert -1 not in positions and positions == sorted(positions), out[-6000:]
    status = final["object"]["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"SliceProvisioned": "True", "CollectivesVerified": "True",
                          "TrainingSucceeded": "True", "Serving": "True", "Ready": "True", "Failed": "False"}
    assert status["phase"] == "Serving" and status["serving"]["modelSource"] == status["training"]["exportedModel"]
    assert run_health(final["object"])["status"] == "Healthy"
    chat = final["chat"]
    assert chat["model"] == final["object"]["metadata"]["name"] and chat["answer"].strip(), chat
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
    # A run that succeeded leaves nothing Failed behind (no submitter Job, pod or RayJob; issue 24).
    assert_nothing_left_failed(kubectl, DEMO_NS)
    return losses


def _jax_example_as(name: str, tmp_path: Path) -> Path:
    doc = yaml.safe_load((EXAMPLES / "local-cpu-jax.yaml").read_text())
    doc["metadata"]["name"] = name
    path = tmp_path / f"{name}-jax.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _check_jax(final) -> None:
    """The JAX run: JaxTrainer's Orbax checkpoint committed on the hostPath volume, and an export
    transformers loads and generates with (it is also what the RayService serves)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert final["object"]["spec"]["training"]["framework"] == "jax"
    status = final["object"]["status"]
    checkpoint, export = Path(status["training"]["lastCheckpoint"]), status["training"]["exportedModel"]
    assert (checkpoint / "state").is_dir() and (checkpoint / "COMMITTED").is_file(), sorted(checkpoint.iterdir())
    model, tok = AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export)
    ids = tok("### Instruction:\nTell me about the cow.\n\n### Response:\n", return_tensors="pt")["input_ids"]
    assert model.generate(input_ids=ids, max_new_tokens=8, do_sample=False).shape[1] > ids.shape[1]


@pytest.mark.real_node
@pytest.mark.timeout(2400)   # two demo runs, each to a served model
@pytest.mark.parametrize("demo_namespace", [DEMO_NS], indirect=True, ids=[DEMO_NS])
def test_demo_runs_twice_and_each_run_trains(local_cluster, cluster_kubectl, demo_namespace, tmp_path, monkeypatch):
    storage = tmp_path / "checkpoints"
    first, final1 = _demo(tmp_path, DEMO_NS, "1", "--storage-path", str(storage))
    _check_succeeded(first, final1, storage, cluster_kubectl)
    run1 = Path(final1["object"]["status"]["training"]["lastCheckpoint"]).parent
    before = {p: p.stat().st_mtime_ns for p in run1.rglob("*") if p.is_file()}

    # The same name again at once (the demo deletes the first object and applies), now with JAX.
    second, final2 = _demo(tmp_path, DEMO_NS, "2", "--storage-path", str(storage),
                           "--example", str(_jax_example_as("local-cpu", tmp_path)))
    _check_succeeded(second, final2, storage, cluster_kubectl)
    run2 = Path(final2["object"]["status"]["training"]["lastCheckpoint"]).parent
    assert run2 != run1 and final2["object"]["metadata"]["uid"] != final1["object"]["metadata"]["uid"]
    assert "Epoch 1/3" in second.stdout  # trained from step 0, not "resumed" at the end
    assert {p: p.stat().st_mtime_ns for p in run1.rglob("*") if p.is_file()} == before  # first run untouched
    assert final2["object"]["status"]["serving"]["modelSource"].startswith(str(run2))   # serves its own export
    _check_jax(final2)
    monkeypatch.setenv("KUBECONFIG", str(local_cluster.kubeconfig))
    _check_chat_and_models()


def _check_chat_and_models():
    """`tpuft chat` against the object the demo left serving (greedy: the same answer twice), and
    /v1/models through the same port-forward."""
    from tpuft import chat, chat_cli
    from tpuft_local.toolchain import tool_path

    kubectl = tool_path("kubectl")
    model, first = chat_cli.ask(kubectl, DEMO_NS, "local-cpu", "What is Ray Serve?", max_tokens=16)
    _, second = chat_cli.ask(kubectl, DEMO_NS, "local-cpu", "What is Ray Serve?", max_tokens=16)
    assert model == "local-cpu" and first.strip() and first == second
    got = subprocess.run([kubectl, "get", "tft", "local-cpu", "-n", DEMO_NS, "-o", "json"], capture_output=True,
                         text=True, check=True, timeout=60)
    serving = chat_cli.endpoint(json.loads(got.stdout))
    with chat_cli.port_forward(kubectl, DEMO_NS, serving["service"], serving["port"]) as port:
        assert [m["id"] for m in chat.models(f"http://127.0.0.1:{port}")] == ["local-cpu"]
