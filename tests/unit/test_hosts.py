"""A running slice's hosts as the pod watch shows them (tpuft.controller.hosts) and what phases.decide does with
them: a loss seen however fast KubeRay replaced the pod, counted once; a pod told to stop keeps its
job until the stop checkpoint is saved; GKE's maintenance notice asks for a checkpoint; with
spec.recovery.elastic, training goes on with the whole slices and comes back to all of them."""
from __future__ import annotations

import json
import shlex

import pytest

from tests.unit.phases.clock import NAME, TUN, apply, at, cluster, job, kinds, make, names
from tpuft.controller import hosts, observed, phases
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.hosts import NodeObs
from tpuft.controller.observed import Observed


def pod(name: str, uid: str, *, head: bool = False, replica: int | None = 0, phase: str = "Running",
        ready: bool | None = True, deleting: bool = False, node: str = "node-a") -> PodObs:
    return PodObs(name, cluster_uid="c-1", deleting=deleting, node_type="head" if head else "worker",
                  replica_index=None if head else replica, uid=uid, node=node, phase=phase, ready=ready)


def slice_pods(slices: int = 1, hosts_per_slice: int = 4, prefix: str = "w") -> tuple[PodObs, ...]:
    """The head and every worker, Running and Ready, each on its own node."""
    workers = tuple(pod(f"{NAME}-ray-{prefix}{s}-{h}", f"uid-{prefix}{s}-{h}", replica=s, node=f"node-{s}-{h}")
                    for s in range(slices) for h in range(hosts_per_slice))
    return (pod(f"{NAME}-ray-head", "uid-head", head=True, node="node-head"), *workers)


def replace_pod(pods: tuple[PodObs, ...], index: int, **change) -> tuple[PodObs, ...]:
    import dataclasses
    out = list(pods)
    out[index] = dataclasses.replace(out[index], **change)
    return tuple(out)


def train_with_pods(slices: int = 1, **spec) -> tuple[dict, tuple[PodObs, ...]]:
    """Drive a fresh object to Training with the pod watch showing the whole slice at each step."""
    o = make(slices=slices, **spec)
    n, whole = names(o), slice_pods(slices)
    workers = 4 * slices
    o = apply(o, phases.decide(o, Observed(), at(0), TUN))
    o = apply(o, phases.decide(o, Observed(cluster(workers, workers, provisioned=True), hosts=whole), at(1), TUN))
    assert o["status"]["phase"] == "VerifyingCollectives"
    assert o["status"]["recovery"]["slicePods"] == sorted(p.uid for p in whole)
    o = apply(o, phases.decide(o, Observed(cluster(workers, workers, provisioned=True),
                                           {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}, hosts=whole),
                               at(2), TUN))
    assert o["status"]["phase"] == "Training"
    return o, whole


# --- tpuft.controller.hosts, pure ----------------------------------------------------------------------------------
def test_the_node_keeps_only_what_is_noteworthy():
    ready = {"metadata": {"name": "n"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert not NodeObs.of(ready).noteworthy
    lost = {"metadata": {"name": "n"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting"}]}}
    assert NodeObs.of(lost).ready is None and NodeObs.of(lost).not_ready.startswith("NodeStatusUnknown")
    gone = {"metadata": {"name": "n"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert NodeObs.of(gone).noteworthy
    notice = {"metadata": {"name": "n", "labels": {hosts.GKE_SCHEDULED_MAINTENANCE_LABEL: "1765000000"}},
              "spec": {"taints": [{"key": hosts.GKE_IMPENDING_TERMINATION_TAINT, "effect": "NoSchedule"}]},
              "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    node = NodeObs.of(notice)
    assert node.noteworthy and hosts.GKE_IMPENDING_TERMINATION_TAINT in node.notice and "1765000000" in node.notice


def test_whole_needs_every_pod_running_and_ready():
    pods = slice_pods()
    assert hosts.whole(pods, 5) == tuple(sorted(p.uid for p in pods))
    assert hosts.whole(pods, 6) is None                                           # one still missing
    assert hosts.whole(replace_pod(pods, 2, ready=False), 5) is None
    assert hosts.whole(replace_pod(pods, 2, deleting=True), 5) is None


@pytest.mark.parametrize("change,cause", [
    ({"deleting": True}, "is being deleted"),
    ({"phase": "Failed"}, "ended (Failed)"),
    ({"ready": False}, "is not Ready"),
    ({"uid": "uid-new"}, "replaced one of the slice's pods"),
])
def test_a_recorded_pod_lost_in_any_way_is_a_loss(change, cause):
    pods = slice_pods()
    recorded = hosts.whole(pods, 5)
    assert recorded is not None and hosts.lost(recorded, pods, {}) is None
    loss = hosts.lost(recorded, replace_pod(pods, 3, **change), {})
    assert loss is not None and cause in loss.cause
    assert loss.stopping == ("deleting" in change)   # told to stop and still running: it saves first


def test_a_pod_gone_from_the_watch_and_a_node_not_ready_are_losses():
    pods = slice_pods()
    recorded = hosts.whole(pods, 5)
    assert recorded is not None
    loss = hosts.lost(recorded, pods[:-1], {})
    assert loss is not None and "1 pod(s) of the slice are gone" in loss.cause
    loss = hosts.lost(recorded, pods, {"node-0-1": NodeObs("node-0-1", ready=False, not_ready="NodeNotReady")})
    assert loss is not None and "node is not Ready (NodeNotReady)" in loss.cause and "node-0-1" in loss.cause


def test_whole_slices_counts_replicas_on_tpu_and_ready_workers_on_cpu():
    pods = slice_pods(slices=2)
    assert hosts.whole_slices(pods, 4, replica_per_slice=True) == 2
    one_down = replace_pod(pods, 6, phase="Pending", ready=None)   # slice 1 short of a host
    assert hosts.whole_slices(one_down, 4, replica_per_slice=True) == 1
    assert hosts.whole_slices(one_down, 4, replica_per_slice=False) == 1   # 7 ready workers: one whole slice of 4


def test_whole_slices_tells_slices_apart_by_tpu_name_where_each_has_a_worker_group():
    """Kueue TAS, slices > 1: one group per slice, each replica 0; TPU_NAME names the slice."""
    import dataclasses
    head, *workers = slice_pods(slices=2)
    pods = (head, *(dataclasses.replace(w, replica_index=0, slice_name=f"v6e-16-{i // 4}") for i, w in enumerate(workers)))
    assert hosts.whole_slices(pods, 4, replica_per_slice=True) == 2
    assert hosts.whole_slices(replace_pod(pods, 6, ready=False), 4, replica_per_slice=True) == 1


# --- phases.decide on the watched pods -------------------------------------------------------------------
def test_a_pod_replaced_before_the_operator_looked_is_one_loss_not_a_failed_attempt():
    """KubeRay's ready count never dipped (a spare node, a fast reschedule): the pod's new UID tells."""
    o, whole = train_with_pods()
    n = names(o)
    train = n.train_attempt(0)
    replaced = replace_pod(whole, 2, uid="uid-w0-1-new")
    d = phases.decide(o, Observed(cluster(4, 4, provisioned=True), {train: job(train)}, hosts=replaced), at(100), TUN)
    assert d.phase == "Provisioning" and d.status["reason"] == "ReplacingSlice"
    assert d.status["recovery"]["sliceReplacements"] == 1 and len(d.status["recovery"]["history"]) == 1
    assert "slicePods" not in d.status["recovery"]   # judged again once the slice is whole
    o = apply(o, d)
    again = phases.decide(o, Observed(cluster(4, 4, provisioned=True), hosts=replaced), at(101), TUN)
    assert again.status["recovery"]["sliceReplacements"] == 1   # counted once
    assert again.phase == "VerifyingCollectives"                # whole again: verified, then resumed
    assert again.status["recovery"]["slicePods"] == sorted(p.uid for p in replaced)


def test_a_pod_told_to_stop_keeps_the_training_job_until_its_checkpoint_is_saved():
    o, whole = train_with_pods()
    train = names(o).train_attempt(0)
    stopping = replace_pod(whole, 1, deleting=True)
    d = phases.decide(o, Observed(cluster(4, 4, provisioned=True), {train: job(train)}, hosts=stopping), at(100), TUN)
    assert d.phase == "Provisioning" and d.actions == ()   # seen at once, the job left to save
    assert "is being deleted" in d.status["recovery"]["history"][0]["cause"]
    o = apply(o, d)
    saving = phases.decide(o, Observed(cluster(4, 4, provisioned=True), {train: job(train)}, hosts=stopping),
                           at(103), TUN)
    assert saving.actions == () and "saving its checkpoint" in saving.status["message"]
    assert saving.requeue_after is not None and saving.requeue_after <= phases.STOPPING_LOOK_SECONDS
    ended = job(train, "FAILED", "Failed", message="exit 143")
    d = phases.decide(apply(o, saving), Observed(cluster(3, 4, provisioned=True), {train: ended}, hosts=stopping[:-1]),
                      at(106), TUN)
    assert kinds(d) == [("delete", "RayJob", train)]


def test_a_hard_loss_stops_the_jobs_at_once():
    o, whole = train_with_pods()
    train = names(o).train_attempt(0)
    d = phases.decide(o, Observed(cluster(4, 4, provisioned=True), {train: job(train)},
                                  hosts=replace_pod(whole, 1, phase="Failed")), at(100), TUN)
    assert kinds(d) == [("delete", "RayJob", train)]


def test_a_maintenance_notice_asks_for_one_checkpoint_and_records_the_step_saved():
    o, whole = train_with_pods()
    train = names(o).train_attempt(0)
    o["status"]["training"] = {"step": 30}
    notice = {"node-0-2": NodeObs("node-0-2", ready=True, notice="cloud.google.com/active-node-maintenance=true")}
    running = Observed(cluster(4, 4, provisioned=True), {train: job(train)}, hosts=whole, nodes=notice)
    d = phases.decide(o, running, at(100), TUN)
    assert d.phase == "Training" and d.actions == ()
    rec = d.status["recovery"]
    assert rec["checkpointRequestedAt"] == observed.fmt_time(at(100))
    assert rec["lastMaintenance"] == {"time": observed.fmt_time(at(100)), "node": "node-0-2",
                                      "notice": "cloud.google.com/active-node-maintenance=true", "step": 30}
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "MaintenanceNotice")]
    o = apply(o, d)
    assert phases.decide(o, running, at(105), TUN).patch is None   # one request per notice
    o["status"]["training"] = {"step": 31, "checkpointRequestSaved": rec["checkpointRequestedAt"]}
    d = phases.decide(o, running, at(110), TUN)
    assert d.status["recovery"]["lastMaintenance"]["checkpointStep"] == 31
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "MaintenanceNotice")]


def _train_document(action) -> dict:
    entrypoint = shlex.split(action.body["spec"]["entrypoint"])
    return json.loads(entrypoint[entrypoint.index("--spec") + 1])


def test_elastic_trains_on_the_whole_slices_then_comes_back_to_every_slice():
    o, whole = train_with_pods(slices=2, recovery={"elastic": True, "elasticWaitSeconds": 60},
                               training={"maxJobRetries": 0, "gradientAccumulationSteps": 2})
    train = names(o).train_attempt(0)
    lost = whole[:5] + tuple(p for p in whole[5:] if p.replica_index == 0)   # slice 1's pods gone
    pending = lost + tuple(replace_pod(whole, i, uid=f"new-{i}", phase="Pending", ready=None)[i]
                           for i in range(5, 9))
    o = apply(o, phases.decide(o, Observed(cluster(4, 8, provisioned=True), {train: job(train)}, hosts=lost),
                               at(100), TUN))
    assert o["status"]["reason"] == "ReplacingSlice"
    early = phases.decide(o, Observed(cluster(4, 8, provisioned=True), hosts=pending), at(130), TUN)
    assert early.phase == "Provisioning" and early.actions == ()
    assert early.requeue_after is not None and early.requeue_after <= 30   # looks again when the wait is over
    d = phases.decide(o, Observed(cluster(4, 8, provisioned=True), hosts=pending), at(161), TUN)
    assert d.phase == "Training" and d.status["reason"] == "TrainingOnFewerSlices"
    assert kinds(d) == [("create", "RayJob", train)]   # the same attempt, from its checkpoint
    document = _train_document(d.actions[0])
    assert document["slices"] == 1 and document["training"]["gradientAccumulationSteps"] == 4   # global batch kept
    assert d.status["recovery"]["elastic"]["slices"] == 1
    o = apply(o, d)
    # the other slice's pods come up Running: not a loss while training on fewer
    coming = lost + tuple(replace_pod(pending, i, phase="Running", ready=False)[i] for i in range(5, 9))
    assert phases.decide(o, Observed(cluster(4, 8, provisioned=True), {train: job(train)}, hosts=coming),
                         at(170), TUN).phase == "Training"
    back = lost + tuple(replace_pod(pending, i, phase="Running", ready=True)[i] for i in range(5, 9))
    asked = phases.decide(o, Observed(cluster(8, 8, provisioned=True), {train: job(train)}, hosts=back), at(180), TUN)
    assert asked.phase == "Training" and asked.actions == ()
    assert asked.status["recovery"]["checkpointRequestedAt"] == observed.fmt_time(at(180))
    o = apply(o, asked)
    o["status"]["training"] = {"step": 50, "checkpointRequestSaved": observed.fmt_time(at(180))}
    d = phases.decide(o, Observed(cluster(8, 8, provisioned=True), {train: job(train)}, hosts=back), at(190), TUN)
    assert d.phase == "Provisioning" and d.status["reason"] == "Resizing"
    assert kinds(d) == [("delete", "RayJob", train)] and "elastic" not in d.status["recovery"]
    o = apply(o, d)
    d = phases.decide(o, Observed(cluster(8, 8, provisioned=True), hosts=back), at(195), TUN)
    assert d.phase == "VerifyingCollectives"   # every slice verified, then training on all of them
    assert d.status["recovery"]["sliceReplacements"] == 1


def test_without_elastic_a_lost_slice_is_waited_for():
    o, whole = train_with_pods(slices=2)
    train = names(o).train_attempt(0)
    lost = whole[:5]
    o = apply(o, phases.decide(o, Observed(cluster(4, 8, provisioned=True), {train: job(train)}, hosts=lost),
                               at(100), TUN))
    d = phases.decide(o, Observed(cluster(4, 8, provisioned=True), hosts=lost), at(1000), TUN)
    assert d.phase == "Provisioning" and d.actions == () and d.status["reason"] == "ReplacingSlice"


def test_two_nodes_with_notices_are_one_request_until_the_set_changes():
    pods = slice_pods()
    one = {"node-0-1": NodeObs("node-0-1", ready=True, notice="n1")}
    both = {**one, "node-0-3": NodeObs("node-0-3", ready=True, notice="n3")}
    assert hosts.maintenance(pods, one) == ("node-0-1", "n1")
    assert hosts.maintenance(pods, both) == ("node-0-1, node-0-3", "node-0-1: n1; node-0-3: n3")
    assert hosts.maintenance(pods, {"elsewhere": NodeObs("elsewhere", notice="n")}) is None


@pytest.mark.parametrize("accumulation,slices,whole,train_on,new_accumulation", [
    (1, 2, 1, 1, 2),    # two slices to one: twice the steps
    (2, 3, 2, 2, 3),    # 3 x 2 = 6 sequences-per-device steps: 2 slices of 3
    (1, 3, 2, 1, 3),    # 3 does not split over 2: one slice keeps the batch
    (1, 4, 3, 2, 2),    # 3 whole, but 4 splits over 2 (not 3)
    (1, 2, 0, 0, None),
])
def test_elastic_keeps_the_global_batch(accumulation, slices, whole, train_on, new_accumulation):
    from tpuft.controller.builders import elastic_accumulation, elastic_slices
    assert elastic_slices(accumulation, slices, whole) == train_on
    if train_on:
        assert elastic_accumulation(accumulation, slices, train_on) == new_accumulation
        assert new_accumulation * train_on == accumulation * slices


def test_a_job_told_to_stop_before_it_trained_is_deleted_once_the_slice_is_whole_again():
    """No save to wait for (the pod went before any worker trained): KubeRay replaced the pod, so the
    pod's stop is over; the old job goes, and nothing is submitted beside it until it is gone."""
    o, whole = train_with_pods()
    train = names(o).train_attempt(0)
    o = apply(o, phases.decide(o, Observed(cluster(4, 4, provisioned=True), {train: job(train)},
                                           hosts=replace_pod(whole, 1, deleting=True)), at(100), TUN))
    back = replace_pod(whole, 1, uid="uid-new")
    d = phases.decide(o, Observed(cluster(4, 4, provisioned=True), {train: job(train)}, hosts=back), at(110), TUN)
    assert kinds(d) == [("delete", "RayJob", train)] and d.phase == "Provisioning"
    assert "to be gone before submitting again" in d.status["message"]
    d = phases.decide(apply(o, d), Observed(cluster(4, 4, provisioned=True), hosts=back), at(112), TUN)
    assert d.phase == "VerifyingCollectives"
