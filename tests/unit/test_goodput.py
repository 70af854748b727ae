"""tpuft.controller.goodput, pure: which cause each phase's seconds count for, how an interval is added, and
status.goodput over a whole run driven through phases.decide with a fixed clock (provisioning,
verification, training, a lost host's replacement, a suspend and its resume)."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone

import pytest

from tests.factories import merge_patch
from tpuft.controller import goodput, observed, phases
from tpuft.api import constants as c
from tpuft.api.constants import GoodputCause as G
from tpuft.api.constants import Phase, Reason
from tpuft.api.fields import to_json
from tpuft.controller.observed import ClusterObs, JobObs, Observed
from tpuft.api.status import Goodput

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.mark.parametrize("phase,reason,expected", [
    (Phase.PENDING, Reason.WAITING_FOR_PREVIOUS, G.PROVISIONING),
    (Phase.PROVISIONING, Reason.WAITING_FOR_SLICE, G.PROVISIONING),
    (Phase.PROVISIONING, Reason.REPLACING_SLICE, G.RECOVERY),
    (Phase.VERIFYING, Reason.VERIFYING, G.VERIFICATION),
    (Phase.VERIFYING, Reason.SUBMISSION_LOST, G.VERIFICATION),
    (Phase.TRAINING, Reason.TRAINING, G.TRAINING),
    (Phase.TRAINING, Reason.FINISHING_RAYJOB, G.TRAINING),
    (Phase.SUSPENDED, Reason.SUSPENDED, G.SUSPENDED),
    (Phase.QUEUED, Reason.QUEUED, G.QUEUED),
    (Phase.QUEUED, Reason.PREEMPTED, G.QUEUED),
    (Phase.SERVING, Reason.SERVING, None),          # after the run's goodput: not counted
    (Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, None),
    (Phase.FAILED, Reason.SLICE_LOST, None),
    (None, None, None),
])
def test_each_phase_counts_for_its_cause(phase, reason, expected):
    assert goodput.cause(phase and phase.value, reason and reason.value) == expected


def _seconds(**by_cause) -> Goodput:
    return Goodput.of({G(k): v for k, v in by_cause.items()})


@pytest.mark.parametrize("before,phase,reason,since,until,after", [
    # the first interval
    (None, Phase.PROVISIONING, Reason.WAITING_FOR_SLICE, 0, 30, _seconds(provisioning=30)),
    # added to what was there
    (_seconds(provisioning=30), Phase.TRAINING, Reason.TRAINING, 30, 130, _seconds(provisioning=30, training=100)),
    (_seconds(training=100), Phase.PROVISIONING, Reason.REPLACING_SLICE, 130, 170, _seconds(training=100, recovery=40)),
    # nothing to add: unchanged (and None stays None)
    (_seconds(training=100), Phase.SERVING, Reason.SERVING, 130, 900, _seconds(training=100)),
    (None, Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, 0, 10, None),
    (None, Phase.TRAINING, Reason.TRAINING, None, 10, None),
    (_seconds(training=5), Phase.TRAINING, Reason.TRAINING, 10, 10, _seconds(training=5)),
])
def test_an_interval_is_added_to_its_cause(before, phase, reason, since, until, after):
    got = goodput.account(before, phase.value, reason.value, None if since is None else at(since), at(until))
    assert got == after


def test_the_summary_has_every_cause_the_total_and_the_ratio():
    assert to_json(_seconds(provisioning=30, verification=20, training=150)) == {
        "provisioningSeconds": 30, "verificationSeconds": 20, "trainingSeconds": 150, "recoverySeconds": 0,
        "suspendedSeconds": 0, "queuedSeconds": 0, c.GOODPUT_TOTAL: 200, c.GOODPUT_RATIO: 0.75}
    assert c.GOODPUT_RATIO not in to_json(_seconds())   # nothing counted yet: no ratio


# --- a whole run through phases.decide ----------------------------------------------------------------
def _object() -> dict:
    spec = {"accelerator": "v6e", "topology": "4x4", "image": "img:1", "model": "m", "dataset": {"name": "d"},
            "checkpoint": {"storagePath": "gs://bucket/ck"}, "verification": {"enabled": True, "timeoutSeconds": 600},
            "recovery": {"maxSliceReplacements": 1}}
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": "ft", "namespace": "ns", "uid": "u-1", "generation": 1}, "spec": spec}


def _step(o: dict, t: float, obs: Observed) -> dict:
    """What the API server holds after the reconcile at time t wrote its patch."""
    d = phases.decide(o, obs, at(t))
    o = copy.deepcopy(o)
    merge_patch(o.setdefault("status", {}), d.patch or {})
    return o


def _ready(ready: int = 4, suspended: bool = False) -> ClusterObs:
    return ClusterObs("ft-ray", {"readyWorkerReplicas": ready, "desiredWorkerReplicas": 4,
                                 "conditions": [{"type": "RayClusterProvisioned", "status": "True"}]}, suspended)


def _jobs(**status) -> dict:
    return {name.replace("_", "-"): JobObs(name.replace("_", "-"), {"jobStatus": s, "jobDeploymentStatus":
                                                                    "Complete" if s == "SUCCEEDED" else "Running"})
            for name, s in status.items()}


def test_a_run_with_a_replacement_and_a_suspend_adds_up_every_second():
    o = _step(_object(), 0, Observed())                                            # Provisioning
    o = _step(o, 30, Observed(_ready()))                                           # -> Verifying: 30 s provisioning
    o = _step(o, 50, Observed(_ready(), _jobs(ft_verify="SUCCEEDED")))             # -> Training: 20 s verification
    assert o["status"]["goodput"] == to_json(_seconds(provisioning=30, verification=20))
    o = _step(o, 150, Observed(_ready(3), _jobs(ft_train="RUNNING")))              # a host lost: 100 s training
    assert (o["status"]["phase"], o["status"]["reason"]) == ("Provisioning", "ReplacingSlice")
    o = _step(o, 160, Observed(_ready(3)))                                         # still replacing: no interval
    o = _step(o, 190, Observed(_ready()))                                          # -> Verifying: 40 s recovery
    o = _step(o, 200, Observed(_ready(), _jobs(ft_verify="SUCCEEDED")))            # -> Training: 10 s verification
    o = _step(o, 230, Observed(_ready(), _jobs(ft_train="RUNNING")))               # training: no interval closes
    assert o["status"]["goodput"] == to_json(_seconds(provisioning=30, verification=30, training=100, recovery=40))
    o["spec"]["suspend"] = True
    o = _step(o, 260, Observed(_ready()))                                          # -> Suspended: 60 s training
    o["spec"]["suspend"] = False
    o = _step(o, 300, Observed(_ready(suspended=True)))                            # -> Provisioning: 40 s suspended
    o = _step(o, 320, Observed(_ready()))                                          # -> Verifying: 20 s provisioning
    o = _step(o, 330, Observed(_ready(), _jobs(ft_verify="SUCCEEDED")))            # -> Training: 10 s verification
    o = _step(o, 400, Observed(_ready(), _jobs(ft_train="SUCCEEDED")))             # -> Succeeded: 70 s training
    assert o["status"]["phase"] == "Succeeded"
    assert o["status"]["goodput"] == {
        "provisioningSeconds": 50, "verificationSeconds": 40, "trainingSeconds": 230, "recoverySeconds": 40,
        "suspendedSeconds": 40, "queuedSeconds": 0, "totalSeconds": 400, "ratio": 0.575}
    # every second from the first transition to completion, and nothing after it
    assert o["status"]["goodput"]["totalSeconds"] == (
        observed.parse_time(o["status"]["completionTime"]) - T0).total_seconds()
    assert _step(o, 900, Observed(_ready()))["status"]["goodput"] == o["status"]["goodput"]
