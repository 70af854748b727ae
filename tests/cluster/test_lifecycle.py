"""One CPU run through the disruptions a real cluster has, against the real KubeRay and the real
Kueue: the run, queued under a ClusterQueue with room for one such run, is preempted mid-training
by a higher-priority one (Kueue suspends its RayCluster, KubeRay's pods go away, each rank saves a
checkpoint at its next step on the way out), waits Queued, is admitted again once the other is
gone and resumes from that checkpoint; then our operator's pod is deleted while the resumed
training runs (the Deployment starts another, which picks the run up), and it still ends
Succeeded, with no slice replacement counted. The preemption goes first: the operator acts on it
within seconds, so it always lands while training (after a restart of unknown length the run
might already have finished). A user's spec.suspend is tests/integration/test_handlers.py's."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.cluster_fixtures import assert_nothing_left_failed
from tests.paths import EXAMPLES
from tests.waiting import wait_until
from tpuft import constants as c
from tpuft_local import chart, node

ONE_RUN_CPU = "1"   # local-cpu.yaml's pods ask 0.6 CPU (head 100m, two workers 250m): one run fits, two do not


def _tft(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout)


def _operator_pods(kubectl) -> list[dict]:
    res = kubectl("get", "pods", "-n", chart.NAMESPACE, "-l", f"app.kubernetes.io/instance={chart.RELEASE}", "-o", "json")
    return json.loads(res.stdout)["items"] if res.returncode == 0 else []


def _queue(kubectl, ns: str) -> tuple[str, list[str]]:
    """A ClusterQueue with CPU for one run (preempting lower priority), its LocalQueue and two
    priorities; returns (LocalQueue, [priority class low, high])."""
    api = f"{c.KUEUE_GROUP}/{c.KUEUE_VERSION}"
    prios = [f"low-{ns}", f"high-{ns}"]
    docs = [{"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": f"cq-{ns}"},
             "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                          {"name": "cpu", "resources": [{"name": "cpu", "nominalQuota": ONE_RUN_CPU},
                                                        {"name": "memory", "nominalQuota": "16Gi"}]}]}]}},
            {"apiVersion": api, "kind": "LocalQueue", "metadata": {"name": "lq", "namespace": ns},
             "spec": {"clusterQueue": f"cq-{ns}"}},
            *[{"apiVersion": api, "kind": "WorkloadPriorityClass", "metadata": {"name": p}, "value": v}
              for p, v in zip(prios, (100, 1000))]]
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}), check=True)
    return "lq", prios


@pytest.fixture
def cpu_queue(cluster_kubectl, cluster_ns):
    yield _queue(cluster_kubectl, cluster_ns)
    cluster_kubectl("delete", "tft", "--all", "-n", cluster_ns, "--wait=false")
    wait_until(lambda: not json.loads(cluster_kubectl("get", "workloads", "-n", cluster_ns, "-o", "json",
                                                      check=True).stdout)["items"], timeout=300, interval=2,
               what="the Workloads to go")
    cluster_kubectl("delete", "clusterqueue", f"cq-{cluster_ns}", "--ignore-not-found")
    cluster_kubectl("delete", "workloadpriorityclass", f"low-{cluster_ns}", f"high-{cluster_ns}", "--ignore-not-found")


def _run(name: str, storage: str, queue: str, priority: str, epochs: int) -> dict:
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"].pop("serve")   # training only: this test ends at Succeeded
    doc["metadata"] = {"name": name, "labels": {c.KUEUE_QUEUE_LABEL: queue, c.KUEUE_PRIORITY_LABEL: priority}}
    doc["spec"]["checkpoint"].update(storagePath=storage, everySteps=5)
    doc["spec"]["checkpoint"]["volume"]["hostPath"]["path"] = storage
    doc["spec"]["training"]["epochs"] = epochs
    # Verification off: it would run twice (before training and again after the resume) and prove
    # nothing this test asserts; re-verification after a resume is tests/unit/test_phases.py's and
    # tests/integration/test_handlers.py's, and on the real cluster the heal run re-verifies.
    doc["spec"]["verification"] = {"enabled": False}
    return doc


@pytest.mark.real_node
def test_preemption_resume_and_operator_restart_mid_training(cluster_kubectl, cluster_ns, cpu_queue, tmp_path):
    queue, (low, high) = cpu_queue
    doc = _run("life", str(tmp_path / "checkpoints"), queue, low, epochs=4)
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)

    def training_step(at_least: int):
        st = _tft(cluster_kubectl, cluster_ns, "life").get("status") or {}
        assert st.get("phase") != "Failed", st
        return st.get("phase") == "Training" and (st.get("training") or {}).get("step", 0) >= at_least

    wait_until(lambda: training_step(6), timeout=900, interval=2, what="training past its first checkpoint")
    st = _tft(cluster_kubectl, cluster_ns, "life")["status"]
    assert next(x for x in st["conditions"] if x["type"] == "Admitted")["status"] == "True", st["conditions"]
    # Every pod of the run on the real node: a simulated node would only pretend to run it.
    ray_pods = json.loads(cluster_kubectl("get", "pods", "-n", cluster_ns, "-l", "ray.io/node-type", "-o", "json",
                                          check=True).stdout)["items"]
    assert ray_pods and {p["spec"]["nodeName"] for p in ray_pods} == {node.NODE_NAME}, \
        [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in ray_pods]
    bump = _run("bump", str(tmp_path / "bump"), queue, high, epochs=1)
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(bump), check=True)
    st = wait_until(lambda: (s := _tft(cluster_kubectl, cluster_ns, "life")["status"]).get("phase") in
                    ("Queued", "Succeeded", "Failed") and s, timeout=300, interval=1, what="life preempted")
    assert (st["phase"], st["reason"]) == ("Queued", "Preempted"), st
    preempted = st["recovery"]["lastPreemption"]
    assert preempted["phase"] == "Training" and "Preempted" in preempted["cause"], preempted
    # The other one runs; once it is gone, Kueue admits life again.
    wait_until(lambda: (_tft(cluster_kubectl, cluster_ns, "bump").get("status") or {}).get("phase")
               not in (None, "Pending", "Queued"), timeout=300, interval=2, what="bump admitted")
    cluster_kubectl("delete", "tft", "bump", "-n", cluster_ns, "--wait=false", check=True)

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
    # preemption is not loss: counted as one, never as a slice replacement
    assert st["recovery"]["preemptions"] == 1 and not st["recovery"].get("sliceReplacements"), st["recovery"]
    # the ranks saved at their next step on the way out: the resumed run lost at most one step of
    # what was last reported before the preemption
    lost = preempted.get("step", 0) - training["resumedFromStep"]
    print(f"steps lost to the preemption: {lost} (last reported step {preempted.get('step')}, resumed from "
          f"{training['resumedFromStep']})")
    assert lost <= 1, (preempted, training)
    assert st["goodput"]["queuedSeconds"] > 0, st["goodput"]
    assert training["step"] == training["totalSteps"] and training.get("loss") is not None
    # the suspended attempt's RayJob went before its pods; the finished one is Complete (issue 24)
    assert_nothing_left_failed(cluster_kubectl, cluster_ns)
