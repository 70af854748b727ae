"""Why a slice is not coming up, from its pods: the first blocking cause, in the words of the
component that knows (the scheduler, the kubelet's image pull, the container's last exit); and
which of a running slice's containers the kernel's OOM killer ended (PodObs.oom_killed).
Pure: handlers list the pods (Kube.slice_pods), this reads them.

Kubernetes already writes every cause onto the pod itself: the scheduler into the PodScheduled
condition (the same text as its FailedScheduling Event), the kubelet into each container's
`state.waiting` (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, CrashLoopBackOff)
and `lastState.terminated`. So one list of pods answers what `kubectl describe pod` would.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from tpuft.api import gke
from tpuft.api import kuberay

MAX_DETAIL = 400   # characters of one component's message kept in status (they can be long)


class Blocker(str, enum.Enum):
    """Kinds of cause, most decisive first: a pod that cannot pull its image will never run,
    wherever it is scheduled; a crash loop is the image's own fault; unschedulable may clear."""
    IMAGE = "image"
    CONFIG = "config"
    CRASH = "crash"
    UNSCHEDULABLE = "unschedulable"


IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
CRASH_REASON = "CrashLoopBackOff"
OOM_KILLED_REASON = "OOMKilled"   # the kubelet's terminated.reason for a container the kernel's OOM killer ended
# Where a pod sits in its worker group: KubeRay >= 1.5 (RayMultiHostIndexing) labels the group
# replica and the host within it; without them, the TPU webhook's `replicaIndex: {group}-{replica}`
# label and the TPU_WORKER_ID it sets in the container's env.
KUBERAY_REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
KUBERAY_HOST_INDEX_LABEL = "ray.io/replica-host-index"
TPU_WORKER_ID_ENV = "TPU_WORKER_ID"
HEAD_NODE_TYPE = "head"   # KubeRay's ray.io/node-type on the head pod (workers: "worker")


@dataclass(frozen=True)
class Waiting:
    """A container the kubelet cannot get running, as containerStatuses[].state.waiting says."""
    container: str
    image: str
    reason: str
    message: str = ""
    last_exit: str = ""   # lastState.terminated, for a crash loop: "exit code 1: <message or reason>"


@dataclass(frozen=True)
class OomKilled:
    """A container the kernel's OOM killer ended: containerStatuses[].state.terminated, or
    lastState.terminated once the kubelet has restarted it, with reason OOMKilled."""
    container: str
    finished_at: str = ""   # terminated.finishedAt, as the kubelet wrote it
    memory_limit: str = ""  # the container's resources.limits.memory in the pod's spec ("" if none)


@dataclass(frozen=True)
class PodObs:
    """One of the RayCluster's pods (label ray.io/cluster), reduced to what diagnosis needs."""
    name: str
    cluster_uid: str | None = None      # the owning RayCluster's UID (ownerReferences)
    deleting: bool = False
    unschedulable: str | None = None    # the PodScheduled=False message the scheduler wrote
    waiting: tuple[Waiting, ...] = ()
    node_type: str = ""                 # label ray.io/node-type: head or worker
    ip: str = ""                        # status.podIP: the Ray node's address in Ray's messages
    replica_index: int | None = None    # its worker group replica (KUBERAY_REPLICA_INDEX_LABEL)
    host_index: int | None = None       # its host within that replica (KUBERAY_HOST_INDEX_LABEL)
    memory_limit: str = ""              # the Ray container's (KubeRay's first) resources.limits.memory
    oom_killed: tuple[OomKilled, ...] = ()
    uid: str = ""                       # metadata.uid: a replaced pod has a new one, whatever its name
    node: str = ""                      # spec.nodeName ("" until scheduled)
    phase: str = ""                     # status.phase: Pending, Running, Succeeded, Failed
    ready: bool | None = None           # the Ready condition (None: not reported yet)
    not_ready: str = ""                 # Ready=False: its reason and message (the node lifecycle controller's when the node is lost)
    slice_name: str = ""                # TPU_NAME in its env: its slice's name, the TPU webhook's `{group}-{replica}`
                                        # or the operator's where each slice has a worker group (Kueue TAS)

    @property
    def is_head(self) -> bool:
        return self.node_type == HEAD_NODE_TYPE

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodObs:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        owners = [o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("kind") == kuberay.RAYCLUSTER_KIND]
        conditions = status.get("conditions") or []
        sched: Mapping[str, Any] = next((x for x in conditions if x.get("type") == "PodScheduled"), {})
        unschedulable = (sched.get("message") or sched.get("reason") or "unschedulable"
                         if sched.get("status") == "False" and sched.get("reason") == "Unschedulable" else None)
        labels, containers = meta.get("labels") or {}, (pod.get("spec") or {}).get("containers") or []
        images = {x.get("name"): x.get("image") or "" for x in containers}
        statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        waiting = tuple(_waiting(x, images) for x in statuses
                        if ((x.get("state") or {}).get("waiting") or {}).get("reason"))
        replica, host = _place(labels, containers)
        limits = {x.get("name") or "": _memory_limit(x) for x in containers}
        ready: Mapping[str, Any] = next((x for x in conditions if x.get("type") == "Ready"), {})
        return cls(meta.get("name") or "", owners[0] if owners else None, bool(meta.get("deletionTimestamp")),
                   unschedulable, waiting, labels.get(kuberay.RAY_NODE_TYPE_LABEL) or "", status.get("podIP") or "",
                   replica, host, next(iter(limits.values()), ""), _oom_killed(statuses, limits),
                   meta.get("uid") or "", (pod.get("spec") or {}).get("nodeName") or "", status.get("phase") or "",
                   {"True": True, "False": False}.get(ready.get("status") or ""),
                   " ".join(x for x in (ready.get("reason"), ready.get("message")) if x) if ready.get("status") == "False"
                   else "", _env_value(containers, gke.TPU_NAME_ENV))


def _waiting(cs: Mapping[str, Any], images: Mapping[str, str]) -> Waiting:
    w = cs["state"]["waiting"]
    last = (cs.get("lastState") or {}).get("terminated") or {}
    name = cs.get("name") or ""
    last_exit = (f"exit code {last.get('exitCode')}: {(last.get('message') or last.get('reason') or '').strip()}"
                 if last else "")
    return Waiting(name, cs.get("image") or images.get(name, ""), w["reason"],
                   (w.get("message") or "").strip(), last_exit)


def _index(text: Any) -> int | None:
    return int(text) if isinstance(text, str) and text.isdigit() else None


def _trailing_index(name: Any) -> int | None:
    """The index a name ends in (`{group}-{i}`: the TPU webhook's replicaIndex label, a slice's TPU_NAME)."""
    return _index(str(name or "").rpartition("-")[2])


def _place(labels: Mapping[str, str], containers: list[Mapping[str, Any]]) -> tuple[int | None, int | None]:
    """(worker group replica, host within it) from KubeRay's index labels, else the TPU webhook's."""
    replica, host = _index(labels.get(KUBERAY_REPLICA_INDEX_LABEL)), _index(labels.get(KUBERAY_HOST_INDEX_LABEL))
    if replica is None:
        replica = _trailing_index(labels.get(gke.TPU_WEBHOOK_REPLICA_LABEL))
    if host is None:
        host = _index(_env_value(containers, TPU_WORKER_ID_ENV))
    return replica, host


def _env_value(containers: list[Mapping[str, Any]], name: str) -> str:
    """The first value set for environment variable `name` in the containers ("" where none is)."""
    return next((str(e.get("value") or "") for x in containers for e in x.get("env") or [] if e.get("name") == name), "")


def _memory_limit(container: Mapping[str, Any]) -> str:
    return str(((container.get("resources") or {}).get("limits") or {}).get("memory") or "")


def _oom_killed(statuses: list[Mapping[str, Any]], limits: Mapping[str, str]) -> tuple[OomKilled, ...]:
    out = []
    for cs in statuses:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            ended = state.get("terminated") or {}
            if ended.get("reason") == OOM_KILLED_REASON:
                name = cs.get("name") or ""
                out.append(OomKilled(name, ended.get("finishedAt") or "", limits.get(name, "")))
                break   # the current state first: a restarted container's lastState is older
    return tuple(out)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL - 3] + "..."


def _causes(pod: PodObs) -> list[tuple[Blocker, str]]:
    out = []
    for w in pod.waiting:
        if w.reason in IMAGE_REASONS:
            out.append((Blocker.IMAGE, f"pod {pod.name}: image {w.image} cannot be pulled ({w.reason})"
                        + (f": {_clip(w.message)}" if w.message else "")))
        elif w.reason in CONFIG_REASONS:
            out.append((Blocker.CONFIG, f"pod {pod.name}: container {w.container} cannot start ({w.reason})"
                        + (f": {_clip(w.message)}" if w.message else "")))
        elif w.reason == CRASH_REASON:
            out.append((Blocker.CRASH, f"pod {pod.name}: container {w.container} keeps crashing ({w.reason}"
                        + (f", last {_clip(w.last_exit)}" if w.last_exit else "") + ")"))
    if pod.unschedulable:
        out.append((Blocker.UNSCHEDULABLE, f"pod {pod.name} cannot be scheduled: the scheduler says: "
                    f"{_clip(pod.unschedulable)}"))
    return out


def blocking(pods: tuple[PodObs, ...]) -> tuple[Blocker, str] | None:
    """The most decisive cause among the pods (ties: the first pod by name), or None when nothing
    blocks yet (pods still being created, images still pulling, Ray still starting)."""
    order = list(Blocker)
    found = [(order.index(kind), pod.name, kind, text) for pod in pods if not pod.deleting
             for kind, text in _causes(pod)]
    return min(found)[2:] if found else None


def blocking_cause(pods: tuple[PodObs, ...]) -> str | None:
    cause = blocking(pods)
    return cause[1] if cause else None


def pool_hint(pools: tuple[tuple[str, str, int], ...], accelerator: str | None, topology: str,
              hosts: int = 1, slices: int = 1) -> str:
    """For a slice the scheduler cannot place: the TPU node pools the cluster has, as
    (cloud.google.com/gke-tpu-accelerator, cloud.google.com/gke-tpu-topology, nodes) seen on nodes,
    against the `hosts` per slice x `slices` the object needs."""
    if not pools:
        return f"no node here carries {gke.GKE_TPU_ACCELERATOR_SELECTOR} (no TPU node pool)"
    seen = ", ".join(f"{a} {t} ({n} node{'s' if n != 1 else ''})" for a, t, n in sorted(pools))
    nodes = sum(n for a, t, n in pools if a == accelerator and t == topology)
    if nodes and nodes < hosts * slices:
        return (f"TPU node pools here: {seen}; {slices} slice{'s' if slices != 1 else ''} of {accelerator} {topology} "
                f"need {hosts * slices} hosts ({hosts} per slice, each slice its own node pool); the cluster has "
                f"{nodes}: add node pools or lower spec.slices")
    if nodes:
        return f"TPU node pools here: {seen}; the {accelerator} {topology} pool exists, so it lacks free capacity"
    return f"TPU node pools here: {seen}; none is {accelerator} {topology}"


def leftovers(pods: tuple[PodObs, ...], own_cluster_uids: frozenset[str]) -> tuple[str, ...]:
    """Pods carrying this RayCluster's name but owned by another (an earlier object of the same
    name, still being garbage-collected). KubeRay selects a cluster's pods by that label alone,
    so a RayCluster created beside them would take the old head for its own."""
    return tuple(sorted(p.name for p in pods if p.cluster_uid not in own_cluster_uids))


def host_of(pod: PodObs, hosts_per_slice: int, hosts_per_replica: int) -> str:
    """Where a worker pod sits: "host H of slice S", from its slice's name (TPU_NAME ends in the
    slice's index) or its replica index, its host index, and the shape (a TPU slice is one group
    replica of hosts_per_replica hosts; on CPU each host is a replica of one); "" where they do not say."""
    slice_index = _trailing_index(pod.slice_name)
    if slice_index is not None and pod.host_index is not None:
        return f"host {pod.host_index} of slice {slice_index}"
    if pod.replica_index is None or (pod.host_index is None and hosts_per_replica > 1) or hosts_per_slice < 1:
        return ""
    n = pod.replica_index * hosts_per_replica + (pod.host_index or 0)
    return f"host {n % hosts_per_slice} of slice {n // hosts_per_slice}"
