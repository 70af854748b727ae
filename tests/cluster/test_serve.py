"""Serving on the real local cluster when it cannot start: the serving cluster's image does not
exist. The run trains (one epoch), releases its slice, creates the RayService; KubeRay's serving
pods cannot pull the image, and the kubelet's error is in the object's status while it is Serving,
then it fails with ServeFailed at spec.serve.timeoutSeconds, naming that error (the seed-004 hang,
caught and named). The happy path (Serving, chat, /v1/models, Argo CD health) is tests/cluster/test_demo.py.
"""
import json

import pytest
import yaml

from tests.paths import EXAMPLES
from tests.waiting import wait_until

SERVE_TIMEOUT = 60


def _status(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout).get("status") or {}


@pytest.mark.timeout(1500)
def test_a_serving_image_that_does_not_exist_is_named_then_fails_serve_failed(cluster_kubectl, cluster_ns, tmp_path):
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    storage = str(tmp_path / "checkpoints")
    doc["metadata"]["name"] = "bad-serve"
    doc["spec"]["checkpoint"].update(storagePath=storage)
    doc["spec"]["checkpoint"]["volume"]["hostPath"]["path"] = storage
    doc["spec"]["training"]["epochs"] = 1
    doc["spec"]["verification"] = {"enabled": False}
    doc["spec"]["serve"].update(image="docker.io/tpufinetune/serving:does-not-exist", timeoutSeconds=SERVE_TIMEOUT)
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)

    serving = wait_until(lambda: (st := _status(cluster_kubectl, cluster_ns, "bad-serve")).get("phase") in
                         ("Serving", "Failed") and st, timeout=900, interval=3, what="training to end and serving start")
    assert serving["phase"] == "Serving", serving
    blocked = wait_until(lambda: "cannot be pulled" in ((st := _status(cluster_kubectl, cluster_ns, "bad-serve"))
                                                        .get("message") or "") and st,
                         timeout=SERVE_TIMEOUT, interval=2, what="the pull error in status while Serving")
    assert blocked["phase"] == "Serving" and "serving:does-not-exist" in blocked["message"], blocked
    failed = wait_until(lambda: (st := _status(cluster_kubectl, cluster_ns, "bad-serve")).get("phase") == "Failed"
                        and st, timeout=SERVE_TIMEOUT + 30, interval=2, what="ServeFailed at spec.serve.timeoutSeconds")
    assert failed["reason"] == "ServeFailed", failed
    assert f"spec.serve.timeoutSeconds ({SERVE_TIMEOUT}s)" in failed["message"]
    assert "serving:does-not-exist cannot be pulled" in failed["message"], failed["message"]
    # the training slice was released before serving started
    assert cluster_kubectl("get", "raycluster", "bad-serve-ray", "-n", cluster_ns).returncode != 0
