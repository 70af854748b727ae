"""`tpuft demo`'s status poll: a loaded API server's 504 is polled again, a refusal ends the demo."""
import pytest
from kubernetes.client.rest import ApiException

from tpuft_local import demo


class Custom:
    """get_namespaced_custom_object answering from a script: an ApiException status, or an object."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def get_namespaced_custom_object(self, *args):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, int):
            raise ApiException(status=answer, reason={504: "Gateway Timeout", 403: "Forbidden"}[answer])
        return answer


def test_a_gateway_timeout_is_polled_again(monkeypatch):
    monkeypatch.setattr(demo.time, "sleep", lambda s: None)
    custom = Custom(504, 504, {"status": {"phase": "Succeeded"}})
    obj, losses = demo.stream(custom, "ns", "run", demo.Clock(), timeout=60)
    assert obj["status"]["phase"] == "Succeeded" and custom.calls == 3 and losses == []


def test_a_refusal_ends_the_demo_naming_the_object(monkeypatch):
    monkeypatch.setattr(demo.time, "sleep", lambda s: None)
    with pytest.raises(demo.DemoError, match="cannot read TPUFinetune ns/run: Forbidden"):
        demo.stream(Custom(403), "ns", "run", demo.Clock(), timeout=60)
