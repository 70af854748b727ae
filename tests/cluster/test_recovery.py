"""A host lost under one slice of two on the simulated v6e pools (issue 29): only that slice's pods
are replaced, on a spare node of its own pool, the run is verified again, and a second loss past
spec.recovery.maxSliceReplacements ends SliceLost. (A host lost mid-training on the real node,
resumed from its checkpoint, is in tests/cluster/test_lifecycle.py's one run through every
disruption; the resume after a replacement, whatever the slice count, is tests/unit/test_phases.py's.)"""
from __future__ import annotations

import json

import yaml

from tests.paths import EXAMPLES
from tests.waiting import wait_until


def _status(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout).get("status") or {}


def _node_copy(node: dict, name: str) -> dict:
    """A Node as tpuft_local.pools writes it (KWOK's annotation, the pool's labels and taints,
    capacity), under another name: KWOK then runs it like the pool's other nodes."""
    meta = node["metadata"]
    labels = {**meta["labels"], "kubernetes.io/hostname": name}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels, "annotations": {
                k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(("kwok.x-k8s.io", "node.alpha"))}},
            "spec": {"taints": node["spec"].get("taints") or []},
            "status": {"capacity": node["status"]["capacity"], "allocatable": node["status"]["allocatable"]}}


def _workers(kubectl, ns: str, name: str) -> dict[str, dict]:
    """The live worker pods by name: node, uid and the slice the TPU webhook stand-in gave it."""
    pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", f"ray.io/cluster={name}-ray,ray.io/node-type=worker",
                              "-o", "json", check=True).stdout)["items"]
    return {p["metadata"]["name"]: {"node": p["spec"].get("nodeName", ""), "uid": p["metadata"]["uid"],
                                    "slice": next(e.get("value") for e in p["spec"]["containers"][0].get("env", [])
                                                  if e["name"] == "TPU_NAME")}
            for p in pods if not p["metadata"].get("deletionTimestamp")}


def test_a_host_lost_in_one_of_two_slices_replaces_only_that_slice_then_a_second_loss_ends_slice_lost(
        local_cluster, cluster_kubectl, cluster_ns):
    """examples/v6e-4x4x2.yaml on the two simulated v6e 4x4 pools; one node under a slice lost (its
    Node deleted and its pod with it, as the pod garbage collector does): KubeRay recreates the pod,
    Pending (its pool is full), our operator stops the jobs and waits for the slice; the node then
    comes back (as GKE's repair brings it back under its name), the pod lands there, the other
    slice's pods are left as they were, and the run goes back through verification. A second node
    lost, with maxSliceReplacements 1 spent, ends Failed/SliceLost with the history. (Nothing
    executes on simulated hosts: verification would end at its deadline, long after this test.)
    Until the operator has seen each loss, the test holds `up`'s lock: `tpuft demo`, in the other
    lane, runs `up`, which puts the pools' nodes back."""
    saved: dict[str, dict] = {}
    try:
        doc = yaml.safe_load((EXAMPLES / "v6e-4x4x2.yaml").read_text())
        doc["metadata"]["name"] = "swap"
        doc["spec"]["provisioningTimeoutSeconds"] = 300
        doc["spec"]["recovery"] = {"maxSliceReplacements": 1}
        cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)
        wait_until(lambda: _status(cluster_kubectl, cluster_ns, "swap").get("phase") == "VerifyingCollectives",
                   timeout=240, interval=2, what="both slices up and verifying")

        def lose(node_name: str) -> None:
            saved[node_name] = json.loads(cluster_kubectl("get", "node", node_name, "-o", "json", check=True).stdout)
            cluster_kubectl("delete", "node", node_name, "--wait=false", check=True)
            cluster_kubectl("delete", "pods", "-n", cluster_ns, "--field-selector", f"spec.nodeName={node_name}",
                            "--grace-period=0", "--force", check=True)

        def back(node_name: str, check: bool = True) -> None:
            cluster_kubectl("apply", "-f", "-", input=json.dumps(_node_copy(saved[node_name], node_name)), check=check)

        before = _workers(cluster_kubectl, cluster_ns, "swap")
        assert len(before) == 8 and len({w["slice"] for w in before.values()}) == 2, before
        victim_pod, victim = sorted(before.items())[0]
        hit = victim["slice"]
        with local_cluster.up_lock():
            lose(victim["node"])
            st = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("recovery") and s,
                            timeout=240, interval=2, what="the lost host seen")
        (loss,) = st["recovery"]["history"]
        assert loss["phase"] == "VerifyingCollectives" and loss["hosts"] == 8 and loss["hostsReady"] < 8, loss
        assert st["phase"] == "Provisioning" and st["reason"] == "ReplacingSlice", st
        back(victim["node"])
        wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("phase") == "VerifyingCollectives"
                   and s["recovery"]["sliceReplacements"] == 1, timeout=240, interval=2, what="verification again")
        after = _workers(cluster_kubectl, cluster_ns, "swap")
        untouched = {k: v for k, v in before.items() if v["slice"] != hit}
        # the other slice's 4 pods are the same pods on the same nodes
        assert {k: v for k, v in after.items() if v["slice"] != hit} == untouched, (before, after)
        replaced = {k: v for k, v in after.items() if v["slice"] == hit}
        # the lost slice is whole again on its own nodes, the lost pod a new one
        assert len(replaced) == 4 and victim_pod not in replaced, (before, after)
        assert {v["node"] for v in replaced.values()} == {v["node"] for v in before.values() if v["slice"] == hit}

        with local_cluster.up_lock():
            lose(sorted(v["node"] for v in untouched.values())[0])   # the other slice: no replacement left
            st = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("phase") == "Failed" and s,
                            timeout=240, interval=2, what="SliceLost")
        assert st["reason"] == "SliceLost" and "maxSliceReplacements=1" in st["message"], st
        assert [h["phase"] for h in st["recovery"]["history"]] == ["VerifyingCollectives"] * 2, st["recovery"]
    finally:
        cluster_kubectl("delete", "tft", "swap", "-n", cluster_ns, "--ignore-not-found", "--wait=false")
        for name in saved:
            back(name, check=False)   # the first of them is back already; applying it again changes nothing
