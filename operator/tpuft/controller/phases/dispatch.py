"""decide: the short table that reads the phase and hands the reconcile to its module."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from tpuft.api.constants import EventType, Phase, Reason
from tpuft.api.spec import DEFAULTS, SpecError, TPUFinetune, parse
from tpuft.api.status import IgnoredSpecChange
from tpuft.controller.observed import (
    SERVE_ENABLED_FIELD,
    Decision,
    Observed,
    Tunables,
    spec_diff,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.ending import _suspend, _suspended, _terminal
from tpuft.controller.phases.provisioning import _pending, _provisioning
from tpuft.controller.phases.queue import _queued
from tpuft.controller.phases.serving import _serving
from tpuft.controller.phases.training import _training
from tpuft.controller.phases.verification import _verifying


# --- decide ----------------------------------------------------------------------------------------
def decide(obj: Mapping[str, Any], observed: Observed, now: datetime, tunables: Tunables = Tunables()) -> Decision:
    draft = _Draft(obj, now)
    spec_raw = obj.get("spec") or {}
    try:
        current: TPUFinetune | None = parse(obj)
        error: SpecError | None = None
    except SpecError as e:
        current, error = None, e
    applied_raw = draft.previous.applied_spec
    ttl = spec_raw.get("ttlSecondsAfterFinished")  # live: read from the current spec
    draft.ttl = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else DEFAULTS["ttlSecondsAfterFinished"]

    if applied_raw is None:  # nothing created yet: the current spec is the one that counts
        # A failure before anything was applied (invalid spec, rejected at admission) is final for
        # that generation only: editing the spec starts the run again.
        restart = draft.phase == Phase.FAILED and draft.previous.observed_generation != draft.generation
        if draft.phase is not None and draft.phase.terminal and not restart:
            return draft.finish()
        if error is not None:
            msg = "invalid spec: " + "; ".join(str(p) for p in error.problems)
            if draft.phase == Phase.FAILED and draft.previous.message != msg:
                draft.add_event(EventType.WARNING, Reason.INVALID_SPEC, msg)
            draft.fail(Reason.INVALID_SPEC, msg)
            return draft.finish()
        if restart:
            draft.status = draft.status.restarted()
        assert current is not None   # no error: it parsed
        return _pending(draft, obj, current, observed)

    try:
        tft = parse({**obj, "spec": applied_raw})
    except SpecError as e:  # e.g. an operator upgrade dropped a shape this run was started with
        if not (draft.phase and draft.phase.terminal):
            draft.fail(Reason.INVALID_SPEC, "the applied spec no longer validates: " + "; ".join(map(str, e.problems)))
        return draft.finish()
    live_suspend = flag if isinstance(flag := spec_raw.get("suspend"), bool) else tft.spec.suspend
    live_serve = _live_serve(spec_raw, tft)
    ignored = spec_diff(spec_raw, applied_raw)
    if tft.spec.serve and not live_serve:   # turning serving off acts live; turning it on mid-run does not
        ignored = [f for f in ignored if f != SERVE_ENABLED_FIELD]
    if ignored or error is not None:
        draft.ignored = _ignored_change(draft, ignored, error)
        if draft.previous.observed_generation != draft.generation:
            draft.add_event(EventType.WARNING, Reason.SPEC_CHANGE_IGNORED, draft.ignored.message or "")
    if draft.phase is not None and draft.phase.terminal:
        return _terminal(draft, tft, observed, tunables)
    if observed.admission_error is not None:
        rejected = observed.admission_error
        draft.fail(Reason.ADMISSION_REJECTED,
                   f"{rejected.kind} {rejected.name} was rejected at admission: {rejected.message}")
        return draft.finish()
    if draft.phase == Phase.SERVING:
        return _serving(draft, tft, observed, live_serve, tunables)
    if live_suspend and draft.phase != Phase.SUSPENDED:
        return _suspend(draft, tft, observed, tunables)
    if draft.phase == Phase.SUSPENDED:
        return _suspended(draft, tft, observed, live_suspend, tunables)
    if draft.phase in (None, Phase.PENDING):  # created but status lost: the creates are idempotent
        return _pending(draft, obj, tft, observed)
    if draft.phase == Phase.QUEUED:
        return _queued(draft, tft, observed)
    if draft.phase == Phase.PROVISIONING:
        return _provisioning(draft, tft, observed)
    if draft.phase == Phase.VERIFYING:
        return _verifying(draft, tft, observed, tunables)
    return _training(draft, tft, observed, tunables, live_serve)


def _live_serve(spec_raw: Mapping, tft: TPUFinetune) -> bool:
    """Whether to serve: the applied spec enables it and the current spec has not turned it off."""
    enabled = (spec_raw.get("serve") or {}).get("enabled") if isinstance(spec_raw.get("serve"), Mapping) else None
    return tft.spec.serve is not None and (enabled if isinstance(enabled, bool) else True)


def _ignored_change(draft: _Draft, ignored: list[str], error: SpecError | None) -> IgnoredSpecChange:
    """status.ignoredSpecChange: the edit this run does not apply, and how to apply it."""
    what = ", ".join(ignored[:6]) + (" ..." if len(ignored) > 6 else "")
    if error is not None:
        what = f"new spec is invalid ({error.problems[0]})" + (f"; changed: {what}" if what else "")
    message = (f"spec change ignored: {what}; the run uses generation {draft.previous.applied_generation}'s spec "
               "(delete and recreate the TPUFinetune to apply it)")
    return IgnoredSpecChange(observed_generation=draft.generation, fields=tuple(ignored), valid=error is None,
                             message=message)
