"""tpuft.controller.phases.decide, pure: every transition and failure reason, timeouts at the bound,
condition stability, no-change -> no write, spec changes recorded and never half-applied."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone

import pytest

from tests.factories import merge_patch, small_object
from tests.kuberay_standin import entrypoint_failed, memory_monitor_kill, train_controller_log
from tpuft.controller import builders, observed, phases
from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.controller.diagnosis import OomKilled, PodObs, Waiting
from tpuft.controller.observed import AdmissionError, ClusterObs, JobObs, Observed, Op
from tpuft.api.spec import parse

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
TUN = observed.Tunables(verify_grace_seconds=60)
NAME, NS = "ft", "team-a"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make(**spec) -> dict:
    return small_object(NAME, NS, {"uid": "u-1", "generation": 1}, **{
        "provisioningTimeoutSeconds": 1800, "verification": {"enabled": True, "timeoutSeconds": 600},
        "ttlSecondsAfterFinished": 300, "training": {"maxJobRetries": 0}, **spec})


def names(o: dict) -> builders.ChildNames:
    return builders.names(parse(o))


def apply(o: dict, d: observed.Decision) -> dict:
    """What the API server holds after the handler writes d.patch (a JSON merge patch)."""
    o = copy.deepcopy(o)
    merge_patch(o.setdefault("status", {}), d.patch or {})
    return o


def cluster(ready: int = 0, desired: int = 4, provisioned: bool = False, state: str | None = None,
            suspended: bool = False, name: str = f"{NAME}-ray") -> ClusterObs:
    st: dict = {"readyWorkerReplicas": ready, "desiredWorkerReplicas": desired}
    if state:
        st["state"] = state
    if provisioned:
        st["conditions"] = [{"type": "RayClusterProvisioned", "status": "True", "reason": "AllPodRunningAndReadyFirstTime"}]
    return ClusterObs(name, st, suspended)


def job(name: str, job_status: str = "RUNNING", deploy: str = "Running", **extra) -> JobObs:
    return JobObs(name, {"jobStatus": job_status, "jobDeploymentStatus": deploy, **extra})


def cond(o_or_d, ctype: c.Condition) -> dict:
    status = o_or_d.status if isinstance(o_or_d, observed.Decision) else o_or_d["status"]
    return next(x for x in status["conditions"] if x["type"] == ctype.value)


def kinds(d: observed.Decision) -> list[tuple[str, str, str]]:
    return [(a.op, a.kind, a.name) for a in d.actions]


def hosts_of(o: dict) -> int:
    """Its worker hosts, over every slice."""
    tft = parse(o)
    return tft.spec.slice.hosts * tft.spec.slices


def run_to(o: dict, phase: Phase, t: float = 0) -> dict:
    """Drive a fresh object through the happy path up to `phase` (at time t for every step)."""
    n, hosts = names(o), hosts_of(o)
    o = apply(o, phases.decide(o, Observed(), at(t), TUN))
    if phase == Phase.PROVISIONING:
        return o
    o = apply(o, phases.decide(o, Observed(cluster(hosts, hosts, provisioned=True)), at(t), TUN))
    if phase == Phase.VERIFYING:
        return o
    if o["status"]["phase"] == Phase.VERIFYING.value:
        o = apply(o, phases.decide(o, Observed(cluster(hosts, hosts, provisioned=True),
                                               {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}), at(t), TUN))
    assert o["status"]["phase"] == phase.value
    return o


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


# --- verification ----------------------------------------------------------------------------------
def verifying(**spec) -> tuple[dict, builders.ChildNames]:
    o = run_to(make(**spec), Phase.VERIFYING)
    return o, names(o)


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


# --- training -------------------------------------------------------------------------------------
def training(**spec) -> tuple[dict, builders.ChildNames]:
    o = run_to(make(**spec), Phase.TRAINING)
    return o, names(o)


def test_training_success():
    o, n = training()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}),
                      at(100), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "TrainingComplete"
    assert cond(d, c.Condition.READY)["status"] == "True" and cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "True"
    assert cond(d, c.Condition.FAILED)["status"] == "False"
    assert d.status["completionTime"] == observed.fmt_time(at(100))
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "TrainingComplete")]
    assert d.requeue_after == 300


def test_training_failure_without_retries():
    o, n = training()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "FAILED", "Failed",
                      reason="AppFailed", message="OOM")}), at(100), TUN)
    assert d.status["reason"] == "TrainingFailed" and "OOM" in d.status["message"] and d.actions == ()


def test_training_retries_then_fails():
    o, n = training(training={"maxJobRetries": 2})
    jobs: dict = {}
    for attempt in range(3):
        name = n.train_attempt(attempt)
        assert o["status"]["trainingAttempts"] == attempt + 1 and o["status"]["children"]["trainJob"] == name
        jobs[name] = job(name, "FAILED", "Failed", reason="AppFailed")
        d = phases.decide(o, Observed(cluster(4, provisioned=True), dict(jobs)), at(100 + attempt), TUN)
        if attempt < 2:
            nxt = n.train_attempt(attempt + 1)
            assert kinds(d) == [("create", "RayJob", nxt)] and d.phase == "Training"
            assert d.status["reason"] == "Retrying" and [e.reason for e in d.events] == ["Retrying"]
            assert d.actions[0].body == builders.build_train_job(parse(o), attempt + 1)
            jobs[nxt] = job(nxt, "PENDING", "Initializing")
        else:
            assert d.status["reason"] == "TrainingFailed" and "after 3 attempt(s)" in d.status["message"]
            assert d.actions == ()
        o = apply(o, d)
    assert [n.train_attempt(i) for i in range(3)] == [f"{NAME}-train", f"{NAME}-train-r1", f"{NAME}-train-r2"]


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


# --- a lost host: replace the slice, verify again, resume -------------------------------------------
def lost(ready: int = 3, hosts: int = 4) -> ClusterObs:
    """KubeRay's status once a worker pod is gone: RayClusterProvisioned stays True."""
    return cluster(ready, hosts, provisioned=True)


@pytest.mark.parametrize("slices", [1, 2])
def test_a_host_lost_in_training_replaces_the_slice_then_verifies_and_resumes_the_same_attempt(slices):
    """One slice, or one host of one of two (issue 29): the whole run is verified again and resumes."""
    o = run_to(make(slices=slices), Phase.TRAINING)
    hosts = hosts_of(o)
    assert hosts == 4 * slices   # v6e 4x4: 4 hosts a slice
    n = names(o)
    o["status"]["training"] = {"step": 40, "loss": 1.2}
    train = n.train_attempt(0)
    d = phases.decide(o, Observed(lost(hosts - 1, hosts), {train: job(train)}), at(100), TUN)
    assert d.phase == "Provisioning" and d.status["reason"] == "ReplacingSlice"
    assert kinds(d) == [("delete", "RayJob", train)]
    assert d.status["phaseTransitionTime"] == observed.fmt_time(at(100))   # a fresh provisioning deadline
    rec = d.status["recovery"]
    assert rec["sliceReplacements"] == 1
    assert rec["history"] == [{"time": observed.fmt_time(at(100)), "phase": "Training",
                               "cause": f"{hosts - 1}/{hosts} worker hosts ready", "hostsReady": hosts - 1,
                               "hosts": hosts, "step": 40}]
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "ReplacingSlice")]   # one, a Warning
    assert cond(d, c.Condition.SLICE_PROVISIONED)["status"] == "False"
    o = apply(o, d)
    waiting = phases.decide(o, Observed(lost(hosts - 1, hosts)), at(110), TUN)   # still coming back
    assert waiting.phase == "Provisioning" and waiting.status["reason"] == "ReplacingSlice"
    assert "replacing the slice (1 of 2)" in waiting.status["message"] and waiting.actions == ()
    o = apply(o, waiting)
    d = phases.decide(o, Observed(lost(hosts, hosts)), at(120), TUN)   # whole again
    # verified again, the same attempt's training job submitted beside it (it resumes once verified)
    assert d.phase == "VerifyingCollectives"
    assert kinds(d) == [("create", "RayJob", n.verify_job), ("create", "RayJob", train)]
    assert d.actions[1].body == builders.build_train_job(parse(o), 0, after_verification=True)
    assert "--after-verification" in d.actions[1].body["spec"]["entrypoint"]
    o = apply(o, d)
    d = phases.decide(o, Observed(lost(hosts, hosts), {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete"),
                                                       train: job(train, "RUNNING")}), at(130), TUN)
    assert d.phase == "Training" and d.actions == ()   # it is already there
    assert d.status["trainingAttempts"] == 1 and d.status["recovery"]["sliceReplacements"] == 1
    failed = job(n.verify_job, "FAILED", "Failed", reason="AppFailed", message="rank 1 hung")
    d = phases.decide(o, Observed(lost(hosts, hosts), {n.verify_job: failed, train: job(train, "RUNNING")}),
                      at(130), TUN)
    assert d.phase == "Failed" and ("delete", "RayJob", train) in kinds(d)   # the waiting job goes too


def test_every_job_of_the_slice_is_stopped_when_a_host_goes():
    o = run_to(make(), Phase.TRAINING)
    n = names(o)
    train = n.train_attempt(0)
    verify = job(n.verify_job, "SUCCEEDED", "Complete")
    d = phases.decide(o, Observed(lost(2), {train: job(train), n.verify_job: verify}), at(100), TUN)
    assert sorted(kinds(d)) == sorted([("delete", "RayJob", n.verify_job), ("delete", "RayJob", train)])


def test_a_head_lost_in_verification_replaces_the_slice():
    o = run_to(make(), Phase.VERIFYING)
    n = names(o)
    head_down = cluster(4, provisioned=True)
    head_down.status["conditions"].append({"type": "HeadPodReady", "status": "False", "reason": "HeadPodNotFound"})
    d = phases.decide(o, Observed(head_down, {n.verify_job: job(n.verify_job)}), at(30), TUN)
    assert d.phase == "Provisioning" and d.status["reason"] == "ReplacingSlice"
    assert "the head pod is not ready (HeadPodNotFound)" in d.status["message"]
    assert kinds(d) == [("delete", "RayJob", n.verify_job)]


def test_one_loss_more_than_allowed_fails_with_slice_lost_and_the_history():
    o = run_to(make(recovery={"maxSliceReplacements": 1}), Phase.TRAINING)
    n = names(o)
    train = n.train_attempt(0)
    o = apply(o, phases.decide(o, Observed(lost(3), {train: job(train)}), at(100), TUN))
    o = apply(o, phases.decide(o, Observed(lost(4)), at(110), TUN))
    o = apply(o, phases.decide(o, Observed(lost(4), {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}),
                               at(120), TUN))
    assert o["status"]["phase"] == "Training"
    d = phases.decide(o, Observed(lost(1), {train: job(train)}), at(200), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "SliceLost"
    assert "maxSliceReplacements=1" in d.status["message"]
    assert d.status["recovery"]["sliceReplacements"] == 1
    assert [h["hostsReady"] for h in d.status["recovery"]["history"]] == [3, 1]
    assert cond(d, c.Condition.FAILED)["status"] == "True"


def test_no_replacement_allowed_fails_at_the_first_loss():
    o = run_to(make(recovery={"maxSliceReplacements": 0}), Phase.VERIFYING)
    n = names(o)
    d = phases.decide(o, Observed(lost(3), {n.verify_job: job(n.verify_job)}), at(30), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "SliceLost"
    assert kinds(d) == [("delete", "RayJob", n.verify_job)]   # not left on the broken slice


def test_a_replaced_slice_that_never_comes_back_times_out():
    o = run_to(make(provisioningTimeoutSeconds=60), Phase.TRAINING)
    train = names(o).train_attempt(0)
    o = apply(o, phases.decide(o, Observed(lost(3), {train: job(train)}), at(100), TUN))
    d = phases.decide(o, Observed(lost(3)), at(160), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ProvisioningTimeout"


def test_history_is_bounded():
    o = run_to(make(recovery={"maxSliceReplacements": 20}), Phase.VERIFYING)
    n = names(o)
    for i in range(c.RECOVERY_HISTORY_MAX + 3):
        o = apply(o, phases.decide(o, Observed(lost(3), {n.verify_job: job(n.verify_job)}), at(10 + 3 * i), TUN))
        o = apply(o, phases.decide(o, Observed(lost(4)), at(11 + 3 * i), TUN))
        assert o["status"]["phase"] == "VerifyingCollectives"
    rec = o["status"]["recovery"]
    assert rec["sliceReplacements"] == c.RECOVERY_HISTORY_MAX + 3 and len(rec["history"]) == c.RECOVERY_HISTORY_MAX


def test_a_run_that_has_finished_succeeds_even_if_a_host_goes_at_the_same_time():
    o = run_to(make(), Phase.TRAINING)
    train = names(o).train_attempt(0)
    d = phases.decide(o, Observed(lost(3), {train: job(train, "SUCCEEDED", "Complete")}), at(100), TUN)
    assert d.phase == "Succeeded" and d.actions == () and "recovery" not in d.status


# --- serving (spec.serve) ------------------------------------------------------------------------------
SERVE_CPU = {"enabled": True, "timeoutSeconds": 600}


def rayservice(app: str | None = None, message: str = "", ready: bool | None = None, side: str = "active",
               name: str = f"{NAME}-serve") -> observed.ServiceObs:
    """A RayService as KubeRay v1.7.0 reports it (applicationStatuses keyed by app name)."""
    st: dict = {}
    if app is not None:
        st[f"{side}ServiceStatus"] = {"applicationStatuses": {c.SERVE_APP_NAME: {"status": app, "message": message}}}
    if ready is not None:
        st["conditions"] = [{"type": "Ready", "status": "True" if ready else "False",
                             "reason": "NonZeroServeEndpoints" if ready else "Initializing"}]
    return observed.ServiceObs(name, st)


def served(t: float = 100, **spec) -> tuple[dict, builders.ChildNames, observed.Decision]:
    """A run that has just finished training with serving on (cpu: the transformers engine)."""
    o, n = training(accelerator="cpu", topology="2", serve=dict(SERVE_CPU), **spec)
    o["status"]["training"] = {"exportedModel": "gs://bucket/ck/run/export"}
    d = phases.decide(o, Observed(cluster(2, desired=2, provisioned=True),
                                  {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}), at(t), TUN)
    return apply(o, d), n, d


def test_training_success_with_serve_releases_the_training_slice_and_creates_the_rayservice():
    o, n, d = served()
    assert d.phase == "Serving" and d.status["reason"] == "Deploying"
    assert kinds(d) == [("delete", "RayCluster", n.cluster), ("create", "RayService", n.service)]
    body = d.actions[1].body
    assert "gs://bucket/ck/run/export" in body["spec"]["serveConfigV2"]   # what training reported it exported
    assert d.status["serving"]["service"] == f"{NAME}-serve-serve-svc" and d.status["serving"]["port"] == 8000
    assert d.status["serving"]["url"] == f"http://{NAME}-serve-serve-svc.{NS}.svc:8000"
    assert d.status["children"]["rayService"] == n.service
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["status"] == "True"
    assert cond(d, c.Condition.SERVING)["status"] == "False" and cond(d, c.Condition.READY)["status"] == "False"
    assert "completionTime" not in d.status   # Serving is not terminal


def test_serving_becomes_ready_when_the_app_is_running_and_writes_once():
    o, n, _ = served()
    d = phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(200), TUN)
    assert d.phase == "Serving" and d.status["reason"] == "Serving"
    assert cond(d, c.Condition.SERVING)["status"] == "True" and cond(d, c.Condition.READY)["status"] == "True"
    assert "notReadySince" not in d.status["serving"]
    assert d.patch["serving"]["notReadySince"] is None   # a merge patch removes a nested key by null only
    o = apply(o, d)
    assert "notReadySince" not in o["status"]["serving"]
    assert phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(300), TUN).patch is None
    assert not phases.wants_serve_pods(o)


@pytest.mark.parametrize("app,ready", [("DEPLOYING", None), ("RUNNING", False), ("DEPLOY_FAILED", False),
                                       ("UNHEALTHY", False), (None, None)])
def test_an_app_short_of_running_fails_serve_failed_at_the_bound_with_its_message(app, ready):
    o, n, _ = served(t=100)
    svc = rayservice(app, message="Deployment ChatDeployment: replica failed: model_source not found", ready=ready)
    early = phases.decide(o, Observed(service=svc), at(100 + 599), TUN)
    assert early.phase == "Serving" and early.requeue_after == pytest.approx(1)
    assert cond(early, c.Condition.READY)["status"] == "False"
    d = phases.decide(o, Observed(service=svc), at(100 + 600), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ServeFailed"
    assert "spec.serve.timeoutSeconds (600s)" in d.status["message"]
    if app:
        assert f"app llm {app}" in d.status["message"]
        assert "model_source not found" in d.status["message"]


def test_the_pending_clusters_app_status_is_read_before_there_is_an_active_one():
    o, _, _ = served()
    d = phases.decide(o, Observed(service=rayservice("DEPLOYING", "waiting for replicas", side="pending")), at(150), TUN)
    assert "app llm DEPLOYING: waiting for replicas" in d.status["message"]


def test_a_serving_pods_image_error_is_in_status_with_one_event():
    o, n, _ = served()
    assert phases.wants_serve_pods(o)
    pod = PodObs(name=f"{n.service}-raycluster-x-head", waiting=(
        Waiting("ray-head", "nope:1", "ErrImagePull", 'failed to pull "nope:1": not found'),))
    d = phases.decide(o, Observed(service=rayservice("NOT_STARTED"), pods=(pod,)), at(150), TUN)
    assert "ErrImagePull" in d.status["message"] and "nope:1" in d.status["message"]
    assert [e.reason for e in d.events if e.reason == c.Reason.SLICE_BLOCKED] == [c.Reason.SLICE_BLOCKED]
    o = apply(o, d)
    again = phases.decide(o, Observed(service=rayservice("NOT_STARTED"), pods=(pod,)), at(160), TUN)
    assert [e for e in again.events if e.reason == c.Reason.SLICE_BLOCKED] == []


def test_an_app_that_stops_running_gets_a_fresh_timeout_from_then():
    o, _, _ = served(t=100)
    o = apply(o, phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(200), TUN))
    o = apply(o, phases.decide(o, Observed(service=rayservice("UNHEALTHY", ready=False)), at(5000), TUN))
    assert o["status"]["phase"] == "Serving" and o["status"]["serving"]["notReadySince"] == observed.fmt_time(at(5000))
    assert cond(o, c.Condition.READY)["status"] == "False"
    d = phases.decide(o, Observed(service=rayservice("UNHEALTHY", ready=False)), at(5600), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ServeFailed"


def test_disabling_serve_deletes_the_rayservice_and_succeeds():
    o, n, _ = served()
    o = apply(o, phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(200), TUN))
    o["spec"]["serve"]["enabled"] = False
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(service=rayservice("RUNNING", ready=True)), at(300), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "ServeStopped"
    assert kinds(d) == [("delete", "RayService", n.service)]
    assert "serving" not in d.status and "ignoredSpecChange" not in d.status   # acted on, not ignored
    assert cond(d, c.Condition.READY)["status"] == "True" and cond(d, c.Condition.SERVING)["status"] == "False"


def test_serve_disabled_before_training_ends_succeeds_without_serving():
    o, n = training(accelerator="cpu", topology="2", serve=dict(SERVE_CPU))
    o["spec"]["serve"]["enabled"] = False
    d = phases.decide(o, Observed(cluster(2, desired=2, provisioned=True),
                                  {n.train_job: job(n.train_job, "SUCCEEDED", "Complete")}), at(100), TUN)
    assert d.phase == "Succeeded" and d.status["reason"] == "TrainingComplete" and kinds(d) == []


def test_enabling_serve_on_a_finished_run_is_recorded_as_ignored():
    o, n = training()
    o = apply(o, phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: job(n.train_job, "SUCCEEDED",
                                                                                             "Complete")}), at(100), TUN))
    o["spec"]["serve"] = {"enabled": True, "engine": "transformers"}
    o["metadata"]["generation"] = 2
    d = phases.decide(o, Observed(cluster(4, provisioned=True)), at(110), TUN)
    assert d.phase == "Succeeded" and d.status["ignoredSpecChange"]["fields"] == ["spec.serve"]


def test_the_rayservice_deleted_while_serving_fails_child_deleted():
    o, n, _ = served()
    d = phases.decide(o, Observed(service=None), at(150), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "ChildDeleted" and n.service in d.status["message"]


def test_a_failed_serve_keeps_the_rayservice_until_the_ttl():
    o, n, _ = served(t=100)
    o = apply(o, phases.decide(o, Observed(service=rayservice("DEPLOYING")), at(700), TUN))
    assert o["status"]["reason"] == "ServeFailed"
    assert phases.decide(o, Observed(service=rayservice("DEPLOYING")), at(700 + 299), TUN).actions == ()
    d = phases.decide(o, Observed(service=rayservice("DEPLOYING")), at(700 + 300), TUN)
    assert kinds(d) == [("delete", "RayService", n.service)]


def test_objects_that_do_not_serve_carry_no_serving_condition():
    o = run_to(make(), Phase.PROVISIONING)
    assert "Serving" not in [x["type"] for x in o["status"]["conditions"]]
    o = run_to(make(accelerator="cpu", topology="2", serve=dict(SERVE_CPU)), Phase.PROVISIONING)
    assert cond(o, c.Condition.SERVING)["status"] == "Unknown"


# --- a RayCluster's RayJobs go before it does ----------------------------------------------------------
# KubeRay (K8sJobMode) sets jobDeploymentStatus Complete/Failed only once the submitter Job, which
# follows the job's logs from the head, has finished: a RayCluster deleted (or suspended) before
# then leaves that Job Failed and the RayJob Running. TUN's grace: 60 s.


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


# --- Kueue: Queued, admitted, preempted ----------------------------------------------------------------
QUOTA = ("couldn't assign flavors to pod set workers: insufficient unused quota for google.com/tpu in flavor "
         "v6e-4x4, 16 more needed")


def queued(**spec) -> dict:
    o = make(**spec)
    o["metadata"]["labels"] = {c.KUEUE_QUEUE_LABEL: "local"}
    return o


def waiting(words: str = QUOTA, evicted: str = "") -> observed.QueueObs:
    return observed.QueueObs(workload="raycluster-ft-ray-1a2b3", waiting=words, evicted=evicted)


def test_a_labelled_object_waits_queued_with_kueues_words_and_no_provisioning_clock():
    o = queued(provisioningTimeoutSeconds=60)
    d = phases.decide(o, Observed(), at(0), TUN)
    assert d.phase == "Queued" and d.status["reason"] == "Queued" and "LocalQueue local" in d.status["message"]
    assert cond(d, c.Condition.ADMITTED)["status"] == "False"
    body = next(a.body for a in d.actions if a.kind == "RayCluster")
    assert body["metadata"]["labels"][c.KUEUE_QUEUE_LABEL] == "local"
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


# --- a worker killed for memory ------------------------------------------------------------------------
STARTED = observed.fmt_time(at(0))   # the RayJob's status.startTime
FULL_LOG = f"tpuft logs {NAME} -n {NS}"
ADVICE = (f"give the workers more memory (spec.resources.worker.limits.memory), a bigger slice, spec.training.method: "
          f"lora, or a smaller spec.training.batchSizePerDevice or maxSeqLength; the full log: {FULL_LOG}")


def oom_killed(name: str = f"{NAME}-ray-tpu-worker-x", killed_at: float | None = 50, replica: int = 0, host: int = 2,
               node_type: str = "worker", ip: str = "10.4.1.7") -> PodObs:
    """A Ray pod whose container the kernel's OOM killer ended killed_at seconds after T0 (None:
    never), restarted since (lastState)."""
    kills = (OomKilled("ray-worker", observed.fmt_time(at(killed_at)), "200Gi"),) if killed_at is not None else ()
    return PodObs(name, cluster_uid="rc-1", node_type=node_type, ip=ip, replica_index=replica, host_index=host,
                  memory_limit="200Gi", oom_killed=kills)


def failed_train(name: str, message: str = entrypoint_failed(train_controller_log(300, "RuntimeError: boom")),
                 started: str = STARTED) -> observed.JobObs:
    return job(name, "FAILED", "Failed", reason="AppFailed", message=message, startTime=started)


def test_a_worker_the_kernel_killed_for_memory_ends_the_run_out_of_memory():
    o, n = training()
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: failed_train(n.train_job)},
                                  pods=(oom_killed(),)), at(100), TUN)
    msg = (f"training failed after 1 attempt(s): RayJob {n.train_job}: worker pod {NS}/{NAME}-ray-tpu-worker-x "
           f"(host 2 of slice 0) was killed for memory by the kernel's OOM killer (limit 200Gi): {ADVICE}")
    assert d.phase == "Failed" and d.status["reason"] == "OutOfMemory" and d.status["message"] == msg
    assert (cond(d, c.Condition.TRAINING_SUCCEEDED)["reason"], cond(d, c.Condition.FAILED)["message"]) == ("OutOfMemory", msg)
    assert [(e.type, e.reason, e.message) for e in d.events] == [("Warning", "OutOfMemory", f"Failed: {msg}")]
    assert d.actions == ()


def test_rays_memory_monitor_names_the_worker_by_its_ip_and_says_the_threshold():
    o, n = training()
    message = entrypoint_failed(train_controller_log(300, memory_monitor_kill("10.4.1.7")))
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: failed_train(n.train_job, message)},
                                  pods=(oom_killed(killed_at=None), oom_killed("other", None, host=1, ip="10.4.1.6"))),
                      at(100), TUN)
    assert d.status["reason"] == "OutOfMemory"
    assert d.status["message"] == (
        f"training failed after 1 attempt(s): RayJob {n.train_job}: a worker process on worker pod "
        f"{NS}/{NAME}-ray-tpu-worker-x (host 2 of slice 0) was killed for memory by Ray's memory monitor (190.12GB "
        f"used of 200.00GB, over its threshold 95.0%, pod limit 200Gi): {ADVICE}")


# What the training driver reports (tpuft_workload.train.failure_message) when Ray Train's error carries
# Ray's memory monitor's kill: the job's own message may be KubeRay's first line only, without the log.
DRIVER_SAW_RAY_KILL = ("TrainingFailedError: Worker exit type: NODE_OUT_OF_MEMORY Worker exit detail: 1 worker(s) "
                       "were killed due to the node running low on memory. Memory on the node (IP: 10.4.1.7, ID: "
                       "5f3a0c9e1b7d4a2f8e6c) was 190.12GB used / 200.00GB limit (0.950600) OOM kill reason: Memory "
                       "usage 204142837760B exceeded threshold of 204010946560B (95.0% of 214748364800B limit)")


@pytest.mark.parametrize("reported_at,named", [(60, True), (-10, False)], ids=["this-job", "an-earlier-job"])
def test_rays_kill_the_driver_reported_is_named_when_the_job_message_has_no_log(reported_at, named):
    o, n = training()
    o["status"]["training"] = {"message": DRIVER_SAW_RAY_KILL, "updatedAt": observed.fmt_time(at(reported_at))}
    message = "Job entrypoint command failed with exit code 1"
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: failed_train(n.train_job, message)},
                                  pods=(oom_killed(killed_at=None),)), at(100), TUN)
    if not named:   # a report from before this job started is not this job's failure
        assert d.status["reason"] == "TrainingFailed" and "memory" not in d.status["message"]
        return
    assert d.status["reason"] == "OutOfMemory"
    assert d.status["message"] == (
        f"training failed after 1 attempt(s): RayJob {n.train_job}: a worker process on worker pod "
        f"{NS}/{NAME}-ray-tpu-worker-x (host 2 of slice 0) was killed for memory by Ray's memory monitor (190.12GB "
        f"used of 200.00GB, over its threshold 95.0%, pod limit 200Gi): {ADVICE}")


def test_a_lora_run_is_not_told_to_use_lora_and_a_killed_head_is_told_about_the_head():
    o, n = training(training={"maxJobRetries": 0, "method": "lora", "framework": "torch"})
    jobs = {n.train_job: failed_train(n.train_job)}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs, pods=(oom_killed(),)), at(100), TUN)
    assert d.status["message"].endswith(f"(limit 200Gi): give the workers more memory (spec.resources.worker.limits."
                                        f"memory), a bigger slice, or a smaller spec.training.batchSizePerDevice or "
                                        f"maxSeqLength; the full log: {FULL_LOG}")
    head = oom_killed(f"{NAME}-ray-head-x", node_type="head")
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs, pods=(head,)), at(100), TUN)
    assert d.status["message"].endswith(f"RayJob {n.train_job}: head pod {NS}/{NAME}-ray-head-x was killed for memory "
                                        f"by the kernel's OOM killer (limit 200Gi): give the head more memory "
                                        f"(spec.resources.head.limits.memory); the full log: {FULL_LOG}")


def test_an_attempt_killed_for_memory_is_retried_as_any_failed_one_and_an_older_kill_is_not_blamed():
    o, n = training(training={"maxJobRetries": 2})
    first, second = n.train_attempt(0), n.train_attempt(1)
    jobs = {first: failed_train(first)}
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs, pods=(oom_killed(),)), at(100), TUN)
    assert d.status["reason"] == "Retrying" and kinds(d) == [("create", "RayJob", second)]
    assert d.status["message"] == (f"RayJob {first}: worker pod {NS}/{NAME}-ray-tpu-worker-x (host 2 of slice 0) was "
                                   f"killed for memory by the kernel's OOM killer (limit 200Gi); resubmitted as {second} "
                                   "(attempt 2 of 3), resuming from checkpoint")
    o = apply(o, d)
    jobs[second] = failed_train(second, started=observed.fmt_time(at(110)))   # the kill at 50 was the first attempt's
    d = phases.decide(o, Observed(cluster(4, provisioned=True), jobs, pods=(oom_killed(),)), at(200), TUN)
    assert d.status["reason"] == "Retrying" and "killed for memory" not in d.status["message"]


def test_a_long_coloured_kuberay_message_reaches_status_short():
    o, n = training()
    log = train_controller_log(400, "\x1b[36m(TrainController pid=2211)\x1b[0m ray.train.WorkerGroupError: Training "
                                    "failed due to worker errors:\n[Rank 3 Error Snippet]: ValueError: bad batch\n")
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.train_job: failed_train(n.train_job, entrypoint_failed(log))}),
                      at(100), TUN)
    msg = (f"training failed after 1 attempt(s): RayJob {n.train_job}: jobDeploymentStatus=Failed jobStatus=FAILED, "
           f"reason=AppFailed, Job entrypoint command failed with exit code 1; the full log: {FULL_LOG}")
    assert d.status["reason"] == "TrainingFailed" and d.status["message"] == msg
    assert cond(d, c.Condition.TRAINING_SUCCEEDED)["message"] == msg and [e.message for e in d.events] == [f"Failed: {msg}"]


def test_a_verification_worker_killed_for_memory_is_told_only_about_the_limit():
    o, n = verifying()
    verify = job(n.verify_job, "FAILED", "Failed", reason="AppFailed", message="Job entrypoint command failed with "
                 "exit code 1. No logs available.", startTime=STARTED)
    d = phases.decide(o, Observed(cluster(4, provisioned=True), {n.verify_job: verify}, pods=(oom_killed(),)), at(100), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "OutOfMemory"
    assert d.status["message"] == (
        f"collective verification failed: RayJob {n.verify_job}: worker pod {NS}/{NAME}-ray-tpu-worker-x (host 2 of "
        f"slice 0) was killed for memory by the kernel's OOM killer (limit 200Gi): give the workers more memory "
        f"(spec.resources.worker.limits.memory); the full log: {FULL_LOG} --job verify")
    assert cond(d, c.Condition.COLLECTIVES_VERIFIED)["reason"] == "OutOfMemory"


def test_a_host_lost_to_the_oom_killer_is_replaced_as_any_lost_host_saying_why():
    o = run_to(make(recovery={"maxSliceReplacements": 1}), Phase.TRAINING)
    train = names(o).train_job
    d = phases.decide(o, Observed(lost(3), {train: job(train, startTime=STARTED)}, pods=(oom_killed(),)), at(100), TUN)
    why = (f"3/4 worker hosts ready; worker pod {NS}/{NAME}-ray-tpu-worker-x (host 2 of slice 0) was killed for memory "
           "by the kernel's OOM killer (limit 200Gi)")
    assert d.status["reason"] == "ReplacingSlice" and f"during Training ({why})" in d.status["message"]
    assert d.status["recovery"]["sliceReplacements"] == 1 and d.status["recovery"]["history"][0]["cause"] == why


def test_a_host_lost_to_the_oom_killer_once_too_often_ends_the_run_out_of_memory():
    o = run_to(make(recovery={"maxSliceReplacements": 0}), Phase.TRAINING)
    train = names(o).train_job
    d = phases.decide(o, Observed(lost(3), {train: job(train, startTime=STARTED)}, pods=(oom_killed(),)), at(100), TUN)
    assert d.phase == "Failed" and d.status["reason"] == "OutOfMemory"
    assert "maxSliceReplacements=0" in d.status["message"] and d.status["message"].endswith(f"kept; {ADVICE}")
    assert cond(d, c.Condition.SLICE_PROVISIONED)["reason"] == "OutOfMemory"
    d = phases.decide(o, Observed(lost(3), {train: job(train, startTime=STARTED)}), at(100), TUN)   # no kill seen
    assert d.status["reason"] == "SliceLost"


FAILED_JOB = {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "reason": "AppFailed"}


@pytest.mark.parametrize("phase,which,status,ready,wants", [
    (Phase.TRAINING, "train", FAILED_JOB, 4, True),
    (Phase.TRAINING, "train", {**FAILED_JOB, "jobDeploymentStatus": "Running"}, 4, True),   # KubeRay finishing it
    (Phase.TRAINING, "train", {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}, 4, False),
    (Phase.TRAINING, "train", {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}, 3, True),   # a host lost
    (Phase.TRAINING, "verify", FAILED_JOB, 4, False),   # not the current job
    (Phase.TRAINING, "train", {**FAILED_JOB, "jobStatus": "", "message": c.RAYJOB_MESSAGE_JOB_NOT_FOUND}, 4, False),
    (Phase.VERIFYING, "verify", FAILED_JOB, 4, True),
    (Phase.SUCCEEDED, "train", FAILED_JOB, 3, False),
])
def test_pods_are_read_after_a_running_slices_job_failed_or_a_host_was_lost(phase, which, status, ready, wants):
    o = run_to(make(), Phase.VERIFYING if phase == Phase.VERIFYING else Phase.TRAINING)
    o["status"]["phase"] = phase.value
    name = names(o).train_job if which == "train" else names(o).verify_job
    assert phases.wants_failure_pods(o, Observed(cluster(ready, provisioned=True), {name: JobObs(name, status)})) is wants


def test_a_spec_warning_is_a_warning_event_when_the_children_are_first_created():
    """An eval set the spec cannot tell apart from the training records (spec.spec_warnings): told
    once, as `tpuft validate` tells it, never refused."""
    o = make(dataset={"name": "d", "split": "train[:1000]"}, evaluation={"split": "train[-200:]"})
    d = phases.decide(o, Observed(), at(0), TUN)
    assert d.phase == "Provisioning"
    warned = [e for e in d.events if e.type == "Warning"]
    assert [e.reason for e in warned] == ["SpecWarning"]
    assert warned[0].message.startswith("warning: spec.evaluation.split: 'train[-200:]' may read records")
    again = phases.decide(apply(o, d), Observed(cluster=cluster()), at(5), TUN)
    assert [e for e in again.events if e.reason == c.Reason.SPEC_WARNING] == []
    assert [e for e in phases.decide(make(), Observed(), at(0), TUN).events if e.type == "Warning"] == []
