"""A chat client for a served TPUFinetune (the RayService's OpenAI-compatible endpoint), for the CLI.

Standard library only (urllib): the operator package never imports the workload's stack. The
server side is tpuft_workload.serve; both take the path from tpuft.constants.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from tpuft.constants import SERVE_CHAT_PATH, SERVE_MODELS_PATH


class ChatError(RuntimeError):
    """The server could not be reached or refused the request. `status` is the HTTP status (None
    when no HTTP answer came), `message` the server's own error message when it sent one."""

    def __init__(self, status: int | None, message: str, url: str):
        where = f"HTTP {status} from {url}" if status is not None else url
        super().__init__(f"{where}: {message}")
        self.status, self.message, self.url = status, message, url


def chat_request(model_id: str, message: str, max_tokens: int, temperature: float) -> dict:
    """The JSON body of one single-turn, non-streaming chat completion."""
    return {"model": model_id, "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": False}


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


def _content(body: dict, url: str) -> str:
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ChatError(200, f"the answer is not a chat.completion (no choices[0].message.content): "
                             f"{json.dumps(body)[:300]}", url) from None
    return content if isinstance(content, str) else ""


def chat(base_url: str, model_id: str, message: str, max_tokens: int = 64, temperature: float = 0.0,
         timeout: float = 60) -> str:
    """POST one user message to base_url + /v1/chat/completions; the assistant's reply text.
    Raises ChatError with the HTTP status and the server's message."""
    url = base_url.rstrip("/") + SERVE_CHAT_PATH
    data = json.dumps(chat_request(model_id, message, max_tokens, temperature)).encode()
    return _content(_call(url, data, timeout), url)


def models(base_url: str, timeout: float = 60) -> list[dict]:
    """GET base_url + /v1/models: the served models' entries (each with its "id")."""
    url = base_url.rstrip("/") + SERVE_MODELS_PATH
    body = _call(url, None, timeout)
    if not isinstance(body.get("data"), list):
        raise ChatError(200, f"the answer is not a model list: {json.dumps(body)[:300]}", url)
    return body["data"]


def _call(url: str, data: bytes | None, timeout: float) -> dict:
    """One JSON request (POST when data is given); the decoded answer, or ChatError."""
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise ChatError(e.code, _server_message(e.read()), url) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise ChatError(None, f"cannot reach the model server ({reason}); is the model served and "
                              "that address reachable from here?", url) from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise ChatError(200, f"the answer is not JSON: {raw[:200]!r}", url) from None
    if not isinstance(body, dict):
        raise ChatError(200, f"the answer is not a JSON object: {raw[:200]!r}", url)
    return body
