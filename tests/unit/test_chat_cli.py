"""tpuft chat's reading of a TPUFinetune: only a Serving object whose model is Ready has an endpoint;
any other says its phase and why, and how to serve it."""
import pytest

from tpuft import chat_cli


def _obj(phase, ready="False", serving=None, serve_enabled=True):
    status = {"phase": phase, "message": f"{phase} message",
              "conditions": [{"type": "Ready", "status": ready}]}
    if serving:
        status["serving"] = serving
    return {"metadata": {"name": "ft", "namespace": "ns"}, "spec": {"serve": {"enabled": serve_enabled}},
            "status": status}


def test_a_ready_serving_object_gives_its_endpoint():
    serving = {"service": "ft-serve-serve-svc", "port": 8000, "model": "ft"}
    assert chat_cli.endpoint(_obj("Serving", "True", serving)) == serving


@pytest.mark.parametrize("obj,words", [
    (_obj("Training"), "phase Training: Training message"),
    (_obj("Serving", "False", {"service": "s"}), "phase Serving: Serving message"),
    (_obj("Succeeded", "True", serve_enabled=False), "set spec.serve.enabled: true"),
    ({"metadata": {"name": "ft", "namespace": "ns"}}, "phase -: no status"),
])
def test_anything_else_is_not_serving_and_says_why(obj, words):
    with pytest.raises(chat_cli.NotServing, match="ns/ft is not serving yet") as e:
        chat_cli.endpoint(obj)
    assert words in str(e.value)
