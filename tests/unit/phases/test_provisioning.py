"""tpuft.controller.phases.provisioning, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.observed import AdmissionError, ClusterObs, Observed

from tests.unit.phases.clock import NAME, T0, TUN, apply, at, cluster, cond, kinds, make, run_to


# --- Pending -> Provisioning ----------------------------------------------------------------------
def test_first_reconcile_creates_identity_network_policy_and_cluster():
    o = make()
    d = phases.decide(o, Observed(), at(0), TUN)
    assert kinds(d) == [("create", "ServiceAccount", f"{NAME}-workload"), ("create", "Role", f"{NAME}-workload"),
                        ("create", "RoleBinding", f"{NAME}-workload"),
                        ("create", "NetworkPolicy", f"{NAME}-ray-ingress"),   # before any Ray pod exists
                        ("create", "RayCluster", f"{NAME}-ray")]
    assert d.actions[-2].body == builders.build_network_policy(parse(o))
    assert d.actions[-1].body == builders.build_raycluster(parse(o))
    st = d.status
    assert st["phase"] == "Provisioning" and st["reason"] == "WaitingForSlice"
    assert st["appliedGeneration"] == 1 and st["observedGeneration"] == 1 and st["appliedSpec"] == o["spec"]
    assert st["children"] == {"rayCluster": f"{NAME}-ray", "serviceAccount": f"{NAME}-workload"}
    assert st["slice"]["hosts"] == 4 and st["slice"]["devices"] == 16 and st["slice"]["rayAcceleratorType"] == "TPU-V6E"
    assert st["startTime"] == st["phaseTransitionTime"] == "2026-01-01T12:00:00Z"
    assert [x["type"] for x in st["conditions"]] == ["SliceProvisioned", "CollectivesVerified", "TrainingSucceeded",
                                                      "Ready", "Failed"]
    assert d.requeue_after == 1800
    assert "verification" not in st and "training" not in st


def test_status_owned_keys_only_workload_keys_untouched():
    o = make()
    o["status"] = {"training": {"loss": 1.5}, "verification": {"passed": True}}
    d = phases.decide(o, Observed(), at(0), TUN)
    assert "training" not in d.patch and "verification" not in d.patch
    assert apply(o, d)["status"]["training"] == {"loss": 1.5}


@pytest.mark.parametrize("obs,provisioned", [
    (cluster(0), False),
    (cluster(3, state="ready"), False),                 # state ready but 3/4 hosts
    (cluster(4, state="ready"), True),                  # pre-v1.7 signal
    (cluster(4, provisioned=True), True),               # KubeRay v1.7.0 condition
    (cluster(0, provisioned=True), False),             # the condition stays True after pods are lost
    (ClusterObs(f"{NAME}-ray", {"conditions": [{"type": "RayClusterProvisioned", "status": "False"}]}), False),
    # right after a resume: KubeRay has not looked at the new spec yet (observedGeneration 2 < 3)
    (ClusterObs(f"{NAME}-ray", {**cluster(4, provisioned=True).status, "observedGeneration": 2}, generation=3), False),
    (ClusterObs(f"{NAME}-ray", {**cluster(4, provisioned=True).status, "observedGeneration": 3}, generation=3), True),
    (ClusterObs(f"{NAME}-ray", {"state": "ready", "readyWorkerReplicas": 4, "desiredWorkerReplicas": 4, "conditions": [
        {"type": "RayClusterSuspending", "status": "True"}]}), False),
])
def test_provisioned_signals(obs, provisioned):
    o = run_to(make(), Phase.PROVISIONING)
    d = phases.decide(o, Observed(obs), at(5), TUN)
    assert (d.phase == "VerifyingCollectives") is provisioned
    if provisioned:
        assert kinds(d) == [("create", "RayJob", f"{NAME}-verify")]
        assert cond(d, c.Condition.SLICE_PROVISIONED)["status"] == "True"
        assert d.status["children"]["verifyJob"] == f"{NAME}-verify"


def test_provisioning_progress_written_once():
    o = run_to(make(), Phase.PROVISIONING)
    d = phases.decide(o, Observed(cluster(2)), at(5), TUN)
    assert "2/4 worker hosts ready" in d.status["message"] and d.patch and set(d.patch) <= {"message", "conditions"}
    o = apply(o, d)
    d2 = phases.decide(o, Observed(cluster(2)), at(9), TUN)
    assert d2.patch is None and d2.events == () and d2.actions == ()
    assert d2.requeue_after == pytest.approx(1800 - 9)


@pytest.mark.parametrize("elapsed,failed", [(1799, False), (1800, True), (5000, True)])
def test_provisioning_timeout_at_the_bound(elapsed, failed):
    o = run_to(make(), Phase.PROVISIONING)
    d = phases.decide(o, Observed(cluster(0)), at(elapsed), TUN)
    assert (d.phase == "Failed") is failed
    if failed:
        m = d.status["message"]
        assert d.status["reason"] == "ProvisioningTimeout"
        assert "0/4 worker hosts ready" in m and "after 1800s" in m and "4x4" in m and "tpu-v6e-slice" in m
        assert cond(d, c.Condition.SLICE_PROVISIONED)["reason"] == "ProvisioningTimeout"
        assert d.events[0].type == "Warning" and d.events[0].reason == "ProvisioningTimeout"
        assert d.status["completionTime"] == observed.fmt_time(at(elapsed))
        assert d.actions == ()


def test_replica_failure_is_reported_in_the_timeout_message():
    o = run_to(make(provisioningTimeoutSeconds=10), Phase.PROVISIONING)
    obs = cluster(0)
    obs.status["conditions"] = [{"type": "ReplicaFailure", "status": "True", "message": "pods forbidden: quota"}]
    d = phases.decide(o, Observed(obs), at(10), TUN)
    assert d.status["reason"] == "ProvisioningTimeout" and "pods forbidden: quota" in d.status["message"]


def unschedulable(name: str = f"{NAME}-ray-worker-a", why: str = "0/8 nodes are available: 4 node(s) didn't "
                  "match Pod's node affinity/selector.") -> PodObs:
    return PodObs(name, cluster_uid="rc-1", unschedulable=why)


def test_the_blocking_cause_is_in_status_while_provisioning_with_one_event_per_cause():
    o = run_to(make(provisioningTimeoutSeconds=100), Phase.PROVISIONING)
    d = phases.decide(o, Observed(cluster(0), pods=(unschedulable(),)), at(5), TUN)
    assert d.status["phase"] == "Provisioning"
    assert "cannot be scheduled: the scheduler says: 0/8 nodes are available" in d.status["message"]
    assert "the scheduler says" in cond(d, c.Condition.SLICE_PROVISIONED)["message"]
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "SliceBlocked")]
    o = apply(o, d)
    again = phases.decide(o, Observed(cluster(0), pods=(unschedulable(),)), at(10), TUN)
    assert again.patch is None and again.events == ()          # same cause: no write, no event
    other = phases.decide(o, Observed(cluster(0), pods=(unschedulable(why="0/8 nodes: Insufficient google.com/tpu"),)),
                          at(15), TUN)
    assert other.patch and [e.reason for e in other.events] == ["SliceBlocked"]
    cleared = phases.decide(apply(o, other), Observed(cluster(1)), at(20), TUN)
    assert "the scheduler says" not in cleared.status["message"] and cleared.events == ()


def test_the_schedulers_reason_is_the_timeout_messages_cause():
    o = run_to(make(provisioningTimeoutSeconds=10), Phase.PROVISIONING)
    d = phases.decide(o, Observed(cluster(0), pods=(unschedulable(),)), at(10), TUN)
    assert d.status["reason"] == "ProvisioningTimeout"
    assert "the scheduler says: 0/8 nodes are available" in d.status["message"]
    assert any("the scheduler says" in e.message and e.reason == "ProvisioningTimeout" for e in d.events)


@pytest.mark.parametrize("phase,wants", [(None, True), (Phase.PENDING, True), (Phase.PROVISIONING, True),
                                         (Phase.VERIFYING, False), (Phase.TRAINING, False), (Phase.SUCCEEDED, False)])
def test_pods_are_read_only_while_the_slice_comes_up(phase, wants):
    o = make() if phase is None else {**make(), "status": {"phase": phase.value}}
    assert phases.wants_pods(o) is wants


def test_leftovers_of_a_deleted_object_of_the_same_name_hold_the_creates():
    d = phases.decide(make(), Observed(leftovers=(f"pod {NAME}-ray-head-x",)), T0, TUN)
    assert d.actions == () and d.status["phase"] == "Pending" and d.status["reason"] == "WaitingForPrevious"
    assert d.requeue_after == c.LEFTOVER_POLL_SECONDS
    d = phases.decide(apply(make(), d), Observed(), at(3), TUN)
    assert [a.kind for a in d.actions][-1] == "RayCluster" and d.status["phase"] == "Provisioning"


def test_leftovers_past_the_provisioning_timeout_fail_with_the_reason():
    o = make(provisioningTimeoutSeconds=10)
    o = apply(o, phases.decide(o, Observed(leftovers=("RayCluster ft-ray",)), T0, TUN))
    d = phases.decide(o, Observed(leftovers=("RayCluster ft-ray",)), at(10), TUN)
    assert d.status["phase"] == "Failed" and d.status["reason"] == "ProvisioningTimeout"
    assert "RayCluster ft-ray" in d.status["message"]


def test_cluster_suspended_by_someone_else_is_left_alone():
    """Without a queue label a suspended RayCluster is not Kueue's: said, never fought."""
    o = run_to(make(), Phase.PROVISIONING)
    d = phases.decide(o, Observed(cluster(0, suspended=True)), at(5), TUN)
    assert d.actions == () and d.phase == "Provisioning"
    assert "suspended, not by this operator" in d.status["message"]


def test_admission_rejected():
    o = make()
    err = AdmissionError("RayCluster", f"{NAME}-ray", 'admission webhook "kuberay-tpu-webhook" denied the request: '
                         "Number of workers in worker group not equal to specified topology")
    d = phases.decide(o, Observed(admission_error=err), at(0), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "AdmissionRejected"
    assert "denied the request" in d.status["message"] and d.actions == ()


def test_cluster_deleted_while_provisioning_is_recreated_with_the_same_deadline():
    o = run_to(make(), Phase.PROVISIONING)
    d = phases.decide(o, Observed(None), at(100), TUN)
    assert kinds(d) == [("create", "RayCluster", f"{NAME}-ray")] and d.phase == "Provisioning"
    assert [e.reason for e in d.events] == ["ChildDeleted"]
    assert phases.decide(apply(o, d), Observed(None), at(1800), TUN).status["reason"] == "ProvisioningTimeout"
