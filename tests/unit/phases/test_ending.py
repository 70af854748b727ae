"""tpuft.controller.phases.ending, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.controller import phases
from tpuft.controller.observed import Observed

from tests.unit.phases.clock import NAME, TUN, apply, at, cluster, cond, job, kinds, make, run_to, training


# --- suspend ----------------------------------------------------------------------------------------
def test_suspend_and_resume_in_provisioning():
    o = run_to(make(), Phase.PROVISIONING)
    o["spec"]["suspend"] = True
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(cluster(0)), at(50), TUN)
    assert d.phase == "Suspended" and kinds(d) == [("suspend", "RayCluster", f"{NAME}-ray")]
    assert not any(e.reason == "SpecChangeIgnored" for e in d.events)  # suspend is live, not a spec change
    o = apply(o, d)
    assert phases.decide(o, Observed(cluster(0, suspended=True)), at(5000), TUN).patch is None  # no clock while suspended
    o["spec"]["suspend"] = False
    o["metadata"]["generation"] = 3
    d = phases.decide(o, Observed(cluster(0, suspended=True)), at(6000), TUN)
    assert d.phase == "Provisioning" and kinds(d) == [("resume", "RayCluster", f"{NAME}-ray")]
    o = apply(o, d)
    assert phases.decide(o, Observed(cluster(0)), at(6000 + 1799), TUN).phase == "Provisioning"
    assert phases.decide(o, Observed(cluster(0)), at(6000 + 1800), TUN).status["reason"] == "ProvisioningTimeout"


def test_suspend_during_training_resumes_same_attempt_after_reverification():
    o, n = training()
    o["spec"]["suspend"] = True
    jobs = {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete"), n.train_job: job(n.train_job)}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(50), TUN)
    assert d.phase == "Suspended"
    # the jobs go first (KubeRay's finalizer stops the Ray job while the head is up), then the cluster
    assert kinds(d) == [("delete", "RayJob", n.train_job), ("delete", "RayJob", n.verify_job)]
    o = apply(o, d)
    going = phases.decide(o, Observed(cluster(4, provisioned=True), jobs_deleting=(n.train_job,)), at(55), TUN)
    assert going.actions == () and going.patch is None
    d = phases.decide(o, Observed(cluster(4, provisioned=True)), at(58), TUN)
    assert kinds(d) == [("suspend", "RayCluster", f"{NAME}-ray")]
    assert cond(d, c.Condition.SLICE_PROVISIONED)["message"] == "RayCluster suspended"
    o = apply(o, d)
    o["spec"]["suspend"] = False
    o = apply(o, phases.decide(o, Observed(cluster(0, suspended=True)), at(60), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True)), at(70), TUN))
    assert o["status"]["phase"] == "VerifyingCollectives"
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}),
                      at(80), TUN)
    assert d.phase == "Training" and kinds(d) == [("create", "RayJob", n.train_job)]
    assert d.status["trainingAttempts"] == 1


def test_created_suspended():
    o = make(suspend=True)
    d = phases.decide(o, Observed(), at(0), TUN)
    assert d.phase == "Suspended" and d.actions[-1].body["spec"]["suspend"] is True


def test_suspend_ignored_once_finished():
    o, n = training()
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED",
                                                                                             "Complete")}), at(10), TUN))
    o["spec"]["suspend"] = True
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {}), at(11), TUN)
    assert d.phase == "Succeeded" and d.actions == ()


# --- after the end: TTL ----------------------------------------------------------------------------
@pytest.mark.parametrize("elapsed,deleted", [(299, False), (300, True)])
def test_ttl_deletes_cluster(elapsed, deleted):
    o, n = training()
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED",
                                                                                             "Complete")}), at(100), TUN))
    d = phases.decide(o, Observed(cluster(4, provisioned=True)), at(100 + elapsed), TUN)
    assert (kinds(d) == [("delete", "RayCluster", f"{NAME}-ray")]) is deleted
    assert d.patch is None
    if not deleted:
        assert d.requeue_after == pytest.approx(1)
    assert phases.decide(o, Observed(None), at(100 + elapsed), TUN).actions == ()


def test_ttl_applies_live_from_the_spec():
    o = run_to(make(provisioningTimeoutSeconds=10), Phase.PROVISIONING)
    o = apply(o, phases.decide(o, Observed(cluster(0)), at(10), TUN))
    assert o["status"]["phase"] == "Failed"
    o["spec"]["ttlSecondsAfterFinished"] = 0
    d = phases.decide(o, Observed(cluster(0)), at(10), TUN)
    assert kinds(d) == [("delete", "RayCluster", f"{NAME}-ray")]
