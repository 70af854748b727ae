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
                             tiny_train_argv, workload_run)
from tpuft.api.spec import Evaluation
from tpuft_workload import __main__ as cli
from tpuft_workload import checkpoint, jax_checkpoint, jax_train, pipeline, train
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
    from tpuft.api.kuberay import RAY_TPU_RESOURCE_PER_CHIP_ENV

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
    """s3:// is refused as the CRD refuses it (the workload parses the same declaration), naming the
    field, before Ray starts."""
    def no_ray():
        raise AssertionError("the storage check must come before Ray starts")

    monkeypatch.setattr(cli, "_ray_init", no_ray)
    with pytest.raises(SystemExit) as exited:
        cli.main(tiny_train_argv(FRAMEWORK, "s3://bucket/ckpt", "run"))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "spec.checkpoint.storagePath" in err and "s3:// is not supported" in err


# ---- the recipe's step and optimizer (no Ray cluster needed) -----------------------------------------

MATRIX, NORM = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def tiny_model():
    """(ModelConfig, host params, 4 packed rows of 64 tokens as train_step's inputs)."""
    import numpy as np

    from tests.workload.inprocess_data import build_blocks, load_records
    from tpuft_workload import jax_model, pipeline, tiny

    tok = tiny.build_tokenizer()
    _, cfg, params = jax_model.from_torch(tiny.build_model(len(tok), seed=7))
    rows = pipeline.rows_of(build_blocks(tok, load_records(tiny.BUILTIN_DATASET, "train[:40]"), 64, True)[:4], np)
    return cfg, params, {**jax_model.inputs_from_rows(rows, True), "n_real": rows["n_real"].astype("int32")}


def _micro_batches(inputs: dict, k: int) -> dict:
    """The rows as k stacked micro-batches, in order."""
    return {key: v.reshape(k, -1, *v.shape[1:]) for key, v in inputs.items()}


def test_k_micro_batches_update_as_one_batch_k_times_larger(tiny_model):
    """train_step with plain SGD (no clip), whose update is the gradient times the rate: for k of 1
    and 2 the update is the rate it is given times the gradient of the mean loss over every labelled
    token of the whole batch (the micro-batches' counts differ, so a mean of their means would not
    match), with the same loss, counts and gradient norm. AdamW itself is not compared here: its
    first step, rate x g / (|g| + 1e-8), turns float-order noise in gradients near 1e-8 into
    differences of 1e-3 of the rate."""
    from functools import partial

    import jax
    import numpy as np
    import optax

    from tpuft_workload import jax_model

    cfg, params, inputs = tiny_model
    per_micro = [int(jax_model.labelled_tokens(m)) for m in _micro_batches(inputs, 2)["labels"]]
    assert per_micro[0] != per_micro[1]
    want_loss, want_grad = jax.jit(jax.value_and_grad(lambda p: jax_model.loss(p, cfg, inputs)))(params)
    sgd = optax.chain(optax.clip_by_global_norm(1e9), optax.inject_hyperparams(optax.sgd)(learning_rate=0.0))
    step = jax.jit(partial(jax_train.train_step, sgd, cfg, None, False))
    rate = 64.0   # a large step: the update stands well above float32 rounding of the params
    for k in (1, 2):
        after, _, sums, grad_norm = step(params, sgd.init(params), _micro_batches(inputs, k), np.float32(rate))
        assert int(sums["labelled"]) == sum(per_micro) and int(sums["real"]) == int(inputs["n_real"].sum())
        assert float(sums["loss_sum"]) / sum(per_micro) == pytest.approx(float(want_loss), rel=1e-5)
        assert float(grad_norm) == pytest.approx(float(optax.global_norm(want_grad)), rel=1e-5)
        for name, p in params.items():
            assert np.allclose((p - after[name]) / rate, want_grad[name], rtol=1e-4, atol=1e-8), (k, name)


def test_each_step_takes_the_rate_it_is_given():
    """The recipe's optimizer over two steps at two rates set by with_rate: optax's AdamW (the same
    mask, clip and decay) with each rate fixed for its step."""
    import numpy as np
    import optax

    from tpuft_workload import jax_model

    rng = np.random.default_rng(0)
    params = {MATRIX: rng.normal(size=(4, 4)).astype(np.float32), NORM: np.ones(4, np.float32)}
    grads = [{n: rng.normal(size=p.shape).astype(np.float32) for n, p in params.items()} for _ in range(2)]
    rates = (1e-2, 2e-3)
    tx = jax_train.optimizer(params, 0.1, 1.0)
    got, state = params, tx.init(params)
    for rate, g in zip(rates, grads):
        updates, state = tx.update(g, jax_train.with_rate(state, rate), got)
        got = optax.apply_updates(got, updates)
    want = params
    fixed = [optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(r, weight_decay=0.1, mask=jax_model.decay_mask(params))) for r in rates]
    reference_state = fixed[0].init(params)   # the rate is no part of AdamW's state
    for reference, g in zip(fixed, grads):
        updates, reference_state = reference.update(g, reference_state, want)
        want = optax.apply_updates(want, updates)
    for name, p in want.items():
        assert np.allclose(got[name], p, rtol=1e-6, atol=1e-7), name
    assert not np.allclose(want[MATRIX], params[MATRIX], atol=1e-3)


def test_with_zero_gradients_only_weight_matrices_shrink():
    """Decoupled decay, p *= 1 - rate x decay, on weight matrices; norms and the embedding table stay."""
    import numpy as np
    import optax

    params = {name: np.ones(shape, np.float32) for name, shape in (
        ("model.embed_tokens.weight", (8, 4)), ("model.norm.weight", (4,)), (NORM, (4,)), (MATRIX, (4, 4)),
        ("lm_head.weight", (8, 4)))}
    tx = jax_train.optimizer(params, 0.1, 1.0)
    state = jax_train.with_rate(tx.init(params), 0.5)
    updates, _ = tx.update({n: np.zeros_like(p) for n, p in params.items()}, state, params)
    after = optax.apply_updates(params, updates)
    shrunk = {n: float(np.asarray(after[n]).max()) for n in params if not np.allclose(after[n], params[n])}
    assert shrunk == {MATRIX: pytest.approx(0.95), "lm_head.weight": pytest.approx(0.95)}


def test_the_eval_set_is_scored_once_row_by_row_in_equal_batches_on_every_process():
    """5 rows on 2 processes x 2 rows: 2 global batches each; the fill rows score nothing."""
    import numpy as np

    from tpuft_workload.jax_model import IGNORE

    rows = {"n_real": np.arange(5), "labels": np.arange(5)[:, None].repeat(3, axis=1)}
    per_process = [list(pipeline.eval_batches(rows, 2, rank, 2)) for rank in (0, 1)]
    assert [len(b) for b in per_process] == [2, 2]
    scored = [int(i) for batches in per_process for b in batches for i, lab in zip(b["n_real"], b["labels"])
              if (lab != IGNORE).any()]
    assert sorted(scored) == [0, 1, 2, 3, 4]


# ---- the backend in this process (Ray only for the rows' object refs) ------------------------------

@pytest.fixture(scope="module")
def backend(ray_cluster, tmp_path_factory):
    """The JAX backend as one worker of one builds it: 9 training rows, micro-batches of 2 accumulated
    over 2 (2 steps an epoch), and 5 eval rows (not a whole number of batches)."""
    import numpy as np
    import ray

    from tests.workload.inprocess_data import build_blocks, load_records
    from tpuft_workload import loop, pipeline, tiny
    from tpuft_workload.report import BackgroundReporter, StatusReporter

    tok = tiny.build_tokenizer()
    blocks = build_blocks(tok, load_records(tiny.BUILTIN_DATASET, "train[:60]"), 64, True)
    train_rows, eval_rows = pipeline.rows_of(blocks[:9], np), pipeline.rows_of(blocks[9:14], np)
    run_dir = str(tmp_path_factory.mktemp("jax-backend"))
    run = workload_run(tiny.BUILTIN_MODEL, evaluation=Evaluation(fraction=0.1), epochs=1, batch_size_per_device=2,
                       max_seq_length=64, learning_rate=1e-2, report_every_steps=100, seed=0,
                       gradient_accumulation_steps=2)
    cfg = loop.TrainConfig(
        run=run, platform="cpu", rows=9, examples=9, pad_fraction=0.0, fault="", run_dir=run_dir,
        run_dir_local=run_dir, export_uri="", resume_from="", resume_manifest={}, cr_namespace="", cr_name="",
        status_every_s=10.0, peak_flops=None, rows_ref=ray.put(train_rows), eval_rows=5,
        eval_rows_ref=ray.put(eval_rows))
    backend = jax_train._Jax(loop.Worker(cfg, 0, 1, BackgroundReporter(StatusReporter("", ""))))
    return backend, train_rows, eval_rows


def _host(params) -> dict:
    import numpy as np

    return {n: np.array(p) for n, p in params.items()}


def test_a_step_takes_k_micro_batches_of_the_epochs_rows(backend):
    import numpy as np

    from tpuft_workload import jax_model, pipeline

    jax_backend, train_rows, _ = backend
    assert jax_backend.steps_per_epoch == 9 // (2 * 2) and jax_backend.global_batch_size == 2 * 2
    first = next(jax_backend.batches(0, 0))
    whole = next(pipeline.epoch_batches(train_rows, 1, 0, 4, 0, 0))   # one batch of k x b rows
    assert len(first) == 2 and all(len(m["n_real"]) == 2 for m in first)
    assert np.array_equal(np.concatenate([m["input_ids"] for m in first]), whole["input_ids"])
    s = jax_backend.step(first, 1e-2)
    assert s.padded == 2 * 2 * 64 and int(s.labelled) == int(jax_model.labelled_tokens(whole["labels"]))


def test_evaluate_is_the_loss_summed_over_every_eval_row_and_changes_nothing(backend):
    import jax
    import numpy as np

    from tpuft_workload import jax_model

    jax_backend, _, eval_rows = backend
    before = _host(jax_backend.params)
    loss_sum, labelled = jax_backend.evaluate()
    want_sum, want_count = jax.jit(lambda p: jax_model.loss_sums(p, jax_backend.mcfg, jax_model.inputs_from_rows(
        eval_rows, True)))(before)
    assert labelled == int(want_count) > 0
    assert loss_sum == pytest.approx(float(want_sum), rel=1e-5)
    assert all(np.array_equal(p, before[n]) for n, p in _host(jax_backend.params).items())


def test_load_from_restores_a_saved_checkpoint(backend, tmp_path):
    import numpy as np

    jax_backend, _, _ = backend
    jax_checkpoint.save(jax_backend._state(), {"step": 0}, str(tmp_path), 0)
    saved = _host(jax_backend.params)
    jax_backend.step(next(jax_backend.batches(0, 0)), 1e-2)
    assert not np.array_equal(_host(jax_backend.params)[MATRIX], saved[MATRIX])
    jax_backend.load_from(str(tmp_path))
    assert all(np.array_equal(p, saved[n]) for n, p in _host(jax_backend.params).items())


# ---- LoRA through the backend: a tiny Gemma 3 and a tiny Qwen 3 -------------------------------------

@pytest.mark.parametrize("family", ["gemma3-text", "qwen3"])
def test_lora_trains_a_saved_family_model_through_the_jax_backend(family, ray_cluster, tmp_path):
    """spec.training.method lora with framework jax on a from_pretrained() folder: only the adapters
    train (the base is bit for bit the same), the loss falls over 12 steps of the shipped data, an
    Orbax checkpoint holds the adapters and restores them, and the export is a PEFT adapter folder
    on that folder that PEFT loads with the backend's logits."""
    import numpy as np
    import ray
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.workload import jax_families
    from tests.workload.inprocess_data import build_blocks, load_records
    from tpuft.api.constants import LORA_DEFAULT_TARGET_MODULES
    from tpuft_workload import jax_model, loop, tiny
    from tpuft_workload.lora import LoraSettings
    from tpuft_workload.report import BackgroundReporter, StatusReporter

    tok = tiny.build_tokenizer()
    source = tmp_path / "model"
    jax_families.save(family, str(source), tokenizer=tok)
    rows = pipeline.rows_of(build_blocks(tok, load_records(tiny.BUILTIN_DATASET, "train[:40]"), 64, True)[:8], np)
    settings = LoraSettings(rank=8, alpha=16, dropout=0.05, target_modules=LORA_DEFAULT_TARGET_MODULES["qwen3"])
    run_dir = str(tmp_path / "run")
    run = workload_run(str(source), method="lora", epochs=1, batch_size_per_device=4, max_seq_length=64,
                       learning_rate=2e-2, report_every_steps=100, seed=0, gradient_accumulation_steps=2)
    cfg = loop.TrainConfig(
        run=run, platform="cpu", rows=8, examples=8, pad_fraction=0.0, fault="", run_dir=run_dir,
        run_dir_local=run_dir, export_uri="", resume_from="", resume_manifest={}, cr_namespace="", cr_name="",
        status_every_s=10.0, peak_flops=None, rows_ref=ray.put(rows), lora=settings)
    backend = jax_train._Jax(loop.Worker(cfg, 0, 1, BackgroundReporter(StatusReporter("", ""))))
    trainable, total = backend.parameter_counts
    assert 0 < trainable < total / 4 and all(".lora_" in n for n in backend.params)
    base_before = _host(backend.frozen)
    micro_batches = next(backend.batches(0, 0))
    losses = []
    for _ in range(12):
        s = backend.step(micro_batches, 2e-2)
        losses.append(float(s.loss_sum) / int(s.labelled))
    print(f"\n{family}: LoRA loss {losses[0]:.3f} -> {losses[-1]:.3f} in 12 steps")
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(np.array_equal(p, base_before[n]) for n, p in _host(backend.frozen).items())
    checkpoint_dir = str(tmp_path / "checkpoint")
    jax_checkpoint.save(backend._state(), {"step": 12}, checkpoint_dir, 0)
    saved = _host(backend.params)
    backend.step(micro_batches, 2e-2)
    backend.load_from(checkpoint_dir)
    assert set(saved) == set(backend.params) and all(np.array_equal(p, saved[n]) for n, p in _host(backend.params).items())

    export = backend.export()
    assert export == f"{run_dir}/export" and (Path(export) / "adapter_config.json").is_file()
    assert json.loads((Path(export) / "adapter_config.json").read_text())["base_model_name_or_path"] == str(source)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(source)), export).eval()
    batch = jax_model.inputs_from_rows(micro_batches[0], True)
    with torch.no_grad():
        want = loaded(input_ids=torch.as_tensor(batch["input_ids"]).long(),
                      position_ids=torch.as_tensor(batch["position_ids"]).long(), use_cache=False).logits.numpy()
    got = jax_model.forward({**_host(backend.frozen), **_host(backend.params)}, backend.mcfg, batch["input_ids"],
                            batch["position_ids"], batch["key_mask"], adapters=backend.adapters)
    assert np.abs(np.asarray(got) - want).max() <= 1e-4
