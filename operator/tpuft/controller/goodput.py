"""status.goodput: where a run's wall-clock seconds went, from the phase transition times the
phase machine already records. Pure, like tpuft.controller.phases, which calls `account` once per reconcile.

Each time status.phaseTransitionTime moves (a new phase, or a fresh deadline in the same phase: a
replaced slice, a resubmitted verification), the interval that just closed, from the previous
transition time to the new one, is added to the cause of the phase (and reason) it was spent in.
Times are whole seconds (observed.fmt_time), so the sums are exact integers. The phase in progress
is counted when it ends: while Training runs, `trainingSeconds` holds the training before the last
transition; at Succeeded, Failed or Serving every second from the first transition on is in.
Serving is not part of it (the run's goodput is about getting a trained model), and nothing after
a terminal phase is either.
"""
from __future__ import annotations

from datetime import datetime

from tpuft.api.constants import GoodputCause, Phase, Reason
from tpuft.api.status import Goodput


def cause(phase: str | None, reason: str | None) -> GoodputCause | None:
    """The cause an interval spent in `phase` (ending with `reason`) counts for; None: not counted."""
    if phase == Phase.PROVISIONING.value and reason in (Reason.REPLACING_SLICE.value, Reason.RESIZING.value):
        return GoodputCause.RECOVERY
    return {Phase.PENDING.value: GoodputCause.PROVISIONING, Phase.PROVISIONING.value: GoodputCause.PROVISIONING,
            Phase.VERIFYING.value: GoodputCause.VERIFICATION, Phase.TRAINING.value: GoodputCause.TRAINING,
            Phase.SUSPENDED.value: GoodputCause.SUSPENDED, Phase.QUEUED.value: GoodputCause.QUEUED}.get(phase or "")


def account(goodput: Goodput | None, phase: str | None, reason: str | None, since: datetime | None,
            until: datetime | None) -> Goodput | None:
    """status.goodput once the interval [since, until] spent in (phase, reason) is closed: `goodput`
    unchanged when there is no such interval (no previous transition, the same transition time, an
    uncounted phase)."""
    what = cause(phase, reason)
    if what is None or since is None or until is None or until <= since:
        return goodput
    return (goodput or Goodput()).add(what, int((until - since).total_seconds()))
