"""Fine-tuning with Ray Train v2 (TorchTrainer) + FSDP2, one code path for TPU, GPU and CPU.

Driver (`run_training`): ScalingConfig from the slice, RunConfig(name=run_name,
storage_path) so a re-submitted job with the same run name resumes from the latest
checkpoint, FailureConfig for in-job restarts, CheckpointConfig(num_to_keep). The operator's
run name carries the object's UID: a re-created TPUFinetune starts fresh, and continues an
earlier run only through --resume-from (spec.checkpoint.resumeFrom), checked here first.

Input (tpuft_workload.pipeline, on the driver before any worker starts): Ray Data reads,
tokenizes and packs the dataset once; the rows are materialized and each epoch Ray Train's
DataConfig streams disjoint, equal shards to the workers.

Workers (`train_loop`, on a typed `TrainConfig`): setup (their dataset shard; shard the model),
restore (the run's own latest checkpoint, else --resume-from's, if any), train (steps over
`iter_torch_batches`; metrics reported every K steps and at epoch ends; DCP checkpoints),
finish (export an HF folder, the run's summary) or, told to stop (SIGTERM: tpuft_workload.preemption),
a checkpoint at the next step boundary and no export: the driver reports the run stopped. Each report (`record`, shared with the JAX path)
updates status.training (with its downsampled history and MFU) and rank 0's TensorBoard files.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import ray
import ray.train

from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import data as datalib
from tpuft_workload import faults as faultlib
from tpuft_workload import pipeline, preemption
from tpuft_workload.metrics_log import Prometheus, TensorBoard
from tpuft_workload.platform import PLATFORMS, Target, load_backend
from tpuft_workload.report import (BackgroundReporter, StatusReporter, Throttle, add_point, flops_per_token,
                                   gpu_slice_peak, mfu)

log = logging.getLogger(__name__)

RESULT_PREFIX = "TPUFT_TRAIN_RESULT"
SUMMARY = "summary.json"  # under storage_path/run_name, written by rank 0 when a run completes


def _say(msg: str) -> None:
    """One line on the worker's stdout. Not print(): Ray Train v2 patches print() to also log
    it, and the RayJob log then shows every line twice."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def _ckpt_name(step: int) -> str:
    return f"checkpoint_step_{step:07d}"


def _status_metrics(m: dict) -> dict:
    """A _Window.reduce() result as status.training keys (also kept in each checkpoint)."""
    return {"loss": round(m["loss"], 5), "tokensPerSecond": round(m["tokens_per_s"], 1),
            "paddedTokensPerSecond": round(m["padded_tokens_per_s"], 1),
            "stepTimeSeconds": round(m["step_time_s"], 4), "padFraction": round(m["pad_fraction"], 4)}


def record(run, m: dict) -> None:
    """What both trainers do with one report's metrics (a _Window.reduce() result): status.training's
    keys, with MFU (when the slice has a catalog peak) and the history point, become
    run.last_metrics (kept in each checkpoint, so a restarted attempt continues the same curve), and
    rank 0 adds the report to TensorBoard and its Prometheus gauges."""
    metrics = _status_metrics(m)
    utilisation = mfu(run.flops_per_token, m["tokens_per_s"], run.peak_flops)
    if utilisation is not None:
        metrics["mfu"] = utilisation
    point = {"step": run.step, "loss": metrics["loss"], "tokensPerSecond": metrics["tokensPerSecond"]}
    metrics["history"] = add_point(run.last_metrics.get("history") or [], point)
    run.last_metrics = metrics
    run.tensorboard.add(run.step, {**m, "mfu": utilisation}, run.cfg.learning_rate)
    run.prometheus.add(run.step, {**m, "mfu": utilisation})


def _resume_message(step: int, total_steps: int, source: str) -> str:
    if step >= total_steps:
        return (f"nothing left to do: resumed at step {step} of {total_steps} from {source}; loss and tokens/s "
                "are those the completed run reported")
    return f"resumed at step {step} of {total_steps} from {source}"


def _maybe_kill(faults: list, rank: int, step: int, run_dir: str) -> None:
    """The train faults (tests): kill-rank exits the process hard, sigterm-rank sends it a SIGTERM."""
    for kind in ("kill", "sigterm"):
        f = faultlib.find(faults, kind, rank)
        if f is None or f.step != step:
            continue
        marker = os.path.join(run_dir, f".tpuft-fault-{kind}-r{rank}-s{step}")
        if "://" in marker or os.path.exists(marker):
            continue  # already fired once (or remote storage: test hook is local-only)
        os.makedirs(run_dir, exist_ok=True)
        open(marker, "w").close()
        if kind == "kill":
            _say(f"[tpuft] injected fault: killing rank {rank} at step {step}")
            os._exit(17)
        _say(f"[tpuft] injected fault: SIGTERM to rank {rank} before step {step}")
        os.kill(os.getpid(), signal.SIGTERM)


class _Window:
    """Accumulates per-step numbers between two reports (device loss stays on device)."""

    def __init__(self, device):
        import torch

        self.device = device
        self.loss = torch.zeros((), device=device, dtype=torch.float32)
        self.grad_norm = torch.zeros((), device=device, dtype=torch.float32)
        self.steps = 0
        self.real = 0
        self.padded = 0
        self.t0 = time.perf_counter()
        self.excluded = 0.0  # time spent in reports/checkpoints, kept out of the rates

    def add(self, loss, real: int, padded: int, grad_norm) -> None:
        self.loss += loss.detach().float()
        self.grad_norm += grad_norm.detach().float()
        self.steps += 1
        self.real += real
        self.padded += padded

    def reduce(self) -> dict:
        """Collective: loss averaged across ranks, tokens summed across ranks, per wall second."""
        import torch
        import torch.distributed as dist

        t = torch.stack([self.loss, torch.tensor(float(self.steps), device=self.device),
                         torch.tensor(float(self.real), device=self.device),
                         torch.tensor(float(self.padded), device=self.device), self.grad_norm])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        loss_sum, steps, real, padded, grad_norm_sum = t.cpu().tolist()
        wall = time.perf_counter() - self.t0
        secs = max(wall - self.excluded, 1e-9)
        # every rank holds the same (global) gradient norm: summed over ranks like the steps
        return {"loss": loss_sum / max(steps, 1), "grad_norm": grad_norm_sum / max(steps, 1), "seconds": wall,
                "tokens_per_s": real / secs, "padded_tokens_per_s": padded / secs,
                "step_time_s": secs / max(self.steps, 1),
                "pad_fraction": 1.0 - real / padded if padded else 0.0}


@dataclass(frozen=True)
class TrainConfig:
    """What every training worker needs. Ray hands train_loop_config to the workers as a plain
    dict (`as_dict`); `train_loop` rebuilds the typed config from it (`from_dict`)."""
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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        return cls(**d)


def train_loop(config: dict) -> None:
    """One training worker: setup, restore, train (steps, reports, checkpoints), finish (export), or
    stop (told to: a checkpoint at the next step boundary, no export)."""
    preemption.install()
    run = _Run(TrainConfig.from_dict(config))
    run.restore()
    if run.train():
        stop_run(run)
    else:
        run.finish()


class _StopVote:
    """The ranks' agreement to stop at this step boundary: any rank told to (SIGTERM) -> all. One
    all-reduce MAX of a 0/1 int32 per step, on the host over gloo (the default group on CPU, a gloo
    group of its own beside NCCL or the TPU backend): it never waits on the device; about 0.1 ms on
    loopback, a few network round trips across hosts."""

    def __init__(self, backend: str):
        import torch
        import torch.distributed as dist

        self.group = None if backend == "gloo" else dist.new_group(backend="gloo")
        self.flag = torch.zeros(1, dtype=torch.int32)

    def agreed(self) -> bool:
        import torch.distributed as dist

        self.flag.fill_(int(preemption.requested()))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag.item())


class _Run:
    """One worker's training run: what setup builds, and the progress the loop moves forward."""

    def __init__(self, cfg: TrainConfig):
        import torch

        self.cfg = cfg
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.plat = PLATFORMS[cfg.platform]
        load_backend(self.plat)
        self.device = ray.train.torch.get_device()
        # MFU's denominator: the TPU slice's from the catalog (the driver's), a GPU's found here
        self.peak_flops = cfg.peak_flops
        if self.plat.kind == "gpu":
            self.peak_flops = gpu_slice_peak(torch.cuda.get_device_name(self.device), self.world)
        self.faults = faultlib.parse_faults(cfg.fault)
        self.reporter = BackgroundReporter(StatusReporter(cfg.cr_namespace, cfg.cr_name) if self.rank == 0
                                           else StatusReporter("", ""))
        self.throttle = Throttle(cfg.status_every_s)
        torch.manual_seed(cfg.seed)
        self._data()
        self._model()
        self.vote = _StopVote(self.plat.backend)
        # progress: restored from a checkpoint, moved by the loop
        self.step, self.resumed_from = 0, -1
        self.last_ckpt, self.message, self.source = "", None, ""
        self.last_metrics: dict = {}  # status.training metrics of the latest report, restored with a checkpoint
        self.tensorboard = TensorBoard(cfg.run_dir, enabled=False)   # rank 0's opens once restored (train)
        self.prometheus = Prometheus(enabled=False)

    def _data(self) -> None:
        from tpuft_workload import model as modellib

        cfg = self.cfg
        self.tokenizer = modellib.load_tokenizer(cfg.model)   # for the export
        self.shard = ray.train.get_dataset_shard("train")
        self.spe = datalib.steps_per_epoch(cfg.rows, self.world, cfg.batch_size_per_device)
        self.total_steps = self.spe * cfg.epochs
        if self.rank == 0:
            _say(f"[tpuft] {cfg.examples} examples -> {cfg.rows} rows of {cfg.max_seq_length} tokens "
                 f"({'packed' if cfg.packing else 'padded'}, pad fraction {cfg.pad_fraction:.1%}; Ray Data, "
                 f"tokenized once); {self.spe} steps/epoch x {cfg.epochs} epochs on {self.world} workers")

    def _model(self) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from tpuft_workload import model as modellib

        cfg = self.cfg
        self.model = modellib.load_model(cfg.model, self.tokenizer, self.plat, cfg.seed)
        arch = ckptlib.architecture(self.model)
        # counted before sharding: MFU's numerator
        self.flops_per_token = flops_per_token(arch["parameters"], self.model.config.to_dict(), cfg.max_seq_length)
        if cfg.resume_from:
            try:
                ckptlib.check_architecture(cfg.resume_from, cfg.resume_manifest, arch, cfg.model)
            except ckptlib.ResumeError as e:
                if self.rank == 0:
                    self.reporter.training(message=str(e))
                    self.reporter.close()
                # Every rank sees the same mismatch; none may fail before rank 0's status write is
                # out, or Ray Train tears the group down (rank 0 with it) and the reason is lost.
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()
                raise
        if self.rank == 0:
            ckptlib.write_run_manifest(cfg.run_dir, {
                "model": cfg.model, "architecture": arch, "namespace": cfg.cr_namespace,
                "name": cfg.cr_name, "resumeFrom": cfg.resume_from or None})
        mesh = init_device_mesh(self.plat.device_type, (self.world,))
        self.params = modellib.shard(self.model, mesh, self.plat, self.device)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=0.01)

    # --- restore ------------------------------------------------------------------------------------
    def restore(self) -> None:
        """This run's own newest committed checkpoint first: Ray's registered one (get_checkpoint)
        can be older when a worker died before the controller polled the last report. An earlier
        run's (--resume-from) only when this run has none yet."""
        from ray.train import Checkpoint

        cfg = self.cfg
        latest = ckptlib.find_latest_committed(cfg.run_dir)
        ckpt = Checkpoint(latest, filesystem=ckptlib.filesystem(latest)) if latest else ray.train.get_checkpoint()
        if ckpt is None and cfg.resume_from:
            latest = cfg.resume_from
            ckpt = Checkpoint(latest, filesystem=ckptlib.filesystem(latest))
        if ckpt is None:
            return
        self.source = latest or ckpt.path
        with ckpt.as_directory() as d:
            state = ckptlib.load(self.model, self.opt, d)
        self.step, self.resumed_from, self.last_ckpt = int(state["step"]), int(state["step"]), state.get("path", "")
        self.last_metrics = dict(state.get("metrics") or {})
        self.message = _resume_message(self.step, self.total_steps, self.source)
        if self.rank == 0:
            _say(f"[tpuft] {self.message}")
        epoch = min(self.step // self.spe + 1, cfg.epochs) if self.spe else cfg.epochs
        self.status(True, epoch=epoch, step=self.step, resumedFrom=self.source, resumedFromStep=self.step,
                    message=self.message, lastCheckpoint=self.last_ckpt or None, **self.last_metrics)

    # --- report -------------------------------------------------------------------------------------
    def status(self, force: bool, **fields) -> None:
        """status.training of the TPUFinetune (rank 0, throttled unless forced)."""
        if self.rank == 0 and self.reporter.enabled and self.throttle.ready(force):
            self.reporter.training(epochs=self.cfg.epochs, totalSteps=self.total_steps, **fields)

    def report(self, metrics: dict, save: bool) -> None:
        """ray.train.report, with a sharded checkpoint when `save` (committed once every rank's
        shards are uploaded). A stop's checkpoint carries metrics["stopped"]: Result.metrics, which
        the driver reads, are the newest checkpoint's."""
        import torch
        from ray.train import Checkpoint

        record(self, metrics)
        metrics = {**metrics, "step": self.step, "total_steps": self.total_steps,
                   "resumed_from_step": self.resumed_from}
        if not save:
            ray.train.report(metrics)
            return
        self.tensorboard.sync()
        name = _ckpt_name(self.step)
        path = ckptlib.join(self.cfg.run_dir, name)
        with tempfile.TemporaryDirectory() as tmp:
            ckptlib.save(self.model, self.opt, {"step": self.step, "epoch": metrics.get("epoch"), "path": path,
                                                "metrics": self.last_metrics}, tmp, self.rank)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
        torch.distributed.barrier()  # every rank's shards are uploaded
        if self.rank == 0:
            ckptlib.mark_committed(path)
        self.last_ckpt = path

    # --- train ----------------------------------------------------------------------------------------
    def train(self) -> bool:
        """Every epoch left; True when the ranks stopped on request (after that step's checkpoint)."""
        self.tensorboard = TensorBoard(self.cfg.run_dir, self.rank == 0, resumed_at=self.step)
        # tagged with the TPUFinetune's name (the run's directory name off the cluster)
        tag = self.cfg.cr_name or self.cfg.run_dir.rstrip("/").rsplit("/", 1)[-1]
        self.prometheus = Prometheus(self.rank == 0, tag)
        self.model.train()
        for epoch in range(self.step // self.spe if self.spe else 0, self.cfg.epochs):
            if self._epoch(epoch):
                return True
        return False

    def _step(self, batch: dict) -> tuple:
        """One optimizer step on `batch` (a [batch, max_len] slice of the shard); (loss, real tokens,
        gradient norm)."""
        import torch

        _maybe_kill(self.faults, self.rank, self.step + 1, self.cfg.run_dir_local)
        # packed rows restart position_ids per example (block-diagonal attention); padded rows mask
        keys = ("input_ids", "labels", "position_ids" if self.cfg.packing else "attention_mask")
        inputs = {k: batch[k].to(self.device) for k in keys}
        out = self.model(**inputs)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)   # the norm before clipping
        if hasattr(grad_norm, "full_tensor"):   # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return out.loss, int(batch["n_real"].sum()), grad_norm

    def _epoch(self, epoch: int) -> bool:
        """One epoch's steps; True when the ranks agreed to stop (that step's checkpoint is saved)."""
        cfg, spe, bsz = self.cfg, self.spe, self.cfg.batch_size_per_device
        every_ckpt, every_rep = cfg.checkpoint_every_steps, cfg.report_every_steps
        done = self.step - epoch * spe   # a resumed epoch passes over the batches it already trained on
        batches = pipeline.torch_batches(self.shard, bsz, cfg.seed, epoch, skip=done)
        epoch_win, win = _Window(self.device), _Window(self.device)
        stop = False
        for i, batch in zip(range(done, spe), batches):
            loss, real, grad_norm = self._step(batch)
            for w in (win, epoch_win):
                w.add(loss, real, bsz * cfg.max_seq_length, grad_norm)
            stop = self.vote.agreed()
            if i == spe - 1:  # the end of the epoch reports (and saves) below
                break
            save = stop or (bool(every_ckpt) and self.step % every_ckpt == 0)
            if self.step % every_rep == 0 or save:
                paused = time.perf_counter()
                m = win.reduce()
                if self.rank == 0:
                    _say(interval_line(epoch + 1, cfg.epochs, self.step, self.total_steps, m))
                self.report({"epoch": epoch + 1, **m, **_stopped(stop)}, save)
                self.status(save, epoch=epoch + 1, step=self.step, lastCheckpoint=self.last_ckpt or None,
                            **self.last_metrics)
                # Reports and checkpoints are not training time: a report waits for the controller
                # to poll the previous one (result queue of size 1, polled every 2 s). Rates leave
                # them out, so tokens/s measures training steps only; epoch_time is the wall clock.
                epoch_win.excluded += time.perf_counter() - paused
                win = _Window(self.device)
            if stop:
                return True
        m = epoch_win.reduce()
        if self.rank == 0:
            _say(epoch_line(epoch + 1, cfg.epochs, m))
        self.report({"epoch": epoch + 1, "epoch_loss": m["loss"], "epoch_time_s": m["seconds"], **m,
                     **_stopped(stop)}, True)
        self.status(True, epoch=epoch + 1, step=self.step, lastCheckpoint=self.last_ckpt, **self.last_metrics)
        return stop

    # --- finish ---------------------------------------------------------------------------------------
    def finish(self) -> None:
        import torch

        cfg = self.cfg
        # bf16 export on accelerators (the dtype the model trains in); fp32 on CPU
        exported = ckptlib.export_hf(self.model, self.tokenizer, cfg.export_uri, self.rank,
                                     dtype=torch.bfloat16 if self.plat.mixed_precision else None)
        finish_run(self, exported)


def scaling_config(target: Target, per_host: bool = False):
    """Ray Train's workers on TPU (with the slice's topology), GPU or CPU: one per device (torch),
    or with per_host one per host, each holding all of its host's TPU resources (JAX)."""
    from ray.train import ScalingConfig
    from tpuft.constants import RAY_TPU_RESOURCE_PER_CHIP_ENV

    shape, plat = target.shape, target.platform
    workers = target.jax_workers if per_host else target.world_size
    if plat.is_tpu:
        if shape.tpu_resource_per_chip > 1:  # TPU7x: Ray reads it at ScalingConfig validation
            os.environ.setdefault(RAY_TPU_RESOURCE_PER_CHIP_ENV, str(shape.tpu_resource_per_chip))
        # per host: resources_per_worker left to Ray, which gives a worker all of its host's TPUs
        per_worker = {} if per_host else {"resources_per_worker": {"TPU": 1}}
        return ScalingConfig(use_tpu=True, topology=shape.topology, accelerator_type=shape.ray_accelerator_type,
                             num_workers=workers, **per_worker)
    if plat.kind == "gpu":
        return ScalingConfig(num_workers=workers, use_gpu=True)
    return ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})


def interval_line(epoch: int, epochs: int, step: int, total: int, m: dict) -> str:
    """The per-interval log line both trainers print (`tpuft demo`'s docs and the benches read it)."""
    return (f"Epoch {epoch}/{epochs} | step {step}/{total} | loss={m['loss']:.4f} | "
            f"step_time={m['step_time_s']:.3f}s | tokens/s={m['tokens_per_s']:.1f} | "
            f"padded_tokens/s={m['padded_tokens_per_s']:.1f}")


def epoch_line(epoch: int, epochs: int, m: dict) -> str:
    return (f"Epoch {epoch}/{epochs} | loss={m['loss']:.4f} | epoch_time={m['seconds']:.2f}s | "
            f"tokens/s={m['tokens_per_s']:.1f} | padded_tokens/s={m['padded_tokens_per_s']:.1f} | "
            f"pad={m['pad_fraction']:.1%}")


def _stopped(stop: bool) -> dict:
    """The report metric that marks a stop's checkpoint (what the driver looks for)."""
    return {"stopped": preemption.REASON} if stop else {}


def stop_run(run) -> None:
    """The end of a stopped run, both trainers: no export, no summary (the run did not finish). Rank
    0 puts the message into status; every rank tells its pod's preStop hook the checkpoint is saved."""
    msg = preemption.message(run.step)
    if run.rank == 0:
        _say(f"[tpuft] {msg}")
        run.status(True, step=run.step, lastCheckpoint=run.last_ckpt, message=msg, **run.last_metrics)
    run.reporter.close()
    run.tensorboard.close()
    preemption.write_marker(run.step, run.last_ckpt)


def finish_run(run, exported: str | None) -> None:
    """The end both trainers share: rank 0 reports the export into status and writes the run's
    summary (Result.metrics is the latest *checkpoint's*, maybe an earlier attempt's: this file is
    what the final attempt did; the history is in status and TensorBoard); every rank closes its
    reporter and TensorBoard writer."""
    metrics = {k: v for k, v in run.last_metrics.items() if k != "history"}
    summary = {"step": run.step, "totalSteps": run.total_steps, "resumedFromStep": run.resumed_from,
               "lastCheckpoint": run.last_ckpt, "exportedModel": exported, **metrics,
               **({"resumedFrom": run.source, "message": run.message} if run.source else {})}
    if run.rank == 0:
        _say(f"[tpuft] exported Hugging Face model to {exported}")
        run.status(True, epoch=run.cfg.epochs, step=run.step, lastCheckpoint=run.last_ckpt,
                   exportedModel=exported, **run.last_metrics)
        ckptlib.write_json(ckptlib.join(run.cfg.run_dir, SUMMARY), summary)
    run.reporter.close()
    run.tensorboard.close()


def prepare(args, target: Target, fault_spec: str = "") -> tuple[str, pipeline.Packed, dict]:
    """What any trainer needs, before any worker starts: (storage path, the packed dataset, the
    workers' TrainConfig as a dict). ResumeError / DataError for a resume point or data that
    cannot be used."""
    from tpuft.constants import ENV_CR_NAME, ENV_CR_NAMESPACE, TrainingFramework

    storage = args.storage_path if "://" in args.storage_path else os.path.abspath(args.storage_path)
    run_dir = ckptlib.join(storage, args.run_name)
    # Checked before any worker starts: it exists, tpuft wrote it and (torch; the JAX path's on its
    # workers) for spec.model's architecture. The workers check the architecture again.
    resume_from, resume_manifest = ckptlib.resolve_resume(args.resume_from) if args.resume_from else ("", {})
    if resume_from and args.framework == TrainingFramework.TORCH.value:
        from tpuft_workload import model as modellib

        ckptlib.check_architecture(resume_from, resume_manifest, ckptlib.architecture(modellib.meta_model(args.model)),
                                   args.model)
    packed = pipeline.build(args.dataset, args.dataset_split, args.dataset_format, args.model,
                            args.max_seq_length, args.packing)
    if datalib.steps_per_epoch(packed.rows, target.world_size, args.batch_size_per_device) == 0:
        raise pipeline.DataError(
            f"{packed.rows} training rows cannot fill one global batch of {target.world_size} workers x "
            f"{args.batch_size_per_device} per device: use a larger spec.dataset.split, a smaller "
            "spec.training.batchSizePerDevice or maxSeqLength, or fewer workers")
    cfg = TrainConfig(
        platform=target.platform.kind, model=args.model, rows=packed.rows, examples=packed.examples,
        pad_fraction=packed.pad_fraction, epochs=args.epochs, batch_size_per_device=args.batch_size_per_device,
        max_seq_length=args.max_seq_length, learning_rate=args.learning_rate, packing=args.packing,
        checkpoint_every_steps=args.checkpoint_every_steps, report_every_steps=args.report_every_steps,
        seed=args.seed, fault=fault_spec, run_dir=run_dir,
        run_dir_local=run_dir if "://" not in run_dir else "",
        export_uri=ckptlib.join(run_dir, ckptlib.EXPORT_DIR),
        resume_from=resume_from, resume_manifest=resume_manifest,
        cr_namespace=os.environ.get(ENV_CR_NAMESPACE, ""), cr_name=os.environ.get(ENV_CR_NAME, ""),
        status_every_s=float(os.environ.get("TPUFT_STATUS_EVERY_S", "10")),
        peak_flops=target.shape.peak_flops * target.slices if target.platform.is_tpu else None,
    ).as_dict()
    return storage, packed, cfg


def run_config(args, storage: str):
    """RunConfig(name, storage_path): a re-submitted job with the same run name resumes there."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    return RunConfig(name=args.run_name, storage_path=storage,
                     checkpoint_config=CheckpointConfig(num_to_keep=args.keep_checkpoints),
                     failure_config=FailureConfig(max_failures=args.max_failures))


def build_trainer(args, target: Target, fault_spec: str = ""):
    """(TorchTrainer, its train_loop_config as a dict: TrainConfig.as_dict)."""
    from ray.train import DataConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    scaling = scaling_config(target)
    storage, packed, cfg = prepare(args, target, fault_spec)
    return TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config=cfg,
        datasets={"train": packed.dataset},
        dataset_config=DataConfig(datasets_to_split=["train"]),
        torch_config=TorchConfig(backend=target.platform.backend),
        scaling_config=scaling,
        run_config=run_config(args, storage),
    ), cfg


def _failed(error: str) -> int:
    print(f"{RESULT_PREFIX} " + json.dumps({"succeeded": False, "error": error[:1000]}), flush=True)
    return 1


def run_training(args, target: Target, fault_spec: str = "", build=None) -> int:
    """Build (`build`: build_trainer, or jax_train.build_trainer), fit, print the result line."""
    try:
        trainer, cfg = (build or build_trainer)(args, target, fault_spec)
    except (ckptlib.ResumeError, pipeline.DataError) as e:
        StatusReporter().training(message=str(e))
        log.error("%s", e)
        return _failed(str(e))
    print(f"Starting fine-tuning: model={args.model} dataset={args.dataset}[{args.dataset_split}] "
          f"{target.shape.generation} {target.shape.topology} x{target.slices} -> "
          f"{trainer.scaling_config.num_workers} workers ({type(trainer).__name__}), run={cfg['run_dir']}",
          flush=True)
    t0 = time.monotonic()
    try:
        result = trainer.fit()
    except Exception as e:  # noqa: BLE001 - one clear line for the RayJob log and the operator
        msg = str(e).strip().splitlines()
        log.error("training failed: %s", e)
        return _failed(f"{type(e).__name__}: {msg[-1] if msg else ''}"[:500])
    seconds = round(time.monotonic() - t0, 1)
    metrics = result.metrics or {}
    if metrics.get("stopped"):
        return _stopped_result(cfg, metrics, seconds)
    body = {"succeeded": True, "seconds": seconds, **ckptlib.read_json(ckptlib.join(cfg["run_dir"], SUMMARY))}
    print(f"{RESULT_PREFIX} {json.dumps(body)}", flush=True)
    return 0


def _stopped_result(cfg: dict, metrics: dict, seconds: float) -> int:
    """A run that stopped on request: not succeeded (no export, no summary), a checkpoint of its
    last step, EXIT_STOPPED. A resubmitted RayJob resumes from that checkpoint."""
    from tpuft.constants import EXIT_STOPPED

    step = int(metrics["step"])
    body = {"succeeded": False, "stopped": metrics["stopped"], "seconds": seconds, "step": step,
            "totalSteps": metrics.get("total_steps"), "resumedFromStep": metrics.get("resumed_from_step"),
            "lastCheckpoint": ckptlib.join(cfg["run_dir"], _ckpt_name(step)), "message": preemption.message(step)}
    print(f"[tpuft] {body['message']}", flush=True)
    print(f"{RESULT_PREFIX} {json.dumps(body)}", flush=True)
    return EXIT_STOPPED


if __name__ == "__main__":  # pragma: no cover - use `python -m tpuft_workload train`
    sys.exit("use: python -m tpuft_workload train ...")
