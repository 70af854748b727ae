"""tpuft.cli.chat against a small local http.server on 127.0.0.1 (no Ray): the body it sends, the reply
it returns (whole, or streamed as server-sent events), and a ChatError carrying the status and the
server's message for every way it fails."""
from __future__ import annotations

import contextlib
import json
import threading

import pytest

from tests.http_stub import QuietHandler, serving
from tests.ranks import free_port
from tpuft.cli import chat
from tpuft.api.constants import SERVE_CHAT_PATH, SERVE_MODELS_PATH


@contextlib.contextmanager
def server(status: int, body: bytes, seen: list | None = None, auth: list | None = None):
    """Answers every POST with (status, body); records (path, JSON body) of each request in `seen`
    and its Authorization header (None when absent) in `auth`."""
    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            data = self.rfile.read(int(self.headers["Content-Length"]))
            if seen is not None:
                seen.append((self.path, json.loads(data)))
            if auth is not None:
                auth.append(self.headers.get("Authorization"))
            self.answer(status, body)

        def do_GET(self):  # noqa: N802 - http.server's name
            if seen is not None:
                seen.append((self.path, None))
            if auth is not None:
                auth.append(self.headers.get("Authorization"))
            self.answer(status, body)

    with serving(Handler) as port:
        yield f"http://127.0.0.1:{port}"


def _completion(content: str) -> bytes:
    return json.dumps({"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}).encode()


def test_chat_request_is_one_user_message_streamed_only_when_asked():
    assert chat.chat_request("m", "hi", 8, 0.5) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5,
        "stream": False}
    assert chat.chat_request("m", "hi", 8, 0.5, stream=True)["stream"] is True


def test_chat_posts_the_request_and_returns_the_content():
    seen: list = []
    with server(200, _completion("hello there"), seen) as url:
        assert chat.chat(url + "/", "tiny", "hi", max_tokens=5) == "hello there"
    assert seen == [(SERVE_CHAT_PATH, chat.chat_request("tiny", "hi", 5, 0.0))]


def test_an_api_key_goes_in_a_bearer_header_and_none_without_one():
    auth: list = []
    with server(200, _completion("hi"), auth=auth) as url:
        chat.chat(url, "m", "hi", api_key="sk-1")
        chat.chat(url, "m", "hi")
        chat.chat(url, "m", "hi", api_key="")
    with server(200, json.dumps({"object": "list", "data": []}).encode(), auth=auth) as url:
        chat.models(url, api_key="sk-2")
    assert auth == ["Bearer sk-1", None, None, "Bearer sk-2"]


def test_a_401_says_the_servers_message_and_never_the_key():
    err = json.dumps({"error": {"message": "Incorrect API key provided; the key is in the Secret ...",
                                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
    with server(401, err) as url, pytest.raises(chat.ChatError) as e:
        chat.chat(url, "m", "hi", api_key="sk-secret-value")
    assert e.value.status == 401 and e.value.message.startswith("Incorrect API key provided")
    assert "sk-secret-value" not in str(e.value)


def test_an_openai_error_body_gives_its_status_and_message():
    err = json.dumps({"error": {"message": "the model 'x' does not exist here", "type": "invalid_request_error",
                                "code": "model_not_found"}}).encode()
    with server(404, err) as url, pytest.raises(chat.ChatError) as e:
        chat.chat(url, "x", "hi")
    assert e.value.status == 404 and e.value.message == "the model 'x' does not exist here"
    assert str(e.value) == f"HTTP 404 from {url}{SERVE_CHAT_PATH}: the model 'x' does not exist here"


def test_a_non_json_error_body_is_quoted():
    with server(502, b"Bad Gateway\n") as url, pytest.raises(chat.ChatError) as e:
        chat.chat(url, "m", "hi")
    assert (e.value.status, e.value.message) == (502, "Bad Gateway")


@pytest.mark.parametrize("body", [b"not json", b'{"choices": []}', b'{"id": 1}'])
def test_an_answer_that_is_not_a_chat_completion_is_a_chat_error(body):
    with server(200, body) as url, pytest.raises(chat.ChatError, match="not"):
        chat.chat(url, "m", "hi")


def test_no_server_is_a_chat_error_without_a_status():
    port = free_port()   # a port nothing listens on
    with pytest.raises(chat.ChatError, match="cannot reach the model server") as e:
        chat.chat(f"http://127.0.0.1:{port}", "m", "hi", timeout=5)
    assert e.value.status is None


def test_models_gets_the_served_ids():
    seen: list = []
    with server(200, json.dumps({"object": "list", "data": [{"id": "local-cpu"}]}).encode(), seen) as url:
        assert [m["id"] for m in chat.models(url)] == ["local-cpu"]
    assert seen == [(SERVE_MODELS_PATH, None)]


def test_models_refuses_an_answer_that_is_no_model_list():
    with server(200, b'{"object": "list"}') as url, pytest.raises(chat.ChatError, match="not a model list"):
        chat.models(url)


# --- chat_stream: server-sent events -------------------------------------------------------------

def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


STREAM = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "woof"}), _chunk({"content": " woof"}),
          _chunk({}, "stop"), b'data: {"object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 9}}\n\n',
          b"data: [DONE]\n\n"]


@contextlib.contextmanager
def sse_server(events: list[bytes], seen: list, hold_after: int | None = None, kind: str = "text/event-stream"):
    """Answers a POST with `events` as a stream (no Content-Length: the end is the connection's end).
    With hold_after=k it waits after the k-th event until `released` is set, and records in seen
    (after the request's (headers, body)) whether that happened before its 5 s wait ran out."""
    released = threading.Event()

    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append((dict(self.headers), json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            for i, event in enumerate(events, 1):
                self.wfile.write(event)
                self.wfile.flush()
                if i == hold_after:
                    seen.append(released.wait(5))

    with serving(Handler, poll_interval=0.05) as port:
        yield f"http://127.0.0.1:{port}", released


def test_chat_stream_yields_each_delta_as_it_arrives():
    seen: list = []
    with sse_server(STREAM, seen, hold_after=2) as (url, released):
        pieces = chat.chat_stream(url, "tiny", "hi", max_tokens=5, api_key="sk-1")
        first = next(pieces)   # the server holds the rest until this arrived
        released.set()
        assert [first, *pieces] == ["woof", " woof"]
    (headers, body), on_time = seen
    assert body == chat.chat_request("tiny", "hi", 5, 0.0, stream=True) and body["stream"] is True
    assert headers["Authorization"] == "Bearer sk-1" and headers["Accept"] == "text/event-stream"
    assert on_time, "the first delta came only after the whole stream"


@pytest.mark.parametrize("events, words", [
    (STREAM[:2] + [b'data: {"error": {"message": "generation failed: out of memory", "type": "server_error"}}\n\n'],
     "HTTP 200 from .*: generation failed: out of memory"),
    (STREAM[:3], "the event stream ended before its data: \\[DONE\\] event"),
    ([b"data: {not json\n\n"], "an event is not JSON"),
])
def test_a_stream_that_fails_or_ends_early_is_a_chat_error(events, words):
    with sse_server(events, []) as (url, _), pytest.raises(chat.ChatError, match=words):
        list(chat.chat_stream(url, "m", "hi"))


def test_a_stream_answered_with_json_or_an_http_error_is_a_chat_error():
    with sse_server([_completion("hi")], [], kind="application/json") as (url, _), \
            pytest.raises(chat.ChatError, match="not an event stream \\(Content-Type application/json\\)"):
        list(chat.chat_stream(url, "m", "hi"))
    err = json.dumps({"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}).encode()
    with server(401, err) as url, pytest.raises(chat.ChatError) as e:
        list(chat.chat_stream(url, "m", "hi", api_key="sk-secret"))
    assert (e.value.status, e.value.message) == (401, "Incorrect API key provided") and "sk-secret" not in str(e.value)
