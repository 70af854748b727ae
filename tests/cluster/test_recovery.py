"""A host lost under a running slice, on the real cluster: a KubeRay worker pod deleted mid-training
is recreated by KubeRay, our operator stops the jobs, waits for the whole slice, verifies it again
and resumes the same training attempt from its last checkpoint. The same run then serves with an
image that does not exist: the kubelet's pull error is in status while Serving, and the run fails
ServeFailed at spec.serve.timeoutSeconds naming it (the seed-004 hang, caught and named; the happy
path is tests/cluster/test_demo.py). On the simulated v6e pool: a node deleted under the slice is
replaced on a spare, and a second loss past spec.recovery.maxSliceReplacements ends SliceLost."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.paths import EXAMPLES
from tests.waiting import wait_until

EVERY = 5   # checkpoint.everySteps: the most a replacement may cost
SERVE_TIMEOUT = 60
BAD_IMAGE = "docker.io/tpufinetune/serving:does-not-exist"


def _status(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout).get("status") or {}


def _kill_a_worker(kubectl, ns: str, name: str) -> str:
    pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", f"ray.io/cluster={name}-ray,ray.io/node-type=worker",
                              "-o", "json", check=True).stdout)["items"]
    victim = sorted(p["metadata"]["name"] for p in pods)[0]
    kubectl("delete", "pod", victim, "-n", ns, "--wait=false", check=True)
    return victim


@pytest.mark.real_node
@pytest.mark.timeout(2100)
def test_a_worker_lost_mid_training_is_replaced_and_resumed_then_a_missing_serving_image_fails_serve_failed(
        cluster_kubectl, cluster_ns, tmp_path):
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    storage = str(tmp_path / "checkpoints")
    doc["metadata"]["name"] = "heal"
    doc["spec"]["checkpoint"].update(storagePath=storage, everySteps=EVERY)
    doc["spec"]["checkpoint"]["volume"]["hostPath"]["path"] = storage
    doc["spec"]["training"]["epochs"] = 4
    doc["spec"]["recovery"] = {"maxSliceReplacements": 1}
    doc["spec"]["serve"].update(image=BAD_IMAGE, timeoutSeconds=SERVE_TIMEOUT)
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)

    def training_past(step: int):
        st = _status(cluster_kubectl, cluster_ns, "heal")
        assert st.get("phase") != "Failed", st
        return st.get("phase") == "Training" and (st.get("training") or {}).get("step", 0) >= step
    wait_until(lambda: training_past(EVERY + 1), timeout=900, interval=2, what=f"training past step {EVERY + 1}")
    victim = _kill_a_worker(cluster_kubectl, cluster_ns, "heal")
    seen = wait_until(lambda: (st := _status(cluster_kubectl, cluster_ns, "heal")).get("recovery") and st,
                      timeout=120, interval=1, what="the loss to be seen")
    assert seen["phase"] in ("Provisioning", "VerifyingCollectives", "Training"), seen

    # Training resumes and ends; serving starts (its image does not exist).
    st = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "heal")).get("phase") in ("Serving", "Failed")
                    and s, timeout=1200, interval=2, what="training to end and serving to start")
    assert st["phase"] == "Serving", st
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
    # the training slice was released before serving started
    assert cluster_kubectl("get", "raycluster", "heal-ray", "-n", cluster_ns).returncode != 0

    # The kubelet's pull error, in status while still Serving; then ServeFailed naming it. (The
    # bound itself is the operator's, counted from status.serving.notReadySince: tests/unit/test_phases.py.)
    blocked = wait_until(lambda: "cannot be pulled" in ((s := _status(cluster_kubectl, cluster_ns, "heal"))
                                                        .get("message") or "") and s,
                         timeout=3 * SERVE_TIMEOUT, interval=2, what="the pull error in status")
    assert blocked["phase"] == "Serving" and "serving:does-not-exist" in blocked["message"], blocked
    failed = wait_until(lambda: (s := _status(cluster_kubectl, cluster_ns, "heal")).get("phase") == "Failed" and s,
                        timeout=3 * SERVE_TIMEOUT, interval=2, what="ServeFailed at spec.serve.timeoutSeconds")
    assert failed["reason"] == "ServeFailed", failed
    assert f"spec.serve.timeoutSeconds ({SERVE_TIMEOUT}s)" in failed["message"]
    assert "serving:does-not-exist cannot be pulled" in failed["message"], failed["message"]
    conditions = {x["type"]: x["status"] for x in failed["conditions"]}
    assert conditions["TrainingSucceeded"] == "True" and conditions["Serving"] == "False", conditions


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
    """A v6e 4x4 slice on the simulated pool, one of its nodes deleted (as a GKE node lost): the
    garbage collector removes the pod, KubeRay recreates it on the pool's spare node, and our
    operator replaces the slice and goes back through verification. A second node lost, with
    maxSliceReplacements 1 spent, ends Failed/SliceLost with the history. (Nothing executes on
    simulated hosts: verification would end at its deadline, long after this test.)"""
    selector = "cloud.google.com/gke-tpu-accelerator=tpu-v6e-slice,cloud.google.com/gke-tpu-topology=4x4"
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
