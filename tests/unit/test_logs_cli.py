"""tpuft logs, against a fake kubectl and a fake Ray Jobs API: while the head is up the log comes
from it (the Ray token read from KubeRay's Secret with the user's kubectl and sent as a Bearer
header, never printed; -f prints each new part once until the job ends); once the head is gone,
from the driver's log file under storagePath (in a bucket, or on a disk readable here), else where
it is; every refusal names what and what to do."""
from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import json
import sys
from pathlib import Path

import pytest

from tests.factories import MINIMUM
from tests.http_stub import QuietHandler, serving
from tpuft.controller import builders
from tpuft.cli import logs_cli, ray_jobs
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api.spec import parse

TOKEN = "ray-token-from-the-secret"
JOB_ID = "ft-train-abc12"
FAKE_KUBECTL = """#!{python}
import json, sys, time
args = sys.argv[1:]
state = json.load(open({state!r}))
with open({state!r} + ".calls", "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[0] == "port-forward":
    answer = state.get("port-forward") or {{}}
    if answer.get("rc"):
        sys.stderr.write(answer.get("stderr", ""))
        sys.exit(answer["rc"])
    print("Forwarding from 127.0.0.1:%d -> 8265" % state["port"], flush=True)
    time.sleep(120)
answer = state.get(args[1]) or {{"rc": 1, "stderr": "Error from server (NotFound): %s not found" % args[1]}}
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("rc", 0))
"""


def _tft(storage: str, children: dict | None = None, phase: str = "Training") -> dict:
    obj = copy.deepcopy(MINIMUM)
    obj["metadata"] = {"name": "ft", "namespace": "ns", "uid": "u-1"}
    obj["spec"]["checkpoint"] = {"storagePath": storage}
    children = {"rayCluster": "ft-ray", "verifyJob": "ft-verify", "trainJob": "ft-train"} if children is None else children
    obj["status"] = {"phase": phase, "message": f"{phase} message", "appliedSpec": copy.deepcopy(obj["spec"]),
                     "children": children}
    return obj


def _found(obj: dict) -> dict:
    return {"stdout": json.dumps(obj)}


NOT_FOUND = {"rc": 1, "stderr": 'Error from server (NotFound): rayclusters.ray.io "ft-ray" not found'}
FORBIDDEN = {"rc": 1, "stderr": 'Error from server (Forbidden): secrets "ft-ray" is forbidden: User "dev" cannot get '
                                'resource "secrets" in API group "" in the namespace "ns"'}
RAYJOB = _found({"kind": "RayJob", "status": {"jobId": JOB_ID, "jobDeploymentStatus": "Running"}})
CLUSTER = _found({"kind": "RayCluster", "spec": {}, "status": {"head": {"serviceName": "ft-ray-head-svc"}}})
SECRET = _found({"kind": "Secret", "data": {kuberay.RAY_AUTH_TOKEN_SECRET_KEY: base64.b64encode(TOKEN.encode()).decode()}})


@contextlib.contextmanager
def _jobs_api(answers: list[tuple[int, str, str]], seen: list):
    """A stand-in for a Ray head's Jobs API: the n-th (status, logs) call pair answers answers[n]
    (HTTP code, JobStatus, the whole log so far), the last one from then on; records each request's
    path and Authorization header."""
    calls = {"status": 0, "logs": 0}

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Authorization")))
            kind = "logs" if self.path.endswith("/logs") else "status"
            code, state, text = answers[min(calls[kind], len(answers) - 1)]
            calls[kind] += 1
            raw = (json.dumps({"logs": text} if kind == "logs" else {"status": state}) if code == 200
                   else "Forbidden: Invalid authentication token").encode()
            self.answer(code, raw)

    with serving(Handler) as port:
        yield port


def _logs(tmp_path, capsys, obj: dict | None, answers=((200, "SUCCEEDED", "line 1\nline 2\n"),), follow=False,
          job=None, **kubectl):
    """`tpuft logs ft -n ns` against the fake kubectl (its answers per resource: `kubectl`, defaults
    for a running head) and the fake Jobs API: (exit code, stdout, stderr, Jobs API requests, kubectl calls)."""
    state, fake = tmp_path / "kubectl.json", tmp_path / "kubectl"
    fake.write_text(FAKE_KUBECTL.format(python=sys.executable, state=str(state)))
    fake.chmod(0o755)
    answers_by_resource = {c.PLURAL: _found(obj) if obj is not None else NOT_FOUND, "rayjobs": RAYJOB,
                           "rayclusters": CLUSTER, "secret": SECRET}
    answers_by_resource.update({k.replace("_", "-"): v for k, v in kubectl.items()})
    seen: list = []
    with _jobs_api(list(answers), seen) as port:
        state.write_text(json.dumps({"port": port, **answers_by_resource}))
        args = argparse.Namespace(name="ft", namespace="ns", follow=follow, job=job, interval=0.01, kubectl=str(fake))
        rc = logs_cli.run(args)
    out, err = capsys.readouterr()
    calls_file = tmp_path / "kubectl.json.calls"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
    return rc, out, err, seen, calls


# --- while the head is up: its Jobs API -------------------------------------------------------------
def test_the_log_comes_from_the_head_with_the_ray_token_as_bearer(tmp_path, capsys):
    rc, out, err, seen, calls = _logs(tmp_path, capsys, _tft(str(tmp_path)))
    assert (rc, out, err) == (0, "line 1\nline 2\n", "")
    assert seen == [(f"/api/jobs/{JOB_ID}", f"Bearer {TOKEN}"), (f"/api/jobs/{JOB_ID}/logs", f"Bearer {TOKEN}")]
    assert ["get", "secret", "ft-ray", "-n", "ns", "-o", "json"] in calls          # KubeRay's Secret: the cluster's name
    assert ["port-forward", "-n", "ns", "svc/ft-ray-head-svc", f":{kuberay.RAY_DASHBOARD_PORT}"] in calls
    assert TOKEN not in out + err


def test_follow_prints_each_new_part_once_until_the_job_ends(tmp_path, capsys):
    answers = [(200, "RUNNING", "a\n"), (200, "RUNNING", "a\nb\n"), (200, "RUNNING", "a\nb\n"),
               (200, "SUCCEEDED", "a\nb\nc\n")]
    rc, out, _, seen, _ = _logs(tmp_path, capsys, _tft(str(tmp_path)), answers, follow=True)
    assert (rc, out) == (0, "a\nb\nc\n")
    assert len([p for p, _ in seen if p.endswith("/logs")]) == 4   # polled until SUCCEEDED, then stopped


@pytest.mark.parametrize("children,job,rayjob", [
    ({"rayCluster": "ft-ray", "verifyJob": "ft-verify", "trainJob": "ft-train-r1"}, None, "ft-train-r1"),
    ({"rayCluster": "ft-ray", "verifyJob": "ft-verify"}, None, "ft-verify"),          # training not started yet
    ({"rayCluster": "ft-ray", "verifyJob": "ft-verify-r1", "trainJob": "ft-train"}, "verify", "ft-verify-r1"),
    ({"rayCluster": "ft-ray"}, None, None),
])
def test_the_job_is_the_current_train_rayjob_unless_asked(children, job, rayjob):
    src = logs_cli.source(_tft("/ckpt", children), job)
    assert src.rayjob == rayjob and src.cluster == "ft-ray"
    expected = c.Component(job) if job else (c.Component.VERIFY if rayjob == "ft-verify" else c.Component.TRAIN)
    assert src.job == expected
    assert src.log_file == f"/ckpt/ns-ft-u-1/logs/{expected.value}.log" == builders.log_path(
        parse({**_tft("/ckpt"), "spec": _tft("/ckpt")["status"]["appliedSpec"]}), expected)


@pytest.mark.parametrize("shown,logs,expected", [
    (0, "a\n", ("a\n", 2)), (2, "a\nb\n", ("b\n", 4)), (4, "a\nb\n", ("", 4)),
    (4, "x\n", ("x\n", 2)),   # shorter: another log, all of it
])
def test_only_what_is_new_is_printed(shown, logs, expected):
    assert logs_cli.new_text(shown, logs) == expected


# --- once the head is gone: the log file under storagePath -----------------------------------------------
def _log_file(storage: Path, job: str = "train") -> Path:
    path = storage / "ns-ft-u-1" / "logs" / f"{job}.log"
    path.parent.mkdir(parents=True)
    path.write_text(f"[tpuft] {job} driver started\nEpoch 3/3 | loss=0.1\n")
    return path


@pytest.mark.parametrize("gone", [{"rayclusters": NOT_FOUND}, {"rayjobs": NOT_FOUND},
                                  {"port_forward": {"rc": 1, "stderr": "error: unable to forward port because pod "
                                                                      "is not running. Current status=Pending"}}])
def test_without_a_head_the_log_file_is_printed(tmp_path, capsys, gone):
    path = _log_file(tmp_path)
    rc, out, err, seen, _ = _logs(tmp_path, capsys, _tft(str(tmp_path)), **gone)
    assert (rc, out, seen) == (0, path.read_text(), [])
    assert err.startswith("tpuft logs: ") and f"the train driver's log from {path}:" in err


def test_a_ray_job_the_head_does_not_know_yet_is_not_started_not_gone(tmp_path, capsys):
    """KubeRay names the Ray job before its submitter pod submits it: the head says 404 meanwhile."""
    rc, out, err, _, _ = _logs(tmp_path, capsys, _tft(str(tmp_path)), [(404, "", "")])
    assert (rc, out) == (1, "") and "is not started on the head yet" in err and "follow it with -f" in err, err
    answers = [(404, "", ""), (200, "SUCCEEDED", "a\n")]
    rc, out, err, seen, _ = _logs(tmp_path, capsys, _tft(str(tmp_path)), answers, follow=True)
    assert (rc, out, err) == (0, "a\n", "")   # -f waits for it, then prints it
    assert len(seen) > 2


def test_a_ray_job_the_head_does_not_know_after_its_rayjob_ended_is_read_from_the_file(tmp_path, capsys):
    path = _log_file(tmp_path)
    ended = _found({"kind": "RayJob", "status": {"jobId": JOB_ID, "jobDeploymentStatus": "Complete"}})
    rc, out, err, _, _ = _logs(tmp_path, capsys, _tft(str(tmp_path)), [(404, "", "")], rayjobs=ended)
    assert (rc, out) == (0, path.read_text()) and "the head does not give Ray job" in err


def test_with_verify_the_verify_file_is_printed(tmp_path, capsys):
    path = _log_file(tmp_path, "verify")
    rc, out, _, _, _ = _logs(tmp_path, capsys, _tft(str(tmp_path)), job="verify", rayclusters=NOT_FOUND)
    assert (rc, out) == (0, path.read_text())


@pytest.mark.parametrize("storage,words", [
    # the bucket's own answers are tests/workload/test_object_store.py's (a real GCS API)
    ("gs://bucket/ckpt", ["RayCluster ns/ft-ray is gone", "install pyarrow (pip install pyarrow)",
                          "`gcloud storage cat gs://bucket/ckpt/ns-ft-u-1/logs/train.log`"]),
    ("/no/such/storage", ["the train driver's log is at /no/such/storage/ns-ft-u-1/logs/train.log",
                          "not readable here", "read it where that storage is mounted"]),
])
def test_a_log_file_that_is_not_readable_here_is_named(tmp_path, capsys, monkeypatch, storage, words):
    for module in ("pyarrow", "pyarrow.fs"):   # a laptop without pyarrow (the workload's venv has it)
        monkeypatch.setitem(sys.modules, module, None)
    rc, out, err, _, _ = _logs(tmp_path, capsys, _tft(storage), rayclusters=NOT_FOUND)
    assert (rc, out) == (1, "")
    assert err.startswith("tpuft logs: ") and all(w in err for w in words), err


# --- refusals: what and what to do ------------------------------------------------------------------------
@pytest.mark.parametrize("obj,answers,kubectl,words", [
    (None, None, {}, ["TPUFinetune ns/ft not found"]),
    ("no-jobs", None, {}, ["has no train RayJob yet (phase Provisioning: Provisioning message)"]),
    ("tft", None, {"secret": FORBIDDEN},
     ["not allowed to get Secret ns/ft-ray (the Ray token KubeRay made for RayCluster ft-ray)",
      "kubectl auth can-i get secret/ft-ray -n ns"]),
    ("tft", None, {"secret": {"rc": 1, "stderr": 'Error from server (NotFound): secrets "ft-ray" not found'}},
     ["Secret ns/ft-ray (the Ray token KubeRay made for RayCluster ft-ray) does not exist", "authOptions"]),
    ("tft", None, {"rayjobs": _found({"status": {"jobDeploymentStatus": "Initializing"}})},
     ["RayJob ns/ft-train has not submitted its Ray job yet", "follow it with -f"]),
    ("tft", [(403, "", "")], {}, ["the Ray head refused the token of Secret ns/ft-ray", "HTTP 403"]),
])
def test_what_cannot_be_shown_says_why_and_what_to_do(tmp_path, capsys, obj, answers, kubectl, words):
    tft = {None: None, "no-jobs": _tft(str(tmp_path), {"rayCluster": "ft-ray"}, "Provisioning"),
           "tft": _tft(str(tmp_path))}[obj]
    rc, out, err, _, _ = _logs(tmp_path, capsys, tft, answers or [(200, "RUNNING", "")], **kubectl)
    assert (rc, out) == (1, "")
    assert err.startswith("tpuft logs: ") and all(w in err for w in words), err
    assert TOKEN not in err


def test_the_jobs_client_sends_the_token_and_keeps_it_out_of_errors(capsys):
    seen: list = []
    with _jobs_api([(403, "", "")], seen) as port:
        with pytest.raises(ray_jobs.JobsError) as e:
            ray_jobs.logs(f"http://127.0.0.1:{port}", "job/with slash", TOKEN)
    assert e.value.status == 403 and TOKEN not in str(e.value)
    assert seen == [("/api/jobs/job%2Fwith%20slash/logs", f"Bearer {TOKEN}")]
