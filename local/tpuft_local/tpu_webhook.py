"""LOCAL STAND-IN for the KubeRay TPU webhook. NOT the real webhook; never deploy it.

The real one is Google's `kuberay-tpu-webhook` (GoogleCloudPlatform/ai-on-gke
ray-on-gke/tpu/kuberay-tpu-webhook, since moved to ai-on-gke/kuberay-tpu-webhook; on GKE it
ships as the Ray add-on). No registry serves its image here, so the local cluster runs this
Python copy of its behaviour as a host process (`python -m tpuft_local.tpu_webhook`) and
registers it with `webhook_configurations(url, ca)`.

Read from its `main.go`: the revision with `injectTorchTpuEnvsIfNeeded` (webhook v1.4.x,
Kueue v1beta2 imports), checked against the v1.3.1 chart and its e2e tests. What it follows:

- Mutation of KubeRay pods (label `app.kubernetes.io/name: kuberay`) whose containers ask for
  `google.com/tpu`: label `replicaIndex: {group}-{replica}` (only when KubeRay's own
  `ray.io/worker-group-replica-index` + `ray.io/replica-host-index` labels are absent; then the
  index comes from the sibling pods, as the real one's informer does); for numOfHosts > 1
  `spec.hostname` `{group}-{replica}-{host}`, `spec.subdomain` `{cluster}-headless` (KubeRay's
  CheckName truncation) and the replica's pod (anti-)affinity; env `MEGASCALE_*` (only when
  the container sets MEGASCALE_NUM_SLICES), `TPU_WORKER_HOSTNAMES` (multi-host),
  `TPU_PROCESS_ADDRESSES`/`TPU_PROCESS_PORT` (tpu7x multi-host), `TORCH_TPU_TOPOLOGY`,
  `TORCH_TPU_SLICEBUILDER_ADDRESSES`, `TPU_WORKER_ID`, `TPU_NAME`, `TPU_DEVICE_PLUGIN_HOST_IP`
  (fieldRef status.hostIP), `TPU_DEVICE_PLUGIN_ADDR`, in the real one's order, with its
  "skip when already set" rules and its add-to-env JSONPatch shape.
- Validation of RayClusters: every worker group asking for google.com/tpu needs numOfHosts
  set, a topology (nodeSelector cloud.google.com/gke-tpu-topology, or the sub-slice
  annotation) and numOfHosts == chips(topology) // chips per pod (at least 1). A group asking
  for no google.com/tpu passes, TPU node selectors or not, as in the real one. Refusal text
  is the real one's, followed by where it went wrong.

Differences, on purpose: where the real webhook returns an HTTP error (the API server then
fails the call and, failurePolicy Fail, refuses the object with an opaque message) this one
answers `allowed: false` with the real error text and the place, so a refusal reads clearly.
Left out: sub-slice affinity discovery from Node topology labels (needs a node informer and
GCE topology labels KWOK nodes do not have), the Kueue/dynamic-slicing bypass of that check,
and the informer cache; siblings are listed live under one lock instead.

The webhook's own strings are spelled here, not imported from `tpuft.api.constants`, so that a
wrong constant in the operator fails a test instead of agreeing with itself.
"""
from __future__ import annotations

import argparse
import base64
import copy
import enum
import http.server
import json
import logging
import math
import signal
import ssl
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from tpuft_local import gke_environment

log = logging.getLogger("tpuft_local.tpu_webhook")

# --- Names the real webhook reads and writes ------------------------------------------------
TPU_RESOURCE = "google.com/tpu"
TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
ACCELERATOR_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
SUBSLICE_TOPOLOGY_ANNOTATION = "cloud.google.com/gke-tpu-slice-topology"
GKE_LABEL_PREFIX = "cloud.google.com/"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
KUEUE_REQUIRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-required-topology"
TPU7X_PREFIX = "tpu7x"  # accelerator selector prefix of the dual-chiplet ("TensorNode") TPUs

CLUSTER_LABEL = "ray.io/cluster"
GROUP_LABEL = "ray.io/group"
REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"  # KubeRay >= 1.5, RayMultiHostIndexing
HOST_INDEX_LABEL = "ray.io/replica-host-index"
REPLICA_NAME_LABEL = "ray.io/worker-group-replica-name"
LEGACY_REPLICA_LABEL = "replicaIndex"  # the webhook's own label, value "{group}-{replica}"
KUBERAY_POD_LABELS = {"app.kubernetes.io/name": "kuberay"}  # the webhook's objectSelector
HEADLESS_SUFFIX = "headless"  # KubeRay utils.HeadlessServiceSuffix
NAME_MAX = 50  # KubeRay utils.CheckName keeps the last 50 characters

TPU_PROCESS_PORT_BASE = 8471
MEGASCALE_PORT_BASE = 8081  # 8080 is Ray's metrics port
DEVICE_PLUGIN_PORT = 2112

MISMATCH_MESSAGE = "Number of workers in worker group not equal to specified topology"
MUTATE_PATH = "/mutate"
VALIDATE_PATH = "/validate"


class Env(str, enum.Enum):
    TPU_WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"
    TPU_WORKER_ID = "TPU_WORKER_ID"
    TPU_NAME = "TPU_NAME"
    TORCH_TPU_TOPOLOGY = "TORCH_TPU_TOPOLOGY"
    TORCH_TPU_SLICEBUILDER_ADDRESSES = "TORCH_TPU_SLICEBUILDER_ADDRESSES"
    TPU_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"
    TPU_PROCESS_PORT = "TPU_PROCESS_PORT"
    TPU_DEVICE_PLUGIN_HOST_IP = "TPU_DEVICE_PLUGIN_HOST_IP"
    TPU_DEVICE_PLUGIN_ADDR = "TPU_DEVICE_PLUGIN_ADDR"
    MEGASCALE_NUM_SLICES = "MEGASCALE_NUM_SLICES"
    MEGASCALE_SLICE_ID = "MEGASCALE_SLICE_ID"
    MEGASCALE_COORDINATOR_ADDRESS = "MEGASCALE_COORDINATOR_ADDRESS"
    MEGASCALE_PORT = "MEGASCALE_PORT"


class Refusal(ValueError):
    """The real webhook would refuse this object (it fails the admission call)."""


# --- Reading pods and worker groups ----------------------------------------------------------
def _tpu_quantity(value: object, where: str) -> int:
    """A google.com/tpu quantity as a chip count (Kubernetes rounds fractions up)."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise Refusal(f"{TPU_RESOURCE} quantity {value!r} is not a number ({where})")
    try:
        return math.ceil(Decimal(str(value)))
    except (InvalidOperation, ValueError, OverflowError):
        raise Refusal(f"{TPU_RESOURCE} quantity {value!r} is not a number ({where})") from None


def _resources(container: dict) -> tuple[dict, dict]:
    res = container.get("resources") or {}
    return res.get("requests") or {}, res.get("limits") or {}


def requests_tpus(container: dict, where: str = "container") -> bool:
    requests, limits = _resources(container)
    return any(_tpu_quantity(q.get(TPU_RESOURCE), where) > 0 for q in (limits, requests))


def tpu_chips(containers: Iterable[dict], where: str = "pod") -> int:
    """Chips the pod asks for: per container the request, else the limit, summed (as the real one)."""
    total = 0
    for ctr in containers:
        requests, limits = _resources(ctr)
        chips = _tpu_quantity(requests.get(TPU_RESOURCE), where)
        total += chips or _tpu_quantity(limits.get(TPU_RESOURCE), where)
    return total


def topology_dims(topology: str, where: str = "topology") -> tuple[int, ...]:
    """'4x4' -> (4, 4, 1); '2x2x2' -> (2, 2, 2). 2D shapes get a third dimension of 1."""
    parts = topology.split("x") if isinstance(topology, str) else [repr(topology)]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise Refusal(f"invalid TPU topology {topology!r} ({where}: expected e.g. 4x4 or 2x2x2)")
    dims = tuple(int(p) for p in parts)
    return dims + (1,) if len(dims) == 2 else dims


def hosts_for(topology: str, chips_per_host: int, where: str = "topology") -> int:
    return max(math.prod(topology_dims(topology, where)) // chips_per_host, 1)


def headless_service_name(cluster: str) -> str:
    """`{cluster}-headless`, shortened the way KubeRay's CheckName shortens it."""
    name = f"{cluster}-{HEADLESS_SUFFIX}"
    if len(name) > NAME_MAX:
        name = name[len(name) - NAME_MAX:]
    if name[0].isdigit() or unicodedata.category(name[0]).startswith("P"):
        name = "r" + name[1:]
    return name


def worker_hostnames(group: str, cluster: str, replica: int, hosts: int) -> list[str]:
    service = headless_service_name(cluster)
    return [f"{group}-{replica}-{h}.{service}" for h in range(hosts)]


def torch_tpu_topology(topology: str, tpu7x: bool) -> str:
    """TORCH_TPU_TOPOLOGY: X,Y,Z, then ,2 on tpu7x (two chiplets per chip)."""
    dims = ",".join(str(d) for d in topology_dims(topology, TOPOLOGY_SELECTOR))
    return dims + ",2" if tpu7x else dims


def slicebuilder_addresses(hostnames: Sequence[str], topology: str, tpu7x: bool) -> str:
    """TORCH_TPU_SLICEBUILDER_ADDRESSES: host:8471+i for every device of every host."""
    per_host = math.prod(topology_dims(topology, TOPOLOGY_SELECTOR)) // len(hostnames)
    per_host *= 2 if tpu7x else 1
    return ",".join(f"{h}:{TPU_PROCESS_PORT_BASE + i}" for h in hostnames for i in range(per_host))


def _env(container: dict, name: str) -> tuple[str, bool]:
    """(value, set): set when a value or a valueFrom is given (the real getEnvironmentVariable)."""
    for var in container.get("env") or ():
        if var.get("name") == name:
            if var.get("value"):
                return str(var["value"]), True
            if var.get("valueFrom"):
                return "", True
    return "", False


@dataclass(frozen=True)
class TPUPod:
    """What the webhook reads off one KubeRay TPU worker pod."""

    namespace: str
    cluster: str
    group: str
    topology: str            # sub-slice annotation, else the topology nodeSelector
    selector_topology: str   # the nodeSelector alone (TORCH_TPU_TOPOLOGY uses only this)
    hosts: int               # numOfHosts implied by topology and chips per pod
    tpu7x: bool
    tpu_containers: tuple[int, ...]  # indices into spec.containers

    @property
    def where(self) -> str:
        return f"pod of RayCluster {self.namespace}/{self.cluster} group {self.group!r}"


def read_tpu_pod(pod: dict) -> TPUPod | None:
    """The TPU facts of a KubeRay pod; None when no container asks for google.com/tpu."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    containers = spec.get("containers")
    if not containers:
        raise Refusal("Container path not specified")
    tpu_idx = tuple(i for i, ctr in enumerate(containers) if requests_tpus(ctr, f"spec.containers[{i}]"))
    if not tpu_idx:
        return None
    labels, selector = meta.get("labels") or {}, spec.get("nodeSelector") or {}
    cluster, group = labels.get(CLUSTER_LABEL, ""), labels.get(GROUP_LABEL, "")
    if not cluster:
        raise Refusal(f"Ray Pod created by KubeRay missing RayCluster label ({CLUSTER_LABEL})")
    if not group:
        raise Refusal(f"Ray Pod created by KubeRay missing Group label ({GROUP_LABEL})")
    topology = (meta.get("annotations") or {}).get(SUBSLICE_TOPOLOGY_ANNOTATION) or selector.get(TOPOLOGY_SELECTOR, "")
    if not topology:
        raise Refusal(f"Ray Pod created by KubeRay missing TPU topology nodeSelector ({TOPOLOGY_SELECTOR}) "
                      f"in group {group!r} of RayCluster {cluster!r}")
    chips = tpu_chips(containers, f"group {group!r}")
    return TPUPod(
        namespace=meta.get("namespace", ""), cluster=cluster, group=group, topology=topology,
        selector_topology=selector.get(TOPOLOGY_SELECTOR, ""),
        hosts=hosts_for(topology, chips, f"group {group!r}"),
        tpu7x=str(selector.get(ACCELERATOR_SELECTOR, "")).startswith(TPU7X_PREFIX),
        tpu_containers=tpu_idx,
    )


# --- Which slice and host a pod is ---------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """A pod's place: replica (slice) index within its group and host index within the slice."""

    replica: int
    host: int


def _kuberay_slot(labels: dict) -> Slot | None:
    """KubeRay's own indexing labels (feature gate RayMultiHostIndexing), when both are set."""
    if REPLICA_INDEX_LABEL not in labels or HOST_INDEX_LABEL not in labels:
        return None
    try:
        replica = int(labels[REPLICA_INDEX_LABEL])
    except ValueError as e:
        raise Refusal(f"failed to parse replica index label: {e}") from None
    try:
        host = int(labels[HOST_INDEX_LABEL])
    except ValueError as e:
        raise Refusal(f"failed to parse host index label: {e}") from None
    return Slot(replica, host)


def occupied_slots(siblings: Iterable[dict]) -> list[Slot]:
    """Slots held by pods this webhook already admitted in the group (the real getSliceToTPUHosts)."""
    slots: list[Slot] = []
    for pod in siblings:
        meta, containers = pod.get("metadata") or {}, (pod.get("spec") or {}).get("containers") or []
        if meta.get("deletionTimestamp"):
            continue
        tpu = [ctr for ctr in containers if requests_tpus(ctr)]
        if not tpu:
            break  # the real one stops here: a group whose pods ask for no TPU is not a TPU group
        label = (meta.get("labels") or {}).get(LEGACY_REPLICA_LABEL, "")
        if not label:
            continue  # not mutated by the webhook yet
        tail = label.rsplit("-", 1)[-1]
        replica = int(tail) if tail.isdigit() else 0  # Go's Atoi error is ignored, leaving 0
        for ctr in tpu:
            worker_id, _ = _env(ctr, Env.TPU_WORKER_ID)
            if not worker_id:
                raise Refusal(f"existing TPU worker missing TPU_WORKER_ID (pod {meta.get('name', '?')})")
            if worker_id.isdigit():
                slots.append(Slot(replica, int(worker_id) // len(tpu)))
                break
    return slots


def next_replica(occupied: Sequence[Slot], hosts: int) -> int:
    """The lowest replica with a free host, else the lowest replica index not in use."""
    held: dict[int, int] = {}
    for s in occupied:
        held[s.replica] = held.get(s.replica, 0) + 1
    unfilled = [r for r, n in held.items() if n < hosts]
    if unfilled:
        return min(unfilled)
    return next(i for i in range(len(held) + 1) if i not in held)


def next_host(occupied: Sequence[Slot], replica: int) -> int:
    """The lowest host index not held in the replica; a duplicate held index is an error."""
    ids = sorted(s.host for s in occupied if s.replica == replica)
    host = 0
    for i, worker_id in enumerate(ids):
        if i > 0 and worker_id == ids[i - 1]:
            raise Refusal("Identical TPU_WORKER_ID assigned to multiple TPU workers in slice")
        if worker_id != host:
            break
        host += 1
    return host


def assign_slot(tp: TPUPod, pod: dict, siblings: Iterable[dict] = (),
                pending: Iterable[Slot] = ()) -> tuple[Slot, bool]:
    """(slot, from KubeRay's labels). `pending`: slots admitted but not yet listed."""
    native = _kuberay_slot((pod.get("metadata") or {}).get("labels") or {})
    if native is not None:
        return native, True
    occupied = occupied_slots(siblings)
    occupied += [s for s in pending if s not in occupied]
    replica = next_replica(occupied, tp.hosts)
    return Slot(replica, next_host(occupied, replica)), False


# --- Mutation ---------------------------------------------------------------------------------
class _EnvOps:
    """JSONPatch adds to one container's env, shaped as the real webhook's: the first add
    creates the array when the container has none, later ones append."""

    def __init__(self, index: int, container: dict):
        self.path = f"/spec/containers/{index}/env"
        self.exists = bool(container.get("env"))
        self.ops: list[dict] = []

    def add(self, name: Env, value: str | None = None, value_from: dict | None = None) -> None:
        var: dict = {"name": name.value}
        if value_from is not None:
            var["valueFrom"] = value_from
        else:
            var["value"] = value
        if self.exists:
            self.ops.append({"op": "add", "path": f"{self.path}/-", "value": var})
        else:
            self.ops.append({"op": "add", "path": self.path, "value": [var]})
            self.exists = True


def _megascale(env: _EnvOps, tp: TPUPod, slot: Slot, tpu_index: int, ctr: dict) -> None:
    """Multi-slice env, only when the user asked for it by setting MEGASCALE_NUM_SLICES."""
    if not _env(ctr, Env.MEGASCALE_NUM_SLICES)[1]:
        return
    if not _env(ctr, Env.MEGASCALE_SLICE_ID)[0]:
        env.add(Env.MEGASCALE_SLICE_ID, str(slot.replica))
    if not _env(ctr, Env.MEGASCALE_COORDINATOR_ADDRESS)[0]:
        coordinator = f"{tp.group}-0-0.{headless_service_name(tp.cluster)}"
        env.add(Env.MEGASCALE_COORDINATOR_ADDRESS,
                f"{coordinator}:{MEGASCALE_PORT_BASE}" if tp.tpu7x else coordinator)
    if not _env(ctr, Env.MEGASCALE_PORT)[0]:
        env.add(Env.MEGASCALE_PORT, str(MEGASCALE_PORT_BASE + (tpu_index if tp.tpu7x else 0)))


def _network(env: _EnvOps, tp: TPUPod, slot: Slot, tpu_index: int, ctr: dict) -> list[str]:
    """TPU_WORKER_HOSTNAMES (and tpu7x process addresses) on multi-host; returns the hostnames."""
    if tp.hosts <= 1:
        return ["localhost"]
    given, _ = _env(ctr, Env.TPU_WORKER_HOSTNAMES)
    hostnames = given.split(",") if given and given != "localhost" else []
    if not hostnames:  # unset, or the single-host default: the webhook fills it in
        hostnames = worker_hostnames(tp.group, tp.cluster, slot.replica, tp.hosts)
        env.add(Env.TPU_WORKER_HOSTNAMES, ",".join(hostnames))
    if tp.tpu7x:
        addresses, _ = _env(ctr, Env.TPU_PROCESS_ADDRESSES)
        if not addresses or "localhost" in addresses:
            ports = range(TPU_PROCESS_PORT_BASE, TPU_PROCESS_PORT_BASE + len(tp.tpu_containers))
            own = worker_hostnames(tp.group, tp.cluster, slot.replica, tp.hosts)
            env.add(Env.TPU_PROCESS_ADDRESSES, ",".join(f"{h}:{p}" for h in own for p in ports))
        if not _env(ctr, Env.TPU_PROCESS_PORT)[0]:
            env.add(Env.TPU_PROCESS_PORT, str(TPU_PROCESS_PORT_BASE + tpu_index))
    return hostnames


def _torch(env: _EnvOps, tp: TPUPod, ctr: dict, hostnames: Sequence[str]) -> None:
    """torch_tpu's multi-process bootstrap, unless the container sets TORCH_TPU_TOPOLOGY itself."""
    if _env(ctr, Env.TORCH_TPU_TOPOLOGY)[1]:
        return
    env.add(Env.TORCH_TPU_TOPOLOGY, torch_tpu_topology(tp.selector_topology, tp.tpu7x))
    env.add(Env.TORCH_TPU_SLICEBUILDER_ADDRESSES,
            slicebuilder_addresses(hostnames, tp.selector_topology, tp.tpu7x))


def _identity(env: _EnvOps, tp: TPUPod, slot: Slot, tpu_index: int, ctr: dict) -> None:
    # Up to v6e one TPU_WORKER_ID per pod; tpu7x numbers every TPU container.
    worker_id = slot.host * len(tp.tpu_containers) + tpu_index if tp.tpu7x else slot.host
    given, _ = _env(ctr, Env.TPU_WORKER_ID)
    # A value equal to the container's default index is overwritten (appended; the last wins).
    if not given or (given == str(tpu_index) and given != str(worker_id)):
        env.add(Env.TPU_WORKER_ID, str(worker_id))
    if not _env(ctr, Env.TPU_NAME)[0]:
        env.add(Env.TPU_NAME, f"{tp.group}-{slot.replica}")
    if not _env(ctr, Env.TPU_DEVICE_PLUGIN_HOST_IP)[1]:
        env.add(Env.TPU_DEVICE_PLUGIN_HOST_IP, value_from={"fieldRef": {"fieldPath": "status.hostIP"}})
    if not _env(ctr, Env.TPU_DEVICE_PLUGIN_ADDR)[0]:
        env.add(Env.TPU_DEVICE_PLUGIN_ADDR, f"$({Env.TPU_DEVICE_PLUGIN_HOST_IP.value}):{DEVICE_PLUGIN_PORT}")


def _selector(key: str, op: str, *values: str) -> dict:
    req: dict = {"key": key, "operator": op}
    if values:
        req["values"] = list(values)
    return req


def _affinity_topology_key(pod: dict) -> str:
    """A user's cloud.google.com/ podAffinity key, else Kueue's required topology, else node pool."""
    terms = (((pod.get("spec") or {}).get("affinity") or {}).get("podAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or []
    for term in terms:
        if str(term.get("topologyKey", "")).startswith(GKE_LABEL_PREFIX):
            return term["topologyKey"]
    required = ((pod.get("metadata") or {}).get("annotations") or {}).get(KUEUE_REQUIRED_TOPOLOGY_ANNOTATION, "")
    return required if required.startswith(GKE_LABEL_PREFIX) else NODEPOOL_LABEL


def _affinity_op(pod: dict, tp: TPUPod, slot: Slot) -> dict:
    """Keep a slice's pods on one node pool, and other slices and clusters off it."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if REPLICA_NAME_LABEL in labels and HOST_INDEX_LABEL in labels:
        key, value = REPLICA_NAME_LABEL, labels[REPLICA_NAME_LABEL]
    else:
        key, value = LEGACY_REPLICA_LABEL, f"{tp.group}-{slot.replica}"
    topo = _affinity_topology_key(pod)
    cluster_in = _selector(CLUSTER_LABEL, "In", tp.cluster)
    together = {"labelSelector": {"matchExpressions": [_selector(key, "In", value), cluster_in]}, "topologyKey": topo}
    apart = [
        {"labelSelector": {"matchExpressions": [_selector(key, "NotIn", value), cluster_in]}, "topologyKey": topo},
        {"labelSelector": {"matchExpressions": [_selector(CLUSTER_LABEL, "NotIn", tp.cluster), _selector(key, "Exists")]},
         "topologyKey": topo,
         "namespaceSelector": {"matchExpressions": [_selector("kubernetes.io/metadata.name", "NotIn", "kube-system")]}},
    ]
    affinity = copy.deepcopy((pod.get("spec") or {}).get("affinity") or {})
    pod_aff = affinity["podAffinity"] = affinity.get("podAffinity") or {}
    pod_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(together)
    anti = affinity["podAntiAffinity"] = affinity.get("podAntiAffinity") or {}
    anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).extend(apart)
    return {"op": "add", "path": "/spec/affinity", "value": affinity}


@dataclass(frozen=True)
class Mutation:
    ops: tuple[dict, ...]   # JSONPatch operations, in the real webhook's order
    slot: Slot | None       # None for a pod that asks for no TPU (left untouched)


def mutate_pod(pod: dict, siblings: Iterable[dict] = (), pending: Iterable[Slot] = ()) -> Mutation:
    """The JSONPatch the real webhook applies to `pod` (a KubeRay worker pod, as created).

    `siblings`: the pods already in the pod's (namespace, cluster, group); they decide the
    replica and host index unless KubeRay labelled the pod itself. Raises Refusal where the
    real webhook refuses the pod."""
    tp = read_tpu_pod(pod)
    if tp is None:
        return Mutation((), None)
    slot, from_kuberay = assign_slot(tp, pod, siblings, pending)
    ops: list[dict] = []
    if not from_kuberay:
        ops.append({"op": "add", "path": f"/metadata/labels/{LEGACY_REPLICA_LABEL}",
                    "value": f"{tp.group}-{slot.replica}"})
    if tp.hosts > 1:
        ops.append({"op": "add", "path": "/spec/hostname", "value": f"{tp.group}-{slot.replica}-{slot.host}"})
        ops.append({"op": "add", "path": "/spec/subdomain", "value": headless_service_name(tp.cluster)})
        ops.append(_affinity_op(pod, tp, slot))
    containers = pod["spec"]["containers"]
    for tpu_index, i in enumerate(tp.tpu_containers):
        env = _EnvOps(i, containers[i])
        _megascale(env, tp, slot, tpu_index, containers[i])
        hostnames = _network(env, tp, slot, tpu_index, containers[i])
        _torch(env, tp, containers[i], hostnames)
        _identity(env, tp, slot, tpu_index, containers[i])
        ops += env.ops
    return Mutation(tuple(ops), slot)


# --- Validation -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    allowed: bool
    message: str = ""
    patch: tuple[dict, ...] = ()
    warnings: tuple[str, ...] = ()
    detail: str = ""  # for the log line only: names and indices, never env values


def _check_group(group: dict, index: int) -> str | None:
    """Why the real webhook refuses this worker group, or None."""
    name = group.get("groupName", f"workerGroupSpecs[{index}]")
    where = f"worker group {name!r}"
    template = group.get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    if containers and not any(requests_tpus(ctr, where) for ctr in containers):
        return None  # no TPUs asked for: not the webhook's business
    # The KubeRay CRD defaults numOfHosts to 1 before any webhook sees the object.
    hosts = group.get("numOfHosts", 1)
    if not hosts:
        return f"workerGroupSpec NumOfHosts not set ({where}: numOfHosts is {hosts!r})"
    if not isinstance(hosts, int) or isinstance(hosts, bool):
        return f"numOfHosts must be an integer ({where}: got {hosts!r})"
    if not containers:
        return f"Container path not specified ({where}: template.spec.containers is empty)"
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    selector = (template.get("spec") or {}).get("nodeSelector") or {}
    topology = annotations.get(SUBSLICE_TOPOLOGY_ANNOTATION) or selector.get(TOPOLOGY_SELECTOR, "")
    if not topology:
        return f"TPU topology not specified ({where}: set nodeSelector {TOPOLOGY_SELECTOR})"
    chips = tpu_chips(containers, where)
    if chips == 0:
        return f"Container does not set TPU limits ({where}: resources {TPU_RESOURCE})"
    expected = hosts_for(topology, chips, where)
    if expected != hosts:
        return (f"{MISMATCH_MESSAGE} ({where}: numOfHosts is {hosts}, but topology {topology} with "
                f"{chips} {TPU_RESOURCE} per pod needs {expected})")
    return None


def validate_raycluster(raycluster: dict) -> Decision:
    """Admit or refuse a RayCluster as the real webhook does: the first bad TPU group refuses it."""
    groups = (raycluster.get("spec") or {}).get("workerGroupSpecs") or []
    for index, group in enumerate(groups):
        try:
            problem = _check_group(group, index)
        except Refusal as e:
            problem = str(e)
        if problem:
            return Decision(False, problem, detail=problem)
    return Decision(True, detail=f"{len(groups)} worker group(s) fit their topology")


# --- AdmissionReview v1 -------------------------------------------------------------------------
SiblingLister = Callable[[str, str, str], list[dict]]  # (namespace, cluster, group) -> pods


def _no_siblings(namespace: str, cluster: str, group: str) -> list[dict]:
    return []


class PendingSlots:
    """Slots this process admitted that a pod List may not show yet (the real one waits up to
    a second for its informer instead). Entries leave when listed or after `ttl` seconds."""

    def __init__(self, ttl: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.clock = ttl, clock
        self._slots: dict[tuple[str, str, str], dict[Slot, float]] = {}

    def current(self, key: tuple[str, str, str], listed: Iterable[Slot]) -> list[Slot]:
        now, seen = self.clock(), set(listed)
        slots = self._slots.get(key, {})
        for slot in [s for s, t in slots.items() if s in seen or now - t > self.ttl]:
            del slots[slot]
        return list(slots)

    def remember(self, key: tuple[str, str, str], slot: Slot) -> None:
        self._slots.setdefault(key, {})[slot] = self.clock()


def _request(review: object) -> dict:
    if not isinstance(review, dict) or not isinstance(review.get("request"), dict):
        raise Refusal("not an AdmissionReview: no .request object")
    return review["request"]


def decide_mutation(request: dict, list_siblings: SiblingLister = _no_siblings,
                    pending: PendingSlots | None = None) -> Decision:
    if (request.get("kind") or {}).get("kind") != "Pod":
        raise Refusal(f"Invalid Kind: expected Pod at {MUTATE_PATH}, got {(request.get('kind') or {}).get('kind')!r}")
    if request.get("operation", "CREATE") != "CREATE":
        return Decision(True, detail=f"operation {request.get('operation')} is not mutated")
    pod = copy.deepcopy(request.get("object") or {})
    meta = pod.setdefault("metadata", {})
    # On CREATE the object's namespace may still be empty; the request always carries it.
    meta["namespace"] = meta.get("namespace") or request.get("namespace", "")
    tp = read_tpu_pod(pod)
    if tp is None:
        return Decision(True, detail="no google.com/tpu requested: untouched")
    key = (tp.namespace, tp.cluster, tp.group)
    try:
        siblings = list_siblings(*key)
    except Exception as e:  # the real one refuses the pod when its lister fails
        raise Refusal(f"cannot list pods of RayCluster {tp.namespace}/{tp.cluster} group {tp.group!r}: "
                      f"{type(e).__name__} {getattr(e, 'status', '')}".rstrip()) from None
    pending_now = pending.current(key, occupied_slots(siblings)) if pending else []
    result = mutate_pod(pod, siblings, pending_now)
    if pending is not None and result.slot is not None:
        pending.remember(key, result.slot)
    return Decision(True, patch=result.ops,
                    detail=f"{tp.cluster}/{tp.group} replica={result.slot.replica} host={result.slot.host} "
                           f"hosts={tp.hosts} ops={len(result.ops)}")


def decide_validation(request: dict) -> Decision:
    if (request.get("kind") or {}).get("kind") != "RayCluster":
        raise Refusal(f"Invalid Kind: expected RayCluster at {VALIDATE_PATH}, "
                      f"got {(request.get('kind') or {}).get('kind')!r}")
    if request.get("operation") == "DELETE":
        return Decision(True, detail="DELETE is not validated")
    obj = request.get("object")
    if not isinstance(obj, dict):
        raise Refusal("RayCluster admission request has no object")
    return validate_raycluster(obj)


def review_response(uid: str, decision: Decision) -> dict:
    """An AdmissionReview v1 answer: patch as base64 JSONPatch, refusal in status.message."""
    response: dict = {"uid": uid, "allowed": decision.allowed}
    if decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(decision.patch)).encode()).decode()
    if not decision.allowed:
        response["status"] = {"status": "Failure", "message": decision.message, "code": 403}
    if decision.warnings:
        response["warnings"] = list(decision.warnings)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def answer(path: str, review: object, list_siblings: SiblingLister = _no_siblings,
           pending: PendingSlots | None = None, gke_env: dict[str, str] | None = None) -> tuple[dict, Decision]:
    """AdmissionReview request -> (AdmissionReview response, decision). Never raises. The same
    process serves tpuft_local.gke_environment's path (a separate stand-in) when given `gke_env`."""
    uid = ""
    try:
        request = _request(review)
        uid = str(request.get("uid", ""))
        if path == MUTATE_PATH:
            decision = decide_mutation(request, list_siblings, pending)
        elif path == VALIDATE_PATH:
            decision = decide_validation(request)
        elif path == gke_environment.MUTATE_PATH and gke_env:
            patch = gke_environment.mutate_pod(request.get("object") or {}, gke_env)
            decision = Decision(True, patch=tuple(patch), detail=f"GKE environment: {len(patch)} env op(s)")
        else:
            raise Refusal(f"unknown webhook path {path!r}: use {MUTATE_PATH} or {VALIDATE_PATH}")
    except Refusal as e:
        decision = Decision(False, str(e), detail=str(e))
    except Exception as e:  # odd input must answer, never crash the handler
        decision = Decision(False, f"kuberay-tpu-webhook stand-in could not read the object: {type(e).__name__}: {e}",
                            detail=f"{type(e).__name__}")
    return review_response(uid, decision), decision


# --- Registration and certificates ------------------------------------------------------------
def webhook_configurations(base_url: str, ca_bundle: bytes | str, *, namespace: str = "ray-system",
                           timeout_seconds: int = 5) -> tuple[dict, dict]:
    """(MutatingWebhookConfiguration, ValidatingWebhookConfiguration) for a webhook served at
    `base_url` (https://IP:PORT; a host process, hence clientConfig.url and not a Service).

    Names, rules and selectors are the real chart's; failurePolicy Fail is its (implicit)
    default, so a webhook that is down blocks TPU pods instead of letting them start
    unconfigured. RayClusters are checked on UPDATE too (the real chart: CREATE only)."""
    if not base_url.startswith("https://"):
        raise ValueError(f"webhook base_url must be https:// (got {base_url!r}): the API server calls only TLS webhooks")
    pem = ca_bundle.encode() if isinstance(ca_bundle, str) else ca_bundle
    common = {
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Fail",
        "timeoutSeconds": timeout_seconds,
        "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                    "values": ["kube-system", "kube-node-lease"]}]},
    }

    def client(path: str) -> dict:
        return {"url": base_url.rstrip("/") + path, "caBundle": base64.b64encode(pem).decode()}

    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "kuberay-tpu-mutating-webhook-cfg"},
        "webhooks": [{**common, "name": f"kuberay-tpu-webhook.{namespace}.svc", "clientConfig": client(MUTATE_PATH),
                      "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                                 "resources": ["pods"], "scope": "Namespaced"}],
                      "objectSelector": {"matchLabels": dict(KUBERAY_POD_LABELS)}}],
    }
    validating = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "kuberay-tpu-validating-webhook-cfg"},
        "webhooks": [{**common, "name": f"raycluster-kuberay-tpu-webhook.{namespace}.svc",
                      "clientConfig": client(VALIDATE_PATH),
                      "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": ["ray.io"], "apiVersions": ["*"],
                                 "resources": ["rayclusters"], "scope": "Namespaced"}]}],
    }
    return mutating, validating


def mint_serving_cert(pki: Path, ip: str) -> tuple[Path, Path]:
    """pki/tpu-webhook-<ip>.{crt,key}: a serving cert for `ip`, signed by the cluster CA in
    `pki` (ca.crt/ca.key from kubepki.ensure_pki). Minted once per address; returns (crt, key)."""
    from tpuft_local import kubepki

    stem = "tpu-webhook-" + "".join(ch if ch.isalnum() else "_" for ch in ip)
    return kubepki.issue(pki, stem, "kuberay-tpu-webhook", server_ips=(ip,), client=False)


# --- HTTPS server ------------------------------------------------------------------------------
MAX_BODY = 8 * 1024 * 1024


def kube_sibling_lister(kubeconfig: str | None) -> SiblingLister:
    """List a group's pods from the API server (as plain JSON dicts, camelCase like the wire)."""
    from kubernetes import client, config

    core = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))

    def list_siblings(namespace: str, cluster: str, group: str) -> list[dict]:
        resp = core.list_namespaced_pod(namespace, label_selector=f"{CLUSTER_LABEL}={cluster},{GROUP_LABEL}={group}",
                                        _preload_content=False, _request_timeout=3)
        return json.loads(resp.data).get("items") or []

    return list_siblings


def _subject(path: str, review: object) -> str:
    """'CREATE Pod ns/name' for the log line (generateName* for pods named by the API server)."""
    request = review.get("request") if isinstance(review, dict) else None
    if not isinstance(request, dict):
        return f"{path} (no request)"
    meta = (request.get("object") or {}).get("metadata") or {}
    name = request.get("name") or meta.get("name") or (meta.get("generateName", "") + "*")
    kind = (request.get("kind") or {}).get("kind", "?")
    return f"{request.get('operation', '?')} {kind} {request.get('namespace', '')}/{name}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: WebhookServer.HTTPServer
    timeout = 10  # seconds per socket read: a stalled client cannot hold a thread

    def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
        self._reply(200, b"kuberay-tpu-webhook", "text/plain")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            return self._reply(400, b"Error decoding request body", "text/plain")
        try:
            review = json.loads(self.rfile.read(length))
        except ValueError:
            return self._reply(400, b"Error decoding request body", "text/plain")
        hook = self.server.hook
        with hook.lock:  # one admission at a time, so two pods never get the same slot
            body, decision = answer(path, review, hook.list_siblings, hook.pending, hook.gke_env)
        verdict = "allowed" if decision.allowed else "DENIED"
        log.info("%s %s: %s", _subject(path, review), verdict, decision.detail or decision.message)
        self._reply(200, json.dumps(body).encode(), "application/json")

    def _reply(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:  # one line per decision is logged instead
        pass


@dataclass
class WebhookServer:
    """The stand-in on `host:port` over TLS, serving /mutate and /validate on its own thread."""

    host: str
    port: int
    cert: Path
    key: Path
    list_siblings: SiblingLister = _no_siblings
    pending: PendingSlots = field(default_factory=PendingSlots)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gke_env: dict[str, str] = field(default_factory=dict)   # tpuft_local.gke_environment's variables

    class HTTPServer(http.server.ThreadingHTTPServer):
        daemon_threads = True
        hook: WebhookServer

    def __post_init__(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        self._httpd = self.HTTPServer((self.host, self.port), _Handler)
        self._httpd.hook = self
        # Handshake in the handler thread (first read), not in the accept loop.
        self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    def start(self) -> WebhookServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tpu-webhook", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread:
            self._thread.join(timeout=5)

    def __enter__(self) -> WebhookServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"--listen wants IP:PORT, e.g. 10.88.0.1:9443 (got {value!r})")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tpuft_local.tpu_webhook", description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_listen, required=True, help="IP:PORT to serve HTTPS on")
    p.add_argument("--cert", type=Path, required=True, help="serving certificate (PEM)")
    p.add_argument("--key", type=Path, required=True, help="its private key (PEM)")
    p.add_argument("--kubeconfig", required=True, help="kubeconfig for listing a TPU group's pods")
    p.add_argument("--gke-env", action="append", default=[], metavar="NAME=VALUE",
                   help=f"also serve {gke_environment.MUTATE_PATH}, adding this variable to Ray pods (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tpu-webhook %(levelname)s %(message)s")
    server = WebhookServer(*args.listen, args.cert, args.key, kube_sibling_lister(args.kubeconfig),
                           gke_env=gke_environment.parse_env(args.gke_env))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with server:
        log.info("LOCAL STAND-IN for the KubeRay TPU webhook serving %s (%s, %s)", server.url, MUTATE_PATH, VALIDATE_PATH)
        stop.wait()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
