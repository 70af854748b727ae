"""A client for the two Ray Jobs API calls `tpuft logs` needs, on a Ray head's dashboard (port 8265):
GET /api/jobs/{id} (the job's status) and GET /api/jobs/{id}/logs (its driver's log so far).

Standard library only (urllib), like tpuft.cli.chat. The heads run with Ray token auth: every request
carries `Authorization: Bearer <token>`, and the token is never part of an error's text.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

# Ray's JobStatus values after which a job's log no longer grows.
ENDED = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


class JobsError(RuntimeError):
    """The head could not be reached or refused the call. `status` is the HTTP status (None when no
    HTTP answer came)."""

    def __init__(self, status: int | None, message: str, url: str):
        where = f"HTTP {status} from {url}" if status is not None else url
        super().__init__(f"{where}: {message}")
        self.status, self.message, self.url = status, message, url


def _get(base_url: str, path: str, token: str | None, timeout: float) -> dict:
    url = base_url.rstrip("/") + path
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise JobsError(e.code, e.read().decode("utf-8", "replace").strip()[:300] or e.reason, url) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise JobsError(None, f"cannot reach the Ray head ({getattr(e, 'reason', e)})", url) from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise JobsError(200, f"the answer is not JSON: {raw[:200]!r}", url) from None
    if not isinstance(body, dict):
        raise JobsError(200, f"the answer is not a JSON object: {raw[:200]!r}", url)
    return body


def _job(job_id: str) -> str:
    return "/api/jobs/" + urllib.parse.quote(job_id, safe="")


def status(base_url: str, job_id: str, token: str | None = None, timeout: float = 30) -> str:
    """The job's Ray JobStatus (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)."""
    return str(_get(base_url, _job(job_id), token, timeout).get("status") or "")


def logs(base_url: str, job_id: str, token: str | None = None, timeout: float = 30) -> str:
    """The job driver's whole log so far."""
    return str(_get(base_url, _job(job_id) + "/logs", token, timeout).get("logs") or "")
