"""Fine-tuning with Ray Train v2 (TorchTrainer) + FSDP2, one code path for TPU, GPU and CPU.

Driver (`run_training`): ScalingConfig from the slice, RunConfig(name=run_name,
storage_path) so a re-submitted job with the same run name resumes from the latest
checkpoint, FailureConfig for in-job restarts, CheckpointConfig(num_to_keep). The operator's
run name carries the object's UID: a re-created TPUFinetune starts fresh, and continues an
earlier run only through --resume-from (spec.checkpoint.resumeFrom), checked here first.

Input (tpuft_workload.pipeline, on the driver before any worker starts): Ray Data reads and
tokenizes the dataset once, through the model's chat template; the driver packs whole examples into
rows and puts them in the object store; each epoch every worker takes its slice of each global
batch of a seeded permutation of the rows.

Workers (`train_loop`): tpuft_workload.loop's run (restore, steps at the scheduled rate, reports
every K steps and at epoch ends, evaluations, checkpoints, then finish or stop on SIGTERM: shared
with the JAX path) over this file's torch backend (`_Torch`): setup (the shared rows and eval rows;
the model sharded with FSDP2, each decoder layer recomputed in the backward with
activationCheckpointing; AdamW with decay on weight matrices only), the step (its micro-batches
accumulated on the global batch's mean loss per labelled token, the JAX path's objective: each
rank's summed loss over every rank's labelled tokens of every micro-batch; clipped), the eval
loss, the ranks' vote at each step boundary (stop; the operator's checkpoint request: one all-reduce
over gloo), DCP checkpoints (the run's own latest, else
--resume-from's, restored; keepBest's, loaded before the export) and the HF export.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import time

import ray
import ray.train

from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import data as datalib
from tpuft_workload import lora as loralib
from tpuft_workload import loop, pipeline, preemption
from tpuft_workload import platform as platformlib
from tpuft_workload.loop import SUMMARY, TrainConfig
from tpuft.api.kuberay import RAY_MEMORY_KILL_SIGN
from tpuft.api.spec import Lora, Run
from tpuft_workload.command import Command
from tpuft_workload.platform import PLATFORMS, Target, load_backend
from tpuft_workload.report import StatusReporter, flops_per_token, gpu_slice_peak
from tpuft_workload.tiny import BUILTIN_MODEL

log = logging.getLogger(__name__)

RESULT_PREFIX = "TPUFT_TRAIN_RESULT"


def train_loop(config: dict) -> None:
    """One training worker: tpuft_workload.loop's run over the torch backend."""
    loop.work(config, _Torch)


class _StopVote:
    """The ranks' agreement at this step boundary: stop (any rank told to, SIGTERM -> all) and save
    a checkpoint (rank 0 saw the operator's request -> all). One all-reduce MAX of two 0/1 int32 per
    step, on the host over gloo (the default group on CPU, a gloo group of its own beside NCCL or the
    TPU backend): it never waits on the device; about 0.1 ms on loopback, a few network round trips
    across hosts."""

    def __init__(self, backend: str):
        import torch
        import torch.distributed as dist

        self.group = None if backend == "gloo" else dist.new_group(backend="gloo")
        self.flags = torch.zeros(2, dtype=torch.int32)   # (stop, checkpoint)

    def agreed(self, checkpoint_wanted: bool = False) -> loop.Agreement:
        import torch.distributed as dist

        self.flags[0] = int(preemption.requested())
        self.flags[1] = int(checkpoint_wanted)
        dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=self.group)
        stop, checkpoint = self.flags.tolist()
        return loop.Agreement(stop=bool(stop), checkpoint=bool(checkpoint))


class _Torch:
    """The torch backend of tpuft_workload.loop (loop.Backend): FSDP2 over one worker per device."""

    def __init__(self, worker: loop.Worker):
        import torch

        self.worker, self.cfg, self.rank, self.world = worker, worker.cfg, worker.rank, worker.world
        self.plat = PLATFORMS[self.cfg.platform]
        load_backend(self.plat)
        self.device = ray.train.torch.get_device()
        # MFU's denominator: the TPU slice's from the catalog (the driver's), a GPU's found here
        self.peak_flops = self.cfg.peak_flops
        if self.plat.kind == "gpu":
            self.peak_flops = gpu_slice_peak(torch.cuda.get_device_name(self.device), self.world)
        torch.manual_seed(self.cfg.training.seed)
        self._data()
        self._model()
        self.vote = _StopVote(self.plat.backend)

    def _data(self) -> None:
        from tpuft_workload import model as modellib

        cfg = self.cfg
        self.tokenizer = modellib.load_tokenizer(cfg.run.model)   # for the export
        self.rows = ray.get(cfg.rows_ref)   # the shared rows, mapped from the node's object store
        self.eval_rows = ray.get(cfg.eval_rows_ref) if cfg.eval_rows_ref is not None else None
        per_step = cfg.training.batch_size_per_device * cfg.training.gradient_accumulation_steps
        self.steps_per_epoch = datalib.steps_per_epoch(cfg.rows, self.world, per_step)
        self.worker.say(f"[tpuft] {loop.data_line(cfg)}; {self.steps_per_epoch} steps/epoch of "
                        f"{cfg.training.gradient_accumulation_steps} micro-batches on {self.world} workers")

    def _model(self) -> None:
        import torch
        from tpuft_workload import model as modellib

        cfg = self.cfg
        from tpuft_workload.sharded_load import unmap_freed_tensors

        unmap_freed_tensors()   # each layer's gathered weights given back to the pod after use
        # A saved model is built on the meta device and each rank reads only its shards, below
        # (sharded_load): no rank ever holds the whole model. The builtin is built whole.
        # (the builtin is built whole: it is tiny)
        weights = None if cfg.run.model == BUILTIN_MODEL else modellib.weights_location(cfg.run.model)
        empty = modellib.empty_model(weights, self.plat) if weights is not None else None
        self.model = empty if empty is not None else modellib.load_model(cfg.run.model, self.tokenizer, self.plat,
                                                                          cfg.training.seed)
        arch = ckptlib.architecture(self.model)   # the base's: what a resume point must match
        # counted before sharding: MFU's numerator
        self.flops_per_token = flops_per_token(arch["parameters"], self.model.config.to_dict(),
                                               cfg.training.max_seq_length)
        self.worker.adopt_architecture(arch, self.barrier)
        if cfg.lora:   # before sharding: FSDP2 shards the frozen base and the adapters alike
            self.model = loralib.wrap(self.model, cfg.lora)
        mesh = modellib.device_mesh(self.plat, self.world, cfg.run.slices)
        # LoRA: the adapters
        recompute = cfg.training.activation_checkpointing
        if recompute is None:
            recompute = recompute_for_memory(self.model.config.to_dict(), cfg, self.world, self.rank)
        self.params = modellib.shard(self.model, mesh, self.plat, self.device, recompute)
        if empty is not None:
            from tpuft_workload import sharded_load

            read = sharded_load.fill(self.model, weights, seed=cfg.training.seed)
            self.worker.say(f"[tpuft] loaded {cfg.run.model} shard by shard: {read['tensors']} tensors, "
                            f"{read['bytes'] / 2**20:.1f} MiB read by this rank")
        # HSDP with accumulation: the all-reduce across slices once per optimizer step, not per micro-batch
        self.defer_all_reduce = mesh.ndim > 1 and cfg.training.gradient_accumulation_steps > 1
        self.parameter_counts = loralib.parameter_counts(self.model)
        self.worker.say(f"[tpuft] training {self.parameter_counts[0]:,} of {self.parameter_counts[1]:,} parameters"
                        + (f" (LoRA rank {cfg.lora.rank} on {','.join(cfg.lora.target_modules)})" if cfg.lora else ""))
        # the rate is set before every step (loop.learning_rate_at)
        self.opt = torch.optim.AdamW(modellib.decay_groups(self.model, cfg.training.weight_decay),
                                     lr=cfg.training.learning_rate)
        self.model.train()

    def batches(self, epoch: int, skip: int):
        """Per optimizer step, this rank's rows of the step (the epoch's permutation in steps of
        batch x accumulation rows a rank) cut into gradient_accumulation_steps micro-batches."""
        b, k = self.cfg.training.batch_size_per_device, self.cfg.training.gradient_accumulation_steps
        seed = self.cfg.training.seed
        for rows in pipeline.torch_batches(self.rows, self.world, self.rank, b * k, seed, epoch, skip=skip):
            yield [{key: v[i * b:(i + 1) * b] for key, v in rows.items()} for i in range(k)]

    def _inputs(self, batch: dict) -> dict:
        """A batch's model inputs on the device: packed rows restart position_ids per example
        (block-diagonal attention); padded rows mask."""
        keys = ("input_ids", "labels", "position_ids" if self.cfg.training.packing else "attention_mask")
        return {k: batch[k].to(self.device) for k in keys}

    def step(self, micro_batches: list, learning_rate: float) -> loop.Step:
        """One optimizer step at `learning_rate` on this rank's micro-batches (each [batch, max_len])
        on the global batch's mean loss per labelled token (model.token_mean_loss): this rank's
        summed loss, labelled and real tokens (the window sums them over the ranks), the global
        gradient norm before clipping to max_grad_norm."""
        import torch

        from tpuft_workload import model as modellib

        for group in self.opt.param_groups:
            group["lr"] = learning_rate
        loss_sum, labelled = modellib.token_mean_loss(self.model, [self._inputs(b) for b in micro_batches],
                                                      self.defer_all_reduce)
        # the norm before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.training.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):   # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loop.Step(loss_sum=loss_sum, labelled=labelled,
                         real=sum(int(b["n_real"].sum()) for b in micro_batches),
                         padded=len(micro_batches) * self.cfg.training.batch_size_per_device
                         * self.cfg.training.max_seq_length,
                         grad_norm=grad_norm.detach().float())

    def evaluate(self) -> tuple[float, float]:
        """(summed loss, labelled tokens) of the whole eval set, over every rank: each rank takes its
        share of each global batch of the rows in order; a share past the end is a row with no
        label (every rank runs the same forwards: FSDP2 gathers the weights in each)."""
        import torch

        from tpuft_workload import model as modellib

        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        labelled = torch.zeros((), dtype=torch.int32, device=self.device)
        self.model.eval()
        with torch.no_grad():
            per_device = self.cfg.training.batch_size_per_device
            for rows in pipeline.eval_batches(self.eval_rows, self.world, self.rank, per_device):
                inputs = self._inputs({k: torch.from_numpy(v.astype("int64")) for k, v in rows.items()})
                # num_items_in_batch 1: transformers' loss is then the sum over the labelled tokens
                loss_sum += self.model(**inputs, num_items_in_batch=1).loss.float()
                labelled += modellib.labelled_tokens(inputs["labels"])
        self.model.train()
        total_loss, total_labelled = self.totals([loss_sum, labelled])
        return total_loss, total_labelled

    def totals(self, values: list) -> list[float]:
        """One all-reduce SUM of the window's numbers (float32 on the device)."""
        import torch
        import torch.distributed as dist

        t = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device) for v in values])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def agree(self, step: int, checkpoint_wanted: bool) -> loop.Agreement:
        return self.vote.agreed(checkpoint_wanted)

    def barrier(self) -> None:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    # --- checkpoints ----------------------------------------------------------------------------------
    def save(self, path: str, name: str, train_state: dict, metrics: dict) -> None:
        """A sharded DCP checkpoint: each rank's shards from a local directory, uploaded by Ray
        Train's report into `path`, then committed once every rank's are uploaded."""
        from ray.train import Checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            ckptlib.save(self.model, self.opt, train_state, tmp, self.rank, trainable_only=bool(self.cfg.lora))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
        loop.commit(self, self.rank, path)

    def load(self) -> tuple[str, dict] | None:
        """This run's own newest committed checkpoint first: Ray's registered one (get_checkpoint)
        can be older when a worker died before the controller polled the last report. An earlier
        run's (--resume-from) only when this run has none yet."""
        cfg = self.cfg
        latest = ckptlib.find_latest_committed(cfg.run_dir)
        ckpt = ckptlib.ray_checkpoint(latest) if latest else ray.train.get_checkpoint()
        if ckpt is None and cfg.resume_from:
            latest = cfg.resume_from
            ckpt = ckptlib.ray_checkpoint(latest)
        if ckpt is None:
            return None
        return latest or ckpt.path, self._load(ckpt)

    def _load(self, ckpt) -> dict:
        """Collective: model and optimizer state from a ray.train.Checkpoint; returns its train_state."""
        with ckpt.as_directory() as d:
            return ckptlib.load(self.model, self.opt, d, trainable_only=bool(self.cfg.lora))

    def load_from(self, path: str) -> None:
        self._load(ckptlib.ray_checkpoint(path))

    def export(self) -> str | None:
        import torch

        from tpuft_workload import model as modellib

        # bf16 export on accelerators (the dtype the model trains in); fp32 on CPU
        dtype = torch.bfloat16 if self.plat.mixed_precision else None
        cfg = self.cfg
        modellib.as_served(self.model, cfg.run.model)
        if cfg.lora:
            return loralib.export(self.model, self.tokenizer, cfg.lora, cfg.run.model, cfg.run_dir, self.rank,
                                  merge=cfg.run.export.merge, dtype=dtype)
        return ckptlib.export_hf(self.model, self.tokenizer, cfg.export_uri, self.rank, dtype=dtype)


def recompute_for_memory(config: dict, cfg: TrainConfig, world: int, rank: int,
                         limit: int | None = None) -> bool:
    """spec.training.activationCheckpointing left out on cpu: on when this worker's pod could not
    hold a step with every layer's activations kept (tpuft.api.model_sizes' training figure), judged
    from the model's config and the pod's own memory limit: the same on every rank of one group."""
    from tpuft.api import model_sizes

    limit = limit if limit is not None else platformlib.memory_limit()
    model = model_sizes.shape_of(config)
    if limit is None or model is None:
        return False
    run = model_sizes.Run(method="lora" if cfg.lora else "full", rank=cfg.lora.rank if cfg.lora else 16,
                          targets=tuple(cfg.lora.target_modules) if cfg.lora else (),
                          tokens=cfg.training.batch_size_per_device * cfg.training.max_seq_length)
    pod_memory = f"{limit // 2 ** 20}Mi"
    on = model_sizes.recompute_needed(model, world, pod_memory, run)
    if on and rank == 0:
        print(f"[tpuft] activation checkpointing on: a step with every layer's activations kept would not fit a "
              f"worker's {pod_memory} (spec.training.activationCheckpointing, left out, lets the workers decide; "
              "set it to choose)", flush=True)
    return on


def scaling_config(target: Target, per_host: bool = False):
    """Ray Train's workers on TPU (with the slice's topology), GPU or CPU: one per device (torch),
    or with per_host one per host, each holding all of its host's TPU resources (JAX)."""
    from ray.train import ScalingConfig
    from tpuft.api.kuberay import RAY_TPU_RESOURCE_PER_CHIP_ENV

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


def prepare(command: Command, target: Target, fault_spec: str = "") -> tuple[str, pipeline.Packed, dict]:
    """What any trainer needs, before any worker starts: (storage path, the packed dataset, the
    workers' TrainConfig as a dict). ResumeError / DataError / LoraError for a resume point, data or
    LoRA settings that cannot be used."""
    from tpuft.api.constants import ENV_CR_NAME, ENV_CR_NAMESPACE

    run, training = command.run, command.run.training
    given = run.checkpoint.storage_path
    storage = given if "://" in given else os.path.abspath(given)
    run_dir = ckptlib.join(storage, command.run_name)
    # Checked before any worker starts: it exists and tpuft wrote it (then _model_checks)
    resume = run.checkpoint.resume_from
    resume_from, resume_manifest = ckptlib.resolve_resume(resume) if resume else ("", {})
    lora = _model_checks(run, resume_from, resume_manifest)
    packed, kept = pipeline.build_once(run_dir, run.dataset, run.model, training.max_seq_length, training.packing,
                                       run.evaluation, training.seed)
    if kept:
        print(f"[tpuft] the packed rows kept by an earlier attempt of this run loaded ({packed.rows} rows)", flush=True)
    per_step = training.batch_size_per_device * training.gradient_accumulation_steps
    check_resume_batch(run_dir, resume_from, target.world_size * per_step, training.batch_size_per_device,
                       training.gradient_accumulation_steps, target.slices)
    if datalib.steps_per_epoch(packed.rows, target.world_size, per_step) == 0:
        raise pipeline.DataError(
            f"{packed.rows} training rows cannot fill one global batch of {target.world_size} workers x "
            f"{training.batch_size_per_device} per device x {training.gradient_accumulation_steps} accumulated: "
            "use a larger spec.dataset.split, a smaller spec.training.batchSizePerDevice, "
            "gradientAccumulationSteps or maxSeqLength, or fewer workers")
    cfg = TrainConfig(
        run=run, platform=target.platform.kind, rows=packed.rows, examples=packed.examples,
        pad_fraction=packed.pad_fraction, record_type=packed.type, truncated=packed.truncated,
        dropped=packed.dropped, fault=fault_spec, run_dir=run_dir,
        run_dir_local=run_dir if "://" not in run_dir else "",
        export_uri=ckptlib.join(run_dir, ckptlib.EXPORT_DIR), resume_from=resume_from, resume_manifest=resume_manifest,
        cr_namespace=os.environ.get(ENV_CR_NAMESPACE, ""), cr_name=os.environ.get(ENV_CR_NAME, ""),
        status_every_s=float(os.environ.get("TPUFT_STATUS_EVERY_S", "10")),
        peak_flops=target.shape.peak_flops * target.slices if target.platform.is_tpu else None, lora=lora,
        rows_ref=packed.ref, eval_rows=packed.eval.rows if packed.eval else 0,
        eval_rows_ref=packed.eval.ref if packed.eval else None,
    ).as_dict()
    return storage, packed, cfg


def check_resume_batch(run_dir: str, resume_from: str, global_batch: int, per_device: int, accumulation: int,
                       slices: int) -> None:
    """Before any worker starts: the checkpoint the workers will resume (this run's newest committed
    one, else --resume-from's) was saved at this global batch (another slice count is fine when the
    accumulation keeps it: loop.global_batch_refusal). ResumeError otherwise. The workers check again."""
    source = ckptlib.find_latest_committed(run_dir) or resume_from
    if not source:
        return
    try:
        state = ckptlib.read_json(ckptlib.join(source, ckptlib.TRAIN_STATE))
    except (OSError, ValueError):
        return   # the workers' load names what is wrong with it
    msg = loop.global_batch_refusal(source, state if isinstance(state, dict) else {}, global_batch, per_device,
                                    accumulation, slices)
    if msg:
        raise ckptlib.ResumeError(msg)


def _model_checks(run: Run, resume_from: str, resume_manifest: dict) -> loralib.LoraSettings | None:
    """On the meta model, before any worker starts: the LoRA settings resolved (LoraError naming
    the field; both frameworks), and the resume point written for spec.model's architecture
    (torch; the JAX path checks it on its workers) and for this method (ResumeError). The workers
    check the resume point again."""
    from tpuft.api.constants import TrainingFramework, TrainingMethod

    training = run.training
    lora = training.method == TrainingMethod.LORA.value
    torch_path = training.framework == TrainingFramework.TORCH.value
    if not (lora or (resume_from and torch_path)):
        return None
    from tpuft_workload import model as modellib

    meta = modellib.meta_model(run.model)
    adapters = training.lora or Lora()
    settings = loralib.resolve(meta, adapters.rank, adapters.alpha, adapters.dropout,
                               adapters.target_modules) if lora else None
    if resume_from:
        if torch_path:
            ckptlib.check_architecture(resume_from, resume_manifest, ckptlib.architecture(meta), run.model)
        loralib.check_resume(resume_from, resume_manifest, settings)
    return settings


def run_config(command: Command, storage: str):
    """RunConfig(name, storage_path): a re-submitted job with the same run name resumes there."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    evaluation = command.run.evaluation
    # keepBest: Ray keeps the best-scored checkpoints (and always the newest); loop.KEEP_SCORE puts
    # the lowest eval loss's first, the rest by step
    best = ({"checkpoint_score_attribute": loop.KEEP_SCORE, "checkpoint_score_order": "max"}
            if evaluation and evaluation.keep_best else {})
    return RunConfig(name=command.run_name, storage_path=storage,
                     checkpoint_config=CheckpointConfig(num_to_keep=command.run.checkpoint.keep, **best),
                     failure_config=FailureConfig(max_failures=command.run.training.max_failures))


def build_trainer(command: Command, target: Target, fault_spec: str = ""):
    """(TorchTrainer, its train_loop_config as a dict: TrainConfig.as_dict)."""
    from ray.train.torch import TorchConfig, TorchTrainer

    scaling = scaling_config(target)
    storage, packed, cfg = prepare(command, target, fault_spec)
    return TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config=cfg,
        torch_config=TorchConfig(backend=target.platform.backend),
        scaling_config=scaling,
        run_config=run_config(command, storage),
    ), cfg


VERIFY_WAIT_GRACE_S = 120   # past the operator's own verification deadline (timeout + its grace): it decides first
VERIFY_POLL_S = 1.0


def wait_for_verification(reporter: StatusReporter, timeout_s: float, poll_s: float = VERIFY_POLL_S,
                          clock=time.monotonic, sleep=time.sleep) -> str | None:
    """--after-verification: wait until the object's CollectivesVerified condition is True (the
    operator resets it to Unknown when it submits this job beside the verification). None when it
    is; the reason otherwise (False: the verification failed; or no answer within timeout_s)."""
    from tpuft.api.constants import Condition

    if not reporter.enabled:
        return None   # by hand, outside the operator: nothing to wait for
    ctype, end = Condition.COLLECTIVES_VERIFIED.value, clock() + timeout_s
    print(f"[tpuft] waiting for the slice's verification ({ctype}) before training", flush=True)
    while clock() < end:
        found = reporter.condition(ctype)
        if found and found[0] == "True":
            return None
        if found and found[0] == "False":
            return f"the slice's verification failed ({ctype}=False: {found[1]}); not training"
        sleep(poll_s)
    return f"the slice's verification did not pass within {timeout_s:g}s ({ctype} not True); not training"


RAY_MEMORY_KILL = re.compile(RAY_MEMORY_KILL_SIGN)
FAILURE_CHARS = 1000   # the result line's error: room for Ray's kill report (node, figures, threshold)


def failure_message(error: BaseException) -> str:
    """One line for the result line: where Ray's memory monitor killed a worker, the error's text
    from Ray's words for it on (its node's IP, memory used and limit, threshold: what the operator
    names the pod by), since Ray Train's last line is only the end of that report; else the
    error's last line."""
    text = str(error).strip()
    kill = RAY_MEMORY_KILL.search(text)
    lines = text.splitlines()
    said = " ".join(text[kill.start():].split()) if kill else (lines[-1].strip() if lines else "")
    return f"{type(error).__name__}: {said}"[:FAILURE_CHARS]


def _failed(error: str) -> int:
    print(f"{RESULT_PREFIX} " + json.dumps({"succeeded": False, "error": error[:1000]}), flush=True)
    return 1


def run_training(command: Command, target: Target, fault_spec: str = "", build=None) -> int:
    """Build (`build`: build_trainer, or jax_train.build_trainer), fit, print the result line."""
    try:
        trainer, cfg = (build or build_trainer)(command, target, fault_spec)
    except (ckptlib.ResumeError, pipeline.DataError, loralib.LoraError) as e:
        StatusReporter().training(message=str(e))
        log.error("%s", e)
        return _failed(str(e))
    run = command.run
    if command.after_verification:
        refused = wait_for_verification(StatusReporter(), run.verification.timeout_seconds + VERIFY_WAIT_GRACE_S)
        if refused:
            log.error("%s", refused)
            return _failed(refused)
    print(f"Starting fine-tuning: model={run.model} dataset={run.dataset.name}[{run.dataset.split}] "
          f"{target.shape.generation} {target.shape.topology} x{target.slices} -> "
          f"{trainer.scaling_config.num_workers} workers ({type(trainer).__name__}), global batch "
          f"{target.world_size} devices x {run.training.batch_size_per_device} x "
          f"{run.training.gradient_accumulation_steps} accumulated = "
          f"{target.world_size * run.training.batch_size_per_device * run.training.gradient_accumulation_steps} "
          f"sequences, run={cfg['run_dir']}", flush=True)
    t0 = time.monotonic()
    try:
        result = trainer.fit()
    except Exception as e:  # noqa: BLE001 - one clear line for the RayJob log and the operator
        log.error("training failed: %s", e)
        error = failure_message(e)
        if RAY_MEMORY_KILL.search(error):   # the operator names the pod and its limit from status
            StatusReporter().training(message=error)
        return _failed(error)
    seconds = round(time.monotonic() - t0, 1)
    metrics = result.metrics or {}
    if stopped_early(metrics):
        return _stopped_result(cfg, metrics, seconds)
    body = {"succeeded": True, "seconds": seconds, **ckptlib.read_json(ckptlib.join(cfg["run_dir"], SUMMARY))}
    print(f"{RESULT_PREFIX} {json.dumps(body)}", flush=True)
    return 0


def stopped_early(metrics: dict) -> bool:
    """The newest checkpoint is a stop's with steps left. Result.metrics are the newest checkpoint's,
    maybe an earlier submission's: a run resumed at its last step (a stop saved there by an older
    release) trains nothing, exports and has finished."""
    if not metrics.get("stopped"):
        return False
    total = metrics.get("total_steps")
    return total is None or int(metrics.get("step", 0)) < int(total)


def _stopped_result(cfg: dict, metrics: dict, seconds: float) -> int:
    """A run that stopped on request: not succeeded (no export, no summary), a checkpoint of its
    last step, EXIT_STOPPED. A resubmitted RayJob resumes from that checkpoint."""
    from tpuft.api.constants import EXIT_STOPPED

    step = int(metrics["step"])
    body = {"succeeded": False, "stopped": metrics["stopped"], "seconds": seconds, "step": step,
            "totalSteps": metrics.get("total_steps"), "resumedFromStep": metrics.get("resumed_from_step"),
            "lastCheckpoint": ckptlib.join(cfg["run_dir"], loop.ckpt_name(step)), "message": preemption.message(step)}
    print(f"[tpuft] {body['message']}", flush=True)
    print(f"{RESULT_PREFIX} {json.dumps(body)}", flush=True)
    return EXIT_STOPPED


if __name__ == "__main__":  # pragma: no cover - use `python -m tpuft_workload train`
    sys.exit("use: python -m tpuft_workload train ...")
