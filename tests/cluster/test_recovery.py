"""A host lost under a running slice, on the real cluster: a KubeRay worker pod deleted mid-training
is recreated by KubeRay, our operator stops the jobs, waits for the whole slice, verifies it again
and resumes the same training attempt from its last checkpoint; with no replacement allowed the
same loss ends Failed/SliceLost."""
from __future__ import annotations

import json

import yaml

from tests.paths import EXAMPLES
from tests.waiting import wait_until

EVERY = 5   # checkpoint.everySteps: the most a replacement may cost


def _run(kubectl, ns: str, name: str, storage: str, replacements: int) -> None:
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"].pop("serve")   # training only: this test ends at Succeeded
    doc["metadata"]["name"] = name
    doc["spec"]["checkpoint"].update(storagePath=storage, everySteps=EVERY)
    doc["spec"]["checkpoint"]["volume"]["hostPath"]["path"] = storage
    doc["spec"]["training"]["epochs"] = 4
    doc["spec"]["recovery"] = {"maxSliceReplacements": replacements}
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc), check=True)


def _status(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout).get("status") or {}


def _training_past(kubectl, ns: str, name: str, step: int) -> None:
    def check():
        st = _status(kubectl, ns, name)
        assert st.get("phase") != "Failed", st
        return st.get("phase") == "Training" and (st.get("training") or {}).get("step", 0) >= step
    wait_until(check, timeout=900, interval=2, what=f"{name} training past step {step}")


def _kill_a_worker(kubectl, ns: str, name: str) -> str:
    pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", f"ray.io/cluster={name}-ray,ray.io/node-type=worker",
                              "-o", "json", check=True).stdout)["items"]
    victim = sorted(p["metadata"]["name"] for p in pods)[0]
    kubectl("delete", "pod", victim, "-n", ns, "--wait=false", check=True)
    return victim


def _finished(kubectl, ns: str, name: str, timeout: float) -> dict:
    return wait_until(lambda: (st := _status(kubectl, ns, name)).get("phase") in ("Succeeded", "Failed") and st,
                      timeout=timeout, interval=3, what=f"{name} to finish")


def test_a_worker_lost_mid_training_is_replaced_verified_again_and_resumed(cluster_kubectl, cluster_ns, tmp_path):
    _run(cluster_kubectl, cluster_ns, "heal", str(tmp_path / "checkpoints"), replacements=1)
    _training_past(cluster_kubectl, cluster_ns, "heal", EVERY + 1)
    victim = _kill_a_worker(cluster_kubectl, cluster_ns, "heal")
    seen = wait_until(lambda: (st := _status(cluster_kubectl, cluster_ns, "heal")).get("recovery") and st,
                      timeout=120, interval=1, what="the loss to be seen")
    assert seen["phase"] in ("Provisioning", "VerifyingCollectives", "Training"), seen
    st = _finished(cluster_kubectl, cluster_ns, "heal", 1200)
    assert st["phase"] == "Succeeded", st
    (loss,) = st["recovery"]["history"]
    assert st["recovery"]["sliceReplacements"] == 1 and loss["phase"] == "Training", (victim, st["recovery"])
    assert loss["hostsReady"] < loss["hosts"] == 2, loss
    training = st["training"]
    # resumed from its own checkpoint, losing at most one checkpoint interval of reported progress
    assert training.get("resumedFromStep", 0) >= max(loss.get("step", 0) - EVERY, EVERY), (training, loss)
    assert training["step"] == training["totalSteps"]
    events = json.loads(cluster_kubectl("get", "events", "-n", cluster_ns, "-o", "json", "--field-selector",
                                        "involvedObject.name=heal,reason=ReplacingSlice", check=True).stdout)["items"]
    assert len(events) == 1 and "a host was lost during Training" in events[0]["message"], events


def test_a_loss_with_no_replacement_left_ends_slice_lost(cluster_kubectl, cluster_ns, tmp_path):
    _run(cluster_kubectl, cluster_ns, "fragile", str(tmp_path / "checkpoints"), replacements=0)
    _training_past(cluster_kubectl, cluster_ns, "fragile", 1)
    _kill_a_worker(cluster_kubectl, cluster_ns, "fragile")
    st = _finished(cluster_kubectl, cluster_ns, "fragile", 300)
    assert st["phase"] == "Failed" and st["reason"] == "SliceLost", st
    assert "maxSliceReplacements=0" in st["message"] and st["recovery"]["history"][0]["phase"] == "Training"


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


def test_a_simulated_tpu_node_deleted_under_the_slice_is_replaced_on_a_spare(cluster_kubectl, cluster_ns):
    """A v6e 4x4 slice on the simulated pool, one of its nodes deleted (as a GKE node lost): the
    garbage collector removes the pod, KubeRay recreates it on the pool's spare node, and our
    operator replaces the slice and goes back through verification. (Nothing executes on simulated
    hosts: verification would end at its deadline; the test ends once it has started again.)"""
    selector = "cloud.google.com/gke-tpu-accelerator=tpu-v6e-slice,cloud.google.com/gke-tpu-topology=4x4"
    nodes = json.loads(cluster_kubectl("get", "nodes", "-l", selector, "-o", "json", check=True).stdout)["items"]
    spare = _node_copy(nodes[0], "gke-v6e-spare")
    cluster_kubectl("apply", "-f", "-", input=json.dumps(spare), check=True)
    saved = None
    try:
        doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
        doc["metadata"]["name"] = "swap"
        doc["spec"]["verification"]["timeoutSeconds"] = 600
        doc["spec"]["provisioningTimeoutSeconds"] = 300
        cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)
        wait_until(lambda: _status(cluster_kubectl, cluster_ns, "swap").get("phase") == "VerifyingCollectives",
                   timeout=240, interval=2, what="the slice up and verifying")

        def workers() -> dict[str, str]:
            pods = json.loads(cluster_kubectl("get", "pods", "-n", cluster_ns, "-l",
                                              "ray.io/cluster=swap-ray,ray.io/node-type=worker", "-o", "json",
                                              check=True).stdout)["items"]
            return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pods
                    if not p["metadata"].get("deletionTimestamp")}

        before = workers()
        pool = {n["metadata"]["name"] for n in nodes} | {"gke-v6e-spare"}
        (free,) = pool - set(before.values())   # 5 nodes, 4 hosts: one is the spare, whichever it is
        victim = sorted(before.values())[0]
        saved = next((n for n in nodes if n["metadata"]["name"] == victim), spare)
        cluster_kubectl("delete", "node", victim, "--wait=false", check=True)
        st = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("recovery") and s,
                        timeout=240, interval=2, what="the lost host seen")
        (loss,) = st["recovery"]["history"]
        assert loss["phase"] == "VerifyingCollectives" and loss["hosts"] == 4 and loss["hostsReady"] < 4, loss
        wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "swap")).get("phase") == "VerifyingCollectives"
                   and s["recovery"]["sliceReplacements"] == 1, timeout=240, interval=2, what="verification again")
        after = workers()
        assert len(after) == 4 and set(after.values()) == set(before.values()) - {victim} | {free}, (before, after)
    finally:
        cluster_kubectl("delete", "tft", "swap", "-n", cluster_ns, "--ignore-not-found", "--wait=false")
        if saved is not None:
            cluster_kubectl("apply", "-f", "-", input=json.dumps(_node_copy(saved, saved["metadata"]["name"])))
        cluster_kubectl("delete", "node", "gke-v6e-spare", "--ignore-not-found", "--wait=false")
