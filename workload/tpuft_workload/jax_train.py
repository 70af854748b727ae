"""Fine-tuning with Ray Train v2's JaxTrainer (`spec.training.framework: jax`).

Driver (`build_trainer`): the torch path's preparation (tpuft_workload.train.prepare: storage,
resume checks, the Ray Data pipeline, TrainConfig) and RunConfig, then a JaxTrainer with ONE
worker per host (TPU: `ScalingConfig(use_tpu=True, topology, accelerator_type)`, each worker
holding all of its host's chips; JaxTrainer sets JAX_PLATFORMS=tpu and calls
jax.distributed.initialize). On CPU (accelerator cpu) JaxTrainer starts plain workers and no
jax.distributed; the workers initialize it themselves over loopback with gloo CPU collectives,
so 2 CPU workers form one 2-device JAX program exactly as 4 TPU hosts form a 16-device one.

Workers (`train_loop`): a 2-D mesh (data = slices, fsdp = the devices of a slice) over every
device of every process; each parameter and its AdamW moments sharded over `fsdp` on its first
divisible dimension (FSDP: XLA all-gathers weights for the step and reduce-scatters the
gradients); each step's global micro-batches sharded over the whole mesh from the worker's rows
(`jax.make_array_from_process_local_data`) and accumulated inside one jit (`train_step`). The
recipe: AdamW with decay on weight matrices only, clipping, and the rate of
loop.learning_rate_at set each step without recompiling (`optimizer`). bf16 compute with float32
master weights on accelerators, float32 on CPU; Orbax checkpoints (tpuft_workload.jax_checkpoint). The run itself
(restore, reports, checkpoint cadence, status keys, log lines, TensorBoard files, the run summary,
a stop on SIGTERM) is tpuft_workload.loop's, the torch path's too; this file is its JAX backend
(`_Jax`): the processes agree on a stop's step through JAX's own preemption sync point.
LoRA (`spec.training.method: lora`): the base is placed as above and frozen, the adapters of
tpuft_workload.jax_lora are what the step differentiates, AdamW updates, Orbax saves and the
export writes (a PEFT adapter folder, by the torch path's writer).
"""
from __future__ import annotations

import os
import socket
import tempfile
from functools import partial

import ray
import ray.train

from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import data as datalib
from tpuft_workload import jax_checkpoint, jax_lora, loop, pipeline, preemption
from tpuft_workload import jax_model as jm
from tpuft_workload.command import Command
from tpuft_workload.platform import PLATFORMS, Target
from tpuft_workload.storage import is_remote
from tpuft_workload.report import flops_per_token, gpu_slice_peak
from tpuft_workload.train import prepare, run_config
from tpuft_workload.train import run_training as _run_training
from tpuft_workload.train import scaling_config as _scaling_config

MESH_AXES = ("data", "fsdp")


def scaling_config(target: Target):
    """One JaxTrainer worker per host (train.scaling_config's per_host)."""
    return _scaling_config(target, per_host=True)


def build_trainer(command: Command, target: Target, fault_spec: str = ""):
    """(JaxTrainer, its train_loop_config as a dict: TrainConfig.as_dict)."""
    from ray.train.v2.jax import JaxTrainer

    scaling = scaling_config(target)
    storage, packed, cfg = prepare(command, target, fault_spec)
    return JaxTrainer(
        train_loop_per_worker=train_loop, train_loop_config=cfg, scaling_config=scaling,
        run_config=run_config(command, storage)), cfg


def run_training(command: Command, target: Target, fault_spec: str = "") -> int:
    return _run_training(command, target, fault_spec, build=build_trainer)


# ---- worker: JAX setup ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_jax(platform_kind: str, rank: int, world: int):
    """`jax`, distributed over every worker. TPU/GPU: JaxTrainer already initialized it. CPU:
    JaxTrainer does not (Ray 2.60 `_JaxBackend.on_start` returns early without use_tpu/use_gpu),
    so rank 0 hosts the coordinator and broadcasts its address; gloo carries the collectives."""
    import logging

    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every save step at INFO
    if platform_kind != "cpu":
        import jax

        return jax
    from ray.train.collective import broadcast_from_rank_zero

    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if world == 1:   # nothing to coordinate
        return jax
    address = f"{ray.util.get_node_ip_address()}:{_free_port()}" if rank == 0 else None
    jax.distributed.initialize(broadcast_from_rank_zero(address), world, rank)
    return jax


def process_hosts(jax) -> list[str]:
    """Each JAX process's host name, in process order (one small all-gather over the processes)."""
    name = socket.gethostname()
    if jax.process_count() == 1:
        return [name]
    import numpy as np
    from jax.experimental import multihost_utils

    encoded = np.zeros(HOST_NAME_BYTES, np.uint8)
    raw = name.encode()[:HOST_NAME_BYTES]
    encoded[:len(raw)] = np.frombuffer(raw, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(encoded)).reshape(-1, HOST_NAME_BYTES)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered]


HOST_NAME_BYTES = 64   # a Linux host name's limit


def build_mesh(jax, slices: int = 1):
    """(data, fsdp) = (slices, devices per slice): parameters shard inside a slice (ICI), batches
    over everything; across slices only gradients travel (DCN). TPU devices know their slice
    (`slice_index`); devices that do not (a CPU or GPU rehearsal of `slices`) are split slice-major,
    as the workers' ranks are."""
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    found = len({getattr(d, "slice_index", 0) for d in devices})
    if found > 1:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh((1, len(devices) // found), (found, 1), devices)
    elif slices > 1:
        if len(devices) % slices:
            raise ValueError(f"{len(devices)} JAX devices do not split into {slices} equal slices")
        grid = np.array(devices).reshape(slices, len(devices) // slices)
    else:
        grid = np.array(devices).reshape(1, len(devices))
    return Mesh(grid, MESH_AXES)


def param_spec(shape: tuple, shards: int):
    """FSDP placement of one parameter: its first dimension divisible by `shards` split over
    `fsdp`; replicated when none is (small norms on odd device counts)."""
    from jax.sharding import PartitionSpec as P

    for dim, size in enumerate(shape):
        if size % shards == 0:
            return P(*([None] * dim), "fsdp")
    return P()


def _put(jax, array, sharding):
    """A host array (or a jax_model.SavedTensor, read region by region) -> a global jax.Array, each
    device given only its slice."""
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])


def optimizer(params: dict, weight_decay: float, max_grad_norm: float):
    """The recipe's AdamW (torch's: decoupled decay scaled by the rate) on `params`' structure:
    gradients clipped to `max_grad_norm` (global norm), decay on weight matrices only
    (jax_model.decays), and the rate an injected hyperparameter that each step sets (`with_rate`),
    so a schedule's changing rate never recompiles the step."""
    import optax

    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=weight_decay,
                                                  mask=jm.decay_mask(params))
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def with_rate(opt_state, learning_rate):
    """`optimizer`'s state with its rate set to `learning_rate` (a traced scalar inside the jit)."""
    import jax.numpy as jnp

    clip, adamw = opt_state
    rate = jnp.asarray(learning_rate, adamw.hyperparams["learning_rate"].dtype)
    return clip, adamw._replace(hyperparams={**adamw.hyperparams, "learning_rate": rate})


def train_step(tx, cfg: jm.ModelConfig, dtype, remat: bool, params, opt_state, micro_batches: dict, learning_rate,
               frozen=None, adapters: jm.Adapters | None = None, dropout_key=None):
    """One optimizer step over k micro-batches, stacked ([k, global micro-batch, ...] each key):
    the gradient of the mean loss over every labelled token of all k (each micro-batch's summed
    loss over the count of all k, gradients summed by a lax.scan over them), so k micro-batches of b rows
    update the params as one batch of k x b; then `tx` (`optimizer`) at `learning_rate`. One jit over
    the mesh: exact data-parallel averaging, FSDP gathers/scatters by XLA. Returns (params,
    opt_state, the step's sums: loss_sum, labelled and real tokens, the gradient norm).
    LoRA: `params` are the adapters (trained), `frozen` the base (no gradient), `adapters` how they
    apply; `dropout_key` draws their dropout, a new stream each step (the optimizer's step count)
    and micro-batch."""
    import jax
    import jax.numpy as jnp
    import optax

    labelled = jm.labelled_tokens(micro_batches["labels"])
    share = 1.0 / labelled.clip(1).astype(jnp.float32)
    k = micro_batches["labels"].shape[0]
    keys = [None] * k
    if dropout_key is not None:
        count = opt_state[1].count   # optimizer(): (clip, inject_hyperparams(adamw)) states
        keys = jax.random.split(jax.random.fold_in(dropout_key, count), k)

    def loss_and_grads(batch, key):
        def scaled(p):
            whole = p if frozen is None else {**frozen, **p}
            total, _ = jm.loss_sums(whole, cfg, batch, dtype, remat, adapters, key)
            return total * share, total

        (_, total), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return total, grads

    def accumulate(carry, batch_and_key):
        total, grads = loss_and_grads(*batch_and_key)
        return (carry[0] + total, jax.tree.map(jnp.add, carry[1], grads)), None

    if k == 1:   # no accumulator: one gradient's memory, not two
        loss_sum, grads = loss_and_grads(jax.tree.map(lambda v: v[0], micro_batches), keys[0])
    else:
        start = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        stacked_keys = None if dropout_key is None else keys
        (loss_sum, grads), _ = jax.lax.scan(accumulate, start, (micro_batches, stacked_keys))
    updates, opt_state = tx.update(grads, with_rate(opt_state, learning_rate), params)
    sums = {"loss_sum": loss_sum, "labelled": labelled, "real": micro_batches["n_real"].sum()}
    # the norm before clip_by_global_norm, as torch's clip_grad_norm_ returns it
    return optax.apply_updates(params, updates), opt_state, sums, optax.global_norm(grads)


def load_weights(model_ref: str, tokenizer, seed: int):
    """(HF config dict, ModelConfig, host params) of spec.model; the builtin is built with the
    torch path's seed, so both frameworks start from the same weights."""
    from tpuft_workload import model as modellib
    from tpuft_workload.tiny import BUILTIN_MODEL

    if model_ref == BUILTIN_MODEL:
        from tpuft_workload.tiny import build_model

        return jm.from_torch(build_model(len(tokenizer), seed=seed))
    return jm.open_hf_dir(modellib.weights_dir(model_ref))   # read shard by shard as the parameters are placed


def write_export(full: dict, hf_config: dict, model_ref: str, tokenizer, dest_uri: str, dtype=None) -> str:
    """A full fine-tune's export from its gathered params (host arrays under Hugging Face's names):
    the from_pretrained() folder at dest_uri with the base's generation config, the chat template's
    turn end among its stop ids (the model learnt to end its answers there, and the serving engine
    stops at those ids), and the tokenizer. Returns dest_uri."""
    from transformers import PretrainedConfig

    from tpuft_workload import model as modellib

    base = modellib.base_generation(model_ref, PretrainedConfig(**hf_config))
    with tempfile.TemporaryDirectory() as tmp:
        jm.save_hf(full, hf_config, tmp, dtype=dtype)
        ckptlib.serving_generation(base, tokenizer).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        ckptlib.upload_dir(tmp, dest_uri)
    return dest_uri


# ---- worker: the backend ----------------------------------------------------------------------

def train_loop(config: dict) -> None:
    """One JAX worker (one host): tpuft_workload.loop's run over the JAX backend."""
    loop.work(config, _Jax)


class _StopVote:
    """The processes' agreement to stop at this step: any told to (SIGTERM) -> all, at the same step.
    Several processes: JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`).
    jax.distributed.initialize starts JAX's preemption service, whose own SIGTERM handler (it replaces
    preemption.install's) tells the coordination service; the processes agree on the next step after
    the furthest any has reached, and every call in between only reads a local value (no collective,
    no device sync: well under a microsecond per step). One process: its own flag.

    The operator's checkpoint request, which only rank 0 sees (its status answer): rank 0's 0/1
    broadcast to every process (`broadcast_one_to_all`, a one-int collective over the devices) at
    each step boundary. It waits for the devices to finish the step just dispatched, which the
    loop's step does not otherwise do."""

    def __init__(self, jax):
        self.sync = jax.process_count() > 1

    def agreed(self, step: int, checkpoint_wanted: bool = False) -> loop.Agreement:
        if self.sync:
            import numpy as np
            from jax.experimental import multihost_utils

            stop = multihost_utils.reached_preemption_sync_point(step)
            checkpoint = bool(multihost_utils.broadcast_one_to_all(np.int32(checkpoint_wanted)))
            return loop.Agreement(stop=bool(stop), checkpoint=checkpoint)
        return loop.Agreement(stop=preemption.requested(), checkpoint=checkpoint_wanted)


class _Jax:
    """The JAX backend of tpuft_workload.loop (loop.Backend): one program over every device of
    every worker. Every number a step returns is already global (no collective to sum them)."""

    def __init__(self, worker: loop.Worker):
        self.worker, self.cfg, self.rank, self.world = worker, worker.cfg, worker.rank, worker.world
        self.plat = PLATFORMS[self.cfg.platform]
        self.jax = init_jax(self.cfg.platform, self.rank, self.world)
        if is_remote(self.cfg.run_dir):   # only a staged (gs://) checkpoint needs one host: no gather else
            jax_checkpoint.check_hosts(self.cfg.run_dir, process_hosts(self.jax))
        # MFU's denominator: the TPU slice's from the catalog (the driver's), the GPUs' found here
        self.peak_flops = self.cfg.peak_flops
        if self.plat.kind == "gpu":
            self.peak_flops = gpu_slice_peak(self.jax.devices()[0].device_kind, self.jax.device_count())
        self._data()
        self._model()
        self.vote = _StopVote(self.jax)

    def _data(self) -> None:
        from tpuft_workload import model as modellib

        cfg = self.cfg
        self.tokenizer = modellib.load_tokenizer(cfg.run.model)
        self.rows = ray.get(cfg.rows_ref)   # the shared rows, mapped from the node's object store
        self.eval_rows = ray.get(cfg.eval_rows_ref) if cfg.eval_rows_ref is not None else None
        # a worker feeds all of its host's devices: batchSizePerDevice rows each, per micro-batch
        self.local_batch = cfg.training.batch_size_per_device * self.jax.local_device_count()
        self.accumulation = cfg.training.gradient_accumulation_steps
        self.global_batch_size = self.local_batch * self.world * self.accumulation   # sequences per optimizer step
        self.steps_per_epoch = datalib.steps_per_epoch(cfg.rows, self.world, self.local_batch * self.accumulation)
        self.worker.say(f"[tpuft] {loop.data_line(cfg)}; {self.steps_per_epoch} steps/epoch of {self.accumulation} "
                        f"micro-batches x {cfg.training.epochs} epochs on {self.world} JAX processes, "
                        f"{self.jax.device_count()} devices")

    def _model(self) -> None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        jax, cfg = self.jax, self.cfg
        self.hf_config, self.mcfg, host = load_weights(cfg.run.model, self.tokenizer, cfg.training.seed)
        arch = jax_checkpoint.architecture(jm.hf_class(self.hf_config), host)   # the base's
        self.flops_per_token = flops_per_token(arch["parameters"], self.hf_config,   # MFU's
                                               cfg.training.max_seq_length)
        self.worker.adopt_architecture(arch, self.barrier)
        self.mesh = build_mesh(jax, cfg.run.slices)
        # Each device's shard read from the files (a SavedTensor) or cut from the host array (the
        # builtin): no process builds the whole tree of a saved model.
        base = {n: _put(jax, a, self._sharding(a)) for n, a in host.items()}
        if isinstance(host, jm.HostTensors):
            self.worker.say(f"[tpuft] read {sum(t.read_bytes for t in host.values()) / 2**20:.1f} MiB of "
                            f"{sum(t.size for t in host.values()) * 4 / 2**20:.1f} MiB of weights (fp32) on this host")
            host.close()
        # LoRA: the base frozen (sharded as for full fine-tuning), the adapters trained; else all of it
        self.frozen, self.adapters, trained = None, None, base
        if cfg.lora:
            shapes = {n: tuple(a.shape) for n, a in base.items()}
            fresh = jax_lora.init(self.mcfg, cfg.lora, shapes, cfg.training.seed)
            self.frozen, self.adapters = base, jax_lora.adapters(cfg.lora)
            trained = {n: _put(jax, a, self._sharding(a)) for n, a in fresh.items()}
        self.params = trained
        count = sum(int(a.size) for a in trained.values())
        self.parameter_counts = (count, arch["parameters"] + (count if cfg.lora else 0))   # (trainable, total)
        self.worker.say(f"[tpuft] training {self.parameter_counts[0]:,} of {self.parameter_counts[1]:,} parameters"
                        + (f" (LoRA rank {cfg.lora.rank} on {','.join(cfg.lora.target_modules)})" if cfg.lora else ""))
        self.tx = optimizer(trained, cfg.training.weight_decay, cfg.training.max_grad_norm)
        # Every leaf placed explicitly: the moments like their parameters; the step count, left to
        # jit, lands on one local device and no longer fits the mesh once Orbax restores it.
        shardings = jax.tree.map(self._sharding, jax.eval_shape(self.tx.init, self.params))
        self.opt_state = jax.jit(self.tx.init, out_shardings=shardings)(self.params)
        self.batch_sharding = NamedSharding(self.mesh, P(MESH_AXES))
        self.micro_batches_sharding = NamedSharding(self.mesh, P(None, MESH_AXES))
        dtype = jax.numpy.bfloat16 if self.plat.mixed_precision else None
        dropout_key = jax.random.key(cfg.training.seed) if cfg.lora and cfg.lora.dropout else None
        remat = bool(cfg.training.activation_checkpointing)
        step = partial(train_step, self.tx, self.mcfg, dtype, remat, adapters=self.adapters,
                       dropout_key=dropout_key)
        self.step_fn = jax.jit(lambda params, opt_state, batch, rate, frozen: step(params, opt_state, batch, rate,
                                                                                   frozen), donate_argnums=(0, 1))
        self.eval_fn = jax.jit(lambda params, frozen, batch: jm.loss_sums(
            params if frozen is None else {**frozen, **params}, self.mcfg, batch, dtype, adapters=self.adapters))

    def _sharding(self, leaf):
        """Where a parameter (or a state leaf of its shape) lives: FSDP over the mesh's fsdp axis."""
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, param_spec(leaf.shape, self.mesh.shape["fsdp"]))

    def batches(self, epoch: int, skip: int):
        """Per optimizer step, this worker's micro-batches: its rows of the step (the epoch's
        permutation in steps of k micro-batches) cut into k, so micro-batch i of every worker
        makes the global micro-batch i."""
        b = self.local_batch
        for rows in pipeline.epoch_batches(self.rows, self.world, self.rank, b * self.accumulation,
                                           self.cfg.training.seed,
                                           epoch, skip=skip):
            yield [{k: v[i * b:(i + 1) * b] for k, v in rows.items()} for i in range(self.accumulation)]

    def step(self, micro_batches: list, learning_rate: float) -> loop.Step:
        """One optimizer step on this worker's rows of the step's micro-batches: summed loss,
        labelled and real tokens and gradient norm, global (left on the device)."""
        import numpy as np

        local = [{**jm.inputs_from_rows(rows, self.cfg.training.packing), "n_real": rows["n_real"].astype("int32")}
                 for rows in micro_batches]
        stacked = {k: np.stack([m[k] for m in local]) for k in local[0]}
        batch = {k: self.jax.make_array_from_process_local_data(
                     self.micro_batches_sharding, v, (len(local), self.local_batch * self.world, *v.shape[2:]))
                 for k, v in stacked.items()}
        self.params, self.opt_state, sums, grad_norm = self.step_fn(self.params, self.opt_state, batch,
                                                                    np.float32(learning_rate), self.frozen)
        return loop.Step(loss_sum=sums["loss_sum"], labelled=sums["labelled"], real=sums["real"],
                         padded=len(local) * self.local_batch * self.world * self.cfg.training.max_seq_length,
                         grad_norm=grad_norm)

    def evaluate(self) -> tuple[float, float]:
        """(summed loss, labelled tokens) over the whole eval set, global: the same on every process."""
        loss_sum, labelled = 0, 0
        for rows in pipeline.eval_batches(self.eval_rows, self.world, self.rank, self.local_batch):
            batch = {k: self.jax.make_array_from_process_local_data(self.batch_sharding, v)
                     for k, v in jm.inputs_from_rows(rows, self.cfg.training.packing).items()}
            total, count = self.eval_fn(self.params, self.frozen, batch)
            loss_sum, labelled = loss_sum + total, labelled + count
        return float(loss_sum), float(labelled)

    def totals(self, values: list) -> list[float]:
        """Already global (one program over the mesh): only read off the device."""
        return [float(v) for v in values]

    def agree(self, step: int, checkpoint_wanted: bool) -> loop.Agreement:
        return self.vote.agreed(step, checkpoint_wanted)

    def barrier(self) -> None:
        ray.train.collective.barrier()

    # --- checkpoints ----------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state}

    def save(self, path: str, name: str, train_state: dict, metrics: dict) -> None:
        """An Orbax checkpoint written in place under the run directory, committed, then registered
        with Ray as it lies (NO_UPLOAD)."""
        from ray.train.v2.api.report_config import CheckpointUploadMode

        jax_checkpoint.save(self._state(), train_state, path, self.rank)
        loop.commit(self, self.rank, path)   # every process's shards and rank 0's train_state are written
        ckpt = ckptlib.ray_checkpoint(path) if self.rank == 0 else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    def load(self) -> tuple[str, dict] | None:
        """This run's newest committed checkpoint, else --resume-from's. Every checkpoint this path
        registers with Ray is committed first, so Ray's get_checkpoint() adds nothing here."""
        path = ckptlib.find_latest_committed(self.cfg.run_dir) or self.cfg.resume_from
        if not path:
            return None
        return path, self._restore(path)

    def load_from(self, path: str) -> None:
        """The params and optimizer state of the committed checkpoint at `path` (keep-best)."""
        self._restore(path)

    def _restore(self, path: str) -> dict:
        """Collective: the state at `path` onto the live state's shardings; its train_state."""
        state, train_state = jax_checkpoint.load(jax_checkpoint.abstract(self._state()), path)
        self.params, self.opt_state = state["params"], state["opt_state"]
        return train_state

    def export(self) -> str | None:
        """Collective: the full weights gathered to every host; rank 0 writes the from_pretrained()
        folder (bf16 on accelerators, the dtype the model trained in; float32 on CPU). LoRA: the
        torch path's PEFT adapter folder (`_export_adapters`)."""
        from jax.experimental import multihost_utils

        if self.cfg.lora:
            return self._export_adapters()
        full = multihost_utils.process_allgather(self.params, tiled=True)
        if self.rank != 0:
            return None
        dtype = None
        if self.plat.mixed_precision:
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        return write_export(full, self.hf_config, self.cfg.run.model, self.tokenizer, self.cfg.export_uri, dtype)

    def _export_adapters(self) -> str | None:
        """Collective: the adapters (and the base, where the built-in model or spec.export.merge needs
        it on rank 0) gathered; rank 0 writes through tpuft_workload.lora.write_export, the torch
        path's writer: the PEFT adapter folder, and base/ or export-merged/ as that path does."""
        from jax.experimental import multihost_utils
        from transformers import AutoConfig

        from tpuft_workload import lora as loralib
        from tpuft_workload import model as modellib
        from tpuft_workload.tiny import BUILTIN_MODEL

        cfg = self.cfg
        adapters = multihost_utils.process_allgather(self.params, tiled=True)
        with_base = cfg.run.export.merge or cfg.run.model == BUILTIN_MODEL
        base = multihost_utils.process_allgather(self.frozen, tiled=True) if with_base else {}
        if self.rank != 0:
            return None
        config = AutoConfig.for_model(**self.hf_config)
        generation = modellib.base_generation(cfg.run.model, config)
        state = jax_lora.peft_state(base, adapters, cfg.lora, self.mcfg)
        return loralib.write_export(config, state, self.tokenizer, cfg.lora, cfg.run.model, cfg.run_dir,
                                    cfg.run.export.merge,
                                    generation)
