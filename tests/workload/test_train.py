"""Fine-tuning on 2 real CPU workers (gloo, FSDP2) with the built-in tiny model and data.

One run covers: loss goes down over 2 epochs, a worker killed mid-epoch is restarted
(FailureConfig) and resumes from the last checkpoint with at most one interval lost, the
status subresource of a real TPUFinetune is written by rank 0 (with the loss history; no MFU on
CPU), rank 0's TensorBoard files hold one curve across both attempts (and `tpuft plot` reads
them as tensorboardX does), rank 0's Prometheus gauges reach Ray's metrics endpoint, and the
exported folder loads with AutoModelForCausalLM.from_pretrained and generates.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.factories import tensorboard_scalars
from tpuft import plot_cli
from tpuft.constants import HISTORY_MAX_POINTS
from tpuft_workload import __main__ as cli
from tpuft_workload import train

# 2 epochs of 7 steps (train[:80] packs into 62 rows): the kill lands in the second
EPOCHS = 2
CKPT_EVERY = 3
KILL_STEP = 8


@pytest.fixture(scope="module")
def cluster_with_kubeconfig(kubeconfig):
    """Ray workers inherit the environment of the process that starts Ray: set KUBECONFIG first."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KUBECONFIG", kubeconfig)
    mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield kubeconfig
    mp.undo()  # other test modules in the session must not inherit it


@pytest.fixture(scope="module")
def cr(cluster_with_kubeconfig, kube_api, kubectl):
    from kubernetes import client

    from tpuft.constants import GROUP, PLURAL, VERSION

    ns = "workload-train"
    kubectl("create", "namespace", ns)
    body = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "local-cpu.yaml").read_text())
    body["metadata"] = {"name": "tiny"}
    api = client.CustomObjectsApi(kube_api)
    api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    yield lambda: api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "tiny").get("status", {})
    kubectl("delete", "namespace", ns, "--wait=false")


def _args(storage: Path, run: str, **extra):
    argv = ["train", "--accelerator", "cpu", "--topology", "2", "--model", "builtin:tiny-llama",
            "--dataset", "builtin:dolly-mini", "--dataset-split", "train[:80]", "--epochs", str(EPOCHS),
            "--batch-size-per-device", "4", "--max-seq-length", "128", "--learning-rate", "3e-3",
            "--storage-path", str(storage), "--run-name", run, "--report-every-steps", "100"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return cli.parse_args(argv)


@pytest.fixture(scope="module")
def killed_run(cluster_with_kubeconfig, ray_cluster, cr, tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    args, target = _args(storage, "tiny-run", checkpoint_every_steps=CKPT_EVERY, keep_checkpoints=20,
                         max_failures=1)
    mp = pytest.MonkeyPatch()
    mp.setenv("TPUFT_NAMESPACE", "workload-train")
    mp.setenv("TPUFT_NAME", "tiny")
    try:
        trainer, cfg = train.build_trainer(args, target, fault_spec=f"kill-rank:1:step:{KILL_STEP}")
    finally:
        mp.undo()
    result = trainer.fit()
    return storage, args, cfg, result


def _summary(cfg) -> dict:
    return json.loads(Path(cfg["run_dir"], train.SUMMARY).read_text())


def test_killed_worker_resumes_from_last_checkpoint(killed_run):
    _, _, cfg, result = killed_run
    assert Path(cfg["run_dir"], f".tpuft-fault-kill-r1-s{KILL_STEP}").exists()  # the fault did fire
    s = _summary(cfg)
    assert s["step"] == s["totalSteps"] == result.metrics["total_steps"]
    per_epoch = s["totalSteps"] // EPOCHS
    done_before_kill = KILL_STEP - 1            # the kill comes before step KILL_STEP runs
    saved = [k for k in range(1, done_before_kill + 1) if k % CKPT_EVERY == 0 or k % per_epoch == 0]
    resumed = s["resumedFromStep"]
    assert resumed == max(saved)                 # the newest checkpoint (interval or epoch end)
    assert done_before_kill - resumed < CKPT_EVERY  # at most one interval lost


def test_loss_decreases(killed_run):
    _, _, _, result = killed_run
    reported = sorted(((mm["step"], mm["loss"]) for _, mm in result.best_checkpoints if "loss" in mm))
    assert len(reported) >= 3 and reported[-1][0] == result.metrics["total_steps"]
    first, last = reported[0][1], reported[-1][1]
    assert last < first - 0.5, reported


def test_status_written_by_rank_0(killed_run, cr):
    _, _, cfg, result = killed_run
    status = cr()
    t = status["training"]
    assert t["epoch"] == t["epochs"] == EPOCHS and t["step"] == t["totalSteps"] == result.metrics["total_steps"]
    assert t["exportedModel"] == cfg["export_uri"]
    assert t["lastCheckpoint"].startswith(cfg["run_dir"])
    assert t["loss"] > 0 and t["tokensPerSecond"] > 0 and 0 <= t["padFraction"] < 0.1
    assert "verification" not in status and "phase" not in status  # nothing else touched
    steps = [p["step"] for p in t["history"]]
    assert 3 <= len(steps) <= HISTORY_MAX_POINTS and steps == sorted(set(steps)) and steps[-1] == t["step"]
    assert t["history"][-1] == {"step": t["step"], "loss": t["loss"], "tokensPerSecond": t["tokensPerSecond"]}
    assert "mfu" not in t   # CPU: no peak FLOP/s in the catalog


def test_tensorboard_holds_one_curve_across_both_attempts(killed_run):
    _, _, cfg, result = killed_run
    files, scalars = tensorboard_scalars(Path(cfg["run_dir"], "tensorboard"))
    assert files == 2   # rank 0 of the killed attempt and of the restarted one
    assert {"train/loss", "train/grad_norm", "train/tokens_per_second", "train/step_time_seconds",
            "train/learning_rate"} <= set(scalars) and "train/mfu" not in scalars
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == result.metrics["total_steps"]   # no step twice
    assert all(v > 0 for _, v in scalars["train/grad_norm"])
    assert scalars["train/learning_rate"][0][1] == pytest.approx(3e-3)   # float32 in the event file
    # `tpuft plot` reads them without tensorboard or protobuf, as tensorboardX's own protos do
    assert plot_cli.read_events(Path(cfg["run_dir"], "tensorboard")) == (files, scalars)


def test_rank_0s_gauges_reach_rays_metrics_endpoint(killed_run):
    """What the chart's PodMonitor scrapes: ray.util.metrics gauges set in a Ray worker, as Ray's
    metrics agent exports them (ray_<name>{tpufinetune=...}) on the node's metrics port."""
    import time
    import urllib.request

    import ray

    from tpuft.constants import TrainMetric
    from tpuft_workload.metrics_log import Prometheus

    @ray.remote(num_cpus=0)
    def set_gauges():
        Prometheus(True, "gauge-probe").add(7, {"loss": 1.5, "tokens_per_s": 1234.0, "step_time_s": 0.25, "mfu": None})

    ray.get(set_gauges.remote())   # the worker stays (Ray keeps idle workers) and pushes them
    port = ray._private.worker.global_worker.node.metrics_export_port
    want = {m.exported: v for m, v in ((TrainMetric.LOSS, 1.5), (TrainMetric.TOKENS_PER_SECOND, 1234.0),
                                       (TrainMetric.STEP_TIME_SECONDS, 0.25), (TrainMetric.STEP, 7.0))}
    deadline, got = time.monotonic() + 45, {}
    while time.monotonic() < deadline and got.keys() != want.keys():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        got = {ln.split("{", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("ray_tpuft_train_") and 'tpufinetune="gauge-probe"' in ln}
        time.sleep(1)
    assert got == want   # and no MFU series: None is not exported


def test_export_loads_and_generates(killed_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuft_workload.data import format_prompt

    export = killed_run[2]["export_uri"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(export))
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok(format_prompt({"instruction": "Tell me about the cow."}), return_tensors="pt")
    out = model.generate(input_ids=ids["input_ids"], max_new_tokens=12, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    assert len(new) > 0
    assert tok.decode(new, skip_special_tokens=True).strip()  # real words, not only specials


# A finished run resubmitted retrains nothing: tests/workload/test_train_resume.py (its retry picks
# the run's own newest checkpoint; resumed at the last step, nothing is left to do) and, through
# the RayJob's CLI, tests/workload/test_jax_train.py. Not a third Ray Train run here.


def test_too_little_data_fails_with_a_clear_reason(ray_cluster, tmp_path, capsys):
    args, target = _args(tmp_path, "too-small", dataset_split="train[:3]")
    assert train.run_training(args, target) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(train.RESULT_PREFIX))
    body = json.loads(line[len(train.RESULT_PREFIX):])
    assert body["succeeded"] is False
    assert "cannot fill one global batch" in body["error"] and "spec.training.batchSizePerDevice" in body["error"]
    assert body["error"].startswith("spec.dataset.name: ")   # on the driver, before any worker
