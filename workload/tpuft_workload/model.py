"""Load a causal LM + tokenizer (built-in, hub, local or gs://) and shard it with FSDP2 (HSDP across slices).

Weights load on the CPU in fp32 (the optimizer's master copy); FSDP2 moves each decoder
layer to the device as it shards it, so the full model never sits on one device. On
accelerators compute runs in bf16 with fp32 gradient reduction (MixedPrecisionPolicy).
The HF token, when needed, is read by huggingface_hub from HF_TOKEN; we never touch or log it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from pathlib import Path

from tpuft_workload.platform import Platform, train_dtypes
from tpuft_workload.render import with_template
from tpuft_workload.tiny import BUILTIN_MODEL
from tpuft_workload.tiny_chat import BUILTIN_CHAT_MODEL

log = logging.getLogger(__name__)

# Gemma 3n / Gemma 4 per-layer embeddings: a huge frozen-able lookup table. We freeze it and keep
# it out of FSDP (sharding a gather-only table costs more than it saves).
FROZEN_REPLICATED = ("embed_tokens_per_layer",)
TOWERS = ("vision_config", "audio_config")


# The weights' files, left in the bucket by _small_files: the sharded load reads them in place.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


class ModelNotFound(FileNotFoundError):
    """spec.model names a gs:// folder that does not exist or holds no object."""


def _model_files(uri: str, recursive: bool) -> tuple:
    """(filesystem, the FileInfos of its files; with `recursive`, its subfolders' too) of a model
    folder URI; ModelNotFound with the URI when there is no such folder."""
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.File:
        raise ModelNotFound(f"spec.model {uri} is an object, not a folder: name the folder that holds config.json "
                            "and the safetensors")
    files = [] if kind == pafs.FileType.NotFound else [
        info for info in fs.get_file_info(pafs.FileSelector(path, recursive=recursive)) if info.is_file]
    if not files:
        raise ModelNotFound(f"spec.model {uri} not found: no object at or under it (check the bucket and the path, "
                            f"e.g. gcloud storage ls {uri})")
    return fs, files


def _download_once(uri: str, kind: str, download) -> str:
    """`download(uri, folder)` run once per host (under a file lock: a host's ranks share one copy)
    into a folder named for the URI and `kind`; that folder."""
    cache = Path(os.environ.get("TPUFT_MODEL_CACHE", "/tmp/tpuft-model-cache"))
    root = cache / f"{hashlib.sha256(uri.encode()).hexdigest()[:16]}-{kind}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".complete").exists():
            download(uri, root)
            (root / ".complete").touch()
    return str(root)


def _builtin_folder(uri: str) -> str:
    """builtin:tiny-chat -> its folder (built once per host, or found in the image); any other
    reference as it is."""
    if uri == BUILTIN_CHAT_MODEL:
        from tpuft_workload.tiny_chat import folder

        return folder()
    return uri


def _local_copy(uri: str) -> str:
    """gs://... -> a local folder with every file of it (downloaded once per host): for readers
    that want the whole model on disk (serving, the JAX path, a checkpoint without safetensors);
    builtin:tiny-chat -> its folder."""
    uri = _builtin_folder(uri)
    if "://" not in uri:
        return uri
    from tpuft_workload.checkpoint import download_dir

    def whole(uri: str, root: Path) -> None:
        _model_files(uri, recursive=True)   # a missing folder says so, instead of copying nothing
        download_dir(uri, str(root))

    return _download_once(uri, "whole", whole)


def _small_files(uri: str) -> str:
    """gs://... -> a local folder with the model folder's own small files (config, tokenizer,
    generation config, chat template, the safetensors index), not its weights nor its subfolders:
    what from_pretrained's config and tokenizer readers need, when the weights are read in place.
    builtin:tiny-chat -> its folder."""
    uri = _builtin_folder(uri)
    if "://" not in uri:
        return uri
    import pyarrow.fs as pafs

    def small(uri: str, root: Path) -> None:
        fs, files = _model_files(uri, recursive=False)
        root.mkdir(parents=True, exist_ok=True)
        for info in files:
            if not info.base_name.endswith(WEIGHT_SUFFIXES):
                pafs.copy_files(info.path, str(root / info.base_name), source_filesystem=fs)

    return _download_once(uri, "small", small)


def load_tokenizer(model_ref: str):
    if model_ref == BUILTIN_MODEL:
        from tpuft_workload.tiny import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_small_files(model_ref))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # pads are label-masked and sit only at the end of rows
    return with_template(tok)   # trained and served through the same template


def load_model(model_ref: str, tokenizer, platform: Platform, seed: int):
    import torch

    if model_ref == BUILTIN_MODEL:
        from tpuft_workload.tiny import build_model

        return build_model(len(tokenizer), seed=seed)
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _local_copy(model_ref)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        attn_implementation="eager" if platform.is_tpu else "sdpa", **_text_only(AutoConfig.from_pretrained(path)))
    model.config.get_text_config().use_cache = False
    return model


def weights_dir(model_ref: str) -> str:
    """A from_pretrained() folder on this host for a local path, a gs:// URI (downloaded whole, once
    per host: _local_copy) or a hub id (huggingface_hub's cache, shared by the host's ranks)."""
    path = _local_copy(model_ref)
    return path if os.path.isdir(path) else _hub_snapshot(model_ref)


def weights_location(model_ref: str) -> str:
    """Where the sharded load (sharded_load.fill) reads the weights: a gs:// URI as it is (each
    rank reads its rows' byte ranges from the bucket: no host copies the model), a local folder,
    or a hub id's snapshot (huggingface_hub's cache, shared by the host's ranks)."""
    model_ref = _builtin_folder(model_ref)
    if "://" in model_ref or os.path.isdir(model_ref):
        return model_ref
    return _hub_snapshot(model_ref)


def _hub_snapshot(model_ref: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(model_ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])


def empty_model(location: str, platform: Platform):
    """The module tree of the saved model at `location` (weights_location's: a folder or a gs://
    URI) with its parameters on the meta device, to be filled shard by shard once sharded (`shard`,
    then sharded_load.fill(model, location)). None for a folder without safetensors (then
    load_model reads it whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpuft_workload import sharded_load

    if not sharded_load.loadable(location):
        return None
    config = AutoConfig.from_pretrained(_small_files(location))
    for tower in _text_only(config):
        setattr(config, tower, None)
    with sharded_load.parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager" if platform.is_tpu else "sdpa")
    model.config.get_text_config().use_cache = False
    return model


def base_generation(model_ref: str, config):
    """The base's generation config: its generation_config.json (its stop ids, its recommended
    sampling), else one derived from `config` as transformers derives it. A model built from its
    config (empty_model, the built-in model) holds only the derived one."""
    from transformers import GenerationConfig

    if model_ref != BUILTIN_MODEL:
        try:
            return GenerationConfig.from_pretrained(_small_files(model_ref))
        except OSError:   # the base has none
            pass
    return GenerationConfig.from_model_config(config)


def base_use_cache(model_ref: str) -> bool:
    """Whether the base's config turns the KV cache on (transformers' default: on)."""
    if model_ref == BUILTIN_MODEL:
        return True
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(_small_files(model_ref)).get_text_config(), "use_cache", True))


def as_served(model, model_ref: str) -> None:
    """Before an export: the model's generation config and KV-cache setting as the base's, which
    the export writes (training ran without the cache: load_model, empty_model)."""
    model.generation_config = base_generation(model_ref, model.config)
    model.config.get_text_config().use_cache = base_use_cache(model_ref)


def _text_only(config) -> dict:
    """Multimodal checkpoints (Gemma 4): the vision/audio towers dropped, as GKE's TorchTPU recipe
    does: from_pretrained's config overrides."""
    return {tower: None for tower in TOWERS if getattr(config, tower, None) is not None}


def meta_model(model_ref: str):
    """The module tree load_model builds for spec.model, on torch's meta device (no weight read or
    allocated): what the driver checks a resume point against before any worker starts."""
    import torch

    if model_ref == BUILTIN_MODEL:
        from tpuft_workload.tiny import build_model

        with torch.device("meta"):
            return build_model(len(load_tokenizer(model_ref)))
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(_small_files(model_ref))
    for tower in _text_only(config):
        setattr(config, tower, None)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _decoder_layers(model) -> list:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # fall back to the usual HF layout: model.layers / language_model.layers
        for m in model.modules():
            if type(m).__name__.endswith("DecoderLayer"):
                layers.append(m)
    return layers


def labelled_tokens(labels):
    """The tokens the causal-LM loss scores: labels other than -100 after its shift by one (a row's
    first label is never predicted)."""
    import torch

    return (labels[:, 1:] != -100).sum(dtype=torch.int32)


def token_mean_loss(model, micro_batches: list[dict], defer_all_reduce: bool = False):
    """Forward and backward of the global batch's mean loss per labelled token, from this rank's
    `micro_batches` (labels included), as JAX's step takes it: the global batch is every rank's
    micro-batches. transformers divides each micro-batch's summed loss by `num_items_in_batch`:
    here the labelled tokens of every micro-batch of every rank (one all-reduce SUM on the default
    group), at least 1 (a global batch of prompts only: loss and gradient 0), so the gradients
    accumulated over the micro-batches are the whole batch's token mean. FSDP2 averages the
    gradients over the ranks (HSDP too: it divides by replicate x shard), so the loss
    backpropagated is the world size times that. `defer_all_reduce` (HSDP): the all-reduce across
    replicas only after the last micro-batch (FSDP2 adds the earlier ones' reduce-scattered
    gradients to it), so the slow network is crossed once per optimizer step. Returns (this rank's
    summed loss, float32, and its labelled tokens): a report window divides the one by the other,
    each summed over ranks and steps."""
    import torch
    import torch.distributed as dist

    labelled = torch.stack([labelled_tokens(b["labels"]) for b in micro_batches]).sum(dtype=torch.int32)
    total = labelled.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    total = total.clamp(min=1)
    world = dist.get_world_size()
    loss_sum = torch.zeros((), dtype=torch.float32, device=total.device)
    for i, inputs in enumerate(micro_batches):
        if defer_all_reduce:
            model.set_requires_all_reduce(i == len(micro_batches) - 1)
        loss = model(**inputs, num_items_in_batch=total).loss
        (loss * world).backward()
        loss_sum += loss.detach().float() * total
    return loss_sum, labelled


def decay_groups(model, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: weight decay on the weight matrices (LoRA's adapters too), none on
    biases, norms (every parameter of fewer than 2 dimensions) or embeddings (an nn.Embedding's
    weight, any module named *embed*, and an output layer tied to the input embedding: the same
    parameter). Trainable parameters only; an empty group is left out."""
    import torch

    no_decay = {id(p) for name, m in model.named_modules()
                if isinstance(m, torch.nn.Embedding) or "embed" in name.rsplit(".", 1)[-1]
                for p in m.parameters()}
    decay, plain = [], []
    for p in model.parameters():
        if p.requires_grad:
            (plain if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def checkpoint_layers(model, layers: list) -> list:
    """Each of `layers` replaced in its parent by a non-reentrant checkpoint wrapper: its
    activations are recomputed in the backward pass instead of kept. Before fully_shard, which then
    shards the wrapper (its state_dict keys are the layer's: checkpoints and exports are unchanged).
    Returns the wrappers."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    wrapped = []
    for layer in layers:
        parent, name = parents[id(layer)]
        wrapper = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(parent, name, wrapper)
        wrapped.append(wrapper)
    return wrapped


def embedding_units(model) -> list:
    """The input and the output embedding, each an FSDP2 unit of its own when they share no
    weight: gathered for their own forward (and the output layer again for its backward), not
    from the first layer's forward to the last layer's backward as the root's parameters are
    (FSDP2 keeps the root gathered between the two): a vocabulary-by-hidden matrix less at the
    step's peak (bench/sharded_load.py). Tied, they stay in the root."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or inputs.weight is outputs.weight:
        return []
    return [inputs, outputs]


MESH_DIMS = ("replicate", "shard")  # HSDP's (across slices, inside a slice)


def device_mesh(platform: Platform, world: int, slices: int = 1):
    """FSDP2's mesh. One slice: 1-D, every parameter sharded over all `world` devices. Several: 2-D
    (replicate = slices, shard = the devices of one slice), i.e. HSDP: parameters shard inside a slice
    (ICI) and replicate across slices, so only gradients cross the data-center network, once per
    step. Ranks are slice-major (rank // devices per slice is the slice), as tpuft_workload.verify
    numbers them."""
    from torch.distributed.device_mesh import init_device_mesh

    if slices <= 1:
        return init_device_mesh(platform.device_type, (world,))
    if world % slices:
        raise ValueError(f"{world} workers do not split into {slices} equal slices")
    return init_device_mesh(platform.device_type, (slices, world // slices), mesh_dim_names=MESH_DIMS)


def shard(model, mesh, platform: Platform, device, activation_checkpointing: bool = False):
    """fully_shard every decoder layer (with `activation_checkpointing`, wrapped first:
    `checkpoint_layers`), the input and the output embedding when they are not tied
    (`embedding_units`), then the root. Returns the trainable parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = train_dtypes(platform)
    mp = MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]) if dtypes else MixedPrecisionPolicy()
    ignored = set()
    for name, p in model.named_parameters():
        if any(k in name for k in FROZEN_REPLICATED):
            p.requires_grad_(False)
            if dtypes:
                p.data = p.data.to(dtypes[0])  # frozen: no fp32 master copy needed
            ignored.add(p)
        elif dtypes and not p.requires_grad:
            # LoRA's frozen base: kept in the compute dtype (half of fp32's bytes); only the
            # trained adapters keep an fp32 master copy
            p.data = p.data.to(dtypes[0])
    layers = _decoder_layers(model)
    if not layers:
        raise RuntimeError(f"found no decoder layers in {type(model).__name__} to shard "
                           "(looked for _no_split_modules and *DecoderLayer)")
    if activation_checkpointing:
        layers = checkpoint_layers(model, layers)
    for layer in layers + embedding_units(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    if any(p.is_meta for p in model.parameters()):   # built to be filled shard by shard (sharded_load)
        from tpuft_workload.sharded_load import materialize

        materialize(model, device)
    else:
        model.to(device)  # moves what FSDP does not own (ignored params, buffers)
    how = "x".join(str(n) for n in mesh.shape)
    log.info("FSDP2: sharded %d %s layers + root over %d devices (%s)%s", len(layers), type(layers[0]).__name__,
             mesh.size(), f"HSDP {how}: replicate x shard" if mesh.ndim > 1 else "FSDP",
             ", activations recomputed per layer" if activation_checkpointing else "")
    return [p for p in model.parameters() if p.requires_grad]
