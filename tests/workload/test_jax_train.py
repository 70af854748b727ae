"""JAX fine-tuning on 2 real CPU workers (JaxTrainer, one 2-process JAX program over gloo) with the
built-in tiny model and data, through the RayJob's CLI path (`jax_train.run_training`).

One run (`killed_run`, tests/workload/conftest.py: the torch path's tests start from the same
fixture) covers: loss goes down over 2 epochs, a worker killed mid-epoch is restarted
(FailureConfig) and resumes from the last Orbax checkpoint with at most one interval lost, rank 0
reports status.training with the torch path's keys (to the session's loopback recorder) and writes
the torch path's TensorBoard scalars, and the export loads with AutoModelForCausalLM.from_pretrained
and generates. The demo's JAX run takes the same path on the real cluster (tests/cluster/
test_demo.py, its driver log teed to --log-file); resuming a finished run retrains nothing in
tests/workload/test_train.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.factories import (TINY_EPOCHS, TINY_STEPS_PER_EPOCH, assert_export_generates, tensorboard_scalars,
                             tiny_train_argv)
from tpuft_workload import __main__ as cli
from tpuft_workload import checkpoint, jax_checkpoint, jax_train, train
from tpuft_workload.platform import resolve_target
from tpuft_workload.report import TRAINING_KEYS

FRAMEWORK, NAME = "jax", "tiny-jax"   # killed_run's
EPOCHS, TOTAL = TINY_EPOCHS, TINY_EPOCHS * TINY_STEPS_PER_EPOCH
KILL_STEP = 8   # in the second epoch: resumed from step 7, the first epoch's end


def _summary(run) -> dict:
    return json.loads((run.run_dir / train.SUMMARY).read_text())


def _result(run):
    """Ray Train's Result of the run, as its controller left it in the run directory."""
    from ray.train import Result

    return Result.from_path(run.run_dir)


def test_killed_worker_resumes_from_last_orbax_checkpoint(killed_run):
    assert killed_run.rc == 0 and killed_run.body["succeeded"], killed_run.body
    killed_run.assert_resumed_after_kill(KILL_STEP)
    s = _summary(killed_run)
    assert s["step"] == s["totalSteps"] == TOTAL and s["resumedFromStep"] == killed_run.body["resumedFromStep"]


def test_loss_decreases(killed_run):
    result = _result(killed_run)
    reported = sorted(((m["step"], m["loss"]) for _, m in result.best_checkpoints if "loss" in m))
    assert len(reported) >= 3 and reported[-1][0] == TOTAL
    first, last = reported[0][1], reported[-1][1]
    assert last < first - 0.5, reported


def test_checkpoints_are_orbax_committed_in_place_and_marked_jax(killed_run):
    result = _result(killed_run)
    last = killed_run.run_dir / f"checkpoint_step_{TOTAL:07d}"
    assert {jax_checkpoint.STATE_DIR, checkpoint.TRAIN_STATE, checkpoint.COMMITTED} <= set(os.listdir(last))
    assert Path(result.checkpoint.path) == last                  # registered with Ray where it lies
    manifest = json.loads((killed_run.run_dir / checkpoint.RUN_MANIFEST).read_text())
    assert manifest["architecture"]["framework"] == "jax"
    assert manifest["architecture"]["class"] == "LlamaForCausalLM"


def test_status_has_the_torch_paths_keys_written_by_rank_0(killed_run):
    patches = killed_run.patches
    assert patches and all(set(p) <= set(TRAINING_KEYS) for p in patches)
    final = patches[-1]
    assert final["step"] == final["totalSteps"] == TOTAL and final["epoch"] == EPOCHS
    assert final["exportedModel"] == str(killed_run.run_dir / checkpoint.EXPORT_DIR)
    assert final["lastCheckpoint"].startswith(str(killed_run.run_dir))
    assert final["loss"] > 0 and final["tokensPerSecond"] > 0 and 0 <= final["padFraction"] < 0.1
    assert final["history"][-1]["step"] == final["step"] and "mfu" not in final   # CPU: no peak, no MFU


def test_tensorboard_has_the_torch_paths_scalars_and_one_curve(killed_run):
    files, scalars = tensorboard_scalars(killed_run.run_dir / "tensorboard")
    assert files == 2 and {"train/loss", "train/grad_norm", "train/tokens_per_second"} <= set(scalars)
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == TOTAL


def test_export_loads_and_generates(killed_run):
    assert_export_generates(killed_run.run_dir / checkpoint.EXPORT_DIR)


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
    assert cli.main(tiny_train_argv(FRAMEWORK, "s3://bucket/ckpt", "run")) == 1
    out = capsys.readouterr().out
    assert "s3fs is not installed" in out and "spec.checkpoint.storagePath" in out
