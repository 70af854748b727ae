"""tests/cluster_fixtures.assert_nothing_left_failed against kubectl's JSON, without a cluster:
each kind of leftover is named, objects being deleted are not counted, a clean namespace passes."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.cluster_fixtures import assert_nothing_left_failed


def kubectl_listing(*items: dict):
    def kubectl(*args, check=False, input=None, timeout=120):
        assert args[:2] == ("get", "jobs.batch,pods,rayjobs.ray.io") and "json" in args
        return subprocess.CompletedProcess(args, 0, json.dumps({"kind": "List", "items": list(items)}), "")
    return kubectl


def obj(kind: str, name: str, status: dict, deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"kind": kind, "metadata": meta, "status": status}


FAILED_JOB = obj("Job", "local-cpu-train", {"conditions": [
    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]})
FAILED_POD = obj("Pod", "local-cpu-train-bndxm", {"phase": "Failed", "containerStatuses": [
    {"name": "ray-job-submitter", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]})
HALF_DONE = obj("RayJob", "local-cpu-train", {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Running"})


def test_the_issues_leftovers_are_each_named():
    with pytest.raises(AssertionError) as e:
        assert_nothing_left_failed(kubectl_listing(FAILED_JOB, FAILED_POD, HALF_DONE), "tpuft-demo")
    msg = str(e.value)
    assert "Job local-cpu-train: Failed (BackoffLimitExceeded" in msg
    assert "Pod local-cpu-train-bndxm: phase Failed (ray-job-submitter exit 1 (Error))" in msg
    assert "RayJob local-cpu-train: jobStatus SUCCEEDED but jobDeploymentStatus Running" in msg


def test_finished_running_and_deleting_objects_pass():
    assert_nothing_left_failed(kubectl_listing(
        obj("Job", "ft-train", {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}),
        obj("Pod", "ft-train-x", {"phase": "Succeeded"}),
        obj("Pod", "ft-ray-head-x", {"phase": "Running"}),
        obj("RayJob", "ft-train", {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}),
        obj("RayJob", "ft-verify", {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"}),
        obj("RayJob", "ft-train-r1", {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}),
        {**FAILED_POD, "metadata": {**FAILED_POD["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}},
        obj("RayJob", "ft-old", HALF_DONE["status"], deleting=True),
    ), "ns")
