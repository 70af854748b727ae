"""A chat client for a served TPUFinetune (the RayService's OpenAI-compatible endpoint), for the CLI.

Standard library only (urllib, through tpuft.cli.http_json): the operator package never imports the workload's stack. The
server side is tpuft_workload.serve; both take the path from tpuft.api.constants. With an API key
(spec.serve.apiKeySecret), each request carries `Authorization: Bearer <key>`; the key is never part
of an error's text. `chat_stream` asks for server-sent events ("stream": true) and yields the
reply's text as it arrives.
"""
from __future__ import annotations

import json
from typing import Iterator

from tpuft.api.constants import SERVE_CHAT_PATH, SERVE_MODELS_PATH
from tpuft.cli.http_json import HttpError, Server, open_request, request_json


class ChatError(HttpError):
    """The server could not be reached or refused the request. `status` is the HTTP status (None
    when no HTTP answer came), `message` the server's own error message when it sent one."""


SSE_DATA = "data:"
SSE_DONE = "[DONE]"


def chat_request(model_id: str, message: str, max_tokens: int, temperature: float, stream: bool = False) -> dict:
    """The JSON body of one single-turn chat completion."""
    return {"model": model_id, "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": stream}


def _server_message(raw: bytes) -> str:
    """OpenAI's {"error": {"message": ...}} when the body has it, else the body itself (shortened)."""
    text = raw.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
    except (ValueError, AttributeError):
        pass
    return text.strip()[:500] or "(empty body)"


MODEL_SERVER = Server("the model server", ChatError,
                      hint="is the model served and that address reachable from here?",
                      refusal=_server_message)


def _content(body: dict, url: str) -> str:
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ChatError(200, f"the answer is not a chat.completion (no choices[0].message.content): "
                             f"{json.dumps(body)[:300]}", url) from None
    return content if isinstance(content, str) else ""


def chat(base_url: str, model_id: str, message: str, max_tokens: int = 64, temperature: float = 0.0,
         timeout: float = 60, api_key: str | None = None) -> str:
    """POST one user message to base_url + /v1/chat/completions; the assistant's reply text.
    Raises ChatError with the HTTP status and the server's message."""
    url = base_url.rstrip("/") + SERVE_CHAT_PATH
    data = json.dumps(chat_request(model_id, message, max_tokens, temperature)).encode()
    return _content(request_json(MODEL_SERVER, url, data, timeout, api_key), url)


def chat_stream(base_url: str, model_id: str, message: str, max_tokens: int = 64, temperature: float = 0.0,
                timeout: float = 60, api_key: str | None = None) -> Iterator[str]:
    """As chat(), streamed: the reply's text deltas as the server sends them (OpenAI's
    chat.completion.chunk events). Raises ChatError, also for an error event mid-stream."""
    url = base_url.rstrip("/") + SERVE_CHAT_PATH
    data = json.dumps(chat_request(model_id, message, max_tokens, temperature, stream=True)).encode()
    with open_request(MODEL_SERVER, url, data, timeout, api_key, accept="text/event-stream") as resp:
        kind = resp.headers.get("Content-Type", "")
        if not kind.startswith("text/event-stream"):
            raise ChatError(resp.status, f"the answer is not an event stream (Content-Type {kind or 'none'}): "
                                         f"{resp.read(200)!r}", url)
        try:
            for line in resp:
                text = line.decode("utf-8", "replace").strip()
                if not text.startswith(SSE_DATA):
                    continue   # blank lines between events, comments, other fields
                payload = text[len(SSE_DATA):].strip()
                if payload == SSE_DONE:
                    return
                if delta := _delta(payload, url):
                    yield delta
        except (TimeoutError, ConnectionError) as e:
            raise ChatError(None, f"the model server stopped answering mid-stream ({e})", url) from None
    raise ChatError(200, f"the event stream ended before its {SSE_DATA} {SSE_DONE} event: the answer may be cut "
                         "short", url)


def _delta(payload: str, url: str) -> str:
    """The content of one chunk event ("" for the role and finish chunks); ChatError for an error event."""
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise ChatError(200, f"an event is not JSON: {payload[:200]!r}", url) from None
    if not isinstance(chunk, dict):
        raise ChatError(200, f"an event is not a JSON object: {payload[:200]!r}", url)
    if "error" in chunk:
        raise ChatError(200, _server_message(payload.encode()), url)
    choices = chunk.get("choices")   # the usage chunk has none
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    delta = first.get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


def models(base_url: str, timeout: float = 60, api_key: str | None = None) -> list[dict]:
    """GET base_url + /v1/models: the served models' entries (each with its "id")."""
    url = base_url.rstrip("/") + SERVE_MODELS_PATH
    body = request_json(MODEL_SERVER, url, None, timeout, api_key)
    if not isinstance(body.get("data"), list):
        raise ChatError(200, f"the answer is not a model list: {json.dumps(body)[:300]}", url)
    return body["data"]

