"""TPU generations and slice shapes: one table, every fact the builders and the workload need.

Facts come from Ray's `ray/_private/accelerators/tpu.py`, XPK's system characteristics and GKE's
TPU documentation; peak dense bf16 compute per chip ("Peak compute per chip (BF16)") from each
generation's Cloud TPU page, cited beside each figure.
Pure: no I/O.

The v6e/v5e 2x4 ambiguity: Ray's `get_chips_per_host` treats 2x4 as one 8-chip VM
(ct6e-standard-8t), XPK lists 2x4 under 4-chip machines. We follow Ray, because Ray's
slice placement group and the TPU webhook's numOfHosts check are what must agree at run
time: 2x4 is a single host with 8 chips.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tpuft.api.constants import CPU_ACCELERATOR
from tpuft.api.gke import GKE_TPU_ACCELERATOR_SELECTOR, GKE_TPU_TOPOLOGY_SELECTOR

# Largest CPU rehearsal we accept; bigger worlds belong on real hardware.
MAX_CPU_WORKERS = 64
# The CRD's maxLength for spec.topology; also keeps int() away from huge digit strings.
MAX_TOPOLOGY_LENGTH = 16
# The shape that messages and the CRD's descriptions give as an example, by topology dimensions.
EXAMPLE_TOPOLOGY = {2: "4x4", 3: "2x2x2"}


class CatalogError(ValueError):
    """A bad accelerator or topology. `field` is the spec field path at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PodSize:
    """A Ray container's default cpu and memory (requests equal limits) and, for a worker, its
    in-memory /dev/shm. Users override each with spec.resources."""
    cpu: str
    memory: str
    shm: str | None = None
    # Sized as GKE's Ray-on-TPU tutorial sizes its workers (v6e on ct6e-standard-4t, TPU7x on
    # tpu7x-standard-4t); the CRD's shmSize description names these. The rest leave headroom on
    # their 4-chip machine types.
    from_reference: bool = False


# Default sizes that are not a generation's: a TPU slice's Ray head is the GKE tutorial's (it trains
# nothing: num-cpus 0; it hosts the jobs' drivers, the GCS and the dashboard), and a CPU
# rehearsal's pods fit a laptop.
TPU_HEAD = PodSize("4", "16Gi")
CPU_HEAD = PodSize("1", "4Gi")
CPU_WORKER = PodSize("1", "4Gi", "1Gi")


@dataclass(frozen=True)
class Generation:
    name: str                      # canonical spelling used in our API
    product: str                   # Google's name for it (descriptions)
    ray_accelerator_type: str      # Ray's accelerator_type, e.g. TPU-V6E
    ray_version: str               # Ray's short name (get_tpu_version_from_type)
    gke_accelerator: str           # node selector cloud.google.com/gke-tpu-accelerator
    machine_type: str              # multi-host machine type (4 chips per VM)
    dims: int                      # 2 or 3 topology dimensions
    chips_per_host: int
    devices_per_chip: int          # TPU7x: 2 chiplets (TensorCores) per chip
    peak_bf16_tflops: float        # peak dense bf16 compute per chip (MFU's denominator)
    hbm_gb: float                  # HBM per chip, GB (what fits: bench/lora_fit.py)
    topologies: tuple[str, ...]    # shapes GKE offers
    single_host: dict[str, str]    # topology -> machine type, for shapes on one VM
    aliases: tuple[str, ...]
    worker: PodSize                # a worker pod's default size (sized for machine_type)


def _shapes(*s: str) -> tuple[str, ...]:
    return s


GENERATIONS: tuple[Generation, ...] = (
    Generation(
        name="v4", product="TPU v4", ray_accelerator_type="TPU-V4", ray_version="v4",
        gke_accelerator="tpu-v4-podslice", machine_type="ct4p-hightpu-4t", dims=3,
        chips_per_host=4, devices_per_chip=1, peak_bf16_tflops=275,   # docs.cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16 per chip
        hbm_gb=32,   # docs.cloud.google.com/tpu/docs/v4: 32 GiB HBM2 per chip
        topologies=_shapes("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
                           "8x8x8", "8x8x12", "8x8x16", "8x16x16", "16x16x16"),
        single_host={"2x2x1": "ct4p-hightpu-4t"},
        worker=PodSize("64", "200Gi", "100Gi"),
        aliases=("tpu-v4", "tpuv4", "tpu-v4-podslice"),
    ),
    Generation(
        name="v5e", product="TPU v5e", ray_accelerator_type="TPU-V5LITEPOD", ray_version="v5litepod",
        gke_accelerator="tpu-v5-lite-podslice", machine_type="ct5lp-hightpu-4t", dims=2,
        chips_per_host=4, devices_per_chip=1, peak_bf16_tflops=197,   # docs.cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16 per chip
        hbm_gb=16,   # docs.cloud.google.com/tpu/docs/v5e: 16 GB HBM2 per chip
        topologies=_shapes("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        single_host={"1x1": "ct5lp-hightpu-1t", "2x2": "ct5lp-hightpu-4t", "2x4": "ct5lp-hightpu-8t"},
        worker=PodSize("24", "96Gi", "48Gi"),
        aliases=("v5litepod", "v5lite", "tpu-v5e", "tpu-v5-lite-podslice", "tpu-v5litepod"),
    ),
    Generation(
        name="v5p", product="TPU v5p", ray_accelerator_type="TPU-V5P", ray_version="v5p",
        gke_accelerator="tpu-v5p-slice", machine_type="ct5p-hightpu-4t", dims=3,
        chips_per_host=4, devices_per_chip=1, peak_bf16_tflops=459,   # docs.cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16 per chip
        hbm_gb=95,   # docs.cloud.google.com/tpu/docs/v5p: 95 GB HBM2e per chip
        topologies=_shapes("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
                           "8x8x8", "8x8x16", "8x16x16", "16x16x16", "16x16x24"),
        single_host={"2x2x1": "ct5p-hightpu-4t"},
        worker=PodSize("64", "200Gi", "100Gi"),
        aliases=("tpu-v5p", "tpu-v5p-slice"),
    ),
    Generation(
        name="v6e", product="TPU v6e", ray_accelerator_type="TPU-V6E", ray_version="v6e",
        gke_accelerator="tpu-v6e-slice", machine_type="ct6e-standard-4t", dims=2,
        chips_per_host=4, devices_per_chip=1, peak_bf16_tflops=918,   # docs.cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16 per chip
        hbm_gb=32,   # docs.cloud.google.com/tpu/docs/v6e: 32 GB HBM per chip
        topologies=_shapes("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        single_host={"1x1": "ct6e-standard-1t", "2x2": "ct6e-standard-4t", "2x4": "ct6e-standard-8t"},
        worker=PodSize("64", "200Gi", "100Gi", from_reference=True),
        aliases=("tpu-v6e", "tpu-v6e-slice", "trillium"),
    ),
    Generation(
        name="tpu7x", product="TPU7x", ray_accelerator_type="TPU-V7X", ray_version="v7x",
        gke_accelerator="tpu7x", machine_type="tpu7x-standard-4t", dims=3,
        chips_per_host=4, devices_per_chip=2, peak_bf16_tflops=2307,  # docs.cloud.google.com/tpu/docs/tpu7x: 2307 bf16 (4614 fp8) per chip
        hbm_gb=192,   # docs.cloud.google.com/tpu/docs/tpu7x: 192 GB HBM per chip
        topologies=_shapes("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
                           "8x8x8", "8x8x16", "8x16x16", "16x16x16"),
        single_host={"2x2x1": "tpu7x-standard-4t"},
        worker=PodSize("64", "250Gi", "128Gi", from_reference=True),
        aliases=("v7x", "tpu-v7x", "ironwood", "tpu7x-standard-4t"),
    ),
)

_BY_SPELLING: dict[str, Generation] = {}
for _g in GENERATIONS:
    for _s in (_g.name, _g.ray_accelerator_type, _g.ray_version, _g.gke_accelerator, *_g.aliases):
        _BY_SPELLING[_s.lower()] = _g

ACCEPTED_ACCELERATORS: tuple[str, ...] = tuple(g.name for g in GENERATIONS) + (CPU_ACCELERATOR,)


def accepted_spellings() -> list[str]:
    """Every spelling `accelerator` accepts (for the CRD's description and error messages)."""
    return sorted(set(_BY_SPELLING) | {CPU_ACCELERATOR})


def canonical_accelerator(value: object, field: str = "spec.accelerator") -> str:
    """'TPU-V6E', 'tpu-v6e-slice', 'v6e' -> 'v6e'; 'cpu' -> 'cpu'."""
    if not isinstance(value, str) or not value.strip():
        raise CatalogError(field, f"must be one of {', '.join(ACCEPTED_ACCELERATORS)} (got {value!r})")
    key = value.strip().lower()
    if key == CPU_ACCELERATOR:
        return CPU_ACCELERATOR
    gen = _BY_SPELLING.get(key)
    if gen is None:
        raise CatalogError(
            field,
            f"unknown accelerator {value!r}; use one of {', '.join(ACCEPTED_ACCELERATORS)} "
            "(Ray and GKE spellings such as TPU-V6E or tpu-v6e-slice are accepted too)",
        )
    return gen.name


def generation(name: str) -> Generation:
    return _BY_SPELLING[canonical_accelerator(name).lower()]


# GPUs are not catalog generations (their topology is a worker count, one GPU each), so their peak
# is looked up on the worker from the device's name (torch.cuda.get_device_name, jax device_kind):
# dense bf16 TFLOP/s from NVIDIA's datasheets, which print twice these "with sparsity". First
# match wins (H100 PCIe and NVL before plain H100, the SXM part). A GPU not listed has no MFU.
GPU_PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989),        # nvidia.com/en-us/data-center/h200: 1,979 with sparsity (SXM)
    ("H100 PCIe", 756),   # nvidia.com/en-us/data-center/h100: 1,513 with sparsity (PCIe)
    ("H100 NVL", 835),    # nvidia.com/en-us/data-center/h100: 1,671 with sparsity (NVL)
    ("H100", 989),        # nvidia.com/en-us/data-center/h100: 1,979 with sparsity (SXM)
    ("A100", 312),        # nvidia.com/en-us/data-center/a100: 312 dense, 624 with sparsity
    ("L4", 121),          # nvidia.com/en-us/data-center/l4: 242 with sparsity
)


def gpu_peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one GPU by its device name (e.g. "NVIDIA H100 80GB HBM3"); None
    for a GPU the table does not list (MFU is then left out, never guessed)."""
    words = f" {device_name.upper()} "
    for model, tflops in GPU_PEAK_BF16_TFLOPS:
        if f" {model.upper()} " in words or f" {model.upper()}-" in words:
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class SliceShape:
    """One slice of a generation and topology, everything derived from the pair."""

    generation: str
    topology: str
    dims: tuple[int, ...]
    chips: int
    hosts: int
    chips_per_host: int
    devices_per_host: int
    machine_type: str | None
    gke_accelerator: str | None
    ray_accelerator_type: str | None
    ray_version: str | None
    tpu_resource_per_chip: int

    @property
    def is_tpu(self) -> bool:
        return self.generation != CPU_ACCELERATOR

    @property
    def devices(self) -> int:
        """Logical devices (one training worker each) in one slice."""
        return self.hosts * self.devices_per_host

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def node_selector(self) -> dict[str, str]:
        if not self.is_tpu:
            return {}
        assert self.gke_accelerator is not None  # a TPU shape always has one (resolve_slice)
        return {GKE_TPU_ACCELERATOR_SELECTOR: self.gke_accelerator, GKE_TPU_TOPOLOGY_SELECTOR: self.topology}

    @property
    def torch_tpu_topology(self) -> str | None:
        """TORCH_TPU_TOPOLOGY as the webhook injects it: X,Y,Z (2D padded with ,1), TPU7x appends ,2."""
        if not self.is_tpu:
            return None
        parts = list(self.dims) + [1] * (3 - len(self.dims))
        if self.tpu_resource_per_chip > 1:
            parts.append(self.tpu_resource_per_chip)
        return ",".join(str(p) for p in parts)

    @property
    def worker_pod(self) -> PodSize:
        return generation(self.generation).worker if self.is_tpu else CPU_WORKER

    @property
    def head_pod(self) -> PodSize:
        return TPU_HEAD if self.is_tpu else CPU_HEAD

    @property
    def peak_flops(self) -> float | None:
        """Peak dense bf16 FLOP/s of the whole slice; None for CPU (no peak to measure against)."""
        if not self.is_tpu:
            return None
        return self.chips * generation(self.generation).peak_bf16_tflops * 1e12

    def as_dict(self) -> dict:
        return {
            "generation": self.generation,
            "topology": self.topology,
            "chips": self.chips,
            "hosts": self.hosts,
            "chipsPerHost": self.chips_per_host,
            "devicesPerHost": self.devices_per_host,
            "devices": self.devices,
            "machineType": self.machine_type,
            "nodeSelector": self.node_selector,
            "rayAcceleratorType": self.ray_accelerator_type,
            "tpuResourcePerChip": self.tpu_resource_per_chip,
            "torchTpuTopology": self.torch_tpu_topology,
            "peakFlops": self.peak_flops,
        }


def parse_dims(topology: object, field: str = "spec.topology") -> tuple[int, ...]:
    if not isinstance(topology, str) or not topology or len(topology) > MAX_TOPOLOGY_LENGTH:
        raise CatalogError(field, f"must be a string such as \"{EXAMPLE_TOPOLOGY[2]}\" or \"{EXAMPLE_TOPOLOGY[3]}\" "
                                  f"(got {topology!r})")
    parts = topology.lower().split("x")
    if not all(p.isascii() and p.isdigit() and p == str(int(p)) and int(p) > 0 for p in parts):
        raise CatalogError(field, f"{topology!r} is not a shape: use positive integers joined by 'x', "
                                  f"e.g. {EXAMPLE_TOPOLOGY[2]}")
    return tuple(int(p) for p in parts)


def resolve_slice(accelerator: object, topology: object,
                  accelerator_field: str = "spec.accelerator",
                  topology_field: str = "spec.topology") -> SliceShape:
    """Validate (accelerator, topology) and derive the slice; CatalogError names the field."""
    acc = canonical_accelerator(accelerator, accelerator_field)
    if acc == CPU_ACCELERATOR:
        if not isinstance(topology, str) or len(topology) > MAX_TOPOLOGY_LENGTH or not (topology.isascii() and topology.isdigit()) or topology != str(int(topology)):
            raise CatalogError(topology_field, f"with accelerator cpu, topology is the worker count, e.g. \"2\" (got {topology!r})")
        n = int(topology)
        if not 1 <= n <= MAX_CPU_WORKERS:
            raise CatalogError(topology_field, f"cpu worker count must be between 1 and {MAX_CPU_WORKERS} (got {n})")
        # One worker per "host": each CPU worker pod is one Ray node with one device.
        return SliceShape(
            generation=CPU_ACCELERATOR, topology=str(n), dims=(n,), chips=n, hosts=n,
            chips_per_host=1, devices_per_host=1, machine_type=None, gke_accelerator=None,
            ray_accelerator_type=None, ray_version=None, tpu_resource_per_chip=1,
        )
    gen = _BY_SPELLING[acc]
    dims = parse_dims(topology, topology_field)
    if len(dims) != gen.dims:
        raise CatalogError(
            topology_field,
            f"{gen.name} topologies are {gen.dims}D (like {EXAMPLE_TOPOLOGY[gen.dims]}), got {topology!r}; "
            f"allowed: {', '.join(gen.topologies)}",
        )
    shape = "x".join(str(d) for d in dims)
    if shape not in gen.topologies:
        raise CatalogError(
            topology_field,
            f"{shape!r} is not a {gen.name} slice shape GKE offers; allowed: {', '.join(gen.topologies)}",
        )
    chips = math.prod(dims)
    if shape in gen.single_host:
        hosts, chips_per_host, machine = 1, chips, gen.single_host[shape]
    else:
        chips_per_host = gen.chips_per_host
        hosts, machine = max(1, chips // chips_per_host), gen.machine_type
    return SliceShape(
        generation=gen.name, topology=shape, dims=dims, chips=chips, hosts=hosts,
        chips_per_host=chips_per_host, devices_per_host=chips_per_host * gen.devices_per_chip,
        machine_type=machine, gke_accelerator=gen.gke_accelerator,
        ray_accelerator_type=gen.ray_accelerator_type, ray_version=gen.ray_version,
        tpu_resource_per_chip=gen.devices_per_chip,
    )
