"""tpuft_workload.loop without Ray or a framework: `Run` over a fake backend. When it reports, saves,
resumes and stops is what both trainers do; the real runs (2 CPU workers, a killed rank) are
tests/workload/test_train.py and test_jax_train.py."""
from __future__ import annotations

import json
import math
from functools import partial

import pytest

from tpuft_workload import loop, preemption
from tpuft_workload.metrics_log import Prometheus

SPE, EPOCHS, CKPT_EVERY = 7, 2, 3
TOTAL = SPE * EPOCHS


class FakeBackend:
    """Step k: mean loss 2.0 - 0.1 k over k labelled tokens, 12 of 16 tokens real, gradient norm 1.5."""
    steps_per_epoch = SPE
    flops_per_token = 1e6
    peak_flops = None

    def __init__(self, stop_at: int = -1, restored: tuple[str, dict] | None = None):
        self.stop_at, self.restored = stop_at, restored
        self.saved: list[tuple[str, dict, dict]] = []   # (name, train_state, metrics)
        self.epochs: list[tuple[int, int]] = []         # (epoch, skip) of each batches() call
        self.steps = 0

    def batches(self, epoch, skip):
        self.epochs.append((epoch, skip))
        return iter(range(skip, SPE))

    def step(self, batch):
        self.steps += 1
        k = self.steps
        return loop.Step(loss_sum=(2.0 - 0.1 * k) * k, labelled=k, real=12, padded=16, grad_norm=1.5)

    def totals(self, values):
        return [float(v) for v in values]

    def stop_agreed(self, step):
        return step == self.stop_at

    def save(self, path, name, train_state, metrics):
        self.saved.append((name, train_state, metrics))

    def load(self):
        return self.restored

    def barrier(self):
        pass

    def export(self):
        return "/export"


class FakeReporter:
    enabled = True

    def __init__(self):
        self.patches: list[dict] = []

    def training(self, **fields):
        self.patches.append(fields)

    def close(self):
        pass


class FakeGauge:
    def __init__(self, name, description, tag_keys):
        self.name = name

    def set(self, value, tags):
        pass


@pytest.fixture
def make_run(tmp_path, monkeypatch):
    """(Run over a FakeBackend, the metrics it reported to Ray without a checkpoint); rank 0."""
    ray_reports: list[dict] = []
    monkeypatch.setattr(loop, "report_to_ray", ray_reports.append)
    monkeypatch.setattr(loop, "Prometheus", partial(Prometheus, gauge=FakeGauge))
    monkeypatch.setattr(preemption, "write_marker", lambda step, ckpt: None)

    def make(backend: FakeBackend, report_every: int = 100, epochs: int = EPOCHS):
        cfg = loop.TrainConfig(
            platform="cpu", model="m", rows=56, examples=60, pad_fraction=0.25, epochs=epochs,
            batch_size_per_device=4, max_seq_length=4, learning_rate=3e-3, packing=True,
            checkpoint_every_steps=CKPT_EVERY, report_every_steps=report_every, seed=0, fault="",
            run_dir=str(tmp_path), run_dir_local=str(tmp_path), export_uri="/export", resume_from="",
            resume_manifest={}, cr_namespace="ns", cr_name="run", status_every_s=0.0, peak_flops=None)
        return loop.Run(loop.Worker(cfg, 0, 2, FakeReporter()), backend), ray_reports
    return make


def _steps(saved) -> list[int]:
    return [ts["step"] for _, ts, _ in saved]


def test_checkpoints_at_every_interval_and_epoch_end_then_the_summary(make_run, tmp_path, capsys):
    backend = FakeBackend()
    run, ray_reports = make_run(backend)
    run.restore()
    assert run.train() is False
    run.finish()
    assert _steps(backend.saved) == [3, 6, 7, 9, 12, 14]   # every 3 steps, and each epoch's end
    assert ray_reports == []   # reports every 100 steps: only with the checkpoints
    name, train_state, metrics = backend.saved[2]
    assert name == "checkpoint_step_0000007" and train_state["path"] == str(tmp_path / name)
    assert (train_state["epoch"], metrics["epoch"], metrics["epoch_time_s"] > 0) == (1, 1, True)
    assert train_state["metrics"]["history"][-1]["step"] == 7 and "stopped" not in metrics
    summary = json.loads((tmp_path / loop.SUMMARY).read_text())
    assert (summary["step"], summary["totalSteps"], summary["resumedFromStep"]) == (TOTAL, TOTAL, -1)
    assert summary["lastCheckpoint"] == str(tmp_path / "checkpoint_step_0000014") and "resumedFrom" not in summary
    final = run.reporter.patches[-1]
    assert (final["epoch"], final["step"], final["exportedModel"]) == (EPOCHS, TOTAL, "/export")
    out = capsys.readouterr().out
    assert "Epoch 1/2 | step 3/14 | loss=" in out and "Epoch 2/2 | loss=" in out


def test_an_epochs_report_averages_its_labelled_tokens(make_run):
    backend = FakeBackend()
    run, _ = make_run(backend, epochs=1)
    run.train()
    _, _, metrics = backend.saved[-1]   # the epoch's end: steps 1..7, step k weighing its k tokens
    assert metrics["epoch_loss"] == pytest.approx(sum((2.0 - 0.1 * k) * k for k in range(1, 8)) / sum(range(1, 8)))
    assert metrics["grad_norm"] == pytest.approx(1.5) and metrics["pad_fraction"] == pytest.approx(0.25)


def test_reports_between_checkpoints_go_to_ray_without_one(make_run):
    backend = FakeBackend()
    run, ray_reports = make_run(backend, report_every=2, epochs=1)
    run.train()
    assert [m["step"] for m in ray_reports] == [2, 4]   # 6 is a checkpoint's, 7 the epoch end's
    assert _steps(backend.saved) == [3, 6, 7]
    assert all(m["total_steps"] == SPE and m["resumed_from_step"] == -1 for m in ray_reports)


def test_a_stop_agreed_saves_that_step_and_ends_without_an_export(make_run, tmp_path):
    backend = FakeBackend(stop_at=10)
    run, _ = make_run(backend)
    assert run.train() is True
    run.stop()
    assert _steps(backend.saved) == [3, 6, 7, 9, 10] and backend.steps == 10
    assert backend.saved[-1][2]["stopped"] == preemption.REASON
    last = run.reporter.patches[-1]
    assert last["message"] == preemption.message(10) and last["lastCheckpoint"] == str(tmp_path / "checkpoint_step_0000010")
    assert "exportedModel" not in last and not (tmp_path / loop.SUMMARY).exists()


def test_a_stop_on_an_epochs_last_step_is_that_epochs_checkpoint(make_run):
    backend = FakeBackend(stop_at=SPE)
    run, _ = make_run(backend)
    assert run.train() is True
    assert _steps(backend.saved) == [3, 6, 7] and backend.saved[-1][2]["stopped"] == preemption.REASON
    assert "epoch_loss" in backend.saved[-1][2]


def test_a_stop_on_the_runs_last_step_finishes_the_run(make_run, tmp_path):
    """Seen in a clean-clone CI run: a SIGTERM agreed on step 44 of 44 saved a stop, and every
    resubmission then resumed with nothing left, exported, and read the stop back as its result."""
    backend = FakeBackend(stop_at=TOTAL)
    run, _ = make_run(backend)
    assert run.train() is False
    run.finish()
    assert _steps(backend.saved) == [3, 6, 7, 9, 12, 14] and "stopped" not in backend.saved[-1][2]
    assert json.loads((tmp_path / loop.SUMMARY).read_text())["step"] == TOTAL


@pytest.mark.parametrize("metrics, early", [
    ({"step": 10, "total_steps": 14}, False),
    ({"step": 10, "total_steps": 14, "stopped": "SIGTERM"}, True),
    ({"step": 14, "total_steps": 14, "stopped": "SIGTERM"}, False),   # resumed at the end: finished
    ({"step": 14, "stopped": "SIGTERM"}, True),                       # no total: trust the stop
], ids=["finished", "stopped mid-run", "stopped on the last step", "no total"])
def test_the_driver_reports_a_stop_only_with_steps_left(metrics, early):
    from tpuft_workload import train

    assert train.stopped_early(metrics) is early


def test_a_resume_skips_the_batches_trained_and_continues_the_curve(make_run):
    history = [{"step": 9, "loss": 1.1, "tokensPerSecond": 5.0}]
    state = {"step": 9, "path": "/runs/a/checkpoint_step_0000009", "metrics": {"loss": 1.1, "history": history}}
    backend = FakeBackend(restored=("/runs/a/checkpoint_step_0000009", state))
    run, _ = make_run(backend)
    run.restore()
    first = run.reporter.patches[0]
    assert (first["epoch"], first["step"], first["resumedFromStep"], first["loss"]) == (2, 9, 9, 1.1)
    assert first["message"] == "resumed at step 9 of 14 from /runs/a/checkpoint_step_0000009"
    run.train()
    assert backend.epochs == [(1, 2)] and backend.steps == TOTAL - 9
    assert _steps(backend.saved) == [12, 14]
    assert [p["step"] for p in backend.saved[-1][1]["metrics"]["history"]] == [9, 12, 14]


def test_resumed_at_the_last_step_trains_nothing_and_keeps_the_metrics(make_run, tmp_path):
    state = {"step": TOTAL, "path": "/runs/a/checkpoint_step_0000014", "metrics": {"loss": 0.5}}
    backend = FakeBackend(restored=("/runs/a", state))
    run, _ = make_run(backend)
    run.restore()
    assert run.train() is False
    run.finish()
    assert backend.epochs == [] and backend.saved == []
    summary = json.loads((tmp_path / loop.SUMMARY).read_text())
    assert summary["loss"] == 0.5 and summary["message"].startswith("nothing left to do: resumed at step 14")


def test_reports_and_checkpoints_are_not_training_time():
    m = loop.window_metrics(loss_sum=8.0, labelled=4, grad_norm_sum=6.0, steps=4, real=300, padded=400, wall=5.0,
                            excluded=2.0, local_steps=2)
    assert (m["loss"], m["grad_norm"], m["seconds"]) == (2.0, 1.5, 5.0)   # steps summed over 2 ranks
    assert (m["tokens_per_s"], m["padded_tokens_per_s"], m["step_time_s"]) == (100.0, 400 / 3, 1.5)
    assert m["pad_fraction"] == 0.25


def test_the_window_loss_is_per_labelled_token_of_every_rank():
    """Rank 0's step: loss 2.0 on 3 labelled tokens; rank 1's: 4.0 on 1; rank 1's next, rows of
    prompt only: no token, no loss. The window's loss is 10/4, not the ranks' mean 3.0, neither NaN
    nor pulled down by the empty step; a window without a labelled token: NaN."""
    window = loop.Window(lambda values: [float(v) for v in values])   # the ranks' sums, as totals gives them
    for loss_sum, labelled in ((6.0, 3), (4.0, 1), (0.0, 0)):
        window.add(loop.Step(loss_sum=loss_sum, labelled=labelled, real=100, padded=128, grad_norm=1.0))
    assert window.reduce()["loss"] == 2.5
    assert math.isnan(loop.window_metrics(0.0, 0, 4.0, 4, 0, 400, 5.0, 0.0, 2)["loss"])
