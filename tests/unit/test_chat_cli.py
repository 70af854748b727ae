"""tpuft chat's reading of a TPUFinetune: only a Serving object whose model is Ready has an endpoint;
any other says its phase and why, and how to serve it; with spec.serve.apiKeySecret, the key read
with the user's kubectl (a fake one here) goes to the server as a Bearer header and is never printed."""
import argparse
import base64
import contextlib
import json
import sys

import pytest

from tests.http_stub import QuietHandler, serving
from tpuft.cli import chat_cli
from tpuft.api import constants as c


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


# --- spec.serve.apiKeySecret: the key read with the user's kubectl and sent, never printed ----------

KEY = "sk-from-the-secret"
SERVING = {"service": "ft-serve-serve-svc", "port": 8000, "model": "ft"}
FAKE_KUBECTL = """#!{python}
import json, sys, time
args = sys.argv[1:]
state = json.load(open({state!r}))
with open({state!r} + ".calls", "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[0] == "port-forward":
    print("Forwarding from 127.0.0.1:%d -> 8000" % state["port"], flush=True)
    time.sleep(120)
answer = state.get(args[1] + "/" + args[2]) or state[args[1]]   # by kind/name, else by kind
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("rc", 0))
"""


@contextlib.contextmanager
def _model_server(status: int, body: dict, auth: list, events: list[str] | None = None,
                  models: list | None = None):
    """A stand-in for the Serve app: answers every POST with (status, body), or a request with
    "stream": true with `events` as server-sent events; records Authorization (and the model asked for)."""
    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            streamed = request["stream"]
            auth.append(self.headers.get("Authorization"))
            if models is not None:
                models.append(request["model"])
            if streamed and events is not None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in events:
                    self.wfile.write(f"data: {event}\n\n".encode())
                    self.wfile.flush()
                return
            raw = json.dumps(body).encode()
            self.answer(status, raw)

    with serving(Handler) as port:
        yield port


def _secret(data: dict) -> dict:
    return {"stdout": json.dumps({"kind": "Secret", "data": {k: base64.b64encode(v.encode()).decode()
                                                             for k, v in data.items()}})}


def _chat(tmp_path, capsys, api_key_secret, secret: dict | None = None, status: int = 200, body: dict | None = None,
          events: list[str] | None = None):
    """`tpuft chat ft hi -n ns` (with --stream when events are given) against a fake kubectl and a
    model server: (exit code, stdout, stderr, the Authorization headers the server got, kubectl's calls)."""
    obj = _obj("Serving", "True", SERVING)
    if api_key_secret is not None:
        obj["spec"]["serve"]["apiKeySecret"] = api_key_secret
    state = tmp_path / "kubectl.json"
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable, state=str(state)))
    kubectl.chmod(0o755)
    auth: list = []
    body = body or {"choices": [{"index": 0, "message": {"role": "assistant", "content": "woof"}}]}
    with _model_server(status, body, auth, events) as port:
        state.write_text(json.dumps({"port": port, c.PLURAL: {"stdout": json.dumps(obj)}, "secret": secret or {}}))
        args = argparse.Namespace(kubectl=str(kubectl), namespace="ns", name="ft", message="hi", max_tokens=8,
                                  temperature=0.0, stream=events is not None)
        rc = chat_cli.run(args)
    out, err = capsys.readouterr()
    calls = [json.loads(line) for line in (tmp_path / "kubectl.json.calls").read_text().splitlines()]
    return rc, out, err, auth, calls


@pytest.mark.parametrize("ref, key", [({"name": "keys", "key": "token"}, "token"), ({"name": "keys"}, "api-key")])
def test_the_key_is_read_from_the_named_secret_and_sent_as_bearer(tmp_path, capsys, ref, key):
    rc, out, err, auth, calls = _chat(tmp_path, capsys, ref, _secret({key: KEY + "\n", "other": "x"}))
    assert (rc, out, auth) == (0, "woof\n", [f"Bearer {KEY}"]), err
    assert ["get", "secret", "keys", "-n", "ns", "-o", "json"] in calls
    assert KEY not in out + err


def test_without_an_api_key_secret_no_secret_is_read_and_no_key_sent(tmp_path, capsys):
    rc, out, _, auth, calls = _chat(tmp_path, capsys, None)
    assert (rc, out, auth) == (0, "woof\n", [None])
    assert not [call for call in calls if call[:2] == ["get", "secret"]]


@pytest.mark.parametrize("secret, words", [
    ({"rc": 1, "stderr": 'Error from server (Forbidden): secrets "keys" is forbidden: User "dev" cannot get '
                         'resource "secrets" in API group "" in the namespace "ns"'},
     ["your kubectl user is not allowed to get Secret ns/keys (spec.serve.apiKeySecret)",
      "kubectl auth can-i get secret/keys -n ns"]),
    ({"rc": 1, "stderr": 'Error from server (NotFound): secrets "keys" not found'},
     ["Secret ns/keys (spec.serve.apiKeySecret) does not exist",
      "kubectl create secret generic keys -n ns --from-literal=api-key=..."]),
    (_secret({"token": KEY}), ["Secret ns/keys (spec.serve.apiKeySecret) has no key 'api-key'", "its keys: token"]),
])
def test_a_secret_that_cannot_be_read_says_which_why_and_what_to_do(tmp_path, capsys, secret, words):
    rc, out, err, auth, _ = _chat(tmp_path, capsys, {"name": "keys"}, secret)
    assert (rc, out, auth) == (1, "", [])   # nothing sent without the key
    assert err.startswith("tpuft chat: ") and all(w in err for w in words), err
    assert KEY not in err


def test_a_key_the_server_refuses_prints_its_message_not_the_key(tmp_path, capsys):
    refused = {"error": {"message": "Incorrect API key provided; the key is in the Secret ...",
                         "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    rc, out, err, auth, _ = _chat(tmp_path, capsys, {"name": "keys"}, _secret({"api-key": KEY}), 401, refused)
    assert (rc, out, auth) == (1, "", [f"Bearer {KEY}"])
    assert "HTTP 401" in err and "Incorrect API key provided" in err and KEY not in err


def _delta(content: str) -> str:
    return json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]})


def test_stream_prints_the_text_as_it_arrives_and_ends_the_line(tmp_path, capsys, monkeypatch):
    writes: list[str] = []
    real = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda text: writes.append(text) or real(text))
    rc, out, err, auth, _ = _chat(tmp_path, capsys, {"name": "keys"}, _secret({"api-key": KEY}),
                                  events=[_delta("woof"), _delta(" woof"), "[DONE]"])
    assert (rc, out, auth) == (0, "woof woof\n", [f"Bearer {KEY}"]), err
    assert writes[:2] == ["woof", " woof"]   # piece by piece, as they came


def test_stream_cut_short_ends_the_printed_line_and_says_why(tmp_path, capsys):
    error = json.dumps({"error": {"message": "generation failed: out of memory", "type": "server_error"}})
    rc, out, err, _, _ = _chat(tmp_path, capsys, None, events=[_delta("woof"), error])
    assert (rc, out) == (1, "woof\n")
    assert err.startswith("tpuft chat: HTTP 200 from ") and "generation failed: out of memory" in err


def test_stream_is_off_unless_asked():
    parser = argparse.ArgumentParser()
    chat_cli.add_arguments(parser)
    assert parser.parse_args(["ft", "hi"]).stream is False
    assert parser.parse_args(["ft", "hi", "--stream"]).stream is True


# --- a fine-tune published to a served base (spec.publish): asked on the base, as <base>:<adapter> -----

def _fine_tune(serving: dict | None, phase: str = "Succeeded") -> dict:
    obj = _obj(phase, "True", serving, serve_enabled=False)
    obj["spec"] = {"publish": {"to": "base", "as": "a"}}
    return obj


def test_a_published_fine_tune_is_asked_on_its_bases_endpoint_under_its_model_id(tmp_path, capsys):
    base = _obj("Serving", "True", {"service": "base-serve-serve-svc", "port": 8000, "model": "base"})
    base["metadata"]["name"], base["spec"]["serve"]["apiKeySecret"] = "base", {"name": "base-keys"}
    fine_tune = _fine_tune({"base": "base", "adapter": "a", "model": "base:a", "reason": "Published"})
    state, kubectl = tmp_path / "kubectl.json", tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable, state=str(state)))
    kubectl.chmod(0o755)
    auth: list = []
    models: list = []
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "woof"}}]}
    with _model_server(200, body, auth, models=models) as port:
        state.write_text(json.dumps({"port": port, f"{c.PLURAL}/ft": {"stdout": json.dumps(fine_tune)},
                                     f"{c.PLURAL}/base": {"stdout": json.dumps(base)},
                                     "secret/base-keys": _secret({"api-key": KEY})}))
        args = argparse.Namespace(kubectl=str(kubectl), namespace="ns", name="ft", message="hi", max_tokens=8,
                                  temperature=0.0, stream=False)
        rc = chat_cli.run(args)
    out, err = capsys.readouterr()
    calls = [json.loads(line) for line in (tmp_path / "kubectl.json.calls").read_text().splitlines()]
    assert (rc, out, models, auth) == (0, "woof\n", ["base:a"], [f"Bearer {KEY}"]), err
    assert ["port-forward", "-n", "ns", "svc/base-serve-serve-svc"] == [x for x in calls if x[0] == "port-forward"][0][:4]


@pytest.mark.parametrize("obj, words", [
    (_fine_tune({"base": "base", "model": "base:a", "reason": "BaseNotServing",
                 "message": "training complete; the base ns/base is not Serving"}),
     "(BaseNotServing: training complete; the base ns/base is not Serving)"),
    (_fine_tune({"base": "base", "model": "base:a", "reason": "NotPromoted", "message": "kept unpublished: ..."}),
     "(NotPromoted: kept unpublished: ...)"),
    (_fine_tune(None, phase="Training"), "(phase Training: Training message)"),
])
def test_a_fine_tune_not_published_says_why(obj, words):
    with pytest.raises(chat_cli.NotServing, match="ns/ft's adapter is not served by base yet") as e:
        chat_cli.published_to(obj)
    assert words in str(e.value)
