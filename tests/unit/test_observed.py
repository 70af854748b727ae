"""tpuft.controller.observed's table of child kinds (CHILD_KINDS): each row's field is an Observed field,
the status.children keys it reads are in the CRD's status schema, and the liveness rule; a failed
RayJob's message as status shows it, and a pod killed for memory (observed.memory_kill)."""
from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest

from tests.kuberay_standin import entrypoint_failed, memory_monitor_kill, train_controller_log
from tpuft.api import kuberay
from tpuft.api import crd
from tpuft.controller.diagnosis import OomKilled, PodObs
from tpuft.controller.kube import CUSTOM
from tpuft.controller.observed import (CHILD_KINDS, MAX_JOB_MESSAGE, ClusterObs, IndexedChild, JobObs, Killer, MemoryKill, QueueObs,
                            Observed, RayMemoryKill, ServiceObs, job_failure_detail, job_message, live, memory_kill)


def test_each_child_kind_observes_a_field_of_observed_named_in_the_crds_status_children():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    children = schema["properties"]["status"]["properties"]["children"]["properties"]
    fields = {f.name for f in dataclasses.fields(Observed)}
    for kind in CHILD_KINDS:
        assert kind.field in fields and set(kind.expected) <= set(children), kind.kind
        assert CUSTOM[kind.kind] == (kind.group, kind.version, kind.plural)   # the API calls use the same resource
    assert len({k.kind for k in CHILD_KINDS}) == len({k.field for k in CHILD_KINDS}) == len(CHILD_KINDS)


def test_live_children_are_ours_not_deleting_and_not_deleted_by_us():
    entries = [IndexedChild("a", owner_uid="u-1"), IndexedChild("b", deleting=True), IndexedChild("c", owner_uid="u-0"),
               IndexedChild("d"), IndexedChild("e")]
    assert list(live(entries, kuberay.RAYJOB_KIND, "u-1", {(kuberay.RAYJOB_KIND, "e"), (kuberay.RAYCLUSTER_KIND, "d")})) == ["a", "d"]


def test_each_row_turns_what_was_found_into_its_field():
    rows = {k.kind: k for k in CHILD_KINDS}
    cluster = IndexedChild("ft-ray", {"state": "ready"}, suspend=True, generation=2, uid="rc-1")
    assert rows[kuberay.RAYCLUSTER_KIND].observe({"ft-ray": cluster}, ("ft-ray",)) == \
        ClusterObs("ft-ray", {"state": "ready"}, True, 2, "rc-1")
    assert rows[kuberay.RAYCLUSTER_KIND].observe({"ft-ray": cluster}, (None,)) is None          # none expected
    assert rows[kuberay.RAYCLUSTER_KIND].observe({}, ("ft-ray",)) is None                       # expected, absent
    found = {"ft-verify": IndexedChild("ft-verify", {"jobStatus": "SUCCEEDED"}), "ft-old": IndexedChild("ft-old")}
    assert rows[kuberay.RAYJOB_KIND].observe(found, ("ft-verify", None)) == {   # every live one, expected or not
        "ft-verify": JobObs("ft-verify", {"jobStatus": "SUCCEEDED"}), "ft-old": JobObs("ft-old")}
    service = IndexedChild("ft-serve", {"x": 1})
    assert rows[kuberay.RAYSERVICE_KIND].observe({"ft-serve": service}, ("ft-serve",)) == ServiceObs("ft-serve", {"x": 1})


# --- a failed RayJob's message ------------------------------------------------------------------------
def failed(message: str, **status) -> JobObs:
    return JobObs("ft-train", {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "reason": "AppFailed",
                               "message": message, **status})


def test_a_failed_jobs_log_tail_and_colour_stay_out_of_status():
    log = train_controller_log(400, "\x1b[36m(TrainController pid=2211)\x1b[0m ray.train.WorkerGroupError: "
                                    "Training failed due to worker errors\n")
    job = failed(entrypoint_failed(log))
    assert len(job.status["message"]) > 20_000
    assert job_message(job) == ("Job entrypoint command failed with exit code 1", True)
    assert job_failure_detail(job, "tpuft logs ft -n team-a") == (
        "RayJob ft-train: jobDeploymentStatus=Failed jobStatus=FAILED, reason=AppFailed, Job entrypoint command "
        "failed with exit code 1; the full log: tpuft logs ft -n team-a")


@pytest.mark.parametrize("message,expected", [
    ("The RayJob has passed the activeDeadlineSeconds. ActiveDeadlineSeconds: 660",
     ("The RayJob has passed the activeDeadlineSeconds. ActiveDeadlineSeconds: 660", False)),
    ("\x1b[31mfailed to start\x1b[0m", ("failed to start", False)),
    ("[36m(TrainController pid=9)[0m boom\nTraceback ...", ("(TrainController pid=9) boom", True)),   # ESC lost
    ("x" * 1000, ("x" * (MAX_JOB_MESSAGE - 3) + "...", True)),
    ("", ("", False)),
])
def test_a_short_message_is_kept_and_a_long_one_cut(message, expected):
    assert job_message(failed(message)) == expected


def test_the_full_log_is_named_only_where_something_was_left_out():
    assert job_failure_detail(failed("bad spec"), "tpuft logs ft -n team-a").endswith("AppFailed, bad spec")


# --- killed for memory ----------------------------------------------------------------------------------
RAY_2_EARLIER = ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
                 "Memory on the node (IP: 10.4.1.8, ID: 7a2b) where the task (actor ID: 0c1d, name=RayTrainWorker."
                 "__init__, pid=415, memory used=180.02GB) was running was 190.12GB / 200.00GB (0.9506), which "
                 "exceeds the memory usage threshold of 0.95. Ray killed this worker (ID: 9e) because it was the "
                 "most recently scheduled task.")


@pytest.mark.parametrize("message,expected", [
    (memory_monitor_kill("10.4.1.7"), RayMemoryKill("10.4.1.7", "190.12GB", "200.00GB", "95.0%")),
    (RAY_2_EARLIER, RayMemoryKill("10.4.1.8", "190.12GB", "200.00GB", "0.95")),
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
     RayMemoryKill()),
    # Ray's guess about a worker that died is not a kill by its memory monitor
    ("Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits. Some common causes include: (1) "
     "the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called", None),
    ("Job entrypoint command failed with exit code 1", None),
])
def test_ray_memory_monitor_kills_are_read_from_the_jobs_message(message, expected):
    assert RayMemoryKill.of(entrypoint_failed(train_controller_log(50, message))) == expected


T_START = "2026-01-01T12:00:00Z"


def worker(name: str, *kills: str, ip: str = "10.4.1.9") -> PodObs:
    return PodObs(name, cluster_uid="rc-1", node_type="worker", ip=ip, memory_limit="200Gi",
                  oom_killed=tuple(OomKilled("ray-worker", at, "200Gi") for at in kills))


def test_the_kernels_first_kill_since_the_job_started_is_named():
    pods = (worker("w-b", "2026-01-01T12:05:00Z"), worker("w-a", "2026-01-01T12:06:00Z"), worker("w-c"))
    found = memory_kill(pods, failed("x", startTime=T_START))
    assert found == MemoryKill(Killer.KERNEL, pods[0], "200Gi", others=1)


def test_a_kill_before_the_job_started_is_an_earlier_jobs():
    pods = (worker("w-a", "2026-01-01T11:59:59Z"),)
    assert memory_kill(pods, failed("x", startTime=T_START)) is None
    assert memory_kill(pods, failed("x"), started=datetime(2026, 1, 1, 12, tzinfo=timezone.utc)) is None   # no startTime
    assert memory_kill(pods, failed("x")) is not None   # nothing to tell it by: named


def test_rays_memory_monitor_is_named_by_the_pod_with_its_nodes_ip():
    pods = (worker("w-a"), worker("w-b", ip="10.4.1.7"))
    found = memory_kill(pods, failed(entrypoint_failed(memory_monitor_kill("10.4.1.7")), startTime=T_START))
    assert found is not None and found.killer == Killer.RAY and found.pod == pods[1] and found.memory_limit == "200Gi"
    assert found.ray == RayMemoryKill("10.4.1.7", "190.12GB", "200.00GB", "95.0%")
    unknown = memory_kill(pods[:1], failed(entrypoint_failed(memory_monitor_kill("10.4.1.7"))))
    assert unknown is not None and unknown.pod is None and unknown.memory_limit == ""


def test_the_kernels_kill_comes_before_rays_words():
    pods = (worker("w-a", "2026-01-01T12:05:00Z"), worker("w-b", ip="10.4.1.7"))
    found = memory_kill(pods, failed(memory_monitor_kill("10.4.1.7"), startTime=T_START))
    assert found is not None and (found.killer, found.pod) == (Killer.KERNEL, pods[0])


# --- Kueue's Workload with an admission check (GKE's queued provisioning) ---------------------------------
WAITING = "Waiting for capacity: no v6e 4x4 slice in us-east5-a now; the request stays queued"


def _workload(state: str, message: str = "", active: bool = True, quota: bool = True) -> dict:
    return {"metadata": {"name": "raycluster-ft-ray-1a2b3"}, "spec": {"active": active},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "True" if quota else "False",
                                       "message": "" if quota else "insufficient quota"}],
                       "admissionChecks": [{"name": "flex-start", "state": state, "message": message}]}}


def _provreq(condition: str, name: str = "raycluster-ft-ray-1a2b3-flex-start-1", created: str = "2026-01-01T12:00:00Z",
             owner: str = "raycluster-ft-ray-1a2b3") -> dict:
    return {"metadata": {"name": name, "creationTimestamp": created,
                         "ownerReferences": [{"kind": "Workload", "name": owner}]},
            "status": {"conditions": [{"type": "Provisioned", "status": "True", "message": "done"},
                                      {"type": condition, "status": "True", "message": f"the {condition} message"}]}}


def test_queue_obs_reads_the_admission_checks_and_the_provisioning_requests_own_message():
    q = QueueObs.of(_workload("Pending", WAITING))
    assert q.quota_reserved and not q.admitted and q.waiting == ""
    assert q.pending_check is not None and q.pending_check.message == WAITING and q.pending_check.state == "Pending"
    assert q.rejected_check is None and q.active
    ready = QueueObs.of(_workload("Ready", "Provisioned"))
    assert ready.pending_check is None
    unreserved = QueueObs.of(_workload("Pending", quota=False))
    assert not unreserved.quota_reserved and unreserved.waiting == "insufficient quota"


@pytest.mark.parametrize("condition,lost", [("CapacityRevoked", True), ("BookingExpired", True), ("Failed", False)])
def test_a_rejected_checks_newest_provisioning_request_says_whether_the_booking_was_lost(condition, lost):
    older = _provreq("Failed" if lost else "CapacityRevoked", name="raycluster-ft-ray-1a2b3-flex-start-0",
                     created="2026-01-01T11:00:00Z")
    other = _provreq("CapacityRevoked", owner="someone-else", created="2026-01-01T13:00:00Z")
    q = QueueObs.of(_workload("Rejected", "x", active=False), (older, _provreq(condition), other))
    assert q.rejected_check is not None and not q.active and q.booking_read
    assert q.booking_lost == (f"{condition}: the {condition} message" if lost else "")
    unread = QueueObs.of(_workload("Rejected", "x", active=False), None)
    assert not unread.booking_read and unread.booking_lost == ""


def test_a_check_rejected_is_seen_after_the_eviction_reset_it_to_pending():
    wl = _workload("Pending", "Reset to Pending after eviction. Previously: Rejected", active=False)
    wl["status"]["conditions"].append({"type": "Evicted", "status": "True", "reason": "DeactivatedDueToAdmissionCheck",
                                       "message": "The workload is deactivated due to Admission check(s): flex-start"})
    q = QueueObs.of(wl)
    assert q.rejected_check is None and q.check_rejected
    wl["status"]["conditions"][-1]["reason"] = "Deactivated"   # spec.active set false by someone: not a check
    assert not QueueObs.of(wl).check_rejected
    assert not QueueObs.of(_workload("Pending", WAITING)).check_rejected
