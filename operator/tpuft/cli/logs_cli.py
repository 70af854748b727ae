"""`tpuft logs NAME [-n NS] [-f] [--job verify|train]`: a run's verification or training driver log.

While the run's RayCluster is up, the log comes from its head's Ray Jobs API (GET
/api/jobs/{id}/logs, through `kubectl port-forward` to the head Service's dashboard port): the
RayJob's status.jobId names the Ray job, and the head's Ray token is read from the Secret KubeRay
made for the RayCluster (its name, key auth_token) with the user's own kubectl rights and sent as
`Authorization: Bearer <token>`; it is never printed. -f polls the log and prints what is new
until the job ends.

Once the head is gone (the run ended and its RayCluster was released, suspended or deleted), the
log is the copy the driver tees to {storagePath}/{run}/logs/<job>.log (tpuft.controller.builders.log_path),
read from the bucket for a gs:// storagePath (tpuft.cli.object_store: pyarrow and the user's Google
credentials) or from the disk when that path is readable here (the local cluster's hostPath).
Exit 1, saying why and what to do, when the log cannot be shown.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from tpuft.controller import builders
from tpuft.cli import kubectl, object_store, ray_jobs
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.controller.observed import DONE_JOB_STATES, JobObs, job_state
from tpuft.api.spec import SpecError, TPUFinetune, parse

JOB_CHILD = {c.Component.VERIFY: "verifyJob", c.Component.TRAIN: "trainJob"}   # status.children keys
POLL_SECONDS = 2.0
DRIVER_LOG_UPLOAD_EVERY_S = 30.0   # tpuft_workload.driver_log.UPLOAD_EVERY_S (the workload's module; one test ties them)


class NoLog(RuntimeError):
    """The log cannot be shown: the message says why and what to do."""


class HeadGone(RuntimeError):
    """The run's head cannot give the log (it is not there): the log file is read instead."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the TPUFinetune")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing the log as it grows, until the job ends")
    p.add_argument("--job", choices=[j.value for j in JOB_CHILD], default=None,
                   help="whose driver log: verify or train (default: train once it has started, else verify); "
                        "the file keeps every attempt's, the head only the current RayJob's")
    p.add_argument("--interval", type=float, default=POLL_SECONDS, help=argparse.SUPPRESS)   # -f's poll (tests)
    kubectl.add_argument(p)


@dataclass(frozen=True)
class Source:
    """Where one job's driver log of one TPUFinetune can be read."""
    namespace: str
    job: c.Component
    rayjob: str | None       # the current RayJob (status.children), None before it was created
    cluster: str             # its RayCluster
    log_file: str | None     # {storagePath}/{run}/logs/<job>.log; None when the spec does not parse


def source(obj: dict, job: str | None = None) -> Source:
    """Pure: where `obj`'s `job` log is (default: train once it has a RayJob, else verify)."""
    meta, st = obj.get("metadata") or {}, obj.get("status") or {}
    ns, name, children = meta.get("namespace") or "default", meta.get("name") or "", st.get("children") or {}
    if job is not None:
        which = c.Component(job)
    elif children.get(JOB_CHILD[c.Component.TRAIN]) or not children.get(JOB_CHILD[c.Component.VERIFY]):
        which = c.Component.TRAIN
    else:
        which = c.Component.VERIFY
    return Source(ns, which, children.get(JOB_CHILD[which]), children.get("rayCluster") or builders.cluster_name(name),
                  _log_file(obj, which))


def built_from(obj: dict) -> TPUFinetune | None:
    """The spec the run was built from (status.appliedSpec), else the spec; None when neither
    parses. Where its files are under storagePath follows from it (tpuft.controller.builders)."""
    applied = (obj.get("status") or {}).get("appliedSpec")
    try:
        return parse({**obj, "spec": applied} if isinstance(applied, dict) else obj)
    except SpecError:
        return None


def _log_file(obj: dict, job: c.Component) -> str | None:
    tft = built_from(obj)
    return None if tft is None else builders.log_path(tft, job)


def new_text(shown: int, logs: str) -> tuple[str, int]:
    """Pure: (what of `logs` is not printed yet, how much is printed then), `shown` characters
    printed before. A shorter log is another one: all of it."""
    if len(logs) < shown:
        return logs, len(logs)
    return logs[shown:], len(logs)


def ray_token(kubectl_bin: str, ns: str, cluster: str) -> str:
    """The Ray token KubeRay keeps for `cluster` (a Secret of its name, key auth_token)."""
    what = f"Secret {ns}/{cluster} (the Ray token KubeRay made for RayCluster {cluster})"
    secret = kubectl.get(kubectl_bin, "secret", cluster, ns, what=what)
    if secret is None:
        raise NoLog(f"{what} does not exist: KubeRay creates it for a RayCluster with authOptions mode token; "
                    "check that KubeRay runs (v1.6+) and its log")
    raw = (secret.get("data") or {}).get(kuberay.RAY_AUTH_TOKEN_SECRET_KEY)
    if not raw:
        raise NoLog(f"{what} has no key {kuberay.RAY_AUTH_TOKEN_SECRET_KEY!r}")
    try:
        return base64.b64decode(raw, validate=True).decode("utf-8").strip()
    except (binascii.Error, UnicodeDecodeError):
        raise NoLog(f"{what}: the value under {kuberay.RAY_AUTH_TOKEN_SECRET_KEY!r} is not a token") from None


def _job_id(args: argparse.Namespace, src: Source) -> str:
    """The Ray job of the RayJob (status.jobId); with -f, waits for it while KubeRay submits."""
    assert src.rayjob is not None, "run() reads a live log only once there is a RayJob"
    while True:
        rayjob = kubectl.get(args.kubectl, "rayjobs", src.rayjob, src.namespace, what=f"RayJob {src.namespace}/{src.rayjob}")
        if rayjob is None:
            raise HeadGone(f"RayJob {src.namespace}/{src.rayjob} is gone")
        st = rayjob.get("status") or {}
        if st.get("jobId"):
            return str(st["jobId"])
        state = job_state(JobObs(src.rayjob, st))
        if st.get("jobDeploymentStatus") in DONE_JOB_STATES:
            raise HeadGone(f"RayJob {src.namespace}/{src.rayjob} ended without a Ray job ({state})")
        if not args.follow:
            raise NoLog(f"RayJob {src.namespace}/{src.rayjob} has not submitted its Ray job yet ({state}): try again "
                        "in a moment, or follow it with -f")
        time.sleep(args.interval)


def _rayjob_ended(args: argparse.Namespace, src: Source) -> bool:
    """KubeRay is done with the RayJob (or it is gone): its Ray job will not start any more."""
    assert src.rayjob is not None, "run() reads a live log only once there is a RayJob"
    rayjob = kubectl.get(args.kubectl, "rayjobs", src.rayjob, src.namespace, what=f"RayJob {src.namespace}/{src.rayjob}")
    return rayjob is None or (rayjob.get("status") or {}).get("jobDeploymentStatus") in DONE_JOB_STATES


def _head(args: argparse.Namespace, src: Source) -> str:
    """The head Service of the run's RayCluster; HeadGone when there is no head to ask."""
    cluster = kubectl.get(args.kubectl, "rayclusters", src.cluster, src.namespace,
                          what=f"RayCluster {src.namespace}/{src.cluster}")
    if cluster is None:
        raise HeadGone(f"RayCluster {src.namespace}/{src.cluster} is gone")
    if (cluster.get("spec") or {}).get("suspend"):
        raise HeadGone(f"RayCluster {src.namespace}/{src.cluster} is suspended")
    head = (cluster.get("status") or {}).get("head") or {}
    return head.get("serviceName") or src.cluster + kuberay.RAY_HEAD_SERVICE_SUFFIX


def live(args: argparse.Namespace, src: Source, out: TextIO, err: TextIO) -> int:
    """Print the job's log from its head (and, with -f, what it adds until the job ends)."""
    job_id, service = _job_id(args, src), _head(args, src)
    token = ray_token(args.kubectl, src.namespace, src.cluster)
    try:
        with kubectl.port_forward(args.kubectl, src.namespace, service, kuberay.RAY_DASHBOARD_PORT) as port:
            return _print(f"http://127.0.0.1:{port}", job_id, token, args, src, out, err)
    except kubectl.KubectlError as e:   # no head pod behind the Service (yet, or any more)
        raise HeadGone(f"the head of RayCluster {src.namespace}/{src.cluster} cannot be reached ({e})") from None


def _print(base: str, job_id: str, token: str, args: argparse.Namespace, src: Source, out: TextIO,
           err: TextIO) -> int:
    shown = 0
    while True:
        try:
            state = ray_jobs.status(base, job_id, token)   # before the log: an ended job's log is then whole
            text, shown = new_text(shown, ray_jobs.logs(base, job_id, token))
        except ray_jobs.JobsError as e:
            if e.status in (401, 403):
                raise NoLog(f"the Ray head refused the token of Secret {src.namespace}/{src.cluster} ({e}); the "
                            "RayCluster may have been re-created since: try again") from None
            if shown == 0 and e.status == 404 and not _rayjob_ended(args, src):
                # KubeRay names the Ray job (status.jobId) before its submitter pod has submitted it
                if not args.follow:
                    raise NoLog(f"Ray job {job_id} of RayJob {src.namespace}/{src.rayjob} is not started on the head "
                                "yet (its submitter pod submits it): try again in a moment, or follow it with -f") from None
                time.sleep(args.interval)
                continue
            if shown == 0 and (e.status == 404 or e.status is None):
                raise HeadGone(f"the head does not give Ray job {job_id} ({e})") from None
            if e.status is None:   # the head went away while following
                err.write(f"tpuft logs: lost the Ray head ({e.message}); the rest is in {src.log_file}\n")
                return 1
            raise NoLog(str(e)) from None
        out.write(text)
        out.flush()
        if not args.follow or state in ray_jobs.ENDED:
            return 0
        time.sleep(args.interval)


def from_file(src: Source, why: str, out: TextIO, err: TextIO) -> int:
    """Print the log file when it is readable here; NoLog saying where it is otherwise."""
    path = src.log_file
    if path is None:
        raise NoLog(f"{why}, and the run's spec does not parse, so where its log file is is not known")
    if object_store.is_remote(path):
        text = _from_bucket(src, why, path)
    else:
        text = _from_disk(src, why, path)
    err.write(f"tpuft logs: {why}; the {src.job.value} driver's log from {path}:\n")
    out.write(text)
    out.flush()
    return 0


def _from_bucket(src: Source, why: str, path: str) -> str:
    try:
        return object_store.read_bytes(path).decode("utf-8", errors="replace")
    except object_store.NotFound:
        raise NoLog(f"{why}; the {src.job.value} driver's log {path} is not there: a driver uploads it every "
                    f"{DRIVER_LOG_UPLOAD_EVERY_S:.0f} s while it runs and when it ends, so a driver that never got "
                    "that far (or was killed before its first upload) left none") from None
    except object_store.StoreError as e:
        raise NoLog(f"{why}; the {src.job.value} driver's log: {e}") from None


def _from_disk(src: Source, why: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise NoLog(f"{why}; the {src.job.value} driver's log is at {path} on spec.checkpoint.storagePath's storage, "
                    f"which is not readable here ({e.strerror or e}): read it where that storage is mounted") from None


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        obj = kubectl.get(args.kubectl, c.PLURAL, args.name, args.namespace,
                          what=f"{c.KIND} {args.namespace}/{args.name}")
        if obj is None:
            raise NoLog(f"{c.KIND} {args.namespace}/{args.name} not found")
        src = source(obj, args.job)
        if src.rayjob is None:
            st = obj.get("status") or {}
            raise NoLog(f"{c.KIND} {args.namespace}/{args.name} has no {src.job.value} RayJob yet (phase "
                        f"{st.get('phase') or '-'}: {st.get('message') or 'no status'}); its log exists once it is "
                        "VerifyingCollectives or Training")
        try:
            return live(args, src, out, err)
        except HeadGone as e:
            return from_file(src, str(e), out, err)
    except (NoLog, kubectl.KubectlError, subprocess.TimeoutExpired) as e:
        err.write(f"tpuft logs: {e}\n")
        return 1
