"""tpuft.controller.phases.recovery, pure and on a fixed clock: the decisions of this phase group
(tests/unit/phases/clock.py drives an object there)."""
from __future__ import annotations

import pytest
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api.constants import Phase
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.diagnosis import OomKilled, PodObs
from tpuft.controller.observed import JobObs, Observed

from tests.kuberay_standin import entrypoint_failed, memory_monitor_kill, train_controller_log
from tests.unit.phases.clock import (
    NAME,
    NS,
    TUN,
    apply,
    at,
    cluster,
    cond,
    hosts_of,
    job,
    kinds,
    lost,
    make,
    names,
    run_to,
    training,
    verifying,
)


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
    (Phase.TRAINING, "train", {**FAILED_JOB, "jobStatus": "", "message": kuberay.RAYJOB_MESSAGE_JOB_NOT_FOUND}, 4, False),
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
