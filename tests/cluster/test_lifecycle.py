"""One CPU run through the disruptions a real cluster has, against the real KubeRay: the run is
suspended mid-training (KubeRay's pods go away) and resumed, then our operator's pod is deleted
while the resumed training runs (the Deployment starts another, which picks the run up), and it
still ends Succeeded, resumed from its own last checkpoint. Suspend goes first: the operator
acts on it within seconds, so it always lands while training (after a restart of unknown length
the run might already have finished)."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.cluster_fixtures import assert_nothing_left_failed
from tests.paths import EXAMPLES
from tests.waiting import wait_until
from tpuft_local import chart, node


def _tft(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout)


def _operator_pods(kubectl) -> list[dict]:
    res = kubectl("get", "pods", "-n", chart.NAMESPACE, "-l", f"app.kubernetes.io/instance={chart.RELEASE}", "-o", "json")
    return json.loads(res.stdout)["items"] if res.returncode == 0 else []


@pytest.mark.real_node
def test_suspend_resume_and_operator_restart_mid_training(cluster_kubectl, cluster_ns, tmp_path):
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"].pop("serve")   # training only: this test ends at Succeeded
    storage = str(tmp_path / "checkpoints")
    doc["metadata"]["name"] = "life"
    doc["spec"]["checkpoint"].update(storagePath=storage, everySteps=5)
    doc["spec"]["checkpoint"]["volume"]["hostPath"]["path"] = storage
    doc["spec"]["training"]["epochs"] = 4
    # Verification off: it would run twice (before training and again after the resume) and prove
    # nothing this test asserts; re-verification after a resume is tests/unit/test_phases.py's and
    # tests/integration/test_handlers.py's, and on the real cluster the heal run re-verifies.
    doc["spec"]["verification"] = {"enabled": False}
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)

    def training_step(at_least: int):
        st = _tft(cluster_kubectl, cluster_ns, "life").get("status") or {}
        assert st.get("phase") != "Failed", st
        return st.get("phase") == "Training" and (st.get("training") or {}).get("step", 0) >= at_least

    wait_until(lambda: training_step(6), timeout=900, interval=2, what="training past its first checkpoint")
    # Every pod of the run on the real node: a simulated node would only pretend to run it.
    ray_pods = json.loads(cluster_kubectl("get", "pods", "-n", cluster_ns, "-l", "ray.io/node-type", "-o", "json",
                                          check=True).stdout)["items"]
    assert ray_pods and {p["spec"]["nodeName"] for p in ray_pods} == {node.NODE_NAME}, \
        [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in ray_pods]
    cluster_kubectl("patch", "tft", "life", "-n", cluster_ns, "--type=merge", "-p", '{"spec":{"suspend":true}}',
                    check=True)
    st = wait_until(lambda: (s := _tft(cluster_kubectl, cluster_ns, "life")["status"]).get("phase") in
                    ("Suspended", "Succeeded", "Failed") and s, timeout=300, interval=2, what="phase Suspended")
    assert st["phase"] == "Suspended" and "suspended during Training" in st["message"], st
    wait_until(lambda: not json.loads(cluster_kubectl("get", "pods", "-n", cluster_ns, "-l", "ray.io/node-type",
                                                      "-o", "json", check=True).stdout)["items"],
               timeout=300, interval=2, what="KubeRay's pods to go while suspended")
    cluster_kubectl("patch", "tft", "life", "-n", cluster_ns, "--type=merge", "-p", '{"spec":{"suspend":false}}',
                    check=True)

    def resumed_training():
        st = _tft(cluster_kubectl, cluster_ns, "life").get("status") or {}
        assert st.get("phase") not in ("Failed", "Succeeded"), st
        # the resumed workload writes resumedFromStep as it loads the checkpoint, then trains on
        return st.get("phase") == "Training" and (st.get("training") or {}).get("resumedFromStep", 0) >= 5

    wait_until(resumed_training, timeout=900, interval=2, what="the resumed run training again")
    (old,) = [p["metadata"]["name"] for p in _operator_pods(cluster_kubectl)]
    cluster_kubectl("delete", "pod", old, "-n", chart.NAMESPACE, "--wait=false", check=True)
    wait_until(lambda: any(p["metadata"]["name"] != old and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
        for p in _operator_pods(cluster_kubectl)), timeout=180, interval=2, what="a new operator pod Ready")

    def finished():
        st = _tft(cluster_kubectl, cluster_ns, "life").get("status") or {}
        return st.get("phase") in ("Succeeded", "Failed") and st

    st = wait_until(finished, timeout=1200, interval=3, what="the resumed run to finish")
    assert st["phase"] == "Succeeded", st
    training = st["training"]
    assert training.get("resumedFromStep", 0) >= 5, training  # its own checkpoint, not step 0
    assert training["step"] == training["totalSteps"] and training.get("loss") is not None
    # the suspended attempt's RayJob went before its pods; the finished one is Complete (issue 24)
    assert_nothing_left_failed(cluster_kubectl, cluster_ns)
