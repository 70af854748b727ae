"""One JSON request over HTTP, for the CLI's clients: tpuft.cli.chat (a served model's OpenAI API) and
tpuft.cli.ray_jobs (a Ray head's Jobs API).

Standard library only (urllib): the operator package never imports the workload's stack. A bearer
token goes in the Authorization header only, never into an error's text.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable


class HttpError(RuntimeError):
    """The server could not be reached or refused the request. `status` is the HTTP status (None
    when no HTTP answer came), `message` what went wrong (the server's own words when it sent some)."""

    def __init__(self, status: int | None, message: str, url: str):
        where = f"HTTP {status} from {url}" if status is not None else url
        super().__init__(f"{where}: {message}")
        self.status, self.message, self.url = status, message, url


def body_text(raw: bytes) -> str:
    """An error answer's body as its message (shortened)."""
    return raw.decode("utf-8", "replace").strip()[:300]


@dataclass(frozen=True)
class Server:
    """Who answers, for the messages: `name` ("the Ray head"), `error` the HttpError subclass its
    client raises, `hint` what to check when it cannot be reached, `refusal` its error body's message."""
    name: str
    error: type[HttpError] = HttpError
    hint: str = ""
    refusal: Callable[[bytes], str] = body_text


def open_request(server: Server, url: str, data: bytes | None, timeout: float, token: str | None,
                 accept: str = "application/json"):
    """The open response of one request (POST with data, else GET), or server.error."""
    headers = {"Accept": accept, **({"Content-Type": "application/json"} if data is not None else {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET", headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise server.error(e.code, server.refusal(e.read()) or str(e.reason), url) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        hint = f"; {server.hint}" if server.hint else ""
        raise server.error(None, f"cannot reach {server.name} ({getattr(e, 'reason', e)}){hint}", url) from None


def request_json(server: Server, url: str, data: bytes | None, timeout: float, token: str | None) -> dict:
    """One JSON request (POST with data, else GET): the decoded answer, or server.error."""
    with open_request(server, url, data, timeout, token) as resp:
        try:
            raw = resp.read()
        except (TimeoutError, ConnectionError) as e:
            raise server.error(None, f"{server.name} stopped answering ({e})", url) from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise server.error(200, f"the answer is not JSON: {raw[:200]!r}", url) from None
    if not isinstance(body, dict):
        raise server.error(200, f"the answer is not a JSON object: {raw[:200]!r}", url)
    return body
