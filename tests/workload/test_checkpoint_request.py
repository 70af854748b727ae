"""The operator's checkpoint request (no Ray): status.recovery.checkpointRequestedAt, read from the
API server's answer to rank 0's status patch, makes every rank save a committed checkpoint at the
next step boundary; training goes on to the end, and rank 0 answers in
status.training.checkpointRequestSaved with that checkpoint as lastCheckpoint.

Two spawned gloo ranks run the real loop over the real torch backend (tests/workload/test_elastic.py's
no_ray_torch: only Ray stood in for). Rank 0's status goes through the real StatusReporter to a fake
API client that merges each patch into an object and answers with the whole object, as the API
server does; the operator's side is played by that object: it asks at REQUEST_STEP, and again, with
a new time, at SECOND_REQUEST_STEP. The status is sent synchronously here (the real run sends it from
BackgroundReporter's thread: its part is tested on its own below), so the step boundary that answers
is exactly the one after the patch that carried the request.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.ranks import file_rendezvous, free_port
from tests.factories import merge_patch, workload_run
from tests.workload.test_elastic import no_ray_torch, without_ray
from tpuft.api.constants import TrainingStatus
from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import loop, pipeline, report, tiny

WORLD, MAX_LEN, SEED, RECORDS = 2, 64, 0, "train[:48]"
REQUEST_STEP, SECOND_REQUEST_STEP = 2, 6      # the operator asks once the object says step >= these
FIRST, SECOND = "2026-12-07T01:00:00Z", "2026-12-07T01:05:00Z"
SAVED = TrainingStatus.CHECKPOINT_REQUEST_SAVED.value


class FakeApi:
    """The TPUFinetune's status subresource: each patch merged, the whole object answered. The
    operator's requests (`asks`: (step, time)) appear once the object's training step reaches them."""

    def __init__(self, asks: list[tuple[int, str]], status: dict | None = None):
        self.asks = asks
        self.object = {"apiVersion": "tpuft.dev/v1", "kind": "TPUFinetune", "status": copy.deepcopy(status or {})}
        self.patches: list[dict] = []
        self.reads = 0   # GETs

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **kwargs):
        self.patches.append(copy.deepcopy(body["status"]["training"]))
        merge_patch(self.object, copy.deepcopy(body))   # as the API server does
        return self._answer()

    def get_namespaced_custom_object_status(self, group, version, namespace, plural, name, **kwargs):
        self.reads += 1
        return self._answer()

    def _answer(self) -> dict:
        """The object, with the operator's request once its training step reached one."""
        step = self.object["status"].get("training", {}).get("step") or 0
        for at, when in self.asks:
            if step >= at:
                self.object["status"].setdefault("recovery", {})["checkpointRequestedAt"] = when
        return copy.deepcopy(self.object)


class SyncReporter:
    """BackgroundReporter's interface over a StatusReporter, sent in the calling thread."""

    def __init__(self, reporter: report.StatusReporter):
        self.reporter = reporter

    @property
    def enabled(self) -> bool:
        return self.reporter.enabled

    def training(self, **fields) -> None:
        self.reporter.training(**fields)

    def checkpoint_request(self) -> str | None:
        requests = self.reporter.requests
        return requests.unanswered if requests else None

    def close(self) -> None:
        pass


def _config(run_dir: Path, rows: int) -> loop.TrainConfig:
    run = workload_run(tiny.BUILTIN_MODEL, epochs=1, batch_size_per_device=1, max_seq_length=MAX_LEN,
                       learning_rate=3e-3, report_every_steps=1, seed=SEED)
    return loop.TrainConfig(
        run=run, platform="cpu", rows=rows, examples=rows, pad_fraction=0.0, fault="", run_dir=str(run_dir),
        run_dir_local=str(run_dir), export_uri="", resume_from="", resume_manifest={}, cr_namespace="ns",
        cr_name="run", status_every_s=0.0, peak_flops=None)


def _rank(rank: int, rendezvous: str, rows: dict, out: str) -> None:
    without_ray()
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    cfg = _config(Path(out) / "run", len(rows["n_real"]))
    status = report.StatusReporter("ns", "run") if rank == 0 else report.StatusReporter("", "")
    api = status._api = FakeApi([(REQUEST_STEP, FIRST), (SECOND_REQUEST_STEP, SECOND)])
    worker = loop.Worker(cfg, rank, WORLD, SyncReporter(status))
    backend = no_ray_torch(worker, rows)
    saved_steps: list[int] = []
    save = backend.save

    def save_and_note(path, name, train_state, metrics):
        saved_steps.append(train_state["step"])
        save(path, name, train_state, metrics)
    backend.save = save_and_note
    run = loop.Run(worker, backend)
    run.restore()
    assert run.train() is False
    run.finish()
    every: list = [None] * WORLD
    dist.all_gather_object(every, saved_steps)
    if rank == 0:
        torch.save({"saved": every, "patches": api.patches, "object": api.object, "step": run.step,
                    "total": run.total_steps}, Path(out) / "result.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def requested(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    from tests.workload.inprocess_data import build_blocks, load_records

    out = tmp_path_factory.mktemp("request")
    rows = pipeline.rows_of(build_blocks(tiny.build_tokenizer(), load_records(tiny.BUILTIN_DATASET, RECORDS),
                                         MAX_LEN, packing=True), np)
    rendezvous = file_rendezvous(out)
    mp.start_processes(_rank, args=(rendezvous, rows, str(out)), nprocs=WORLD, start_method="spawn")
    return {**torch.load(out / "result.pt"), "dir": out / "run"}


def test_every_rank_saves_at_the_step_boundary_after_the_request_and_trains_on(requested):
    total = requested["total"]
    assert total > SECOND_REQUEST_STEP + 2 and requested["step"] == total   # trained to the end
    # the patch of step R carried the request back: saved after step R + 1; the epoch's end (the
    # only scheduled save: checkpoint_every_steps 0) as usual
    want = [REQUEST_STEP + 1, SECOND_REQUEST_STEP + 1, total]
    assert requested["saved"] == [want] * WORLD
    for step in want[:2]:
        ckpt = requested["dir"] / loop.ckpt_name(step)
        assert (ckpt / ckptlib.COMMITTED).is_file() and (ckpt / ckptlib.TRAIN_STATE).is_file()
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(WORLD)]


def test_each_request_is_answered_once_with_its_checkpoint(requested):
    patches = requested["patches"]
    answers = [(p["step"], p[SAVED], p["lastCheckpoint"]) for p in patches if SAVED in p]
    first = [a for a in answers if a[1] == FIRST]
    second = [a for a in answers if a[1] == SECOND]
    ckpt = str(requested["dir"] / loop.ckpt_name(REQUEST_STEP + 1))
    assert first[0] == (REQUEST_STEP + 1, FIRST, ckpt)   # with the checkpoint that answers it
    assert second[0] == (SECOND_REQUEST_STEP + 1, SECOND, str(requested["dir"] / loop.ckpt_name(SECOND_REQUEST_STEP + 1)))
    assert all(a[0] < SECOND_REQUEST_STEP + 1 for a in first) and answers[-1][1] == SECOND
    assert not any(SAVED in p for p in patches if p.get("step", 0) <= REQUEST_STEP)
    training = requested["object"]["status"]["training"]
    assert training[SAVED] == SECOND == requested["object"]["status"]["recovery"]["checkpointRequestedAt"]


# ---- the loop and the reporter, without ranks --------------------------------------------------------
class CountingBackend:
    """tests/workload/test_loop.py's kind of fake: the loop's calls, no model."""
    steps_per_epoch, flops_per_token, peak_flops = 6, 1.0, None

    def __init__(self):
        self.saved: list[int] = []
        self.wanted: list[int] = []   # steps at which rank 0 asked for a checkpoint

    def batches(self, epoch, skip):
        return iter(range(skip, self.steps_per_epoch))

    def step(self, micro_batches, learning_rate):
        return loop.Step(loss_sum=1.0, labelled=1, real=1, padded=1, grad_norm=1.0)

    def totals(self, values):
        return [float(v) for v in values]

    def agree(self, step, checkpoint_wanted):
        if checkpoint_wanted:
            self.wanted.append(step)
        return loop.Agreement(stop=False, checkpoint=checkpoint_wanted)

    def save(self, path, name, train_state, metrics):
        self.saved.append(train_state["step"])

    def load(self):
        return None

    def barrier(self):
        pass

    def export(self):
        return None


def _loop_run(tmp_path, status: dict, monkeypatch) -> tuple[CountingBackend, FakeApi]:
    from functools import partial

    from tpuft_workload.metrics_log import Prometheus
    from tests.workload.test_elastic import NoGauge

    monkeypatch.setattr(loop, "report_to_ray", lambda metrics: None)
    monkeypatch.setattr(loop, "Prometheus", partial(Prometheus, gauge=NoGauge))
    reporter = report.StatusReporter("ns", "run")
    api = reporter._api = FakeApi([(0, FIRST)], status)
    backend = CountingBackend()
    cfg = _config(tmp_path, 6)
    run = loop.Run(loop.Worker(cfg, 0, 1, SyncReporter(reporter)), backend)
    run.restore()
    run.train()
    run.finish()
    return backend, api


def test_a_request_answered_before_this_attempt_is_not_answered_again(tmp_path, monkeypatch):
    """A resumed attempt finds its request answered in the object (by the attempt before it)."""
    backend, api = _loop_run(tmp_path, {"training": {SAVED: FIRST}}, monkeypatch)
    assert backend.wanted == [] and backend.saved == [6]   # the epoch's end only


def test_a_request_unanswered_in_the_object_is_answered(tmp_path, monkeypatch):
    """The control of the test above: the same object without the answer."""
    backend, api = _loop_run(tmp_path, {}, monkeypatch)
    assert backend.wanted == [2] and backend.saved == [2, 6]   # the first patch (step 1) answered with it
    assert api.object["status"]["training"][SAVED] == FIRST


def test_the_background_reporter_reads_the_request_from_the_patch_answer():
    """BackgroundReporter's thread keeps the answer; checkpoint_request() reads it: nothing before a
    patch, the request after one, nothing once the object holds its answer."""
    import time

    status = report.StatusReporter("ns", "run")
    api = status._api = FakeApi([(1, FIRST)])
    background = report.BackgroundReporter(status)
    assert background.checkpoint_request() is None
    background.training(step=1)
    deadline = time.monotonic() + 10
    while background.checkpoint_request() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert background.checkpoint_request() == FIRST
    background.training(step=2, **{SAVED: FIRST})
    background.close()
    assert background.checkpoint_request() is None and len(api.patches) == 2


def test_requests_of_an_answer_that_is_not_an_object_keep_the_last_known():
    assert report.Requests.of(None) is None
    got = report.Requests.of({"status": {"recovery": {"checkpointRequestedAt": FIRST}, "training": {}}})
    assert got.unanswered == FIRST
    assert report.Requests.of({"status": {}}).unanswered is None


def test_an_idle_background_reporter_reads_the_request_without_a_patch():
    """No patch for poll_s: the thread reads the status (one GET per idle poll_s), and the request
    is seen all the same."""
    import time

    status = report.StatusReporter("ns", "run")
    api = status._api = FakeApi([(0, FIRST)])
    background = report.BackgroundReporter(status, poll_s=0.05)
    deadline = time.monotonic() + 10
    while background.checkpoint_request() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    background.close()
    assert background.checkpoint_request() == FIRST and api.reads >= 1 and api.patches == []


# ---- JAX: rank 0's wish reaches every process at the same step ---------------------------------------
_JAX_VOTE = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
from tpuft_workload import jax_train
vote = jax_train._StopVote(jax)
seen = []
for step in range(1, 6):
    a = vote.agreed(step, rank == 0 and step == 3)
    seen.append([a.stop, a.checkpoint])
print(json.dumps({"rank": rank, "sync": vote.sync, "seen": seen}))
"""


def test_the_jax_vote_tells_every_process_at_the_step_rank_0_wanted_it(tmp_path):
    """Two JAX processes (jax.distributed over loopback, gloo collectives on CPU): rank 0 wants a
    checkpoint at step 3 only; jax_train._StopVote says so to both, at step 3 and no other."""
    import json
    import os
    import subprocess
    import sys
    import time

    port = free_port()   # the JAX coordinator's, bound by process 0 at once
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _JAX_VOTE, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(WORLD)]
    # Bounded: a hung collective ends the test. 24 s alone; a clean-clone CI run beside the real
    # node's training (this lane niced) passed 120 s.
    deadline = time.monotonic() + 300
    try:
        done = [proc.communicate(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:   # only those still running (a hung collective): ours, by their handles
            if proc.poll() is None:
                proc.kill()
        tails = [f"process {rank}: {proc.communicate(timeout=10)[1][-1500:]}" for rank, proc in enumerate(procs)]
        pytest.fail("the two JAX processes did not finish within 300 s:\n" + "\n".join(tails))
    outs = []
    for proc, (out, err) in zip(procs, done):
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    want = [[False, step == 3] for step in range(1, 6)]
    assert [o["seen"] for o in outs] == [want] * WORLD and all(o["sync"] for o in outs)


def test_the_jax_vote_of_one_process_is_its_own_wish():
    from types import SimpleNamespace

    from tpuft_workload import jax_train

    vote = jax_train._StopVote(SimpleNamespace(process_count=lambda: 1))
    assert vote.agreed(3, True) == loop.Agreement(stop=False, checkpoint=True)
    assert vote.agreed(4, False) == loop.Agreement(stop=False, checkpoint=False)


class _Conditions:
    """A StatusReporter's condition() answering from a script (None: not read)."""
    enabled = True

    def __init__(self, *answers):
        self.answers, self.reads = list(answers), 0

    def condition(self, ctype):
        assert ctype == "CollectivesVerified"
        self.reads += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_a_training_job_submitted_beside_the_verification_waits_for_it():
    from tpuft_workload.train import wait_for_verification

    clock = iter(range(1000))
    tick = lambda: next(clock)   # noqa: E731 - a second per read
    waits = _Conditions(("Unknown", "RayJob submitted"), None, ("Unknown", ""), ("True", "passed"))
    assert wait_for_verification(waits, 60, clock=tick, sleep=lambda s: None) is None and waits.reads == 4
    failed = _Conditions(("Unknown", ""), ("False", "rank 1 (slice 0): all_reduce mismatch"))
    reason = wait_for_verification(failed, 60, clock=tick, sleep=lambda s: None)
    assert reason and "verification failed" in reason and "all_reduce mismatch" in reason
    never = _Conditions(("Unknown", ""))
    reason = wait_for_verification(never, 5, clock=tick, sleep=lambda s: None)
    assert reason and "did not pass within 5s" in reason


def test_after_verification_is_a_flag_of_train_not_of_the_document():
    from tpuft_workload.__main__ import parse_args

    command, _ = parse_args(["train", "--spec", '{"accelerator": "cpu", "topology": "2", "model": "builtin:tiny-llama",'
                             ' "dataset": {"name": "builtin:dolly-mini"}, "checkpoint": {"storagePath": "/tmp/x"}}',
                             "--run-name", "r", "--after-verification"])
    assert command.after_verification
    command, _ = parse_args(["train", "--spec", '{"accelerator": "cpu", "topology": "2", "model": "builtin:tiny-llama",'
                             ' "dataset": {"name": "builtin:dolly-mini"}, "checkpoint": {"storagePath": "/tmp/x"}}',
                             "--run-name", "r"])
    assert not command.after_verification
