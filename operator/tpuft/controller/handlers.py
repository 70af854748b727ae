"""kopf wiring: one level-based reconcile per TPUFinetune, driven by watch events and a resync.

    kopf run --standalone -m tpuft.controller.handlers --all-namespaces | --namespace=NS

Nothing is ever written onto the TPUFinetune's metadata: there are no kopf change handlers,
timers or daemons (those need kopf's annotations or a finalizer, which GitOps tools see as
drift and which block deletion when the operator is gone). Instead:

  * `kopf.index` keeps the TPUFinetunes and, per row of observed.CHILD_KINDS, the owned children
    (label tpufinetune.dev/name) in memory; `kopf.on.event` on each kind queues the owner's key.
  * the RayClusters' pods (labels tpufinetune.dev/name and ray.io/cluster) are indexed too, each reduced
    to a diagnosis.PodObs, and the nodes that are not Ready or carry a GKE maintenance notice (a
    hosts.NodeObs; nothing for the rest): a lost host or a notice queues the owner at once (tpuft.controller.hosts).
    Nodes only with TPUFT_WATCH_NODES=1 (the default; the chart sets 0 where its ClusterRole does not
    allow it): the pods' own Ready condition still shows a lost node.
  * startup reads the settings (tpuft.controller.settings, from the environment) and starts a work queue
    (tpuft.controller.workqueue, kept in kopf's `memo`) whose handler is the reconciler (tpuft.controller.reconciler).
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.controller import metrics
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.hosts import NodeObs
from tpuft.controller.kube import Kube, new_api_client
from tpuft.controller.observed import CHILD_KINDS, ChildKind, IndexedChild, section
from tpuft.controller.reconciler import Indexes, Reconciler
from tpuft.controller.settings import Settings
from tpuft.controller.workqueue import WorkQueue

OWNED = {c.LABEL_NAME: kopf.PRESENT}
QUEUE = "queue"   # the work queue's key in kopf's memo
OBJECT_INDEX = "tpufinetunes"   # the TPUFinetunes' kopf index (the startup handler's keyword argument)
POD_INDEX = "pods_by_owner"     # the RayClusters' pods by their TPUFinetune's key
NODE_INDEX = "noteworthy_nodes"  # nodes not Ready or with a maintenance notice, by name
SLICE_PODS = {c.LABEL_NAME: kopf.PRESENT, kuberay.RAY_CLUSTER_LABEL: kopf.PRESENT}


def index_id(kind: ChildKind) -> str:
    """The kopf index of a child kind (and the startup handler's keyword argument holding it)."""
    return f"{kind.plural}_by_owner"


# --- indexes and event handlers ----------------------------------------------------------------------
# The ignores: kopf's handler protocols type `namespace` as str | None (for cluster-scoped
# resources); every resource here is namespaced, so these handlers take a str.
@kopf.index(c.GROUP, c.VERSION, c.PLURAL, id=OBJECT_INDEX)  # type: ignore[arg-type]
def tpufinetunes(namespace: str, name: str, body: Any, **_: Any) -> dict:
    """The object itself: the reconciler reads it from here (an informer cache), not with a GET."""
    return {(namespace, name): copy.deepcopy(dict(body))}


def index_child(namespace: str, name: str, labels: Any, spec: Any, status: Any, meta: Any, **_: Any) -> dict:
    """A child of any kind, by its owner's key."""
    return {(namespace, labels[c.LABEL_NAME]): IndexedChild.of(name, spec, status, meta)}


# The queue lives in kopf's memo (set by startup; resource handlers get copies of the
# operator's memo, made after startup, so they see it).
def _queue(memo: kopf.Memo) -> WorkQueue | None:
    return memo.get(QUEUE)


@kopf.on.event(c.GROUP, c.VERSION, c.PLURAL)  # type: ignore[arg-type]
async def tpufinetune_event(type: str | None, namespace: str, name: str, memo: kopf.Memo, body: Any = None,
                            tpufinetunes: kopf.Index | None = None, **_: Any) -> None:
    if (queue := _queue(memo)) is not None:
        if type == "DELETED":
            metrics.set_phase((namespace, name), None)
        queue.kick((namespace, name))
        for key in sharing_a_base(namespace, name, body, tpufinetunes or {}):
            queue.kick(key)


def sharing_a_base(namespace: str, name: str, body: Any, objects: Any) -> list[tuple[str, str]]:
    """Who else decides on this object's change: the base a fine-tune publishes to (its adapters, an
    unpublish when the fine-tune is deleted), and the fine-tunes that publish to a base (waiting for
    it to serve)."""
    spec = section(body, "spec")
    to = section(spec, "publish").get("to")
    keys = [(namespace, str(to))] if to else []
    if section(spec, "serve").get("adapters") is not None:
        for key, store in list(objects.items()):
            to = section(section(next(iter(store), None), "spec"), "publish").get("to")
            if key[0] == namespace and to == name:
                keys.append(key)
    return keys


async def child_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    if (queue := _queue(memo)) is not None:
        queue.kick((namespace, labels[c.LABEL_NAME]))


@kopf.index("", "v1", "pods", id=POD_INDEX, labels=SLICE_PODS)  # type: ignore[arg-type]
def pods_by_owner(namespace: str, labels: Any, body: Any, **_: Any) -> dict:
    return {(namespace, labels[c.LABEL_NAME]): PodObs.of(body)}


@kopf.on.event("", "v1", "pods", id="pod_event", labels=SLICE_PODS)  # type: ignore[arg-type]
async def pod_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    if (queue := _queue(memo)) is not None:
        queue.kick((namespace, labels[c.LABEL_NAME]))


def noteworthy_nodes(name: str, body: Any, **_: Any) -> dict | None:
    node = NodeObs.of(body)
    return {name: node} if node.noteworthy else None


def _noteworthy(body: Any, **_: Any) -> bool:
    return NodeObs.of(body).noteworthy


async def node_event(name: str, memo: kopf.Memo, pods_by_owner: kopf.Index, **_: Any) -> None:
    """Queues the owners of the pods on a noteworthy node."""
    if (queue := _queue(memo)) is None:
        return
    for key, pods in pods_by_owner.items():
        if any(p.node == name for p in pods):
            queue.kick(key)


# Only where nodes may be listed and watched (Settings.watch_nodes, read now: the watches are fixed
# at import): kopf serves no index until every index is listed, so a 403 on nodes would stall it.
# A Ready node's routine updates (heartbeats) run no handler (kopf's `when`): no log line, no
# queueing; a notice withdrawn is seen at the next resync.
WATCH_NODES = bool(Settings.from_env().watch_nodes)
if WATCH_NODES:
    kopf.index("", "v1", "nodes", id=NODE_INDEX)(noteworthy_nodes)
    kopf.on.event("", "v1", "nodes", id="node_event", when=_noteworthy)(node_event)  # type: ignore[arg-type]


for _kind in CHILD_KINDS:
    kopf.index(_kind.group, _kind.version, _kind.plural, id=index_id(_kind), labels=OWNED)(index_child)  # type: ignore[arg-type]
    kopf.on.event(_kind.group, _kind.version, _kind.plural, id=f"{_kind.kind.lower()}_event",
                  labels=OWNED)(child_event)  # type: ignore[arg-type]


# --- lifecycle ------------------------------------------------------------------------------------
def controller(kube: Kube, config: Settings, indexes: Indexes) -> WorkQueue:
    """The work queue, its handler the reconciler (not started)."""
    reconciler = Reconciler(kube, config, indexes)
    return WorkQueue(reconciler.handle, indexes.objects, resync=config.resync_seconds, workers=config.workers,
                     on_error=reconciler.failed)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    config = Settings.from_env()   # read at startup, not import: tests set the environment
    if config.log_level:
        logging.getLogger("tpuft").setLevel(config.log_level)
    settings.posting.level = logging.WARNING      # kopf's own k8s Events: only problems
    settings.watching.server_timeout = 300        # re-list at least every 5 minutes
    metrics.serve(config.metrics_port)
    indexes = Indexes(kwargs[OBJECT_INDEX], {k.kind: kwargs[index_id(k)] for k in CHILD_KINDS},
                      kwargs[POD_INDEX], kwargs.get(NODE_INDEX, {}))
    queue = controller(Kube(new_api_client(), config.api_timeout_seconds), config, indexes)
    queue.start()
    memo[QUEUE] = queue


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster ServiceAccount, else KUBECONFIG as set now (kopf's client-library login reads the
    kubernetes client's default path, which is fixed at import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    queue = memo.pop(QUEUE, None)
    if queue is not None:
        await queue.stop()


@kopf.on.probe(id="reconciler")
def probe(memo: kopf.Memo, **_: Any) -> dict:
    queue = _queue(memo)
    return {"queued": len(queue.queued), "busy": len(queue.busy)} if queue else {"queued": 0, "busy": 0}
