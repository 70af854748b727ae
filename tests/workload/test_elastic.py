"""An elastic resume (no Ray): a checkpoint of 2 slices resumes on 1 with twice the accumulation, and
one of 1 slice on 2, and training goes on as if the slice count had never changed.

Four spawned gloo ranks drive the real loop (tpuft_workload.loop.Run: restore, the data cursor, the
schedule, reports, checkpoints) over the real torch backend (train._Torch: FSDP2 / HSDP, AdamW,
token_mean_loss), the tiny Llama on packed dolly-mini rows, cosine schedule with warmup. Only Ray is
stood in for: the rows are passed in (not ray.get), a checkpoint is written by the project's DCP
save straight into the run directory and committed (not uploaded through ray.train.report), and the
status reporter is off. In one spawn, re-forming the process group between phases:

  1. world 2 (ranks 0, 1): ONE slice, mesh (2,), accumulation 2A, from scratch to the end, a
     checkpoint every CKPT_EVERY steps;
  2. world 4: TWO slices, mesh (2, 2) (HSDP), accumulation A, from scratch to the end; then the same
     layout resumed from phase 1's checkpoint at step CKPT_EVERY, copied into a run directory of its
     own (as a resubmitted job with the same run name finds it: find_latest_committed);
  3. world 2: one slice, accumulation 2A, resumed from phase 2's first run's checkpoint at step
     CKPT_EVERY through spec.checkpoint.resumeFrom (checkpoint.resolve_resume: its tpuft-run.json
     checked), and the same with accumulation A (a global batch of half the size): refused.

The global batch is workers x batch per device x accumulation = 4 x 1 x A = 2 x 1 x 2A: every
optimizer step takes the same rows (data.rank_batches: the step's slice of the epoch's permutation,
whoever holds them), and the objective is the global batch's mean loss per labelled token, so
every run's parameters agree up to float32 sums in another order. Also here: the driver's refusal of
another global batch before any worker starts (train.check_resume_batch), and the JAX path's Orbax
checkpoint of mesh (data, fsdp) = (2, 2) resumed on (1, 2), in a process of its own (four CPU devices).

Measured (2026-12-07, 2 cores, max abs over every parameter after 12 steps of 8 rows): two slices
resumed on one 1.19e-07 from the uninterrupted two, one resumed on two 1.19e-07 from the
uninterrupted one, the two layouts 1.58e-07 apart; training moved the parameters by more than 1e-2.
JAX, mesh (2, 2) resumed on (1, 2): 2.55e-07.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.factories import workload_run
from tests.ranks import file_rendezvous
from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import data as datalib
from tpuft_workload import loop, pipeline, tiny
from tpuft_workload.platform import PLATFORMS

WORLD_TWO_SLICES, SLICES = 4, 2
WORLD_ONE_SLICE = WORLD_TWO_SLICES // SLICES     # the slice that is left
ACCUMULATION = 2                                 # A on two slices; 2A on one
MAX_LEN, SEED, RECORDS = 64, 0, "train[:72]"
EPOCHS, CKPT_EVERY = 2, 3                        # the resume point lies in epoch 1; the runs cross into epoch 2
# float32 sums in another order, through AdamW (which divides by a small sqrt(v)) for every step
# after the resume: about 4x the largest difference measured (module docstring)
ELASTIC_PARAM_ATOL = 1e-6
ROW_ID = "row_id"   # a column of each row's index: which rows each step trained on


def _config(run_dir: Path, world: int, slices: int, accumulation: int, rows: int, resume: str = "") -> loop.TrainConfig:
    resume_from, manifest = ckptlib.resolve_resume(resume) if resume else ("", {})
    run = workload_run(tiny.BUILTIN_MODEL, slices=slices, checkpoint_every_steps=CKPT_EVERY, epochs=EPOCHS,
                       batch_size_per_device=1, max_seq_length=MAX_LEN, learning_rate=3e-3, report_every_steps=4,
                       seed=SEED, learning_rate_schedule="cosine", warmup_steps=2,
                       gradient_accumulation_steps=accumulation)
    return loop.TrainConfig(
        run=run, platform="cpu", rows=rows, examples=rows, pad_fraction=0.0, fault="", run_dir=str(run_dir),
        run_dir_local=str(run_dir), export_uri="", resume_from=resume_from, resume_manifest=manifest,
        cr_namespace="", cr_name="", status_every_s=0.0, peak_flops=None)


def no_ray_torch(worker: loop.Worker, rows: dict):
    """train._Torch, its Ray parts stood in for: rows given, DCP checkpoints written in place."""
    from tpuft_workload import train
    from tpuft_workload import model as modellib

    class NoRayTorch(train._Torch):
        def __init__(self, worker: loop.Worker):
            self.worker, self.cfg, self.rank, self.world = worker, worker.cfg, worker.rank, worker.world
            self.plat, self.device, self.peak_flops = PLATFORMS["cpu"], torch.device("cpu"), None
            torch.manual_seed(self.cfg.training.seed)
            self.tokenizer = modellib.load_tokenizer(self.cfg.run.model)
            self.rows, self.eval_rows = rows, None
            per_step = self.cfg.training.batch_size_per_device * self.cfg.training.gradient_accumulation_steps
            self.steps_per_epoch = datalib.steps_per_epoch(self.cfg.rows, self.world, per_step)
            self._model()
            self.vote = train._StopVote("gloo")
            self.seen: dict[int, list[int]] = {}   # optimizer step (1-based) -> this rank's row ids

        def step(self, micro_batches, learning_rate):
            ids = [int(i) for b in micro_batches for i in b.get(ROW_ID, ())]
            self.seen[len(self.seen) + 1] = ids
            return super().step(micro_batches, learning_rate)

        def save(self, path, name, train_state, metrics):
            ckptlib.save(self.model, self.opt, train_state, path, self.rank)
            loop.commit(self, self.rank, path)

        def load(self):
            path = ckptlib.find_latest_committed(self.cfg.run_dir) or self.cfg.resume_from
            if not path:
                return None
            return path, ckptlib.load(self.model, self.opt, path)

        def export(self):
            return None

    return NoRayTorch(worker)


def _train(rank: int, world: int, cfg: loop.TrainConfig, rows: dict) -> dict:
    """One run through loop.Run: its full parameters, loss history, mesh, the rows of each step (all
    ranks'), where it started and ended (every rank returns them; rank 0's are kept)."""
    from tpuft_workload.report import BackgroundReporter, StatusReporter

    worker = loop.Worker(cfg, rank, world, BackgroundReporter(StatusReporter("", "")))
    backend = no_ray_torch(worker, rows)
    run = loop.Run(worker, backend)
    run.restore()
    assert run.train() is False
    run.finish()
    params = {n: p.full_tensor().detach().clone() for n, p in backend.model.named_parameters()}   # collective
    seen: list = [None] * world
    dist.all_gather_object(seen, backend.seen)
    start = max(run.resumed_from, 0)   # the steps this run trained are start + 1, ...
    rows_per_step = {start + k: sorted(i for s in seen for i in s[k]) for k in seen[0]}
    history = [(p["step"], p["loss"]) for p in run.last_metrics["history"]]
    mesh = list(backend.model.model.embed_tokens.weight.device_mesh.shape)
    return {"params": params, "rows": rows_per_step, "history": history, "mesh": mesh, "step": run.step,
            "resumed_from": run.resumed_from, "global_batch": run.global_batch}


def _refused(rank: int, world: int, cfg: loop.TrainConfig, rows: dict) -> str:
    from tpuft_workload.report import BackgroundReporter, StatusReporter

    worker = loop.Worker(cfg, rank, world, BackgroundReporter(StatusReporter("", "")))
    run = loop.Run(worker, no_ray_torch(worker, rows))
    with pytest.raises(ckptlib.ResumeError) as refused:
        run.restore()
    return str(refused.value)


def _group(rank: int, world: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)


def _rank(rank: int, rendezvous: list[str], rows: dict, out: str) -> None:
    """One of four processes: the phases of the module docstring."""
    without_ray()
    started = time.perf_counter()
    root = Path(out)
    n = len(rows["n_real"])
    result: dict = {}
    one = partial(_config, world=WORLD_ONE_SLICE, slices=1, accumulation=2 * ACCUMULATION, rows=n)
    two = partial(_config, world=WORLD_TWO_SLICES, slices=SLICES, accumulation=ACCUMULATION, rows=n)
    ckpt = loop.ckpt_name(CKPT_EVERY)
    if rank < WORLD_ONE_SLICE:   # 1: one slice, from scratch
        _group(rank, WORLD_ONE_SLICE, rendezvous[0])
        result["one"] = _train(rank, WORLD_ONE_SLICE, one(root / "one"), rows)
        if rank == 0:   # a run directory holding the checkpoint at CKPT_EVERY as its newest
            shutil.copytree(root / "one" / ckpt, root / "one-to-two" / ckpt)
            shutil.copy(root / "one" / ckptlib.RUN_MANIFEST, root / "one-to-two" / ckptlib.RUN_MANIFEST)
        dist.destroy_process_group()
    _group(rank, WORLD_TWO_SLICES, rendezvous[1])   # 2: two slices
    result["two"] = _train(rank, WORLD_TWO_SLICES, two(root / "two"), rows)
    result["one-to-two"] = _train(rank, WORLD_TWO_SLICES, two(root / "one-to-two"), rows)
    dist.destroy_process_group()
    if rank < WORLD_ONE_SLICE:   # 3: the slice left, from the two slices' checkpoint
        _group(rank, WORLD_ONE_SLICE, rendezvous[2])
        resume = str(root / "two" / ckpt)
        result["two-to-one"] = _train(rank, WORLD_ONE_SLICE, one(root / "two-to-one", resume=resume), rows)
        half = _config(root / "half", WORLD_ONE_SLICE, 1, ACCUMULATION, n, resume=resume)
        result["refused"] = _refused(rank, WORLD_ONE_SLICE, half, rows)
        dist.destroy_process_group()
    if rank == 0:
        result["seconds"] = time.perf_counter() - started
        torch.save(result, root / "result.pt")


class NoGauge:
    def __init__(self, name, description, tag_keys):
        pass

    def set(self, value, tags):
        pass


def without_ray() -> None:
    """In a spawned rank: the loop's two calls into Ray (its metrics agent, its Train controller) made
    no-ops."""
    from tpuft_workload import metrics_log

    loop.Prometheus = partial(metrics_log.Prometheus, gauge=NoGauge)
    loop.report_to_ray = lambda metrics: None


def _rows() -> dict:
    from tests.workload.inprocess_data import build_blocks, load_records   # the parent's only (datasets)

    blocks = build_blocks(tiny.build_tokenizer(), load_records(tiny.BUILTIN_DATASET, RECORDS), MAX_LEN, packing=True)
    rows = pipeline.rows_of(blocks, np)
    rows[ROW_ID] = np.arange(len(blocks), dtype=np.int32)
    return rows


@pytest.fixture(scope="module")
def elastic(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("elastic")
    rows = _rows()
    rendezvous = [file_rendezvous(out) for _ in range(3)]   # one per process group the phases form
    mp.start_processes(_rank, args=(rendezvous, rows, str(out)), nprocs=WORLD_TWO_SLICES, start_method="spawn")
    result = torch.load(out / "result.pt")
    print(f"elastic: {len(rows['n_real'])} rows, the phases took {result['seconds']:.1f} s")
    return {**result, "n_rows": len(rows["n_real"]), "dir": out}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_the_layouts_are_what_they_say(elastic):
    assert elastic["one"]["mesh"] == [WORLD_ONE_SLICE] and elastic["two-to-one"]["mesh"] == [WORLD_ONE_SLICE]
    assert elastic["two"]["mesh"] == [SLICES, WORLD_ONE_SLICE] == elastic["one-to-two"]["mesh"]
    batches = {name: elastic[name]["global_batch"] for name in ("one", "two", "one-to-two", "two-to-one")}
    assert set(batches.values()) == {WORLD_TWO_SLICES * ACCUMULATION}, batches
    total = EPOCHS * (elastic["n_rows"] // (WORLD_TWO_SLICES * ACCUMULATION))
    for name in ("one", "two", "one-to-two", "two-to-one"):
        assert elastic[name]["step"] == total
    assert elastic["one"]["resumed_from"] == elastic["two"]["resumed_from"] == -1
    assert elastic["one-to-two"]["resumed_from"] == elastic["two-to-one"]["resumed_from"] == CKPT_EVERY


def test_every_step_trains_the_same_global_batch_on_one_slice_or_two(elastic):
    """The rows of each optimizer step (all ranks, all micro-batches) are a function of the step only."""
    two, one = elastic["two"]["rows"], elastic["one"]["rows"]
    assert two == one and len(two) == elastic["two"]["step"]
    assert all(len(r) == WORLD_TWO_SLICES * ACCUMULATION for r in two.values())
    assert elastic["two-to-one"]["rows"] == {s: r for s, r in two.items() if s > CKPT_EVERY}
    assert elastic["one-to-two"]["rows"] == {s: r for s, r in one.items() if s > CKPT_EVERY}
    for step in (1, CKPT_EVERY + 1):   # and it is the data module's own global batch of that step
        spe = elastic["n_rows"] // (WORLD_TWO_SLICES * ACCUMULATION)
        epoch, within = divmod(step - 1, spe)
        want = sorted(i for r in range(WORLD_ONE_SLICE)
                      for i in datalib.rank_batches(elastic["n_rows"], WORLD_ONE_SLICE, r, 2 * ACCUMULATION, epoch,
                                                    SEED)[within])
        assert two[step] == want


def test_two_slices_resumed_on_one_with_twice_the_accumulation_train_as_if_uninterrupted(elastic):
    diff = _max_diff(elastic["two-to-one"]["params"], elastic["two"]["params"])
    print(f"max |two-to-one - two| = {diff:.3g}")
    assert diff <= ELASTIC_PARAM_ATOL
    assert elastic["two-to-one"]["history"][-1] == pytest.approx(elastic["two"]["history"][-1], abs=2e-5)


def test_one_slice_resumed_on_two_with_half_the_accumulation_trains_as_if_uninterrupted(elastic):
    diff = _max_diff(elastic["one-to-two"]["params"], elastic["one"]["params"])
    print(f"max |one-to-two - one| = {diff:.3g}")
    assert diff <= ELASTIC_PARAM_ATOL


def test_one_slice_and_two_train_the_same_parameters(elastic):
    diff = _max_diff(elastic["one"]["params"], elastic["two"]["params"])
    print(f"max |one - two| = {diff:.3g}")
    assert diff <= ELASTIC_PARAM_ATOL


def test_training_moves_the_parameters_far_beyond_the_tolerance(elastic):
    """So the tests above can fail: the run moves every tensor's largest entry by much more."""
    fresh = {n: p.detach() for n, p in tiny.build_model(len(tiny.build_tokenizer()), seed=SEED).named_parameters()}
    assert _max_diff(fresh, elastic["two"]["params"]) > 100 * ELASTIC_PARAM_ATOL


def test_a_resume_at_another_global_batch_is_refused_with_what_to_do(elastic):
    msg = elastic["refused"]
    assert f"saved at a global batch of {WORLD_TWO_SLICES * ACCUMULATION} sequences" in msg
    assert f"this run's is {WORLD_ONE_SLICE * ACCUMULATION}" in msg and "gradientAccumulationSteps" in msg


def test_the_driver_refuses_a_resume_at_another_global_batch_before_any_worker_starts(tmp_path):
    """train.prepare's check (check_resume_batch): this run's newest committed checkpoint, else
    --resume-from's; one without a recorded global batch (an older release's) is not checked."""
    from tpuft_workload import train

    ckpt = tmp_path / "run" / loop.ckpt_name(3)
    ckpt.mkdir(parents=True)
    (ckpt / ckptlib.TRAIN_STATE).write_text(json.dumps({"step": 3, loop.GLOBAL_BATCH_STATE: 8}))
    train.check_resume_batch(str(tmp_path / "run"), "", 8, 1, 4, 1)   # not committed: nothing to resume
    (ckpt / ckptlib.COMMITTED).write_text("ok")
    train.check_resume_batch(str(tmp_path / "run"), "", 8, 1, 4, 1)   # 2 devices x 1 x 4, as saved
    with pytest.raises(ckptlib.ResumeError, match=r"global batch of 8 sequences .* this run's is 4 \(2 devices x 1 "
                                                  r"per device x 2 accumulated, 1 slice\(s\)\).* is 8"):
        train.check_resume_batch(str(tmp_path / "run"), "", 4, 1, 2, 1)
    with pytest.raises(ckptlib.ResumeError):   # the same checkpoint as --resume-from of a new run
        train.check_resume_batch(str(tmp_path / "new"), str(ckpt), 16, 2, 2, 2)
    (ckpt / ckptlib.TRAIN_STATE).write_text(json.dumps({"step": 3}))
    train.check_resume_batch(str(tmp_path / "run"), "", 4, 1, 2, 1)


def test_the_checkpoints_record_their_global_batch(elastic):
    state = json.loads((elastic["dir"] / "two" / loop.ckpt_name(CKPT_EVERY) / ckptlib.TRAIN_STATE).read_text())
    assert state[loop.GLOBAL_BATCH_STATE] == WORLD_TWO_SLICES * ACCUMULATION and state["step"] == CKPT_EVERY



# ---- JAX: an Orbax checkpoint of mesh (data, fsdp) = (2, 2) resumed on (1, 2) ------------------------
_JAX_TWO_TO_ONE = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
from functools import partial
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tests.workload.inprocess_data import build_blocks, load_records
from tpuft_workload import jax_checkpoint, jax_model as jm, jax_train as jt, pipeline, tiny

ckpt_dir, accumulation, steps, resume_at = sys.argv[1], 2, 4, 2
tok = tiny.build_tokenizer()
_, mcfg, host = jt.load_weights(tiny.BUILTIN_MODEL, tok, 0)
blocks = build_blocks(tok, load_records(tiny.BUILTIN_DATASET, "train[:72]"), 64, True)
rows = pipeline.rows_of(blocks, np)
rows = {**jm.inputs_from_rows(rows, True), "n_real": rows["n_real"].astype("int32")}
GLOBAL = 8   # rows per optimizer step, on either layout

def state_on(mesh):
    put = lambda a: jt._put(jax, a, NamedSharding(mesh, jt.param_spec(a.shape, mesh.shape["fsdp"])))
    params = {n: put(a) for n, a in host.items()}
    tx = jt.optimizer(host, 0.01, 1.0)
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, jt.param_spec(a.shape, mesh.shape["fsdp"])),
                             jax.eval_shape(tx.init, params))
    return tx, params, jax.jit(tx.init, out_shardings=shardings)(params)

def train(mesh, k, tx, params, opt, first, last):
    step = jax.jit(partial(jt.train_step, tx, mcfg, None, False))
    for s in range(first, last):
        rows_s = {n: v[s * GLOBAL:(s + 1) * GLOBAL] for n, v in rows.items()}
        micro = {n: v.reshape(k, GLOBAL // k, *v.shape[1:]) for n, v in rows_s.items()}
        batch = {n: jt._put(jax, v, NamedSharding(mesh, P(None, jt.MESH_AXES))) for n, v in micro.items()}
        params, opt, _, _ = step(params, opt, batch, np.float32(3e-3))
    return params, opt

devices = np.array(jax.devices())
two = Mesh(devices.reshape(2, 2), jt.MESH_AXES)
one = Mesh(devices[:2].reshape(1, 2), jt.MESH_AXES)
tx, params, opt = state_on(two)
params, opt = train(two, accumulation, tx, params, opt, 0, resume_at)
jax_checkpoint.save({"params": params, "opt_state": opt}, {"step": resume_at}, ckpt_dir, 0)
params, opt = train(two, accumulation, tx, params, opt, resume_at, steps)
want = {n: np.asarray(v) for n, v in params.items()}

tx1, params1, opt1 = state_on(one)
state, train_state = jax_checkpoint.load(jax_checkpoint.abstract({"params": params1, "opt_state": opt1}), ckpt_dir)
placed = {str(state["params"]["model.embed_tokens.weight"].sharding.mesh.shape)}
params1, opt1 = train(one, 2 * accumulation, tx1, state["params"], state["opt_state"], train_state["step"], steps)
got = {n: np.asarray(v) for n, v in params1.items()}
fresh = {n: np.asarray(v) for n, v in host.items()}
print(json.dumps({"max_abs_diff": max(float(np.abs(got[n] - want[n]).max()) for n in want),
                  "moved": max(float(np.abs(fresh[n] - want[n]).max()) for n in want),
                  "restored_on": sorted(placed), "step": train_state["step"]}))
"""


@pytest.fixture(scope="module", autouse=True)
def jax_two_to_one(tmp_path_factory):
    """The JAX run below, started before the torch ranks (autouse: first of the module's fixtures) so
    that it runs beside them; its output in files (a full pipe would stall it)."""
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("jax")
    with open(d / "stdout", "w") as out, open(d / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _JAX_TWO_TO_ONE, str(d / "ckpt")], stdout=out, stderr=err,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    yield proc, d
    if proc.poll() is None:   # a test failed before waiting for it: ours, ended by its handle
        proc.kill()
        proc.wait(timeout=10)


def test_a_jax_checkpoint_of_two_slices_resumes_on_one_with_twice_the_accumulation(jax_two_to_one):
    """JAX (jax_train's step, jax_checkpoint's save and load), four CPU devices in a process of its
    own: 2 steps on mesh (data, fsdp) = (2, 2) with 2 micro-batches of 4 rows, an Orbax checkpoint, 2
    more steps; the checkpoint restored onto (1, 2) (the slice left: Orbax places each array on the
    new mesh's shardings) and the same 2 steps as 4 micro-batches of 2 rows: the parameters of the
    uninterrupted run, up to float32 sums in another order."""
    proc, d = jax_two_to_one
    assert proc.wait(timeout=300) == 0, (d / "stderr").read_text()[-3000:]
    out = json.loads((d / "stdout").read_text().strip().splitlines()[-1])
    print(f"JAX: max |two-to-one - two| = {out['max_abs_diff']:.3g}, moved {out['moved']:.3g}")
    assert out["restored_on"] == ["OrderedDict([('data', 1), ('fsdp', 2)])"] and out["step"] == 2
    assert out["max_abs_diff"] <= ELASTIC_PARAM_ATOL < out["moved"] / 100
