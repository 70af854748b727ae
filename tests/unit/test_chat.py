"""tpuft.chat against a small local http.server on 127.0.0.1 (no Ray): the body it sends, the reply
it returns, and a ChatError carrying the status and the server's message for every way it fails."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tpuft import chat
from tpuft.constants import SERVE_CHAT_PATH, SERVE_MODELS_PATH


@contextlib.contextmanager
def server(status: int, body: bytes, seen: list | None = None):
    """Answers every POST with (status, body); records (path, JSON body) of each request in `seen`."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            data = self.rfile.read(int(self.headers["Content-Length"]))
            if seen is not None:
                seen.append((self.path, json.loads(data)))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's name
            if seen is not None:
                seen.append((self.path, None))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _completion(content: str) -> bytes:
    return json.dumps({"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}).encode()


def test_chat_request_is_one_user_message_without_streaming():
    assert chat.chat_request("m", "hi", 8, 0.5) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5,
        "stream": False}


def test_chat_posts_the_request_and_returns_the_content():
    seen: list = []
    with server(200, _completion("hello there"), seen) as url:
        assert chat.chat(url + "/", "tiny", "hi", max_tokens=5) == "hello there"
    assert seen == [(SERVE_CHAT_PATH, chat.chat_request("tiny", "hi", 5, 0.0))]


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
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
