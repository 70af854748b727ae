"""tpuft.controller.phases.verification, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.api.spec import parse
from tpuft.controller import builders, phases
from tpuft.controller.observed import JobObs, Observed

from tests.unit.phases.clock import NAME, NS, TUN, at, cluster, cond, job, kinds, make, run_to, training, verifying


def test_verification_success_starts_training():
    o, n = verifying()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}),
                      at(30), TUN)
    assert d.phase == "Training" and kinds(d) == [("create", "RayJob", f"{NAME}-train")]
    assert d.actions[0].body == builders.build_train_job(parse(o), 0)
    assert cond(d, c.Condition.COLLECTIVES_VERIFIED)["status"] == "True"
    assert d.status["trainingAttempts"] == 1 and d.status["children"]["trainJob"] == f"{NAME}-train"


@pytest.mark.parametrize("status,reason", [
    ({"jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "reason": "AppFailed", "message": "rank 3 hung"},
     "VerificationFailed"),
    ({"jobStatus": "", "jobDeploymentStatus": "Failed", "reason": "SubmissionFailed"}, "VerificationFailed"),
    ({"jobStatus": "", "jobDeploymentStatus": "ValidationFailed", "message": "bad spec"}, "VerificationFailed"),
    ({"jobStatus": "RUNNING", "jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"}, "CollectiveTimeout"),
    ({"jobStatus": "STOPPED", "jobDeploymentStatus": "Complete"}, "VerificationFailed"),
])
def test_verification_failures_never_start_training(status, reason):
    o, n = verifying()
    o["status"]["verification"] = {"passed": False, "message": "all_reduce mismatch on host 2"}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: JobObs(n.verify_job, status)}), at(30), TUN)
    assert d.phase == "Failed" and d.status["reason"] == reason and d.actions == ()
    assert n.verify_job in d.status["message"] and "all_reduce mismatch on host 2" in d.status["message"]
    assert cond(d, c.Condition.COLLECTIVES_VERIFIED)["status"] == "False"
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "Unknown"


STORAGE_ERROR = ("checkpoint storage path gs://bkt/ckpt/team-a-ft-u-1 is not writable (403 Forbidden): principal "
                 "principal://iam.googleapis.com/.../subject/ns/team-a/sa/ft-workload lacks storage.objects.create")


@pytest.mark.parametrize("seconds", [5, 45])   # the verify job's check took seconds: status long before 120+60 s
def test_a_storage_failure_in_verification_fails_as_storage_naming_bucket_and_account(seconds):
    o, n = verifying(checkpoint={"storagePath": "gs://bkt/ckpt"})
    o["status"]["verification"] = {"passed": False, "message": f"storage check failed: {STORAGE_ERROR}",
                                   "storageError": STORAGE_ERROR}
    failed = {n.verify_job: job(n.verify_job, "FAILED", "Failed", reason="AppFailed")}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), failed), at(seconds), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "StorageNotWritable" and d.actions == ()
    assert STORAGE_ERROR in d.status["message"] and "gs://bkt/ckpt/team-a-ft-u-1" in d.status["message"]
    assert f"ServiceAccount {NS}/{NAME}-workload" in d.status["message"]
    assert cond(d, c.Condition.COLLECTIVES_VERIFIED)["reason"] == "StorageNotWritable"
    assert "CollectiveTimeout" not in d.status["message"] and "never joins" not in d.status["message"]


def test_a_verification_without_a_storage_error_still_fails_as_verification():
    o, n = verifying()
    o["status"]["verification"] = {"passed": False, "message": "all_reduce mismatch", "storageError": None}
    failed = {n.verify_job: job(n.verify_job, "FAILED", "Failed")}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), failed), at(30), TUN)
    assert d.status["reason"] == "VerificationFailed"


def test_a_storage_refusal_of_the_training_job_fails_as_storage_without_a_retry():
    o, n = training(training={"maxJobRetries": 2}, serviceAccountName="team-ksa")
    o["status"]["training"] = {"message": STORAGE_ERROR, "storageError": STORAGE_ERROR}
    failed = {n.train_job: job(n.train_job, "FAILED", "Failed")}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), failed), at(100), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "StorageNotWritable" and d.actions == ()
    assert STORAGE_ERROR in d.status["message"] and f"ServiceAccount {NS}/team-ksa" in d.status["message"]
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["reason"] == "StorageNotWritable"


def test_a_run_with_its_own_service_account_binds_it_and_creates_none():
    d = phases.decide(make(serviceAccountName="team-ksa"), Observed(), at(0), TUN)
    assert ("create", "ServiceAccount", f"{NAME}-workload") not in kinds(d)
    binding = next(a.body for a in d.actions if a.kind == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "team-ksa", "namespace": NS}]
    assert d.status["children"]["serviceAccount"] == "team-ksa"


@pytest.mark.parametrize("elapsed,failed", [(659, False), (660, True)])
def test_collective_timeout_at_timeout_plus_grace(elapsed, failed):
    o, n = verifying()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: job(n.verify_job)}), at(elapsed), TUN)
    assert (d.status["reason"] == "CollectiveTimeout") is failed
    if not failed:
        assert d.phase == "VerifyingCollectives" and d.requeue_after == pytest.approx(660 - elapsed)
    else:
        assert "600s" in d.status["message"] and "jobStatus=RUNNING" in d.status["message"]


def test_verification_disabled_goes_straight_to_training():
    o = run_to(make(verification={"enabled": False, "timeoutSeconds": 600}), Phase.TRAINING)
    assert cond(o, c.Condition.COLLECTIVES_VERIFIED)["reason"] == "VerificationSkipped"
    assert o["status"]["children"].get("verifyJob") is None


@pytest.mark.parametrize("phase", [Phase.VERIFYING, Phase.TRAINING])
def test_cluster_deleted_mid_run_fails_child_deleted(phase):
    o = run_to(make(), phase)
    d = phases.decide(o, Observed(None, {}), at(40), TUN)
    assert d.status["reason"] == "ChildDeleted" and f"{NAME}-ray" in d.status["message"] and d.actions == ()


@pytest.mark.parametrize("phase,job_name", [(Phase.VERIFYING, f"{NAME}-verify"), (Phase.TRAINING, f"{NAME}-train")])
def test_job_deleted_mid_run_fails_child_deleted(phase, job_name):
    o = run_to(make(), phase)
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {}), at(40), TUN)
    assert d.status["reason"] == "ChildDeleted" and job_name in d.status["message"]
