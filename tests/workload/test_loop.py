"""tpuft_workload.loop without Ray or a framework: `Run` over a fake backend. When it reports, saves,
resumes and stops is what both trainers do; the real runs (2 CPU workers, a killed rank) are
tests/workload/test_train.py and test_jax_train.py."""
from __future__ import annotations

import dataclasses
import json
import math
from functools import partial

import pytest

from tests.factories import workload_run
from tpuft.api.spec import Evaluation, Training
from tpuft_workload import loop, preemption
from tpuft_workload.metrics_log import Prometheus

SPE, EPOCHS, CKPT_EVERY = 7, 2, 3
TOTAL = SPE * EPOCHS


class FakeBackend:
    """Step k: mean loss 2.0 - 0.1 k over k labelled tokens, 12 of 16 tokens real, gradient norm 1.5."""
    steps_per_epoch = SPE
    flops_per_token = 1e6
    peak_flops = None

    def __init__(self, stop_at: int = -1, restored: tuple[str, dict] | None = None, eval_losses=()):
        self.stop_at, self.restored, self.eval_losses = stop_at, restored, list(eval_losses)
        self.saved: list[tuple[str, dict, dict]] = []   # (name, train_state, metrics)
        self.epochs: list[tuple[int, int]] = []         # (epoch, skip) of each batches() call
        self.steps = 0
        self.rates: list[float] = []     # the learning rate of each step
        self.evaluated: list[int] = []   # the steps evaluated after
        self.loaded: list[str] = []      # load_from's paths

    def batches(self, epoch, skip):
        self.epochs.append((epoch, skip))
        return iter(range(skip, SPE))

    def step(self, micro_batches, learning_rate):
        self.steps += 1
        self.rates.append(learning_rate)
        k = self.steps
        return loop.Step(loss_sum=(2.0 - 0.1 * k) * k, labelled=k, real=12, padded=16, grad_norm=1.5)

    def evaluate(self):
        loss = self.eval_losses[len(self.evaluated)]
        self.evaluated.append(self.steps)
        return loss * 10, 10

    def load_from(self, path):
        self.loaded.append(path)

    def totals(self, values):
        return [float(v) for v in values]

    def agree(self, step, checkpoint_wanted):
        return loop.Agreement(stop=step == self.stop_at, checkpoint=checkpoint_wanted)

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

    def checkpoint_request(self):
        return None

    def close(self):
        pass


class FakeGauge:
    def __init__(self, name, description, tag_keys):
        self.name = name

    def set(self, value, tags):
        pass


EVALUATION_FIELDS = {f.name for f in dataclasses.fields(Evaluation)}


@pytest.fixture
def make_run(tmp_path, monkeypatch):
    """(Run over a FakeBackend, the metrics it reported to Ray without a checkpoint); rank 0."""
    ray_reports: list[dict] = []
    monkeypatch.setattr(loop, "report_to_ray", ray_reports.append)
    monkeypatch.setattr(loop, "Prometheus", partial(Prometheus, gauge=FakeGauge))
    monkeypatch.setattr(preemption, "write_marker", lambda step, ckpt: None)

    def make(backend: FakeBackend, report_every: int = 100, epochs: int = EPOCHS, eval_rows: int = 0, **recipe):
        """`recipe`: spec.training's and spec.evaluation's fields beyond the tiny run's (the schedule,
        maxSteps, when to evaluate); with eval_rows, an eval set held out of the dataset."""
        asked = {k: recipe.pop(k) for k in list(recipe) if k in EVALUATION_FIELDS}
        evaluation = Evaluation(fraction=0.1, **asked) if eval_rows else None
        run = workload_run(checkpoint_every_steps=CKPT_EVERY, evaluation=evaluation, epochs=epochs,
                           batch_size_per_device=4, max_seq_length=4, learning_rate=3e-3,
                           report_every_steps=report_every, seed=0, **recipe)
        cfg = loop.TrainConfig(
            run=run, platform="cpu", rows=56, examples=60, pad_fraction=0.25, fault="", run_dir=str(tmp_path),
            run_dir_local=str(tmp_path), export_uri="/export", resume_from="", resume_manifest={},
            cr_namespace="ns", cr_name="run", status_every_s=0.0, peak_flops=None, eval_rows=eval_rows)
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
    # step 10, the first after the resume, is reported at once (then every 2 steps as before)
    assert [p["step"] for p in backend.saved[-1][1]["metrics"]["history"]] == [9, 10, 12, 14]
    assert [p["step"] for p in run.reporter.patches][:2] == [9, 10]


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


# ---- the recipe: the schedule, maxSteps, the global batch --------------------------------------------

def _schedule(schedule: str, warmup_steps: int | None = None, warmup_ratio: float | None = None,
              floor: float = 0.0) -> Training:
    return Training(learning_rate=1.0, learning_rate_schedule=schedule, warmup_steps=warmup_steps,
                    warmup_ratio=warmup_ratio, min_learning_rate_ratio=floor)


@pytest.mark.parametrize("schedule, want", [
    ("constant", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.25, 0.5, 0.75, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1]),
    # 0.1 + 0.9 x (1 + cos(pi x k / 5)) / 2, k = 0 .. 5
    ("cosine", [0.25, 0.5, 0.75, 1.0, 1.0, 0.9140576, 0.6890576, 0.4109424, 0.1859424, 0.1]),
], ids=["constant", "linear", "cosine"])
def test_the_schedule_warms_up_then_decays_to_the_floor(schedule, want):
    """10 steps, 4 of warmup (0.25 .. 1 of the peak), then from the peak at step 4 down to the floor
    (0.1 of the peak) at the last step, 9."""
    cfg = _schedule(schedule, warmup_steps=4, floor=0.1)
    assert [loop.learning_rate_at(cfg, i, 10) for i in range(10)] == pytest.approx(want)


def test_a_warmup_ratio_is_of_the_runs_steps():
    cfg = _schedule("linear", warmup_ratio=0.25)
    assert [loop.learning_rate_at(cfg, i, 8) for i in range(3)] == [0.5, 1.0, 1.0]   # ceil(0.25 x 8) = 2 steps


def test_each_step_trains_at_the_scheduled_rate_and_a_resume_continues_it(make_run):
    recipe = {"learning_rate_schedule": "cosine", "warmup_steps": 3, "min_learning_rate_ratio": 0.1}
    backend = FakeBackend()
    run, _ = make_run(backend, **recipe)
    run.train()
    assert backend.rates == [loop.learning_rate_at(run.cfg.training, i, TOTAL) for i in range(TOTAL)]
    assert backend.rates[2] == pytest.approx(3e-3) and backend.rates[-1] == pytest.approx(3e-4)
    assert run.reporter.patches[-1]["learningRate"] == pytest.approx(3e-4)
    state = {"step": 9, "path": "/runs/a/checkpoint_step_0000009", "metrics": {}}
    resumed = FakeBackend(restored=("/runs/a", state))
    again, _ = make_run(resumed, **recipe)
    again.restore()
    again.train()
    assert resumed.rates == backend.rates[9:]


def test_max_steps_passes_over_the_data_as_often_as_it_takes(make_run, tmp_path):
    """maxSteps 17 of 7-step epochs: epochs 1 and 2 whole, the third cut at step 17, reported as 3."""
    backend = FakeBackend()
    run, _ = make_run(backend, epochs=1, max_steps=17)
    run.restore()
    assert run.train() is False
    run.finish()
    assert backend.steps == 17 and backend.epochs == [(0, 0), (1, 0), (2, 0)]
    assert _steps(backend.saved) == [3, 6, 7, 9, 12, 14, 15, 17]   # the run's end is the last epoch's
    final = run.reporter.patches[-1]
    assert (final["epoch"], final["epochs"], final["step"], final["totalSteps"]) == (3, 3, 17, 17)
    assert json.loads((tmp_path / loop.SUMMARY).read_text())["step"] == 17


def test_the_global_batch_is_reported_from_the_start(make_run, capsys):
    run, _ = make_run(FakeBackend(), gradient_accumulation_steps=3)
    run.train()
    assert {p["globalBatchSize"] for p in run.reporter.patches} == {2 * 4 * 3}   # 2 workers x 4 x 3
    assert "[tpuft] global batch 24 sequences (4 per device x 3 accumulated" in capsys.readouterr().out


# ---- the per-interval series and the epoch's mean ----------------------------------------------------

def test_the_interval_series_holds_no_epoch_mean(make_run, tmp_path):
    """Reports every 2 steps of a 7-step epoch (and the checkpoints' every 3): the report at step 7
    is the mean of step 7 alone in the history and train/loss; the epoch's mean goes in epochLoss
    and train/epoch_loss only."""
    from tests.factories import tensorboard_scalars

    backend = FakeBackend()
    run, _ = make_run(backend, report_every=2, epochs=1)
    run.train()
    run.finish()
    step_loss = {k: 2.0 - 0.1 * k for k in range(1, 8)}
    window = {2: (1, 2), 3: (3,), 4: (4,), 6: (5, 6), 7: (7,)}
    want = {s: sum(step_loss[k] * k for k in ks) / sum(ks) for s, ks in window.items()}
    epoch_mean = sum(step_loss[k] * k for k in range(1, 8)) / sum(range(1, 8))
    history = run.reporter.patches[-1]["history"]
    assert {p["step"]: p["loss"] for p in history} == pytest.approx(want, abs=1e-5)
    assert run.reporter.patches[-1]["epochLoss"] == pytest.approx(epoch_mean, abs=1e-5)
    assert epoch_mean not in [pytest.approx(p["loss"], abs=1e-5) for p in history]
    _, scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert dict(scalars["train/loss"]) == pytest.approx(want, abs=1e-5)
    assert scalars["train/epoch_loss"] == [(7, pytest.approx(epoch_mean, abs=1e-5))]


# ---- evaluation --------------------------------------------------------------------------------------

def test_evaluations_remember_the_best_and_count_since_it():
    ev = loop.Evaluations()
    assert ev.status() == {}
    assert [ev.observe(s, loss, f"/c{s}") for s, loss in ((2, 3.0), (4, 2.0), (6, math.nan), (8, 2.5))] == \
        [True, True, False, False]
    assert (ev.best_loss, ev.best_step, ev.best_path, ev.since_best) == (2.0, 4, "/c4", 2)
    assert ev.patience_spent(2) and not ev.patience_spent(3)
    assert not ev.patience_spent(0) and not ev.patience_spent(None)
    assert ev.status() == {"evalLoss": 2.5, "evalPerplexity": pytest.approx(math.exp(2.5), abs=1e-4),
                           "bestEvalLoss": 2.0, "bestStep": 4}
    assert loop.Evaluations.from_dict(ev.as_dict()) == ev


EVAL = {"eval_rows": 4}


def test_evaluations_at_each_epoch_end_go_to_status_history_and_tensorboard(make_run, tmp_path, capsys):
    from tests.factories import tensorboard_scalars

    backend = FakeBackend(eval_losses=[3.0, 2.0])
    run, _ = make_run(backend, report_every=2, **EVAL)
    run.train()
    run.finish()
    assert backend.evaluated == [SPE, TOTAL]
    final = run.reporter.patches[-1]
    assert (final["evalLoss"], final["bestEvalLoss"], final["bestStep"]) == (2.0, 2.0, TOTAL)
    assert final["evalPerplexity"] == pytest.approx(math.exp(2.0), abs=1e-4)
    assert {p["step"]: p.get("evalLoss") for p in final["history"] if "evalLoss" in p} == {SPE: 3.0, TOTAL: 2.0}
    _, scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["eval/loss"] == [(SPE, 3.0), (TOTAL, 2.0)] and len(scalars["eval/perplexity"]) == 2
    assert "Eval at step 7/14 | eval_loss=3.0000 | perplexity=20.086 | best=3.0000 at step 7" in capsys.readouterr().out


def test_evaluations_every_n_steps_report_there_and_at_the_end(make_run):
    backend = FakeBackend(eval_losses=[5.0, 4.0, 3.0, 2.0, 1.0])
    run, ray_reports = make_run(backend, epochs=1, every_steps=2, **EVAL)
    run.train()
    assert backend.evaluated == [2, 4, 6, 7]   # and the run's last step
    assert [m["step"] for m in ray_reports] == [2, 4]   # an evaluation is a report (6: a checkpoint's)
    assert [m["eval_loss"] for m in ray_reports] == [5.0, 4.0]


def test_early_stopping_finishes_the_run_after_patience_evaluations_without_a_better_loss(make_run, tmp_path):
    backend = FakeBackend(eval_losses=[3.0, 2.0, 2.5, 2.1, 1.0])
    run, _ = make_run(backend, epochs=3, every_steps=2, early_stopping_patience=2, **EVAL)
    assert run.train() is False
    run.finish()
    assert backend.evaluated == [2, 4, 6, 8] and backend.steps == 8   # 2.5 then 2.1: two without beating 2.0
    assert _steps(backend.saved)[-1] == 8   # the stop's step saved: a resubmission does not train on
    message = "early stopping at step 8 of 21: the eval loss has not improved for 2 evaluations (best 2.0000 at step 4)"
    final = run.reporter.patches[-1]
    assert final["message"] == message and final["exportedModel"] == "/export" and backend.loaded == []
    summary = json.loads((tmp_path / loop.SUMMARY).read_text())
    assert (summary["step"], summary["exportedStep"], summary["message"]) == (8, 8, message)

    resumed = FakeBackend(restored=("/runs/a", backend.saved[-1][1]))
    again, _ = make_run(resumed, epochs=3, every_steps=2, early_stopping_patience=2, **EVAL)
    again.restore()
    assert again.train() is False and resumed.steps == 0 and again.early_stop == message


def test_keep_best_saves_each_improvement_ranks_it_first_and_exports_it(make_run, tmp_path):
    backend = FakeBackend(eval_losses=[3.0, 2.0, 2.5, 2.6])
    run, _ = make_run(backend, epochs=1, every_steps=2, keep_best=True, **EVAL)
    run.train()
    run.finish()
    assert backend.evaluated == [2, 4, 6, 7]
    assert _steps(backend.saved) == [2, 3, 4, 6, 7]   # improvements (2, 4) saved beside the periodic ones
    scores = {ts["step"]: m[loop.KEEP_SCORE] for _, ts, m in backend.saved}
    assert scores == {2: 2 + loop.BEST_BONUS, 3: 3, 4: 4 + loop.BEST_BONUS, 6: 6, 7: 7}
    assert backend.saved[-1][1]["evaluation"]["best_step"] == 4   # a resume keeps the best so far
    best = str(tmp_path / "checkpoint_step_0000004")
    assert backend.loaded == []   # the fake saved nothing: gone, so the last step is exported
    (tmp_path / "checkpoint_step_0000004").mkdir()
    (tmp_path / "checkpoint_step_0000004" / "COMMITTED").write_text("ok\n")
    run.finish()
    assert backend.loaded == [best]
    summary = json.loads((tmp_path / loop.SUMMARY).read_text())
    assert (summary["exportedStep"], summary["bestStep"], summary["bestEvalLoss"]) == (4, 4, 2.0)
    assert run.reporter.patches[-1]["message"] == \
        "exported step 4 (eval loss 2.0000, the run's lowest), not the last step 7 (eval loss 2.6000)"
