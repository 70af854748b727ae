"""One level-based reconcile of one TPUFinetune (the work queue's handler; handlers.py wires them):

  * the TPUFinetune from the index, with the status keys the operator owns overlaid by what this
    process last wrote until the index catches up (tpuft.controller.ledger; no GET per reconcile: an idle
    resync makes no API request);
  * observe its children (CHILD_KINDS, from the index; an expected child missing from the index is
    confirmed with a GET), phases.decide, perform the actions idempotently (create -> 409 -> adopt
    if ours), write status ONCE via the status subresource when it changed (operator keys only),
    post Events.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Collection, Mapping, Sequence

from tpuft.controller import builders, diagnosis, metrics, phases
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.hosts import NodeObs, of_cluster
from tpuft.controller.kube import Kube, KubeError, Rejected
from tpuft.controller.ledger import Ledger
from tpuft.controller.observed import (CHILD_KINDS, AdmissionError, Decision, Event, IndexedChild, Observed, Op, PeerObs, live,
                            parse_time, section)
from tpuft.controller.settings import Settings
from tpuft.api.status import RunStatus, owned

log = logging.getLogger("tpuft.operator")
Key = tuple[str, str]
Children = Mapping[str, Sequence[IndexedChild]]   # kind -> the owned children the index holds


@dataclass(frozen=True)
class Snapshot:
    """One key's entries in the indexes, copied: what one reconcile reads."""
    body: dict | None
    children: Children
    pods: tuple[PodObs, ...] = ()                 # its RayClusters' pods (frozen: no copy needed)
    nodes: Mapping[str, NodeObs] = field(default_factory=dict)   # those pods' nodes that are noteworthy
    # The other TPUFinetunes of its namespace, not being deleted: read only for a base (spec.serve.adapters)
    # or a fine-tune that publishes to one (spec.publish); None: not read.
    peers: tuple[PeerObs, ...] | None = None


def shares_a_base(body: Mapping[str, Any]) -> bool:
    """Whether an object's decision reads the other TPUFinetunes of its namespace: it publishes to a base,
    or it is one."""
    spec = section(body, "spec")
    return spec.get("publish") is not None or section(spec, "serve").get("adapters") is not None


@dataclass(frozen=True)
class Indexes:
    """kopf's indexes as the reconciler reads them: the TPUFinetunes by key (one body each), and
    each child kind's children by their owner's key."""
    objects: Mapping[Key, Any]
    children: Mapping[str, Mapping[Key, Any]]   # ChildKind.kind -> index
    pods: Mapping[Key, Any] = field(default_factory=dict)    # handlers.POD_INDEX
    nodes: Mapping[str, Any] = field(default_factory=dict)   # handlers.NODE_INDEX

    @classmethod
    def empty(cls) -> Indexes:
        return cls({}, {kind.kind: {} for kind in CHILD_KINDS})

    def snapshot(self, key: Key) -> Snapshot:
        body = next(iter(self.objects.get(key, [])), None)
        children = {kind: [copy.deepcopy(x) for x in index.get(key, [])] for kind, index in self.children.items()}
        pods = tuple(self.pods.get(key, ()))
        nodes = {p.node: node for p in pods if p.node and (node := next(iter(self.nodes.get(p.node, ())), None))}
        peers = None
        if body is not None and shares_a_base(body):
            peers = tuple(PeerObs.of(other) for k, store in list(self.objects.items())
                          if k[0] == key[0] and k != key and (other := next(iter(store), None)) is not None
                          and not (other.get("metadata") or {}).get("deletionTimestamp"))
        return Snapshot(copy.deepcopy(body), children, pods, nodes, peers)


class Reconciler:
    def __init__(self, kube: Kube, settings: Settings, indexes: Indexes | None = None):
        self.kube, self.settings, self.tunables = kube, settings, settings.tunables()
        self.indexes = indexes if indexes is not None else Indexes.empty()
        self.ledger = Ledger()   # per key: what bridges the index's lag, the last error posted
        self._pools: tuple[float, tuple | None] | None = None   # (when, Kube.node_pools())

    # --- the work queue's side (tpuft.controller.workqueue), on the event loop -----------------------------------
    async def handle(self, key: Key) -> float | None:
        started = time.perf_counter()
        try:
            requeue = await asyncio.to_thread(self.reconcile, key, self.indexes.snapshot(key))
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(result="ok").inc()
        return requeue

    def failed(self, key: Key, error: Exception, attempt: int, retry_in: float) -> None:
        if isinstance(error, KubeError):
            log.warning("reconcile tft=%s/%s failed attempt=%d retry_in=%.0fs error=%s", *key, attempt, retry_in, error)
            metrics.RECONCILES.labels(result="retry").inc()
        else:  # a bug: log it loudly; the queue keeps the operator alive and backs off
            log.error("reconcile tft=%s/%s crashed attempt=%d", *key, attempt, exc_info=error)
            metrics.RECONCILES.labels(result="error").inc()

    # Everything below runs in a worker thread: plain blocking API calls.
    def observe(self, obj: dict, children: Children, pods: tuple[PodObs, ...] = (),
                nodes: Mapping[str, NodeObs] | None = None, peers: tuple[PeerObs, ...] | None = None) -> Observed:
        ns, uid = obj["metadata"]["namespace"], obj["metadata"].get("uid")
        # Children we deleted: after a relist (410) kopf's index can keep them forever (it never
        # sees their DELETED event), so they are confirmed with a GET.
        removed = self.ledger.removed((ns, obj["metadata"]["name"]))
        named = (obj.get("status") or {}).get("children") or {}
        fields = {}
        for kind in CHILD_KINDS:
            names = tuple(named.get(k) for k in kind.expected)
            found = live(children.get(kind.kind, ()), kind.kind, uid, removed)
            for name in names:
                if name and name not in found and (entry := self._confirm(kind.kind, ns, name, uid)) is not None:
                    found[name] = entry
            fields[kind.field] = kind.observe(found, names)
        observed = Observed(**fields)
        if peers is not None:
            observed = dataclasses.replace(observed, **neighbours(obj, peers))
        if observed.cluster is not None:
            observed = dataclasses.replace(observed, hosts=of_cluster(pods, observed.cluster.uid),
                                           nodes=dict(nodes or {}))
            jobs = children.get(kuberay.RAYJOB_KIND, ())
            observed = dataclasses.replace(observed, jobs_deleting=self._deleting_jobs(ns, jobs, removed, uid))
        cluster = observed.cluster
        if phases.wants_queue(obj, cluster) and cluster is not None and cluster.uid:
            observed = dataclasses.replace(observed, queue=self.kube.queue(ns, cluster.uid))
        if phases.wants_serve_pods(obj):
            return self._with_serve_pods(observed, obj)
        clusters = children.get(kuberay.RAYCLUSTER_KIND, ())
        if phases.wants_pods(obj):
            return self._with_pods(observed, obj, clusters)
        return self._with_failure_pods(observed, obj) if phases.wants_failure_pods(obj, observed) else observed

    def _deleting_jobs(self, ns: str, jobs: Sequence[IndexedChild], removed: Collection[tuple[str, str]],
                       uid: str | None) -> tuple[str, ...]:
        """RayJobs of ours on their way out: the index shows them deleting, or we deleted them and
        it has not caught up. Each is confirmed with a GET (after a re-list the index can keep them
        forever); only while there is a RayCluster they could hold."""
        names = sorted({x.name for x in jobs if x.belongs_to(uid) and (x.deleting or (kuberay.RAYJOB_KIND, x.name) in removed)})
        return tuple(name for name in names if self.kube.get(kuberay.RAYJOB_KIND, ns, name) is not None)

    def _with_serve_pods(self, observed: Observed, obj: dict) -> Observed:
        """While the Serve app is not RUNNING: the serving cluster's pods (an image that does not
        pull, a pod that does not fit), listed at most once per pod_list_seconds."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        key = (ns, name)
        pods = self.ledger.pods(key, time.monotonic(), self.settings.pod_list_seconds)
        if pods is None:
            pods = self.kube.pods(ns, f"{c.LABEL_NAME}={name},{c.LABEL_COMPONENT}={c.Component.SERVE.value}")
            self.ledger.listed_pods(key, time.monotonic(), pods)
        return dataclasses.replace(observed, pods=tuple(pods or ()))

    def _with_pods(self, observed: Observed, obj: dict, clusters: Sequence[IndexedChild]) -> Observed:
        """While the slice comes up: its pods (a stall's cause) and whatever an earlier object of
        this name left (its RayCluster, its pods), which must go before we create ours."""
        ns, uid = obj["metadata"]["namespace"], obj["metadata"].get("uid")
        name = builders.cluster_name(obj["metadata"]["name"])
        ours = frozenset(u for u in [x.uid for x in clusters if x.name == name and x.belongs_to(uid) and not x.deleting]
                         + [observed.cluster.uid if observed.cluster else None] if u is not None)
        old = tuple(f"RayCluster {x.name}" for x in clusters if x.name == name and not x.belongs_to(uid))
        key = (ns, obj["metadata"]["name"])
        pods = self.ledger.pods(key, time.monotonic(), self.settings.pod_list_seconds)
        listed = pods is None
        if listed:
            pods = self.kube.slice_pods(ns, name)
        stale = diagnosis.leftovers(pods or (), ours)
        if listed:   # leftovers are waited on: each look at them is fresh, never a reused list
            self.ledger.listed_pods(key, time.monotonic(), pods if pods is not None and not old and not stale else None)
            pods = pods or ()
        mine = tuple(p for p in pods or () if p.cluster_uid in ours)
        found = diagnosis.blocking(mine)
        pools = self._node_pools() if found and found[0] == diagnosis.Blocker.UNSCHEDULABLE else None
        return dataclasses.replace(observed, pods=mine, pools=pools,
                                   leftovers=old + tuple(f"pod {p}" for p in stale))

    def _with_failure_pods(self, observed: Observed, obj: dict) -> Observed:
        """A job failed or a host was lost under a running slice: its pods, listed fresh each time (a
        list kept from before the failure would not show a container killed for memory since)."""
        cluster = observed.cluster
        assert cluster is not None   # phases.wants_failure_pods
        pods = self.kube.slice_pods(obj["metadata"]["namespace"], cluster.name) or ()
        return dataclasses.replace(observed, pods=tuple(p for p in pods if cluster.uid is None
                                                        or p.cluster_uid == cluster.uid))

    def _node_pools(self) -> tuple | None:
        """The cluster's TPU node pools, one list of nodes per POOLS_CACHE_SECONDS for all objects."""
        now = time.monotonic()
        if self._pools is None or now - self._pools[0] >= c.POOLS_CACHE_SECONDS:
            self._pools = (now, self.kube.node_pools())
        return self._pools[1]

    def _confirm(self, kind: str, ns: str, name: str, uid: str | None) -> IndexedChild | None:
        """The index has not seen it (yet): ask the API server before believing it is gone."""
        obj = self.kube.get(kind, ns, name)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return None
        entry = IndexedChild.of(name, obj.get("spec"), obj.get("status"), obj.get("metadata") or {})
        return entry if entry.belongs_to(uid) else None

    def reconcile(self, key: Key, snap: Snapshot) -> float | None:
        """Returns the seconds until the decision wants another look (None: at the resync)."""
        obj = self._current(key, snap.body)
        if obj is None:
            return None
        ns, name = key
        now = datetime.now(timezone.utc)
        observed = self.observe(obj, snap.children, snap.pods, snap.nodes, snap.peers)
        decision = phases.decide(obj, observed, now, self.tunables)
        uid = obj["metadata"].get("uid", "")
        decision, done = self._act(key, obj, observed, decision, now)
        self.ledger.clear_error(key)
        previous = RunStatus.of(obj.get("status"))
        if decision.patch:
            if not self._patch_status(key, decision.patch):   # 404: the object is gone
                self.ledger.mark_gone(key, uid)
                return None
            self.ledger.wrote(key, decision.status)
            metrics.STATUS_WRITES.inc()
        for event in decision.events:
            self.kube.post_event(obj, event)
        status = RunStatus.of(decision.status)
        self._phase_metrics(key, previous, status, now)
        if decision.patch or done:
            log.info("reconciled tft=%s/%s phase=%s->%s reason=%s actions=[%s] wrote=%s", ns, name,
                     previous.phase.value if previous.phase else "-", decision.phase, status.reason, ", ".join(done),
                     sorted(decision.patch or {}))
        return decision.requeue_after

    def _current(self, key: Key, body: dict | None) -> dict | None:
        """The object to decide on (the ledger's overlay on the index's copy), or None: nothing to do."""
        if body is None or body["metadata"].get("deletionTimestamp"):
            metrics.set_phase(key, None)   # children go with it: ownerReferences + garbage collector
            self.ledger.forget(key)
            return None
        if self.ledger.is_gone(key, body["metadata"].get("uid")):
            return None   # deleted while kopf's watch was re-listing: its index never dropped it
        if self.ledger.is_unsure(key):  # the index may lag a write whose answer we lost: deciding from it could go back
            fresh = self.kube.get(c.KIND, *key)
            if fresh is None:
                self.ledger.mark_gone(key, body["metadata"].get("uid"))
                return None
            body = fresh
            self.ledger.wrote(key, fresh.get("status") or {})   # until the index shows what the server has
        return self.ledger.overlay(key, body)

    def _act(self, key: Key, obj: dict, observed: Observed, decision: Decision,
             now: datetime) -> tuple[Decision, list[str]]:
        """Perform the decision's actions in order; an admission refusal stops them and is decided
        on (it becomes the status). Returns the decision to record and what was done."""
        ns, uid = key[0], obj["metadata"].get("uid", "")
        done: list[str] = []
        for action in decision.actions:
            try:
                result = self.kube.perform(ns, uid, action)
            except Rejected as r:
                log.warning("tft=%s/%s %s %s rejected: %s", *key, action.kind, action.name, r.api_message)
                rejected = dataclasses.replace(observed, admission_error=AdmissionError(r.kind, r.name, r.api_message))
                return phases.decide(obj, rejected, now, self.tunables), done
            except KubeError as e:
                self._note_error(key, obj, str(e), now)
                raise
            metrics.ACTIONS.labels(op=action.op.value, kind=action.kind).inc()
            if action.op == Op.DELETE:
                self.ledger.deleted_child(key, action.kind, action.name)
            elif action.op == Op.CREATE:
                self.ledger.created_child(key, action.kind, action.name)
            done.append(f"{action.op.value}:{action.kind}/{action.name}={result}")
        return decision, done

    def _patch_status(self, key: Key, patch: dict) -> bool:
        try:
            return self.kube.patch_status(key[0], key[1], patch)
        except KubeError:
            self.ledger.write_unsure(key)   # a timeout or a 5xx may come after the write was applied
            raise

    def _note_error(self, key: Key, obj: dict, error: str, now: datetime) -> None:
        patch = phases.note_error(obj, error, now)
        if patch:
            try:
                if self._patch_status(key, patch):
                    self.ledger.wrote(key, {**owned(obj.get("status")), **patch})
            except KubeError as e:
                log.warning("tft=%s/%s could not record error in status: %s", *key, e)
        if self.ledger.new_error(key, error):
            self.kube.post_event(obj, Event(c.EventType.WARNING, c.Reason.RECONCILE_ERROR, error))

    @staticmethod
    def _phase_metrics(key: Key, previous: RunStatus, status: RunStatus, now: datetime) -> None:
        before, after = previous.phase, status.phase
        if before != after:
            since = parse_time(previous.phase_transition_time)
            if before and since:
                metrics.PHASE_SECONDS.labels(phase=before.value).observe(max((now - since).total_seconds(), 0))
            if after == c.Phase.FAILED:
                metrics.FAILURES.labels(reason=status.reason or "Unknown").inc()
        metrics.set_phase(key, after.value if after else None)
        replaced = _slice_replacements(status) - _slice_replacements(previous)
        if replaced > 0:
            metrics.SLICE_REPLACEMENTS.inc(replaced)


def neighbours(obj: Mapping[str, Any], peers: tuple[PeerObs, ...]) -> dict[str, Any]:
    """Observed's fields read from the other TPUFinetunes of the namespace: a fine-tune's base and the
    adapters published to it; a base's adapters and which objects still exist."""
    publish = section(section(obj, "spec"), "publish")
    base_name = str(publish.get("to") or "") if publish else obj["metadata"]["name"]
    base = next((p for p in peers if p.name == base_name), None) if publish else None
    published = tuple(p.published for p in peers if p.published is not None and p.published.base == base_name)
    return {"base": base, "published": published, "live_uids": frozenset(p.uid for p in peers if p.uid)}


def _slice_replacements(status: RunStatus) -> int:
    return (status.recovery.slice_replacements if status.recovery else None) or 0
