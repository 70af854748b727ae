"""tpuft.controller.diagnosis, pure: a pod's status as the kubelet and the scheduler write it -> the one
cause a user should read first."""
from __future__ import annotations

import pytest

from tpuft.controller.diagnosis import MAX_DETAIL, OomKilled, PodObs, blocking_cause, host_of, leftovers, pool_hint


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


# --- a container the kernel's OOM killer ended ------------------------------------------------------------
def running_pod(name: str = "ft-ray-tpu-worker-x", *, labels: dict | None = None, env: list | None = None,
                state: dict | None = None, last: dict | None = None, limit: str = "200Gi") -> dict:
    """A Ray pod of a running slice, as the API server returns it once the kubelet has restarted
    its container (restartPolicy Always)."""
    cs = {"name": "ray-worker", "image": "img:1", "ready": True, "restartCount": 1 if last else 0,
          "state": state or {"running": {"startedAt": "2026-01-01T12:03:00Z"}}}
    if last:
        cs["lastState"] = {"terminated": last}
    container = {"name": "ray-worker", "image": "img:1", "env": env or [],
                 "resources": {"limits": {"cpu": "8", "memory": limit}, "requests": {"cpu": "8", "memory": limit}}}
    return {"metadata": {"name": name, "labels": {"ray.io/cluster": "ft-ray", "ray.io/node-type": "worker",
                                                  **(labels or {})},
                         "ownerReferences": [{"kind": "RayCluster", "name": "ft-ray", "uid": "rc-1"}]},
            "spec": {"containers": [container, {"name": "sidecar", "image": "s:1"}]},
            "status": {"phase": "Running", "podIP": "10.4.1.7", "containerStatuses": [cs]}}


OOM = {"exitCode": 137, "reason": "OOMKilled", "startedAt": "2026-01-01T12:00:10Z", "finishedAt": "2026-01-01T12:02:59Z"}


def test_an_oom_killed_container_is_read_from_its_last_state_with_its_limit():
    obs = PodObs.of(running_pod(last=OOM, labels={"ray.io/worker-group-replica-index": "1",
                                                  "ray.io/replica-host-index": "2"}))
    assert obs.oom_killed == (OomKilled("ray-worker", "2026-01-01T12:02:59Z", "200Gi"),)
    assert (obs.ip, obs.node_type, obs.is_head, obs.memory_limit) == ("10.4.1.7", "worker", False, "200Gi")
    assert (obs.replica_index, obs.host_index) == (1, 2)
    assert blocking_cause((obs,)) is None   # running again: not a stall


def test_an_oom_killed_container_not_yet_restarted_is_read_from_its_state():
    obs = PodObs.of(running_pod(state={"terminated": OOM}, last={**OOM, "finishedAt": "2026-01-01T11:00:00Z"}))
    assert [k.finished_at for k in obs.oom_killed] == ["2026-01-01T12:02:59Z"]   # the latest, once


@pytest.mark.parametrize("last", [None, {"exitCode": 1, "reason": "Error", "finishedAt": "2026-01-01T12:02:59Z"}])
def test_other_exits_are_not_oom_kills(last):
    assert PodObs.of(running_pod(last=last)).oom_killed == ()


def test_without_kuberays_index_labels_the_tpu_webhooks_place_the_pod():
    obs = PodObs.of(running_pod(labels={"replicaIndex": "tpu-group-1"}, env=[{"name": "TPU_WORKER_ID", "value": "3"}]))
    assert (obs.replica_index, obs.host_index) == (1, 3)
    assert (PodObs.of(running_pod()).replica_index, PodObs.of(running_pod()).host_index) == (None, None)


@pytest.mark.parametrize("replica,host,hosts_per_replica,expected", [
    (0, 2, 4, "host 2 of slice 0"),     # TPU: a slice is one group replica of its hosts
    (1, 3, 4, "host 3 of slice 1"),
    (5, None, 1, "host 1 of slice 1"),  # CPU: each host is a replica of one (4 hosts per slice here)
    (1, None, 4, ""),                   # a TPU pod without its host index
    (None, 2, 4, ""),
])
def test_host_of_names_the_slice_and_host(replica, host, hosts_per_replica, expected):
    assert host_of(PodObs("p", replica_index=replica, host_index=host), 4, hosts_per_replica) == expected


def test_host_of_takes_the_slice_from_tpu_name_where_each_slice_has_a_worker_group():
    raw = running_pod(labels={"ray.io/worker-group-replica-index": "0", "ray.io/replica-host-index": "2"},
                      env=[{"name": "TPU_NAME", "value": "v6e-16-1"}])
    obs = PodObs.of(raw)
    assert (obs.slice_name, obs.replica_index, obs.host_index) == ("v6e-16-1", 0, 2)
    assert host_of(obs, 4, 4) == "host 2 of slice 1"
