"""tpuft.controller.phases, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import copy

import pytest
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.observed import JobObs, Observed, Op

from tests.unit.phases.clock import NAME, TUN, apply, at, cluster, cond, job, kinds, make, names, run_to


# --- validation -----------------------------------------------------------------------------------
def test_invalid_spec_fails_naming_fields_and_creates_nothing():
    o = make(topology="3x3", slices=0)
    d = phases.decide(o, Observed(), at(0), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "InvalidSpec"
    assert "spec.slices" in d.status["message"] and "topology" in d.status["message"]
    assert d.actions == ()
    assert cond(d, c.Condition.FAILED)["status"] == "True" and cond(d, c.Condition.READY)["status"] == "False"
    assert [e.type for e in d.events] == ["Warning"]
    o = apply(o, d)
    again = phases.decide(o, Observed(), at(50), TUN)
    assert again.patch is None and again.events == () and again.actions == ()


def test_corrected_spec_after_invalid_starts_the_run():
    o = apply(make(topology="3x3"), phases.decide(make(topology="3x3"), Observed(), at(0), TUN))
    o["spec"]["topology"] = "4x4"
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(), at(10), TUN)
    assert d.phase == "Provisioning" and d.status["appliedGeneration"] == 2
    assert (Op.CREATE, "RayCluster", f"{NAME}-ray") in kinds(d)
    assert "completionTime" not in d.status and d.patch["completionTime"] is None


# --- spec changes mid-run --------------------------------------------------------------------------
def test_spec_change_is_recorded_and_never_half_applied():
    o = run_to(make(), Phase.PROVISIONING)
    n = names(o)
    applied = parse(o)
    o["spec"]["training"] = {"maxJobRetries": 0, "epochs": 9}
    o["spec"]["image"] = "img:2"
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(cluster(4, provisioned=True)), at(5), TUN)
    assert d.status["observedGeneration"] == 2 and d.status["appliedGeneration"] == 1
    assert "spec change ignored: spec.image, spec.training.epochs" in d.status["ignoredSpecChange"]["message"]
    assert d.status["ignoredSpecChange"]["fields"] == ["spec.image", "spec.training.epochs"]
    assert d.status["ignoredSpecChange"]["observedGeneration"] == 2
    assert "spec change ignored" not in d.status["message"]  # the phase's message stays the phase's
    assert [e.reason for e in d.events if e.type == "Warning"] == ["SpecChangeIgnored"]
    assert d.actions[0].body == builders.build_verify_job(applied)  # built from the applied spec
    o = apply(o, d)
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job)}), at(6), TUN))
    d2 = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job)}), at(7), TUN)
    assert d2.patch is None and d2.events == ()  # recorded once; the note does not grow
    assert d2.status["ignoredSpecChange"] == d.status["ignoredSpecChange"]
    assert "spec change ignored" not in d2.status["message"]
    o["spec"] = copy.deepcopy(o["status"]["appliedSpec"])  # reverted: the note goes away
    o["metadata"]["generation"] = 3
    d3 = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job)}), at(7), TUN)
    assert "ignoredSpecChange" not in d3.status and d3.status["observedGeneration"] == 3
    assert d3.patch["ignoredSpecChange"] is None  # removed from the stored status


def test_invalid_spec_edit_mid_run_is_ignored():
    o = run_to(make(), Phase.PROVISIONING)
    o["spec"]["topology"] = "3x3"
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(cluster(1)), at(5), TUN)
    assert d.phase == "Provisioning" and "new spec is invalid" in d.status["ignoredSpecChange"]["message"]
    assert d.status["ignoredSpecChange"]["valid"] is False


# --- stability -------------------------------------------------------------------------------------
def test_condition_transition_times_only_move_when_status_changes():
    o = make()
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    ready0 = cond(o, c.Condition.READY)
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True)), at(20), TUN))
    assert cond(o, c.Condition.READY)["lastTransitionTime"] == ready0["lastTransitionTime"]
    assert cond(o, c.Condition.READY)["reason"] == "Verifying"
    assert cond(o, c.Condition.SLICE_PROVISIONED)["lastTransitionTime"] == observed.fmt_time(at(20))
    n = names(o)
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job, "SUCCEEDED",
                                                                                            "Complete")}), at(40), TUN))
    assert cond(o, c.Condition.SLICE_PROVISIONED)["lastTransitionTime"] == observed.fmt_time(at(20))
    assert cond(o, c.Condition.COLLECTIVES_VERIFIED)["lastTransitionTime"] == observed.fmt_time(at(40))
    assert o["status"]["phaseTransitionTime"] == observed.fmt_time(at(40))


@pytest.mark.parametrize("phase", [Phase.PROVISIONING, Phase.VERIFYING, Phase.TRAINING])
def test_steady_state_writes_nothing(phase):
    o = run_to(make(), phase)
    n = names(o)
    verify = job(n.verify_job) if phase == Phase.VERIFYING else job(n.verify_job, "SUCCEEDED", "Complete")
    jobs = {n.verify_job: verify, n.train_job: job(n.train_job)}
    obs = Observed(cluster(0) if phase == Phase.PROVISIONING else cluster(4, provisioned=True), jobs)
    o = apply(o, phases.decide(o, obs, at(1), TUN))
    d = phases.decide(o, obs, at(2), TUN)
    assert d.patch is None and d.events == () and d.actions == ()


@pytest.mark.parametrize("phase", [Phase.VERIFYING, Phase.TRAINING])
def test_one_status_write_per_phase_change_while_the_job_progresses(phase):
    """Entering the phase writes status once; the RayJob moving through KubeRay's states
    (no status yet, Initializing/PENDING, Running/RUNNING) writes nothing more."""
    o = run_to(make(), phase)
    n = names(o)
    name = n.verify_job if phase == Phase.VERIFYING else n.train_job
    done = {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")} if phase == Phase.TRAINING else {}
    for t, st in enumerate([{}, {"jobDeploymentStatus": "Initializing"},
                            {"jobDeploymentStatus": "Running", "jobStatus": "PENDING"},
                            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}], start=1):
        d = phases.decide(o, Observed(cluster(4, provisioned=True), {**done, name: JobObs(name, st)}), at(t), TUN)
        assert d.patch is None, (st, d.patch)


def test_decide_is_idempotent_when_the_status_write_was_lost():
    """Operator died after acting, before writing: the same creates again (409 -> adopt)."""
    o = run_to(make(), Phase.PROVISIONING)
    obs = Observed(cluster(4, provisioned=True))
    assert kinds(phases.decide(o, obs, at(3), TUN)) == kinds(phases.decide(o, obs, at(4), TUN))


def test_note_error_keeps_phase_and_pending_times_out():
    o = make()
    p = phases.note_error(o, "create RayCluster team-a/ft-ray: 500 etcd timeout", at(0))
    assert p["phase"] == "Pending" and "etcd timeout" in p["message"]
    o["status"] = p
    assert phases.note_error(o, "create RayCluster team-a/ft-ray: 500 etcd timeout", at(1)) is None
    d = phases.decide(o, Observed(), at(1800), TUN)
    assert d.status["reason"] == "ProvisioningTimeout" and "etcd timeout" in d.status["message"]
    assert d.status["trainingAttempts"] == 0  # the same shape as a timeout after the creates
    d = phases.decide(o, Observed(), at(100), TUN)
    assert d.phase == "Provisioning" and len(d.actions) == 5


def test_applied_spec_that_no_longer_parses_fails_instead_of_crashing():
    o = run_to(make(), Phase.PROVISIONING)
    o["status"]["appliedSpec"]["topology"] = "3x3"
    d = phases.decide(o, Observed(cluster(0)), at(5), TUN)
    assert d.status["reason"] == "InvalidSpec" and "no longer validates" in d.status["message"]


def test_timeouts_never_fire_early_when_the_phase_starts_mid_second():
    """Stored times have whole-second resolution; rounding down would fail a run up to 1 s early."""
    o = make(provisioningTimeoutSeconds=10)
    o = apply(o, phases.decide(o, Observed(), at(0.7), TUN))
    assert phases.decide(o, Observed(cluster(0)), at(10.6), TUN).status["phase"] == Phase.PROVISIONING.value
    assert phases.decide(o, Observed(cluster(0)), at(11.0), TUN).status["phase"] == Phase.FAILED.value
