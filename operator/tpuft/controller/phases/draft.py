"""The status a reconcile is building (_Draft): conditions, events and actions, then the merge
patch that writes only what changed."""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any, Mapping

from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.status import (
    Children,
    IgnoredSpecChange,
    Recovery,
    RunCondition,
    RunStatus,
)
from tpuft.controller import goodput
from tpuft.controller.observed import (
    CONDITION_ORDER,
    Action,
    Decision,
    Event,
    Op,
    fmt_time,
    parse_time,
)


# --- the draft status ---------------------------------------------------------------------------
class _Draft:
    """One reconcile's decision as it is made: the status as stored (`previous`) and as edited so
    far (`status`), the conditions, actions and events decided, and when to look again."""

    def __init__(self, obj: Mapping, now: datetime):
        self.previous = RunStatus.of(obj.get("status"))
        self.status = self.previous
        self.now = now
        self.generation = int((obj.get("metadata") or {}).get("generation") or 0)
        self.conditions: dict[Condition, tuple[ConditionStatus, str, str]] = {}
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.requeue_seconds: float | None = None
        self.ignored: IgnoredSpecChange | None = None   # when a spec edit is not applied
        self.ttl = 0
        self.reason: Reason | None = None  # the last move_to() of this reconcile
        self.serving_ready = False         # Serving with the app RUNNING: Ready is True

    @property
    def phase(self) -> Phase | None:
        return self.status.phase

    @property
    def children(self) -> Children:
        return self.status.children or Children()

    @property
    def recovery(self) -> Recovery:
        return self.status.recovery or Recovery()

    def seconds_in_phase(self) -> float:
        t = parse_time(self.status.phase_transition_time)
        return (self.now - t).total_seconds() if t else 0.0

    def restart_clock(self) -> None:
        """A fresh deadline in the same phase."""
        self.status = replace(self.status, phase_transition_time=fmt_time(self.now))

    def requeue_after(self, seconds: float) -> None:
        seconds = max(seconds, 0.5)
        self.requeue_seconds = seconds if self.requeue_seconds is None else min(self.requeue_seconds, seconds)

    def set_condition(self, ctype: Condition, status: ConditionStatus, reason: Reason | str, message: str = "") -> None:
        """reason: a Reason, or the status.reason string the overall conditions mirror."""
        self.conditions[ctype] = (status, reason.value if isinstance(reason, Reason) else reason, message)

    def add_action(self, op: Op, kind: str, name: str, body: Mapping | None = None) -> None:
        self.actions.append(Action(op, kind, name, body))

    def add_event(self, type_: EventType, reason: Reason, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def move_to(self, phase: Phase, reason: Reason, message: str) -> None:
        if self.status.phase != phase:
            self.restart_clock()
        self.status = replace(self.status, phase=phase, reason=reason.value, message=message)
        self.reason = reason
        if phase.terminal and not self.status.completion_time:
            self.status = replace(self.status, completion_time=fmt_time(self.now))
            self.requeue_after(self.ttl)

    def fail(self, reason: Reason, message: str) -> None:
        self.move_to(Phase.FAILED, reason, message)

    def finish(self) -> Decision:
        status, previous = self.status, self.previous
        status = replace(status, observed_generation=self.generation, ignored_spec_change=self.ignored,
                         start_time=fmt_time(self.now) if status.start_time is None else status.start_time)
        since, until = parse_time(previous.phase_transition_time), parse_time(status.phase_transition_time)
        if since != until:   # an interval closed: its seconds go to the cause it was spent on
            was = previous.phase.value if previous.phase else None
            spent = goodput.account(status.goodput, was, previous.reason, since, until)
            if spent is not None:
                status = replace(status, goodput=spent)
        phase, reason, message = status.phase, status.reason or "", status.message or ""
        pending = Reason.PENDING.value
        ready = phase == Phase.SUCCEEDED or (phase == Phase.SERVING and self.serving_ready)
        self.set_condition(Condition.READY, ConditionStatus.of(ready), reason or pending, message)
        self.set_condition(Condition.FAILED, ConditionStatus.of(phase == Phase.FAILED), reason or pending,
                           message if phase == Phase.FAILED else "")
        self.status = replace(status, conditions=self._conditions(reason or pending))
        if previous.phase != phase:
            # a lost host sends the run back to Provisioning: news, not progress
            etype = (EventType.WARNING if phase == Phase.FAILED or self.reason in (Reason.REPLACING_SLICE,
                                                                                   Reason.PREEMPTED)
                     else EventType.NORMAL)
            self.events.insert(0, Event(etype, self.reason or Reason(reason),
                                        f"{phase.value if phase else None}: {message}"))
        before, after = previous.owned_json(), self.status.owned_json()
        return Decision(status=after, patch=_merge_patch(before, after), actions=tuple(self.actions),
                        events=tuple(self.events), requeue_after=self.requeue_seconds)

    def _conditions(self, reason: str) -> tuple[RunCondition, ...]:
        """Every condition in CONDITION_ORDER: as set in this reconcile, else as stored, else
        Unknown with the phase's reason; a condition's transition time moves only with its status."""
        old = {x.type: x for x in self.previous.conditions or ()}
        out = []
        for ctype in CONDITION_ORDER:
            optional = ctype in (Condition.SERVING, Condition.ADMITTED)
            if optional and ctype not in self.conditions and ctype.value not in old:
                continue   # only objects that serve carry Serving; only queued ones (Kueue) Admitted
            if ctype in self.conditions:
                status, why, message = self.conditions[ctype]
            elif ctype.value in old:
                stored = old[ctype.value]
                status, why, message = stored.status, stored.reason or "", stored.message or ""
            else:
                status, why, message = ConditionStatus.UNKNOWN, reason, ""
            before = old.get(ctype.value)
            since = before.last_transition_time if before is not None and before.status == status else None
            out.append(RunCondition(type=ctype.value, status=status, reason=why or ConditionStatus.UNKNOWN.value,
                                    message=message, last_transition_time=since or fmt_time(self.now),
                                    observed_generation=self.generation))
        return tuple(out)


def _merge_patch(before: Mapping, after: Mapping) -> dict | None:
    """The JSON merge patch (RFC 7386, what the status write sends) that turns `before` into
    `after` (two RunStatus.owned_json()): changed keys with their new values, removed keys as
    null, at every depth (a key dropped from a nested object, e.g. status.serving.notReadySince,
    is removed only by an explicit null). None: nothing changed."""
    def value(old: Any, new: Any) -> Any:
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            return {**new, **{k: None for k in old if k not in new},
                    **{k: value(old[k], v) for k, v in new.items() if k in old}}
        return new
    patch = {k: value(before.get(k), v) for k, v in after.items() if before.get(k) != v}
    patch.update({k: None for k in before if k not in after})
    return patch or None
