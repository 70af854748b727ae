"""JAX fine-tuning on 2 real CPU workers (JaxTrainer, one 2-process JAX program over gloo) with the
built-in tiny model and data.

One run covers: loss goes down over 2 epochs, a worker killed mid-epoch is restarted
(FailureConfig) and resumes from the last Orbax checkpoint with at most one interval lost, rank 0
reports status.training with the torch path's keys (to the session's loopback recorder) and writes
the torch path's TensorBoard scalars, and the export loads with AutoModelForCausalLM.from_pretrained
and generates. The RayJob's CLI path (`--framework jax`, its
driver log teed to --log-file) runs in the demo's JAX run on the real cluster (tests/cluster/
test_demo.py); resuming a finished run retrains nothing in tests/workload/test_train.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.factories import assert_export_generates, tensorboard_scalars
from tpuft_workload import __main__ as cli
from tpuft_workload import checkpoint, jax_checkpoint, jax_train, train
from tpuft_workload.platform import resolve_target
from tpuft_workload.report import TRAINING_KEYS

# 2 epochs of 7 steps (train[:80] packs into 62 rows): the kill lands in the second
EPOCHS = 2
CKPT_EVERY = 3
KILL_STEP = 8
NS, NAME = "ns", "tiny-jax"


def _argv(storage: Path | str, run: str, **extra) -> list[str]:
    argv = ["train", "--framework", "jax", "--accelerator", "cpu", "--topology", "2",
            "--model", "builtin:tiny-llama", "--dataset", "builtin:dolly-mini", "--dataset-split", "train[:80]",
            "--epochs", str(EPOCHS), "--batch-size-per-device", "4", "--max-seq-length", "128", "--learning-rate", "3e-3",
            "--storage-path", str(storage), "--run-name", run, "--report-every-steps", "100",
            "--checkpoint-every-steps", str(CKPT_EVERY), "--keep-checkpoints", "20"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


@pytest.fixture(scope="module")
def killed_run(status_recorder, ray_cluster, tmp_path_factory):
    status_recorder.take()
    storage = tmp_path_factory.mktemp("storage")
    args, target = cli.parse_args(_argv(storage, "tiny-jax-run", max_failures=1))
    mp = pytest.MonkeyPatch()
    mp.setenv("TPUFT_NAMESPACE", NS)
    mp.setenv("TPUFT_NAME", NAME)
    try:
        trainer, cfg = jax_train.build_trainer(args, target, fault_spec=f"kill-rank:1:step:{KILL_STEP}")
    finally:
        mp.undo()
    result = trainer.fit()
    return storage, args, cfg, result


def _summary(cfg) -> dict:
    return json.loads(Path(cfg["run_dir"], train.SUMMARY).read_text())


def test_killed_worker_resumes_from_last_orbax_checkpoint(killed_run):
    _, _, cfg, result = killed_run
    assert Path(cfg["run_dir"], f".tpuft-fault-kill-r1-s{KILL_STEP}").exists()  # the fault did fire
    s = _summary(cfg)
    assert s["step"] == s["totalSteps"] == result.metrics["total_steps"]
    per_epoch = s["totalSteps"] // EPOCHS
    done_before_kill = KILL_STEP - 1
    saved = [k for k in range(1, done_before_kill + 1) if k % CKPT_EVERY == 0 or k % per_epoch == 0]
    assert s["resumedFromStep"] == max(saved)                    # the newest checkpoint
    assert done_before_kill - s["resumedFromStep"] < CKPT_EVERY   # at most one interval lost
    assert s["resumedFrom"] == str(Path(cfg["run_dir"], f"checkpoint_step_{max(saved):07d}"))


def test_loss_decreases(killed_run):
    _, _, _, result = killed_run
    reported = sorted(((m["step"], m["loss"]) for _, m in result.best_checkpoints if "loss" in m))
    assert len(reported) >= 3 and reported[-1][0] == result.metrics["total_steps"]
    first, last = reported[0][1], reported[-1][1]
    assert last < first - 0.5, reported


def test_checkpoints_are_orbax_committed_in_place_and_marked_jax(killed_run):
    _, _, cfg, result = killed_run
    run_dir = Path(cfg["run_dir"])
    last = run_dir / f"checkpoint_step_{result.metrics['total_steps']:07d}"
    assert {jax_checkpoint.STATE_DIR, checkpoint.TRAIN_STATE, checkpoint.COMMITTED} <= set(os.listdir(last))
    assert Path(result.checkpoint.path) == last                  # registered with Ray where it lies
    manifest = json.loads((run_dir / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["architecture"]["framework"] == "jax"
    assert manifest["architecture"]["class"] == "LlamaForCausalLM"


def test_status_has_the_torch_paths_keys_written_by_rank_0(killed_run, status_recorder):
    _, _, cfg, result = killed_run
    patches = status_recorder.take()
    assert patches and all(set(p) <= set(TRAINING_KEYS) for p in patches)
    final = patches[-1]
    assert final["step"] == final["totalSteps"] == result.metrics["total_steps"] and final["epoch"] == EPOCHS
    assert final["exportedModel"] == cfg["export_uri"] and final["lastCheckpoint"].startswith(cfg["run_dir"])
    assert final["loss"] > 0 and final["tokensPerSecond"] > 0 and 0 <= final["padFraction"] < 0.1
    assert any(p.get("resumedFromStep") == _summary(cfg)["resumedFromStep"] for p in patches)
    assert final["history"][-1]["step"] == final["step"] and "mfu" not in final   # CPU: no peak, no MFU


def test_tensorboard_has_the_torch_paths_scalars_and_one_curve(killed_run):
    _, _, cfg, result = killed_run
    files, scalars = tensorboard_scalars(Path(cfg["run_dir"], "tensorboard"))
    assert files == 2 and {"train/loss", "train/grad_norm", "train/tokens_per_second"} <= set(scalars)
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == result.metrics["total_steps"]


def test_export_loads_and_generates(killed_run):
    assert_export_generates(killed_run[2]["export_uri"])


# ---- no Ray cluster needed ----------------------------------------------------------------------

@pytest.mark.parametrize("acc,topo,workers,ray_type", [("v6e", "4x4", 4, "TPU-V6E"), ("tpu7x", "2x2x2", 2, "TPU-V7X")])
def test_tpu_scaling_is_one_worker_per_host(acc, topo, workers, ray_type, monkeypatch):
    from tpuft.constants import RAY_TPU_RESOURCE_PER_CHIP_ENV

    monkeypatch.delenv(RAY_TPU_RESOURCE_PER_CHIP_ENV, raising=False)
    sc = jax_train.scaling_config(resolve_target(acc, topo))
    assert (sc.use_tpu, sc.topology, sc.accelerator_type, sc.num_workers) == (True, topo, ray_type, workers)


def test_cpu_scaling_is_the_topologys_worker_count():
    sc = jax_train.scaling_config(resolve_target("cpu", "2"))
    assert (sc.use_tpu, sc.num_workers, sc.resources_per_worker) == (False, 2, {"CPU": 1})


@pytest.mark.parametrize("shape,shards,spec", [((204, 64), 2, ("fsdp",)), ((64,), 4, ("fsdp",)),
                                               ((3, 8), 4, (None, "fsdp")), ((3,), 2, ())])
def test_parameters_shard_on_their_first_divisible_dimension(shape, shards, spec):
    assert tuple(jax_train.param_spec(shape, shards)) == spec


def test_a_torch_checkpoint_is_refused_by_the_jax_path():
    import numpy as np

    params = {"model.embed_tokens.weight": np.zeros((4, 2))}
    jax_arch = jax_checkpoint.architecture("LlamaForCausalLM", params)
    torch_arch = {k: v for k, v in jax_arch.items() if k != "framework"}
    with pytest.raises(checkpoint.ResumeError, match="different model architecture"):
        checkpoint.check_architecture("/ckpt/checkpoint_step_0000001", {"architecture": torch_arch}, jax_arch,
                                      "builtin:tiny-llama")


def test_an_object_store_path_orbax_cannot_reach_fails_before_ray(monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")

    def no_ray():
        raise AssertionError("the storage check must come before Ray starts")

    monkeypatch.setattr(cli, "_ray_init", no_ray)
    assert cli.main(_argv("s3://bucket/ckpt", "run")) == 1
    out = capsys.readouterr().out
    assert "s3fs is not installed" in out and "spec.checkpoint.storagePath" in out
