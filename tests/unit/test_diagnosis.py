"""tpuft.diagnosis, pure: a pod's status as the kubelet and the scheduler write it -> the one
cause a user should read first."""
from __future__ import annotations

import pytest

from tpuft.diagnosis import MAX_DETAIL, PodObs, blocking_cause, leftovers, pool_hint


def pod(name: str = "ft-ray-worker-a", *, waiting: dict | None = None, last: dict | None = None,
        scheduled: dict | None = None, init: bool = False, deleting: bool = False, owner: str = "rc-1") -> dict:
    """The fields of a v1 Pod the diagnosis reads, spelled as the API server returns them."""
    cs = {"name": "ray-worker", "image": "us-docker.pkg.dev/p/r/workload:1", "ready": False,
          "state": {"waiting": waiting} if waiting else {"running": {"startedAt": "2026-12-01T00:00:00Z"}}}
    if last:
        cs["lastState"] = {"terminated": last}
    status: dict = {"phase": "Pending", "conditions": [scheduled] if scheduled else []}
    if waiting or last:
        status["initContainerStatuses" if init else "containerStatuses"] = [cs]
    meta = {"name": name, "labels": {"ray.io/cluster": "ft-ray"},
            "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "ft-ray", "uid": owner}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "spec": {"containers": [{"name": "ray-worker", "image": "us-docker.pkg.dev/p/r/workload:1"}]},
            "status": status}


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/8 nodes are available: 4 Insufficient google.com/tpu, 4 node(s) didn't match "
                            "Pod's node affinity/selector. preemption: 0/8 nodes are available."}


@pytest.mark.parametrize("raw,expected", [
    pytest.param(pod(waiting={"reason": "ImagePullBackOff", "message": 'Back-off pulling image "us-docker.pkg.dev/p/r/workload:1"'}),
                 "pod ft-ray-worker-a: image us-docker.pkg.dev/p/r/workload:1 cannot be pulled (ImagePullBackOff): "
                 'Back-off pulling image "us-docker.pkg.dev/p/r/workload:1"', id="image-pull-backoff"),
    pytest.param(pod(waiting={"reason": "ErrImagePull", "message": "rpc error: not found"}),
                 "pod ft-ray-worker-a: image us-docker.pkg.dev/p/r/workload:1 cannot be pulled (ErrImagePull): "
                 "rpc error: not found", id="err-image-pull"),
    pytest.param(pod(waiting={"reason": "CreateContainerConfigError", "message": 'secret "hf-secret" not found'}),
                 'pod ft-ray-worker-a: container ray-worker cannot start (CreateContainerConfigError): '
                 'secret "hf-secret" not found', id="missing-secret"),
    pytest.param(pod(waiting={"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"},
                     last={"exitCode": 1, "reason": "Error", "message": "ModuleNotFoundError: No module named 'ray'\n"}),
                 "pod ft-ray-worker-a: container ray-worker keeps crashing (CrashLoopBackOff, last exit code 1: "
                 "ModuleNotFoundError: No module named 'ray')", id="crash-loop"),
    pytest.param(pod(waiting={"reason": "CrashLoopBackOff"}, last={"exitCode": 137, "reason": "OOMKilled"}),
                 "pod ft-ray-worker-a: container ray-worker keeps crashing (CrashLoopBackOff, last exit code 137: "
                 "OOMKilled)", id="oom-loop"),
    pytest.param(pod(waiting={"reason": "ImagePullBackOff"}, init=True),
                 "pod ft-ray-worker-a: image us-docker.pkg.dev/p/r/workload:1 cannot be pulled (ImagePullBackOff)",
                 id="init-container"),
    pytest.param(pod(scheduled=UNSCHEDULABLE),
                 f"pod ft-ray-worker-a cannot be scheduled: the scheduler says: {UNSCHEDULABLE['message']}",
                 id="unschedulable"),
    pytest.param(pod(waiting={"reason": "ContainerCreating"}), None, id="still-creating"),
    pytest.param(pod(waiting={"reason": "PodInitializing"}), None, id="initializing"),
    pytest.param(pod(scheduled={"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}), None,
                 id="gated-is-not-a-stall"),
    pytest.param(pod(), None, id="running"),
    pytest.param(pod(waiting={"reason": "ImagePullBackOff"}, deleting=True), None, id="deleting-pods-do-not-count"),
])
def test_each_cause_in_the_components_own_words(raw, expected):
    assert blocking_cause((PodObs.of(raw),)) == expected


def test_the_most_decisive_cause_wins_over_pod_order():
    pods = (PodObs.of(pod("a-unschedulable", scheduled=UNSCHEDULABLE)),
            PodObs.of(pod("b-crash", waiting={"reason": "CrashLoopBackOff"})),
            PodObs.of(pod("c-image", waiting={"reason": "ErrImagePull"})))
    assert blocking_cause(pods).startswith("pod c-image: image")
    assert blocking_cause(pods[:2]).startswith("pod b-crash: container")


def test_ties_go_to_the_first_pod_by_name():
    pods = tuple(PodObs.of(pod(n, scheduled=UNSCHEDULABLE)) for n in ("w-2", "w-1", "w-3"))
    assert blocking_cause(pods).startswith("pod w-1 ")


def test_long_messages_are_clipped_and_one_line():
    raw = pod(scheduled={**UNSCHEDULABLE, "message": "0/9 nodes:\n" + "x" * 5000})
    cause = blocking_cause((PodObs.of(raw),))
    detail = cause.split("the scheduler says: ", 1)[1]
    assert len(detail) == MAX_DETAIL and detail.endswith("...") and "\n" not in cause


def test_leftovers_are_pods_of_any_other_raycluster():
    pods = (PodObs.of(pod("ft-ray-head-old", owner="rc-0")), PodObs.of(pod("ft-ray-head-new", owner="rc-1")))
    assert leftovers(pods, frozenset({"rc-1"})) == ("ft-ray-head-old",)
    assert leftovers(pods, frozenset()) == ("ft-ray-head-new", "ft-ray-head-old")


@pytest.mark.parametrize("pools,expected", [
    ((("tpu-v6e-slice", "4x4", 4), ("tpu7x", "2x2x2", 2)),
     "TPU node pools here: tpu-v6e-slice 4x4 (4 nodes), tpu7x 2x2x2 (2 nodes); none is tpu-v6e-slice 4x8"),
    ((("tpu-v6e-slice", "4x8", 8),),
     "TPU node pools here: tpu-v6e-slice 4x8 (8 nodes); the tpu-v6e-slice 4x8 pool exists, so it lacks free capacity"),
    ((), "no node here carries cloud.google.com/gke-tpu-accelerator (no TPU node pool)"),
])
def test_the_pool_hint_names_what_the_cluster_offers(pools, expected):
    assert pool_hint(pools, "tpu-v6e-slice", "4x8", hosts=8) == expected


@pytest.mark.parametrize("nodes, slices, expected", [
    (4, 2, "TPU node pools here: tpu-v6e-slice 4x4 (4 nodes); 2 slices of tpu-v6e-slice 4x4 need 8 hosts "
           "(4 per slice, each slice its own node pool); the cluster has 4: add node pools or lower spec.slices"),
    (8, 2, "TPU node pools here: tpu-v6e-slice 4x4 (8 nodes); the tpu-v6e-slice 4x4 pool exists, so it lacks free capacity"),
    (4, 1, "TPU node pools here: tpu-v6e-slice 4x4 (4 nodes); the tpu-v6e-slice 4x4 pool exists, so it lacks free capacity"),
])
def test_the_pool_hint_counts_the_hosts_every_slice_needs(nodes, slices, expected):
    assert pool_hint((("tpu-v6e-slice", "4x4", nodes),), "tpu-v6e-slice", "4x4", hosts=4, slices=slices) == expected
