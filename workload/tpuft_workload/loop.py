"""The training run both trainers share: one worker's restore, epochs of steps, reports and
checkpoints, then finish (export, the run's summary) or stop (told to: tpuft_workload.preemption).

What the run reports (status.training, Ray Train's metrics, the log lines, TensorBoard and the
Prometheus gauges), when it saves, and how it resumes and stops is decided here, once. A framework
(train.py: torch FSDP2; jax_train.py: JAX) is a `Backend`: its batches, one step, the ranks' stop
vote, the sums over ranks of a report window, save/load of a checkpoint, a barrier and the export.

Importable without Ray or a framework (both are imported by the backends): tests/workload/
test_loop.py drives `Run` with a fake backend.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from tpuft.constants import TrainingStatus
from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import faults as faultlib
from tpuft_workload import preemption
from tpuft_workload.lora import LoraSettings, check_resume, training_manifest
from tpuft_workload.metrics_log import Prometheus, TensorBoard
from tpuft_workload.report import BackgroundReporter, StatusReporter, Throttle, add_point, mfu

SUMMARY = "summary.json"  # under storage_path/run_name, written by rank 0 when a run completes


def say(msg: str) -> None:
    """One line on the worker's stdout. Not print(): Ray Train v2 patches print() to also log
    it, and the RayJob log then shows every line twice."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def ckpt_name(step: int) -> str:
    return f"checkpoint_step_{step:07d}"


@dataclass(frozen=True)
class TrainConfig:
    """What every training worker needs. Ray hands train_loop_config to the workers as a plain
    dict (`as_dict`); `work` rebuilds the typed config from it (`from_dict`)."""
    platform: str                 # tpuft_workload.platform.PLATFORMS key
    model: str
    rows: int                     # packed rows the pipeline produced (steps come from it)
    examples: int
    pad_fraction: float
    epochs: int
    batch_size_per_device: int
    max_seq_length: int
    learning_rate: float
    packing: bool
    checkpoint_every_steps: int   # 0: at epoch ends only
    report_every_steps: int
    seed: int
    fault: str                    # TPUFT_FAULTS spec (tests)
    run_dir: str                  # storage_path/run_name: this run's checkpoints, export and summary
    run_dir_local: str            # run_dir when it is a local path, else "" (the fault markers)
    export_uri: str
    resume_from: str              # a committed checkpoint of an earlier run ("": none)
    resume_manifest: dict         # that run's tpuft-run.json
    # Workers run on other pods: the CR identity is passed explicitly, not via their environment.
    cr_namespace: str
    cr_name: str
    status_every_s: float
    peak_flops: float | None      # the TPU slice's peak FLOP/s (tpuft.catalog; MFU's denominator), None off TPU
    slices: int = 1               # > 1: HSDP, parameters replicated across slices (tpuft_workload.model.device_mesh)
    lora: LoraSettings | None = None   # spec.training.method: lora, resolved by the driver (None: full)
    merge_export: bool = False    # spec.export.merge: LoRA's merged full weights beside the adapter export
    record_type: str = "instruction"   # constants.DatasetType value the records were read as
    truncated: int = 0            # examples cut to max_seq_length
    dropped: int = 0              # examples left out (spec.dataset.overlong)
    rows_ref: Any = None          # ray.ObjectRef of the packed rows (tpuft_workload.pipeline.build)
    # The recipe (spec.training): the rate after warmup, the optimizer's decay and clip, the global batch
    learning_rate_schedule: str = "constant"   # constants.LearningRateSchedule value
    warmup_steps: int = 0         # spec.training.warmupSteps (0: none, or warmup_ratio's)
    warmup_ratio: float = 0.0     # spec.training.warmupRatio: of the run's optimizer steps
    min_learning_rate_ratio: float = 0.0
    weight_decay: float = 0.01    # on weight matrices only (not biases, norms, embeddings)
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1   # micro-batches per optimizer step
    max_steps: int = 0            # 0: epochs decide; else the run's optimizer steps
    activation_checkpointing: bool = False   # resolved per platform by tpuft.spec
    # spec.evaluation: the eval set (packed like the rows), when to evaluate, what to keep
    eval_rows: int = 0            # 0: no eval set
    eval_rows_ref: Any = None     # ray.ObjectRef of the eval rows
    eval_every_steps: int = 0     # 0: at each epoch end (and always at the end)
    early_stopping_patience: int = 0   # 0: never stop early
    keep_best: bool = False       # export the checkpoint with the lowest eval loss

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        lora = d.get("lora")
        return cls(**{**d, "lora": LoraSettings.from_dict(lora) if lora else None})


def data_line(cfg: TrainConfig) -> str:
    """What the run trains on, for the log: examples, rows, packing, and what did not fit."""
    cut = f", {cfg.truncated} truncated" if cfg.truncated else ""
    left = f", {cfg.dropped} dropped (longer than {cfg.max_seq_length} tokens)" if cfg.dropped else ""
    held = f"; eval set: {cfg.eval_rows} rows" if cfg.eval_rows else ""
    return (f"{cfg.examples} {cfg.record_type} examples{cut}{left} -> {cfg.rows} rows of {cfg.max_seq_length} tokens "
            f"({'whole examples packed' if cfg.packing else 'padded'}, pad fraction {cfg.pad_fraction:.1%}){held}")


def global_batch_size(cfg: TrainConfig, world: int) -> int:
    """Sequences per optimizer step: devices (all slices) x per device x accumulation."""
    return world * cfg.batch_size_per_device * cfg.gradient_accumulation_steps


def learning_rate_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """The rate of optimizer step `step` (0-based) of `total_steps`: a linear warmup from 0 over the
    warmup steps, then constant, or linear or cosine decay to min_learning_rate_ratio x the peak
    at the last step. Pure: both frameworks take their rate from here."""
    peak = cfg.learning_rate
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    if cfg.learning_rate_schedule == "constant":
        return peak
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    floor = peak * cfg.min_learning_rate_ratio
    if cfg.learning_rate_schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---- what a framework does -----------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One optimizer step's numbers (torch: this rank's; JAX: the global batch's). All but padded
    may stay on the device (no sync per step) until a window's `Backend.totals`. Both frameworks
    train on the global batch's mean loss per labelled token, and a window reports the same: its
    summed loss over its labelled tokens, each summed over steps and ranks (rows of prompt only
    add neither)."""
    loss_sum: Any    # next-token loss summed over the `labelled` tokens
    labelled: Any    # tokens the loss scores (labels other than -100, after the shift by one)
    real: Any        # real (unpadded) tokens
    padded: int      # tokens including padding, counted like `real`
    grad_norm: Any   # the global gradient norm before clipping


class Backend(Protocol):
    """One framework's part of the run. The loop calls these; everything else is the loop's."""
    steps_per_epoch: int          # global batches in one pass over the data
    flops_per_token: float        # MFU's numerator (report.flops_per_token)
    peak_flops: float | None      # MFU's denominator; None: no MFU
    # (trainable, total) parameters, status.training's trainableParameters and totalParameters; a
    # backend without it reports neither
    parameter_counts: tuple[int, int]

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """This worker's batches of `epoch`, the first `skip` (trained before a resume) left out."""

    def step(self, batch: Any) -> Step:
        """One optimizer step on `batch`."""

    def totals(self, values: list) -> list[float]:
        """Each value summed over the ranks (torch: one all-reduce), as floats."""

    def stop_agreed(self, step: int) -> bool:
        """After `step`: whether the ranks agree to stop now (any was told to: every one, same step)."""

    def save(self, path: str, name: str, train_state: dict, metrics: dict) -> None:
        """This step's checkpoint at `path` (directory `name`) holding `train_state`, committed
        (`commit`), and registered with Ray Train with `metrics` (ray.train.report)."""

    def load(self) -> tuple[str, dict] | None:
        """Restore from the checkpoint to resume: (its path, its train_state), None for none."""

    def barrier(self) -> None:
        """Every rank has got here."""

    def export(self) -> str | None:
        """Collective: the from_pretrained() folder written (rank 0 returns its URI)."""


def commit(backend: Backend, rank: int, path: str) -> None:
    """A checkpoint every rank wrote its part of: rank 0 marks it committed, once all have."""
    backend.barrier()
    if rank == 0:
        ckptlib.mark_committed(path)


def report_to_ray(metrics: dict) -> None:
    """ray.train.report without a checkpoint (a name of its own: test_loop.py stands in for it)."""
    import ray.train

    ray.train.report(metrics)


# ---- the worker, before its model exists -----------------------------------------------------------

@dataclass(frozen=True)
class Worker:
    """This process's place in the run, and its status reporter (rank 0's reaches status.training)."""
    cfg: TrainConfig
    rank: int
    world: int
    reporter: BackgroundReporter

    @classmethod
    def here(cls, cfg: TrainConfig) -> Worker:
        """This Ray Train worker's."""
        import ray.train

        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        reporter = BackgroundReporter(StatusReporter(cfg.cr_namespace, cfg.cr_name) if rank == 0
                                      else StatusReporter("", ""))
        return cls(cfg, rank, ctx.get_world_size(), reporter)

    def adopt_architecture(self, arch: dict, barrier: Callable[[], None]) -> None:
        """The model's architecture, before it is sharded: refused (ResumeError, in status) when
        --resume-from's is another, or holds other weights (full or LoRA, the adapters' shape); rank 0
        records it and the method in the run's manifest."""
        cfg = self.cfg
        if cfg.resume_from:
            try:
                ckptlib.check_architecture(cfg.resume_from, cfg.resume_manifest, arch, cfg.model)
                check_resume(cfg.resume_from, cfg.resume_manifest, cfg.lora)
            except ckptlib.ResumeError as e:
                if self.rank == 0:
                    self.reporter.training(message=str(e))
                    self.reporter.close()
                # Every rank sees the same mismatch; none may fail before rank 0's status write is
                # out, or Ray Train tears the group down (rank 0 with it) and the reason is lost.
                barrier()
                raise
        if self.rank == 0:
            ckptlib.write_run_manifest(cfg.run_dir, {
                "model": cfg.model, "architecture": arch, "namespace": cfg.cr_namespace,
                "name": cfg.cr_name, "resumeFrom": cfg.resume_from or None, "training": training_manifest(cfg.lora)})

    def say(self, msg: str) -> None:
        """A line from rank 0 only."""
        if self.rank == 0:
            say(msg)


# ---- reports ---------------------------------------------------------------------------------------

def window_metrics(loss_sum: float, labelled: float, grad_norm_sum: float, steps: float, real: float,
                   padded: float, wall: float, excluded: float, local_steps: int) -> dict:
    """A report window's metrics from its sums over the ranks (`steps` too: a mean over them; the
    loss per labelled token, NaN when none was): reports and checkpoints (`excluded` seconds) are
    not training time."""
    secs = max(wall - excluded, 1e-9)
    # every rank holds the same (global) gradient norm: summed over ranks like the steps
    return {"loss": loss_sum / labelled if labelled else math.nan, "grad_norm": grad_norm_sum / max(steps, 1),
            "seconds": wall,
            "tokens_per_s": real / secs, "padded_tokens_per_s": padded / secs,
            "step_time_s": secs / max(local_steps, 1),
            "pad_fraction": 1.0 - real / padded if padded else 0.0}


class Window:
    """Per-step numbers between two reports (device values stay on the device until `reduce`)."""

    def __init__(self, totals: Callable[[list], list[float]]):
        self.totals = totals
        self.loss_sum: Any = 0
        self.labelled: Any = 0
        self.grad_norm: Any = 0
        self.real: Any = 0
        self.steps = 0
        self.padded = 0
        self.t0 = time.perf_counter()
        self.excluded = 0.0  # time spent in reports/checkpoints, kept out of the rates

    def add(self, s: Step) -> None:
        self.loss_sum = self.loss_sum + s.loss_sum
        self.labelled = self.labelled + s.labelled
        self.grad_norm = self.grad_norm + s.grad_norm
        self.steps += 1
        self.real = self.real + s.real
        self.padded += s.padded

    def reduce(self) -> dict:
        """Collective (torch): the loss per labelled token and the tokens per wall second, all ranks'."""
        loss_sum, labelled, steps, real, padded, grad_norm = self.totals(
            [self.loss_sum, self.labelled, self.steps, self.real, self.padded, self.grad_norm])
        return window_metrics(loss_sum, labelled, grad_norm, steps, real, padded, time.perf_counter() - self.t0,
                              self.excluded, self.steps)


def status_metrics(m: dict) -> dict:
    """A Window.reduce() result as status.training keys (also kept in each checkpoint)."""
    return {"loss": round(m["loss"], 5), "tokensPerSecond": round(m["tokens_per_s"], 1),
            "paddedTokensPerSecond": round(m["padded_tokens_per_s"], 1),
            "stepTimeSeconds": round(m["step_time_s"], 4), "padFraction": round(m["pad_fraction"], 4)}


def interval_line(epoch: int, epochs: int, step: int, total: int, m: dict) -> str:
    """The per-interval log line both trainers print (`tpuft demo`'s docs and the benches read it)."""
    return (f"Epoch {epoch}/{epochs} | step {step}/{total} | loss={m['loss']:.4f} | "
            f"step_time={m['step_time_s']:.3f}s | tokens/s={m['tokens_per_s']:.1f} | "
            f"padded_tokens/s={m['padded_tokens_per_s']:.1f}")


def epoch_line(epoch: int, epochs: int, m: dict) -> str:
    return (f"Epoch {epoch}/{epochs} | loss={m['loss']:.4f} | epoch_time={m['seconds']:.2f}s | "
            f"tokens/s={m['tokens_per_s']:.1f} | padded_tokens/s={m['padded_tokens_per_s']:.1f} | "
            f"pad={m['pad_fraction']:.1%}")


def stopped(stop: bool) -> dict:
    """The report metric that marks a stop's checkpoint (what the driver looks for)."""
    return {"stopped": preemption.REASON} if stop else {}


def resume_message(step: int, total_steps: int, source: str) -> str:
    if step >= total_steps:
        return (f"nothing left to do: resumed at step {step} of {total_steps} from {source}; loss and tokens/s "
                "are those the completed run reported")
    return f"resumed at step {step} of {total_steps} from {source}"


# ---- the run ---------------------------------------------------------------------------------------

def work(config: dict, backend: Callable[[Worker], Backend]) -> None:
    """One training worker (Ray Train's train function): setup (`backend` builds the model),
    restore, train (steps, reports, checkpoints), finish (export), or stop (told to: a checkpoint
    at the next step boundary, no export)."""
    preemption.install()
    worker = Worker.here(TrainConfig.from_dict(config))
    run = Run(worker, backend(worker))
    run.restore()
    if run.train():
        run.stop()
    else:
        run.finish()


class Run:
    """One worker's training run: the progress the loop moves forward, and what it reports."""

    def __init__(self, worker: Worker, backend: Backend):
        cfg = worker.cfg
        self.cfg, self.rank, self.backend, self.reporter = cfg, worker.rank, backend, worker.reporter
        self.faults = faultlib.parse_faults(cfg.fault)
        self.throttle = Throttle(cfg.status_every_s)
        self.spe = backend.steps_per_epoch
        self.total_steps = self.spe * cfg.epochs
        # progress: restored from a checkpoint, moved by the loop
        self.step, self.resumed_from = 0, -1
        self.last_ckpt, self.message, self.source = "", None, ""
        self.last_metrics: dict = {}  # status.training metrics of the latest report, restored with a checkpoint
        self.tensorboard = TensorBoard(cfg.run_dir, enabled=False)   # rank 0's opens once restored (train)
        self.prometheus = Prometheus(enabled=False)
        counts = getattr(backend, "parameter_counts", None)
        self.parameters = {TrainingStatus.TRAINABLE_PARAMETERS.value: counts[0],
                           TrainingStatus.TOTAL_PARAMETERS.value: counts[1]} if counts else {}

    # --- restore ------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Progress and the last report's metrics from the backend's checkpoint, if any."""
        restored = self.backend.load()
        if restored is None:
            return
        self.source, state = restored
        self.step, self.resumed_from, self.last_ckpt = int(state["step"]), int(state["step"]), state.get("path", "")
        self.last_metrics = dict(state.get("metrics") or {})
        self.message = resume_message(self.step, self.total_steps, self.source)
        if self.rank == 0:
            say(f"[tpuft] {self.message}")
        epoch = min(self.step // self.spe + 1, self.cfg.epochs) if self.spe else self.cfg.epochs
        self.status(True, epoch=epoch, step=self.step, resumedFrom=self.source, resumedFromStep=self.step,
                    message=self.message, lastCheckpoint=self.last_ckpt or None, **self.last_metrics)

    # --- report -------------------------------------------------------------------------------------
    def status(self, force: bool, **fields) -> None:
        """status.training of the TPUFinetune (rank 0, throttled unless forced)."""
        if self.rank == 0 and self.reporter.enabled and self.throttle.ready(force):
            self.reporter.training(epochs=self.cfg.epochs, totalSteps=self.total_steps, **self.parameters, **fields)

    def record(self, m: dict) -> None:
        """One report's metrics (a Window.reduce() result): status.training's keys, with MFU (when
        the slice has a catalog peak) and the history point, become last_metrics (kept in each
        checkpoint, so a restarted attempt continues the same curve), and rank 0 adds the report to
        TensorBoard and its Prometheus gauges."""
        metrics = status_metrics(m)
        utilisation = mfu(self.backend.flops_per_token, m["tokens_per_s"], self.backend.peak_flops)
        if utilisation is not None:
            metrics["mfu"] = utilisation
        point = {"step": self.step, "loss": metrics["loss"], "tokensPerSecond": metrics["tokensPerSecond"]}
        metrics["history"] = add_point(self.last_metrics.get("history") or [], point)
        self.last_metrics = metrics
        self.tensorboard.add(self.step, {**m, "mfu": utilisation}, self.cfg.learning_rate)
        self.prometheus.add(self.step, {**m, "mfu": utilisation})

    def report(self, metrics: dict, save: bool) -> None:
        """ray.train.report, with this step's checkpoint when `save`. A stop's checkpoint carries
        metrics["stopped"]: Result.metrics, which the driver reads, are the newest checkpoint's."""
        self.record(metrics)
        metrics = {**metrics, "step": self.step, "total_steps": self.total_steps,
                   "resumed_from_step": self.resumed_from}
        if not save:
            report_to_ray(metrics)
            return
        self.tensorboard.sync()
        name = ckpt_name(self.step)
        path = ckptlib.join(self.cfg.run_dir, name)
        self.backend.save(path, name, {"step": self.step, "epoch": metrics.get("epoch"), "path": path,
                                       "metrics": self.last_metrics}, metrics)
        self.last_ckpt = path

    # --- train ----------------------------------------------------------------------------------------
    def train(self) -> bool:
        """Every epoch left; True when the ranks stopped on request (after that step's checkpoint)."""
        self.tensorboard = TensorBoard(self.cfg.run_dir, self.rank == 0, resumed_at=self.step)
        # tagged with the TPUFinetune's name (the run's directory name off the cluster)
        tag = self.cfg.cr_name or self.cfg.run_dir.rstrip("/").rsplit("/", 1)[-1]
        self.prometheus = Prometheus(self.rank == 0, tag)
        for epoch in range(self.step // self.spe if self.spe else 0, self.cfg.epochs):
            if self._epoch(epoch):
                return True
        return False

    def _epoch(self, epoch: int) -> bool:
        """One epoch's steps; True when the ranks agreed to stop (that step's checkpoint is saved)."""
        cfg, spe = self.cfg, self.spe
        every_ckpt, every_rep = cfg.checkpoint_every_steps, cfg.report_every_steps
        done = self.step - epoch * spe   # a resumed epoch passes over the batches it already trained on
        batches = self.backend.batches(epoch, done)
        epoch_win, win = Window(self.backend.totals), Window(self.backend.totals)
        stop = False
        for i, batch in zip(range(done, spe), batches):
            faultlib.fire_train(self.faults, self.rank, self.step + 1, cfg.run_dir_local)
            s = self.backend.step(batch)
            self.step += 1
            for w in (win, epoch_win):
                w.add(s)
            # Every rank takes part in the agreement (a collective); a stop on the run's last step is
            # moot: the step is trained, so the run finishes (export) instead of saving a stop that a
            # resubmitted run would find with nothing left to train.
            stop = self.backend.stop_agreed(self.step) and self.step < self.total_steps
            if i == spe - 1:  # the end of the epoch reports (and saves) below
                break
            save = stop or (bool(every_ckpt) and self.step % every_ckpt == 0)
            if self.step % every_rep == 0 or save:
                paused = time.perf_counter()
                self._interval(epoch, win.reduce(), save, stop)
                # Reports and checkpoints are not training time: a report waits for the controller
                # to poll the previous one (result queue of size 1, polled every 2 s). Rates leave
                # them out, so tokens/s measures training steps only; epoch_time is the wall clock.
                epoch_win.excluded += time.perf_counter() - paused
                win = Window(self.backend.totals)
            if stop:
                return True
        self._epoch_end(epoch, epoch_win.reduce(), stop)
        return stop

    def _interval(self, epoch: int, m: dict, save: bool, stop: bool) -> None:
        if self.rank == 0:
            say(interval_line(epoch + 1, self.cfg.epochs, self.step, self.total_steps, m))
        self.report({"epoch": epoch + 1, **m, **stopped(stop)}, save)
        self.status(save, epoch=epoch + 1, step=self.step, lastCheckpoint=self.last_ckpt or None,
                    **self.last_metrics)

    def _epoch_end(self, epoch: int, m: dict, stop: bool) -> None:
        if self.rank == 0:
            say(epoch_line(epoch + 1, self.cfg.epochs, m))
        self.report({"epoch": epoch + 1, "epoch_loss": m["loss"], "epoch_time_s": m["seconds"], **m,
                     **stopped(stop)}, True)
        self.status(True, epoch=epoch + 1, step=self.step, lastCheckpoint=self.last_ckpt, **self.last_metrics)

    # --- the end ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """The end of a stopped run: no export, no summary (the run did not finish). Rank 0 puts the
        message into status; every rank tells its pod's preStop hook the checkpoint is saved."""
        msg = preemption.message(self.step)
        if self.rank == 0:
            say(f"[tpuft] {msg}")
            self.status(True, step=self.step, lastCheckpoint=self.last_ckpt, message=msg, **self.last_metrics)
        self.reporter.close()
        self.tensorboard.close()
        preemption.write_marker(self.step, self.last_ckpt)

    def finish(self) -> None:
        """The end of a finished run: the export; rank 0 reports it into status and writes the run's
        summary (Result.metrics is the latest *checkpoint's*, maybe an earlier attempt's: this file
        is what the final attempt did; the history is in status and TensorBoard); every rank closes
        its reporter and TensorBoard writer."""
        exported = self.backend.export()
        metrics = {k: v for k, v in self.last_metrics.items() if k != "history"}
        summary = {"step": self.step, "totalSteps": self.total_steps, "resumedFromStep": self.resumed_from,
                   "lastCheckpoint": self.last_ckpt, "exportedModel": exported, **self.parameters, **metrics,
                   **({"resumedFrom": self.source, "message": self.message} if self.source else {})}
        if self.rank == 0:
            say(f"[tpuft] exported Hugging Face model to {exported}")
            self.status(True, epoch=self.cfg.epochs, step=self.step, lastCheckpoint=self.last_ckpt,
                        exportedModel=exported, **self.last_metrics)
            ckptlib.write_json(ckptlib.join(self.cfg.run_dir, SUMMARY), summary)
        self.reporter.close()
        self.tensorboard.close()
