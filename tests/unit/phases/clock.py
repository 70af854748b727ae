"""The fixed clock and the objects the phase tests drive through tpuft.controller.phases.decide:
the helpers the test modules by phase share."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone

from tpuft.api import constants as c
from tpuft.api.constants import Phase
from tpuft.api.spec import parse
from tpuft.controller import builders, observed, phases
from tpuft.controller.observed import ClusterObs, JobObs, Observed

from tests.factories import merge_patch, small_object

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


TUN = observed.Tunables(verify_grace_seconds=60)


NAME, NS = "ft", "team-a"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make(**spec) -> dict:
    return small_object(NAME, NS, {"uid": "u-1", "generation": 1}, **{
        "provisioningTimeoutSeconds": 1800, "verification": {"enabled": True, "timeoutSeconds": 600},
        "ttlSecondsAfterFinished": 300, "training": {"maxJobRetries": 0}, **spec})


def names(o: dict) -> builders.ChildNames:
    return builders.names(parse(o))


def apply(o: dict, d: observed.Decision) -> dict:
    """What the API server holds after the handler writes d.patch (a JSON merge patch)."""
    o = copy.deepcopy(o)
    merge_patch(o.setdefault("status", {}), d.patch or {})
    return o


def cluster(ready: int = 0, desired: int = 4, provisioned: bool = False, state: str | None = None,
            suspended: bool = False, name: str = f"{NAME}-ray") -> ClusterObs:
    st: dict = {"readyWorkerReplicas": ready, "desiredWorkerReplicas": desired}
    if state:
        st["state"] = state
    if provisioned:
        st["conditions"] = [{"type": "RayClusterProvisioned", "status": "True", "reason": "AllPodRunningAndReadyFirstTime"}]
    return ClusterObs(name, st, suspended)


def job(name: str, job_status: str = "RUNNING", deploy: str = "Running", **extra) -> JobObs:
    return JobObs(name, {"jobStatus": job_status, "jobDeploymentStatus": deploy, **extra})


def cond(o_or_d, ctype: c.Condition) -> dict:
    status = o_or_d.status if isinstance(o_or_d, observed.Decision) else o_or_d["status"]
    return next(x for x in status["conditions"] if x["type"] == ctype.value)


def kinds(d: observed.Decision) -> list[tuple[str, str, str]]:
    return [(a.op, a.kind, a.name) for a in d.actions]


def hosts_of(o: dict) -> int:
    """Its worker hosts, over every slice."""
    tft = parse(o)
    return tft.spec.slice.hosts * tft.spec.slices


def run_to(o: dict, phase: Phase, t: float = 0) -> dict:
    """Drive a fresh object through the happy path up to `phase` (at time t for every step)."""
    n, hosts = names(o), hosts_of(o)
    o = apply(o, phases.decide(o, Observed(), at(t), TUN))
    if phase == Phase.PROVISIONING:
        return o
    o = apply(o, phases.decide(o, Observed(cluster(hosts, hosts, provisioned=True)), at(t), TUN))
    if phase == Phase.VERIFYING:
        return o
    if o["status"]["phase"] == Phase.VERIFYING.value:
        o = apply(o, phases.decide(o, Observed(cluster(hosts, hosts, provisioned=True),
                                               {n.verify_job: job(n.verify_job, "SUCCEEDED", "Complete")}), at(t), TUN))
    assert o["status"]["phase"] == phase.value
    return o


# --- verification ----------------------------------------------------------------------------------
def verifying(**spec) -> tuple[dict, builders.ChildNames]:
    o = run_to(make(**spec), Phase.VERIFYING)
    return o, names(o)


# --- training -------------------------------------------------------------------------------------
def training(**spec) -> tuple[dict, builders.ChildNames]:
    o = run_to(make(**spec), Phase.TRAINING)
    return o, names(o)


# --- a lost host: replace the slice, verify again, resume -------------------------------------------
def lost(ready: int = 3, hosts: int = 4) -> ClusterObs:
    """KubeRay's status once a worker pod is gone: RayClusterProvisioned stays True."""
    return cluster(ready, hosts, provisioned=True)


# --- serving (spec.serve) ------------------------------------------------------------------------------
SERVE_CPU = {"enabled": True, "timeoutSeconds": 600}


def rayservice(app: str | None = None, message: str = "", ready: bool | None = None, side: str = "active",
               name: str = f"{NAME}-serve") -> observed.ServiceObs:
    """A RayService as KubeRay v1.7.0 reports it (applicationStatuses keyed by app name)."""
    st: dict = {}
    if app is not None:
        st[f"{side}ServiceStatus"] = {"applicationStatuses": {c.SERVE_APP_NAME: {"status": app, "message": message}}}
    if ready is not None:
        st["conditions"] = [{"type": "Ready", "status": "True" if ready else "False",
                             "reason": "NonZeroServeEndpoints" if ready else "Initializing"}]
    return observed.ServiceObs(name, st)


# --- Kueue: Queued, admitted, preempted ----------------------------------------------------------------
QUOTA = ("couldn't assign flavors to pod set workers: insufficient unused quota for google.com/tpu in flavor "
         "v6e-4x4, 16 more needed")


def waiting(words: str = QUOTA, evicted: str = "") -> observed.QueueObs:
    return observed.QueueObs(workload="raycluster-ft-ray-1a2b3", waiting=words, evicted=evicted)
