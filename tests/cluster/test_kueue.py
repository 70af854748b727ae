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
from tpuft import constants as c
from tpuft_local import kueue, pools

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
    prios = [{"apiVersion": f"{c.KUEUE_GROUP}/{c.KUEUE_VERSION}", "kind": "WorkloadPriorityClass",
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
    doc["metadata"] = {"name": name, "labels": {c.KUEUE_QUEUE_LABEL: queue,
                                                **({c.KUEUE_PRIORITY_LABEL: priority} if priority else {})}}
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
    assert c.TPU_RESOURCE in st["message"] and V6E.name in st["message"], st["message"]
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
    assert st["phase"] == "Queued" and c.TPU_RESOURCE in st["message"], st
    (wl,) = [w for w in _get(cluster_kubectl, "workloads", "-n", ns)["items"]
             if any(o["name"] == "two-ray" for o in w["metadata"].get("ownerReferences") or [])]
    assert sorted(p["count"] for p in wl["spec"]["podSets"]) == [1, 8], wl["spec"]["podSets"]   # head; 2 x 4 hosts
    assert not _get(cluster_kubectl, "pods", "-n", ns, "-l", "ray.io/cluster=two-ray").get("items")
    cluster_kubectl("delete", "tft", "lost", "two", "-n", ns, check=True)
    wait_until(lambda: not _get(cluster_kubectl, "rayclusters,workloads", "-n", ns).get("items"), timeout=120,
               interval=1, what="lost's RayCluster and Workload gone")
