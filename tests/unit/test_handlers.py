"""tpuft.controller.handlers, the kopf wiring, without kopf running: one index and one event handler per
child kind (observed.CHILD_KINDS), and the work queue kept in kopf's memo."""
from __future__ import annotations

import asyncio

import kopf
from kopf._core.intents.registries import get_default_registry

from tests.factories import NAME, NS, FakeKube, tft
from tpuft.api import constants as c
from tpuft.controller import handlers
from tpuft.controller.observed import CHILD_KINDS, IndexedChild
from tpuft.controller.reconciler import Indexes
from tpuft.controller.settings import Settings


def test_each_child_kind_has_an_index_and_an_event_handler_filtered_by_owner():
    registry = get_default_registry()
    indexes = {h.id: h for h in registry._indexing.get_all_handlers()}
    events = {h.id: h for h in registry._watching.get_all_handlers()}
    assert set(indexes) == {"tpufinetunes", *(handlers.index_id(k) for k in CHILD_KINDS), handlers.POD_INDEX,
                            handlers.NODE_INDEX}
    assert set(events) == {"tpufinetune_event", "raycluster_event", "rayjob_event", "rayservice_event", "pod_event",
                           "node_event"}
    pods = indexes[handlers.POD_INDEX]
    assert pods.selector.any_name == "pods" and pods.labels == handlers.SLICE_PODS
    for kind in CHILD_KINDS:
        h = indexes[handlers.index_id(kind)]
        assert (h.selector.group, h.selector.version, h.selector.any_name) == (kind.group, kind.version, kind.plural)
        assert h.labels == {c.LABEL_NAME: kopf.PRESENT} and h.fn is handlers.index_child


def test_the_index_records_the_owner():
    meta = {"ownerReferences": [{"kind": "TPUFinetune", "uid": "u-1", "controller": True}]}
    entry = handlers.index_child(namespace=NS, name=f"{NAME}-ray", labels={"tpufinetune.dev/name": NAME},
                                 spec={}, status={}, meta=meta)
    assert entry[(NS, NAME)].owner_uid == "u-1"


def test_the_index_keeps_typed_children():
    meta = {"generation": 3, "deletionTimestamp": "2026-01-01T00:00:00Z"}
    entry = handlers.index_child(namespace=NS, name=f"{NAME}-verify", labels={"tpufinetune.dev/name": NAME},
                                 spec={"suspend": True}, status={"jobStatus": "RUNNING"}, meta=meta)
    assert entry == {(NS, NAME): IndexedChild(f"{NAME}-verify", {"jobStatus": "RUNNING"}, suspend=True,
                                              deleting=True, generation=3)}


def test_operator_state_lives_in_kopfs_memo():
    memo = kopf.Memo()
    assert handlers.probe(memo=memo) == {"queued": 0, "busy": 0}
    asyncio.run(handlers.tpufinetune_event(type="ADDED", namespace=NS, name=NAME, memo=memo))  # no queue yet
    memo[handlers.QUEUE] = queue = handlers.controller(FakeKube(tft()), Settings(), Indexes.empty())
    asyncio.run(handlers.tpufinetune_event(type="ADDED", namespace=NS, name=NAME, memo=memo))
    asyncio.run(handlers.child_event(namespace=NS, labels={"tpufinetune.dev/name": "other"}, memo=memo))
    assert handlers.probe(memo=memo) == {"queued": 2, "busy": 0} and queue.queued == {(NS, NAME), (NS, "other")}
    asyncio.run(handlers.cleanup(memo=memo))
    assert handlers.QUEUE not in memo


def test_a_fine_tunes_change_queues_its_base_and_a_bases_change_queues_its_fine_tunes():
    base = {"spec": {"serve": {"enabled": True, "adapters": {}}}}
    objects = {(NS, "base"): [base], (NS, "ft"): [{"spec": {"publish": {"to": "base"}}}],
               ("other", "ft"): [{"spec": {"publish": {"to": "base"}}}], (NS, "plain"): [{"spec": {}}]}
    assert handlers.sharing_a_base(NS, "ft", {"spec": {"publish": {"to": "base"}}}, objects) == [(NS, "base")]
    assert handlers.sharing_a_base(NS, "base", base, objects) == [(NS, "ft")]
    assert handlers.sharing_a_base(NS, "plain", {"spec": {}}, objects) == []
