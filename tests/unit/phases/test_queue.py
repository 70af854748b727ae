"""tpuft.controller.phases.queue, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api import kueue
from tpuft.controller import builders, observed, phases
from tpuft.controller.observed import ClusterObs, Observed

from tests.unit.phases.clock import NAME, QUOTA, TUN, apply, at, cluster, cond, job, kinds, make, names, waiting


def queued(**spec) -> dict:
    o = make(**spec)
    o["metadata"]["labels"] = {kueue.KUEUE_QUEUE_LABEL: "local"}
    return o


def test_a_labelled_object_waits_queued_with_kueues_words_and_no_provisioning_clock():
    o = queued(provisioningTimeoutSeconds=60)
    d = phases.decide(o, Observed(), at(0), TUN)
    assert d.phase == "Queued" and d.status["reason"] == "Queued" and "LocalQueue local" in d.status["message"]
    assert cond(d, c.Condition.ADMITTED)["status"] == "False"
    body = next(a.body for a in d.actions if a.kind == "RayCluster")
    assert body["metadata"]["labels"][kueue.KUEUE_QUEUE_LABEL] == "local"
    o = apply(o, d)
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting()), at(3), TUN)
    assert d.phase == "Queued" and QUOTA in d.status["message"] and cond(d, c.Condition.ADMITTED)["message"] == QUOTA
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "Queued")]
    o = apply(o, d)
    again = phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting()), at(5000), TUN)
    assert again.patch is None and again.events == () and again.actions == ()   # queued long past 60 s: not failed
    assert again.requeue_after == c.QUEUE_POLL_SECONDS
    missing = phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting("LocalQueue local doesn't exist")),
                            at(5001), TUN)
    assert "LocalQueue local doesn't exist" in missing.status["message"] and len(missing.events) == 1


def test_admission_starts_the_provisioning_deadline():
    o = queued(provisioningTimeoutSeconds=60)
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting()), at(1000), TUN))
    admitted = observed.QueueObs(workload="raycluster-ft-ray-1a2b3", admitted=True)
    d = phases.decide(o, Observed(cluster(0), queue=admitted), at(2000), TUN)
    assert d.phase == "Provisioning" and d.status["phaseTransitionTime"] == observed.fmt_time(at(2000))
    assert cond(d, c.Condition.ADMITTED)["status"] == "True" and "raycluster-ft-ray-1a2b3" in cond(d, c.Condition.ADMITTED)["message"]
    o = apply(o, d)
    assert phases.decide(o, Observed(cluster(0)), at(2059), TUN).phase == "Provisioning"
    late = phases.decide(o, Observed(cluster(0)), at(2060), TUN)
    assert late.phase == "Failed" and late.status["reason"] == "ProvisioningTimeout"
    assert late.status["goodput"]["queuedSeconds"] == 2000 and late.status["goodput"]["provisioningSeconds"] == 60


def test_queue_timeout_fails_at_the_bound_only():
    o = queued(queueTimeoutSeconds=300)
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    assert phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting()), at(299), TUN).phase == "Queued"
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting()), at(300), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "QueueTimeout" and QUOTA in d.status["message"]
    assert "kubectl describe localqueue local" in d.status["message"]


def _labelled_training() -> tuple[dict, builders.ChildNames]:
    o = queued()
    n = names(o)
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(0)), at(1), TUN))            # admitted
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True)), at(2), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True),
                                           {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}), at(3), TUN))
    assert o["status"]["phase"] == "Training"
    return o, n


EVICTED = "Preempted: Preempted to accommodate a workload (UID: u-9) due to prioritization in the ClusterQueue"


@pytest.mark.parametrize("preemptions", [1, 3])
def test_a_preempted_run_waits_queued_and_resumes_the_same_attempt_never_slice_lost(preemptions):
    o, n = _labelled_training()
    o["spec"]["recovery"] = {"maxSliceReplacements": 0}   # a preemption read as a loss would fail it at once
    o["status"]["appliedSpec"]["recovery"] = {"maxSliceReplacements": 0}
    train = n.train_attempt(0)
    t = 10
    for i in range(1, preemptions + 1):
        o["status"]["training"] = {"step": 40 * i}
        # KubeRay deletes the pods of the suspended RayCluster: 0 hosts ready, which alone would read as a loss
        d = phases.decide(o, Observed(cluster(0, suspended=True), {train: job(train)}, queue=waiting(evicted=EVICTED)),
                          at(t), TUN)
        assert d.phase == "Queued" and d.status["reason"] == "Preempted" and EVICTED in d.status["message"]
        assert kinds(d) == []   # not yet: deleting the RayJob would stop its Ray job before the ranks save
        rec = d.status["recovery"]
        assert rec["preemptions"] == i and not rec.get("sliceReplacements") and not rec.get("history")
        assert rec["lastPreemption"] == {"time": observed.fmt_time(at(t)), "phase": "Training", "cause": EVICTED,
                                         "step": 40 * i}
        assert ("Warning", "Preempted") in [(e.type, e.reason) for e in d.events]
        o = apply(o, d)
        going = phases.decide(o, Observed(cluster(0, suspended=True), {train: job(train)}, queue=waiting()),
                              at(t + 2), TUN)
        assert kinds(going) == [] and going.status["reason"] == "Preempted"   # the pods still go (their preStop)
        assert QUOTA in going.status["message"]   # Kueue's words for why it waits now
        gone = ClusterObs(f"{NAME}-ray", {"conditions": [{"type": "RayClusterSuspended", "status": "True"}]}, True)
        still = phases.decide(o, Observed(gone, {train: job(train, "FAILED", "Failed")}, queue=waiting()),
                              at(t + 5), TUN)
        assert still.phase == "Queued" and still.status["reason"] == "Preempted"
        assert kinds(still) == [("delete", "RayJob", train)]   # KubeRay has deleted the pods: now it goes
        o = apply(o, still)
        o = apply(o, phases.decide(o, Observed(cluster(0)), at(t + 20), TUN))   # admitted again
        assert o["status"]["phase"] == "Provisioning" and "admitted again" in o["status"]["message"]
        o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True)), at(t + 30), TUN))
        assert o["status"]["phase"] == "VerifyingCollectives"   # the new slice is verified again
        d = phases.decide(o, Observed(cluster(4, provisioned=True),
                                      {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}), at(t + 40), TUN)
        assert d.phase == "Training" and kinds(d) == [("create", "RayJob", train)]   # same attempt: it resumes
        assert d.status["trainingAttempts"] == 1
        o = apply(o, d)
        t += 100
    assert o["status"]["goodput"]["queuedSeconds"] == 1 + 20 * preemptions   # first admission, then each wait


def test_a_preempted_runs_job_still_there_at_readmission_is_deleted_first():
    o, n = _labelled_training()
    train = n.train_attempt(0)
    o = apply(o, phases.decide(o, Observed(cluster(0, suspended=True), {train: job(train)},
                                           queue=waiting(evicted=EVICTED)), at(10), TUN))
    d = phases.decide(o, Observed(cluster(0), {train: job(train)}), at(12), TUN)   # admitted before it went
    assert d.phase == "Queued" and kinds(d) == [("delete", "RayJob", train)] and "admitted again" in d.status["message"]
    late = phases.decide(o, Observed(cluster(0, suspended=True), {train: job(train)}), at(10 + c.PREEMPTION_STOP_SECONDS),
                         TUN)
    assert kinds(late) == [("delete", "RayJob", train)]   # pods that never go: stopped anyway, bounded


# --- Kueue's ProvisioningRequest admission check: GKE flex-start with queued provisioning -------------------
CAPACITY = "Waiting for resources. Currently there are not enough resources available to fulfill the request."


WORKLOAD = "raycluster-ft-ray-1a2b3"


def capacity(state: str = "Pending", message: str = CAPACITY, **extra) -> observed.QueueObs:
    """A Workload holding quota whose ProvisioningRequest check is in `state`."""
    return observed.QueueObs(workload=WORKLOAD, quota_reserved=True,
                             checks=(observed.CheckObs("flex-start", state, message),), **extra)


def test_quota_reserved_then_waiting_for_capacity_in_the_provisioning_requests_words_off_the_provisioning_clock():
    o = queued(provisioningTimeoutSeconds=60, scheduling={"provisioning": "flexStart"})
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(0, suspended=True), queue=waiting()), at(1), TUN))
    assert o["status"]["reason"] == "Queued"
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=capacity()), at(2), TUN)
    assert d.phase == "Queued" and d.status["reason"] == "WaitingForCapacity"
    assert CAPACITY in d.status["message"] and "admission check flex-start is Pending" in d.status["message"]
    assert cond(d, c.Condition.ADMITTED)["reason"] == "WaitingForCapacity"
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "WaitingForCapacity")]
    o = apply(o, d)
    later = phases.decide(o, Observed(cluster(0, suspended=True), queue=capacity()), at(5000), TUN)
    assert later.patch is None and later.actions == ()   # waiting long past 60 s: not failed, no new event
    retry = phases.decide(o, Observed(cluster(0, suspended=True), queue=capacity(
        message="Retrying after booking expired: the booking expired")), at(5001), TUN)
    assert retry.status["reason"] == "WaitingForCapacity" and "booking expired" in retry.status["message"]
    d = phases.decide(o, Observed(cluster(0), queue=capacity("Ready", "Provisioning Request was successfully "
                                                                      "provisioned.", admitted=True)), at(6000), TUN)
    assert d.phase == "Provisioning" and d.status["phaseTransitionTime"] == observed.fmt_time(at(6000))
    o = apply(o, d)
    assert phases.decide(o, Observed(cluster(0)), at(6059), TUN).phase == "Provisioning"
    assert phases.decide(o, Observed(cluster(0)), at(6060), TUN).status["reason"] == "ProvisioningTimeout"


REVOKED = "CapacityRevoked: the flex-start nodes were reclaimed"


DEACTIVATED = ("DeactivatedDueToAdmissionCheck: The workload is deactivated due to Admission check(s): flex-start, "
               "were rejected")


def test_a_revoked_booking_mid_run_is_a_preemption_then_a_new_workload_and_the_same_attempt_resumes():
    o, n = _labelled_training()
    train = n.train_attempt(0)
    o["status"]["training"] = {"step": 40}
    # As Kueue v0.17.0 leaves it: deactivated, and the eviction has reset the rejected check to Pending
    rejected = capacity("Pending", "Reset to Pending after eviction. Previously: Rejected", active=False,
                        booking_lost=REVOKED, evicted=DEACTIVATED)
    d = phases.decide(o, Observed(cluster(0, suspended=True), {train: job(train)}, queue=rejected), at(10), TUN)
    assert d.phase == "Queued" and d.status["reason"] == "Preempted" and REVOKED in d.status["message"]
    assert kinds(d) == []   # the ranks save at their next step first (the pods' preStop)
    rec = d.status["recovery"]
    assert rec["preemptions"] == 1 and not rec.get("sliceReplacements")
    assert rec["lastPreemption"]["cause"] == REVOKED and rec["lastPreemption"]["step"] == 40
    o = apply(o, d)
    gone = ClusterObs(f"{NAME}-ray", {"conditions": [{"type": "RayClusterSuspended", "status": "True"}]}, True)
    d = phases.decide(o, Observed(gone, {train: job(train, "FAILED", "Failed")}, queue=rejected), at(15), TUN)
    assert kinds(d) == [("delete", "RayJob", train)]   # the stopped job first, as after a preemption
    o = apply(o, d)
    d = phases.decide(o, Observed(gone, queue=rejected), at(20), TUN)
    assert kinds(d) == [("delete", "RayCluster", n.cluster)] and d.status["reason"] == "Requeuing"
    assert REVOKED in d.status["message"] and ("Warning", "Preempted") in [(e.type, e.reason) for e in d.events]
    o = apply(o, d)
    still = phases.decide(o, Observed(gone, queue=rejected), at(21), TUN)   # terminating: once is enough
    assert kinds(still) == [] and still.events == () and still.patch is None
    d = phases.decide(o, Observed(), at(25), TUN)
    assert kinds(d) == [("create", "RayCluster", n.cluster)] and d.status["reason"] == "Preempted"
    assert not [e for e in d.events if e.reason == "ChildDeleted"]   # we deleted it: no warning about it
    o = apply(o, d)
    o = apply(o, phases.decide(o, Observed(cluster(0, suspended=True), queue=capacity()), at(30), TUN))
    assert o["status"]["reason"] == "Preempted" and CAPACITY in o["status"]["message"]
    o = apply(o, phases.decide(o, Observed(cluster(0)), at(40), TUN))
    assert o["status"]["phase"] == "Provisioning" and "admitted again" in o["status"]["message"]
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True)), at(50), TUN))
    assert o["status"]["phase"] == "VerifyingCollectives"
    d = phases.decide(o, Observed(cluster(4, provisioned=True),
                                  {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}), at(60), TUN)
    assert d.phase == "Training" and kinds(d) == [("create", "RayJob", train)] and d.status["trainingAttempts"] == 1
    assert d.status["recovery"]["preemptions"] == 1


def test_capacity_that_failed_for_good_fails_the_run_in_the_provisioning_requests_words():
    o = queued(scheduling={"provisioning": "flexStart"})
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    failed = capacity("Rejected", "TPU v6e 4x4 is not offered in this zone", active=False)
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=failed), at(5), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "CapacityRejected"
    assert "not offered in this zone" in d.status["message"] and "kubectl get provisioningrequests" in d.status["message"]
    reset = capacity("Pending", "Reset to Pending after eviction. Previously: Rejected", active=False,
                     evicted=DEACTIVATED)   # read after the eviction: the Workload's reason says it
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=reset), at(5), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "CapacityRejected" and DEACTIVATED in d.status["message"]


def test_a_workload_deactivated_by_someone_else_stays_queued():
    o = queued(scheduling={"provisioning": "flexStart"})
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    other = capacity("Pending", active=False, evicted="Deactivated: The workload is deactivated")
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=other), at(5), TUN)
    assert d.phase == "Queued" and kinds(d) == []


def test_a_rejected_check_whose_provisioning_requests_cannot_be_read_waits_and_says_why():
    o = queued(scheduling={"provisioning": "flexStart"})
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    d = phases.decide(o, Observed(cluster(0, suspended=True), queue=capacity("Rejected", active=False,
                                                                             booking_read=False)), at(5), TUN)
    assert d.phase == "Queued" and kinds(d) == [] and "provisioningrequests.autoscaling.x-k8s.io" in d.status["message"]


def test_kueue_not_installed_says_so_and_provisions():
    o = queued()
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    d = phases.decide(o, Observed(cluster(0), queue=observed.QueueObs(installed=False)), at(2), TUN)
    assert d.phase == "Provisioning" and "Kueue not installed" in d.status["message"]
    assert cond(d, c.Condition.ADMITTED)["reason"] == "KueueNotInstalled"
    assert ("Warning", "KueueNotInstalled") in [(e.type, e.reason) for e in d.events]


def test_unlabelled_objects_carry_no_admitted_condition():
    d = phases.decide(make(), Observed(), at(0), TUN)
    assert c.Condition.ADMITTED.value not in [x["type"] for x in d.status["conditions"]]


@pytest.mark.parametrize("phase,suspended,expected", [
    ("Queued", True, True), ("Queued", False, True), ("Training", True, True), ("Training", False, False),
    ("Suspended", True, False), ("Provisioning", True, True)])
def test_wants_queue(phase, suspended, expected):
    o = queued()
    o["status"] = {"phase": phase}
    assert phases.wants_queue(o, cluster(0, suspended=suspended)) is expected
    assert phases.wants_queue(o, None) is False
    assert phases.wants_queue(make() | {"status": {"phase": phase}}, cluster(0, suspended=suspended)) is False
