"""Our operator as users run it: the image built from Dockerfile.operator, installed by
`helm install` of charts/tpufinetune-operator with its default values, on the containerd node."""
from __future__ import annotations

import json

import pytest

from tests.waiting import wait_until
from tpuft_local import chart, node


@pytest.fixture
def operator_pod(cluster_kubectl):
    """The one Ready operator pod. Read afresh by each test and waited for: the lifecycle test, in
    another lane at the same time, deletes the operator's pod once and the Deployment makes another."""
    def ready_one():
        pods = json.loads(cluster_kubectl("get", "pods", "-n", chart.NAMESPACE, "-l",
                                          f"app.kubernetes.io/instance={chart.RELEASE}", "-o", "json",
                                          check=True).stdout)["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = [p for p in live if p["status"].get("phase") == "Running" and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
        return ready[0] if len(live) == len(ready) == 1 else None
    return wait_until(ready_one, timeout=240, interval=2, what="one Ready operator pod")


def test_operator_pod_runs_from_the_image_entrypoint_on_the_real_node(operator_pod):
    assert operator_pod["spec"]["nodeName"] == node.NODE_NAME
    ready = {c["type"]: c["status"] for c in operator_pod["status"]["conditions"]}
    assert ready["Ready"] == "True" and ready["ContainersReady"] == "True"
    (container,) = operator_pod["spec"]["containers"]
    assert "command" not in container  # the image's ENTRYPOINT (kopf run ...) runs
    assert container["image"] == "ghcr.io/tpufinetune/tpufinetune-operator:0.1.0"
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert operator_pod["spec"]["securityContext"]["runAsUser"] == 65532
    (status,) = operator_pod["status"]["containerStatuses"]
    assert status["ready"] is True
    # The operator never ended on its own. A restart after the node lost its container (the machine
    # stopped with the cluster up, then `tpuft cluster up` again) is containerd's exit 255, reason
    # Unknown: a CI run met one (the pod kept in etcd, restarted by the kubelet).
    lost = status.get("lastState", {}).get("terminated") or {}
    assert status["restartCount"] == 0 or (lost.get("exitCode"), lost.get("reason")) == (255, "Unknown"), status


def test_operator_serves_metrics_in_the_pod(local_cluster, operator_pod):
    name = operator_pod["metadata"]["name"]
    port = next(p["containerPort"] for p in operator_pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    res = local_cluster.cp.kubectl("get", "--raw", f"/api/v1/namespaces/{chart.NAMESPACE}/pods/{name}:{port}/proxy/metrics")
    assert res.returncode == 0, res.stderr
    assert "tpuft_reconcile_total" in res.stdout


@pytest.mark.parametrize("verb,resource,allowed", [
    ("patch", "tpufinetunes.tpufinetune.dev --subresource=status", True),
    ("list", "tpufinetunes.tpufinetune.dev", True),
    ("create", "rayclusters.ray.io", True),
    ("create", "rayjobs.ray.io", True),
    ("create", "events", True),
    ("list", "events", False),
    ("delete", "tpufinetunes.tpufinetune.dev", False),
    ("patch", "tpufinetunes.tpufinetune.dev", False),
    ("get", "secrets", False),
    ("list", "pods", True),     # a RayCluster's pods while its slice comes up
    ("get", "pods", False),
    ("watch", "pods", True),    # and watched: a lost host seen at once (tpuft.controller.hosts)
    ("create", "pods", False),
    ("delete", "pods", False),
    ("create", "pods/exec", False),
])
def test_operator_service_account_is_least_privilege(local_cluster, operator_pod, verb, resource, allowed):
    sa = f"system:serviceaccount:{chart.NAMESPACE}:{operator_pod['spec']['serviceAccountName']}"
    res = local_cluster.cp.kubectl("auth", "can-i", verb, *resource.split(), "--as", sa, "-n", "default")
    assert res.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, res.stdout, res.stderr)
