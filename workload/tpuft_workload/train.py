"""Fine-tuning with Ray Train v2 (TorchTrainer) + FSDP2, one code path for TPU, GPU and CPU.

Driver (`run_training`): ScalingConfig from the slice, RunConfig(name=run_name,
storage_path) so a re-submitted job with the same run name resumes from the latest
checkpoint, FailureConfig for in-job restarts, CheckpointConfig(num_to_keep). The operator's
run name carries the object's UID: a re-created TPUFinetune starts fresh, and continues an
earlier run only through --resume-from (spec.checkpoint.resumeFrom), checked here first.

Workers (`train_loop`): tokenize + pack the data (every rank builds the same rows, then
takes its disjoint slice), shard the model, restore the run's own latest checkpoint (else
--resume-from's) if any, train, report metrics every K steps and at epoch ends, checkpoint
with DCP, export an HF folder.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

import ray
import ray.train

from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import data as datalib
from tpuft_workload import faults as faultlib
from tpuft_workload.platform import PLATFORMS, Target, load_backend
from tpuft_workload.report import BackgroundReporter, StatusReporter, Throttle

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


def _resume_message(step: int, total_steps: int, source: str) -> str:
    if step >= total_steps:
        return (f"nothing left to do: resumed at step {step} of {total_steps} from {source}; loss and tokens/s "
                "are those the completed run reported")
    return f"resumed at step {step} of {total_steps} from {source}"


def _maybe_kill(faults: list, rank: int, step: int, run_dir: str) -> None:
    f = faultlib.find(faults, "kill", rank)
    if f is None or f.step != step:
        return
    marker = os.path.join(run_dir, f".tpuft-fault-kill-r{rank}-s{step}")
    if "://" in marker or os.path.exists(marker):
        return  # already fired once (or remote storage: test hook is local-only)
    os.makedirs(run_dir, exist_ok=True)
    open(marker, "w").close()
    _say(f"[tpuft] injected fault: killing rank {rank} at step {step}")
    os._exit(17)


class _Window:
    """Accumulates per-step numbers between two reports (device loss stays on device)."""

    def __init__(self, device):
        import torch

        self.device = device
        self.loss = torch.zeros((), device=device, dtype=torch.float32)
        self.steps = 0
        self.real = 0
        self.padded = 0
        self.t0 = time.perf_counter()
        self.excluded = 0.0  # time spent in reports/checkpoints, kept out of the rates

    def add(self, loss, real: int, padded: int) -> None:
        self.loss += loss.detach().float()
        self.steps += 1
        self.real += real
        self.padded += padded

    def reduce(self) -> dict:
        """Collective: loss averaged across ranks, tokens summed across ranks, per wall second."""
        import torch
        import torch.distributed as dist

        t = torch.stack([self.loss, torch.tensor(float(self.steps), device=self.device),
                         torch.tensor(float(self.real), device=self.device),
                         torch.tensor(float(self.padded), device=self.device)])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        loss_sum, steps, real, padded = t.cpu().tolist()
        wall = time.perf_counter() - self.t0
        secs = max(wall - self.excluded, 1e-9)
        return {"loss": loss_sum / max(steps, 1), "seconds": wall,
                "tokens_per_s": real / secs, "padded_tokens_per_s": padded / secs,
                "step_time_s": secs / max(self.steps, 1),
                "pad_fraction": 1.0 - real / padded if padded else 0.0}


def train_loop(cfg: dict) -> None:
    import torch
    import torch.distributed
    from torch.distributed.device_mesh import init_device_mesh
    from ray.train import Checkpoint

    from tpuft_workload import model as modellib

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    plat = PLATFORMS[cfg["platform"]]
    load_backend(plat)
    device = ray.train.torch.get_device()
    faults = faultlib.parse_faults(cfg["fault"])
    reporter = BackgroundReporter(StatusReporter(cfg["cr_namespace"], cfg["cr_name"]) if rank == 0
                                  else StatusReporter("", ""))
    throttle = Throttle(cfg["status_every_s"])
    torch.manual_seed(cfg["seed"])

    tokenizer = modellib.load_tokenizer(cfg["model"])
    records = datalib.load_records(cfg["dataset"], cfg["dataset_split"])
    blocks = datalib.build_blocks(tokenizer, records, cfg["max_seq_length"], cfg["packing"])
    bsz = cfg["batch_size_per_device"]
    spe = datalib.steps_per_epoch(len(blocks), world, bsz)
    datalib.rank_batches(len(blocks), world, rank, bsz, 0, cfg["seed"])  # fail early if too small
    total_steps = spe * cfg["epochs"]
    if rank == 0:
        _say(f"[tpuft] {len(records)} examples -> {len(blocks)} rows of {cfg['max_seq_length']} tokens "
              f"({'packed' if cfg['packing'] else 'padded'}, pad fraction {datalib.pad_fraction(blocks):.1%}); "
              f"{spe} steps/epoch x {cfg['epochs']} epochs on {world} workers")

    model = modellib.load_model(cfg["model"], tokenizer, plat, cfg["seed"])
    arch = ckptlib.architecture(model)
    if cfg["resume_from"]:
        try:
            ckptlib.check_architecture(cfg["resume_from"], cfg["resume_manifest"], arch, cfg["model"])
        except ckptlib.ResumeError as e:
            if rank == 0:
                reporter.training(message=str(e))
                reporter.close()
            raise
    if rank == 0:
        ckptlib.write_run_manifest(cfg["run_dir"], {
            "model": cfg["model"], "architecture": arch, "namespace": cfg["cr_namespace"],
            "name": cfg["cr_name"], "resumeFrom": cfg["resume_from"] or None})
    mesh = init_device_mesh(plat.device_type, (world,))
    params = modellib.shard(model, mesh, plat, device)
    opt = torch.optim.AdamW(params, lr=cfg["learning_rate"], weight_decay=0.01)

    step, resumed_from = 0, -1
    last_ckpt, message, source = "", None, ""
    last_metrics: dict = {}  # status.training metrics of the latest report, restored with a checkpoint
    # This run's own newest committed checkpoint first: Ray's registered one (get_checkpoint) can
    # be older when a worker died before the controller polled the last report. An earlier run's
    # (--resume-from) only when this run has none yet.
    latest = ckptlib.find_latest_committed(cfg["run_dir"])
    ckpt = Checkpoint(latest, filesystem=ckptlib.filesystem(latest)) if latest else ray.train.get_checkpoint()
    if ckpt is None and cfg["resume_from"]:
        latest = cfg["resume_from"]
        ckpt = Checkpoint(latest, filesystem=ckptlib.filesystem(latest))
    if ckpt is not None:
        source = latest or ckpt.path
        with ckpt.as_directory() as d:
            state = ckptlib.load(model, opt, d)
        step, resumed_from, last_ckpt = int(state["step"]), int(state["step"]), state.get("path", "")
        last_metrics, message = dict(state.get("metrics") or {}), _resume_message(step, total_steps, source)
        if rank == 0:
            _say(f"[tpuft] {message}")

    def status(force: bool, **fields) -> None:
        if rank == 0 and reporter.enabled and throttle.ready(force):
            reporter.training(epochs=cfg["epochs"], totalSteps=total_steps, **fields)

    if ckpt is not None:
        status(True, epoch=min(step // spe + 1, cfg["epochs"]) if spe else cfg["epochs"], step=step,
               resumedFrom=source, resumedFromStep=step, message=message, lastCheckpoint=last_ckpt or None,
               **last_metrics)

    def report(metrics: dict, save: bool) -> None:
        nonlocal last_ckpt, last_metrics
        last_metrics = _status_metrics(metrics)
        metrics = {**metrics, "step": step, "total_steps": total_steps, "resumed_from_step": resumed_from}
        if not save:
            ray.train.report(metrics)
            return
        name = _ckpt_name(step)
        path = ckptlib.join(cfg["run_dir"], name)
        with tempfile.TemporaryDirectory() as tmp:
            ckptlib.save(model, opt, {"step": step, "epoch": metrics.get("epoch"), "path": path,
                                      "metrics": last_metrics}, tmp, rank)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
        torch.distributed.barrier()  # every rank's shards are uploaded
        if rank == 0:
            ckptlib.mark_committed(path)
        last_ckpt = path

    every_ckpt, every_rep = cfg["checkpoint_every_steps"], cfg["report_every_steps"]
    model.train()
    for epoch in range(step // spe if spe else 0, cfg["epochs"]):
        batches = datalib.rank_batches(len(blocks), world, rank, bsz, epoch, cfg["seed"])
        epoch_win, win = _Window(device), _Window(device)
        for i in range(step - epoch * spe, spe):
            _maybe_kill(faults, rank, step + 1, cfg["run_dir_local"])
            batch = {k: v.to(device) for k, v in datalib.collate(blocks, batches[i]).items()}
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            real = sum(blocks[j].n_real for j in batches[i])
            for w in (win, epoch_win):
                w.add(out.loss, real, bsz * cfg["max_seq_length"])
            end_of_epoch = i == spe - 1
            if end_of_epoch:
                break
            save = bool(every_ckpt) and step % every_ckpt == 0
            if step % every_rep == 0 or save:
                paused = time.perf_counter()
                m = win.reduce()
                if rank == 0:
                    _say(f"Epoch {epoch + 1}/{cfg['epochs']} | step {step}/{total_steps} | loss={m['loss']:.4f} | "
                         f"step_time={m['step_time_s']:.3f}s | tokens/s={m['tokens_per_s']:.1f} | "
                         f"padded_tokens/s={m['padded_tokens_per_s']:.1f}")
                report({"epoch": epoch + 1, **m}, save)
                status(save, epoch=epoch + 1, step=step, lastCheckpoint=last_ckpt or None, **last_metrics)
                # Reports and checkpoints are not training time: a report waits for the controller
                # to poll the previous one (result queue of size 1, polled every 2 s). Rates leave
                # them out (the seed's epoch timer also stops before its checkpoint); epoch_time
                # is the wall clock.
                epoch_win.excluded += time.perf_counter() - paused
                win = _Window(device)
        m = epoch_win.reduce()
        if rank == 0:
            _say(f"Epoch {epoch + 1}/{cfg['epochs']} | loss={m['loss']:.4f} | epoch_time={m['seconds']:.2f}s | "
                 f"tokens/s={m['tokens_per_s']:.1f} | padded_tokens/s={m['padded_tokens_per_s']:.1f} | "
                 f"pad={m['pad_fraction']:.1%}")
        report({"epoch": epoch + 1, "epoch_loss": m["loss"], "epoch_time_s": m["seconds"], **m}, True)
        status(True, epoch=epoch + 1, step=step, lastCheckpoint=last_ckpt, **last_metrics)

    # bf16 export on accelerators (the dtype the model trains in); fp32 on CPU
    exported = ckptlib.export_hf(model, tokenizer, cfg["export_uri"], rank,
                                 dtype=torch.bfloat16 if plat.mixed_precision else None)
    summary = {"step": step, "totalSteps": total_steps, "resumedFromStep": resumed_from,
               "lastCheckpoint": last_ckpt, "exportedModel": exported, **last_metrics,
               **({"resumedFrom": source, "message": message} if source else {})}
    if rank == 0:
        _say(f"[tpuft] exported Hugging Face model to {exported}")
        status(True, epoch=cfg["epochs"], step=step, lastCheckpoint=last_ckpt, exportedModel=exported,
               **last_metrics)
        # Result.metrics is the latest *checkpoint's* metrics (maybe from an earlier attempt):
        # this file is what the final attempt actually did.
        ckptlib.write_json(ckptlib.join(cfg["run_dir"], SUMMARY), summary)
    reporter.close()


def build_trainer(args, target: Target, fault_spec: str = ""):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from tpuft.constants import ENV_CR_NAME, ENV_CR_NAMESPACE, RAY_TPU_RESOURCE_PER_CHIP_ENV

    shape, plat = target.shape, target.platform
    storage = args.storage_path if "://" in args.storage_path else os.path.abspath(args.storage_path)
    run_dir = ckptlib.join(storage, args.run_name)
    # Checked (it exists, tpuft wrote it) before any worker starts; the architecture on the workers.
    resume_from, resume_manifest = ckptlib.resolve_resume(args.resume_from) if args.resume_from else ("", {})
    if plat.is_tpu:
        if shape.tpu_resource_per_chip > 1:  # TPU7x: Ray reads it at ScalingConfig validation
            os.environ.setdefault(RAY_TPU_RESOURCE_PER_CHIP_ENV, str(shape.tpu_resource_per_chip))
        scaling = ScalingConfig(use_tpu=True, topology=shape.topology, accelerator_type=shape.ray_accelerator_type,
                                num_workers=target.world_size, resources_per_worker={"TPU": 1})
    elif plat.kind == "gpu":
        scaling = ScalingConfig(num_workers=target.world_size, use_gpu=True)
    else:
        scaling = ScalingConfig(num_workers=target.world_size, resources_per_worker={"CPU": 1})
    cfg = {
        "platform": plat.kind, "model": args.model, "dataset": args.dataset, "dataset_split": args.dataset_split,
        "epochs": args.epochs, "batch_size_per_device": args.batch_size_per_device,
        "max_seq_length": args.max_seq_length, "learning_rate": args.learning_rate, "packing": args.packing,
        "checkpoint_every_steps": args.checkpoint_every_steps, "report_every_steps": args.report_every_steps,
        "seed": args.seed, "fault": fault_spec, "run_dir": run_dir,
        "run_dir_local": run_dir if "://" not in run_dir else "",
        "export_uri": ckptlib.join(run_dir, ckptlib.EXPORT_DIR),
        "resume_from": resume_from, "resume_manifest": resume_manifest,
        # Workers run on other pods: pass the CR identity explicitly, not via their environment.
        "cr_namespace": os.environ.get(ENV_CR_NAMESPACE, ""), "cr_name": os.environ.get(ENV_CR_NAME, ""),
        "status_every_s": float(os.environ.get("TPUFT_STATUS_EVERY_S", "10")),
    }
    return TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config=cfg,
        torch_config=TorchConfig(backend=plat.backend),
        scaling_config=scaling,
        run_config=RunConfig(
            name=args.run_name, storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=args.keep_checkpoints),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    ), cfg


def _failed(error: str) -> int:
    print(f"{RESULT_PREFIX} " + json.dumps({"succeeded": False, "error": error[:1000]}), flush=True)
    return 1


def run_training(args, target: Target, fault_spec: str = "") -> int:
    try:
        trainer, cfg = build_trainer(args, target, fault_spec)
    except ckptlib.ResumeError as e:
        StatusReporter().training(message=str(e))
        log.error("%s", e)
        return _failed(str(e))
    print(f"Starting fine-tuning: model={args.model} dataset={args.dataset}[{args.dataset_split}] "
          f"{target.shape.generation} {target.shape.topology} x{target.slices} -> {target.world_size} workers "
          f"({target.platform.backend}), run={cfg['run_dir']}", flush=True)
    t0 = time.monotonic()
    try:
        trainer.fit()
    except Exception as e:  # noqa: BLE001 - one clear line for the RayJob log and the operator
        msg = str(e).strip().splitlines()
        log.error("training failed: %s", e)
        return _failed(f"{type(e).__name__}: {msg[-1] if msg else ''}"[:500])
    body = {"succeeded": True, "seconds": round(time.monotonic() - t0, 1),
            **ckptlib.read_json(ckptlib.join(cfg["run_dir"], SUMMARY))}
    print(f"{RESULT_PREFIX} {json.dumps(body)}", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - use `python -m tpuft_workload train`
    sys.exit("use: python -m tpuft_workload train ...")
