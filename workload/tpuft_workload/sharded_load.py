"""Load a saved model shard by shard: no rank ever holds more than its FSDP2 shards.

The module tree is built with its parameters on torch's meta device (nothing allocated; buffers,
such as the rotary tables, are computed as usual), sharded with FSDP2, given storage for this
rank's shards only (`to_empty`), then each shard is read from the safetensors files: only the
rows of dim 0 this rank holds, one byte range of the file each, through a pyarrow filesystem
(tpuft_workload.safetensors_ranges: a local folder or a gs:// one, read in place), so a rank
reads and keeps about 1/world of the model. A tied weight is one parameter and is read once; a parameter FSDP2
does not shard (the frozen, replicated Gemma per-layer table) is read whole. LoRA's adapters are
not in the base's files: each is initialised whole as PEFT initialises it, from the run's seed, and
this rank's rows copied in (`_reset_adapters`).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterator

from tpuft_workload import safetensors_ranges
from tpuft_workload.safetensors_ranges import Folder, SafetensorsFile, ShardedLoadError


def loadable(path: str, filesystem=None) -> bool:
    """Whether `path` (a local folder or a gs:// URI; with `filesystem`, a path in it) holds a
    safetensors checkpoint: one file or an index."""
    return safetensors_ranges.loadable(Folder.at(path, filesystem))


def weight_files(path: str, filesystem=None) -> dict[str, str]:
    """{tensor name: its file} of a safetensors checkpoint folder (a local folder or a gs:// URI)."""
    return safetensors_ranges.weight_files(Folder.at(path, filesystem))


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real (a rotary
    table is computed from the config, not read)."""
    import torch
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register


def materialize(model, device) -> None:
    """Storage for this rank's shards (and the unsharded parameters), uninitialised; the buffers
    keep their values (to_empty would drop them)."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if buf.device.type != "meta"}
    model.to_empty(device=device)
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name].to(buf.device))


def _local_rows(param):
    """(the tensor this rank fills, the global offset of its rows) of a parameter: a DTensor's local
    shard and where it starts in dim 0, or a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape) or any(offset[1:]):
        raise ShardedLoadError(f"a shard of shape {tuple(local.shape)} at {tuple(offset)}: only dim-0 sharding "
                               "(FSDP2's Shard(0)) is read shard by shard")
    return local, offset[0]


def fill(model, path: str, filesystem=None, seed: int = 0) -> dict[str, int]:
    """Every parameter (and every persistent buffer the files hold) of a sharded, materialized
    model from the safetensors in `path` (a local folder or a gs:// URI, read in place; with
    `filesystem`, a path in that pyarrow filesystem), each rank reading only its rows; LoRA's
    adapters initialised from `seed` (`_reset_adapters`). Returns
    {"tensors": filled, "bytes": tensor data read by this rank}. ShardedLoadError names what is
    missing."""
    import torch

    folder = Folder.at(path, filesystem)
    files = safetensors_ranges.weight_files(folder)
    names: dict[int, list[str]] = {}   # a tied parameter has several names; the files hold one
    params = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    adapters = {id(p) for n, p in model.named_parameters() if _is_adapter(n)}
    missing, read, opened = [], 0, {}

    def file_of(source: str) -> SafetensorsFile:
        if files[source] not in opened:
            opened[files[source]] = SafetensorsFile(folder, files[source])
        return opened[files[source]]

    try:
        with torch.no_grad():
            for key, param in params.items():
                if key in adapters:
                    continue
                source = next((_checkpoint_name(n) for n in names[key] if _checkpoint_name(n) in files), None)
                if source is None:
                    missing.append(names[key][0])
                    continue
                target, start = _local_rows(param)
                read += file_of(source).read_into(source, target, start)
            for name, buf in model.named_buffers():
                source = _checkpoint_name(name)
                if source in files:
                    read += file_of(source).read_into(source, buf, None)
    finally:
        for opened_file in opened.values():
            opened_file.close()
    if missing:
        raise ShardedLoadError(f"{path} holds no tensor for {len(missing)} parameters, e.g. {missing[:3]}: it is "
                               "not a checkpoint of this model (spec.model)")
    _reset_adapters(model, seed)
    return {"tensors": len(params) - len(adapters), "bytes": read}


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


# torch's activation checkpointing wrapper (model.checkpoint_layers) holds the layer under this name
CHECKPOINT_WRAPPED = "._checkpoint_wrapped_module."


def _checkpoint_name(name: str) -> str:
    """A parameter's name in a Hugging Face checkpoint: PEFT's wrapping (base_model.model., base_layer.)
    and activation checkpointing's (a layer's _checkpoint_wrapped_module.) taken off."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").replace(CHECKPOINT_WRAPPED, ".")


def _reset_adapters(model, seed: int) -> None:
    """LoRA's adapters, which no base checkpoint holds, as PEFT initialises them (A, and an
    embedding's B: random; the others zero): each drawn whole on the CPU from a generator seeded by
    `seed` and its name, the same on every rank, then this rank's rows copied in. Not PEFT's reset
    on the sharded parameter: without CUDA's RNG tracker, DTensor's random ops fill each rank's
    shard from that rank's own generator, seeded alike on every rank, so the shards repeat each
    other and A's rank falls to r / world (B starts at zero: for good)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not _is_adapter(name):
                continue
            full = torch.zeros(param.shape, dtype=torch.float32)
            if ".lora_A." in name:   # PEFT's init_lora_weights=True
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=_generator(seed, name))
            elif ".lora_embedding_B." in name:
                torch.nn.init.normal_(full, generator=_generator(seed, name))
            target, start = _local_rows(param)
            rows = full if start is None else full[start:start + target.shape[0]]
            target.copy_(rows.to(target.dtype))


def _generator(seed: int, name: str):
    """A CPU generator for one parameter: seeded by the run's seed and the parameter's name."""
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


# glibc's mallopt parameter, and the size from which each allocation is a mapping of its own
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def unmap_freed_tensors() -> bool:
    """Have glibc's malloc give every allocation of MMAP_THRESHOLD_BYTES or more its own mapping,
    returned to the kernel when freed. By default glibc raises that threshold (up to 32 MiB) after
    the first such free, and FSDP2's gathered weights (a layer's, freed after its forward) then come
    from the heap, where freed chunks stay charged to the pod: measured, up to 41 MiB more a
    layer of a 0.15B Llama's first forward, with or without activation checkpointing
    (bench/sharded_load.py). A fixed threshold also turns glibc's adjustment off. Call it before the
    model is built; True where it took effect (glibc only)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, its address space's high-water mark (not
    getrusage's ru_maxrss, which keeps the parent's peak across fork and exec)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")
