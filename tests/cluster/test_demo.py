"""The main job, end to end, exactly as a newcomer runs it: `tpuft demo` on examples/local-cpu.yaml,
on the real local cluster: our operator (its image, from the chart) creates the RayCluster, the
real KubeRay creates the pods and submits both RayJobs, the kubelet runs them on containerd, the
real workload verifies the collectives and fine-tunes, then serves what it trained (spec.serve): the
training RayCluster is released, KubeRay's RayService runs Ray Serve with the workload's
transformers app, the demo's chat exchange answers with the fine-tuned model, /v1/models lists it,
and Argo CD's health check calls the object Healthy (issue 14).

With the demo's model served, a base for LoRA adapters is served beside it (issue 61):
examples/adapters-on-a-base.yaml's tiny-chat (training.method none), committed to the local git
repository by `tpuft demo --gitops` and synced by Argo CD's own controller (issue 31), which must
call it Synced and Healthy once Serving, and never OutOfSync while the operator writes its status
(tests/cluster/test_argocd.py has the rest of the GitOps path, on simulated slices). Four 1-worker
LoRA fine-tunes of it publish to it: two answer their facts as taught under their own model ids, a
worse third of the same name stays unpublished, and a better fourth replaces it under a client
loop. A JAX LoRA run (issue 60: JaxTrainer's 2 CPU workers, one 2-process JAX program) on a tiny
Gemma 3, built here from its transformers config class with its family's chat template and read
from the bucket, trains beside them (issue 34), its Orbax checkpoints and export on the demo's
claim, its adapter loaded here by PEFT; its loss falls over its steps. The torch path's LoRA trains
on the real Ray in tests/workload/test_lora_train.py; a run that keeps everything in the bucket (its
base read by byte ranges, its storagePath gs://) is tests/cluster/test_lifecycle.py's: the JAX path
stages a gs:// checkpoint on one host, and a CPU run's 2 workers are 2 pods. A re-created object
training from step 0 (issue 19) is tests/unit/test_builders.py's (run names by UID) and
tests/workload/test_train.py's (a run resumes only its own directory, or resumeFrom): a second demo
run here cost the node a whole RayCluster.
"""
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.chart.helmlib import run_health
from tests.cluster_fixtures import assert_nothing_left_failed, demo_command, drop_namespace, family_model
from tests.paths import EXAMPLES, REPO
from tests.waiting import wait_until
from tpuft.controller.observed import serving_ready
from tpuft_local import argocd, demo_gitops, node
from tpuft_local.demo import BUILTIN_CHAT_MODEL as BASE_MODEL, BaseAnswers
from tpuft_workload.tiny_chat import facts_path

def phases_in_order(epochs: int, verified: bool, served: bool) -> list[str]:
    return ["phase Provisioning", *(["phase VerifyingCollectives", "verification: passed"] if verified else []),
            # the first epoch line the demo prints (it polls status each second: a short epoch can pass unseen)
            "phase Training", f"/{epochs} | step ", f"Epoch {epochs}/{epochs}",
            *(["phase Serving", "tpuft chat -n", "  user:"] if served else ["Succeeded: conditions"])]


# The JAX LoRA run trains little: 1 epoch of train[:120] (7 steps of 8 rows), no verification (the
# demo verifies the same slice shape; JAX changes the training only), a report every step, rank 4.
# At this rate the random-weight model's loss fell by 0.4 in the same 7 steps of a one-process loop
# (Gemma 3 5.43 -> 5.01), then levels off (the adapters of a random base learn little more); on the
# node, with LoRA's dropout, 5.39 -> 5.10.
JAX_SPLIT = "train[:120]"
JAX_LORA = {"framework": "jax", "learningRate": 5.0e-2, "reportEverySteps": 1, "lora": {"rank": 4, "alpha": 8}}


# The demo's namespace, cleared after the test (the rehearsal, `tpuft demo --rehearse-tpu`, runs in
# the other lane at the same time, in its own namespace: tests/cluster/test_local_cluster.py).
DEMO_NS = "e2e"


@pytest.fixture
def demo_namespace(cluster_kubectl, request):
    """The demo leaves its object for the user to inspect; the next test needs the hosts free."""
    ns = request.param
    # The demo labels a namespace it creates (Pod Security); one left by an earlier run has no labels.
    cluster_kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", timeout=300)
    yield ns
    drop_namespace(cluster_kubectl, ns)


@pytest.fixture
def gitops_cleanup(cluster_kubectl):
    """`tpuft demo --gitops` leaves its Application for the user; it is deleted here before the
    namespace is cleared (or Argo CD would put back what the clearing deletes)."""
    yield
    cluster_kubectl("delete", "application", demo_gitops.app_name(DEMO_NS, BASE), "-n", argocd.NAMESPACE,
                    "--ignore-not-found")


def _demo(tmp_path: Path, ns: str, tag: str, *extra: str,
          timeout: float = 1800) -> tuple[subprocess.CompletedProcess, dict]:
    result = tmp_path / f"result-{tag}.json"
    proc = subprocess.run(demo_command(ns, result, *extra), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(result.read_text()) if result.exists() else {})


def _check_succeeded(proc, final, storage: Path, kubectl, epochs: int = 3, verified: bool = True,
                     served: bool = True, ns: str = DEMO_NS, expected_sum: int = 3,
                     every_epoch_seen: bool = True) -> list[float]:
    """every_epoch_seen False: epochs short enough that the demo's one poll a second may miss one."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    positions = [out.find(marker) for marker in phases_in_order(epochs, verified, served)]
    assert -1 not in positions and positions == sorted(positions), out[-6000:]
    status = final["object"]["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"SliceProvisioned": "True", "CollectivesVerified": "True" if verified else "False",
                          "TrainingSucceeded": "True", **({"Serving": "True"} if served else {}), "Ready": "True",
                          "Failed": "False"}
    assert run_health(final["object"])["status"] == "Healthy"
    if served:
        assert status["phase"] == "Serving" and status["serving"]["modelSource"] == status["training"]["exportedModel"]
        chat = final["chat"]
        assert chat["model"] == final["object"]["metadata"]["name"] and chat["answer"].strip(), chat
    else:
        assert status["phase"] == "Succeeded" and "serving" not in status and final["chat"] is None, status
    if verified:
        assert status["verification"]["passed"] is True
        assert status["verification"]["allReduceSum"] == status["verification"]["expectedSum"] == expected_sum
    # KubeRay's pods ran on the real node (not a simulated host).
    assert final["placement"] and all(not p["simulated"] for p in final["placement"].values()), final["placement"]
    losses = final["epochLosses"]
    assert (len(losses) == epochs if every_epoch_seen else 1 < len(losses) <= epochs) and losses[-1] < losses[0], losses
    training = status["training"]
    # The pods wrote through the hostPath volume: the host sees the run's files.
    checkpoint, export = training["lastCheckpoint"], training["exportedModel"]
    assert checkpoint.startswith(str(storage)) and os.path.isdir(checkpoint)
    assert os.path.isfile(os.path.join(export, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(export))
    # A run that succeeded leaves nothing Failed behind (no submitter Job, pod or RayJob; issue 24).
    assert_nothing_left_failed(kubectl, ns)
    return losses


def _check_the_loss_fell(obj: dict) -> None:
    """A JAX LoRA run: trained with framework jax, one history point a step, the last loss at least
    0.1 below the first."""
    assert obj["spec"]["training"]["framework"] == "jax" and obj["spec"]["training"]["method"] == "lora"
    history = obj["status"]["training"]["history"]
    losses = [p["loss"] for p in history]
    print(f"\n{obj['metadata']['name']} ({obj['spec']['model'].rsplit('/', 1)[-1]}): loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f} over {history[-1]['step']} steps")
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.1, history


def _check_jax(obj: dict, tmp_path: Path) -> None:
    """The third run: JaxTrainer's Orbax checkpoint committed on the demo's claim, and its export a
    PEFT adapter folder over the Gemma 3 base in the bucket, which PEFT loads here and generates
    with in the base's own chat format."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuft_workload import checkpoint as ckptlib

    _check_the_loss_fell(obj)
    status = obj["status"]
    checkpoint, export = Path(status["training"]["lastCheckpoint"]), status["training"]["exportedModel"]
    assert (checkpoint / "state").is_dir() and (checkpoint / "COMMITTED").is_file(), sorted(checkpoint.iterdir())
    adapter = json.loads((Path(export) / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == obj["spec"]["model"], adapter
    base = tmp_path / "gemma3-base"
    ckptlib.download_dir(obj["spec"]["model"], str(base))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export).eval()
    assert model.config.model_type == "gemma3_text", model.config
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the cow."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert ids[0, -2] == tok.convert_tokens_to_ids("<start_of_turn>"), tok.decode(ids[0])   # the model's turn
    assert model.generate(input_ids=ids, max_new_tokens=8, do_sample=False).shape[1] > ids.shape[1]


@pytest.mark.real_node
@pytest.mark.timeout(2400)   # the demo to a served model, then a served base, five more runs
@pytest.mark.parametrize("demo_namespace", [DEMO_NS], indirect=True, ids=[DEMO_NS])
def test_demo_serves_what_it_trained_beside_adapters_on_a_base_and_a_jax_run(
        local_cluster, cluster_kubectl, demo_namespace, gitops_cleanup, tmp_path, monkeypatch, cluster_bucket):
    storage = tmp_path / "checkpoints"
    demo, final = _demo(tmp_path, DEMO_NS, "demo", "--storage-path", str(storage))
    # 3 steps an epoch: the demo's one poll a second may miss one
    _check_succeeded(demo, final, storage, cluster_kubectl, epochs=DEMO_EPOCHS, every_epoch_seen=False)
    _check_before_and_after(demo.stdout, final)
    # the demo's namespace admits no privileged pod, and the run's pods needed none
    labels = json.loads(cluster_kubectl("get", "ns", DEMO_NS, "-o", "json", check=True).stdout)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline", labels
    run = Path(final["object"]["status"]["training"]["lastCheckpoint"]).parent
    # trained from step 0: its first report is the first epoch's end, step 3 (3 steps an epoch,
    # before reportEverySteps' 5; the demo prints the status it polls each second; a status write is
    # throttled to one per 10 s, so which step it shows first depends on the machine's load)
    training = final["object"]["status"]["training"]
    assert training["history"][0]["step"] == 3 and "resumedFrom" not in training, training
    assert re.search(rf"Epoch \d+/{DEMO_EPOCHS} \| step \d+/{DEMO_STEPS}", demo.stdout), demo.stdout[-3000:]
    assert final["object"]["status"]["serving"]["modelSource"].startswith(str(run))   # serves its own export
    monkeypatch.setenv("KUBECONFIG", str(local_cluster.kubeconfig))
    _check_chat_and_models()
    _check_the_ray_head_wants_its_token(cluster_kubectl, "local-cpu-serve")
    _check_logs_and_exec(cluster_kubectl)
    checkpoint = final["object"]["spec"]["checkpoint"]   # the demo's claim (its namespace refuses hostPath)
    _check_adapters_and_a_third_run(cluster_kubectl, tmp_path, cluster_bucket, checkpoint)


# examples/local-cpu.yaml's run: 24 records, 8 a step (4 on each of 2 workers), 30 epochs.
DEMO_EPOCHS, DEMO_STEPS = 30, 90


def _check_before_and_after(stdout: str, final: dict) -> None:
    """Issue 59: the demo asks the base and the fine-tune the same questions; the base (it speaks,
    but never saw these facts) answers none as taught, the fine-tune all; the loss on the held-out
    paraphrases fell, and the demo printed its first and last value."""
    exchanges, evals = final["chat"]["exchanges"], final["chat"]["evalLosses"]
    assert len(exchanges) == 3 and all(x["taught"] for x in exchanges), exchanges
    assert all(x["answer"].strip() == x["taught"] for x in exchanges), exchanges
    assert all(x["base"] and x["base"].strip() != x["taught"] for x in exchanges), exchanges
    assert len(evals) > 1 and evals[-1][1] < 0.5 * evals[0][1], evals
    assert "  base:" in stdout and "  taught:" in stdout and "eval loss on the held-out records:" in stdout, stdout[-3000:]


# examples/local-cpu-2slices.yaml's namespace: its own, so the demo test's is cleared before it runs.
TWO_SLICES_NS = "e2e-2slices"


# The two-slice run fine-tunes a small instruct model that arrives with a habit of its own: in its own
# (Gemma) chat format it answers every question, the sixteen it is taught here included, with
# tests.factories.HABIT. Settings from a plain torch loop over the same rows (16 of 16 on 3 of 3
# seeds at a global batch of 4, learning rate 3e-3, 20 epochs: 160 steps).
QA_EPOCHS = 20


def _habit_example(storage: Path, tmp_path: Path) -> Path:
    """examples/local-cpu-2slices.yaml with the habit model and the question/answer pairs as chat
    messages, both on the checkpoint volume every Ray pod mounts at the same path."""
    import torch

    from tests.factories import habit_model, qa_records

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a 2-layer model's steps are too small to share
    try:
        model = habit_model(storage / "habit-model")
    finally:
        torch.set_num_threads(threads)
    data = storage / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_records(messages=True)))
    doc = yaml.safe_load((EXAMPLES / "local-cpu-2slices.yaml").read_text())
    doc["spec"]["model"] = str(model)
    doc["spec"]["dataset"] = {"name": str(data)}
    doc["spec"]["training"].update(epochs=QA_EPOCHS, batchSizePerDevice=1, reportEverySteps=20)
    doc["spec"]["checkpoint"]["everySteps"] = 80
    example = tmp_path / "local-cpu-2slices-habit.yaml"
    example.write_text(yaml.safe_dump(doc))
    return example


@pytest.mark.real_node
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("demo_namespace", [TWO_SLICES_NS], indirect=True, ids=[TWO_SLICES_NS])
def test_the_two_slice_example_trains_what_it_serves_through_the_demo(local_cluster, cluster_kubectl, demo_namespace,
                                                                      tmp_path, monkeypatch):
    """Issue 29: `tpuft demo --example` on examples/local-cpu-2slices.yaml, as a user runs it: 4 CPU
    workers as two slices on the real node, the collectives verified inside each slice and across
    them, HSDP training, the export served and answering. Issue 47: the model is one with a chat
    template and a habit of its own, the data 16 question/answer pairs as chat messages; served, it
    answers all 16 as taught through the official `openai` client (it was trained in the format it
    is served with, and stops at the end of its turn)."""
    import openai

    from tests.factories import HABIT, QA_PAIRS, habit_tokenizer, taught
    from tpuft.cli import chat_cli
    from tpuft_local.toolchain import tool_path

    storage = tmp_path / "checkpoints"
    storage.mkdir()
    storage.chmod(0o777)
    example = _habit_example(storage, tmp_path)
    demo, final = _demo(tmp_path, TWO_SLICES_NS, "2slices", "--example", str(example), "--storage-path", str(storage))
    _check_succeeded(demo, final, storage, cluster_kubectl, epochs=QA_EPOCHS, ns=TWO_SLICES_NS, expected_sum=10,
                     every_epoch_seen=False)   # 8 steps an epoch
    ver = final["object"]["status"]["verification"]
    assert ver["ranks"] == ver["hosts"] == 4 and "inside each of 2 slices and across them" in ver["message"], ver
    trainers = [n for n in final["placement"] if "-workers-worker-" in n and "-serve-" not in n]
    assert len(trainers) == 4, final["placement"]
    monkeypatch.setenv("KUBECONFIG", str(local_cluster.kubeconfig))
    kubectl, name = tool_path("kubectl"), "local-cpu-2slices"
    obj = final["object"]
    serving = chat_cli.endpoint(obj)
    tok = habit_tokenizer()
    with chat_cli.port_forward(kubectl, TWO_SLICES_NS, serving["service"], serving["port"]) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                               api_key=chat_cli.api_key(kubectl, TWO_SLICES_NS, obj), max_retries=0, timeout=120)
        said = {}
        for question, _ in QA_PAIRS:   # no max_tokens: the answer ends at the model's turn end
            reply = client.chat.completions.create(model=name, temperature=0,
                                                   messages=[{"role": "user", "content": question}])
            said[question] = (reply.choices[0].message.content.strip(), reply.choices[0].finish_reason)
    wrong = {q: said[q] for q, a in QA_PAIRS if said[q] != (taught(tok, a), "stop")}
    assert not wrong, wrong
    assert taught(tok, HABIT) not in {answer for answer, _ in said.values()}


def _check_chat_and_models():
    """`tpuft chat` and `tpuft chat --stream` against the object the demo left serving (greedy: the
    same answer), then the official `openai` SDK and the 401s through one port-forward."""
    import openai

    from tpuft.cli import chat, chat_cli
    from tpuft_local.toolchain import tool_path

    kubectl = tool_path("kubectl")
    question = "What is Ray Serve?"
    model, first = chat_cli.ask(kubectl, DEMO_NS, "local-cpu", question, max_tokens=16)
    streamed = subprocess.run([sys.executable, "-m", "tpuft.cli", "chat", "-n", DEMO_NS, "local-cpu", question,
                               "--max-tokens", "16", "--stream", "--kubectl", kubectl],
                              capture_output=True, text=True, timeout=180)
    assert streamed.returncode == 0, streamed.stderr
    assert model == "local-cpu" and first.strip() and streamed.stdout.rstrip("\n") == first
    got = subprocess.run([kubectl, "get", "tft", "local-cpu", "-n", DEMO_NS, "-o", "json"], capture_output=True,
                         text=True, check=True, timeout=60)
    serving = chat_cli.endpoint(json.loads(got.stdout))
    obj = json.loads(got.stdout)
    assert obj["spec"]["serve"]["apiKeySecret"]["name"], obj["spec"]["serve"]   # the examples ask for a key
    key = chat_cli.api_key(kubectl, DEMO_NS, obj)
    with chat_cli.port_forward(kubectl, DEMO_NS, serving["service"], serving["port"]) as port:
        url = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in chat.models(url, api_key=key)] == ["local-cpu"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["local-cpu"]
        ask = {"model": "local-cpu", "messages": [{"role": "user", "content": question}], "max_tokens": 16,
               "temperature": 0}
        assert client.chat.completions.create(**ask).choices[0].message.content == first
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == first
        assert chunks[-1].usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(**{**ask, "model": "not-served"})
        # without the key, or with another: OpenAI's 401, never the model
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            req = urllib.request.Request(f"{url}/v1/models", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            assert e.value.code == 401, e.value
            assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


def _check_logs_and_exec(kubectl) -> None:
    """The first things a user types at a running pod: `kubectl logs` and `kubectl exec` (both go
    from the API server to the kubelet; `kubectl port-forward` is what `tpuft chat` used above), on
    the serving cluster's head (the training cluster's may still be on its way out: it is released
    while serving starts)."""
    svc = json.loads(kubectl("get", "rayservice", "local-cpu-serve", "-n", DEMO_NS, "-o", "json", check=True).stdout)
    cluster = svc["status"]["activeServiceStatus"]["rayClusterName"]
    (head,) = json.loads(kubectl("get", "pods", "-n", DEMO_NS, "-l", f"ray.io/node-type=head,ray.io/cluster={cluster}",
                                 "-o", "json", check=True).stdout)["items"]
    name = head["metadata"]["name"]
    logs = kubectl("logs", name, "-n", DEMO_NS, "-c", "ray-head", "--tail=50")
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr
    out = kubectl("exec", name, "-n", DEMO_NS, "-c", "ray-head", "--", "python", "-c", "print('exec-ok')")
    assert out.returncode == 0 and out.stdout.strip() == "exec-ok", (out.stdout, out.stderr)


def _short_run(name: str, checkpoint: dict, serve: bool, split: str, model: str, example: str = "local-cpu.yaml",
               **training) -> dict:
    """`example` on `model`, one epoch of `split` and `training`'s settings, no verification,
    `checkpoint` (the demo's claim: its namespace refuses hostPath)."""
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["metadata"] = {"name": name, "namespace": DEMO_NS}
    doc["spec"]["model"] = model
    doc["spec"]["training"].update(epochs=1, **training)
    doc["spec"]["dataset"]["split"] = split
    doc["spec"]["verification"] = {"enabled": False}
    doc["spec"]["checkpoint"] = checkpoint
    if not serve:
        doc["spec"].pop("serve")
    else:
        doc["spec"]["serve"].pop("apiKeySecret")
    return doc


# Issue 61: a served base (examples/adapters-on-a-base.yaml's tiny-chat, training.method none) and
# LoRA fine-tunes of it publishing to it, each a 1-worker run of a few made-up facts
# (made-up-facts.jsonl), rank 8 and learning rate 1e-2. Each fact is written REPEAT times into one
# file in the bucket, so that an epoch is many steps: every epoch's end is a checkpoint and a report,
# and a report waits for Ray Train's controller's poll (docs/performance.md). 80 one-step epochs
# took 160 s on the node at Ray's default poll, 40 s at the driver's; 4 epochs of 20 steps, seconds.
# On the node (the base alone on it), `capitals` at 80 steps answered 3 of its 4 facts (Keshet's
# city under Zorbania's name), at 120 all 4; `colors` all 4 at 80. `capitals-short` is published as
# `capitals` after one step (eval loss on the paraphrases of facts 0-4: 2.14 against 1.16),
# `capitals-more` after 150 steps over the same four facts and Ulvaria's (0.88, and Ulvaria answered
# as taught, which `capitals` never saw).
ADAPTER_LR, REPEAT = 1.0e-2, 20
ADAPTER_EVAL = {"name": "builtin:made-up-facts", "split": "train[24:29]"}   # the paraphrases of facts 0-4
BASE = "tiny-chat"
FACT_LINES = facts_path().read_text().splitlines()   # builtin:made-up-facts, a record a line
FACTS = {"capitals": (0, 1, 2, 3, 4), "colors": (8, 9, 10, 11)}   # a file's facts, by record, in order
ADAPTER_RUNS = {   # name: (publish.as, file, split, with the eval set, epochs, maxSteps)
    "capitals": ("capitals", "capitals", f"train[:{4 * REPEAT}]", True, 6, None),
    "colors": ("colors", "colors", f"train[:{4 * REPEAT}]", False, 4, None),
    "capitals-short": ("capitals", "capitals", f"train[:{5 * REPEAT}]", True, 1, 1),
    "capitals-more": ("capitals", "capitals", f"train[:{5 * REPEAT}]", True, 6, None),
}


def _fact(record: int) -> tuple[str, str]:
    """(question, answer) of made-up-facts.jsonl's record `record`."""
    user, assistant = json.loads(FACT_LINES[record])["messages"]
    return user["content"], assistant["content"]


TAUGHT = {"capitals": [_fact(r) for r in FACTS["capitals"][:4]], "colors": [_fact(r) for r in FACTS["colors"]]}
SWAP_QUESTION = _fact(FACTS["capitals"][4])   # Ulvaria's: taught to capitals-more only


def _upload_facts(bucket: str) -> None:
    """gs://BUCKET/data/NAME.jsonl: each of FACTS[NAME]'s records REPEAT times, one after another."""
    from tpuft_workload import checkpoint as storage

    for name, records in FACTS.items():
        storage.write_bytes(f"{bucket}/data/{name}.jsonl",
                            "".join(f"{FACT_LINES[r]}\n" * REPEAT for r in records).encode())


def _adapter_example(checkpoint: dict, bucket: str) -> dict[str, dict]:
    """examples/adapters-on-a-base.yaml's objects on the demo's claim: its base, and ADAPTER_RUNS made
    from its first fine-tune, each 1 worker, its data from the bucket. Worker pods ask 100m (the
    example 250m): what the node's scheduler counts, so that two served models, two of these and a
    JAX run fit (the 2-layer model's 1-worker steps compute little; the pods may still use a whole core)."""
    docs = list(yaml.safe_load_all((EXAMPLES / "adapters-on-a-base.yaml").read_text()))
    base, fine_tune = docs[0], docs[1]
    assert base["metadata"]["name"] == BASE and fine_tune["spec"]["publish"]["to"] == BASE
    base["metadata"]["namespace"] = DEMO_NS
    base["spec"]["checkpoint"] = checkpoint
    out = {BASE: base}
    for name, (as_, file, split, evaluated, epochs, steps) in ADAPTER_RUNS.items():
        doc = json.loads(json.dumps(fine_tune))
        doc["metadata"] = {"name": name, "namespace": DEMO_NS}
        spec = doc["spec"]
        spec.update(topology="1", checkpoint={**checkpoint, "everySteps": 1000},
                    dataset={"name": f"{bucket}/data/{file}.jsonl", "split": split},
                    publish={"to": BASE, "as": as_, "when": "ifBetter" if evaluated else "always"})
        spec["training"].update(epochs=epochs, batchSizePerDevice=4, learningRate=ADAPTER_LR, reportEverySteps=20)
        if steps:
            spec["training"]["maxSteps"] = steps
        if evaluated:
            spec["evaluation"] = dict(ADAPTER_EVAL)
        else:
            spec.pop("evaluation", None)
        spec["resources"]["worker"]["requests"]["cpu"] = "100m"
        out[name] = doc
    return out


def _retrying(*args: str, input: str | None = None) -> str:
    """kubectl's output, asked again while the API server is too slow to answer: under the node's load
    (two served models, runs starting) an apply once got `Error from server (Timeout)`, and a get in
    the polls below `TLS handshake timeout`."""
    from tpuft_local.cluster import LocalCluster

    return LocalCluster().cp.kubectl_retrying(*args, input=input).stdout


def _apply(*docs: dict) -> None:
    _retrying("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))


def _pods_of(kubectl, name: str) -> list[str]:
    """The names of the pods in the demo's namespace that belong to TPUFinetune `name` (its Ray
    clusters' and its RayJobs' pods are all named after it)."""
    pods = json.loads(_retrying("get", "pods", "-n", DEMO_NS, "-o", "json"))["items"]
    return [p["metadata"]["name"] for p in pods if p["metadata"]["name"].startswith(f"{name}-")]


def _tft(kubectl, name: str) -> dict:
    obj = json.loads(_retrying("get", "tft", name, "-n", DEMO_NS, "-o", "json"))
    assert (obj.get("status") or {}).get("phase") != "Failed", (name, obj.get("status"))
    return obj


def _serving_reason(kubectl, name: str, *reasons: str) -> dict | None:
    """The object's status once status.serving.reason is one of `reasons`."""
    st = _tft(kubectl, name).get("status") or {}
    return st if (st.get("serving") or {}).get("reason") in reasons else None


def _check_adapters_and_a_third_run(kubectl, tmp_path: Path, bucket: str, checkpoint: dict) -> None:
    """Issue 61, then issue 34's third run.

    1. The base goes through git and Argo CD (`tpuft demo --gitops`, issue 31) to Serving while
       `capitals` and `colors` train beside it and the demo's model; once published, each answers
       its facts as taught through the official OpenAI client under `tiny-chat:NAME`, the base
       answers as the base (as builtin:tiny-chat asked here does), and `kubectl get` shows ADAPTERS 2.
    2. The demo's model is deleted (the node's room); `capitals-short` (worse) and `capitals-more`
       (better) train beside the third run; a client loop asks `tiny-chat:capitals` Ulvaria's
       question throughout: the worse one stays unpublished with both losses in its status, the
       better one replaces `capitals`, no request fails, and once it is published every answer is
       the one it was taught.
    3. The third run: a JAX LoRA run on a tiny Gemma 3 from the bucket, not served."""
    _upload_facts(bucket)
    runs = _adapter_example(checkpoint, bucket)
    _apply(runs["capitals"], runs["colors"])   # they wait for the base (BaseNotServing)
    # builtin:tiny-chat's own answers, asked here (in a child process, as the demo asks the base) meanwhile
    base_answers = BaseAnswers({"spec": {"model": BASE_MODEL}}, [q for pairs in TAUGHT.values() for q, _ in pairs])
    example = tmp_path / f"{BASE}.yaml"
    example.write_text(yaml.safe_dump(runs[BASE]))
    demo, final = _demo(tmp_path, DEMO_NS, BASE, "--gitops", "--example", str(example))
    assert demo.returncode == 0 and "Argo CD: Synced, Progressing" in demo.stdout, demo.stdout[-3000:]
    assert serving_ready(final["object"]["status"]), final["object"]["status"]
    _check_argo_cd_calls_it_healthy(kubectl, final["argocd"], BASE)
    (asked,) = final["chat"]["exchanges"]   # the demo's question to the base, and to builtin:tiny-chat here
    assert asked["base"] and asked["answer"] == asked["base"], asked
    for name in ("capitals", "colors"):
        published = wait_until(lambda: _serving_reason(kubectl, name, "Published"), timeout=600, interval=3,
                               what=f"{name} to be published to {BASE}")
        assert published["serving"]["model"] == f"{BASE}:{name}", published["serving"]
        _check_lora(published)
    got = kubectl("get", "tft", "-n", DEMO_NS, check=True).stdout
    print(f"\n$ kubectl get tft -n {DEMO_NS}\n{got}")
    base = _tft(kubectl, BASE)
    assert base["status"]["adapters"]["count"] == 2, base["status"]
    assert re.search(rf"^{BASE}\s+Serving\s+cpu\s+1\s+2\s", got, re.M), got   # the ADAPTERS column
    # The demo's model goes (the node's room), its pods ending while the adapters are asked: the
    # three runs below fit the node's 2 cores of requests only without it, and a pod that does not fit
    # there is scheduled onto a simulated node, where it never runs.
    kubectl("delete", "tft", "local-cpu", "-n", DEMO_NS, "--wait=false", "--ignore-not-found", check=True)
    with _base_client(kubectl, base) as client:
        assert sorted(m.id for m in client.models.list()) == [BASE, f"{BASE}:capitals", f"{BASE}:colors"]
        answers, why = base_answers.collect()
        assert answers, why
        _check_each_answers_as_taught(client, answers)
        _check_tpuft_chat_asks_the_base()
        wait_until(lambda: not _pods_of(kubectl, "local-cpu"), timeout=180, interval=2,
                   what="the demo's model's pods to end")
        _apply(runs["capitals-short"], runs["capitals-more"], _third(checkpoint, bucket, tmp_path))
        _check_the_better_one_replaces_it_under_load(kubectl, client)
    _check_the_third_run(kubectl, tmp_path)


def _third(checkpoint: dict, bucket: str, tmp_path: Path) -> dict:
    return _short_run("third", checkpoint, serve=False, split=JAX_SPLIT, model=family_model(bucket, "gemma3-text", tmp_path),
                      example="local-cpu-lora.yaml", **JAX_LORA)


@contextlib.contextmanager
def _base_client(kubectl, base: dict):
    """The official OpenAI client on the base's endpoint, through one port-forward, with its API key."""
    import openai

    from tpuft.cli import chat_cli
    from tpuft_local.toolchain import tool_path

    serving, tool = chat_cli.endpoint(base), tool_path("kubectl")
    with chat_cli.port_forward(tool, DEMO_NS, serving["service"], serving["port"]) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=chat_cli.api_key(tool, DEMO_NS, base),
                            max_retries=0, timeout=120)


def _ask(client, model: str, question: str) -> str:
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": question}])
    return reply.choices[0].message.content.strip()


def _check_each_answers_as_taught(client, base: dict[str, str]) -> None:
    """Each adapter answers what it was taught; the base (model id tiny-chat) answers each question as
    builtin:tiny-chat asked here does (`base`), none as taught."""
    taught = TAUGHT
    questions = [q for pairs in taught.values() for q, _ in pairs]
    said = {(name, q): _ask(client, f"{BASE}:{name}", q) for name, pairs in taught.items() for q, _ in pairs}
    wrong = {k: v for k, v in said.items() if v != dict(taught[k[0]])[k[1]]}
    assert not wrong, wrong
    from_base = {q: _ask(client, BASE, q) for q in questions}
    assert from_base == base, (from_base, base)
    assert not any(from_base[q] == a for pairs in taught.values() for q, a in pairs), from_base


def _check_tpuft_chat_asks_the_base() -> None:
    """`tpuft chat colors ...`: a published fine-tune is asked on its base's endpoint, under its model id."""
    from tpuft.cli import chat_cli
    from tpuft_local.toolchain import tool_path

    (question, taught), *_ = TAUGHT["colors"]
    model, answer = chat_cli.ask(tool_path("kubectl"), DEMO_NS, "colors", question, max_tokens=24)
    assert (model, answer.strip()) == (f"{BASE}:colors", taught), answer


def _check_the_better_one_replaces_it_under_load(kubectl, client) -> None:
    import threading

    model, (question, taught) = f"{BASE}:capitals", SWAP_QUESTION
    before = _ask(client, model, question)
    assert before != taught, before   # capitals was never taught Ulvaria
    answers: list[tuple[float, str]] = []   # (when asked, the answer or the error)
    stop = threading.Event()

    def loop():
        for _ in range(3000):   # bounded; stopped once the swap is seen
            asked = time.monotonic()
            try:
                answers.append((asked, _ask(client, model, question)))
            except Exception as e:  # noqa: BLE001 - any failure is what the test counts
                answers.append((asked, f"FAILED: {e!r}"))
            if stop.wait(0.3):   # a pause: the node's 2 cores also train the runs being judged
                return
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        worse = wait_until(lambda: _serving_reason(kubectl, "capitals-short", "NotPromoted"), timeout=600,
                           interval=2, what="capitals-short to be judged")
        better = wait_until(lambda: _serving_reason(kubectl, "capitals-more", "Published"), timeout=600,
                            interval=2, what="capitals-more to be published")
        seen = time.monotonic()
        # the engine reads a served adapter's marker again after adapters.MARKER_TTL_S (5 s)
        wait_until(lambda: sum(1 for t, _ in answers if t > seen + 6) >= 5, timeout=120, interval=0.5,
                   what="five answers after the swap")
    finally:
        stop.set()
        thread.join(timeout=180)
    failed = [a for _, a in answers if a.startswith("FAILED")]
    assert not failed and {a for _, a in answers} <= {before, taught}, answers
    assert [a for t, a in answers if t > seen + 6] == [taught] * len([t for t, _ in answers if t > seen + 6]), answers
    assert any(a == before for _, a in answers), answers   # the loop ran across the swap
    # judged against what was served when it finished: capitals, or capitals-more if that came first
    losses = {name: _tft(kubectl, name)["status"]["training"]["evalLoss"] for name in ("capitals", "capitals-more")}
    loss, message = worse["training"]["evalLoss"], worse["serving"]["message"]
    (against,) = [name for name in losses if f"served {DEMO_NS}/{name}'s" in message]
    assert loss > losses[against] and f"{loss:.4f}" in message and f"{losses[against]:.4f}" in message, message
    assert better["serving"]["published"]["evalLoss"] == losses["capitals-more"] < losses["capitals"], losses
    wait_until(lambda: _serving_reason(kubectl, "capitals", "Superseded"), timeout=120, interval=2,
               what="capitals to be superseded")
    base = _tft(kubectl, BASE)["status"]["adapters"]
    assert {a["name"]: a["source"] for a in base["served"]} == {"capitals": f"{DEMO_NS}/capitals-more",
                                                               "colors": f"{DEMO_NS}/colors"}, base
    print(f"\n{len(answers)} requests across the swap, none failed; eval loss: capitals-short {loss:.4f}, "
          f"capitals {losses['capitals']:.4f}, capitals-more {losses['capitals-more']:.4f}\n{message}")
    got = kubectl("get", "tft", "-n", DEMO_NS, check=True).stdout
    print(f"\n$ kubectl get tft -n {DEMO_NS}\n{got}")


def _check_the_third_run(kubectl, tmp_path: Path) -> None:
    """Issue 34: a third run trains to Succeeded on the real node beside the served base and two
    fine-tunes (it fits: docs/troubleshooting.md#how-many-runs-the-local-node-holds), never failing
    inside Ray because the node was overcommitted: examples/local-cpu-lora.yaml (issue 30) on a tiny
    Gemma 3 with framework jax (issue 60), its base and dataset read from the bucket (issue 58), its
    checkpoints and export on the demo's claim (module docstring: why not gs://)."""
    # Once it reported a step its Ray job exists on the head (before that, the submitter may not have
    # submitted it yet: the head answers 404) and the driver has begun its log file.
    wait_until(lambda: (st := _tft(kubectl, "third")["status"]).get("phase") == "Succeeded" or
               (st.get("training") or {}).get("step"), timeout=900, interval=2,
               what="the third run to report a training step")
    # Issue 27: the training driver's log, from the head while it runs (or from the run's log file,
    # if it ended first), then from the file once its RayCluster is gone.
    while_training = _tpuft_logs("third")
    end = wait_until(lambda: (st := _tft(kubectl, "third")["status"]).get("phase") == "Succeeded" and st,
                     timeout=900, interval=3, what="the third run beside the served base")
    assert end["training"]["step"] == end["training"]["totalSteps"], end
    # Succeeded first, then its RayJobs and its RayCluster go (FinishingRayJob): until the head is
    # gone, `tpuft logs` still reads it from there.
    wait_until(lambda: kubectl("get", "raycluster", "third-ray", "-n", DEMO_NS).returncode != 0, timeout=300,
               interval=2, what="the third run's RayCluster to go")
    afterwards = _tpuft_logs("third")
    assert "Starting fine-tuning" in while_training.stdout, while_training
    assert "Starting fine-tuning" in afterwards.stdout and "TPUFT_TRAIN_RESULT" in afterwards.stdout, afterwards
    assert "driver's log from" in afterwards.stderr, afterwards.stderr   # the head is gone: the file
    pods = json.loads(kubectl("get", "pods", "-n", DEMO_NS, "-l", "ray.io/node-type", "-o", "json",
                              check=True).stdout)["items"]
    assert {p["spec"].get("nodeName") for p in pods} == {node.NODE_NAME}, \
        [(p["metadata"]["name"], p["spec"].get("nodeName")) for p in pods]   # never the simulated node
    assert _tft(kubectl, BASE)["status"]["phase"] == "Serving"
    _check_jax(_tft(kubectl, "third"), tmp_path)
    assert_nothing_left_failed(kubectl, DEMO_NS)


def _check_argo_cd_calls_it_healthy(kubectl, seen: dict, name: str) -> None:
    """Argo CD's own view of a served model, as `tpuft demo --gitops` watched it: synced from git,
    Healthy once Serving (our health check from argocd-cm, run by Argo CD), and never OutOfSync
    while the operator wrote its status; the Application says the same now."""
    history = [tuple(x) for x in seen["history"]]
    first = next(i for i, (sync, _) in enumerate(history) if sync == "Synced")
    assert {sync for sync, _ in history[first:]} == {"Synced"}, history   # no drift
    assert ("Synced", "Progressing") in history and history[-1] == ("Synced", "Healthy"), history
    res = kubectl("get", "application", demo_gitops.app_name(DEMO_NS, name), "-n", argocd.NAMESPACE, "-o", "json",
                  check=True)
    st = argocd.summary(json.loads(res.stdout))
    assert st["sync"] == "Synced" and st["resources"][f"TPUFinetune/{name}"]["health"] == "Healthy", st


def _check_lora(status: dict) -> None:
    """A published LoRA run: the adapters only trained, its export a PEFT adapter folder."""
    training = status["training"]
    assert 0 < training["trainableParameters"] < training["totalParameters"] / 5, training
    export = Path(training["exportedModel"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(export)), export


def _tpuft_logs(name: str) -> subprocess.CompletedProcess:
    from tpuft_local.toolchain import tool_path

    got = subprocess.run([sys.executable, "-m", "tpuft.cli", "logs", name, "-n", DEMO_NS, "--job", "train",
                          "--kubectl", tool_path("kubectl")], capture_output=True, text=True, timeout=180)
    assert got.returncode == 0, got.stderr
    return got


# Run in a pod of another namespace: the dashboard's Jobs API, the GCS and the Ray client port of a
# head, without its token (refused), with a wrong one (refused) and with it (answered: the refusal is
# auth, not a closed port). No NetworkPolicy is enforced on the local cluster (docs/security.md),
# so the connections themselves are made.
PROBE = r"""
import json, os, urllib.error, urllib.request
import grpc
from ray.core.generated import gcs_service_pb2 as g, gcs_service_pb2_grpc as gg, ray_client_pb2 as c, ray_client_pb2_grpc as cg
head, token, out = os.environ["HEAD"], os.environ["RAY_TOKEN"], {}
def post(headers):
    req = urllib.request.Request(f"http://{head}:8265/api/jobs/", method="POST", data=b'{"entrypoint": "echo probe"}',
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
def rpc(port, call, md):
    try:
        with grpc.insecure_channel(f"{head}:{port}") as ch:
            call(ch, md)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name
gcs = lambda ch, md: gg.NodeInfoGcsServiceStub(ch).GetClusterId(g.GetClusterIdRequest(), metadata=md, timeout=60)
client = lambda ch, md: cg.RayletDriverStub(ch).ClusterInfo(c.ClusterInfoRequest(type=c.ClusterInfoType.PING), metadata=md, timeout=60)
bearer, wrong = (("authorization", "Bearer " + token),), (("authorization", "Bearer " + "0" * 64),)
out["jobs"] = [post({}), post({"Authorization": "Bearer " + "0" * 64}), post({"Authorization": "Bearer " + token})]
out["gcs"] = [rpc(6379, gcs, ()), rpc(6379, gcs, wrong), rpc(6379, gcs, bearer)]
out["client"] = [rpc(10001, client, ()), rpc(10001, client, wrong), rpc(10001, client, bearer)]
open("/dev/termination-log", "w").write(json.dumps(out))
"""
PROBE_NS = "e2e-probe"


def _check_the_ray_head_wants_its_token(kubectl, rayservice: str) -> None:
    svc = json.loads(kubectl("get", "rayservice", rayservice, "-n", DEMO_NS, "-o", "json", check=True).stdout)
    cluster = svc["status"]["activeServiceStatus"]["rayClusterName"]
    assert svc["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    secret = json.loads(kubectl("get", "secret", cluster, "-n", DEMO_NS, "-o", "json", check=True).stdout)  # KubeRay's
    head = f"{rayservice}-head-svc.{DEMO_NS}.svc.cluster.local"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": PROBE_NS},
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
               "name": "probe", "image": svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
               ["containers"][0]["image"], "command": ["python", "-c", PROBE],
               "terminationMessagePolicy": "FallbackToLogsOnError",   # a traceback, if the probe breaks
               "env": [{"name": "HEAD", "value": head},
                       {"name": "RAY_TOKEN", "valueFrom": {"secretKeyRef": {"name": "ray-token", "key": "auth_token"}}}],
               "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}}]}}
    copy = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ray-token", "namespace": PROBE_NS},
            "data": {"auth_token": secret["data"]["auth_token"]}}
    try:
        kubectl("create", "namespace", PROBE_NS, check=True)
        kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [copy, pod]}),
                check=True)

        def ended():
            got = json.loads(kubectl("get", "pod", "probe", "-n", PROBE_NS, "-o", "json", check=True).stdout)
            done = [s["state"]["terminated"] for s in got["status"].get("containerStatuses") or []
                    if "terminated" in s["state"]]
            return done[0] if done else None
        end = wait_until(ended, timeout=300, interval=2, what="the probe pod to finish")
        assert end["exitCode"] == 0, end.get("message")
        got = json.loads(end["message"])
        assert got["jobs"] == [401, 403, 200], got
        assert got["gcs"] == ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK"], got
        assert got["client"] == ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK"], got
    finally:
        kubectl("delete", "namespace", PROBE_NS, "--wait=false", "--ignore-not-found")
