"""tpuft.controller.phases.jobs, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.observed import JobObs, Observed

from tests.unit.phases.clock import (
    NAME,
    SERVE_CPU,
    TUN,
    apply,
    at,
    cluster,
    cond,
    job,
    kinds,
    lost,
    make,
    names,
    rayservice,
    run_to,
    training,
    verifying,
)


@pytest.mark.parametrize("status,finishing,settled", [
    ({"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Running"}, True, False),
    ({"jobStatus": "FAILED", "jobDeploymentStatus": "Running"}, True, False),
    ({"jobStatus": "STOPPED", "jobDeploymentStatus": "Running"}, True, False),
    ({"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}, False, True),
    ({"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"}, False, True),
    ({"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}, False, False),
    ({"jobStatus": "RUNNING", "jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"}, False, False),
    ({"jobStatus": "", "jobDeploymentStatus": "Failed", "reason": "SubmissionFailed"}, False, False),
    ({"jobStatus": "", "jobDeploymentStatus": "Failed", "reason": "AppFailed",   # lost: nothing of it runs
      "message": "Submitter completed but Ray job not found in RayCluster."}, False, True),
    ({}, False, False),
])
def test_what_counts_as_finishing_and_as_settled(status, finishing, settled):
    j = JobObs("j", status)
    assert (observed.job_finishing(j), observed.job_settled(j)) == (finishing, settled)


def test_a_succeeded_training_job_waits_for_kuberay_before_the_run_succeeds():
    o, n = training()
    obs = lambda deploy: Observed(cluster(4, provisioned=True), {  # noqa: E731
        n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete"), n.train_job: job(n.train_job, "SUCCEEDED", deploy)})
    d = phases.decide(o, obs("Running"), at(100), TUN)
    assert d.phase == "Training" and d.status["reason"] == "FinishingRayJob" and d.actions == ()
    assert d.status["message"] == (f"RayJob {n.train_job}: the job is SUCCEEDED; waiting for KubeRay to finish the "
                                   "RayJob (its submitter to exit) before succeeding")
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "True" and cond(d, c.Condition.READY)["status"] == "False"
    assert "completionTime" not in d.status and d.requeue_after == pytest.approx(60)
    o = apply(o, d)
    again = phases.decide(o, obs("Running"), at(130), TUN)
    assert again.patch is None and again.actions == () and again.requeue_after == pytest.approx(30)
    d = phases.decide(o, obs("Complete"), at(131), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "TrainingComplete" and d.actions == ()
    assert d.status["completionTime"] == observed.fmt_time(at(131))


def test_past_the_grace_the_unfinished_rayjob_is_deleted_and_the_run_succeeds():
    o, n = training()
    obs = Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED", "Running")})
    o = apply(o, phases.decide(o, obs, at(100), TUN))
    assert phases.decide(o, obs, at(159), TUN).phase == "Training"
    d = phases.decide(o, obs, at(160), TUN)
    assert d.phase == "Succeeded" and kinds(d) == [("delete", "RayJob", n.train_job)]
    assert ("Warning", "FinishingRayJob") in [(e.type, e.reason) for e in d.events]


def test_serving_releases_the_training_slice_only_once_kuberay_has_finished_the_rayjob():
    o, n = training(accelerator="cpu", topology="2", serve=dict(SERVE_CPU))
    slice_ = cluster(2, desired=2, provisioned=True)
    o = apply(o, phases.decide(o, Observed(slice_, {n.train_job: job(n.train_job, "SUCCEEDED", "Running")}), at(100), TUN))
    assert o["status"]["phase"] == "Training" and o["status"]["reason"] == "FinishingRayJob"
    assert o["status"]["message"].endswith("before releasing the slice to serve")
    d = phases.decide(o, Observed(slice_, {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}), at(104), TUN)
    assert d.phase == "Serving" and kinds(d) == [("delete", "RayCluster", n.cluster), ("create", "RayService", n.service)]


def test_past_the_grace_serving_starts_and_the_slice_goes_once_the_rayjob_has():
    o, n = training(accelerator="cpu", topology="2", serve=dict(SERVE_CPU))
    slice_ = cluster(2, desired=2, provisioned=True)
    stuck = Observed(slice_, {n.train_job: job(n.train_job, "SUCCEEDED", "Running")})
    o = apply(o, phases.decide(o, stuck, at(100), TUN))
    d = phases.decide(o, stuck, at(160), TUN)
    assert d.phase == "Serving" and kinds(d) == [("delete", "RayJob", n.train_job), ("create", "RayService", n.service)]
    assert "once its RayJobs are gone" in d.status["message"]
    o = apply(o, d)
    going = Observed(slice_, jobs_deleting=(n.train_job,), service=rayservice("DEPLOYING"))
    held = phases.decide(o, going, at(170), TUN)
    assert held.phase == "Serving" and held.actions == ()
    gone = phases.decide(o, Observed(slice_, service=rayservice("DEPLOYING")), at(175), TUN)
    assert kinds(gone) == [("delete", "RayCluster", n.cluster)]
    # KubeRay never lets the RayJob go (its finalizer stuck): the slice goes at twice the grace
    assert kinds(phases.decide(o, going, at(160 + 119), TUN)) == []
    assert kinds(phases.decide(o, going, at(160 + 120), TUN)) == [("delete", "RayCluster", n.cluster)]


@pytest.mark.parametrize("phase,reason", [(Phase.VERIFYING, "VerificationFailed"), (Phase.TRAINING, "TrainingFailed")])
def test_a_failed_job_ends_the_run_only_once_kuberay_has_finished_its_rayjob(phase, reason):
    o = run_to(make(), phase)
    n = names(o)
    name = n.verify_job if phase == Phase.VERIFYING else n.train_job
    done = {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")} if phase == Phase.TRAINING else {}
    obs = lambda deploy: Observed(cluster(4, provisioned=True), {**done, name: job(name, "FAILED", deploy)})  # noqa: E731
    d = phases.decide(o, obs("Running"), at(30), TUN)
    assert d.phase == phase.value and d.status["reason"] == "FinishingRayJob" and d.actions == ()
    assert d.status["message"].endswith(f"before failing with {reason}")
    ctype = c.Condition.COLLECTIVES_VERIFIED if phase == Phase.VERIFYING else c.Condition.TRAINING_SUCCEEDED
    assert cond(d, ctype)["status"] == "False" and cond(d, c.Condition.FAILED)["status"] == "False"
    o = apply(o, d)
    d = phases.decide(o, obs("Failed"), at(33), TUN)
    assert d.phase == "Failed" and d.status["reason"] == reason and d.actions == ()
    d = phases.decide(o, obs("Running"), at(90), TUN)   # KubeRay never finished it: deleted, the run fails
    assert d.phase == "Failed" and kinds(d) == [("delete", "RayJob", name)]


def test_a_failed_attempt_with_retries_left_is_resubmitted_without_waiting():
    o, n = training(training={"maxJobRetries": 1})
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "FAILED", "Running")}),
                      at(100), TUN)
    assert d.status["reason"] == "Retrying" and kinds(d) == [("create", "RayJob", n.train_attempt(1))]


def collective_timeout() -> tuple[dict, builders.ChildNames]:
    """Failed with CollectiveTimeout at 660 s: its verify job still RUNNING on the slice."""
    o, n = verifying()
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job)}), at(660), TUN))
    assert o["status"]["reason"] == "CollectiveTimeout"
    return o, n


def test_the_ttl_deletes_unfinished_rayjobs_first_then_the_cluster():
    o, n = collective_timeout()
    running = {n.verify_job: job(n.verify_job)}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), running), at(660 + 300), TUN)
    assert kinds(d) == [("delete", "RayJob", n.verify_job)] and d.events == () and d.patch is None
    held = phases.decide(o, Observed(cluster(4, provisioned=True), jobs_deleting=(n.verify_job,)), at(965), TUN)
    assert held.actions == () and held.requeue_after == pytest.approx(55)
    d = phases.decide(o, Observed(cluster(4, provisioned=True)), at(970), TUN)
    assert kinds(d) == [("delete", "RayCluster", n.cluster)] and [e.reason for e in d.events] == ["TTLExpired"]
    stuck = phases.decide(o, Observed(cluster(4, provisioned=True), jobs_deleting=(n.verify_job,)), at(960 + 120), TUN)
    assert kinds(stuck) == [("delete", "RayCluster", n.cluster)]


def test_the_ttl_keeps_finished_rayjobs_as_the_record():
    o, n = training(training={"maxJobRetries": 1})
    jobs = {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete"), n.train_job: job(n.train_job, "FAILED", "Failed"),
            n.train_attempt(1): job(n.train_attempt(1), "SUCCEEDED", "Complete")}
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(100), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(200), TUN))
    assert o["status"]["phase"] == "Succeeded"
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(500), TUN)
    assert kinds(d) == [("delete", "RayCluster", n.cluster)]


def test_a_finishing_rayjob_at_the_ttl_gets_the_grace_before_it_is_deleted():
    o, n = training(training={"maxJobRetries": 1})
    first = {n.train_job: job(n.train_job, "FAILED", "Running")}   # its submitter still following the logs
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), first), at(100), TUN))
    jobs = {**first, n.train_attempt(1): job(n.train_attempt(1), "SUCCEEDED", "Complete")}
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(101), TUN))
    o["spec"]["ttlSecondsAfterFinished"] = 0
    assert o["status"]["phase"] == "Succeeded"
    assert kinds(phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(130), TUN)) == []
    assert kinds(phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(161), TUN)) == [
        ("delete", "RayJob", n.train_job)]


def test_suspend_waits_at_most_twice_the_grace_for_the_rayjobs_to_go():
    o, n = training()
    o["spec"]["suspend"] = True
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job)}), at(50), TUN))
    assert cond(o, c.Condition.SLICE_PROVISIONED)["message"] == f"RayCluster suspended once RayJob {n.train_job} is gone"
    going = Observed(cluster(4, provisioned=True), jobs_deleting=(n.train_job,))
    assert phases.decide(o, going, at(50 + 119), TUN).actions == ()
    assert kinds(phases.decide(o, going, at(50 + 120), TUN)) == [("suspend", "RayCluster", n.cluster)]


def test_a_recovered_slice_waits_for_the_deleted_rayjobs_before_submitting_again():
    """KubeRay's submitter Job has the RayJob's name: a new RayJob created while the old one (and
    its submitter Job) is still going would take that Job for its own."""
    o = run_to(make(), Phase.TRAINING)
    n = names(o)
    o = apply(o, phases.decide(o, Observed(lost(3), {n.train_job: job(n.train_job)}), at(100), TUN))
    d = phases.decide(o, Observed(lost(4), jobs_deleting=(n.train_job,)), at(110), TUN)
    assert d.phase == "Provisioning" and d.actions == ()
    assert f"waiting for RayJob {n.train_job} (deleted before) to be gone before submitting again" in d.status["message"]
    d = phases.decide(apply(o, d), Observed(lost(4)), at(112), TUN)
    assert d.phase == "VerifyingCollectives"
    assert kinds(d) == [("create", "RayJob", n.verify_job), ("create", "RayJob", n.train_job)]   # beside it


# --- a RayJob KubeRay lost (observed.job_lost) -------------------------------------------------------
# KubeRay v1.6.2 (rayjob_controller.go, the Running case) fails a RayJob with reason AppFailed and
# this message once its submitter Job has completed while the dashboard answers 404 for the job id.
# No Ray job of it ended: it is resubmitted as a new RayJob after a backoff (TUN: 10 s, doubling),
# at most c.LOST_SUBMISSION_RETRIES times per run, not counted against training.maxJobRetries.
NOT_FOUND = "Submitter completed but Ray job not found in RayCluster."


def lost_job(name: str, job_status: str = "") -> JobObs:
    return job(name, job_status, "Failed", reason="AppFailed", message=NOT_FOUND)


@pytest.mark.parametrize("status,is_lost", [
    ({"jobStatus": "", "jobDeploymentStatus": "Failed", "reason": "AppFailed", "message": NOT_FOUND}, True),
    ({"jobDeploymentStatus": "Failed", "reason": "AppFailed", "message": NOT_FOUND}, True),
    ({"jobStatus": "RUNNING", "jobDeploymentStatus": "Failed", "reason": "AppFailed", "message": NOT_FOUND}, True),
    ({"jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "reason": "AppFailed", "message": NOT_FOUND}, False),
    ({"jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "reason": "AppFailed",
      "message": "Job entrypoint command failed with exit code 1"}, False),
    ({"jobStatus": "", "jobDeploymentStatus": "Failed", "reason": "SubmissionFailed",
      "message": "Job submission has failed. Reason: BackoffLimitExceeded."}, False),
    ({"jobStatus": "", "jobDeploymentStatus": "Running", "message": NOT_FOUND}, False),
])
def test_what_counts_as_a_lost_submission(status, is_lost):
    assert observed.job_lost(JobObs("j", status)) is is_lost


def test_a_lost_training_job_is_resubmitted_after_the_backoff_without_spending_a_retry():
    o, n = training()   # maxJobRetries 0
    slice_ = cluster(4, provisioned=True)
    verified = {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}
    obs = Observed(slice_, {**verified, n.train_job: lost_job(n.train_job)})
    d = phases.decide(o, obs, at(100), TUN)
    assert d.phase == "Training" and d.status["reason"] == "SubmissionLost" and d.actions == () and d.events == ()
    assert d.status["recovery"]["resubmit"] == {"rayJob": n.train_job, "seen": observed.fmt_time(at(100)),
                                                "at": observed.fmt_time(at(110))}
    assert d.status["message"] == (
        f"RayJob {n.train_job}: jobDeploymentStatus=Failed jobStatus=-, reason=AppFailed, {NOT_FOUND}; KubeRay lost "
        "the Ray job, not the workload failing (lost submission 1 of 3 in this run, not counted against "
        f"training.maxJobRetries); resubmitting as {n.train_attempt(1)} at {observed.fmt_time(at(110))}")
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "Unknown"
    assert cond(d, c.Condition.FAILED)["status"] == "False" and d.requeue_after == pytest.approx(10)
    o = apply(o, d)
    waiting = phases.decide(o, obs, at(105), TUN)
    assert waiting.patch is None and waiting.actions == () and waiting.requeue_after == pytest.approx(5)
    d = phases.decide(o, obs, at(110), TUN)
    assert kinds(d) == [("create", "RayJob", n.train_attempt(1))]
    assert d.actions[0].body == builders.build_train_job(parse(o), 1)
    assert d.status["trainingAttempts"] == 2 and d.status["children"]["trainJob"] == n.train_attempt(1)
    assert d.status["recovery"] == {"lostSubmissions": [{"time": observed.fmt_time(at(100)), "phase": "Training",
                                                         "rayJob": n.train_job, "resubmittedAs": n.train_attempt(1)}]}
    assert d.patch["recovery"]["resubmit"] is None   # removed on the server too
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "SubmissionLost")]
    assert f"resubmitted as {n.train_attempt(1)}, resuming from checkpoint" in d.events[0].message
    o = apply(o, d)
    jobs = {**obs.jobs, n.train_attempt(1): job(n.train_attempt(1))}
    d = phases.decide(o, Observed(slice_, jobs), at(120), TUN)
    assert d.status["message"] == f"training (RayJob {n.train_attempt(1)}, attempt 1 of 1)"
    o = apply(o, d)
    jobs[n.train_attempt(1)] = job(n.train_attempt(1), "FAILED", "Failed", reason="AppFailed", message="OOM")
    d = phases.decide(o, Observed(slice_, jobs), at(130), TUN)   # the workload's own failure: no retries left
    assert d.phase == "Failed" and d.status["reason"] == "TrainingFailed" and d.actions == ()
    assert d.status["message"].startswith("training failed after 1 attempt(s): ") and "OOM" in d.status["message"]
    assert "(1 more RayJob(s) resubmitted after a lost submission)" in d.status["message"]


@pytest.mark.parametrize("retries,then", [(0, "TrainingFailed"), (1, "Retrying")])
def test_lost_submissions_are_bounded_per_run_then_count_as_failed_attempts(retries, then):
    o, n = training(training={"maxJobRetries": retries})
    slice_ = cluster(4, provisioned=True)
    jobs: dict = {}
    t = 100
    for i, backoff in enumerate((10, 20, 40)):   # doubling with each loss in the run
        jobs[n.train_attempt(i)] = lost_job(n.train_attempt(i))
        d = phases.decide(o, Observed(slice_, dict(jobs)), at(t), TUN)
        assert d.status["reason"] == "SubmissionLost" and d.requeue_after == pytest.approx(backoff)
        assert f"lost submission {i + 1} of 3" in d.status["message"]
        o = apply(o, d)
        t += backoff
        d = phases.decide(o, Observed(slice_, dict(jobs)), at(t), TUN)
        assert kinds(d) == [("create", "RayJob", n.train_attempt(i + 1))]
        o = apply(o, d)
    assert [x["rayJob"] for x in o["status"]["recovery"]["lostSubmissions"]] == [n.train_attempt(i) for i in range(3)]
    jobs[n.train_attempt(3)] = lost_job(n.train_attempt(3))   # a fourth: a failed attempt like any other
    d = phases.decide(o, Observed(slice_, dict(jobs)), at(t + 1), TUN)
    assert d.status["reason"] == then and "resubmit" not in d.status["recovery"]
    if then == "Retrying":
        assert kinds(d) == [("create", "RayJob", n.train_attempt(4))]
        assert "(attempt 2 of 2)" in d.status["message"] and d.status["trainingAttempts"] == 5
    else:
        assert d.actions == () and "training failed after 1 attempt(s)" in d.status["message"]


def test_a_retry_and_a_lost_submission_each_take_their_own_budget():
    o, n = training(training={"maxJobRetries": 1})
    slice_ = cluster(4, provisioned=True)
    jobs = {n.train_job: job(n.train_job, "FAILED", "Failed", reason="AppFailed", message="preempted")}
    o = apply(o, phases.decide(o, Observed(slice_, dict(jobs)), at(100), TUN))
    assert o["status"]["reason"] == "Retrying" and "(attempt 2 of 2)" in o["status"]["message"]
    jobs[n.train_attempt(1)] = lost_job(n.train_attempt(1), "RUNNING")   # KubeRay had read it, then lost it
    o = apply(o, phases.decide(o, Observed(slice_, dict(jobs)), at(110), TUN))
    assert o["status"]["reason"] == "SubmissionLost"
    d = phases.decide(o, Observed(slice_, dict(jobs)), at(120), TUN)
    assert kinds(d) == [("create", "RayJob", n.train_attempt(2))]
    o = apply(o, d)
    jobs[n.train_attempt(2)] = job(n.train_attempt(2))
    assert phases.decide(o, Observed(slice_, dict(jobs)), at(130), TUN).status["message"] == (
        f"training (RayJob {n.train_attempt(2)}, attempt 2 of 2)")
    jobs[n.train_attempt(2)] = job(n.train_attempt(2), "FAILED", "Failed", reason="AppFailed")
    d = phases.decide(o, Observed(slice_, dict(jobs)), at(140), TUN)
    assert d.status["reason"] == "TrainingFailed" and "after 2 attempt(s)" in d.status["message"]


def test_a_lost_verify_job_is_replaced_by_a_fresh_one_with_its_own_deadline():
    o, n = verifying()
    slice_ = cluster(4, provisioned=True)
    fresh = n.verify_attempt(1)
    obs = Observed(slice_, {n.verify_job: lost_job(n.verify_job)})
    d = phases.decide(o, obs, at(500), TUN)
    assert d.phase == "VerifyingCollectives" and d.status["reason"] == "SubmissionLost" and d.actions == ()
    assert "lost submission 1 of 3 in this run)" in d.status["message"] and "maxJobRetries" not in d.status["message"]
    assert cond(d, c.Condition.COLLECTIVES_VERIFIED)["reason"] == "SubmissionLost"
    o = apply(o, d)
    d = phases.decide(o, obs, at(510), TUN)
    assert kinds(d) == [("create", "RayJob", fresh)] and d.actions[0].body == builders.build_verify_job(parse(o), 1)
    assert fresh == f"{NAME}-verify-r1" and d.status["children"]["verifyJob"] == fresh
    assert d.status["phaseTransitionTime"] == observed.fmt_time(at(510))
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "SubmissionLost")]
    o = apply(o, d)
    jobs = {**obs.jobs, fresh: job(fresh)}
    d = phases.decide(o, Observed(slice_, jobs), at(1169), TUN)   # 600 s + 60 s grace from the fresh job
    assert d.phase == "VerifyingCollectives" and d.status["message"].endswith(f"(RayJob {fresh})")
    o = apply(o, d)
    assert phases.decide(o, Observed(slice_, jobs), at(1170), TUN).status["reason"] == "CollectiveTimeout"
    jobs[fresh] = job(fresh, "SUCCEEDED", "Complete")
    d = phases.decide(o, Observed(slice_, jobs), at(600), TUN)
    assert d.phase == "Training" and kinds(d) == [("create", "RayJob", n.train_job)]
    assert d.status["trainingAttempts"] == 1   # verification's losses are not training attempts


def test_a_fresh_verify_job_after_a_lost_one_is_the_one_suspend_and_a_lost_host_stop():
    o, n = verifying()
    slice_ = cluster(4, provisioned=True)
    fresh = n.verify_attempt(1)
    obs = Observed(slice_, {n.verify_job: lost_job(n.verify_job)})
    o = apply(o, phases.decide(o, obs, at(100), TUN))
    o = apply(o, phases.decide(o, obs, at(110), TUN))
    running = Observed(slice_, {**obs.jobs, fresh: job(fresh)})
    d = phases.decide(o, Observed(lost(3), running.jobs), at(120), TUN)
    assert d.phase == "Provisioning" and kinds(d) == [("delete", "RayJob", fresh)]   # the lost one stays as the record
    o = apply(o, d)
    d = phases.decide(o, Observed(lost(4), obs.jobs), at(130), TUN)
    assert d.phase == "VerifyingCollectives" and kinds(d) == [("create", "RayJob", fresh)]
    o = apply(o, d)
    o["spec"]["suspend"] = True
    d = phases.decide(o, running, at(140), TUN)
    assert d.phase == "Suspended" and kinds(d) == [("delete", "RayJob", fresh)]


def test_suspending_while_a_lost_job_waits_drops_the_resubmission():
    o, n = training()
    obs = Observed(cluster(4, provisioned=True), {n.train_job: lost_job(n.train_job)})
    o = apply(o, phases.decide(o, obs, at(100), TUN))
    assert o["status"]["recovery"]["resubmit"]["rayJob"] == n.train_job
    o["spec"]["suspend"] = True
    d = phases.decide(o, obs, at(105), TUN)
    assert d.phase == "Suspended" and ("delete", "RayJob", n.train_job) in kinds(d)
    assert "recovery" not in d.status   # the resumed run verifies the slice, then submits the attempt again


def test_no_backoff_resubmits_at_once():
    o, n = training()
    obs = Observed(cluster(4, provisioned=True), {n.train_job: lost_job(n.train_job)})
    d = phases.decide(o, obs, at(100), observed.Tunables(verify_grace_seconds=60, resubmit_backoff_seconds=0))
    assert kinds(d) == [("create", "RayJob", n.train_attempt(1))] and "resubmit" not in d.status["recovery"]


def test_a_lost_rayjob_is_kept_as_the_record_at_the_ttl():
    o, n = training()
    jobs = {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete"), n.train_job: lost_job(n.train_job)}
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(100), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(110), TUN))
    jobs[n.train_attempt(1)] = job(n.train_attempt(1), "SUCCEEDED", "Complete")
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(200), TUN))
    assert o["status"]["phase"] == "Succeeded"
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs), at(500), TUN)
    assert kinds(d) == [("delete", "RayCluster", n.cluster)]
