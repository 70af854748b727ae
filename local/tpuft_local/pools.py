"""Simulated GKE node pools: KWOK Nodes that look like GKE's TPU and CPU pools.

Labels, taints and capacity follow what GKE puts on a TPU slice node: the accelerator and
topology labels from the catalog (one source with the operator's node selectors), the machine
type as `node.kubernetes.io/instance-type`, `google.com/tpu` = chips per host, the machine
type's vCPUs and memory, and the `google.com/tpu` NoSchedule taint (tolerated automatically
by the API server's ExtendedResourceToleration admission, as on GKE). Allocatable is capacity
minus GKE's documented node reservations. KWOK (sigs.k8s.io/kwok) keeps the Nodes Ready and
moves pods placed on them to Running; nothing executes there.
"""
from __future__ import annotations

import dataclasses

from tpuft.api import gke
from tpuft.api.catalog import CatalogError, resolve_slice

KWOK_ANNOTATION = "kwok.x-k8s.io/node"  # KWOK manages only Nodes carrying it (--manage-nodes-with-annotation-selector)
POOL_LABEL = "cloud.google.com/gke-nodepool"
CPU_POOL = "cpu-pool"


@dataclasses.dataclass(frozen=True)
class Machine:
    vcpus: int
    memory_gib: int


# Published Compute Engine machine-type shapes (vCPUs, memory). tpu7x-standard-4t is taken
# from GKE's Ironwood documentation as 224 vCPUs / 960 GiB: UNVERIFIED on real hardware here.
MACHINES = {
    "ct4p-hightpu-4t": Machine(240, 407), "ct5lp-hightpu-4t": Machine(112, 192), "ct5lp-hightpu-8t": Machine(224, 400),
    "ct5p-hightpu-4t": Machine(208, 448), "ct6e-standard-4t": Machine(180, 720), "ct6e-standard-8t": Machine(180, 1440),
    "tpu7x-standard-4t": Machine(224, 960), "n2-standard-16": Machine(16, 64),
}
CPU_POOL_MACHINE = "n2-standard-16"  # where a TPU slice's Ray head (catalog.TPU_HEAD by default) is placed


@dataclasses.dataclass(frozen=True)
class TpuPool:
    accelerator: str  # as spec.accelerator: v6e, tpu7x, ...
    topology: str
    slices: int = 1

    @classmethod
    def parse(cls, text: str) -> "TpuPool":
        """ACCEL:TOPOLOGY[:SLICES], e.g. v6e:4x4 or tpu7x:2x2x2:2."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"--tpu-pool {text!r}: expected ACCEL:TOPOLOGY[:SLICES], e.g. v6e:4x4 or tpu7x:2x2x2:2")
        slices = parts[2] if len(parts) == 3 else "1"
        if not slices.isdigit() or int(slices) < 1:
            raise ValueError(f"--tpu-pool {text!r}: SLICES must be a positive integer")
        pool = cls(parts[0], parts[1], int(slices))
        pool.slice  # validates against the catalog
        return pool

    @property
    def slice(self):
        try:
            return resolve_slice(self.accelerator, self.topology)
        except CatalogError as e:
            raise ValueError(f"--tpu-pool {self.accelerator}:{self.topology}: {e}") from None

    @property
    def name(self) -> str:
        return f"{self.accelerator}-{self.topology}"


# Two v6e 4x4 slices (GKE: one node pool each), so a `slices: 2` run is placed on the real scheduler.
DEFAULT_POOLS = (TpuPool("v6e", "4x4", 2), TpuPool("tpu7x", "2x2x2"))


def gke_allocatable(m: Machine) -> tuple[str, str]:
    """(cpu, memory) allocatable after GKE's node reservations (GKE docs, 'Allocatable resources')."""
    cores, reserved_m = m.vcpus, 0.0
    for upto, share in ((1, 0.06), (2, 0.01), (4, 0.005), (10**9, 0.0025)):
        step = min(cores, upto) - min(cores, {1: 0, 2: 1, 4: 2, 10**9: 4}[upto])
        reserved_m += max(step, 0) * 1000 * share
    gib, reserved_gib = m.memory_gib, 0.0
    for lo, hi, share in ((0, 4, 0.25), (4, 8, 0.20), (8, 16, 0.10), (16, 128, 0.06), (128, 10**9, 0.02)):
        reserved_gib += max(0, min(gib, hi) - lo) * share
    eviction_mib = 100
    return f"{cores * 1000 - int(reserved_m)}m", f"{int((gib - reserved_gib) * 1024) - eviction_mib}Mi"


def _node(name: str, pool: str, machine_type: str, labels: dict, taints: list, extra: dict) -> dict:
    m = MACHINES[machine_type]
    cpu, memory = gke_allocatable(m)
    capacity = {"cpu": str(m.vcpus), "memory": f"{m.memory_gib}Gi", "pods": "110",
                "ephemeral-storage": "100Gi", **extra}
    allocatable = {**capacity, "cpu": cpu, "memory": memory, "ephemeral-storage": "95Gi"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                "node.kubernetes.io/instance-type": machine_type, POOL_LABEL: pool, "type": "kwok",
                                **labels}},
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": allocatable},
    }


def tpu_nodes(pool: TpuPool) -> list[dict]:
    s = pool.slice
    if s.machine_type not in MACHINES:
        raise ValueError(f"--tpu-pool {pool.accelerator}:{pool.topology}: no machine shape for {s.machine_type}; "
                         f"known: {', '.join(sorted(MACHINES))}")
    taint = [{"key": gke.TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]
    return [_node(f"gke-{pool.name}-{i}-{h}", f"{pool.name}-{i}", s.machine_type, dict(s.node_selector), taint,
                  {gke.TPU_RESOURCE: str(s.chips_per_host)})
            for i in range(pool.slices) for h in range(s.hosts)]


# The simulated CPU pool hosts what fits nowhere real (a TPU slice's 4-CPU Ray head). Unmarked, the
# scheduler's least-allocated scoring preferred its 16 empty vCPUs to the busy real node for any
# small pod, KubeRay's job submitters included: KWOK then marked the submitter Completed without
# running it, and KubeRay failed the RayJob "Submitter completed but Ray job not found in
# RayCluster" (issue 34). PreferNoSchedule keeps such pods on the real node while they fit there.
SIMULATED_TAINT = {"key": KWOK_ANNOTATION, "value": "fake", "effect": "PreferNoSchedule"}


def cpu_node() -> dict:
    return _node(f"gke-{CPU_POOL}-0", CPU_POOL, CPU_POOL_MACHINE, {}, [SIMULATED_TAINT], {})


# GKE flex-start with queued provisioning: the nodes of such a pool carry these labels and this taint
# (besides the TPU ones); tpuft_local.queued_provisioning makes them on request.
FLEX_START_LABELS = {gke.GKE_FLEX_START_SELECTOR: "true", gke.GKE_QUEUED_TAINT: "true"}
QUEUED_TAINT = {"key": gke.GKE_QUEUED_TAINT, "value": "true", "effect": "NoSchedule"}


def flex_start_nodes(slice_shape, pool: str, slices: int, extra_labels: dict) -> list[dict]:
    """The KWOK nodes of a flex-start node pool holding `slices` slices of `slice_shape` (one GKE node
    pool per slice: `{pool}-{i}`), as GKE's queued provisioning makes them for a ProvisioningRequest."""
    taints = [{"key": gke.TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}, QUEUED_TAINT]
    labels = {**dict(slice_shape.node_selector), **FLEX_START_LABELS, **extra_labels}
    return [_node(f"gke-{pool}-{i}-{h}", f"{pool}-{i}", slice_shape.machine_type, labels, taints,
                  {gke.TPU_RESOURCE: str(slice_shape.chips_per_host)})
            for i in range(slices) for h in range(slice_shape.hosts)]


def all_nodes(pools) -> list[dict]:
    return [cpu_node()] + [n for p in pools for n in tpu_nodes(p)]
