"""kopf wiring: one level-based reconcile per TPUFinetune, driven by watch events and a resync.

    kopf run --standalone -m tpuft.handlers --all-namespaces | --namespace=NS

Nothing is ever written onto the TPUFinetune's metadata: there are no kopf change handlers,
timers or daemons (those need kopf's annotations or a finalizer, which GitOps tools see as
drift and which block deletion when the operator is gone). Instead:

  * `kopf.index` keeps the owned RayClusters / RayJobs (label tpufinetune.dev/name) and the
    TPUFinetune keys in memory; `kopf.on.event` on all three kinds queues the owner's key.
  * A small controller (started in `on.startup`, kept in kopf's `memo`) runs a work queue: at most one reconcile per
    key at a time, a resync of every key every Settings.resync_seconds (default 5) or sooner when
    the decision asks (a deadline), exponential backoff (1 s .. 60 s) after API errors.
  * reconcile: the TPUFinetune from the index, with the status keys the operator owns overlaid
    by what this process last wrote until the index catches up (tpuft.ledger; no GET per
    reconcile: an idle resync makes no API request); observe children (index; an expected child missing from the
    index is confirmed with a GET), phases.decide, perform the actions
    idempotently (create -> 409 -> adopt if ours), write status ONCE via the status subresource
    when it changed (operator keys only), post Events.

Settings: tpuft.settings (from the environment, read once in startup).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from datetime import datetime, timezone
from typing import Any, Sequence

import kopf

from tpuft import constants as c
from tpuft import builders, diagnosis, metrics, phases
from tpuft.kube import Kube, KubeError, Rejected, new_api_client
from tpuft.ledger import Ledger
from tpuft.observed import AdmissionError, ClusterObs, Event, IndexedChild, JobObs, Observed, Op, ServiceObs, owned, parse_time
from tpuft.settings import Settings

log = logging.getLogger("tpuft.operator")
Key = tuple[str, str]

BACKOFF_MIN, BACKOFF_MAX = 1.0, 60.0


# --- indexes and event handlers ----------------------------------------------------------------------
# The ignores: kopf's handler protocols type `namespace` as str | None (for cluster-scoped
# resources); every resource here is namespaced, so these handlers take a str.
@kopf.index(c.GROUP, c.VERSION, c.PLURAL)  # type: ignore[arg-type]
def tpufinetunes(namespace: str, name: str, body: Any, **_: Any) -> dict:
    """The object itself: the reconciler reads it from here (an informer cache), not with a GET."""
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.index(c.RAY_GROUP, c.RAY_VERSION, c.RAYCLUSTER_PLURAL, labels={c.LABEL_NAME: kopf.PRESENT})  # type: ignore[arg-type]
def rayclusters_by_owner(namespace: str, name: str, labels: Any, spec: Any, status: Any, meta: Any,
                         **_: Any) -> dict:
    return {(namespace, labels[c.LABEL_NAME]): IndexedChild.of(name, spec, status, meta)}


@kopf.index(c.RAY_GROUP, c.RAY_VERSION, c.RAYJOB_PLURAL, labels={c.LABEL_NAME: kopf.PRESENT})  # type: ignore[arg-type]
def rayjobs_by_owner(namespace: str, name: str, labels: Any, spec: Any, status: Any, meta: Any, **_: Any) -> dict:
    return {(namespace, labels[c.LABEL_NAME]): IndexedChild.of(name, spec, status, meta)}


@kopf.index(c.RAY_GROUP, c.RAY_VERSION, c.RAYSERVICE_PLURAL, labels={c.LABEL_NAME: kopf.PRESENT})  # type: ignore[arg-type]
def rayservices_by_owner(namespace: str, name: str, labels: Any, spec: Any, status: Any, meta: Any,
                         **_: Any) -> dict:
    return {(namespace, labels[c.LABEL_NAME]): IndexedChild.of(name, spec, status, meta)}


# The controller lives in kopf's memo (set by startup; resource handlers get copies of the
# operator's memo, made after startup, so they see it).
def _controller(memo: kopf.Memo) -> Controller | None:
    return memo.get("controller")


@kopf.on.event(c.GROUP, c.VERSION, c.PLURAL)  # type: ignore[arg-type]
async def tpufinetune_event(type: str | None, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    if (ctl := _controller(memo)) is not None:
        if type == "DELETED":
            metrics.set_phase((namespace, name), None)
        ctl.kick((namespace, name))


@kopf.on.event(c.RAY_GROUP, c.RAY_VERSION, c.RAYCLUSTER_PLURAL, labels={c.LABEL_NAME: kopf.PRESENT})  # type: ignore[arg-type]
async def raycluster_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    if (ctl := _controller(memo)) is not None:
        ctl.kick((namespace, labels[c.LABEL_NAME]))


@kopf.on.event(c.RAY_GROUP, c.RAY_VERSION, c.RAYJOB_PLURAL, labels={c.LABEL_NAME: kopf.PRESENT})  # type: ignore[arg-type]
async def rayjob_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    if (ctl := _controller(memo)) is not None:
        ctl.kick((namespace, labels[c.LABEL_NAME]))


@kopf.on.event(c.RAY_GROUP, c.RAY_VERSION, c.RAYSERVICE_PLURAL, labels={c.LABEL_NAME: kopf.PRESENT})  # type: ignore[arg-type]
async def rayservice_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    if (ctl := _controller(memo)) is not None:
        ctl.kick((namespace, labels[c.LABEL_NAME]))


# --- lifecycle ------------------------------------------------------------------------------------
@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    config = Settings.from_env()   # read at startup, not import: tests set the environment
    if config.log_level:
        logging.getLogger("tpuft").setLevel(config.log_level)
    settings.posting.level = logging.WARNING      # kopf's own k8s Events: only problems
    settings.watching.server_timeout = 300        # re-list at least every 5 minutes
    metrics.serve(config.metrics_port)
    ctl = Controller(Kube(new_api_client(), config.api_timeout_seconds), kwargs["tpufinetunes"],
                     kwargs["rayclusters_by_owner"], kwargs["rayjobs_by_owner"], config, kwargs["rayservices_by_owner"])
    ctl.start()
    memo["controller"] = ctl


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster ServiceAccount, else KUBECONFIG as set now (kopf's client-library login reads the
    kubernetes client's default path, which is fixed at import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    ctl = memo.pop("controller", None)
    if ctl is not None:
        await ctl.stop()


@kopf.on.probe(id="reconciler")
def probe(memo: kopf.Memo, **_: Any) -> dict:
    ctl = _controller(memo)
    return {"queued": len(ctl.queued), "busy": len(ctl.busy)} if ctl else {"queued": 0, "busy": 0}


# --- the controller ---------------------------------------------------------------------------------
class Controller:
    def __init__(self, kube: Kube, keys: Any, clusters: Any, jobs: Any, settings: Settings,
                 services: Any = None):
        self.kube, self.keys, self.clusters, self.jobs = kube, keys, clusters, jobs
        self.tun = settings.tunables()
        self.services = services if services is not None else {}
        self.queue: asyncio.Queue[Key] = asyncio.Queue()
        self.queued: set[Key] = set()
        self.busy: set[Key] = set()
        self.dirty: set[Key] = set()
        self.ledger = Ledger()   # per key: schedule, backoff, last error, and what bridges the index's lag
        self.tasks: list[asyncio.Task] = []
        self.resync, self.workers = settings.resync_seconds, settings.workers
        self.pod_list_seconds = settings.pod_list_seconds
        self._pools: tuple[float, tuple | None] | None = None   # (when, Kube.node_pools())

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._ticker(), name="tpuft-resync")]
        self.tasks += [asyncio.create_task(self._worker(), name=f"tpuft-worker-{i}") for i in range(self.workers)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def kick(self, key: Key) -> None:
        if key in self.busy:
            self.dirty.add(key)
        elif key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)

    async def _ticker(self) -> None:
        tick = min(0.5, self.resync)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for key in list(self.keys.keys()):
                if self.ledger.is_due(key, now):
                    self.kick(key)

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            self.queued.discard(key)
            self.busy.add(key)
            try:
                delay = await self._reconcile(key)
            finally:
                self.busy.discard(key)
            if key in self.keys:
                self.ledger.schedule(key, time.monotonic() + delay)
            if key in self.dirty:
                self.dirty.discard(key)
                self.kick(key)

    def _snapshot(self, key: Key) -> tuple[dict | None, list[IndexedChild], list[IndexedChild], list[IndexedChild]]:
        body = next(iter(self.keys.get(key, [])), None)
        clusters = [copy.deepcopy(x) for x in self.clusters.get(key, [])]
        jobs = [copy.deepcopy(x) for x in self.jobs.get(key, [])]
        services = [copy.deepcopy(x) for x in self.services.get(key, [])]
        return copy.deepcopy(body), clusters, jobs, services

    async def _reconcile(self, key: Key) -> float:
        started = time.perf_counter()
        try:
            requeue = await asyncio.to_thread(self.reconcile, key, *self._snapshot(key))
            self.ledger.succeeded(key)
            metrics.RECONCILES.labels(result="ok").inc()
            return min(requeue if requeue is not None else self.resync, self.resync)
        except KubeError as e:
            n = self.ledger.failed(key)
            delay = min(BACKOFF_MIN * 2 ** (n - 1), BACKOFF_MAX)
            log.warning("reconcile tft=%s/%s failed attempt=%d retry_in=%.0fs error=%s", *key, n, delay, e)
            metrics.RECONCILES.labels(result="retry").inc()
            return delay
        except Exception:  # a bug: log it loudly, keep the operator alive, back off
            n = self.ledger.failed(key)
            log.exception("reconcile tft=%s/%s crashed attempt=%d", *key, n)
            metrics.RECONCILES.labels(result="error").inc()
            return min(BACKOFF_MIN * 2 ** (n - 1), BACKOFF_MAX)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)

    # Everything below runs in a worker thread: plain blocking API calls.
    def observe(self, obj: dict, clusters: list[IndexedChild], jobs: list[IndexedChild],
                services: Sequence[IndexedChild] = ()) -> Observed:
        ns = obj["metadata"]["namespace"]
        children = (obj.get("status") or {}).get("children") or {}
        # Children we deleted: after a relist (410) kopf's index can keep them forever (it never
        # sees their DELETED event), so they are confirmed with a GET.
        removed = self.ledger.removed((ns, obj["metadata"]["name"]))
        uid = obj["metadata"].get("uid")
        live = {x.name: x for x in clusters
                if not x.deleting and x.belongs_to(uid) and (c.RAYCLUSTER_KIND, x.name) not in removed}
        cluster = None
        want = children.get("rayCluster")
        if want:
            entry = live.get(want) or self._confirm(c.RAYCLUSTER_KIND, ns, want, uid)
            if entry is not None:
                cluster = ClusterObs(want, entry.status, entry.suspend, entry.generation, entry.uid)
        found = {x.name: JobObs(x.name, x.status) for x in jobs
                 if not x.deleting and x.belongs_to(uid) and (c.RAYJOB_KIND, x.name) not in removed}
        for want in (children.get("verifyJob"), children.get("trainJob")):
            if want and want not in found:
                entry = self._confirm(c.RAYJOB_KIND, ns, want, uid)
                if entry is not None:
                    found[want] = JobObs(want, entry.status)
        service = self._service(obj, services, removed)
        deleting = self._deleting_jobs(ns, jobs, removed, uid) if cluster is not None else ()
        observed = Observed(cluster=cluster, jobs=found, jobs_deleting=deleting, service=service)
        if phases.wants_queue(obj, cluster) and cluster is not None and cluster.uid:
            observed = dataclasses.replace(observed, queue=self.kube.queue(ns, cluster.uid))
        if phases.wants_serve_pods(obj):
            return self._with_serve_pods(observed, obj)
        return self._with_pods(observed, obj, clusters) if phases.wants_pods(obj) else observed

    def _deleting_jobs(self, ns: str, jobs: list[IndexedChild], removed: Any, uid: str | None) -> tuple[str, ...]:
        """RayJobs of ours on their way out: the index shows them deleting, or we deleted them and
        it has not caught up. Each is confirmed with a GET (after a re-list the index can keep them
        forever); only while there is a RayCluster they could hold."""
        names = sorted({x.name for x in jobs if x.belongs_to(uid) and (x.deleting or (c.RAYJOB_KIND, x.name) in removed)})
        return tuple(name for name in names if self.kube.get(c.RAYJOB_KIND, ns, name) is not None)

    def _service(self, obj: dict, services: Sequence[IndexedChild], removed: Any) -> ServiceObs | None:
        want = ((obj.get("status") or {}).get("children") or {}).get("rayService")
        if not want:
            return None
        ns, uid = obj["metadata"]["namespace"], obj["metadata"].get("uid")
        live = {x.name: x for x in services
                if not x.deleting and x.belongs_to(uid) and (c.RAYSERVICE_KIND, x.name) not in removed}
        entry = live.get(want) or self._confirm(c.RAYSERVICE_KIND, ns, want, uid)
        return ServiceObs(want, entry.status) if entry is not None else None

    def _with_serve_pods(self, observed: Observed, obj: dict) -> Observed:
        """While the Serve app is not RUNNING: the serving cluster's pods (an image that does not
        pull, a pod that does not fit), listed at most once per pod_list_seconds."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        key = (ns, name)
        pods = self.ledger.pods(key, time.monotonic(), self.pod_list_seconds)
        if pods is None:
            pods = self.kube.pods(ns, f"{c.LABEL_NAME}={name},{c.LABEL_COMPONENT}={c.Component.SERVE.value}")
            self.ledger.listed_pods(key, time.monotonic(), pods)
        return dataclasses.replace(observed, pods=tuple(pods or ()))

    def _with_pods(self, observed: Observed, obj: dict, clusters: list[IndexedChild]) -> Observed:
        """While the slice comes up: its pods (a stall's cause) and whatever an earlier object of
        this name left (its RayCluster, its pods), which must go before we create ours."""
        ns, uid = obj["metadata"]["namespace"], obj["metadata"].get("uid")
        name = builders.cluster_name(obj["metadata"]["name"])
        ours = frozenset(u for u in [x.uid for x in clusters if x.name == name and x.belongs_to(uid) and not x.deleting]
                         + [observed.cluster.uid if observed.cluster else None] if u is not None)
        old = tuple(f"RayCluster {x.name}" for x in clusters if x.name == name and not x.belongs_to(uid))
        key = (ns, obj["metadata"]["name"])
        pods = self.ledger.pods(key, time.monotonic(), self.pod_list_seconds)
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

    def reconcile(self, key: Key, body: dict | None, clusters: list[IndexedChild],
                  jobs: list[IndexedChild], services: Sequence[IndexedChild] = ()) -> float | None:
        ns, name = key
        if body is None or body["metadata"].get("deletionTimestamp"):
            metrics.set_phase(key, None)   # children go with it: ownerReferences + garbage collector
            self.ledger.forget(key)
            return None
        if self.ledger.is_gone(key, body["metadata"].get("uid")):
            return None   # deleted while kopf's watch was re-listing: its index never dropped it
        if self.ledger.is_unsure(key):  # the index may lag a write whose answer we lost: deciding from it could go back
            fresh = self.kube.get(c.KIND, ns, name)
            if fresh is None:
                self.ledger.mark_gone(key, body["metadata"].get("uid"))
                return None
            body = fresh
            self.ledger.wrote(key, fresh.get("status") or {})   # until the index shows what the server has
        obj = self.ledger.overlay(key, body)
        now = datetime.now(timezone.utc)
        observed = self.observe(obj, clusters, jobs, services)
        decision = phases.decide(obj, observed, now, self.tun)
        uid = obj["metadata"].get("uid", "")
        done = []
        for action in decision.actions:
            try:
                result = self.kube.perform(ns, uid, action)
            except Rejected as r:
                log.warning("tft=%s/%s %s %s rejected: %s", ns, name, action.kind, action.name, r.api_message)
                rejected = dataclasses.replace(observed, admission_error=AdmissionError(r.kind, r.name, r.api_message))
                decision = phases.decide(obj, rejected, now, self.tun)
                break
            except KubeError as e:
                self._note_error(key, obj, str(e), now)
                raise
            metrics.ACTIONS.labels(op=action.op.value, kind=action.kind).inc()
            if action.op == Op.DELETE:
                self.ledger.deleted_child(key, action.kind, action.name)
            elif action.op == Op.CREATE:
                self.ledger.created_child(key, action.kind, action.name)
            done.append(f"{action.op.value}:{action.kind}/{action.name}={result}")
        self.ledger.clear_error(key)
        prev = owned(obj.get("status"))
        if decision.patch:
            if not self._patch_status(key, decision.patch):   # 404: the object is gone
                self.ledger.mark_gone(key, uid)
                return None
            self.ledger.wrote(key, decision.status)
            metrics.STATUS_WRITES.inc()
        for event in decision.events:
            self.kube.post_event(obj, event)
        self._phase_metrics(key, prev, decision.status, now)
        if decision.patch or done:
            log.info("reconciled tft=%s/%s phase=%s->%s reason=%s actions=[%s] wrote=%s", ns, name,
                     prev.get("phase") or "-", decision.phase, decision.status.get("reason"), ", ".join(done),
                     sorted(decision.patch or {}))
        return decision.requeue_after

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
    def _phase_metrics(key: Key, prev: dict, status: dict, now: datetime) -> None:
        before, after = prev.get("phase"), status.get("phase")
        if before != after:
            since = parse_time(prev.get("phaseTransitionTime"))
            if before and since:
                metrics.PHASE_SECONDS.labels(phase=before).observe(max((now - since).total_seconds(), 0))
            if after == c.Phase.FAILED.value:
                metrics.FAILURES.labels(reason=status.get("reason") or "Unknown").inc()
        metrics.set_phase(key, after)
        replaced = lambda st: int((st.get("recovery") or {}).get("sliceReplacements") or 0)  # noqa: E731
        if replaced(status) > replaced(prev):
            metrics.SLICE_REPLACEMENTS.inc(replaced(status) - replaced(prev))
