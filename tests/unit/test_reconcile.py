"""handlers.Controller.reconcile with a fake API: actions before the single status write,
admission rejections, transient errors, index misses confirmed with a GET."""
from __future__ import annotations

import copy

import pytest

from tpuft import handlers, phases
from tpuft.kube import KubeError, Rejected

NS, NAME = "team-a", "ft"


def tft() -> dict:
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFinetune",
            "metadata": {"name": NAME, "namespace": NS, "uid": "u-1", "generation": 1},
            "spec": {"accelerator": "v6e", "topology": "4x4", "image": "img:1", "model": "m",
                     "dataset": {"name": "d"}, "checkpoint": {"storagePath": "gs://bucket/ck"}}}


class FakeKube:
    def __init__(self, obj: dict | None):
        self.objects: dict[tuple[str, str], dict] = {}
        if obj is not None:
            self.objects[("TPUFinetune", NAME)] = obj
        self.log: list[tuple] = []
        self.fail: dict[tuple[str, str], Exception] = {}

    def get(self, kind, ns, name):
        self.log.append(("get", kind, name))
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj else None

    def perform(self, ns, uid, action):
        self.log.append((action.op, action.kind, action.name))
        err = self.fail.get((action.kind, action.name))
        if err:
            raise err
        if action.op == phases.Op.CREATE:
            self.objects[(action.kind, action.name)] = copy.deepcopy(dict(action.body))
        return "created"

    def patch_status(self, ns, name, patch):
        self.log.append(("patch_status", tuple(sorted(patch))))
        st = self.objects[("TPUFinetune", NAME)].setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                st.pop(k, None)
            else:
                st[k] = copy.deepcopy(v)
        return True

    def post_event(self, obj, event):
        self.log.append(("event", event.type, event.reason))

    def ops(self, *kinds):
        return [x for x in self.log if x[0] in kinds]


def controller(kube) -> handlers.Controller:
    return handlers.Controller(kube, {}, {}, {}, phases.Tunables(verify_grace_seconds=1))


def indexed(kube) -> dict:
    """What the index holds once it has caught up with the API server."""
    return copy.deepcopy(kube.objects[("TPUFinetune", NAME)])


def test_first_reconcile_acts_then_writes_status_once():
    kube = FakeKube(tft())
    ctl = controller(kube)
    stale = indexed(kube)
    requeue = ctl.reconcile((NS, NAME), stale, [], [])
    writes = kube.ops("patch_status")
    assert len(writes) == 1
    creates = kube.ops("create")
    assert [c[1] for c in creates] == ["ServiceAccount", "Role", "RoleBinding", "RayCluster"]
    assert kube.log.index(creates[-1]) < kube.log.index(writes[0])  # act first, then record
    assert kube.objects[("TPUFinetune", NAME)]["status"]["phase"] == "Provisioning"
    assert ("event", "Normal", "WaitingForSlice") in kube.log
    assert requeue == 1800
    kube.log.clear()
    # Neither index has caught up: our own status write is overlaid, the cluster is confirmed
    # with a GET; nothing is created, written or announced twice.
    ctl.reconcile((NS, NAME), stale, [], [])
    assert ("get", "RayCluster", f"{NAME}-ray") in kube.log
    assert kube.ops("create", "patch_status", "event") == []
    # Caught up: no request at all.
    kube.log.clear()
    cluster = phases.IndexedChild(f"{NAME}-ray", {}, suspend=False, deleting=False)
    ctl.reconcile((NS, NAME), indexed(kube), [cluster], [])
    assert kube.log == [] and ctl.ledger.written((NS, NAME)) is None


def test_admission_rejection_becomes_the_status():
    kube = FakeKube(tft())
    kube.fail[("RayCluster", f"{NAME}-ray")] = Rejected("RayCluster", f"{NAME}-ray", "denied: numOfHosts", 403)
    controller(kube).reconcile((NS, NAME), indexed(kube), [], [])
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert st["phase"] == "Failed" and st["reason"] == "AdmissionRejected" and "denied: numOfHosts" in st["message"]
    assert len(kube.ops("patch_status")) == 1 and ("event", "Warning", "AdmissionRejected") in kube.log


def test_transient_error_is_recorded_once_and_raised():
    kube = FakeKube(tft())
    kube.fail[("RayCluster", f"{NAME}-ray")] = KubeError("create RayCluster team-a/ft-ray: HTTP 500: etcd timeout")
    ctl = controller(kube)
    stale = indexed(kube)
    for _ in range(2):
        with pytest.raises(KubeError):
            ctl.reconcile((NS, NAME), stale, [], [])
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert st["phase"] == "Pending" and "etcd timeout" in st["message"]
    assert len(kube.ops("patch_status")) == 1
    assert [x for x in kube.log if x[0] == "event"] == [("event", "Warning", "ReconcileError")]
    del kube.fail[("RayCluster", f"{NAME}-ray")]
    ctl.reconcile((NS, NAME), indexed(kube), [], [])
    assert kube.objects[("TPUFinetune", NAME)]["status"]["phase"] == "Provisioning"


def test_gone_object_is_forgotten():
    kube = FakeKube(None)
    assert controller(kube).reconcile((NS, NAME), None, [], []) is None
    assert kube.ops("create", "patch_status", "event") == []


def test_deleting_children_in_the_index_count_as_absent():
    kube = FakeKube(tft())
    ctl = controller(kube)
    ctl.reconcile((NS, NAME), indexed(kube), [], [])
    obj = kube.objects[("TPUFinetune", NAME)]
    entry = phases.IndexedChild(f"{NAME}-ray", {}, suspend=False, deleting=True)
    del kube.objects[("RayCluster", f"{NAME}-ray")]
    observed = ctl.observe(obj, [entry], [])
    assert observed.cluster is None


def test_the_index_keeps_typed_children():
    meta = {"generation": 3, "deletionTimestamp": "2026-01-01T00:00:00Z"}
    entry = handlers.rayjobs_by_owner(namespace=NS, name=f"{NAME}-verify", labels={"tpufinetune.dev/name": NAME},
                                      spec={"suspend": True}, status={"jobStatus": "RUNNING"}, meta=meta)
    assert entry == {(NS, NAME): phases.IndexedChild(f"{NAME}-verify", {"jobStatus": "RUNNING"}, suspend=True,
                                                     deleting=True, generation=3)}


def test_operator_state_lives_in_kopfs_memo():
    import asyncio

    import kopf

    memo = kopf.Memo()
    assert handlers.probe(memo=memo) == {"queued": 0, "busy": 0}
    asyncio.run(handlers.tpufinetune_event(type="ADDED", namespace=NS, name=NAME, memo=memo))  # no controller yet
    memo["controller"] = ctl = controller(FakeKube(tft()))
    asyncio.run(handlers.tpufinetune_event(type="ADDED", namespace=NS, name=NAME, memo=memo))
    asyncio.run(handlers.rayjob_event(namespace=NS, labels={"tpufinetune.dev/name": "other"}, memo=memo))
    assert handlers.probe(memo=memo) == {"queued": 2, "busy": 0} and ctl.queued == {(NS, NAME), (NS, "other")}
    asyncio.run(handlers.cleanup(memo=memo))
    assert "controller" not in memo
