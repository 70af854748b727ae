"""A host lost under a slice on the simulated v6e pool: a node deleted under the slice is replaced on
a spare, and a second loss past spec.recovery.maxSliceReplacements ends SliceLost. (A host lost
mid-training on the real node, resumed from its checkpoint, is in tests/cluster/test_lifecycle.py's
one run through every disruption.)"""
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


def test_a_simulated_tpu_node_deleted_under_the_slice_is_replaced_then_a_second_loss_ends_slice_lost(
        cluster_kubectl, cluster_ns):
    """A v6e 4x4 slice on the simulated pool (the first of the two, pinned), one of its nodes deleted
    (as a GKE node lost): the garbage collector removes the pod, KubeRay recreates it on the pool's
    spare node (a slice's pods share one node pool: the TPU webhook's affinity), and our
    operator replaces the slice and goes back through verification. A second node lost, with
    maxSliceReplacements 1 spent, ends Failed/SliceLost with the history. (Nothing executes on
    simulated hosts: verification would end at its deadline, long after this test.)"""
    pool_name = "v6e-4x4-0"
    selector = ("cloud.google.com/gke-tpu-accelerator=tpu-v6e-slice,cloud.google.com/gke-tpu-topology=4x4,"
                f"cloud.google.com/gke-nodepool={pool_name}")
    nodes = json.loads(cluster_kubectl("get", "nodes", "-l", selector, "-o", "json", check=True).stdout)["items"]
    spare = _node_copy(nodes[0], "gke-v6e-spare")
    cluster_kubectl("apply", "-f", "-", input=json.dumps(spare), check=True)
    saved: list[dict] = []
    try:
        doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
        doc["metadata"]["name"] = "swap"
        doc["spec"]["verification"]["timeoutSeconds"] = 600
        doc["spec"]["provisioningTimeoutSeconds"] = 300
        doc["spec"]["recovery"] = {"maxSliceReplacements": 1}
        doc["spec"]["scheduling"] = {"nodeSelector": {"cloud.google.com/gke-nodepool": pool_name}}   # where the spare is
        cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)
        wait_until(lambda: _status(cluster_kubectl, cluster_ns, "swap").get("phase") == "VerifyingCollectives",
                   timeout=240, interval=2, what="the slice up and verifying")

        def workers() -> dict[str, str]:
            pods = json.loads(cluster_kubectl("get", "pods", "-n", cluster_ns, "-l",
                                              "ray.io/cluster=swap-ray,ray.io/node-type=worker", "-o", "json",
                                              check=True).stdout)["items"]
            return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pods
                    if not p["metadata"].get("deletionTimestamp")}

        def lose(node_name: str) -> None:
            saved.append(next((n for n in nodes if n["metadata"]["name"] == node_name), spare))
            cluster_kubectl("delete", "node", node_name, "--wait=false", check=True)

        before = workers()
        pool = {n["metadata"]["name"] for n in nodes} | {"gke-v6e-spare"}
        (free,) = pool - set(before.values())   # 5 nodes, 4 hosts: one is the spare, whichever it is
        victim = sorted(before.values())[0]
        lose(victim)
        st = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("recovery") and s,
                        timeout=240, interval=2, what="the lost host seen")
        (loss,) = st["recovery"]["history"]
        assert loss["phase"] == "VerifyingCollectives" and loss["hosts"] == 4 and loss["hostsReady"] < 4, loss
        wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("phase") == "VerifyingCollectives"
                   and s["recovery"]["sliceReplacements"] == 1, timeout=240, interval=2, what="verification again")
        after = workers()
        assert len(after) == 4 and set(after.values()) == set(before.values()) - {victim} | {free}, (before, after)

        lose(sorted(after.values())[0])   # no spare left, and no replacement allowed
        st = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("phase") == "Failed" and s,
                        timeout=240, interval=2, what="SliceLost")
        assert st["reason"] == "SliceLost" and "maxSliceReplacements=1" in st["message"], st
        assert [h["phase"] for h in st["recovery"]["history"]] == ["VerifyingCollectives"] * 2, st["recovery"]
    finally:
        cluster_kubectl("delete", "tft", "swap", "-n", cluster_ns, "--ignore-not-found", "--wait=false")
        for node in saved:
            if node is not spare:
                cluster_kubectl("apply", "-f", "-", input=json.dumps(_node_copy(node, node["metadata"]["name"])))
        cluster_kubectl("delete", "node", "gke-v6e-spare", "--ignore-not-found", "--wait=false")
