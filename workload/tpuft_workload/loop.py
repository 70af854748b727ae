"""The training run both trainers share: one worker's restore, epochs of steps, reports and
checkpoints, then finish (export, the run's summary) or stop (told to: tpuft_workload.preemption).

What the run reports (status.training, Ray Train's metrics, the log lines, TensorBoard and the
Prometheus gauges), each step's learning rate, when it evaluates, saves and stops early, which
checkpoint it exports (keepBest), and how it resumes and stops is decided here, once. A framework
(train.py: torch FSDP2; jax_train.py: JAX) is a `Backend`: its micro-batches, one optimizer step,
the eval loss, the ranks' agreement at each step boundary (stop; save on the operator's checkpoint
request and go on), the sums over ranks of a report window, save/load of a checkpoint, a barrier
and the export.

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

from tpuft.api.constants import HistoryPoint, LearningRateSchedule, TrainingStatus
from tpuft.api import spec as speclib
from tpuft.api.spec import Evaluation, Training
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
    """What every training worker needs: the run's document as parsed (`run`: spec.model, spec.slices,
    spec.training, spec.checkpoint, spec.evaluation and spec.export, read as they are) and what the
    driver decided at run time. Ray hands train_loop_config to the workers as a dict of these fields
    (`as_dict`; Ray pickles it, so the sections and the ObjectRefs arrive as they are); `work` rebuilds
    the config from it (`from_dict`)."""
    run: speclib.Run
    platform: str                 # tpuft_workload.platform.PLATFORMS key
    rows: int                     # packed rows the pipeline produced (steps come from it)
    examples: int
    pad_fraction: float
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
    peak_flops: float | None      # the TPU slice's peak FLOP/s (tpuft.api.catalog; MFU's denominator), None off TPU
    lora: LoraSettings | None = None   # spec.training.lora resolved for the model by the driver (None: not lora)
    record_type: str = "instruction"   # constants.DatasetType value the records were read as
    truncated: int = 0            # examples cut to max_seq_length
    dropped: int = 0              # examples left out (spec.dataset.overlong)
    rows_ref: Any = None          # ray.ObjectRef of the packed rows (tpuft_workload.pipeline.build)
    eval_rows: int = 0            # packed eval rows; 0: no eval set
    eval_rows_ref: Any = None     # ray.ObjectRef of the eval rows

    @property
    def training(self) -> Training:
        return self.run.training

    @property
    def evaluation(self) -> Evaluation:
        """spec.evaluation; without one its defaults (then eval_rows is 0: nothing is evaluated)."""
        return self.run.evaluation or Evaluation()

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        return cls(**d)


def data_line(cfg: TrainConfig) -> str:
    """What the run trains on, for the log: examples, rows, packing, and what did not fit."""
    cut = f", {cfg.truncated} truncated" if cfg.truncated else ""
    length = cfg.training.max_seq_length
    left = f", {cfg.dropped} dropped (longer than {length} tokens)" if cfg.dropped else ""
    held = f"; eval set: {cfg.eval_rows} rows" if cfg.eval_rows else ""
    return (f"{cfg.examples} {cfg.record_type} examples{cut}{left} -> {cfg.rows} rows of {length} tokens "
            f"({'whole examples packed' if cfg.training.packing else 'padded'}, pad fraction {cfg.pad_fraction:.1%})"
            f"{held}")


def global_batch_size(training: Training, world: int) -> int:
    """Sequences per optimizer step: devices (all slices) x per device x accumulation."""
    return world * training.batch_size_per_device * training.gradient_accumulation_steps


def warmup_steps(training: Training, total_steps: int) -> int:
    """warmupSteps, else warmupRatio of the run's optimizer steps (neither: 0)."""
    return training.warmup_steps or math.ceil((training.warmup_ratio or 0.0) * total_steps)


def learning_rate_at(training: Training, step: int, total_steps: int) -> float:
    """The rate of optimizer step `step` (0-based) of `total_steps`: a linear warmup from 0 over the
    warmup steps, then constant, or linear or cosine decay to min_learning_rate_ratio x the peak
    at the last step. Pure: both frameworks take their rate from here."""
    peak = training.learning_rate
    warmup = warmup_steps(training, total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    if training.learning_rate_schedule == LearningRateSchedule.CONSTANT.value:
        return peak
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    floor = peak * training.min_learning_rate_ratio
    if training.learning_rate_schedule == LearningRateSchedule.LINEAR.value:
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


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed at a step boundary (Backend.agree)."""
    stop: bool         # stop after this step's checkpoint (SIGTERM: tpuft_workload.preemption)
    checkpoint: bool   # save this step's checkpoint and go on (the operator's checkpoint request)


class Backend(Protocol):
    """One framework's part of the run. The loop calls these; everything else is the loop's."""
    # optimizer steps in one pass over the data: rows // (data-parallel devices x
    # batch_size_per_device x gradient_accumulation_steps)
    steps_per_epoch: int
    flops_per_token: float        # MFU's numerator (report.flops_per_token)
    peak_flops: float | None      # MFU's denominator; None: no MFU
    # (trainable, total) parameters, status.training's trainableParameters and totalParameters; a
    # backend without it reports neither
    parameter_counts: tuple[int, int]
    # Optional: sequences per optimizer step, when the workers are not the data-parallel devices
    # (JAX: one worker per host); a backend without it: global_batch_size(cfg.training, world)
    global_batch_size: int

    def batches(self, epoch: int, skip: int) -> Iterator[list]:
        """This worker's optimizer steps of `epoch`, each a list of cfg.training.gradient_accumulation_steps
        micro-batches (a batch each); the first `skip` steps (trained before a resume) left out."""

    def step(self, micro_batches: list, learning_rate: float) -> Step:
        """One optimizer step at `learning_rate` over all `micro_batches`: the gradient of the token
        mean over every labelled token of every micro-batch and rank (k micro-batches of b rows make
        the update one batch of k x b would), clipped to cfg.training.max_grad_norm. The Step's sums are
        over the micro-batches; its grad_norm is the norm before clipping."""

    def evaluate(self) -> tuple[float, float]:
        """(summed loss, labelled tokens) over the whole eval set (cfg.eval_rows_ref), each summed
        over the ranks, the same on every rank; no gradients, the model back in train mode after."""

    def totals(self, values: list) -> list[float]:
        """Each value summed over the ranks (torch: one all-reduce), as floats."""

    def agree(self, step: int, checkpoint_wanted: bool) -> Agreement:
        """After `step`, one exchange among the ranks: stop now (any was told to: every one, same
        step), and save a checkpoint now (any rank wants one: rank 0 when it saw an unanswered
        status.recovery.checkpointRequestedAt)."""

    def save(self, path: str, name: str, train_state: dict, metrics: dict) -> None:
        """This step's checkpoint at `path` (directory `name`) holding `train_state`, committed
        (`commit`), and registered with Ray Train with `metrics` (ray.train.report)."""

    def load(self) -> tuple[str, dict] | None:
        """Restore from the checkpoint to resume: (its path, its train_state), None for none."""

    def load_from(self, path: str) -> None:
        """Collective: the weights (and optimizer state) of the committed checkpoint at `path`, which
        `save` wrote (keepBest: the best one, before the export)."""

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
                ckptlib.check_architecture(cfg.resume_from, cfg.resume_manifest, arch, cfg.run.model)
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
                "model": cfg.run.model, "architecture": arch, "namespace": cfg.cr_namespace,
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


def interval_line(epoch: int, epochs: int, step: int, total: int, m: dict, learning_rate: float) -> str:
    """The per-interval log line both trainers print (`tpuft demo`'s docs and the benches read it)."""
    return (f"Epoch {epoch}/{epochs} | step {step}/{total} | loss={m['loss']:.4f} | "
            f"step_time={m['step_time_s']:.3f}s | tokens/s={m['tokens_per_s']:.1f} | "
            f"padded_tokens/s={m['padded_tokens_per_s']:.1f} | lr={learning_rate:.3g}")


def epoch_line(epoch: int, epochs: int, m: dict) -> str:
    return (f"Epoch {epoch}/{epochs} | loss={m['loss']:.4f} | epoch_time={m['seconds']:.2f}s | "
            f"tokens/s={m['tokens_per_s']:.1f} | padded_tokens/s={m['padded_tokens_per_s']:.1f} | "
            f"pad={m['pad_fraction']:.1%}")


def recipe_line(training: Training, global_batch: int, steps_per_epoch: int, total_steps: int,
                epochs: int) -> str:
    """Rank 0's line at the start: the global batch, the steps and the learning-rate schedule."""
    schedule = training.learning_rate_schedule
    floor = ("" if schedule == LearningRateSchedule.CONSTANT.value
             else f" to {training.min_learning_rate_ratio:g} x peak")
    return (f"[tpuft] global batch {global_batch} sequences ({training.batch_size_per_device} per device x "
            f"{training.gradient_accumulation_steps} accumulated, every device); {total_steps} optimizer steps "
            f"({epochs} epochs of {steps_per_epoch}); learning rate {training.learning_rate:g}, "
            f"{warmup_steps(training, total_steps)} warmup steps, {schedule}{floor}; weight decay "
            f"{training.weight_decay:g}, gradients clipped to {training.max_grad_norm:g}")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def perplexity(loss: float) -> float | None:
    """exp(loss); None when it is not a finite number a status can hold."""
    return math.exp(loss) if loss < 100 else None


GLOBAL_BATCH_STATE = "global_batch"   # train_state's: sequences per optimizer step when saved (Run._check_global_batch)
KEEP_SCORE = "keep_score"   # the checkpoint metric Ray's CheckpointConfig ranks by with keepBest (train.run_config)
BEST_BONUS = 1e12           # > any step: the best checkpoint outranks every other


@dataclass
class Evaluations:
    """The evaluations so far: the latest eval loss, the lowest, its step and checkpoint, and the
    evaluations since it (early stopping's count). Kept in each checkpoint's train_state, so a
    resumed run keeps its best."""
    loss: float | None = None
    best_loss: float | None = None
    best_step: int = -1
    best_path: str = ""
    since_best: int = 0

    def observe(self, step: int, loss: float, path: str) -> bool:
        """The evaluation at `step` (whose checkpoint is, or would be, `path`); True when it is
        the lowest so far (a NaN never is)."""
        self.loss = loss
        if not math.isnan(loss) and (self.best_loss is None or loss < self.best_loss):
            self.best_loss, self.best_step, self.best_path, self.since_best = loss, step, path, 0
            return True
        self.since_best += 1
        return False

    def patience_spent(self, patience: int | None) -> bool:
        """spec.evaluation.earlyStoppingPatience evaluations without a better loss (None: never)."""
        return patience is not None and patience > 0 and self.since_best >= patience

    def status(self) -> dict:
        """status.training's eval keys (none before the first evaluation)."""
        if self.loss is None:
            return {}
        ppl = perplexity(self.loss)
        out = {TrainingStatus.EVAL_LOSS.value: round(self.loss, 5),
               TrainingStatus.EVAL_PERPLEXITY.value: None if ppl is None else round(ppl, 4)}
        if self.best_loss is not None:
            out |= {TrainingStatus.BEST_EVAL_LOSS.value: round(self.best_loss, 5),
                    TrainingStatus.BEST_STEP.value: self.best_step}
        return {k: v for k, v in out.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Evaluations:
        return cls(**(d or {}))


def stopped(stop: bool) -> dict:
    """The report metric that marks a stop's checkpoint (what the driver looks for)."""
    return {"stopped": preemption.REASON} if stop else {}


def resume_message(step: int, total_steps: int, source: str) -> str:
    if step >= total_steps:
        return (f"nothing left to do: resumed at step {step} of {total_steps} from {source}; loss and tokens/s "
                "are those the completed run reported")
    return f"resumed at step {step} of {total_steps} from {source}"


def global_batch_refusal(source: str, state: dict, global_batch: int, per_device: int, accumulation: int,
                         slices: int) -> str | None:
    """Why the checkpoint at `source` (its train_state `state`) cannot resume at `global_batch`
    sequences per optimizer step; None when it can (the same global batch, or a checkpoint that
    does not record one). Its step would be another place in the data and the schedule."""
    saved = state.get(GLOBAL_BATCH_STATE)
    if saved is None or int(saved) == global_batch:
        return None
    return (f"{source} was saved at a global batch of {saved} sequences per optimizer step; this run's is "
            f"{global_batch} ({global_batch // (per_device * accumulation)} devices x {per_device} per device x "
            f"{accumulation} accumulated, {slices} slice(s)): its step {state.get('step')} would be another place "
            f"in the data and the schedule. Resume with spec.training.gradientAccumulationSteps (or "
            f"batchSizePerDevice) such that devices x per device x accumulation is {saved}")


def checkpoint_exists(path: str) -> bool:
    """A committed checkpoint is at `path` (the commit marker is its last file)."""
    try:
        ckptlib.read_bytes(ckptlib.join(path, ckptlib.COMMITTED))
        return True
    except OSError:
        return False


# ---- the run ---------------------------------------------------------------------------------------

def work(config: dict, backend: Callable[[Worker], Backend]) -> None:
    """One training worker (Ray Train's train function): setup (`backend` builds the model),
    restore, train (steps, reports, evaluations, checkpoints), finish (export), or stop (told to:
    a checkpoint at the next step boundary, no export)."""
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
        # maxSteps: as many passes over the data as it takes, the last one cut short
        self.total_steps = cfg.training.max_steps or self.spe * cfg.training.epochs
        self.epochs = -(-self.total_steps // self.spe) if self.spe else cfg.training.epochs
        self.global_batch = (getattr(backend, "global_batch_size", None)
                             or global_batch_size(cfg.training, worker.world))
        # progress: restored from a checkpoint, moved by the loop
        self.step, self.resumed_from = 0, -1
        self.last_ckpt, self.message, self.source = "", None, ""
        self.last_metrics: dict = {}  # status.training metrics of the latest report, restored with a checkpoint
        self.evaluations = Evaluations()
        self.learning_rate = learning_rate_at(cfg.training, 0, self.total_steps)   # the latest step's
        self.early_stop: str | None = None   # why the run stopped early (early stopping's message)
        # The operator's checkpoint request (status.recovery.checkpointRequestedAt), rank 0's view: the
        # value the next save answers, and the value answered (status.training.checkpointRequestSaved)
        self.request_saving: str | None = None
        self.request_answered: str | None = None
        self.tensorboard = TensorBoard(cfg.run_dir, enabled=False)   # rank 0's opens once restored (train)
        self.prometheus = Prometheus(enabled=False)
        counts = getattr(backend, "parameter_counts", None)
        # status.training keys that hold for the whole run
        self.fixed = {TrainingStatus.GLOBAL_BATCH_SIZE.value: self.global_batch,
                      **({TrainingStatus.TRAINABLE_PARAMETERS.value: counts[0],
                          TrainingStatus.TOTAL_PARAMETERS.value: counts[1]} if counts else {})}

    # --- restore ------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Progress, the evaluations and the last report's metrics from the backend's checkpoint, if any."""
        restored = self.backend.load()
        if restored is None:
            return
        self.source, state = restored
        self._check_global_batch(state)
        self.step, self.resumed_from, self.last_ckpt = int(state["step"]), int(state["step"]), state.get("path", "")
        self.last_metrics = dict(state.get("metrics") or {})
        self.evaluations = Evaluations.from_dict(state.get("evaluation"))
        self.message = resume_message(self.step, self.total_steps, self.source)
        if self.rank == 0:
            say(f"[tpuft] {self.message}")
        self.status(True, epoch=self.epoch_at(self.step + 1), step=self.step, resumedFrom=self.source,
                    resumedFromStep=self.step, message=self.message, lastCheckpoint=self.last_ckpt or None,
                    **self.last_metrics)

    def _check_global_batch(self, state: dict) -> None:
        """A checkpoint resumes on another slice count or accumulation (an elastic resume) only with
        the same global batch: the step count is then the same place in the data (each step's rows
        are the epoch permutation's next global batch, whoever holds them) and in the schedule.
        Another global batch would put step s elsewhere in the data: refused, on every rank (each
        read the same train_state), rank 0's reason in status first. Checkpoints written before
        the global batch was recorded are not checked."""
        cfg = self.cfg
        msg = global_batch_refusal(self.source, state, self.global_batch, cfg.training.batch_size_per_device,
                                   cfg.training.gradient_accumulation_steps, cfg.run.slices)
        if msg is None:
            return
        if self.rank == 0:
            say(f"[tpuft] {msg}")
            self.reporter.training(message=msg)
            self.reporter.close()
        self.backend.barrier()   # rank 0's status write is out before any rank fails
        raise ckptlib.ResumeError(msg)

    def epoch_at(self, step: int) -> int:
        """The (1-based) epoch that optimizer step `step` (1-based) belongs to, at most the last."""
        return min(max(-(-step // self.spe), 1), self.epochs) if self.spe else self.epochs

    # --- report -------------------------------------------------------------------------------------
    def status(self, force: bool, **fields) -> None:
        """status.training of the TPUFinetune (rank 0, throttled unless forced)."""
        if self.rank == 0 and self.reporter.enabled and self.throttle.ready(force):
            self.reporter.training(epochs=self.epochs, totalSteps=self.total_steps, **self.fixed, **fields)

    def record(self, m: dict, evaluated: bool) -> None:
        """One report's metrics (a Window.reduce() result, with epoch_loss at an epoch's end): status.training's
        keys, with MFU (when the slice has a catalog peak), the learning rate, the epoch's and the
        evaluations' numbers and the history point (with the eval loss when `evaluated` at this
        step), become last_metrics (kept in each checkpoint, so a restarted attempt continues the
        same curve), and rank 0 adds the report to TensorBoard and its Prometheus gauges."""
        metrics = status_metrics(m)
        utilisation = mfu(self.backend.flops_per_token, m["tokens_per_s"], self.backend.peak_flops)
        if utilisation is not None:
            metrics["mfu"] = utilisation
        metrics[TrainingStatus.LEARNING_RATE.value] = float(f"{self.learning_rate:.6g}")
        epoch_loss = round(m["epoch_loss"], 5) if "epoch_loss" in m else self.last_metrics.get(
            TrainingStatus.EPOCH_LOSS.value)
        if epoch_loss is not None:
            metrics[TrainingStatus.EPOCH_LOSS.value] = epoch_loss
        metrics |= self.evaluations.status()
        point = {"step": self.step, "loss": metrics["loss"], "tokensPerSecond": metrics["tokensPerSecond"]}
        scalars = {**m, "mfu": utilisation}
        if evaluated and TrainingStatus.EVAL_LOSS.value in metrics:
            point[HistoryPoint.EVAL_LOSS.value] = metrics[TrainingStatus.EVAL_LOSS.value]
            scalars |= {"eval_loss": self.evaluations.loss, "eval_perplexity": perplexity(self.evaluations.loss)}
        metrics["history"] = add_point(self.last_metrics.get("history") or [], point)
        self.last_metrics = metrics
        self.tensorboard.add(self.step, scalars, self.learning_rate)
        self.prometheus.add(self.step, {**m, "mfu": utilisation})

    def report(self, metrics: dict, save: bool, evaluated: bool = False) -> None:
        """ray.train.report, with this step's checkpoint when `save`. A stop's checkpoint carries
        metrics["stopped"]: Result.metrics, which the driver reads, are the newest checkpoint's.
        With keepBest a checkpoint's KEEP_SCORE ranks the best above the rest for Ray's num_to_keep."""
        self.record(metrics, evaluated)
        metrics = {**metrics, "step": self.step, "total_steps": self.total_steps,
                   "resumed_from_step": self.resumed_from}
        if evaluated and self.evaluations.loss is not None:
            metrics["eval_loss"] = self.evaluations.loss
        if not save:
            report_to_ray(metrics)
            return
        if self.cfg.evaluation.keep_best:
            metrics[KEEP_SCORE] = self.step + (BEST_BONUS if self.evaluations.best_step == self.step else 0.0)
        self.tensorboard.sync()
        name = ckpt_name(self.step)
        path = ckptlib.join(self.cfg.run_dir, name)
        self.backend.save(path, name, {"step": self.step, "epoch": metrics.get("epoch"), "path": path,
                                       "metrics": self.last_metrics, "evaluation": self.evaluations.as_dict(),
                                       GLOBAL_BATCH_STATE: self.global_batch}, metrics)
        self.last_ckpt = path
        if self.request_saving:   # any committed save after the request was seen answers it
            self.request_answered, self.request_saving = self.request_saving, None

    # --- evaluate -------------------------------------------------------------------------------------
    def evaluate_if_due(self, epoch_end: bool) -> bool:
        """The eval set's loss after this step, when one is due: every spec.evaluation.everySteps steps
        and at the run's last step, or (everySteps left out) at each epoch's end. Early stopping is
        decided here."""
        cfg = self.cfg
        if not cfg.eval_rows:
            return False
        every = cfg.evaluation.every_steps
        if not (self.step % every == 0 or self.step >= self.total_steps if every else epoch_end):
            return False
        loss_sum, labelled = self.backend.evaluate()
        loss = loss_sum / labelled if labelled else math.nan
        ev = self.evaluations
        ev.observe(self.step, loss, ckptlib.join(cfg.run_dir, ckpt_name(self.step)))
        if self.rank == 0:
            ppl = perplexity(loss)
            say(f"Eval at step {self.step}/{self.total_steps} | eval_loss={loss:.4f} | "
                f"perplexity={'-' if ppl is None else f'{ppl:.3f}'} | best={_num(ev.best_loss)} at step {ev.best_step}")
        if ev.patience_spent(cfg.evaluation.early_stopping_patience) and self.step < self.total_steps:
            self.early_stop = self._early_stop_message()
            if self.rank == 0:
                say(f"[tpuft] {self.early_stop}")
        return True

    def _early_stop_message(self) -> str:
        ev = self.evaluations
        return (f"early stopping at step {self.step} of {self.total_steps}: the eval loss has not improved for "
                f"{self.cfg.evaluation.early_stopping_patience} evaluations (best {_num(ev.best_loss)} at step "
                f"{ev.best_step})")

    # --- train ----------------------------------------------------------------------------------------
    def train(self) -> bool:
        """Every step left; True when the ranks stopped on request (after that step's checkpoint).
        An early stop (spec.evaluation.earlyStoppingPatience) ends it as finished."""
        cfg = self.cfg
        self.tensorboard = TensorBoard(cfg.run_dir, self.rank == 0, resumed_at=self.step)
        # tagged with the TPUFinetune's name (the run's directory name off the cluster)
        tag = cfg.cr_name or cfg.run_dir.rstrip("/").rsplit("/", 1)[-1]
        self.prometheus = Prometheus(self.rank == 0, tag)
        if self.rank == 0:
            say(recipe_line(cfg.training, self.global_batch, self.spe, self.total_steps, self.epochs))
        ev = self.evaluations
        # resumed after an early stop
        if ev.patience_spent(cfg.evaluation.early_stopping_patience) and self.step < self.total_steps:
            self.early_stop = self._early_stop_message()
            return False
        for epoch in range(self.step // self.spe if self.spe else 0, self.epochs):
            if self._epoch(epoch):
                return True
            if self.early_stop:
                break
        return False

    def _epoch(self, epoch: int) -> bool:
        """One epoch's steps; True when the ranks agreed to stop (that step's checkpoint is saved)."""
        cfg, spe = self.cfg, self.spe
        every_ckpt, every_rep = cfg.run.checkpoint.every_steps, cfg.training.report_every_steps
        end = min(spe, self.total_steps - epoch * spe)   # maxSteps may end the last epoch early
        done = self.step - epoch * spe   # a resumed epoch passes over the batches it already trained on
        if done >= end:
            return False
        batches = self.backend.batches(epoch, done)
        epoch_win, win = Window(self.backend.totals), Window(self.backend.totals)
        stop = evaluated = False
        for i, micro_batches in zip(range(done, end), batches):
            faultlib.fire_train(self.faults, self.rank, self.step + 1, cfg.run_dir_local)
            self.learning_rate = learning_rate_at(cfg.training, self.step, self.total_steps)
            s = self.backend.step(micro_batches, self.learning_rate)
            self.step += 1
            for w in (win, epoch_win):
                w.add(s)
            # Every rank takes part in the agreement (a collective); a stop on the run's last step is
            # moot: the step is trained, so the run finishes (export) instead of saving a stop that a
            # resubmitted run would find with nothing left to train.
            agreed = self.backend.agree(self.step, self._checkpoint_wanted())
            stop = agreed.stop and self.step < self.total_steps
            paused = time.perf_counter()
            evaluated = self.evaluate_if_due(epoch_end=i == end - 1)
            if evaluated:   # evaluations are not training time
                spent = time.perf_counter() - paused
                for w in (win, epoch_win):
                    w.excluded += spent
            if i == end - 1:  # the end of the epoch reports (and saves) below
                break
            best = evaluated and self.evaluations.best_step == self.step
            save = (stop or agreed.checkpoint or bool(self.early_stop)
                    or (bool(every_ckpt) and self.step % every_ckpt == 0) or (best and cfg.evaluation.keep_best))
            # The first step after a resume is reported at once: "training again" shows when it is.
            first = self.step == self.resumed_from + 1 and self.resumed_from > 0
            if self.step % every_rep == 0 or save or evaluated or first:
                paused = time.perf_counter()
                self._interval(epoch, win.reduce(), save, stop, evaluated, force=first)
                # Reports and checkpoints are not training time: a report waits for the controller
                # to poll the previous one (result queue of size 1, polled every 2 s). Rates leave
                # them out, so tokens/s measures training steps only; epoch_time is the wall clock.
                epoch_win.excluded += time.perf_counter() - paused
                win = Window(self.backend.totals)
            if stop or self.early_stop:
                return stop
        # the interval since the last report, and the whole epoch (its own key: epoch_loss)
        self._epoch_end(epoch, win.reduce(), epoch_win.reduce(), stop, evaluated)
        return stop

    def _checkpoint_wanted(self) -> bool:
        """Rank 0: a checkpoint request the latest status answer carried (report.BackgroundReporter.
        checkpoint_request: not yet answered in the object) that this run has not answered either.
        The other ranks learn it from the step boundary's agreement."""
        if self.rank != 0:
            return False
        wanted = self.reporter.checkpoint_request()
        if wanted is None or wanted == self.request_answered:
            return False
        if wanted != self.request_saving:
            say(f"[tpuft] checkpoint requested (status.recovery.checkpointRequestedAt {wanted}): saving step "
                f"{self.step}'s checkpoint, then training on")
        self.request_saving = wanted
        return True

    def _answered(self) -> dict:
        """status.training's answer to the checkpoint request, once a save answered it."""
        return {TrainingStatus.CHECKPOINT_REQUEST_SAVED.value: self.request_answered} if self.request_answered else {}

    def _now(self, force: bool, epoch: int) -> None:
        """status.training after a report."""
        self.status(force, epoch=epoch, step=self.step, lastCheckpoint=self.last_ckpt or None,
                    **({"message": self.early_stop} if self.early_stop else {}), **self._answered(),
                    **self.last_metrics)

    def _interval(self, epoch: int, m: dict, save: bool, stop: bool, evaluated: bool, force: bool = False) -> None:
        if self.rank == 0:
            say(interval_line(epoch + 1, self.epochs, self.step, self.total_steps, m, self.learning_rate))
        self.report({"epoch": epoch + 1, **m, **stopped(stop)}, save, evaluated)
        self._now(save or evaluated or force, epoch + 1)

    def _epoch_end(self, epoch: int, interval: dict, whole: dict, stop: bool, evaluated: bool) -> None:
        if self.rank == 0:
            say(epoch_line(epoch + 1, self.epochs, whole))
        self.report({"epoch": epoch + 1, **interval, "epoch_loss": whole["loss"], "epoch_time_s": whole["seconds"],
                     **stopped(stop)}, True, evaluated)
        self._now(True, epoch + 1)

    # --- the end ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """The end of a stopped run: no export, no summary (the run did not finish). Rank 0 puts the
        message into status; every rank tells its pod's preStop hook the checkpoint is saved."""
        msg = preemption.message(self.step)
        if self.rank == 0:
            say(f"[tpuft] {msg}")
            self.status(True, step=self.step, lastCheckpoint=self.last_ckpt, message=msg, **self._answered(),
                        **self.last_metrics)
        self.reporter.close()
        self.tensorboard.close()
        preemption.write_marker(self.step, self.last_ckpt)

    def _keep_best(self) -> tuple[int, str | None]:
        """keepBest: the best evaluation's weights loaded when it was not the last step's. Returns
        (the step exported, what to say about it, None when there is nothing to say)."""
        ev = self.evaluations
        if not (self.cfg.evaluation.keep_best and ev.best_loss is not None):
            return self.step, None
        if ev.best_step == self.step:
            return self.step, f"exported step {self.step}: its eval loss {ev.best_loss:.4f} is the run's lowest"
        if not checkpoint_exists(ev.best_path):   # every rank sees the same storage: all load, or none
            return self.step, (f"keepBest: the checkpoint of the lowest eval loss (step {ev.best_step}, "
                               f"{ev.best_loss:.4f}) is gone from {ev.best_path}; exported the last step {self.step}")
        self.backend.load_from(ev.best_path)
        return ev.best_step, (f"exported step {ev.best_step} (eval loss {ev.best_loss:.4f}, the run's lowest), "
                              f"not the last step {self.step} (eval loss {_num(ev.loss)})")

    def finish(self) -> None:
        """The end of a finished run: with keepBest the best checkpoint loaded, the export; rank 0
        reports it into status and writes the run's summary (Result.metrics is the latest
        *checkpoint's*, maybe an earlier attempt's: this file is what the final attempt did; the
        history is in status and TensorBoard); every rank closes its reporter and TensorBoard writer."""
        exported_step, kept = self._keep_best()
        exported = self.backend.export()
        message = "; ".join(m for m in (self.early_stop, kept) if m) or None
        metrics = {k: v for k, v in self.last_metrics.items() if k != "history"}
        summary = {"step": self.step, "totalSteps": self.total_steps, "resumedFromStep": self.resumed_from,
                   "lastCheckpoint": self.last_ckpt, "exportedModel": exported, "exportedStep": exported_step,
                   **self.fixed, **metrics,
                   **({"resumedFrom": self.source, "message": self.message} if self.source else {})}
        if message:
            summary["message"] = "; ".join(m for m in (summary.get("message"), message) if m)
        if self.rank == 0:
            if message:
                say(f"[tpuft] {message}")
            say(f"[tpuft] exported Hugging Face model (step {exported_step}) to {exported}")
            self.status(True, epoch=self.epoch_at(self.step), step=self.step, lastCheckpoint=self.last_ckpt,
                        exportedModel=exported, **({"message": message} if message else {}), **self._answered(),
                        **self.last_metrics)
            ckptlib.write_json(ckptlib.join(self.cfg.run_dir, SUMMARY), summary)
        self.reporter.close()
        self.tensorboard.close()
