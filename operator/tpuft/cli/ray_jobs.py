"""A client for the two Ray Jobs API calls `tpuft logs` needs, on a Ray head's dashboard (port 8265):
GET /api/jobs/{id} (the job's status) and GET /api/jobs/{id}/logs (its driver's log so far).

Standard library only (tpuft.cli.http_json), like tpuft.cli.chat. The heads run with Ray token auth: every request
carries `Authorization: Bearer <token>`, and the token is never part of an error's text.
"""
from __future__ import annotations

import urllib.parse

from tpuft.cli.http_json import HttpError, Server, request_json

# Ray's JobStatus values after which a job's log no longer grows.
ENDED = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


class JobsError(HttpError):
    """The head could not be reached or refused the call. `status` is the HTTP status (None when no
    HTTP answer came)."""


HEAD = Server("the Ray head", JobsError)


def _get(base_url: str, path: str, token: str | None, timeout: float) -> dict:
    return request_json(HEAD, base_url.rstrip("/") + path, None, timeout, token)


def _job(job_id: str) -> str:
    return "/api/jobs/" + urllib.parse.quote(job_id, safe="")


def status(base_url: str, job_id: str, token: str | None = None, timeout: float = 30) -> str:
    """The job's Ray JobStatus (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)."""
    return str(_get(base_url, _job(job_id), token, timeout).get("status") or "")


def logs(base_url: str, job_id: str, token: str | None = None, timeout: float = 30) -> str:
    """The job driver's whole log so far."""
    return str(_get(base_url, _job(job_id) + "/logs", token, timeout).get("logs") or "")
