"""The reconciler's brain, pure: (the object, what its children look like, now) -> Decision.

No client, no clock, no randomness: `reconciler.py` gathers the observation, calls `decide`,
performs `Decision.actions` (idempotent creates by deterministic name, patches, deletes),
then writes `Decision.patch` (None when nothing changed) to the status subresource.

Rules worth knowing (see also docs/concepts.md):
  * The spec is validated first; an invalid spec fails with InvalidSpec and creates nothing.
    A corrected spec restarts the run, as long as nothing was ever created.
  * The spec the children are built from is stored in status.appliedSpec. Every child made
    later in the run (verify job, each training attempt, a recreated cluster) is built from it,
    so a spec edit mid-run is never half-applied; it is recorded (observedGeneration, a
    Warning event, status.ignoredSpecChange). Only `suspend` and `ttlSecondsAfterFinished`
    act live.
  * A RayCluster's RayJobs go before it does (_release): a RayJob whose Ray job has ended is
    finished by KubeRay (jobDeploymentStatus Complete/Failed) only once its submitter, following
    the job's logs from the head, has exited. So a job's outcome moves the run on (Succeeded,
    Serving, TrainingFailed, VerificationFailed) only once KubeRay has finished its RayJob
    (reason FinishingRayJob meanwhile, at most Tunables.rayjob_grace_seconds; past it the RayJob
    is deleted), and a RayCluster is deleted (serving, TTL) or suspended only once every RayJob on
    it is finished or gone (an unfinished one is deleted first; at most twice the grace).
  * A RayJob KubeRay failed because its submitter completed while the dashboard did not know its
    Ray job (observed.job_lost) is not the workload failing: after a backoff it is resubmitted as a
    new RayJob (training: the next attempt's name; verification: a fresh verify job), at most
    c.LOST_SUBMISSION_RETRIES times per run, not counted against training.maxJobRetries
    (status.recovery.lostSubmissions, reason and Warning event SubmissionLost). Past that it is a
    failed job like any other.
  * Suspend: the active RayJob and the verify job are deleted (they cannot outlive their pods;
    checkpoints stay), then the RayCluster is patched suspend=true. Resume -> Provisioning (clock
    restarts), then the new slice is verified again, then training continues with the same
    attempt, resuming from its checkpoint.
  * A child deleted out from under us: the RayCluster is recreated while Provisioning; in
    VerifyingCollectives/Training the run fails with ChildDeleted (the slice/job is gone).
  * After Succeeded/Failed the RayCluster is deleted once ttlSecondsAfterFinished has passed.
  * While the slice comes up, the first blocking cause its pods show (tpuft.controller.diagnosis: image
    pull, container config, crash loop, the scheduler's reason) is in status.message and the
    SliceProvisioned condition, and a SliceBlocked event is posted once per new cause; the
    ProvisioningTimeout message carries it. A re-created object waits (Pending,
    WaitingForPrevious) until the deleted one's RayCluster and pods are gone.
  * A job that failed, or a host lost under it, because a pod was killed for memory (a container
    the kernel's OOM killer ended, in the pods read then: wants_failure_pods; or Ray's memory
    monitor, in the job's message) is said so: which pod, where in the slice, its limit, what to
    change. Retries and slice replacements count as for any failure; a run that ends, ends
    OutOfMemory. A RayJob's message reaches status without colour codes or Ray's log tail
    (observed.job_message): the log stays in `tpuft logs`.
  * Adapters on a shared base (docs/serving.md): training.method none goes from Pending straight to
    Serving (no RayCluster, no RayJobs). A LoRA fine-tune with spec.publish is refused (BaseMismatch)
    before anything is created when its base is known to be wrong; once Succeeded, its reason follows
    the publication (tpuft.controller.publishing judges, _publication acts): BaseNotServing, NotPromoted,
    Publishing (a RayJob on the base's serving RayCluster), Published, Superseded, PublishFailed. A
    base derives status.adapters from its fine-tunes' status.serving and unpublishes a deleted one's
    adapter itself: no object writes another's status, and no finalizer is needed.
  * status.goodput (tpuft.controller.goodput): each time phaseTransitionTime moves, the seconds since the
    previous one go to the cause they were spent on (provisioning, verification, training,
    recovery, suspended); ratio = training / total.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Mapping

from tpuft.controller import builders, goodput, publishing
from tpuft.api import constants as c
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.controller import hosts
from tpuft.controller.diagnosis import Blocker, blocking, host_of, pool_hint
from tpuft.controller.builders import elastic_accumulation, elastic_slices
from tpuft.api.spec import DEFAULTS, SpecError, TPUFinetune, parse, spec_warnings
from tpuft.controller.observed import (
    CONDITION_ORDER, SERVE_ENABLED_FIELD, Action, CheckObs, ClusterObs, Decision, Event, JobObs, Killer, MemoryKill,
    Observed, Op, QueueObs, Tunables, cluster_progress, cluster_provisioned, cluster_suspended, fmt_time, job_failed,
    job_failure_detail, job_finishing, job_lost, job_settled, job_state, job_succeeded, memory_kill, parse_time,
    service_progress, service_ready, serving_ready, slice_loss, spec_diff)
from tpuft.api.status import (Adapter, Adapters, Children, Elastic, IgnoredSpecChange, LostSlice, LostSubmission,
                          MaintenanceNotice, Preemption, Publication, Recovery, Resubmit, RunCondition, RunStatus,
                          Serving, Slice, Verification)
from tpuft.api.status import Training as TrainingProgress


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


def _pending(draft: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed) -> Decision:
    if obs.admission_error is not None:
        rejected = obs.admission_error
        draft.fail(Reason.ADMISSION_REJECTED,
                   f"{rejected.kind} {rejected.name} was rejected at admission: {rejected.message}")
        return draft.finish()
    if draft.phase == Phase.PENDING and draft.seconds_in_phase() >= tft.spec.provisioning_timeout_seconds:
        if draft.status.training_attempts is None:   # the same status shape as a timeout after the creates
            draft.status = replace(draft.status, training_attempts=0)
        draft.fail(Reason.PROVISIONING_TIMEOUT, f"children could not be created within "
                   f"{tft.spec.provisioning_timeout_seconds}s: {draft.previous.message or 'no detail'}")
        return draft.finish()
    names, shape = builders.names(tft), tft.spec.slice
    if obs.leftovers:
        return _wait_for_previous(draft, tft, obs)
    if tft.spec.publish is not None and obs.base is not None and (
            mismatch := publishing.base_mismatch(tft, obs.base)):
        draft.fail(Reason.BASE_MISMATCH, mismatch)   # before anything is created: nothing is trained for nothing
        return draft.finish()
    if not tft.spec.trains:
        return _serve_as_is(draft, obj, tft)
    # The NetworkPolicy before the RayCluster, so that no Ray pod starts unprotected where it is enforced.
    for body in [*builders.build_workload_identity(tft), builders.build_network_policy(tft)]:
        draft.add_action(Op.CREATE, body["kind"], body["metadata"]["name"], body)
    draft.add_action(Op.CREATE, c.RAYCLUSTER_KIND, names.cluster, builders.build_raycluster(tft))
    draft.status = replace(
        draft.status, applied_generation=draft.status.applied_generation or draft.generation,
        applied_spec=copy.deepcopy(draft.status.applied_spec or dict(obj.get("spec") or {})),
        children=Children(ray_cluster=names.cluster, service_account=builders.service_account(tft)), training_attempts=0,
        slice=Slice(accelerator=shape.generation, topology=shape.topology, slices=tft.spec.slices, hosts=shape.hosts,
                    chips_per_host=shape.chips_per_host, devices_per_host=shape.devices_per_host,
                    devices=tft.spec.num_workers, ray_accelerator_type=shape.ray_accelerator_type or ""))
    progress = cluster_progress(tft, ClusterObs(names.cluster))  # what the next reconcile will see: no write then
    _initial_conditions(draft, tft, progress)
    if draft.previous.applied_spec is None:   # once: when the children are first made from this spec
        for warning in spec_warnings(tft.spec):
            draft.add_event(EventType.WARNING, Reason.SPEC_WARNING, warning)
    if tft.spec.suspend:
        draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED, "created suspended")
        draft.move_to(Phase.SUSPENDED, Reason.SUSPENDED, f"RayCluster {names.cluster} created suspended (spec.suspend)")
    elif queue_name(tft):
        msg = f"waiting for Kueue to admit RayCluster {names.cluster} (LocalQueue {queue_name(tft)})"
        draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, Reason.QUEUED, msg)
        draft.move_to(Phase.QUEUED, Reason.QUEUED, msg)
        draft.requeue_after(c.QUEUE_POLL_SECONDS)
    else:
        draft.move_to(Phase.PROVISIONING, Reason.WAITING_FOR_SLICE,
                      f"waiting for slice {shape.generation} {shape.topology}: {progress}")
        draft.requeue_after(tft.spec.provisioning_timeout_seconds)
    return draft.finish()


def _wait_for_previous(draft: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    """KubeRay selects a RayCluster's pods by name label alone: a new RayCluster created while
    the deleted object's pods are still terminating takes its old head for its own (and Ray
    jobs then fail on a head node that is gone). Wait, briefly, until they are."""
    shown = ", ".join(obs.leftovers[:4]) + (f" and {len(obs.leftovers) - 4} more" if len(obs.leftovers) > 4 else "")
    draft.move_to(Phase.PENDING, Reason.WAITING_FOR_PREVIOUS, f"waiting for an earlier {c.KIND} {tft.meta.namespace}/"
                  f"{tft.meta.name}'s children to be deleted before creating RayCluster {builders.names(tft).cluster}: "
                  f"{shown}")
    draft.requeue_after(c.LEFTOVER_POLL_SECONDS)
    return draft.finish()


def _initial_conditions(draft: _Draft, tft: TPUFinetune, progress: str) -> None:
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.WAITING_FOR_SLICE, progress)
    if tft.spec.verification.enabled:
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, Reason.WAITING_FOR_SLICE, "")
    else:
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, Reason.VERIFICATION_SKIPPED,
                            "spec.verification.enabled is false")
    draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, Reason.WAITING_FOR_SLICE, "")
    if tft.spec.serve:
        draft.set_condition(Condition.SERVING, ConditionStatus.UNKNOWN, Reason.WAITING_FOR_SLICE,
                            "serves once training succeeds")


def _provisioning(draft: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    names, shape, timeout = builders.names(tft), tft.spec.slice, tft.spec.provisioning_timeout_seconds
    if obs.cluster is None and not obs.leftovers:
        body = builders.build_raycluster(tft)
        body["spec"].pop("suspend", None)
        draft.add_action(Op.CREATE, c.RAYCLUSTER_KIND, names.cluster, body)
        draft.add_event(EventType.WARNING, Reason.CHILD_DELETED, f"RayCluster {names.cluster} not found while "
                        "provisioning; recreating it (the provisioning deadline is unchanged)")
    if _evicted(tft, obs):
        return _requeue(draft, tft, obs)
    ready = (obs.cluster is not None and cluster_provisioned(obs.cluster.status, obs.cluster.generation)
             and not slice_loss(obs.cluster.status))   # RayClusterProvisioned stays True after a loss
    # The pods a later loss is judged against (tpuft.controller.hosts): every one of them seen Ready by the pod watch.
    recorded = hosts.whole(obs.hosts, 1 + shape.hosts * tft.spec.slices) if obs.hosts else None
    unseen = ready and bool(obs.hosts) and recorded is None
    replacing = draft.previous.reason in (Reason.REPLACING_SLICE.value, Reason.RESIZING.value)
    # A pod told to stop is saving while it terminates; once it is gone (or the slice is whole again: KubeRay
    # replaces a pod only then) its preStop, and so the save, is over.
    saving = any(p.deleting for p in obs.hosts) and not (ready and not unseen)
    stopping, stopped = _stop_old_jobs(draft, tft, obs, saving) if replacing else ([], [])
    old_jobs = bool(obs.jobs_deleting or stopping or stopped)   # nothing is submitted beside them
    if ready and not unseen and not old_jobs:
        draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.TRUE, Reason.SLICE_READY,
                            cluster_progress(tft, obs.cluster))
        if recorded or draft.recovery.slice_pods or draft.recovery.elastic:
            draft.status = replace(draft.status, recovery=replace(draft.recovery.slice_whole(recorded), elastic=None))
        if not tft.spec.verification.enabled:
            return _start_training(draft, tft, obs)
        # After a loss or a resize the training job goes in beside the verification: its submission, data
        # and driver start overlap it, and its trainer waits for CollectivesVerified (--after-verification).
        return _start_verification(draft, tft, with_training=replacing and bool(draft.status.training_attempts))
    if replacing and not old_jobs and (fewer := _elastic_slices(draft, tft, obs)):
        return _train_on_fewer_slices(draft, tft, obs, fewer)
    progress = cluster_progress(tft, obs.cluster)
    if stopping:
        progress += (f"; RayJob {', '.join(stopping)} is saving its checkpoint (its pod was told to stop) before "
                     "it is stopped")
        draft.requeue_after(STOPPING_LOOK_SECONDS)
    elif ready and (obs.jobs_deleting or stopped):   # KubeRay would take the old submitter Job (same name) for the new one's
        progress += (f"; waiting for RayJob {', '.join(sorted({*obs.jobs_deleting, *stopped}))} (deleted before) to be "
                     "gone before submitting again")
    elif unseen:
        progress += "; waiting for the pod watch to show each of the slice's pods Ready"
        draft.requeue_after(STOPPING_LOOK_SECONDS)
    if obs.cluster is not None and obs.cluster.suspended:  # not by us, not Kueue's (no queue label): who?
        progress += "; the RayCluster is suspended, not by this operator (spec.suspend is false, no queue label)"
    found = blocking(obs.pods)
    cause = found[1] if found else None
    if found and found[0] == Blocker.UNSCHEDULABLE and obs.pools is not None and shape.is_tpu:
        hint = pool_hint(obs.pools, shape.gke_accelerator, shape.topology, shape.hosts, tft.spec.slices)
        cause = f"{found[1]}; {hint}"
    if cause:
        progress += f"; {cause}"
        if cause not in (draft.previous.message or ""):   # once per new cause, not on every resync
            draft.add_event(EventType.WARNING, Reason.SLICE_BLOCKED, cause)
    if draft.seconds_in_phase() >= timeout:
        where = (f"a TPU node pool with {c.GKE_TPU_ACCELERATOR_SELECTOR}={shape.gke_accelerator} and "
                 f"{c.GKE_TPU_TOPOLOGY_SELECTOR}={shape.topology} ({shape.hosts} hosts of {shape.machine_type}) "
                 "per slice"
                 if shape.is_tpu else "schedulable CPU nodes")
        msg = (f"slice not provisioned after {timeout}s: {progress}; check {where} has capacity and quota, "
               f"and `kubectl describe raycluster {names.cluster}` / "
               f"`kubectl get pods -l {c.RAY_CLUSTER_LABEL}={names.cluster}`")
        draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.PROVISIONING_TIMEOUT, msg)
        draft.fail(Reason.PROVISIONING_TIMEOUT, msg)
        return draft.finish()
    reason, what = Reason.WAITING_FOR_SLICE, f"waiting for slice {shape.generation} {shape.topology}"
    if draft.previous.reason == Reason.REPLACING_SLICE.value:   # keep saying why it is provisioning again
        reason = Reason.REPLACING_SLICE
        what = (f"replacing the slice ({draft.recovery.slice_replacements} of "
                f"{tft.spec.recovery.max_slice_replacements}): {what}")
        if tft.spec.recovery.elastic and tft.spec.slices > 1:
            wait = tft.spec.recovery.elastic_wait_seconds - draft.seconds_in_phase()
            if wait > 0:
                draft.requeue_after(wait)
    elif draft.previous.reason == Reason.RESIZING.value:
        reason, what = Reason.RESIZING, f"back to all {tft.spec.slices} slices: {what}"
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, reason, progress)
    draft.move_to(Phase.PROVISIONING, reason, f"{what}: {progress}")
    draft.requeue_after(timeout - draft.seconds_in_phase())
    return draft.finish()


def wants_pods(obj: Mapping[str, Any]) -> bool:
    """Whether the handler should list the RayCluster's pods for this reconcile: while the slice
    is being created or is coming up (the only phases a stall cause or a leftover matters in)."""
    return RunStatus.of(obj.get("status")).phase in (None, Phase.PENDING, Phase.PROVISIONING)


STOPPING_LOOK_SECONDS = 2.0   # how often a RayJob saving its stop checkpoint is looked at (events come too)


def _stop_old_jobs(draft: _Draft, tft: TPUFinetune, obs: Observed,
                   pod_saving: bool) -> tuple[list[str], list[str]]:
    """After a loss or a resize: the slice's RayJobs still on the cluster. One whose pod was told to stop
    saves its checkpoint and ends by itself (preStop, tpuft_workload.preemption); it is deleted once it
    has ended, once no pod of the slice is stopping any more (`pod_saving` False: the preStop, and so
    the save, is over; a job told to stop before it trained never ends by itself), or once the pod's
    own stop bound has passed. Returns (those still saving, those deleted now)."""
    saving, deleted = [], []
    for name in sorted(x for x in {_verify_job(draft, tft), draft.children.train_job} if x is not None):
        job = obs.jobs.get(name)
        if job is None:
            continue
        if (not pod_saving or job_settled(job) or job_failed(job) or job_succeeded(job)
                or draft.seconds_in_phase() >= c.PRESTOP_WAIT_SECONDS):
            draft.add_action(Op.DELETE, c.RAYJOB_KIND, name)
            deleted.append(name)
        else:
            saving.append(name)
    return saving, deleted


def _elastic_slices(draft: _Draft, tft: TPUFinetune, obs: Observed) -> int:
    """spec.recovery.elastic, a replacement waited for elasticWaitSeconds: how many of the whole slices
    to train on, the most that keep the global batch (0: stay; none is whole, or it is too soon)."""
    recovery, shape = tft.spec.recovery, tft.spec.slice
    # Only a run that has trained: its slices were verified (or verification is off) and it has a checkpoint to go on from.
    if (not recovery.elastic or tft.spec.slices < 2 or draft.previous.reason != Reason.REPLACING_SLICE.value
            or not draft.status.training_attempts
            or draft.seconds_in_phase() < recovery.elastic_wait_seconds or not hosts.head_ready(obs.hosts)):
        return 0
    whole = hosts.whole_slices(obs.hosts, shape.hosts, replica_per_slice=shape.is_tpu)
    return elastic_slices(tft.spec.training.gradient_accumulation_steps, tft.spec.slices, whole)


def _train_on_fewer_slices(draft: _Draft, tft: TPUFinetune, obs: Observed, slices: int) -> Decision:
    """Training resumes from its checkpoint on the whole slices; they were verified before and are
    unchanged, so they are not verified again (the lost slice is, when every slice is back)."""
    accumulation = elastic_accumulation(tft.spec.training.gradient_accumulation_steps, tft.spec.slices, slices)
    running = tuple(sorted(p.uid for p in obs.hosts if hosts.up(p)))
    elastic = Elastic(slices=slices, gradient_accumulation_steps=accumulation, since=fmt_time(draft.now))
    draft.status = replace(draft.status, recovery=replace(draft.recovery.slice_whole(running), elastic=elastic))
    msg = (f"a lost slice is not back after {tft.spec.recovery.elastic_wait_seconds}s: training resumes from its "
           f"checkpoint on {slices} of {tft.spec.slices} slices (gradient accumulation {accumulation}, was "
           f"{tft.spec.training.gradient_accumulation_steps}); back to {tft.spec.slices} once every slice is whole")
    draft.add_event(EventType.WARNING, Reason.TRAINING_ON_FEWER_SLICES, msg)
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.TRAINING_ON_FEWER_SLICES, msg)
    return _start_training(draft, tft, obs, slices=slices)


def _start_verification(draft: _Draft, tft: TPUFinetune, reason: Reason = Reason.VERIFYING,
                        message: str | None = None, with_training: bool = False) -> Decision:
    index = draft.recovery.lost_count(Phase.VERIFYING)   # a fresh name after each lost submission
    name = builders.names(tft).verify_attempt(index)
    draft.add_action(Op.CREATE, c.RAYJOB_KIND, name, builders.build_verify_job(tft, index))
    draft.status = replace(draft.status, children=replace(draft.children, verify_job=name))
    if with_training:
        train = _submit_training(draft, tft, after_verification=True)
        message = message or (f"verifying collectives on every device (RayJob {name}); RayJob {train} submitted "
                              "beside it, training once they pass")
    draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, reason,
                        message or f"RayJob {name} submitted")
    draft.move_to(Phase.VERIFYING, reason, message or f"verifying collectives on every device (RayJob {name})")
    return draft.finish()


def _waiting_train_job(draft: _Draft, obs: Observed) -> str | None:
    """The training RayJob submitted beside this verification (after a loss), when it exists."""
    train = draft.children.train_job
    return train if train is not None and train in obs.jobs else None


def _stop_waiting_train_job(draft: _Draft, obs: Observed) -> None:
    if (train := _waiting_train_job(draft, obs)) is not None:
        draft.add_action(Op.DELETE, c.RAYJOB_KIND, train)


def _verify_job(draft: _Draft, tft: TPUFinetune) -> str:
    """The current verification RayJob's name."""
    return builders.names(tft).verify_attempt(draft.recovery.lost_count(Phase.VERIFYING))


def _submit_training(draft: _Draft, tft: TPUFinetune, slices: int | None = None,
                     after_verification: bool = False) -> str:
    """The current training attempt's RayJob created (after a resume or a loss the interrupted attempt
    continues from its checkpoint) and named in status; returns its name."""
    attempts = draft.status.training_attempts or 0
    index = max(attempts - 1, 0)
    name = builders.names(tft).train_attempt(index)
    draft.add_action(Op.CREATE, c.RAYJOB_KIND, name, builders.build_train_job(tft, index, slices, after_verification))
    draft.status = replace(draft.status, training_attempts=max(attempts, 1),
                           children=replace(draft.children, train_job=name))
    return name


def _start_training(draft: _Draft, tft: TPUFinetune, obs: Observed, slices: int | None = None) -> Decision:
    name = _submit_training(draft, tft, slices)
    draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, Reason.TRAINING,
                        f"RayJob {name} submitted")
    draft.move_to(Phase.TRAINING, *_training_says(draft, tft, name, draft.status.training_attempts or 1))
    return draft.finish()


def _training_says(draft: _Draft, tft: TPUFinetune, job: str, attempt: int) -> tuple[Reason, str]:
    """Training's reason and message: on fewer slices than the spec's (spec.recovery.elastic), it says so."""
    msg = f"training (RayJob {job}, attempt {attempt} of {tft.spec.training.max_job_retries + 1})"
    elastic = draft.recovery.elastic
    if elastic is None:
        return Reason.TRAINING, msg
    return Reason.TRAINING_ON_FEWER_SLICES, (f"{msg} on {elastic.slices} of {tft.spec.slices} slices (a lost slice "
                                             "is not back; training returns to every slice once it is)")


def _lost_cluster(draft: _Draft, tft: TPUFinetune, obs: Observed) -> bool:
    if obs.cluster is not None:
        return False
    assert draft.phase is not None   # a running phase's handler calls this
    draft.fail(Reason.CHILD_DELETED, f"RayCluster {builders.names(tft).cluster} was deleted during "
               f"{draft.phase.value}; the run cannot continue (recreate the TPUFinetune to start again; checkpoints "
               "are kept)")
    return True


def _replace_slice(draft: _Draft, tft: TPUFinetune, obs: Observed, cause: str, stopping: bool = False) -> Decision:
    """A host was lost under a running job: stop the jobs (they cannot finish on a broken slice),
    let KubeRay recreate the lost pods, wait for the whole slice under a fresh provisioning
    deadline, verify it again and resume training from its checkpoint (the same attempt, as after
    a suspend). Past spec.recovery.maxSliceReplacements: Failed/SliceLost, with the history (the
    jobs are stopped then too: left on the broken slice, their submitters would fail)."""
    allowed, was = tft.spec.recovery.max_slice_replacements, draft.phase
    assert was is not None and obs.cluster is not None   # _verifying and _training, past _lost_cluster
    done = draft.recovery.slice_replacements or 0
    current = _verify_job(draft, tft) if was == Phase.VERIFYING else draft.children.train_job
    killed = _memory_kill(draft, obs, obs.jobs.get(current or ""))
    if killed is not None:   # a container the kernel ended for memory is restarted: its pod not ready meanwhile
        cause = f"{cause}; {_killed_for_memory(tft, killed)}"
    loss = LostSlice(time=fmt_time(draft.now), phase=was.value, cause=cause,
                     hosts_ready=(hosts.ready_workers(obs.hosts) if obs.hosts
                                  else int(obs.cluster.status.get("readyWorkerReplicas") or 0)),
                     hosts=tft.spec.slice.hosts * tft.spec.slices, step=draft.status.reported_step)
    draft.status = replace(draft.status, recovery=draft.recovery.record_loss(loss))
    submitted = {_verify_job(draft, tft), draft.children.train_job}
    # A training job whose pod was told to stop saves that step's checkpoint and ends by itself: it is
    # left to (_stop_old_jobs deletes it once ended), unless the run ends here.
    saving = draft.children.train_job if stopping and was == Phase.TRAINING and done < allowed else None
    for job in sorted(name for name in submitted if name is not None):
        if job in obs.jobs and job != saving:   # while the head may still be up: KubeRay's finalizer stops the Ray job
            draft.add_action(Op.DELETE, c.RAYJOB_KIND, job)
    if done >= allowed:
        msg = (f"a host of the slice was lost during {was.value} ({cause}) and the slice has already been replaced "
               f"{done} time(s) (spec.recovery.maxSliceReplacements={allowed}); checkpoints are kept")
        reason = Reason.SLICE_LOST
        if killed is not None:
            reason, msg = Reason.OUT_OF_MEMORY, f"{msg}; {_memory_advice(tft, killed, _component(was))}"
        draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, reason, msg)
        draft.fail(reason, msg)
        return draft.finish()
    draft.status = replace(draft.status, recovery=replace(draft.recovery.replacing_slice(), slice_pods=None))
    msg = (f"replacing the slice ({done + 1} of {allowed}): a host was lost during {was.value} ({cause}); "
           "KubeRay recreates the lost pods, then the slice is verified again"
           + (" and training resumes from its last checkpoint"
              if was == Phase.TRAINING or draft.status.training_attempts else ""))
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.REPLACING_SLICE, msg)
    if tft.spec.verification.enabled:
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, Reason.REPLACING_SLICE, "")
    draft.move_to(Phase.PROVISIONING, Reason.REPLACING_SLICE, msg)
    draft.restart_clock()   # a fresh provisioning deadline
    draft.requeue_after(tft.spec.provisioning_timeout_seconds)
    return draft.finish()


def _verifying(draft: _Draft, tft: TPUFinetune, obs: Observed, tunables: Tunables) -> Decision:
    names, timeout, name = builders.names(tft), tft.spec.verification.timeout_seconds, _verify_job(draft, tft)
    if _lost_cluster(draft, tft, obs):
        return draft.finish()
    assert obs.cluster is not None
    if _evicted(tft, obs):   # KubeRay deletes the pods of a suspended cluster: not a lost host
        return _requeue(draft, tft, obs)
    if loss := _host_loss(draft, obs):
        return _replace_slice(draft, tft, obs, loss.cause)
    job = obs.jobs.get(name)
    if job is None:
        draft.fail(Reason.CHILD_DELETED, f"RayJob {name} was deleted during verification")
        return draft.finish()
    workload = (draft.status.verification or Verification()).message
    if job_succeeded(job):
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.TRUE, Reason.VERIFIED,
                            workload or f"RayJob {name} succeeded")
        if (train := _waiting_train_job(draft, obs)) is not None:   # submitted beside it: it trains now
            attempts = draft.status.training_attempts or 1
            draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, Reason.TRAINING,
                                f"RayJob {train} submitted")
            draft.move_to(Phase.TRAINING, *_training_says(draft, tft, train, attempts))
            return draft.finish()
        return _start_training(draft, tft, obs)
    if job_lost(job) and draft.recovery.lost_count() < c.LOST_SUBMISSION_RETRIES:
        msg = _resubmission_due(draft, job, names.verify_attempt(draft.recovery.lost_count(Phase.VERIFYING) + 1),
                                Condition.COLLECTIVES_VERIFIED, tunables)
        if msg is None:
            return draft.finish()
        draft.add_event(EventType.WARNING, Reason.SUBMISSION_LOST, msg)
        draft.restart_clock()   # the fresh job's own verification deadline
        return _start_verification(draft, tft, Reason.SUBMISSION_LOST, msg)
    storage = (draft.status.verification or Verification()).storage_error
    if job_failed(job) and storage:
        msg = _storage_not_writable(tft, f"RayJob {name}", storage)
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, Reason.STORAGE_NOT_WRITABLE, msg)
        _stop_waiting_train_job(draft, obs)
        if _finishing(draft, job, Condition.COLLECTIVES_VERIFIED, f"failing with {Reason.STORAGE_NOT_WRITABLE.value}",
                      tunables):
            return draft.finish()
        draft.fail(Reason.STORAGE_NOT_WRITABLE, msg)
        return draft.finish()
    if job_failed(job):
        timed_out = job.status.get("reason") == c.RAYJOB_REASON_DEADLINE_EXCEEDED
        killed = None if timed_out else _memory_kill(draft, obs, job)
        reason = (Reason.COLLECTIVE_TIMEOUT if timed_out else Reason.OUT_OF_MEMORY if killed
                  else Reason.VERIFICATION_FAILED)
        detail = (f"RayJob {name}: {_killed_for_memory(tft, killed)}: {_memory_advice(tft, killed, c.Component.VERIFY)}"
                  if killed else job_failure_detail(job, _full_log(tft, c.Component.VERIFY)))
        msg = f"collective verification failed: {detail}" + (f"; workload: {workload}" if workload else "")
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, reason, msg)
        _stop_waiting_train_job(draft, obs)
        if _finishing(draft, job, Condition.COLLECTIVES_VERIFIED, f"failing with {reason.value}", tunables):
            return draft.finish()
        draft.fail(reason, msg)
        return draft.finish()
    bound = timeout + tunables.verify_grace_seconds
    if draft.seconds_in_phase() >= bound:
        msg = (f"collective verification did not finish within {timeout}s (+{tunables.verify_grace_seconds:g}s grace): "
               f"RayJob {name} {job_state(job)}; a host that never joins (wrong topology, unhealthy ICI) "
               "looks like this")
        draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, Reason.COLLECTIVE_TIMEOUT, msg)
        _stop_waiting_train_job(draft, obs)
        draft.fail(Reason.COLLECTIVE_TIMEOUT, msg)
        return draft.finish()
    # Same message as on entry: the job's own progress lives in the RayJob's status, and an
    # unchanged message means no status write (one write per phase change).
    draft.move_to(Phase.VERIFYING, Reason.VERIFYING, f"verifying collectives on every device (RayJob {name})")
    draft.requeue_after(bound - draft.seconds_in_phase())
    return draft.finish()


def _training(draft: _Draft, tft: TPUFinetune, obs: Observed, tunables: Tunables, live_serve: bool = False) -> Decision:
    names = builders.names(tft)
    attempts = max(draft.status.training_attempts or 1, 1)   # RayJobs submitted
    resubmitted = draft.recovery.lost_count(Phase.TRAINING)                 # of them after a lost submission
    counted, retries = attempts - resubmitted, tft.spec.training.max_job_retries
    name = names.train_attempt(attempts - 1)
    if _lost_cluster(draft, tft, obs):
        return draft.finish()
    assert obs.cluster is not None
    job = obs.jobs.get(name)
    if _evicted(tft, obs) and not (job is not None and job_succeeded(job)):
        return _requeue(draft, tft, obs)
    loss = _host_loss(draft, obs)
    if loss and not (job is not None and job_succeeded(job)):   # a finished run needs no slice any more
        return _replace_slice(draft, tft, obs, loss.cause, loss.stopping)
    if job is not None and not job_settled(job):
        _maintenance(draft, obs)
        if (resized := _grow_back(draft, tft, obs, name)) is not None:
            return resized
    if job is None:
        draft.fail(Reason.CHILD_DELETED, f"RayJob {name} was deleted during training")
        return draft.finish()
    if job_succeeded(job):
        draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.TRUE, Reason.TRAINING_COMPLETE,
                            f"RayJob {name} succeeded")
        if _finishing(draft, job, Condition.TRAINING_SUCCEEDED, "releasing the slice to serve" if live_serve
                      else "succeeding", tunables):
            return draft.finish()
        if live_serve:
            return _start_serving(draft, tft, obs, tunables)
        draft.move_to(Phase.SUCCEEDED, Reason.TRAINING_COMPLETE,
                      f"training complete (RayJob {name}, attempt {counted})")
        if tft.spec.publish is not None:
            _publication(draft, tft, obs)
        return draft.finish()
    if job_lost(job) and draft.recovery.lost_count() < c.LOST_SUBMISSION_RETRIES:
        msg = _resubmission_due(draft, job, names.train_attempt(attempts), Condition.TRAINING_SUCCEEDED, tunables)
        if msg is None:
            return draft.finish()
        return _resubmit_training(draft, tft, attempts, Reason.SUBMISSION_LOST, f"{msg}, resuming from checkpoint")
    storage = (draft.status.training or TrainingProgress()).storage_error
    if job_failed(job) and storage:   # not retried: another attempt would meet the same storage
        msg = _storage_not_writable(tft, f"RayJob {name}", storage)
        draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.FALSE, Reason.STORAGE_NOT_WRITABLE, msg)
        if _finishing(draft, job, Condition.TRAINING_SUCCEEDED, f"failing with {Reason.STORAGE_NOT_WRITABLE.value}",
                      tunables):
            return draft.finish()
        draft.fail(Reason.STORAGE_NOT_WRITABLE, msg)
        return draft.finish()
    if job_failed(job):
        killed = _memory_kill(draft, obs, job)
        detail = (f"RayJob {name}: {_killed_for_memory(tft, killed)}" if killed
                  else job_failure_detail(job, _full_log(tft, c.Component.TRAIN)))
        if counted <= retries:
            return _resubmit_training(draft, tft, attempts, Reason.RETRYING, f"{detail}; resubmitted as "
                                      f"{names.train_attempt(attempts)} (attempt {counted + 1} of {retries + 1}), "
                                      "resuming from checkpoint")
        if killed:
            detail += f": {_memory_advice(tft, killed, c.Component.TRAIN)}"
        msg = f"training failed after {counted} attempt(s): {detail}" + (
            f" ({resubmitted} more RayJob(s) resubmitted after a lost submission)" if resubmitted else "")
        reason = Reason.OUT_OF_MEMORY if killed else Reason.TRAINING_FAILED
        draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.FALSE, reason, msg)
        if _finishing(draft, job, Condition.TRAINING_SUCCEEDED, f"failing with {reason.value}", tunables):
            return draft.finish()
        draft.fail(reason, msg)
        return draft.finish()
    draft.move_to(Phase.TRAINING, *_training_says(draft, tft, name, counted))
    return draft.finish()


def _host_loss(draft: _Draft, obs: Observed) -> hosts.Loss | None:
    """A lost host of the running slice: judged against the pods it was found whole with (the pod
    watch, tpuft.controller.hosts), else (no record: pods not watched) as KubeRay's ready count shows it."""
    assert obs.cluster is not None
    recorded = draft.recovery.slice_pods
    if recorded:
        return hosts.lost(recorded, obs.hosts, obs.nodes)
    lost = slice_loss(obs.cluster.status)
    return hosts.Loss(lost) if lost else None


def _maintenance(draft: _Draft, obs: Observed) -> None:
    """GKE's maintenance notice on a node under the running slice: a checkpoint is asked for at the
    next step boundary (status.recovery.checkpointRequestedAt; training goes on), once per notice; the
    step the job saved for it is recorded when it answers. The host's loss, when it comes, is the usual
    replacement."""
    found, last = hosts.maintenance(obs.hosts, obs.nodes), draft.recovery.last_maintenance
    if found and not (last is not None and (last.node, last.notice) == found):
        node, notice = found
        seen = MaintenanceNotice(time=fmt_time(draft.now), node=node, notice=notice, step=draft.status.reported_step)
        draft.status = replace(draft.status, recovery=draft.recovery.maintenance_notice(seen, fmt_time(draft.now)))
        draft.add_event(EventType.WARNING, Reason.MAINTENANCE_NOTICE,
                        f"node {node} under the slice: {notice}; the training job is asked for a checkpoint at its "
                        "next step boundary")
        return
    training = draft.status.training
    answered = training is not None and training.checkpoint_request_saved is not None and (
        training.checkpoint_request_saved == draft.recovery.checkpoint_requested_at)
    if last is not None and last.checkpoint_step is None and answered and last.time == draft.recovery.checkpoint_requested_at:
        assert training is not None
        draft.status = replace(draft.status, recovery=replace(
            draft.recovery, last_maintenance=replace(last, checkpoint_step=training.step)))
        draft.add_event(EventType.NORMAL, Reason.MAINTENANCE_NOTICE,
                        f"checkpoint at step {training.step} saved for the maintenance notice on node {last.node}")


GROW_BACK_CHECKPOINT_WAIT_SECONDS = 300   # a job that never answers the checkpoint request is stopped after this


def _grow_back(draft: _Draft, tft: TPUFinetune, obs: Observed, job: str) -> Decision | None:
    """Training on fewer slices (spec.recovery.elastic) and every slice whole again: a checkpoint is asked
    for, then the job is stopped and the run goes back through Provisioning (reason Resizing) to verify
    every slice and train on all of them from that checkpoint."""
    elastic, shape = draft.recovery.elastic, tft.spec.slice
    if elastic is None or hosts.whole_slices(obs.hosts, shape.hosts, replica_per_slice=shape.is_tpu) < tft.spec.slices:
        return None
    requested, since = parse_time(draft.recovery.checkpoint_requested_at), parse_time(elastic.since)
    if requested is None or since is None or requested <= since:
        draft.status = replace(draft.status, recovery=replace(draft.recovery,
                                                               checkpoint_requested_at=fmt_time(draft.now)))
        draft.requeue_after(GROW_BACK_CHECKPOINT_WAIT_SECONDS)
        return None
    training = draft.status.training
    answered = training is not None and training.checkpoint_request_saved == draft.recovery.checkpoint_requested_at
    if not answered and (draft.now - requested).total_seconds() < GROW_BACK_CHECKPOINT_WAIT_SECONDS:
        draft.requeue_after(GROW_BACK_CHECKPOINT_WAIT_SECONDS - (draft.now - requested).total_seconds())
        return None
    draft.add_action(Op.DELETE, c.RAYJOB_KIND, job)
    saved = (f"the checkpoint at step {training.step} asked for is saved" if answered and training is not None
             else f"no answer to the checkpoint request within {GROW_BACK_CHECKPOINT_WAIT_SECONDS}s")
    msg = (f"every one of the {tft.spec.slices} slices is whole again ({saved}): training on {elastic.slices} "
           f"stops, the slices are verified and training resumes on all of them")
    draft.status = replace(draft.status, recovery=replace(draft.recovery, elastic=None, slice_pods=None))
    draft.add_event(EventType.NORMAL, Reason.RESIZING, msg)
    draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.RESIZING, msg)
    draft.move_to(Phase.PROVISIONING, Reason.RESIZING, msg)
    draft.restart_clock()
    return draft.finish()


# --- a worker killed for memory (observed.memory_kill) -------------------------------------------------
def wants_failure_pods(obj: Mapping[str, Any], observed: Observed) -> bool:
    """Whether the handler should list the slice's pods for this reconcile although the slice is up:
    in VerifyingCollectives or Training once the current RayJob has failed (not lost) or the slice
    has lost a host. A container the kernel's OOM killer ended shows only there (the kubelet restarts
    it; its lastState says OOMKilled), and a pod's IP names the node of Ray's memory monitor's kill."""
    status = RunStatus.of(obj.get("status"))
    children = status.children or Children()
    current = (children.verify_job if status.phase == Phase.VERIFYING
               else children.train_job if status.phase == Phase.TRAINING else None)
    if current is None or observed.cluster is None:
        return False
    job = observed.jobs.get(current)
    recorded = (status.recovery or Recovery()).slice_pods
    return ((job is not None and job_failed(job) and not job_lost(job)) or slice_loss(observed.cluster.status) is not None
            or (bool(recorded) and hosts.lost(recorded or (), observed.hosts, observed.nodes) is not None))


def _memory_kill(draft: _Draft, obs: Observed, job: JobObs | None) -> MemoryKill | None:
    """A pod of the slice killed for memory while `job` ran (since its start; without one, since
    the phase began), Ray's kill also as the training driver reported it (status.training.message,
    when written since the job started: an earlier attempt's report is not this job's)."""
    started = parse_time(draft.status.phase_transition_time)
    since = (job.status.get("startTime") if job is not None else None) or draft.status.phase_transition_time
    training = draft.status.training or TrainingProgress()
    try:
        reported_at, start = parse_time(training.updated_at), parse_time(since)
    except ValueError:   # a time not in the workload's format: not this job's report
        reported_at = start = None
    current = reported_at is not None and start is not None and reported_at >= start
    return memory_kill(obs.pods, job, started, (training.message or "") if current else "")


def _killed_for_memory(tft: TPUFinetune, killed: MemoryKill) -> str:
    """Which pod (its namespace/name, where in the slice), by what, at what memory limit."""
    pod, shape = killed.pod, tft.spec.slice
    if pod is not None:
        role = "head" if pod.is_head else "worker"
        where = "" if pod.is_head else host_of(pod, shape.hosts, shape.hosts if shape.is_tpu else 1)
        who = f"{role} pod {tft.meta.namespace}/{pod.name}" + (f" ({where})" if where else "")
    else:
        ip = killed.ray.node_ip if killed.ray else ""
        who = f"the Ray node at {ip}" if ip else "a Ray node"
    limit = f"limit {killed.memory_limit}" if killed.memory_limit else "no memory limit set"
    if killed.killer == Killer.KERNEL:
        more = f"; the OOM killer ended containers of {killed.others} more pod(s) too" if killed.others else ""
        return f"{who} was killed for memory by {Killer.KERNEL.value} ({limit}){more}"
    ray = killed.ray
    numbers = [f"{ray.used} used of {ray.total}" if ray and ray.used else "",
               f"over its threshold {ray.threshold}" if ray and ray.threshold else "", f"pod {limit}" if pod else ""]
    said = ", ".join(x for x in numbers if x)
    return f"a worker process on {who} was killed for memory by {Killer.RAY.value}" + (f" ({said})" if said else "")


def _memory_advice(tft: TPUFinetune, killed: MemoryKill, job: c.Component) -> str:
    """What to change, and where the whole log is. Training's memory shrinks per host with more
    hosts to shard over, with LoRA (no optimizer state for the frozen base), with activations
    recomputed instead of kept, and with fewer tokens a step; verification holds no model, so only
    the limit helps there."""
    if killed.pod is not None and killed.pod.is_head:
        change = "give the head more memory (spec.resources.head.limits.memory)"
    else:
        ways = ["give the workers more memory (spec.resources.worker.limits.memory)"]
        if job == c.Component.TRAIN:
            ways.append("a bigger slice")
            if tft.spec.training.method != c.TrainingMethod.LORA.value:
                ways.append("spec.training.method: lora")
            if not tft.spec.training.activation_checkpointing:
                ways.append("spec.training.activationCheckpointing: true")
            ways.append("a smaller spec.training.batchSizePerDevice or maxSeqLength")
        change = ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + (", or " if len(ways) > 2 else " or ") + ways[-1]
    return f"{change}; the full log: {_full_log(tft, job)}"


def _component(phase: Phase) -> c.Component:
    return c.Component.VERIFY if phase == Phase.VERIFYING else c.Component.TRAIN


def _storage_not_writable(tft: TPUFinetune, job: str, error: str) -> str:
    """The run's storage failed its check in the workload (before any collective or training step): the
    workload's message names the bucket and the identity; the ServiceAccount is named here too."""
    return (f"{job}: the run's storage {builders.run_dir(tft)} is not writable: {error}; the Ray pods run as "
            f"ServiceAccount {tft.meta.namespace}/{builders.service_account(tft)} (docs/gke.md, Storage and identity)")


def _full_log(tft: TPUFinetune, job: c.Component) -> str:
    """The command that prints a job's whole driver log (tpuft.cli.logs_cli)."""
    return f"tpuft logs {tft.meta.name} -n {tft.meta.namespace}" + (" --job verify" if job == c.Component.VERIFY else "")


def _resubmit_training(draft: _Draft, tft: TPUFinetune, index: int, reason: Reason, msg: str) -> Decision:
    """The next training RayJob (attempt `index`, a new name), after a failed attempt (Retrying)
    or a lost submission (SubmissionLost); it resumes from the last checkpoint."""
    next_job = builders.names(tft).train_attempt(index)
    elastic = draft.recovery.elastic   # still on fewer slices: the next attempt too
    draft.add_action(Op.CREATE, c.RAYJOB_KIND, next_job,
                     builders.build_train_job(tft, index, elastic.slices if elastic else None))
    draft.status = replace(draft.status, training_attempts=index + 1,
                           children=replace(draft.children, train_job=next_job))
    draft.add_event(EventType.WARNING, reason, msg)
    draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, reason, msg)
    draft.move_to(Phase.TRAINING, reason, msg)
    return draft.finish()


# --- a RayJob KubeRay lost (observed.job_lost) -------------------------------------------------------
def _resubmission_due(draft: _Draft, job: JobObs, next_job: str, ctype: Condition, tunables: Tunables) -> str | None:
    """`job` is lost and the run has resubmitted fewer than c.LOST_SUBMISSION_RETRIES: wait out
    the backoff (tunables.resubmit_backoff_seconds, doubling with each earlier loss in the run; 0: none;
    status.recovery.resubmit says until when, reason SubmissionLost meanwhile), then record it in
    status.recovery.lostSubmissions and return the message to resubmit it as `next_job` with. None
    while waiting."""
    recovery = draft.recovery
    earlier = recovery.lost_count()
    wait = recovery.resubmit
    if wait is None or wait.ray_job != job.name:
        backoff = tunables.resubmit_backoff_seconds * 2 ** earlier
        wait = Resubmit(ray_job=job.name, seen=fmt_time(draft.now), at=fmt_time(draft.now + timedelta(seconds=backoff)))
    what = (f"{job_failure_detail(job)}; KubeRay lost the Ray job, not the workload failing (lost submission "
            f"{earlier + 1} of {c.LOST_SUBMISSION_RETRIES} in this run"
            + (", not counted against training.maxJobRetries)" if draft.phase == Phase.TRAINING else ")"))
    left = (((parse_time(wait.at) or draft.now) - draft.now).total_seconds()
            if tunables.resubmit_backoff_seconds > 0 else 0.0)
    if left > 0:
        draft.status = replace(draft.status, recovery=recovery.waiting_to_resubmit(wait))
        msg = f"{what}; resubmitting as {next_job} at {wait.at}"
        draft.set_condition(ctype, ConditionStatus.UNKNOWN, Reason.SUBMISSION_LOST, msg)
        draft.move_to(draft.phase or Phase.PENDING, Reason.SUBMISSION_LOST, msg)
        draft.requeue_after(left)
        return None
    lost = LostSubmission(time=wait.seen, phase=(draft.phase or Phase.PENDING).value, ray_job=job.name,
                          resubmitted_as=next_job)
    draft.status = replace(draft.status, recovery=recovery.lost_submission(lost))
    return f"{what}; resubmitted as {next_job}"


def _start_serving(draft: _Draft, tft: TPUFinetune, obs: Observed, tunables: Tunables) -> Decision:
    """Training is done: release its slice (once its RayJobs are finished or gone) and serve the
    export on the serve slice."""
    names, serve = builders.names(tft), tft.spec.serve
    assert serve is not None, "serving needs spec.serve enabled"
    shape = serve.slice
    exported = draft.status.training.exported_model if draft.status.training else None
    source = exported or builders.export_path(tft)
    holding = _release(draft, obs, 0, tunables)
    if not holding:
        draft.add_action(Op.DELETE, c.RAYCLUSTER_KIND, names.cluster)
    draft.add_action(Op.CREATE, c.RAYSERVICE_KIND, names.service, builders.build_rayservice(tft, source))
    draft.status = replace(draft.status, children=replace(draft.children, ray_service=names.service),
                           serving=_serving_status(draft, tft, source))
    msg = (f"training complete; deploying {tft.meta.name} with {serve.engine.value} on {shape.generation} "
           f"{shape.topology} x{serve.replicas} (RayService {names.service}; RayCluster {names.cluster} released"
           + (" once its RayJobs are gone)" if holding else ")"))
    draft.set_condition(Condition.SERVING, ConditionStatus.FALSE, Reason.DEPLOYING, msg)
    draft.move_to(Phase.SERVING, Reason.DEPLOYING, msg)
    draft.requeue_after(serve.timeout_seconds)
    return draft.finish()


def _serving_status(draft: _Draft, tft: TPUFinetune, source: str) -> Serving:
    """status.serving when the RayService is created: where clients reach it, what it serves."""
    names, serve = builders.names(tft), tft.spec.serve
    assert serve is not None, "serving needs spec.serve enabled"
    return Serving(service=names.serve_service, port=c.SERVE_PORT, model=tft.meta.name,
                   url=f"http://{names.serve_service}.{tft.meta.namespace}.svc:{c.SERVE_PORT}",
                   engine=serve.engine.value, model_source=source, not_ready_since=fmt_time(draft.now),
                   adapters_root=builders.adapters_root(tft) if serve.adapters is not None else None)


def _serve_as_is(draft: _Draft, obj: Mapping, tft: TPUFinetune) -> Decision:
    """training.method none: no training cluster, no verification; spec.model is served as it is, on
    the serve slice, from the first reconcile (a base for LoRA adapters, spec.serve.adapters)."""
    names, serve = builders.names(tft), tft.spec.serve
    assert serve is not None, "training.method none needs spec.serve enabled (tpuft.api.spec)"
    for body in [*builders.build_workload_identity(tft), builders.build_network_policy(tft)]:
        draft.add_action(Op.CREATE, body["kind"], body["metadata"]["name"], body)
    draft.add_action(Op.CREATE, c.RAYSERVICE_KIND, names.service, builders.build_rayservice(tft))
    draft.status = replace(
        draft.status, applied_generation=draft.status.applied_generation or draft.generation,
        applied_spec=copy.deepcopy(draft.status.applied_spec or dict(obj.get("spec") or {})),
        children=Children(ray_service=names.service, service_account=builders.service_account(tft)),
        serving=_serving_status(draft, tft, tft.spec.model),
        adapters=Adapters(count=0) if serve.adapters is not None else None)
    skipped = f"spec.training.method is {c.TrainingMethod.NONE.value}: {tft.spec.model} is served as it is"
    draft.set_condition(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, Reason.VERIFICATION_SKIPPED, skipped)
    draft.set_condition(Condition.TRAINING_SUCCEEDED, ConditionStatus.FALSE, Reason.NOT_TRAINED, skipped)
    msg = (f"deploying {tft.spec.model} as {tft.meta.name} with {serve.engine.value} on {serve.slice.generation} "
           f"{serve.slice.topology} x{serve.replicas} (RayService {names.service}; nothing trained)")
    draft.set_condition(Condition.SERVING, ConditionStatus.FALSE, Reason.DEPLOYING, msg)
    draft.move_to(Phase.SERVING, Reason.DEPLOYING, msg)
    draft.requeue_after(serve.timeout_seconds)
    return draft.finish()


def _serving(draft: _Draft, tft: TPUFinetune, obs: Observed, live_serve: bool, tunables: Tunables) -> Decision:
    """The RayService until spec.serve.enabled goes false (-> Succeeded) or its app stays short of
    RUNNING for spec.serve.timeoutSeconds (-> Failed/ServeFailed, in the app's own words)."""
    names, serve = builders.names(tft), tft.spec.serve
    assert serve is not None, "serving needs spec.serve enabled"
    # the training slice goes once no RayJob holds it
    if obs.cluster is not None and not _release(draft, obs, draft.seconds_in_phase(), tunables):
        draft.add_action(Op.DELETE, c.RAYCLUSTER_KIND, names.cluster)
    if not live_serve:
        if obs.service is not None:
            draft.add_action(Op.DELETE, c.RAYSERVICE_KIND, names.service)
        draft.status = replace(draft.status, serving=None)
        msg = f"training complete; serving stopped (spec.serve.enabled is false: RayService {names.service} deleted)"
        draft.set_condition(Condition.SERVING, ConditionStatus.FALSE, Reason.SERVE_STOPPED, msg)
        draft.move_to(Phase.SUCCEEDED, Reason.SERVE_STOPPED, msg)
        return draft.finish()
    if obs.service is None:
        draft.fail(Reason.CHILD_DELETED, f"RayService {names.service} was deleted while serving; recreate the "
                   "TPUFinetune (with spec.checkpoint.resumeFrom to skip training) to serve again")
        return draft.finish()
    serving = draft.status.serving or Serving()
    if serve.adapters is not None:
        serving = _base_adapters(draft, tft, obs, serving)
    if service_ready(obs.service.status):
        serving = serving.ready()
        draft.status = replace(draft.status, serving=serving)
        msg = f"serving model {serving.model} at {serving.url} (OpenAI-compatible /v1)"
        draft.set_condition(Condition.SERVING, ConditionStatus.TRUE, Reason.SERVING, msg)
        draft.serving_ready = True
        draft.move_to(Phase.SERVING, Reason.SERVING, msg)
        return draft.finish()
    since = parse_time(serving.not_ready_since) or draft.now
    draft.status = replace(draft.status, serving=serving.not_ready(fmt_time(since)))
    progress = f"RayService {names.service}: {service_progress(obs.service.status)}"
    found = blocking(obs.pods)
    if found:
        progress += f"; {found[1]}"
        if found[1] not in (draft.previous.message or ""):
            draft.add_event(EventType.WARNING, Reason.SLICE_BLOCKED, found[1])
    waited = (draft.now - since).total_seconds()
    if waited >= serve.timeout_seconds:
        msg = f"the Serve app was not RUNNING within spec.serve.timeoutSeconds ({serve.timeout_seconds}s): {progress}"
        draft.set_condition(Condition.SERVING, ConditionStatus.FALSE, Reason.SERVE_FAILED, msg)
        draft.fail(Reason.SERVE_FAILED, msg)
        return draft.finish()
    draft.set_condition(Condition.SERVING, ConditionStatus.FALSE, Reason.DEPLOYING, progress)
    draft.move_to(Phase.SERVING, Reason.DEPLOYING, f"deploying: {progress}")
    draft.requeue_after(serve.timeout_seconds - waited)
    return draft.finish()


# --- adapters on a shared base (tpuft.controller.publishing judges, these act) -----------------------------------------
BASE_POLL_SECONDS = 30.0   # how often a fine-tune waiting for its base looks again (the base's events come too)
PUBLISH_POLL_SECONDS = 10.0
# status.serving.reason of a fine-tune with spec.publish that no longer changes by itself.
PUBLISH_SETTLED = (Reason.SUPERSEDED.value, Reason.PUBLISH_FAILED.value)


def _publication(draft: _Draft, tft: TPUFinetune, obs: Observed) -> None:
    """Succeeded with spec.publish: the adapter is published on the base's serving cluster when the
    base serves (same model, room for adapters) and the gate lets it (tpuft.controller.publishing.gate); else
    status.serving says why. Each state is the Serving condition and the Succeeded phase's reason."""
    publish, adapter, names = tft.spec.publish, tft.adapter_name, builders.names(tft)
    assert publish is not None and adapter is not None, "_publication needs spec.publish"
    previous = draft.status.serving or Serving()
    serving = replace(previous, base=publish.to, adapter=adapter, model=f"{publish.to}:{adapter}")

    def say(reason: Reason, message: str, now: Serving | None = None, served: bool = False) -> None:
        draft.status = replace(draft.status, serving=replace(now or serving, reason=reason.value, message=message))
        draft.set_condition(Condition.SERVING, ConditionStatus.of(served), reason, message)
        if previous.reason != reason.value and reason != Reason.PUBLISHING:   # its event says why, once
            draft.add_event(EventType.WARNING if reason in (Reason.PUBLISH_FAILED, Reason.BASE_MISMATCH)
                            else EventType.NORMAL, reason, message)
        draft.move_to(Phase.SUCCEEDED, reason, message)

    record, base = serving.published, obs.base
    if serving.reason == Reason.PUBLISHED.value and record is not None:
        later = publishing.newer(obs.published, adapter, tft.meta.uid, record.published_at or "", tft.meta.ref)
        if later is not None:
            say(Reason.SUPERSEDED, f"superseded by {later.source} (published as {serving.model} at "
                                   f"{later.published_at}); this adapter is no longer served", replace(serving, published=None))
            return
        # A base recreated under the same name has a new run directory: its adapters root is empty.
        moved = base is not None and base.adapters_root not in (None, serving.adapters_root)
        if base is not None and base.serving_ready and not moved:
            say(Reason.PUBLISHED, f"served by {publish.to} as model {serving.model}", served=True)
            return
        serving = replace(serving, published=None, adapters_root=None)   # published again below, once it serves
    if serving.reason in PUBLISH_SETTLED:
        return
    job_name = draft.children.publish_job
    job = obs.jobs.get(job_name) if job_name else None
    if job is not None and job_succeeded(job):
        draft.add_action(Op.DELETE, c.RAYJOB_KIND, job.name)
        draft.status = replace(draft.status, children=replace(draft.children, publish_job=None))
        published = Publication(eval_loss=publishing.eval_loss(tft, draft.status.training), eval_set=tft.spec.eval_set,
                                published_at=fmt_time(draft.now))
        say(Reason.PUBLISHED, f"served by {publish.to} as model {serving.model}",
            replace(serving, published=published, adapters_root=base.adapters_root if base else None), served=True)
        return
    if job is not None and job_failed(job):
        draft.add_action(Op.DELETE, c.RAYJOB_KIND, job.name)
        draft.status = replace(draft.status, children=replace(draft.children, publish_job=None))
        say(Reason.PUBLISH_FAILED, f"publishing to {publish.to} failed: {job_failure_detail(job, '')}; recreate the "
                                   "TPUFinetune (spec.checkpoint.resumeFrom skips training) to publish again")
        return
    if job is not None:
        draft.requeue_after(PUBLISH_POLL_SECONDS)
        say(Reason.PUBLISHING, _publishing_says(publish.to, serving, job.name))
        return
    if base is None or not base.serving_ready or not base.ray_cluster or not base.adapters_root:
        what = "does not exist" if base is None else "is not Serving"
        draft.requeue_after(BASE_POLL_SECONDS)
        say(Reason.BASE_NOT_SERVING, f"training complete; the base {tft.meta.namespace}/{publish.to} {what}: the "
                                     "adapter is published once it serves")
        return
    mismatch = publishing.base_mismatch(tft, base)
    if mismatch:
        say(Reason.BASE_MISMATCH, mismatch)
        return
    loss, eval_set = publishing.eval_loss(tft, draft.status.training), tft.spec.eval_set
    verdict = publishing.gate(publish.when, publish.margin, loss, eval_set,
                              publishing.served(obs.published, adapter, tft.meta.uid))
    if not verdict.promote:
        say(Reason.NOT_PROMOTED, f"kept unpublished: {verdict.message}")
        return
    training = draft.status.training
    export = (training.exported_model if training else None) or builders.export_path(tft)
    body = builders.build_publish_job(tft, publish.to, base.ray_cluster, base.adapters_root, export, loss, eval_set)
    draft.add_action(Op.CREATE, c.RAYJOB_KIND, names.publish_job, body)
    draft.status = replace(draft.status, children=replace(draft.children, publish_job=names.publish_job))
    draft.requeue_after(PUBLISH_POLL_SECONDS)
    draft.add_event(EventType.NORMAL, Reason.PUBLISHING, f"publishing to {publish.to} as {serving.model}: "
                    f"{verdict.message} (RayJob {names.publish_job} on RayCluster {base.ray_cluster})")
    say(Reason.PUBLISHING, _publishing_says(publish.to, serving, names.publish_job))


def _publishing_says(base: str, serving: Serving, job: str) -> str:
    """The same words while the publish RayJob runs: one status write for the whole of it."""
    return f"publishing the adapter to {base} as model {serving.model} (RayJob {job})"


def _base_adapters(draft: _Draft, tft: TPUFinetune, obs: Observed, serving: Serving) -> Serving:
    """A base (spec.serve.adapters): status.adapters from the fine-tunes whose status.serving says they
    are published here (obs.published), the RayService's cluster publishing runs on, and the adapter of
    a fine-tune that was deleted removed by an unpublish RayJob on that cluster (one at a time; the
    workload removes a folder only while its marker names that fine-tune's uid)."""
    assert obs.service is not None
    cluster = (obs.service.status.get("activeServiceStatus") or {}).get("rayClusterName") or serving.ray_cluster
    serving = replace(serving, ray_cluster=cluster, adapters_root=builders.adapters_root(tft))
    served = publishing.latest_per_adapter(obs.published)
    entries = [Adapter(name=p.adapter, model=f"{tft.meta.name}:{p.adapter}", source=p.source, uid=p.uid,
                       eval_loss=p.eval_loss, published_at=p.published_at) for p in served]
    held = {p.adapter for p in served}
    previous = (draft.status.adapters.served if draft.status.adapters else None) or ()
    gone = [replace(a, unpublishing=True) for a in previous
            if a.name not in held and a.uid and a.uid not in obs.live_uids]
    running = draft.children.unpublish_job
    job = obs.jobs.get(running) if running else None
    if running and (job is None or job_settled(job) or job_failed(job)):
        done = next((a for a in gone if builders.unpublish_job_name(tft.meta.name, a.name or "", a.uid or "")
                     == running), None)
        if job is not None:
            draft.add_action(Op.DELETE, c.RAYJOB_KIND, running)
            if job_failed(job) and done is not None:
                draft.add_event(EventType.WARNING, Reason.UNPUBLISHING, f"RayJob {running} could not remove adapter "
                                f"{done.name} from {serving.adapters_root}: {job_failure_detail(job, '')}")
        gone = [a for a in gone if a is not done]
        running = None
    if running is None and gone and cluster:
        first = gone[0]
        body = builders.build_unpublish_job(tft, cluster, first.name or "", first.uid or "")
        running = body["metadata"]["name"]
        draft.add_action(Op.CREATE, c.RAYJOB_KIND, running, body)
        draft.add_event(EventType.NORMAL, Reason.UNPUBLISHING, f"{first.source} was deleted: removing its adapter "
                        f"{first.name} (RayJob {running})")
    if running is not None:
        draft.requeue_after(PUBLISH_POLL_SECONDS)
    draft.status = replace(draft.status, children=replace(draft.children, unpublish_job=running),
                           adapters=Adapters(count=len(entries), served=tuple(entries + gone) or None))
    return serving


def wants_serve_pods(obj: Mapping[str, Any]) -> bool:
    """Serving and not (yet) ready: the serving cluster's pods say why (image pull, scheduling)."""
    status = obj.get("status") or {}
    return status.get("phase") == Phase.SERVING.value and not serving_ready(status)


# --- Kueue: Queued, admitted, preempted ----------------------------------------------------------------
# A run waiting to be admitted again after it lost its slice to Kueue (preempted, or a booking lost).
PREEMPTED_REASONS = (Reason.PREEMPTED.value, Reason.REQUEUING.value)


def queue_name(tft: TPUFinetune) -> str | None:
    """The LocalQueue the object asks Kueue for (its kueue.x-k8s.io/queue-name label), or None."""
    return tft.meta.labels.get(c.KUEUE_QUEUE_LABEL) or None


def wants_queue(obj: Mapping[str, Any], cluster: ClusterObs | None) -> bool:
    """Whether the handler should read Kueue's Workload for this reconcile: an object with a queue
    label whose RayCluster exists, while Queued, or when that RayCluster is suspended outside
    Suspended (an eviction: the message says Kueue's reason)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if not labels.get(c.KUEUE_QUEUE_LABEL) or cluster is None:
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
        draft.add_action(Op.CREATE, c.RAYCLUSTER_KIND, names.cluster, builders.build_raycluster(tft))
        if draft.previous.reason == Reason.REQUEUING.value:   # we deleted it: a new Workload, back in the queue
            draft.move_to(Phase.QUEUED, Reason.PREEMPTED, f"RayCluster {names.cluster} made again after the lost "
                          f"booking; waiting for Kueue to admit it (LocalQueue {queue}); checkpoints kept")
            draft.requeue_after(c.QUEUE_POLL_SECONDS)
            return draft.finish()
        draft.add_event(EventType.WARNING, Reason.CHILD_DELETED,
                        f"RayCluster {names.cluster} not found while queued; recreating it")
    if kueue is not None and not kueue.installed:
        msg = (f"label {c.KUEUE_QUEUE_LABEL}={queue} but Kueue is not installed (no {c.KUEUE_GROUP}/"
               f"{c.KUEUE_VERSION} Workload API): nothing queues this run, it provisions right away; install "
               "Kueue, or remove the label")
        draft.set_condition(Condition.ADMITTED, ConditionStatus.FALSE, Reason.KUEUE_NOT_INSTALLED, msg)
        draft.add_event(EventType.WARNING, Reason.KUEUE_NOT_INSTALLED, msg)
        return _admitted(draft, tft, obs, f"not queued ({c.KUEUE_QUEUE_LABEL}={queue}, Kueue not installed)")
    admitted = obs.cluster is not None and not obs.cluster.suspended
    if obs.jobs:   # a preempted run's RayJobs: stopped once KubeRay has deleted its pods, gone before it runs again
        gone = obs.cluster is None or cluster_suspended(obs.cluster.status)
        if gone or admitted or draft.seconds_in_phase() >= c.PREEMPTION_STOP_SECONDS:
            for name in sorted(obs.jobs):
                draft.add_action(Op.DELETE, c.RAYJOB_KIND, name)
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
        draft.add_action(Op.DELETE, c.RAYCLUSTER_KIND, names.cluster)
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
        draft.add_action(Op.SUSPEND, c.RAYCLUSTER_KIND, names.cluster)
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
            draft.add_action(Op.SUSPEND, c.RAYCLUSTER_KIND, names.cluster)
            draft.set_condition(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED,
                                "RayCluster suspended")
        return draft.finish()
    if obs.cluster is not None:
        draft.add_action(Op.RESUME, c.RAYCLUSTER_KIND, names.cluster)
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
    left_over = [(kind, x.name) for kind, x in ((c.RAYCLUSTER_KIND, obs.cluster), (c.RAYSERVICE_KIND, obs.service))
                 if x is not None]
    if left_over and done is not None:
        left = ttl - (draft.now - done).total_seconds()
        if left <= 0:
            for kind, name in left_over:
                if kind == c.RAYCLUSTER_KIND and _release(draft, obs, -left, tunables):
                    continue   # its RayJobs go first
                draft.add_action(Op.DELETE, kind, name)
                draft.add_event(EventType.NORMAL, Reason.TTL_EXPIRED, f"deleting {kind} {name}: "
                                f"ttlSecondsAfterFinished ({ttl}s) has passed; status and checkpoints stay")
        else:
            draft.requeue_after(left)
    return draft.finish()


# --- a RayCluster's RayJobs go before it does ----------------------------------------------------------
def _finishing(draft: _Draft, job: JobObs, ctype: Condition, then: str, tunables: Tunables) -> bool:
    """The job's outcome is known (ctype, just set, says it) but KubeRay has not finished its RayJob
    yet (observed.job_finishing): the phase stays, reason FinishingRayJob, until it has, for at
    most the grace from when ctype took its status. Past it the RayJob is deleted, so it and its
    submitter are gone before its RayCluster goes. True while waiting."""
    if not job_finishing(job):
        return False
    grace = tunables.rayjob_grace_seconds
    before = next((x for x in draft.previous.conditions or () if x.type == ctype.value), None)
    since = (parse_time(before.last_transition_time)
             if before is not None and before.status == draft.conditions[ctype][0] else None)
    waited = (draft.now - since).total_seconds() if since else 0.0
    if waited < grace:
        draft.move_to(draft.phase or Phase.PENDING, Reason.FINISHING_RAYJOB,
                      f"RayJob {job.name}: the job is {job.status.get('jobStatus')}; waiting for KubeRay to finish "
                      f"the RayJob (its submitter to exit) before {then}")
        draft.requeue_after(grace - waited)
        return True
    draft.add_action(Op.DELETE, c.RAYJOB_KIND, job.name)
    draft.add_event(EventType.WARNING, Reason.FINISHING_RAYJOB, f"KubeRay did not finish RayJob {job.name} within "
                    f"{grace:g}s of its job ending ({job_state(job)}); deleting it before its RayCluster goes")
    return False


def _release(draft: _Draft, obs: Observed, waited: float, tunables: Tunables,
             stop: frozenset[str] = frozenset()) -> list[str]:
    """Before a RayCluster goes (deleted or suspended) every RayJob on it is finished or gone: a
    submitter still following its job's logs when the head goes fails (its K8s Job ends Failed,
    the RayJob never Complete). A RayJob KubeRay is finishing may take the grace; the other
    unfinished ones, and those in `stop`, are deleted now (KubeRay's finalizer stops a Ray job
    still running while the head is up; the submitter Job goes with its RayJob). Returns the
    RayJobs still holding the cluster `waited` seconds after it was to go: none past twice the
    grace (KubeRay has not let them go: the cluster goes anyway)."""
    grace = tunables.rayjob_grace_seconds
    elsewhere = {draft.children.publish_job, draft.children.unpublish_job}   # on a base's serving cluster
    holding = set(obs.jobs_deleting) - elsewhere
    for name, job in sorted(obs.jobs.items()):
        if name in holding or name in elsewhere or (name not in stop and job_settled(job)):
            continue
        if name in stop or not (job_finishing(job) and waited < grace):
            draft.add_action(Op.DELETE, c.RAYJOB_KIND, name)
        holding.add(name)
    if not holding or waited >= 2 * grace:
        return []
    draft.requeue_after((grace if waited < grace else 2 * grace) - waited)
    return sorted(holding)


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
