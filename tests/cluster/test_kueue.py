"""The real Kueue (v0.17.0, built here, run by `tpuft cluster up`) admitting TPUFinetunes on the
simulated v6e pool: queued is not stuck, preemption is not loss, a missing LocalQueue is said.

Each test makes its own ClusterQueue (one v6e 4x4 slice of quota, the CPU flavor for the heads)
and LocalQueue in its namespace, over the flavors `cluster up` made: other lanes' objects and the
ClusterQueue `local` are untouched. The slices are KWOK's: the pods run nowhere, so a run admitted
here gets as far as VerifyingCollectives, which is all these need.
"""
from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.paths import EXAMPLES
from tests.waiting import wait_until
from tpuft.api import gke
from tpuft.api import kueue as kueue_names
from tpuft_local import kueue, pools
from tpuft_local import queued_provisioning as qp

V6E = pools.DEFAULT_POOLS[0]


def _get(kubectl, *args) -> dict:
    res = kubectl("get", *args, "-o", "json")
    return json.loads(res.stdout) if res.returncode == 0 else {}


def _status(kubectl, ns: str, name: str) -> dict:
    return _get(kubectl, "tft", name, "-n", ns).get("status") or {}


def _apply(kubectl, *docs: dict, ns: str | None = None) -> None:
    args = ("-n", ns) if ns else ()
    kubectl("apply", *args, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}),
            check=True)


@pytest.fixture
def queue(cluster_kubectl, cluster_ns):
    """A ClusterQueue of one v6e 4x4 slice (preempting lower priority) and LocalQueue `lq`."""
    name = f"cq-{cluster_ns}"
    objs = [o for o in kueue.queue_objects([V6E], cluster_queue=name) if o["kind"] == "ClusterQueue"]
    objs.append(kueue.local_queue(cluster_ns, name, "lq"))
    prios = [{"apiVersion": f"{kueue_names.KUEUE_GROUP}/{kueue_names.KUEUE_VERSION}", "kind": "WorkloadPriorityClass",
              "metadata": {"name": f"{p}-{cluster_ns}"}, "value": v, "description": f"{p} (test)"}
             for p, v in (("low", 100), ("high", 1000))]
    _apply(cluster_kubectl, *objs, *prios)
    yield "lq"
    cluster_kubectl("delete", "tft", "--all", "-n", cluster_ns, "--wait=false")
    wait_until(lambda: not _get(cluster_kubectl, "workloads", "-n", cluster_ns).get("items"), timeout=180,
               interval=2, what=f"the Workloads in {cluster_ns} to go")
    cluster_kubectl("delete", "clusterqueue", name, "--ignore-not-found")
    cluster_kubectl("delete", "workloadpriorityclass", *[p["metadata"]["name"] for p in prios], "--ignore-not-found")


def _slice(name: str, queue: str, priority: str | None = None, **spec) -> dict:
    doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
    doc["metadata"] = {"name": name, "labels": {kueue_names.KUEUE_QUEUE_LABEL: queue,
                                                **({kueue_names.KUEUE_PRIORITY_LABEL: priority} if priority else {})}}
    doc["spec"]["verification"]["timeoutSeconds"] = 900   # stays VerifyingCollectives (KWOK runs nothing)
    doc["spec"]["provisioningTimeoutSeconds"] = 300
    doc["spec"].update(spec)
    return doc


def _phase(kubectl, ns, name, *phases, timeout, what) -> dict:
    return wait_until(lambda: (st := _status(kubectl, ns, name)).get("phase") in phases and st,
                      timeout=timeout, interval=1, what=what)


def _cond(st: dict, ctype: str) -> dict:
    return next((x for x in st.get("conditions") or [] if x["type"] == ctype), {})


def test_a_second_slice_waits_queued_in_kueues_words_past_its_provisioning_timeout_then_is_admitted(
        cluster_kubectl, cluster_ns, queue):
    ns = cluster_ns
    _apply(cluster_kubectl, _slice("first", queue), ns=ns)
    _phase(cluster_kubectl, ns, "first", "Provisioning", "VerifyingCollectives", timeout=120, what="first admitted")
    _apply(cluster_kubectl, _slice("second", queue, provisioningTimeoutSeconds=20), ns=ns)
    st = wait_until(lambda: "insufficient" in (s := _status(cluster_kubectl, ns, "second")).get("message", "") and s,
                    timeout=60, interval=1, what="Kueue's quota words in second's status")
    assert st["phase"] == "Queued" and st["reason"] == "Queued", st
    assert gke.TPU_RESOURCE in st["message"] and V6E.name in st["message"], st["message"]
    assert _cond(st, "Admitted")["status"] == "False"
    rc = _get(cluster_kubectl, "raycluster", "second-ray", "-n", ns)
    assert rc["spec"]["suspend"] is True                      # Kueue's webhook suspended it at creation
    assert not _get(cluster_kubectl, "pods", "-n", ns, "-l", "ray.io/cluster=second-ray").get("items")
    table = cluster_kubectl("get", "tft", "-n", ns, check=True).stdout
    assert "Queued" in table, table
    time.sleep(30)   # past second's provisioningTimeoutSeconds (20): queue time is not provisioning time
    st = _status(cluster_kubectl, ns, "second")
    assert st["phase"] == "Queued" and "insufficient" in st["message"], st
    events = _get(cluster_kubectl, "events", "-n", ns, "--field-selector", "reason=Queued,involvedObject.name=second")
    # one per new reason, not per look: Kueue's words may change as it gets to the Workload (no
    # Workload yet, pending, then its quota message: seen 3 in a clean-clone run), never repeat
    said = [e["message"] for e in events["items"]]
    assert said and len(set(said)) == len(said) and all(e.get("count", 1) == 1 for e in events["items"]), said
    cluster_kubectl("delete", "tft", "first", "-n", ns, check=True)
    st = _phase(cluster_kubectl, ns, "second", "Provisioning", "VerifyingCollectives", timeout=180,
                what="second admitted once first is gone")
    assert _cond(st, "Admitted")["status"] == "True", st
    assert st["goodput"]["queuedSeconds"] >= 30, st["goodput"]


def test_a_preempted_run_waits_queued_then_is_verified_again_without_counting_a_slice_replacement(
        cluster_kubectl, cluster_ns, queue):
    ns = cluster_ns
    _apply(cluster_kubectl, _slice("low", queue, f"low-{ns}"), ns=ns)
    _phase(cluster_kubectl, ns, "low", "VerifyingCollectives", timeout=240, what="low verifying on the v6e pool")
    _apply(cluster_kubectl, _slice("high", queue, f"high-{ns}"), ns=ns)
    st = _phase(cluster_kubectl, ns, "low", "Queued", "Failed", timeout=120, what="low preempted by high")
    assert (st["phase"], st["reason"]) == ("Queued", "Preempted"), st
    rec = st["recovery"]
    assert rec["preemptions"] == 1 and not rec.get("sliceReplacements"), rec
    assert rec["lastPreemption"]["phase"] == "VerifyingCollectives" and "Preempted" in rec["lastPreemption"]["cause"]
    wait_until(lambda: cluster_kubectl("get", "rayjob", "low-verify", "-n", ns).returncode != 0, timeout=120,
               what="low's verification RayJob stopped")
    _phase(cluster_kubectl, ns, "high", "Provisioning", "VerifyingCollectives", timeout=120, what="high admitted")
    cluster_kubectl("delete", "tft", "high", "-n", ns, check=True)
    st = _phase(cluster_kubectl, ns, "low", "VerifyingCollectives", "Failed", timeout=300,
                what="low admitted again and verifying its new slice")
    assert st["phase"] == "VerifyingCollectives" and st["recovery"]["preemptions"] == 1, st
    assert not st["recovery"].get("sliceReplacements"), st["recovery"]


def test_a_missing_local_queue_and_a_shape_past_the_whole_quota_are_said_and_nothing_is_left_on_delete(
        cluster_kubectl, cluster_ns, queue):
    ns = cluster_ns
    start = time.monotonic()
    _apply(cluster_kubectl, _slice("lost", "no-such-queue"), ns=ns)
    # Gang admission: two v6e 4x4 slices (32 chips) under a quota of one slice (16) are admitted
    # whole or not at all, and say so in Kueue's words instead of hanging.
    _apply(cluster_kubectl, _slice("two", queue, slices=2), ns=ns)
    st = wait_until(lambda: "doesn't exist" in (s := _status(cluster_kubectl, ns, "lost")).get("message", "") and s,
                    timeout=60, interval=0.5, what="the missing LocalQueue in lost's status")
    took = time.monotonic() - start
    print(f"missing LocalQueue said {took:.1f} s after apply")
    assert st["phase"] == "Queued" and "no-such-queue" in st["message"], st
    st = wait_until(lambda: "insufficient" in (s := _status(cluster_kubectl, ns, "two")).get("message", "") and s,
                    timeout=60, interval=1, what="Kueue's quota words in two's status")
    assert st["phase"] == "Queued" and gke.TPU_RESOURCE in st["message"], st
    (wl,) = [w for w in _get(cluster_kubectl, "workloads", "-n", ns)["items"]
             if any(o["name"] == "two-ray" for o in w["metadata"].get("ownerReferences") or [])]
    assert sorted(p["count"] for p in wl["spec"]["podSets"]) == [1, 8], wl["spec"]["podSets"]   # head; 2 x 4 hosts
    assert not _get(cluster_kubectl, "pods", "-n", ns, "-l", "ray.io/cluster=two-ray").get("items")
    cluster_kubectl("delete", "tft", "lost", "two", "-n", ns, check=True)
    wait_until(lambda: not _get(cluster_kubectl, "rayclusters,workloads", "-n", ns).get("items"), timeout=120,
               interval=1, what="lost's RayCluster and Workload gone")


# --- GKE flex-start through Kueue's ProvisioningRequest check, with the named stand-in for GKE --------------
def _standin_settings(kubectl, provision_after: str) -> None:
    """The stand-in's delay (tpuft_local.queued_provisioning reads it on every pass)."""
    _apply(kubectl, {"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": qp.SETTINGS, "namespace": qp.SETTINGS_NAMESPACE},
                     "data": {"provisionAfterSeconds": provision_after}})


def _flex_nodes(kubectl) -> list[dict]:
    return _get(kubectl, "nodes", "-l", f"{qp.OWNER_LABEL},{gke.GKE_FLEX_START_SELECTOR}=true").get("items") or []


def _requests(kubectl, ns: str) -> list[dict]:
    return _get(kubectl, "provisioningrequests.autoscaling.x-k8s.io", "-n", ns).get("items") or []


@pytest.fixture
def flex_queue(cluster_kubectl, cluster_ns):
    """A ClusterQueue with `up`'s AdmissionCheck `flex-start` (ProvisioningRequests of class
    queued-provisioning.gke.io, answered by the stand-in) on `up`'s flex-start flavor, and LocalQueue `flex`."""
    name = f"flex-{cluster_ns}"
    cq = next(o for o in kueue.flex_start_objects(V6E) if o["kind"] == "ClusterQueue")
    cq = {**cq, "metadata": {"name": name}}
    _apply(cluster_kubectl, cq, kueue.local_queue(cluster_ns, name, "flex"))
    yield "flex"
    cluster_kubectl("delete", "tft", "--all", "-n", cluster_ns, "--wait=false")
    wait_until(lambda: not _get(cluster_kubectl, "workloads", "-n", cluster_ns).get("items"), timeout=180,
               interval=2, what=f"the Workloads in {cluster_ns} to go")
    cluster_kubectl("delete", "clusterqueue", name, "--ignore-not-found")
    _standin_settings(cluster_kubectl, str(qp.DEFAULT_PROVISION_AFTER))


def test_flex_start_waits_for_capacity_in_the_provisioning_requests_words_provisions_and_a_revoked_booking_requeues(
        cluster_kubectl, cluster_ns, flex_queue):
    ns, kubectl = cluster_ns, cluster_kubectl
    assert not _flex_nodes(kubectl), "flex-start nodes left from an earlier run"
    _standin_settings(kubectl, "never")
    _apply(kubectl, _slice("flex", flex_queue, scheduling={"provisioning": "flexStart", "maxRunDurationSeconds": 3600}),
           ns=ns)
    # 1. quota reserved, the ProvisioningRequest waits: the run says so in its words, as its own reason
    # (first without a message: Kueue copies the request's once the stand-in has accepted it)
    st = wait_until(lambda: "Waiting for capacity" in (s := _status(kubectl, ns, "flex")).get("message", "") and s,
                    timeout=120, interval=1, what="the ProvisioningRequest's words in flex's status")
    assert (st["phase"], st["reason"]) == ("Queued", "WaitingForCapacity") and "stand-in" in st["message"], st
    (pr,) = _requests(kubectl, ns)
    assert pr["spec"]["provisioningClassName"] == kueue.QUEUED_PROVISIONING_CLASS
    assert pr["spec"]["parameters"][gke.GKE_MAX_RUN_DURATION_PARAMETER] == "3600"   # from the RayCluster's annotation
    assert _cond(pr["status"], "Accepted")["status"] == "True" and _cond(pr["status"], "Provisioned")["status"] == "False"
    assert not _flex_nodes(kubectl) and not _get(kubectl, "pods", "-n", ns, "-l", "ray.io/cluster=flex-ray").get("items")
    # 2./3. the stand-in provisions: a flex-start node pool appears, the run provisions and verifies on it
    _standin_settings(kubectl, "0")
    st = _phase(kubectl, ns, "flex", "VerifyingCollectives", "Failed", timeout=300, what="flex verifying its slice")
    assert st["phase"] == "VerifyingCollectives", st
    nodes = {n["metadata"]["name"]: n for n in _flex_nodes(kubectl)}
    assert len(nodes) == V6E.slice.hosts, sorted(nodes)
    workers = _get(kubectl, "pods", "-n", ns, "-l", "ray.io/cluster=flex-ray,ray.io/node-type=worker")["items"]
    assert sorted(p["spec"].get("nodeName") for p in workers) == sorted(nodes)   # the slice is the provisioned one
    attempts = st.get("trainingAttempts")
    # 5. GKE takes the capacity back mid-run: a preemption, then queued again as a new Workload
    (pr,) = _requests(kubectl, ns)
    kubectl("annotate", "provisioningrequests.autoscaling.x-k8s.io", pr["metadata"]["name"], "-n", ns,
            f"{qp.REVOKE_ANNOTATION}=revoked by tests/cluster/test_kueue.py", check=True)
    st = wait_until(lambda: (s := _status(kubectl, ns, "flex")).get("recovery", {}).get("preemptions") and s,
                    timeout=120, interval=1, what="flex preempted by the revoked capacity")
    assert st["phase"] == "Queued" and "CapacityRevoked" in st["recovery"]["lastPreemption"]["cause"], st
    assert not st["recovery"].get("sliceReplacements") and st.get("trainingAttempts") == attempts, st
    st = _phase(kubectl, ns, "flex", "VerifyingCollectives", "Failed", timeout=300,
                what="flex admitted again on a new booking and verifying")
    assert st["phase"] == "VerifyingCollectives" and st["recovery"]["preemptions"] == 1, st
    assert [p["metadata"]["uid"] for p in _requests(kubectl, ns)] != [pr["metadata"]["uid"]]   # a new request
    # 4. deleting the run ends the booking: the provisioned nodes go
    kubectl("delete", "tft", "flex", "-n", ns, check=True)
    wait_until(lambda: not _flex_nodes(kubectl), timeout=180, interval=2, what="the flex-start nodes removed")


@pytest.fixture
def fallback_queue(cluster_kubectl, cluster_ns):
    """The fallback order (kueue.fallback_objects): the v6e pool's flavor, one slice, then flex-start."""
    name = f"fallback-{cluster_ns}"
    _apply(cluster_kubectl, *kueue.fallback_objects(V6E, cluster_ns, cluster_queue=name))
    yield name
    cluster_kubectl("delete", "tft", "--all", "-n", cluster_ns, "--wait=false")
    wait_until(lambda: not _get(cluster_kubectl, "workloads", "-n", cluster_ns).get("items"), timeout=180,
               interval=2, what=f"the Workloads in {cluster_ns} to go")
    cluster_kubectl("delete", "clusterqueue", name, "--ignore-not-found")
    _standin_settings(cluster_kubectl, str(qp.DEFAULT_PROVISION_AFTER))


def test_a_fallback_order_takes_flex_start_once_the_pools_quota_is_taken(cluster_kubectl, cluster_ns, fallback_queue):
    """Kueue v0.17's fallback across capacity types, with runs that name none: the first is admitted on
    the v6e pool's own flavor; the second, that flavor's slice taken, on the next one, flex-start,
    where it waits for capacity in the ProvisioningRequest's words and then verifies on the nodes the
    stand-in provisioned (Kueue put the flavor's flex-start label and toleration on its pods)."""
    ns, kubectl = cluster_ns, cluster_kubectl
    assert not _flex_nodes(kubectl), "flex-start nodes left from an earlier run"
    _standin_settings(kubectl, "never")
    _apply(kubectl, _slice("first", fallback_queue), ns=ns)
    _phase(kubectl, ns, "first", "VerifyingCollectives", timeout=180, what="first verifying on the pool's flavor")
    _apply(kubectl, _slice("second", fallback_queue), ns=ns)
    wait_until(lambda: _status(kubectl, ns, "second").get("reason") == "WaitingForCapacity",
               timeout=120, interval=1, what="second falling back to flex-start, waiting for capacity")
    (pr,) = _requests(kubectl, ns)   # first's flavor has no check: one ProvisioningRequest, second's
    assert pr["spec"]["provisioningClassName"] == kueue.QUEUED_PROVISIONING_CLASS, pr["spec"]
    flavors = {w["metadata"]["name"]: [f for a in w["status"]["admission"]["podSetAssignments"]
                                       for f in (a.get("flavors") or {}).values()]
               for w in _get(kubectl, "workloads", "-n", ns)["items"] if (w.get("status") or {}).get("admission")}
    print(f"fallback order: the flavors Kueue assigned, per Workload: {flavors}")
    assert sorted(sorted(set(f) - {kueue.CPU_FLAVOR}) for f in flavors.values()) == [
        [V6E.name], [kueue.flex_start_flavor_name(V6E)]], flavors
    _standin_settings(kubectl, "0")
    _phase(kubectl, ns, "second", "VerifyingCollectives", timeout=300, what="second verifying on flex-start nodes")
    nodes = sorted(n["metadata"]["name"] for n in _flex_nodes(kubectl))
    assert sorted(p["spec"].get("nodeName") for p in _workers(kubectl, ns, "second-ray")) == nodes and nodes
    assert not set(p["spec"].get("nodeName") for p in _workers(kubectl, ns, "first-ray")) & set(nodes)


def _workers(kubectl, ns: str, cluster: str) -> list[dict]:
    return _get(kubectl, "pods", "-n", ns, "-l", f"ray.io/cluster={cluster},ray.io/node-type=worker").get("items") or []


def test_topology_aware_slices_land_whole_on_node_pools(cluster_kubectl, cluster_ns):
    """Kueue TAS (ClusterQueue `tas`, Topology by cloud.google.com/gke-nodepool): one slice's 4 hosts
    bound on one node pool by the real scheduler; a `slices: 2` run (a worker group per slice, one
    Kueue pod set each) bound as two whole slices, one per node pool of the v6e pool, and verified; a
    lost host of one slice is one replacement, its slice placed whole on a node pool again."""
    ns, kubectl = cluster_ns, cluster_kubectl
    _apply(kubectl, kueue.local_queue(ns, kueue.TAS, "tas"))
    pool_of = {n["metadata"]["name"]: n["metadata"]["labels"][pools.POOL_LABEL]
               for n in _get(kubectl, "nodes", "-l", pools.POOL_LABEL)["items"]}
    _apply(kubectl, _slice("one", "tas", scheduling={"topologyAware": True}), ns=ns)
    bound = wait_until(lambda: len(p := [x for x in _workers(kubectl, ns, "one-ray") if x["spec"].get("nodeName")]) == 4
                       and p, timeout=240, interval=2, what="one's 4 hosts bound")
    assert len({pool_of[p["spec"]["nodeName"]] for p in bound}) == 1, [p["spec"]["nodeName"] for p in bound]
    kubectl("delete", "tft", "one", "-n", ns, check=True)
    wait_until(lambda: not _workers(kubectl, ns, "one-ray"), timeout=180, interval=2, what="one's pods gone")
    _apply(kubectl, _slice("two", "tas", slices=2, scheduling={"topologyAware": True}), ns=ns)
    bound = wait_until(lambda: len(p := [x for x in _workers(kubectl, ns, "two-ray") if x["spec"].get("nodeName")]) == 8
                       and p, timeout=240, interval=2, what="two's 8 hosts bound by the scheduler")
    per_pool: dict[str, set[str]] = {}
    for p in bound:
        labels = p["metadata"]["labels"]
        per_pool.setdefault(pool_of[p["spec"]["nodeName"]], set()).add(
            f"{labels['ray.io/group']} replica {labels.get('ray.io/worker-group-replica-index', '?')}")
    print(f"TAS placement: node pool -> the slices (worker group, replica) of its pods: {per_pool}")
    assert set(per_pool) == {f"{V6E.name}-0", f"{V6E.name}-1"}, per_pool
    assert all(len(slices) == 1 for slices in per_pool.values()), per_pool
    assert sorted(len([p for p in bound if pool_of[p["spec"]["nodeName"]] == pool]) for pool in per_pool) == [4, 4]
    status = _phase(kubectl, ns, "two", "VerifyingCollectives", timeout=180, what="two verifying on both slices")
    assert len(status["recovery"]["slicePods"]) == 1 + 8, status["recovery"]   # the head and both slices
    # a host of slice 1 lost: KubeRay makes the slice's pods again, Kueue places them on a node pool whole
    recorded = set(status["recovery"]["slicePods"])
    lost = next(p for p in bound if p["metadata"]["labels"]["ray.io/group"].endswith("-s1"))
    kubectl("delete", "pod", lost["metadata"]["name"], "-n", ns, "--wait=false", check=True)
    status = wait_until(lambda: (s := _status(kubectl, ns, "two")).get("phase") == "VerifyingCollectives"
                        and set(s["recovery"].get("slicePods") or ()) - recorded and s,
                        timeout=180, interval=1, what="two's slice 1 replaced and verifying again")
    assert status["recovery"]["sliceReplacements"] == 1 and lost["metadata"]["name"] in status["recovery"]["history"][0]["cause"]
    again = [p for p in _workers(kubectl, ns, "two-ray") if p["metadata"]["labels"]["ray.io/group"].endswith("-s1")]
    assert len(again) == 4 and len({pool_of[p["spec"]["nodeName"]] for p in again}) == 1, [
        p["spec"].get("nodeName") for p in again]
    kubectl("delete", "tft", "two", "-n", ns, check=True)
