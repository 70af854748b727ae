"""tpuft.controller.reconciler.Reconciler with a fake API: actions before the single status write,
admission rejections, transient errors, index misses confirmed with a GET."""
from __future__ import annotations

import pytest

import dataclasses

from tests.factories import NAME, NS, FakeKube, Lifecycle, indexed, kids, reconciler, snap, tft
from tpuft.controller.kube import KubeError, Rejected
from tpuft.controller.observed import IndexedChild
from tpuft.controller.settings import Settings

def test_first_reconcile_acts_then_writes_status_once():
    kube = FakeKube(tft())
    ctl = reconciler(kube)
    stale = indexed(kube)
    requeue = ctl.reconcile((NS, NAME), snap(stale))
    writes = kube.ops("patch_status")
    assert len(writes) == 1
    creates = kube.ops("create")
    assert [c[1] for c in creates] == ["ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "RayCluster"]
    assert kube.log.index(creates[-1]) < kube.log.index(writes[0])  # act first, then record
    assert kube.objects[("TPUFinetune", NAME)]["status"]["phase"] == "Provisioning"
    assert ("event", "Normal", "WaitingForSlice") in kube.log
    assert requeue == 1800
    kube.log.clear()
    # Neither index has caught up: our own status write is overlaid, the cluster is confirmed
    # with a GET; nothing is created, written or announced twice.
    ctl.reconcile((NS, NAME), snap(stale))
    assert ("get", "RayCluster", f"{NAME}-ray") in kube.log
    assert kube.ops("create", "patch_status", "event") == []
    # Caught up: no request at all (the slice's pods, listed for a stall's cause, are reused
    # for TPUFT_POD_LIST_SECONDS)
    kube.log.clear()
    cluster = IndexedChild(f"{NAME}-ray", {}, suspend=False, deleting=False)
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert kube.log == [] and ctl.ledger.written((NS, NAME)) is None
    ctl.settings = dataclasses.replace(ctl.settings, pod_list_seconds=0)
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert kube.log == [("slice_pods", f"{NAME}-ray")]


def test_admission_rejection_becomes_the_status():
    kube = FakeKube(tft())
    kube.fail[("RayCluster", f"{NAME}-ray")] = Rejected("RayCluster", f"{NAME}-ray", "denied: numOfHosts", 403)
    reconciler(kube).reconcile((NS, NAME), snap(indexed(kube)))
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert st["phase"] == "Failed" and st["reason"] == "AdmissionRejected" and "denied: numOfHosts" in st["message"]
    assert len(kube.ops("patch_status")) == 1 and ("event", "Warning", "AdmissionRejected") in kube.log


def test_transient_error_is_recorded_once_and_raised():
    kube = FakeKube(tft())
    kube.fail[("RayCluster", f"{NAME}-ray")] = KubeError("create RayCluster team-a/ft-ray: HTTP 500: etcd timeout")
    ctl = reconciler(kube)
    stale = indexed(kube)
    for _ in range(2):
        with pytest.raises(KubeError):
            ctl.reconcile((NS, NAME), snap(stale))
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert st["phase"] == "Pending" and "etcd timeout" in st["message"]
    assert len(kube.ops("patch_status")) == 1
    assert [x for x in kube.log if x[0] == "event"] == [("event", "Warning", "ReconcileError")]
    del kube.fail[("RayCluster", f"{NAME}-ray")]
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    assert kube.objects[("TPUFinetune", NAME)]["status"]["phase"] == "Provisioning"


def test_gone_object_is_forgotten():
    kube = FakeKube(None)
    assert reconciler(kube).reconcile((NS, NAME), snap(None)) is None
    assert kube.ops("create", "patch_status", "event") == []


def test_deleting_children_in_the_index_count_as_absent():
    kube = FakeKube(tft())
    ctl = reconciler(kube)
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    obj = kube.objects[("TPUFinetune", NAME)]
    entry = IndexedChild(f"{NAME}-ray", {}, suspend=False, deleting=True)
    del kube.objects[("RayCluster", f"{NAME}-ray")]
    observed = ctl.observe(obj, kids([entry], []))
    assert observed.cluster is None


def test_a_previous_objects_children_are_not_taken_for_its_own():
    """Delete and re-create a TPUFinetune of the same name: until the garbage collector removes
    the old RayCluster and RayJobs (same names), they belong to the old UID and count as absent."""
    kube = FakeKube(tft())
    ctl = reconciler(kube)
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    obj = kube.objects[("TPUFinetune", NAME)]
    old_cluster = IndexedChild(f"{NAME}-ray", {"state": "ready"}, owner_uid="uid-of-the-deleted-object")
    old_job = IndexedChild(f"{NAME}-verify", {"jobStatus": "FAILED"}, owner_uid="uid-of-the-deleted-object")
    kube.objects[("RayCluster", f"{NAME}-ray")]["metadata"]["ownerReferences"] = [
        {"kind": "TPUFinetune", "uid": "uid-of-the-deleted-object"}]
    observed = ctl.observe(obj, kids([old_cluster], [old_job]))
    assert observed.cluster is None and observed.jobs == {}
    own = IndexedChild(f"{NAME}-ray", {"state": "ready"}, owner_uid=obj["metadata"]["uid"])
    assert ctl.observe(obj, kids([own], [])).cluster is not None


def test_rayjobs_on_their_way_out_are_confirmed_with_a_get_while_there_is_a_cluster():
    """A RayJob being deleted (KubeRay's finalizer, its submitter Job going) still holds its
    RayCluster (phases.jobs._release); the index may keep one forever after a re-list, so each is
    confirmed with a GET, and only while there is a RayCluster it could hold."""
    kube = FakeKube(tft())
    ctl = reconciler(kube)
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    obj = kube.objects[("TPUFinetune", NAME)]
    cluster = IndexedChild(f"{NAME}-ray", {})
    going = IndexedChild(f"{NAME}-verify", {"jobStatus": "SUCCEEDED"}, deleting=True)
    kube.objects[("RayJob", f"{NAME}-verify")] = {"metadata": {"name": f"{NAME}-verify"}}
    observed = ctl.observe(obj, kids([cluster], [going]))
    assert observed.jobs_deleting == (f"{NAME}-verify",) and observed.jobs == {}
    assert ("get", "RayJob", f"{NAME}-verify") in kube.log
    del kube.objects[("RayJob", f"{NAME}-verify")]   # gone; the index has not caught up
    assert ctl.observe(obj, kids([cluster], [going])).jobs_deleting == ()
    ctl.ledger.deleted_child((NS, NAME), "RayJob", f"{NAME}-train")   # deleted by us, the index still shows it
    kube.objects[("RayJob", f"{NAME}-train")] = {"metadata": {"name": f"{NAME}-train"}}
    assert ctl.observe(obj, kids([cluster], [IndexedChild(f"{NAME}-train", {})])).jobs_deleting == (f"{NAME}-train",)
    del kube.objects[("RayCluster", f"{NAME}-ray")]
    kube.log.clear()
    assert ctl.observe(obj, kids([], [going])).jobs_deleting == ()   # no cluster: nothing to hold, no GET for it
    assert ("get", "RayJob", f"{NAME}-verify") not in kube.log


# --- whole lifecycles against a fake API (tests.factories.Lifecycle; KubeRay's part by
# tests/kuberay_standin.py): the pure rules, without a control plane. tests/integration/
# test_handlers.py keeps what needs one (admission, watches, RBAC, restarts, deletion). ---------------
def cond(status: dict, ctype: str) -> dict:
    return next(x for x in status["conditions"] if x["type"] == ctype)


def verifying(tft: Lifecycle, **spec) -> dict:
    tft.apply(**spec)
    tft.wait("Provisioning")
    tft.kuberay.cluster_ready(f"{NAME}-ray")
    return tft.wait("VerifyingCollectives")


@pytest.mark.parametrize("how,reason", [("failed", "VerificationFailed"), ("deadline", "CollectiveTimeout")])
def test_verification_failure_never_trains(how, reason):
    tft = Lifecycle()
    kuberay = tft.kuberay
    verifying(tft)
    kuberay.job_running(f"{NAME}-verify")
    if how == "failed":
        kuberay.job_failed(f"{NAME}-verify", "all_reduce sum 120 != expected 136")
    else:
        kuberay.job_deadline_exceeded(f"{NAME}-verify", 660)
    st = tft.wait("Failed")
    assert st["reason"] == reason and f"{NAME}-verify" in st["message"]
    tft.reconcile(3)   # later resyncs create nothing either
    assert tft.children("rayjobs") == [f"{NAME}-verify"]


def test_training_retries_then_fails():
    tft = Lifecycle()
    kuberay = tft.kuberay
    tft.apply(verification={"enabled": False}, training={"maxJobRetries": 1})
    tft.wait("Provisioning")
    kuberay.cluster_ready(f"{NAME}-ray")
    st = tft.wait("Training")
    assert cond(st, "CollectivesVerified")["reason"] == "VerificationSkipped"
    kuberay.job_failed(f"{NAME}-train", "preempted")
    tft.wait_until(lambda: tft.status().get("trainingAttempts") == 2, what="the resubmission")
    assert tft.children("rayjobs") == [f"{NAME}-train", f"{NAME}-train-r1"]
    assert tft.status()["children"]["trainJob"] == f"{NAME}-train-r1"
    kuberay.job_failed(f"{NAME}-train-r1", "preempted again")
    st = tft.wait("Failed")
    assert st["reason"] == "TrainingFailed" and "after 2 attempt(s)" in st["message"]
    assert "Retrying" in [e["reason"] for e in tft.events()]


def test_lost_submissions_are_resubmitted_as_fresh_rayjobs():
    """KubeRay fails a RayJob whose submitter completed while the dashboard knew no job of it:
    a fresh verify job, then the next training attempt, neither spending training.maxJobRetries."""
    tft = Lifecycle(Settings(verify_grace_seconds=1, resubmit_backoff_seconds=0))
    kuberay = tft.kuberay
    verifying(tft)
    kuberay.job_lost(f"{NAME}-verify")
    tft.wait_until(lambda: tft.status()["children"]["verifyJob"] == f"{NAME}-verify-r1", what="a fresh verify job")
    assert tft.children("rayjobs") == [f"{NAME}-verify", f"{NAME}-verify-r1"]
    kuberay.job_succeeded(f"{NAME}-verify-r1")
    tft.wait("Training")
    kuberay.job_lost(f"{NAME}-train")
    tft.wait_until(lambda: tft.status().get("trainingAttempts") == 2, what="the resubmission")
    kuberay.job_succeeded(f"{NAME}-train-r1")
    st = tft.wait("Succeeded")
    assert [(x["phase"], x["rayJob"], x["resubmittedAs"]) for x in st["recovery"]["lostSubmissions"]] == [
        ("VerifyingCollectives", f"{NAME}-verify", f"{NAME}-verify-r1"),
        ("Training", f"{NAME}-train", f"{NAME}-train-r1")]
    assert [e["reason"] for e in tft.events() if e["type"] == "Warning"] == ["SubmissionLost", "SubmissionLost"]


def test_child_deleted():
    tft = Lifecycle()
    kuberay = tft.kuberay
    tft.apply(verification={"enabled": False})
    tft.wait("Provisioning")
    first = kuberay.get("rayclusters", f"{NAME}-ray")["metadata"]["uid"]
    tft.delete("RayCluster", f"{NAME}-ray")
    tft.wait_until(lambda: tft.children("rayclusters") == [f"{NAME}-ray"]
                   and kuberay.get("rayclusters", f"{NAME}-ray")["metadata"]["uid"] != first, what="the recreation")
    kuberay.cluster_ready(f"{NAME}-ray")
    tft.wait("Training")
    tft.delete("RayCluster", f"{NAME}-ray")
    st = tft.wait("Failed")
    assert st["reason"] == "ChildDeleted" and f"{NAME}-ray" in st["message"]


def test_spec_change_mid_run_is_recorded_not_applied():
    tft = Lifecycle()
    kuberay = tft.kuberay
    tft.apply()
    tft.wait("Provisioning")
    tft.patch({"training": {"epochs": 9}})
    st = tft.wait_until(lambda: (s := tft.status()).get("observedGeneration") == 2 and s, what="observedGeneration 2")
    assert st["appliedGeneration"] == 1
    assert "spec change ignored: spec.training.epochs" in st["ignoredSpecChange"]["message"]
    kuberay.cluster_ready(f"{NAME}-ray")
    tft.wait("VerifyingCollectives")
    kuberay.job_succeeded(f"{NAME}-verify")
    tft.wait("Training")
    entry = kuberay.get("rayjobs", f"{NAME}-train")["spec"]["entrypoint"]
    assert '"epochs":3' in entry  # built from the applied generation, not the edit
    assert "SpecChangeIgnored" in [e["reason"] for e in tft.events() if e["type"] == "Warning"]


def pod(name: str, cluster_uid: str, **status) -> dict:
    """A RayCluster's pod as the API server returns it (KubeRay's label and ownerReference)."""
    return {"metadata": {"name": name, "labels": {"ray.io/cluster": f"{NAME}-ray"},
                         "ownerReferences": [{"kind": "RayCluster", "uid": cluster_uid}]},
            "spec": {"containers": [{"name": "ray-worker", "image": "img:1"}]}, "status": status}


UNSCHEDULABLE = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/8 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."}]}


def test_a_stuck_slice_says_the_schedulers_reason_while_provisioning_and_at_the_deadline():
    kube = FakeKube(tft())
    ctl = reconciler(kube, pod_list_seconds=0)
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    cluster = IndexedChild(f"{NAME}-ray", {}, suspend=False, deleting=False, uid="rc-1")
    kube.pods = [pod(f"{NAME}-ray-worker-a", "rc-1", **UNSCHEDULABLE)]
    for _ in range(3):   # resyncs: one write and one event for the cause, however often it is seen
        ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert st["phase"] == "Provisioning"
    assert (f"pod {NAME}-ray-worker-a cannot be scheduled: the scheduler says: 0/8 nodes are available"
            in st["message"]), st["message"]
    assert kube.ops("event").count(("event", "Warning", "SliceBlocked")) == 1
    assert len(kube.ops("patch_status")) == 2   # Provisioning, then the cause
    st["phaseTransitionTime"] = "2000-01-01T00:00:00Z"   # the deadline has long passed
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert st["reason"] == "ProvisioningTimeout" and "the scheduler says: 0/8 nodes are available" in st["message"]


def test_pods_of_another_cluster_are_not_this_slices_cause():
    kube = FakeKube(tft())
    ctl = reconciler(kube, pod_list_seconds=0)
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    cluster = IndexedChild(f"{NAME}-ray", {}, uid="rc-1")
    kube.pods = [pod(f"{NAME}-ray-worker-old", "rc-0", **UNSCHEDULABLE)]
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert "cannot be scheduled" not in kube.objects[("TPUFinetune", NAME)]["status"]["message"]


def test_a_recreated_object_waits_for_the_deleted_ones_pods_then_creates():
    """Same name, new UID: the deleted object's RayCluster and pods (GC still at work) would be
    taken by KubeRay for the new cluster's (it selects pods by the ray.io/cluster label)."""
    kube = FakeKube(tft())
    ctl = reconciler(kube)
    old = IndexedChild(f"{NAME}-ray", {}, owner_uid="u-0", uid="rc-0")
    kube.pods = [pod(f"{NAME}-ray-head-x", "rc-0", phase="Running")]
    requeue = ctl.reconcile((NS, NAME), snap(indexed(kube), [old]))
    st = kube.objects[("TPUFinetune", NAME)]["status"]
    assert kube.ops("create") == [] and st["phase"] == "Pending" and st["reason"] == "WaitingForPrevious"
    assert f"RayCluster {NAME}-ray, pod {NAME}-ray-head-x" in st["message"], st["message"]
    assert requeue is not None and requeue <= 2
    ctl.reconcile((NS, NAME), snap(indexed(kube)))   # the RayCluster went; its pod has not
    assert kube.ops("create") == [] and len(kube.ops("slice_pods")) == 2   # leftovers: never a reused list
    kube.pods = []
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    assert [x[1] for x in kube.ops("create")][-1] == "RayCluster"
    assert kube.objects[("TPUFinetune", NAME)]["status"]["phase"] == "Provisioning"


def test_a_listed_slice_is_reused_for_the_interval_then_listed_again(monkeypatch):
    kube = FakeKube(tft())
    ctl = reconciler(kube)
    clock = [100.0]
    monkeypatch.setattr("tpuft.controller.reconciler.time.monotonic", lambda: clock[0])
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    cluster = IndexedChild(f"{NAME}-ray", {}, uid="rc-1")
    kube.pods = [pod(f"{NAME}-ray-worker-a", "rc-1", **UNSCHEDULABLE)]
    clock[0] += ctl.settings.pod_list_seconds - 1
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert len(kube.ops("slice_pods")) == 1
    assert "cannot be scheduled" not in kube.objects[("TPUFinetune", NAME)]["status"]["message"]
    clock[0] += 1
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert len(kube.ops("slice_pods")) == 2
    assert "cannot be scheduled" in kube.objects[("TPUFinetune", NAME)]["status"]["message"]


def test_node_pools_are_read_only_for_an_unschedulable_slice_and_shared(monkeypatch):
    kube = FakeKube(tft())
    kube.pools = (("tpu-v6e-slice", "4x4", 4),)
    ctl = reconciler(kube, pod_list_seconds=0)
    ctl.reconcile((NS, NAME), snap(indexed(kube)))
    cluster = IndexedChild(f"{NAME}-ray", {}, uid="rc-1")
    kube.pods = [pod(f"{NAME}-ray-worker-a", "rc-1", phase="Pending")]
    ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert kube.ops("node_pools") == []   # nothing unschedulable: no node list
    kube.pods = [pod(f"{NAME}-ray-worker-a", "rc-1", **UNSCHEDULABLE)]
    for _ in range(3):
        ctl.reconcile((NS, NAME), snap(indexed(kube), [cluster]))
    assert len(kube.ops("node_pools")) == 1   # one list serves POOLS_CACHE_SECONDS
    msg = kube.objects[("TPUFinetune", NAME)]["status"]["message"]
    assert "the scheduler says" in msg and "the tpu-v6e-slice 4x4 pool exists" in msg, msg


# --- adapters on a shared base: the other TPUFinetunes of the namespace, from the index -------------
def _published(name: str, uid: str, base: str = "base") -> dict:
    return {"metadata": {"name": name, "namespace": NS, "uid": uid}, "spec": {"publish": {"to": base}},
            "status": {"serving": {"base": base, "adapter": "chat", "reason": "Published",
                                   "published": {"evalLoss": 1.0, "evalSet": "s", "publishedAt": "2026-01-01T00:00:00Z"}}}}


def test_a_base_and_its_fine_tunes_read_each_other_from_the_index_and_nothing_else_does():
    from tpuft.controller.reconciler import Indexes, neighbours

    base = {"metadata": {"name": "base", "namespace": NS, "uid": "u-base"},
            "spec": {"model": "m", "serve": {"enabled": True, "adapters": {"maxRank": 32}}},
            "status": {"phase": "Serving", "conditions": [{"type": "Ready", "status": "True"}],
                       "serving": {"rayCluster": "base-serve-raycluster-x", "adaptersRoot": "gs://b/r/adapters"}}}
    ft, other_ns = _published("ft", "u-ft"), {**_published("ft", "u-x"), "metadata": {"name": "ft", "namespace": "x"}}
    deleting = _published("gone", "u-gone")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    plain = {"metadata": {"name": "plain", "namespace": NS, "uid": "u-p"}, "spec": {}}
    objects = {(NS, "base"): [base], (NS, "ft"): [ft], ("x", "ft"): [other_ns], (NS, "gone"): [deleting],
               (NS, "plain"): [plain]}
    indexes = Indexes(objects, Indexes.empty().children)
    assert indexes.snapshot((NS, "plain")).peers is None   # neither a base nor publishing: no peers read
    peers = indexes.snapshot((NS, "base")).peers
    assert sorted(p.name for p in peers) == ["ft", "plain"]   # same namespace, not deleting, not itself
    seen = neighbours(base, peers)
    assert seen["base"] is None and [p.source for p in seen["published"]] == [f"{NS}/ft"]
    assert seen["live_uids"] == {"u-ft", "u-p"}
    seen = neighbours(ft, indexes.snapshot((NS, "ft")).peers)
    assert seen["base"].name == "base" and seen["base"].serving_ready and seen["base"].max_rank == 32
    assert seen["base"].ray_cluster == "base-serve-raycluster-x" and seen["published"] == ()
