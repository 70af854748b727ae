"""End states and pauses: Suspended and resumed, Succeeded and Failed with their TTL, and an
error noted without moving the phase."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from tpuft.api import kuberay
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import RunStatus
from tpuft.controller import builders
from tpuft.controller.observed import (
    Decision,
    Observed,
    Op,
    Tunables,
    cluster_progress,
    fmt_time,
    parse_time,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import _release, _verify_job
from tpuft.controller.phases.serving import _publication


def _suspend(draft: _Draft, tft: TPUFinetune, obs: Observed, tunables: Tunables) -> Decision:
    names, was = builders.names(tft), draft.phase or Phase.PENDING
    # Jobs cannot outlive their pods; the verify job goes too, so the resumed slice is verified again.
    # They go first: the RayCluster is suspended once they are gone (_suspended).
    verify = _verify_job(draft, tft)
    active = {Phase.VERIFYING: verify, Phase.TRAINING: draft.children.train_job}.get(was)
    stop = frozenset(x for x in (verify, active) if x is not None)
    holding = _release(draft, obs, 0, tunables, stop=stop) if obs.cluster is not None else []
    draft.status = draft.status.without_resubmission()   # the resumed run verifies the slice, then submits again
    if obs.cluster is not None and not holding:
        draft.add_action(Op.SUSPEND, kuberay.RAYCLUSTER_KIND, names.cluster)
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED,
                        f"RayCluster suspended once RayJob {', '.join(holding)} is gone" if holding
                        else "RayCluster suspended")
    draft.move_to(Phase.SUSPENDED, Reason.SUSPENDED, f"suspended during {was.value}" +
                  (f" (RayJob {active} deleted; it resumes from its checkpoint)" if active else ""))
    return draft.finish()


def _suspended(draft: _Draft, tft: TPUFinetune, obs: Observed, live_suspend: bool, tunables: Tunables) -> Decision:
    names = builders.names(tft)
    if live_suspend:
        cluster_up = obs.cluster is not None and not obs.cluster.suspended
        if cluster_up and not _release(draft, obs, draft.seconds_in_phase(), tunables):
            draft.add_action(Op.SUSPEND, kuberay.RAYCLUSTER_KIND, names.cluster)
            draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED,
                                "RayCluster suspended")
        return draft.finish()
    if obs.cluster is not None:
        draft.add_action(Op.RESUME, kuberay.RAYCLUSTER_KIND, names.cluster)
    draft.move_to(Phase.PROVISIONING, Reason.WAITING_FOR_SLICE,
                  f"resumed; waiting for slice: {cluster_progress(tft, obs.cluster)}")
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.WAITING_FOR_SLICE, "resumed")
    draft.requeue_after(tft.spec.provisioning_timeout_seconds)
    return draft.finish()


def _terminal(draft: _Draft, tft: TPUFinetune, obs: Observed, tunables: Tunables) -> Decision:
    if draft.phase == Phase.SUCCEEDED and tft.spec.publish is not None:
        _publication(draft, tft, obs)
    ttl = draft.ttl
    done = parse_time(draft.status.completion_time)
    left_over = [(kind, x.name) for kind, x in ((kuberay.RAYCLUSTER_KIND, obs.cluster), (kuberay.RAYSERVICE_KIND, obs.service))
                 if x is not None]
    if left_over and done is not None:
        left = ttl - (draft.now - done).total_seconds()
        if left <= 0:
            for kind, name in left_over:
                if kind == kuberay.RAYCLUSTER_KIND and _release(draft, obs, -left, tunables):
                    continue   # its RayJobs go first
                draft.add_action(Op.DELETE, kind, name)
                draft.add_event(EventType.NORMAL, Reason.TTL_EXPIRED, f"deleting {kind} {name}: "
                                f"ttlSecondsAfterFinished ({ttl}s) has passed; status and checkpoints stay")
        else:
            draft.requeue_after(left)
    return draft.finish()


def note_error(obj: Mapping[str, Any], error: str, now: datetime) -> dict | None:
    """Status patch after an action failed transiently: phase kept (Pending if none), message says why."""
    previous = RunStatus.of(obj.get("status"))
    patch: dict[str, Any] = {}
    if previous.phase is None:
        patch.update({"phase": Phase.PENDING.value, "reason": Reason.CREATED.value,
                      "phaseTransitionTime": fmt_time(now), "startTime": fmt_time(now)})
    msg = f"retrying: {error}"
    if previous.message != msg:
        patch["message"] = msg
    return patch or None
