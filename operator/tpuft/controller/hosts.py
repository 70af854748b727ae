"""A running slice's hosts, watched: which of its pods is lost, which node under it has a GKE
maintenance notice, how many of its slices are whole. Pure: handlers keep the pods (label
tpufinetune.dev/name, ray.io/cluster) and the nodes that are not Ready or carry a notice in kopf
indexes; this reads them.

A loss is judged against the pods the slice was found whole with (`status.recovery.slicePods`, their
UIDs): one of them terminating, ended, not Ready or gone, or a pod of the cluster not among them (KubeRay
replaced one between two reconciles) is a lost host. So a loss is seen once, however fast the
replacement came, and not through KubeRay's ready count, which counts a terminating pod ready until its
container exits.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tpuft.controller.diagnosis import PodObs

# GKE's maintenance notices on a node (GKE's documentation, "Monitor maintenance events"; the same
# names in GKE's node-problem tooling): an upcoming host maintenance (Unix seconds of its window's
# start), one under way, and the taint GKE puts on a node it is about to terminate.
GKE_SCHEDULED_MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"
GKE_ACTIVE_MAINTENANCE_LABEL = "cloud.google.com/active-node-maintenance"
GKE_IMPENDING_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
ENDED_POD_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class NodeObs:
    """A node as the operator keeps it: only one that is not Ready or has a maintenance notice."""
    name: str
    ready: bool | None = None
    not_ready: str = ""   # the Ready condition's reason and message when not True
    notice: str = ""      # a maintenance notice, in GKE's labels' and taints' words

    @classmethod
    def of(cls, node: Mapping[str, Any]) -> NodeObs:
        meta, status = node.get("metadata") or {}, node.get("status") or {}
        ready: Mapping[str, Any] = next((x for x in status.get("conditions") or [] if x.get("type") == "Ready"), {})
        state = {"True": True, "False": False}.get(ready.get("status") or "")
        detail = " ".join(x for x in (ready.get("reason"), ready.get("message")) if x)
        return cls(meta.get("name") or "", state, detail if state is not True else "",
                   notice(meta.get("labels") or {}, (node.get("spec") or {}).get("taints") or []))

    @property
    def noteworthy(self) -> bool:
        """Worth keeping in the index: a node that is Ready and has no notice is the normal case."""
        return self.ready is False or bool(self.notice)


def notice(labels: Mapping[str, str], taints: Iterable[Mapping[str, Any]]) -> str:
    """A node's maintenance notice, in GKE's words ("" when none)."""
    found = []
    if any(t.get("key") == GKE_IMPENDING_TERMINATION_TAINT for t in taints):
        found.append(f"taint {GKE_IMPENDING_TERMINATION_TAINT} (GKE is about to terminate the node)")
    if str(labels.get(GKE_ACTIVE_MAINTENANCE_LABEL, "")).lower() == "true":
        found.append(f"{GKE_ACTIVE_MAINTENANCE_LABEL}=true (host maintenance under way)")
    if (when := labels.get(GKE_SCHEDULED_MAINTENANCE_LABEL)):
        found.append(f"{GKE_SCHEDULED_MAINTENANCE_LABEL}={when} (host maintenance scheduled)")
    return "; ".join(found)


def up(pod: PodObs) -> bool:
    """Running and Ready, and not told to stop."""
    return not pod.deleting and pod.phase == "Running" and pod.ready is True


def of_cluster(pods: Iterable[PodObs], cluster_uid: str | None) -> tuple[PodObs, ...]:
    """The RayCluster's own pods (head and workers; not the RayJobs' submitter pods), by name."""
    return tuple(sorted((p for p in pods if cluster_uid and p.cluster_uid == cluster_uid), key=lambda p: p.name))


def whole(pods: tuple[PodObs, ...], expected: int) -> tuple[str, ...] | None:
    """The UIDs of the cluster's pods when exactly `expected` of them run, each Ready and none
    terminating (the record a later loss is judged against); None otherwise."""
    if len(pods) != expected or not all(up(p) and p.uid for p in pods):
        return None
    return tuple(sorted(p.uid for p in pods))


@dataclass(frozen=True)
class Loss:
    cause: str
    # The pod was told to stop and still runs: its preStop hook has the Ray Train workers save the
    # step's checkpoint and end, so the run's job ends by itself (stopping it now would cut the save).
    stopping: bool = False


def lost(recorded: tuple[str, ...], pods: tuple[PodObs, ...], nodes: Mapping[str, NodeObs]) -> Loss | None:
    """The first lost host of a slice recorded whole (`recorded`: its pods' UIDs), or None. A pod not
    recorded is no loss by itself (training on fewer slices, the lost slice's pods come up)."""
    if not recorded:
        return None
    by_uid = {p.uid: p for p in pods}
    for pod in pods:
        if pod.uid not in recorded:
            continue
        where = f"pod {pod.name}" + (f" on node {pod.node}" if pod.node else "")
        if pod.deleting:
            return Loss(f"{where} is being deleted", stopping=pod.phase == "Running")
        if pod.phase in ENDED_POD_PHASES:
            return Loss(f"{where} ended ({pod.phase})")
        node = nodes.get(pod.node)
        if node is not None and node.ready is False:
            return Loss(f"{where}: the node is not Ready" + (f" ({node.not_ready})" if node.not_ready else ""))
        if pod.ready is False:
            return Loss(f"{where} is not Ready" + (f" ({pod.not_ready})" if pod.not_ready else ""))
    gone = [uid for uid in recorded if uid not in by_uid]
    if gone and (new := [p.name for p in pods if p.uid not in recorded and not p.deleting]):
        return Loss(f"pod {new[0]} replaced one of the slice's pods since the slice was last whole")
    if gone:
        return Loss(f"{len(gone)} pod(s) of the slice are gone (deleted, or their node removed)")
    return None


def maintenance(pods: tuple[PodObs, ...], nodes: Mapping[str, NodeObs]) -> tuple[str, str] | None:
    """The nodes under the slice with a GKE maintenance notice and their notices, each joined by
    "; " in node order (one checkpoint per change of this pair), or None."""
    noticed = [(name, nodes[name].notice) for name in sorted({p.node for p in pods if p.node})
               if name in nodes and nodes[name].notice]
    if not noticed:
        return None
    return ", ".join(n for n, _ in noticed), "; ".join(f"{n}: {text}" if len(noticed) > 1 else text
                                                      for n, text in noticed)


def whole_slices(pods: tuple[PodObs, ...], hosts_per_slice: int, replica_per_slice: bool) -> int:
    """How many slices have every host running and Ready. replica_per_slice (TPU): a slice is named by
    its TPU_NAME (one per worker group replica, also where each slice has a worker group of its own),
    else by KubeRay's replica index label; otherwise (a CPU rehearsal, one replica per host) any
    hosts_per_slice Ready workers make a slice, as Ray Train places ranks."""
    workers = [p for p in pods if not p.is_head and up(p)]
    keys: list[object] = ([p.slice_name for p in workers] if all(p.slice_name for p in workers)
                          else [p.replica_index for p in workers])
    if replica_per_slice and workers and all(k is not None for k in keys):
        return sum(1 for n in Counter(keys).values() if n >= hosts_per_slice)
    return len(workers) // max(hosts_per_slice, 1)


def ready_workers(pods: tuple[PodObs, ...]) -> int:
    """Workers running and Ready, none told to stop (KubeRay counts a terminating pod ready until it exits)."""
    return sum(1 for p in pods if not p.is_head and up(p))


def head_ready(pods: tuple[PodObs, ...]) -> bool:
    return any(p.is_head and up(p) for p in pods)
