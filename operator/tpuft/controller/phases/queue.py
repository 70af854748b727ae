"""Queue and capacity: Kueue's admission (Queued, admitted, preempted, requeued) and the
ProvisioningRequest admission check's words (GKE flex-start)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api import kueue as kueue_names
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import (
    Preemption,
    RunStatus,
)
from tpuft.controller import builders
from tpuft.controller.observed import (
    CheckObs,
    ClusterObs,
    Decision,
    Observed,
    Op,
    QueueObs,
    cluster_progress,
    cluster_suspended,
    fmt_time,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import _verify_job

# --- Kueue: Queued, admitted, preempted ----------------------------------------------------------------
# A run waiting to be admitted again after it lost its slice to Kueue (preempted, or a booking lost).
PREEMPTED_REASONS = (Reason.PREEMPTED.value, Reason.REQUEUING.value)


def queue_name(tft: TPUFinetune) -> str | None:
    """The LocalQueue the object asks Kueue for (its kueue.x-k8s.io/queue-name label), or None."""
    return tft.meta.labels.get(kueue_names.KUEUE_QUEUE_LABEL) or None


def wants_queue(obj: Mapping[str, Any], cluster: ClusterObs | None) -> bool:
    """Whether the handler should read Kueue's Workload for this reconcile: an object with a queue
    label whose RayCluster exists, while Queued, or when that RayCluster is suspended outside
    Suspended (an eviction: the message says Kueue's reason)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if not labels.get(kueue_names.KUEUE_QUEUE_LABEL) or cluster is None:
        return False
    phase = RunStatus.of(obj.get("status")).phase
    return phase == Phase.QUEUED or (cluster.suspended and phase != Phase.SUSPENDED)


def _evicted(tft: TPUFinetune, obs: Observed) -> bool:
    """A labelled object's RayCluster suspended while we did not ask (we do only in Suspended): Kueue
    has not admitted it, or has taken the admission back."""
    return bool(queue_name(tft)) and obs.cluster is not None and obs.cluster.suspended


def _kueue_words(kueue: QueueObs | None) -> str:
    if kueue is None or not kueue.workload:
        return "Kueue has not made a Workload for it yet"
    if check := kueue.capacity_check:
        return _capacity_words(check)
    return (kueue.waiting or (kueue.evicted and f"evicted ({kueue.evicted})")
            or f"Workload {kueue.workload} is waiting for quota")


def _capacity_words(check: CheckObs) -> str:
    """Quota reserved, an admission check not Ready: for Kueue's ProvisioningRequest check its
    message is the ProvisioningRequest's own (GKE's queued provisioning: why there is no capacity yet)."""
    return (f"quota reserved; waiting for capacity: admission check {check.name} is {check.state}"
            + (f": {check.message}" if check.message else ""))


def _requeue(draft: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    """Kueue suspended the RayCluster under a provisioning, verifying or training run. While a job
    runs that is a preemption: the jobs are stopped (checkpoints stay), status.recovery.preemptions
    counts it (never sliceReplacements), and the run waits Queued; re-admitted, it provisions,
    verifies again and resumes from its checkpoint (the same attempt, as after a suspend)."""
    names, was, kueue = builders.names(tft), draft.phase or Phase.PENDING, obs.queue
    running = was in (Phase.VERIFYING, Phase.TRAINING)
    if running:
        # The jobs are stopped once KubeRay has deleted the pods (_queued), not now: deleting a
        # RayJob stops its Ray job at once, before the pods' preStop hook has let every rank save
        # a checkpoint at its next step (tpuft_workload.preemption).
        active = {Phase.VERIFYING: _verify_job(draft, tft), Phase.TRAINING: draft.children.train_job}[was]
        draft.status = draft.status.without_resubmission()
        # A revoked booking (GKE took the flex-start nodes back) is a preemption too: its cause is the
        # ProvisioningRequest's condition, read when Kueue rejects the check.
        cause = ((kueue.booking_lost or kueue.evicted) if kueue else "") or f"RayCluster {names.cluster} suspended by Kueue"
        preemption = Preemption(time=fmt_time(draft.now), phase=was.value, cause=cause, step=draft.status.reported_step)
        draft.status = replace(draft.status, recovery=draft.recovery.record_preemption(preemption))
        if tft.spec.verification.enabled:
            draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, Reason.PREEMPTED,
                                "verified again once re-admitted")
    preempted = running or bool(kueue and kueue.evicted) or draft.previous.reason in PREEMPTED_REASONS
    reason = Reason.PREEMPTED if preempted else Reason.QUEUED
    words = _kueue_words(kueue)
    if running:
        jobs = f"RayJob {active} stopped once its pods are gone; " if active else ""
        msg = (f"preempted by Kueue during {was.value} ({cause}); "
               f"{jobs}checkpoints kept; it resumes from the last one once admitted again")
    else:
        msg = f"waiting for Kueue to admit RayCluster {names.cluster} again: {words}"
    draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, reason, words)
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, reason, "RayCluster suspended by Kueue")
    draft.move_to(Phase.QUEUED, reason, msg)
    draft.requeue_after(c.QUEUE_POLL_SECONDS)
    return draft.finish()


def _queued(draft: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    """Waiting for Kueue. Admitted (the RayCluster unsuspended): Provisioning, under a fresh
    deadline: time queued never counts against provisioningTimeoutSeconds."""
    names, kueue, queue = builders.names(tft), obs.queue, queue_name(tft)
    if obs.cluster is None and not obs.leftovers:   # deleted while queued: made again, queued again
        draft.add_action(Op.CREATE, kuberay.RAYCLUSTER_KIND, names.cluster, builders.build_raycluster(tft))
        if draft.previous.reason == Reason.REQUEUING.value:   # we deleted it: a new Workload, back in the queue
            draft.move_to(Phase.QUEUED, Reason.PREEMPTED, f"RayCluster {names.cluster} made again after the lost "
                          f"booking; waiting for Kueue to admit it (LocalQueue {queue}); checkpoints kept")
            draft.requeue_after(c.QUEUE_POLL_SECONDS)
            return draft.finish()
        draft.add_event(EventType.WARNING, Reason.CHILD_DELETED,
                        f"RayCluster {names.cluster} not found while queued; recreating it")
    if kueue is not None and not kueue.installed:
        msg = (f"label {kueue_names.KUEUE_QUEUE_LABEL}={queue} but Kueue is not installed (no {kueue_names.KUEUE_GROUP}/"
               f"{kueue_names.KUEUE_VERSION} Workload API): nothing queues this run, it provisions right away; install "
               "Kueue, or remove the label")
        draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, Reason.KUEUE_NOT_INSTALLED, msg)
        draft.add_event(EventType.WARNING, Reason.KUEUE_NOT_INSTALLED, msg)
        return _admitted(draft, tft, obs, f"not queued ({kueue_names.KUEUE_QUEUE_LABEL}={queue}, Kueue not installed)")
    admitted = obs.cluster is not None and not obs.cluster.suspended
    if obs.jobs:   # a preempted run's RayJobs: stopped once KubeRay has deleted its pods, gone before it runs again
        gone = obs.cluster is None or cluster_suspended(obs.cluster.status)
        if gone or admitted or draft.seconds_in_phase() >= c.PREEMPTION_STOP_SECONDS:
            for name in sorted(obs.jobs):
                draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, name)
        draft.requeue_after(c.LEFTOVER_POLL_SECONDS)
        if admitted:
            draft.move_to(Phase.QUEUED, Reason.PREEMPTED, f"admitted again; waiting for RayJob "
                          f"{', '.join(sorted(obs.jobs))} (stopped after the preemption) to be gone")
            return draft.finish()
    if admitted:
        draft.set_condition(Condition.ADMITTED, ConditionStatus.TRUE, Reason.ADMITTED,
                            f"admitted by Kueue (Workload {kueue.workload}, LocalQueue {queue})"
                            if kueue and kueue.workload else f"admitted (LocalQueue {queue})")
        again = draft.previous.reason in PREEMPTED_REASONS
        return _admitted(draft, tft, obs, "admitted again after a preemption" if again else "admitted")
    if kueue is not None and kueue.check_rejected and obs.cluster is not None and not obs.jobs:
        return _rejected(draft, tft, obs, kueue)
    timeout = tft.spec.queue_timeout_seconds
    words = _kueue_words(kueue)
    if timeout is not None and draft.seconds_in_phase() >= timeout:
        msg = (f"not admitted by Kueue within spec.queueTimeoutSeconds ({timeout}s) in LocalQueue {queue}: {words}; "
               f"`kubectl describe localqueue {queue}` and its ClusterQueue show the quota")
        draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, Reason.QUEUE_TIMEOUT, msg)
        draft.fail(Reason.QUEUE_TIMEOUT, msg)
        return draft.finish()
    reason = Reason.PREEMPTED if draft.previous.reason in PREEMPTED_REASONS else Reason.QUEUED
    if reason == Reason.QUEUED and kueue is not None and kueue.capacity_check is not None:
        reason = Reason.WAITING_FOR_CAPACITY   # Kueue reserved quota; the slice itself is not there yet
    if words not in (draft.previous.message or ""):   # one event per new reason Kueue gives
        draft.add_event(EventType.NORMAL, reason if reason == Reason.WAITING_FOR_CAPACITY else Reason.QUEUED,
                        f"LocalQueue {queue}: {words}")
    lead = ("preempted by Kueue; waiting to be admitted again (checkpoints kept)" if reason == Reason.PREEMPTED
            else f"waiting for Kueue to admit RayCluster {names.cluster}")
    draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, reason, words)
    draft.move_to(Phase.QUEUED, reason, f"{lead} (LocalQueue {queue}): {words}")
    draft.requeue_after(c.QUEUE_POLL_SECONDS if timeout is None
                        else min(c.QUEUE_POLL_SECONDS, timeout - draft.seconds_in_phase()))
    return draft.finish()


def _rejected(draft: _Draft, tft: TPUFinetune, obs: Observed, kueue: QueueObs) -> Decision:
    """Kueue rejected an admission check and deactivated the Workload. A booking revoked or expired
    (the ProvisioningRequest's CapacityRevoked or BookingExpired) is a preemption: the RayCluster is
    deleted and made again, so that Kueue queues a new Workload (checkpoints kept, no attempt spent).
    Capacity that failed for good fails the run in the ProvisioningRequest's words."""
    names, queue = builders.names(tft), queue_name(tft)
    check = kueue.rejected_check
    what = (f"admission check {check.name}: {check.message or 'no message'}" if check
            else f"Workload {kueue.workload} deactivated: {kueue.evicted}")
    if kueue.booking_lost and draft.previous.reason == Reason.REQUEUING.value:   # deleted: waiting for it to go
        draft.requeue_after(c.LEFTOVER_POLL_SECONDS)
        return draft.finish()
    if kueue.booking_lost:
        msg = (f"{kueue.booking_lost} (Workload {kueue.workload}); deleting RayCluster "
               f"{names.cluster} to queue it again as a new Workload; checkpoints kept")
        draft.add_action(Op.DELETE, kuberay.RAYCLUSTER_KIND, names.cluster)
        draft.add_event(EventType.WARNING, Reason.PREEMPTED, msg)
        draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, Reason.REQUEUING, kueue.booking_lost)
        draft.move_to(Phase.QUEUED, Reason.REQUEUING, msg)
        draft.requeue_after(c.LEFTOVER_POLL_SECONDS)
        return draft.finish()
    if not kueue.booking_read:   # cannot tell a lost booking from a failure: wait, say why
        msg = (f"Kueue rejected an admission check ({what}) and the ProvisioningRequests in {tft.meta.namespace} "
               "could not be read to tell a lost booking from a failure; "
               "the operator needs list on provisioningrequests.autoscaling.x-k8s.io (the chart's Role has it)")
        draft.move_to(Phase.QUEUED, Reason.QUEUED, msg)
        draft.requeue_after(c.QUEUE_POLL_SECONDS)
        return draft.finish()
    msg = (f"Kueue rejected an admission check in LocalQueue {queue} ({what}); "
           f"`kubectl get provisioningrequests -n {tft.meta.namespace}` shows why the capacity was not provisioned")
    draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, Reason.CAPACITY_REJECTED, msg)
    draft.fail(Reason.CAPACITY_REJECTED, msg)
    return draft.finish()


def _admitted(draft: _Draft, tft: TPUFinetune, obs: Observed, how: str) -> Decision:
    shape = tft.spec.slice
    progress = cluster_progress(tft, obs.cluster)
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.WAITING_FOR_SLICE, progress)
    draft.move_to(Phase.PROVISIONING, Reason.WAITING_FOR_SLICE,
                  f"{how}; waiting for slice {shape.generation} {shape.topology}: {progress}")
    draft.requeue_after(tft.spec.provisioning_timeout_seconds)
    return draft.finish()
