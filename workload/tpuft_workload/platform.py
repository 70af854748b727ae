"""Which hardware we run on, and everything that follows from it.

One table decides the process-group backend, the torch device, the device-mesh type and
the training precision for TPU, GPU and CPU, so `verify` and `train` share one code path.

`torch_tpu` is imported ONLY on the TPU path (torch loads it as a device-backend plugin):
installing it anywhere else crashes `import torch`, so the CPU/GPU images never have it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from tpuft.api.catalog import CatalogError, SliceShape, resolve_slice
from tpuft.api.constants import CPU_ACCELERATOR

GPU_ACCELERATOR = "gpu"

# Variables the KubeRay TPU webhook injects into every TPU worker pod. Without the
# TORCH_TPU_* pair torch_tpu cannot start multi-process (nothing in Ray 2.60 sets them).
TPU_ENV_ALWAYS = ("TPU_WORKER_ID", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES")
TPU_ENV_MULTI_HOST = ("TPU_WORKER_HOSTNAMES",)


@dataclass(frozen=True)
class Platform:
    kind: str            # "tpu" | "gpu" | "cpu"
    backend: str         # torch.distributed process-group backend
    device_type: str     # torch device type, also the init_device_mesh type
    mixed_precision: bool  # bf16 params / fp32 reduce (accelerators); fp32 on CPU

    @property
    def is_tpu(self) -> bool:
        return self.kind == "tpu"


PLATFORMS: dict[str, Platform] = {
    "tpu": Platform("tpu", "tpu_dist", "tpu", True),
    "gpu": Platform("gpu", "nccl", "cuda", True),
    "cpu": Platform("cpu", "gloo", "cpu", False),
}


@dataclass(frozen=True)
class Target:
    """What the user asked for: platform + slice shape + number of slices."""

    platform: Platform
    shape: SliceShape
    slices: int

    @property
    def world_size(self) -> int:
        return self.shape.devices * self.slices

    @property
    def jax_workers(self) -> int:
        """JaxTrainer workers: one JAX process per host of every slice on TPU, each driving all of
        its host's chips; on CPU/GPU the topology's worker count, as for torch."""
        return self.shape.hosts * self.slices if self.platform.is_tpu else self.world_size


def resolve_target(accelerator: str, topology: str, slices: int = 1) -> Target:
    """--accelerator/--topology/--slices -> Target. Raises CatalogError with the flag at fault.

    `gpu` is not a catalog generation: like `cpu`, its topology is the worker count
    (one GPU per worker).
    """
    if slices < 1:
        raise CatalogError("--slices", f"must be >= 1 (got {slices})")
    acc = (accelerator or "").strip().lower()
    if acc == GPU_ACCELERATOR:
        shape = resolve_slice(CPU_ACCELERATOR, topology, "--accelerator", "--topology")
        return Target(PLATFORMS["gpu"], shape, slices)
    shape = resolve_slice(accelerator, topology, "--accelerator", "--topology")
    if not shape.is_tpu:
        return Target(PLATFORMS["cpu"], shape, slices)
    return Target(PLATFORMS["tpu"], shape, slices)


def missing_tpu_env(shape: SliceShape, environ: Mapping[str, str] | None = None) -> list[str]:
    """Names of webhook-injected variables absent from this TPU worker's environment."""
    env = os.environ if environ is None else environ
    names = list(TPU_ENV_ALWAYS)
    if shape.multi_host:
        names = list(TPU_ENV_MULTI_HOST) + names
    return [n for n in names if not env.get(n)]


def tpu_env_error(missing: list[str], where: str = "") -> str:
    at = f" on {where}" if where else ""
    return (
        f"TPU environment incomplete{at}: missing {', '.join(missing)}. These are injected by "
        "the KubeRay TPU webhook (v1.4.0+ for TORCH_TPU_*): install or upgrade the webhook "
        "(GKE Ray add-on or ai-on-gke kuberay-tpu-webhook) and recreate the RayCluster."
    )


def load_backend(platform: Platform) -> None:
    """Make the platform's backend importable. TPU: `import torch_tpu` (registers tpu_dist)."""
    if platform.is_tpu:
        try:
            import torch_tpu  # noqa: F401  (only ever imported here, on the TPU path)
        except ImportError as e:
            raise RuntimeError(
                "accelerator is a TPU but torch_tpu is not importable in this image: install "
                "torch-tpu and libtpu in the TPU worker image (never in CPU/GPU images)"
            ) from e


def device(platform: Platform, local_rank: int = 0):
    import torch

    if platform.kind == "gpu":
        return torch.device("cuda", local_rank)
    return torch.device(platform.device_type)


def train_dtypes(platform: Platform):
    """(param_dtype, reduce_dtype) for FSDP2 MixedPrecisionPolicy; None on CPU (fp32)."""
    import torch

    if platform.mixed_precision:
        return torch.bfloat16, torch.float32
    return None


# Where a container reads its own memory limit: cgroup v2's file, else v1's.
MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
UNLIMITED = 2 ** 60   # v1 writes a page-rounded 2**63 - 1 for "no limit"


def memory_limit(files: tuple[str, ...] = MEMORY_LIMIT_FILES) -> int | None:
    """This container's memory limit in bytes (its pod's, as the kubelet and Ray's memory monitor
    count it); None without one or where no cgroup file says."""
    for path in files:
        try:
            with open(path) as fh:
                value = fh.read().strip()
        except OSError:
            continue
        if value == "max" or not value.isdigit() or int(value) >= UNLIMITED:
            return None
        return int(value)
    return None
