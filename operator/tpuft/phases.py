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
  * While the slice comes up, the first blocking cause its pods show (tpuft.diagnosis: image
    pull, container config, crash loop, the scheduler's reason) is in status.message and the
    SliceProvisioned condition, and a SliceBlocked event is posted once per new cause; the
    ProvisioningTimeout message carries it. A re-created object waits (Pending,
    WaitingForPrevious) until the deleted one's RayCluster and pods are gone.
  * status.goodput (tpuft.goodput): each time phaseTransitionTime moves, the seconds since the
    previous one go to the cause they were spent on (provisioning, verification, training,
    recovery, suspended); ratio = training / total.
"""
from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any, Mapping

from tpuft import builders, goodput
from tpuft import constants as c
from tpuft.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.diagnosis import Blocker, blocking, pool_hint
from tpuft.spec import DEFAULTS, SpecError, TPUFinetune, parse
from tpuft.observed import (
    CONDITION_ORDER, SERVE_ENABLED_FIELD, Action, ClusterObs, Decision, Event, JobObs, Observed, Op, QueueObs, Tunables,
    cluster_progress, cluster_provisioned, cluster_suspended, fmt_time, job_failed, job_failure_detail, job_finishing,
    job_lost, job_settled, job_state, job_succeeded, owned, parse_time, service_progress, service_ready, serving_ready,
    slice_loss, spec_diff)


# --- the draft status ---------------------------------------------------------------------------
class _Draft:
    def __init__(self, obj: Mapping, now: datetime):
        self.prev = owned(obj.get("status"))
        self.st = copy.deepcopy(self.prev)
        self.now = now
        self.generation = int((obj.get("metadata") or {}).get("generation") or 0)
        self.conds: dict[Condition, tuple[ConditionStatus, str, str]] = {}
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.requeue: float | None = None
        self.ignored: dict | None = None   # status.ignoredSpecChange, when a spec edit is not applied
        self.ttl = 0
        self.reason: Reason | None = None  # the last go() of this reconcile
        self.serving_ready = False         # Serving with the app RUNNING: Ready is True
        try:
            self.phase: Phase | None = Phase(self.prev["phase"]) if self.prev.get("phase") else None
        except ValueError:
            self.phase = None

    def elapsed(self) -> float:
        t = parse_time(self.st.get("phaseTransitionTime"))
        return (self.now - t).total_seconds() if t else 0.0

    def wake(self, seconds: float) -> None:
        seconds = max(seconds, 0.5)
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def cond(self, ctype: Condition, status: ConditionStatus, reason: Reason | str, message: str = "") -> None:
        """reason: a Reason, or the status.reason string the overall conditions mirror."""
        self.conds[ctype] = (status, reason.value if isinstance(reason, Reason) else reason, message)

    def act(self, op: Op, kind: str, name: str, body: Mapping | None = None) -> None:
        self.actions.append(Action(op, kind, name, body))

    def event(self, type_: EventType, reason: Reason, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def go(self, phase: Phase, reason: Reason, message: str) -> None:
        if self.st.get("phase") != phase.value:
            self.st["phaseTransitionTime"] = fmt_time(self.now)
            self.phase = phase
        self.st["phase"], self.st["reason"], self.st["message"] = phase.value, reason.value, message
        self.reason = reason
        if phase.terminal and not self.st.get("completionTime"):
            self.st["completionTime"] = fmt_time(self.now)
            self.wake(self.ttl)

    def fail(self, reason: Reason, message: str) -> None:
        self.go(Phase.FAILED, reason, message)

    def finish(self) -> Decision:
        st, prev = self.st, self.prev
        st["observedGeneration"] = self.generation
        st.setdefault("startTime", fmt_time(self.now))
        since, until = parse_time(prev.get("phaseTransitionTime")), parse_time(st.get("phaseTransitionTime"))
        if since != until:   # an interval closed: its seconds go to the cause it was spent on
            spent = goodput.account(st.get("goodput"), prev.get("phase"), prev.get("reason"), since, until)
            if spent is not None:
                st["goodput"] = spent
        if self.ignored is not None:
            st["ignoredSpecChange"] = self.ignored
        else:
            st.pop("ignoredSpecChange", None)
        phase, reason = st.get("phase"), st.get("reason") or ""
        pending = Reason.PENDING.value
        ready = phase == Phase.SUCCEEDED.value or (phase == Phase.SERVING.value and self.serving_ready)
        self.cond(Condition.READY, ConditionStatus.of(ready), reason or pending, st.get("message") or "")
        self.cond(Condition.FAILED, ConditionStatus.of(phase == Phase.FAILED.value), reason or pending,
                  (st.get("message") or "") if phase == Phase.FAILED.value else "")
        old = {x.get("type"): x for x in prev.get("conditions") or []}
        conds = []
        for ctype in CONDITION_ORDER:
            if ctype in (Condition.SERVING, Condition.ADMITTED) and ctype not in self.conds and ctype.value not in old:
                continue   # only objects that serve carry Serving; only queued ones (Kueue) Admitted
            if ctype in self.conds:
                cstatus, creason, cmsg = self.conds[ctype]
                status = cstatus.value
            elif ctype.value in old:
                o = old[ctype.value]
                status, creason, cmsg = o.get("status"), o.get("reason"), o.get("message")
            else:
                status, creason, cmsg = ConditionStatus.UNKNOWN.value, reason or pending, ""
            before = old.get(ctype.value) or {}
            ltt = before.get("lastTransitionTime") if before.get("status") == status else None
            conds.append({"type": ctype.value, "status": status, "reason": creason or ConditionStatus.UNKNOWN.value,
                          "message": cmsg or "", "lastTransitionTime": ltt or fmt_time(self.now),
                          "observedGeneration": self.generation})
        st["conditions"] = conds
        if prev.get("phase") != phase:
            # a lost host sends the run back to Provisioning: news, not progress
            etype = (EventType.WARNING if phase == Phase.FAILED.value or self.reason in (Reason.REPLACING_SLICE,
                                                                                         Reason.PREEMPTED)
                     else EventType.NORMAL)
            self.events.insert(0, Event(etype, self.reason or Reason(reason), f"{phase}: {st.get('message') or ''}"))
        patch = _merge_patch(prev, st)
        return Decision(status=st, patch=patch, actions=tuple(self.actions), events=tuple(self.events),
                        requeue_after=self.requeue)


def _merge_patch(prev: Mapping, new: Mapping) -> dict | None:
    """The JSON merge patch (RFC 7386, what the status write sends) that turns prev into new:
    changed keys with their new values, removed keys as null, at every depth (a key dropped
    from a nested object, e.g. status.serving.notReadySince, is removed only by an explicit null)."""
    def value(before: Any, after: Any) -> Any:
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            return {**after, **{k: None for k in before if k not in after},
                    **{k: value(before[k], v) for k, v in after.items() if k in before}}
        return after
    patch = {k: value(prev.get(k), v) for k, v in new.items() if prev.get(k) != v}
    patch.update({k: None for k in prev if k not in new})
    return patch or None


# --- decide ----------------------------------------------------------------------------------------
def decide(obj: Mapping[str, Any], observed: Observed, now: datetime, tun: Tunables = Tunables()) -> Decision:
    d = _Draft(obj, now)
    spec_raw = obj.get("spec") or {}
    try:
        current: TPUFinetune | None = parse(obj)
        error: SpecError | None = None
    except SpecError as e:
        current, error = None, e
    applied_raw = d.prev.get("appliedSpec")
    ttl = spec_raw.get("ttlSecondsAfterFinished")  # live: read from the current spec
    d.ttl = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else DEFAULTS["ttlSecondsAfterFinished"]

    if applied_raw is None:  # nothing created yet: the current spec is the one that counts
        # A failure before anything was applied (invalid spec, rejected at admission) is final for
        # that generation only: editing the spec starts the run again.
        restart = d.phase == Phase.FAILED and d.prev.get("observedGeneration") != d.generation
        if d.phase is not None and d.phase.terminal and not restart:
            return d.finish()
        if error is not None:
            msg = "invalid spec: " + "; ".join(str(p) for p in error.problems)
            if d.phase == Phase.FAILED and d.prev.get("message") != msg:
                d.event(EventType.WARNING, Reason.INVALID_SPEC, msg)
            d.fail(Reason.INVALID_SPEC, msg)
            return d.finish()
        if restart:
            for k in ("phase", "reason", "message", "completionTime", "phaseTransitionTime", "conditions",
                      "startTime", "goodput"):
                d.st.pop(k, None)
            d.phase = None
        assert current is not None   # no error: it parsed
        return _pending(d, obj, current, observed)

    try:
        tft = parse({**obj, "spec": applied_raw})
    except SpecError as e:  # e.g. an operator upgrade dropped a shape this run was started with
        if not (d.phase and d.phase.terminal):
            d.fail(Reason.INVALID_SPEC, "the applied spec no longer validates: " + "; ".join(map(str, e.problems)))
        return d.finish()
    live_suspend = flag if isinstance(flag := spec_raw.get("suspend"), bool) else tft.spec.suspend
    live_serve = _live_serve(spec_raw, tft)
    ignored = spec_diff(spec_raw, applied_raw)
    if tft.spec.serve and not live_serve:   # turning serving off acts live; turning it on mid-run does not
        ignored = [f for f in ignored if f != SERVE_ENABLED_FIELD]
    if ignored or error is not None:
        d.ignored = _ignored_change(d, ignored, error)
        if d.prev.get("observedGeneration") != d.generation:
            d.event(EventType.WARNING, Reason.SPEC_CHANGE_IGNORED, d.ignored["message"])
    if d.phase is not None and d.phase.terminal:
        return _terminal(d, tft, observed, tun)
    if observed.admission_error is not None:
        rej = observed.admission_error
        d.fail(Reason.ADMISSION_REJECTED, f"{rej.kind} {rej.name} was rejected at admission: {rej.message}")
        return d.finish()
    if d.phase == Phase.SERVING:
        return _serving(d, tft, observed, live_serve, tun)
    if live_suspend and d.phase != Phase.SUSPENDED:
        return _suspend(d, tft, observed, tun)
    if d.phase == Phase.SUSPENDED:
        return _suspended(d, tft, observed, live_suspend, tun)
    if d.phase in (None, Phase.PENDING):  # created but status lost: the creates are idempotent
        return _pending(d, obj, tft, observed)
    if d.phase == Phase.QUEUED:
        return _queued(d, tft, observed)
    if d.phase == Phase.PROVISIONING:
        return _provisioning(d, obj, tft, observed)
    if d.phase == Phase.VERIFYING:
        return _verifying(d, obj, tft, observed, tun)
    return _training(d, obj, tft, observed, tun, live_serve)


def _live_serve(spec_raw: Mapping, tft: TPUFinetune) -> bool:
    """Whether to serve: the applied spec enables it and the current spec has not turned it off."""
    enabled = (spec_raw.get("serve") or {}).get("enabled") if isinstance(spec_raw.get("serve"), Mapping) else None
    return tft.spec.serve is not None and (enabled if isinstance(enabled, bool) else True)


def _ignored_change(d: _Draft, ignored: list[str], error: SpecError | None) -> dict:
    """status.ignoredSpecChange: the edit this run does not apply, and how to apply it."""
    what = ", ".join(ignored[:6]) + (" ..." if len(ignored) > 6 else "")
    if error is not None:
        what = f"new spec is invalid ({error.problems[0]})" + (f"; changed: {what}" if what else "")
    message = (f"spec change ignored: {what}; the run uses generation {d.prev.get('appliedGeneration')}'s spec "
               "(delete and recreate the TPUFinetune to apply it)")
    return {"observedGeneration": d.generation, "fields": ignored, "valid": error is None, "message": message}


def _pending(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed) -> Decision:
    if obs.admission_error is not None:
        e = obs.admission_error
        d.fail(Reason.ADMISSION_REJECTED, f"{e.kind} {e.name} was rejected at admission: {e.message}")
        return d.finish()
    if d.phase == Phase.PENDING and d.elapsed() >= tft.spec.provisioning_timeout_seconds:
        d.st.setdefault("trainingAttempts", 0)  # the same status shape as a timeout after the creates
        d.fail(Reason.PROVISIONING_TIMEOUT, f"children could not be created within "
               f"{tft.spec.provisioning_timeout_seconds}s: {d.prev.get('message') or 'no detail'}")
        return d.finish()
    n, s = builders.names(tft), tft.spec.slice
    if obs.leftovers:
        return _wait_for_previous(d, tft, obs)
    # The NetworkPolicy before the RayCluster, so that no Ray pod starts unprotected where it is enforced.
    for body in [*builders.build_workload_identity(tft), builders.build_network_policy(tft)]:
        d.act(Op.CREATE, body["kind"], body["metadata"]["name"], body)
    d.act(Op.CREATE, c.RAYCLUSTER_KIND, n.cluster, builders.build_raycluster(tft))
    d.st.update({
        "appliedGeneration": d.st.get("appliedGeneration") or d.generation,
        "appliedSpec": copy.deepcopy(d.st.get("appliedSpec") or dict(obj.get("spec") or {})),
        "children": {"rayCluster": n.cluster, "serviceAccount": n.identity}, "trainingAttempts": 0,
        "slice": {"accelerator": s.generation, "topology": s.topology, "slices": tft.spec.slices,
                  "hosts": s.hosts, "chipsPerHost": s.chips_per_host, "devicesPerHost": s.devices_per_host,
                  "devices": tft.spec.num_workers, "rayAcceleratorType": s.ray_accelerator_type or ""}})
    progress = cluster_progress(tft, ClusterObs(n.cluster))  # what the next reconcile will see: no write then
    _initial_conditions(d, tft, progress)
    if tft.spec.suspend:
        d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED, "created suspended")
        d.go(Phase.SUSPENDED, Reason.SUSPENDED, f"RayCluster {n.cluster} created suspended (spec.suspend)")
    elif queue_name(tft):
        msg = f"waiting for Kueue to admit RayCluster {n.cluster} (LocalQueue {queue_name(tft)})"
        d.cond(Condition.ADMITTED, ConditionStatus.FALSE, Reason.QUEUED, msg)
        d.go(Phase.QUEUED, Reason.QUEUED, msg)
        d.wake(c.QUEUE_POLL_SECONDS)
    else:
        d.go(Phase.PROVISIONING, Reason.WAITING_FOR_SLICE, f"waiting for slice {s.generation} {s.topology}: {progress}")
        d.wake(tft.spec.provisioning_timeout_seconds)
    return d.finish()


def _wait_for_previous(d: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    """KubeRay selects a RayCluster's pods by name label alone: a new RayCluster created while
    the deleted object's pods are still terminating takes its old head for its own (and Ray
    jobs then fail on a head node that is gone). Wait, briefly, until they are."""
    shown = ", ".join(obs.leftovers[:4]) + (f" and {len(obs.leftovers) - 4} more" if len(obs.leftovers) > 4 else "")
    d.go(Phase.PENDING, Reason.WAITING_FOR_PREVIOUS, f"waiting for an earlier {c.KIND} {tft.meta.namespace}/"
         f"{tft.meta.name}'s children to be deleted before creating RayCluster {builders.names(tft).cluster}: "
         f"{shown}")
    d.wake(c.LEFTOVER_POLL_SECONDS)
    return d.finish()


def _initial_conditions(d: _Draft, tft: TPUFinetune, progress: str) -> None:
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.WAITING_FOR_SLICE, progress)
    if tft.spec.verification.enabled:
        d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, Reason.WAITING_FOR_SLICE, "")
    else:
        d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, Reason.VERIFICATION_SKIPPED, "spec.verification.enabled is false")
    d.cond(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, Reason.WAITING_FOR_SLICE, "")
    if tft.spec.serve:
        d.cond(Condition.SERVING, ConditionStatus.UNKNOWN, Reason.WAITING_FOR_SLICE, "serves once training succeeds")


def _provisioning(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed) -> Decision:
    n, s, timeout = builders.names(tft), tft.spec.slice, tft.spec.provisioning_timeout_seconds
    if obs.cluster is None and not obs.leftovers:
        body = builders.build_raycluster(tft)
        body["spec"].pop("suspend", None)
        d.act(Op.CREATE, c.RAYCLUSTER_KIND, n.cluster, body)
        d.event(EventType.WARNING, Reason.CHILD_DELETED, f"RayCluster {n.cluster} not found while provisioning; "
                "recreating it (the provisioning deadline is unchanged)")
    if _evicted(tft, obs):
        return _requeue(d, obj, tft, obs)
    ready = (obs.cluster is not None and cluster_provisioned(obs.cluster.status, obs.cluster.generation)
             and not slice_loss(obs.cluster.status))   # RayClusterProvisioned stays True after a loss
    if ready and not obs.jobs_deleting:
        d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.TRUE, Reason.SLICE_READY, cluster_progress(tft, obs.cluster))
        return _start_verification(d, tft) if tft.spec.verification.enabled else _start_training(d, tft, obs)
    progress = cluster_progress(tft, obs.cluster)
    if ready:   # after a replacement or a resume: KubeRay would take the old submitter Job (same name) for the new one's
        progress += (f"; waiting for RayJob {', '.join(obs.jobs_deleting)} (deleted before) to be gone before "
                     "submitting again")
    if obs.cluster is not None and obs.cluster.suspended:  # not by us, not Kueue's (no queue label): who?
        progress += "; the RayCluster is suspended, not by this operator (spec.suspend is false, no queue label)"
    found = blocking(obs.pods)
    cause = found[1] if found else None
    if found and found[0] == Blocker.UNSCHEDULABLE and obs.pools is not None and s.is_tpu:
        cause = f"{found[1]}; {pool_hint(obs.pools, s.gke_accelerator, s.topology, s.hosts, tft.spec.slices)}"
    if cause:
        progress += f"; {cause}"
        if cause not in (d.prev.get("message") or ""):   # once per new cause, not on every resync
            d.event(EventType.WARNING, Reason.SLICE_BLOCKED, cause)
    if d.elapsed() >= timeout:
        where = (f"a TPU node pool with {c.GKE_TPU_ACCELERATOR_SELECTOR}={s.gke_accelerator} and "
                 f"{c.GKE_TPU_TOPOLOGY_SELECTOR}={s.topology} ({s.hosts} hosts of {s.machine_type}) per slice"
                 if s.is_tpu else "schedulable CPU nodes")
        msg = (f"slice not provisioned after {timeout}s: {progress}; check {where} has capacity and quota, "
               f"and `kubectl describe raycluster {n.cluster}` / `kubectl get pods -l {c.RAY_CLUSTER_LABEL}={n.cluster}`")
        d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.PROVISIONING_TIMEOUT, msg)
        d.fail(Reason.PROVISIONING_TIMEOUT, msg)
        return d.finish()
    reason, what = Reason.WAITING_FOR_SLICE, f"waiting for slice {s.generation} {s.topology}"
    if d.prev.get("reason") == Reason.REPLACING_SLICE.value:   # keep saying why it is provisioning again
        reason = Reason.REPLACING_SLICE
        what = (f"replacing the slice ({(d.st.get('recovery') or {}).get('sliceReplacements')} of "
                f"{tft.spec.recovery.max_slice_replacements}): {what}")
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, reason, progress)
    d.go(Phase.PROVISIONING, reason, f"{what}: {progress}")
    d.wake(timeout - d.elapsed())
    return d.finish()


def wants_pods(obj: Mapping[str, Any]) -> bool:
    """Whether the handler should list the RayCluster's pods for this reconcile: while the slice
    is being created or is coming up (the only phases a stall cause or a leftover matters in)."""
    phase = owned(obj.get("status")).get("phase")
    return phase in (None, "", Phase.PENDING.value, Phase.PROVISIONING.value)


def _start_verification(d: _Draft, tft: TPUFinetune, reason: Reason = Reason.VERIFYING,
                        message: str | None = None) -> Decision:
    index = _lost_count(d, Phase.VERIFYING)   # a fresh name after each lost submission
    name = builders.names(tft).verify_attempt(index)
    d.act(Op.CREATE, c.RAYJOB_KIND, name, builders.build_verify_job(tft, index))
    d.st.setdefault("children", {})["verifyJob"] = name
    d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, reason, message or f"RayJob {name} submitted")
    d.go(Phase.VERIFYING, reason, message or f"verifying collectives on every device (RayJob {name})")
    return d.finish()


def _verify_job(d: _Draft, tft: TPUFinetune) -> str:
    """The current verification RayJob's name."""
    return builders.names(tft).verify_attempt(_lost_count(d, Phase.VERIFYING))


def _start_training(d: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    n = builders.names(tft)
    attempts = int(d.st.get("trainingAttempts") or 0)
    index = max(attempts - 1, 0)  # after a resume the interrupted attempt continues from its checkpoint
    d.act(Op.CREATE, c.RAYJOB_KIND, n.train_attempt(index), builders.build_train_job(tft, index))
    d.st["trainingAttempts"] = max(attempts, 1)
    d.st.setdefault("children", {})["trainJob"] = n.train_attempt(index)
    d.cond(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, Reason.TRAINING, f"RayJob {n.train_attempt(index)} submitted")
    d.go(Phase.TRAINING, Reason.TRAINING, f"training (RayJob {n.train_attempt(index)}, attempt {index + 1} of "
         f"{tft.spec.training.max_job_retries + 1})")
    return d.finish()


def _lost_cluster(d: _Draft, tft: TPUFinetune, obs: Observed) -> bool:
    if obs.cluster is not None:
        return False
    assert d.phase is not None   # a running phase's handler calls this
    d.fail(Reason.CHILD_DELETED, f"RayCluster {builders.names(tft).cluster} was deleted during {d.phase.value}; "
           "the run cannot continue (recreate the TPUFinetune to start again; checkpoints are kept)")
    return True


def _replace_slice(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed, cause: str) -> Decision:
    """A host was lost under a running job: stop the jobs (they cannot finish on a broken slice),
    let KubeRay recreate the lost pods, wait for the whole slice under a fresh provisioning
    deadline, verify it again and resume training from its checkpoint (the same attempt, as after
    a suspend). Past spec.recovery.maxSliceReplacements: Failed/SliceLost, with the history (the
    jobs are stopped then too: left on the broken slice, their submitters would fail)."""
    allowed, was = tft.spec.recovery.max_slice_replacements, d.phase
    assert was is not None and obs.cluster is not None   # _verifying and _training, past _lost_cluster
    rec = copy.deepcopy(d.st.get("recovery") or {})
    done = int(rec.get("sliceReplacements") or 0)
    st = obj.get("status") or {}
    entry = {"time": fmt_time(d.now), "phase": was.value, "cause": cause,
             "hostsReady": int(obs.cluster.status.get("readyWorkerReplicas") or 0),
             "hosts": tft.spec.slice.hosts * tft.spec.slices}
    if isinstance((st.get("training") or {}).get(c.TrainingStatus.STEP.value), int):
        entry["step"] = st["training"][c.TrainingStatus.STEP.value]
    rec["history"] = ([*(rec.get("history") or []), entry])[-c.RECOVERY_HISTORY_MAX:]
    rec["sliceReplacements"] = done
    d.st["recovery"] = rec
    rec.pop("resubmit", None)   # the jobs are submitted again once the slice is back
    for job in sorted({_verify_job(d, tft), d.st.get("children", {}).get("trainJob")} - {None}):
        if job in obs.jobs:   # while the head may still be up: KubeRay's finalizer stops the Ray job
            d.act(Op.DELETE, c.RAYJOB_KIND, job)
    if done >= allowed:
        msg = (f"a host of the slice was lost during {was.value} ({cause}) and the slice has already been replaced "
               f"{done} time(s) (spec.recovery.maxSliceReplacements={allowed}); checkpoints are kept")
        d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SLICE_LOST, msg)
        d.fail(Reason.SLICE_LOST, msg)
        return d.finish()
    rec["sliceReplacements"] = done + 1
    msg = (f"replacing the slice ({done + 1} of {allowed}): a host was lost during {was.value} ({cause}); "
           "KubeRay recreates the lost pods, then the slice is verified again"
           + (" and training resumes from its last checkpoint" if was == Phase.TRAINING or d.st.get("trainingAttempts")
              else ""))
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.REPLACING_SLICE, msg)
    if tft.spec.verification.enabled:
        d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, Reason.REPLACING_SLICE, "")
    d.go(Phase.PROVISIONING, Reason.REPLACING_SLICE, msg)
    d.st["phaseTransitionTime"] = fmt_time(d.now)   # a fresh provisioning deadline
    d.wake(tft.spec.provisioning_timeout_seconds)
    return d.finish()


def _verifying(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed, tun: Tunables) -> Decision:
    n, timeout, name = builders.names(tft), tft.spec.verification.timeout_seconds, _verify_job(d, tft)
    if _lost_cluster(d, tft, obs):
        return d.finish()
    assert obs.cluster is not None
    if _evicted(tft, obs):   # KubeRay deletes the pods of a suspended cluster: not a lost host
        return _requeue(d, obj, tft, obs)
    if lost := slice_loss(obs.cluster.status):
        return _replace_slice(d, obj, tft, obs, lost)
    job = obs.jobs.get(name)
    if job is None:
        d.fail(Reason.CHILD_DELETED, f"RayJob {name} was deleted during verification")
        return d.finish()
    workload = ((obj.get("status") or {}).get("verification") or {}).get("message")
    if job_succeeded(job):
        d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.TRUE, Reason.VERIFIED, workload or f"RayJob {name} succeeded")
        return _start_training(d, tft, obs)
    if job_lost(job) and _lost_count(d) < c.LOST_SUBMISSION_RETRIES:
        msg = _resubmission_due(d, job, n.verify_attempt(_lost_count(d, Phase.VERIFYING) + 1),
                                Condition.COLLECTIVES_VERIFIED, tun)
        if msg is None:
            return d.finish()
        d.event(EventType.WARNING, Reason.SUBMISSION_LOST, msg)
        d.st["phaseTransitionTime"] = fmt_time(d.now)   # the fresh job's own verification deadline
        return _start_verification(d, tft, Reason.SUBMISSION_LOST, msg)
    if job_failed(job):
        timed_out = job.status.get("reason") == c.RAYJOB_REASON_DEADLINE_EXCEEDED
        reason = Reason.COLLECTIVE_TIMEOUT if timed_out else Reason.VERIFICATION_FAILED
        msg = f"collective verification failed: {job_failure_detail(job)}" + (f"; workload: {workload}" if workload else "")
        d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, reason, msg)
        if _finishing(d, job, Condition.COLLECTIVES_VERIFIED, f"failing with {reason.value}", tun):
            return d.finish()
        d.fail(reason, msg)
        return d.finish()
    bound = timeout + tun.verify_grace_seconds
    if d.elapsed() >= bound:
        msg = (f"collective verification did not finish within {timeout}s (+{tun.verify_grace_seconds:g}s grace): "
               f"RayJob {name} {job_state(job)}; a host that never joins (wrong topology, unhealthy ICI) "
               "looks like this")
        d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.FALSE, Reason.COLLECTIVE_TIMEOUT, msg)
        d.fail(Reason.COLLECTIVE_TIMEOUT, msg)
        return d.finish()
    # Same message as on entry: the job's own progress lives in the RayJob's status, and an
    # unchanged message means no status write (one write per phase change).
    d.go(Phase.VERIFYING, Reason.VERIFYING, f"verifying collectives on every device (RayJob {name})")
    d.wake(bound - d.elapsed())
    return d.finish()


def _training(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed, tun: Tunables,
              live_serve: bool = False) -> Decision:
    n = builders.names(tft)
    attempts = max(int(d.st.get("trainingAttempts") or 1), 1)   # RayJobs submitted
    resubmitted = _lost_count(d, Phase.TRAINING)                 # of them after a lost submission
    counted, retries = attempts - resubmitted, tft.spec.training.max_job_retries
    name = n.train_attempt(attempts - 1)
    if _lost_cluster(d, tft, obs):
        return d.finish()
    assert obs.cluster is not None
    job = obs.jobs.get(name)
    if _evicted(tft, obs) and not (job is not None and job_succeeded(job)):
        return _requeue(d, obj, tft, obs)
    lost = slice_loss(obs.cluster.status)
    if lost and not (job is not None and job_succeeded(job)):   # a finished run needs no slice any more
        return _replace_slice(d, obj, tft, obs, lost)
    if job is None:
        d.fail(Reason.CHILD_DELETED, f"RayJob {name} was deleted during training")
        return d.finish()
    if job_succeeded(job):
        d.cond(Condition.TRAINING_SUCCEEDED, ConditionStatus.TRUE, Reason.TRAINING_COMPLETE, f"RayJob {name} succeeded")
        if _finishing(d, job, Condition.TRAINING_SUCCEEDED, "releasing the slice to serve" if live_serve
                      else "succeeding", tun):
            return d.finish()
        if live_serve:
            return _start_serving(d, obj, tft, obs, tun)
        d.go(Phase.SUCCEEDED, Reason.TRAINING_COMPLETE, f"training complete (RayJob {name}, attempt {counted})")
        return d.finish()
    if job_lost(job) and _lost_count(d) < c.LOST_SUBMISSION_RETRIES:
        msg = _resubmission_due(d, job, n.train_attempt(attempts), Condition.TRAINING_SUCCEEDED, tun)
        if msg is None:
            return d.finish()
        return _resubmit_training(d, tft, attempts, Reason.SUBMISSION_LOST, f"{msg}, resuming from checkpoint")
    if job_failed(job):
        detail = job_failure_detail(job)
        if counted <= retries:
            return _resubmit_training(d, tft, attempts, Reason.RETRYING, f"{detail}; resubmitted as "
                                      f"{n.train_attempt(attempts)} (attempt {counted + 1} of {retries + 1}), "
                                      "resuming from checkpoint")
        msg = f"training failed after {counted} attempt(s): {detail}" + (
            f" ({resubmitted} more RayJob(s) resubmitted after a lost submission)" if resubmitted else "")
        d.cond(Condition.TRAINING_SUCCEEDED, ConditionStatus.FALSE, Reason.TRAINING_FAILED, msg)
        if _finishing(d, job, Condition.TRAINING_SUCCEEDED, f"failing with {Reason.TRAINING_FAILED.value}", tun):
            return d.finish()
        d.fail(Reason.TRAINING_FAILED, msg)
        return d.finish()
    d.go(Phase.TRAINING, Reason.TRAINING, f"training (RayJob {name}, attempt {counted} of {retries + 1})")
    return d.finish()


def _resubmit_training(d: _Draft, tft: TPUFinetune, index: int, reason: Reason, msg: str) -> Decision:
    """The next training RayJob (attempt `index`, a new name), after a failed attempt (Retrying)
    or a lost submission (SubmissionLost); it resumes from the last checkpoint."""
    nxt = builders.names(tft).train_attempt(index)
    d.act(Op.CREATE, c.RAYJOB_KIND, nxt, builders.build_train_job(tft, index))
    d.st["trainingAttempts"] = index + 1
    d.st.setdefault("children", {})["trainJob"] = nxt
    d.event(EventType.WARNING, reason, msg)
    d.cond(Condition.TRAINING_SUCCEEDED, ConditionStatus.UNKNOWN, reason, msg)
    d.go(Phase.TRAINING, reason, msg)
    return d.finish()


# --- a RayJob KubeRay lost (observed.job_lost) -------------------------------------------------------
def _drop_resubmission(d: _Draft) -> None:
    """A resubmission being waited for is off (the run is suspended): its RayJob is deleted."""
    rec = d.st.get("recovery")
    if rec and rec.pop("resubmit", None) is not None and not rec:
        d.st.pop("recovery")


def _lost_count(d: _Draft, phase: Phase | None = None) -> int:
    """Lost submissions resubmitted so far in this run (in `phase` only, when given)."""
    lost = (d.st.get("recovery") or {}).get("lostSubmissions") or []
    return sum(1 for x in lost if phase is None or x.get("phase") == phase.value)


def _resubmission_due(d: _Draft, job: JobObs, nxt: str, ctype: Condition, tun: Tunables) -> str | None:
    """`job` is lost and the run has resubmitted fewer than c.LOST_SUBMISSION_RETRIES: wait out
    the backoff (tun.resubmit_backoff_seconds, doubling with each earlier loss in the run; 0: none;
    status.recovery.resubmit says until when, reason SubmissionLost meanwhile), then record it in
    status.recovery.lostSubmissions and return the message to resubmit it as `nxt` with. None
    while waiting."""
    rec = copy.deepcopy(d.st.get("recovery") or {})
    lost = list(rec.get("lostSubmissions") or [])
    wait = rec.get("resubmit") or {}
    if wait.get("rayJob") != job.name:
        backoff = tun.resubmit_backoff_seconds * 2 ** len(lost)
        wait = {"rayJob": job.name, "seen": fmt_time(d.now), "at": fmt_time(d.now + timedelta(seconds=backoff))}
    what = (f"{job_failure_detail(job)}; KubeRay lost the Ray job, not the workload failing (lost submission "
            f"{len(lost) + 1} of {c.LOST_SUBMISSION_RETRIES} in this run"
            + (", not counted against training.maxJobRetries)" if d.phase == Phase.TRAINING else ")"))
    left = ((parse_time(wait["at"]) or d.now) - d.now).total_seconds() if tun.resubmit_backoff_seconds > 0 else 0.0
    if left > 0:
        rec["resubmit"] = wait
        d.st["recovery"] = rec
        msg = f"{what}; resubmitting as {nxt} at {wait['at']}"
        d.cond(ctype, ConditionStatus.UNKNOWN, Reason.SUBMISSION_LOST, msg)
        d.go(d.phase or Phase.PENDING, Reason.SUBMISSION_LOST, msg)
        d.wake(left)
        return None
    rec.pop("resubmit", None)
    rec["lostSubmissions"] = [*lost, {"time": wait["seen"], "phase": (d.phase or Phase.PENDING).value,
                                      "rayJob": job.name, "resubmittedAs": nxt}]
    d.st["recovery"] = rec
    return f"{what}; resubmitted as {nxt}"


def _start_serving(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed, tun: Tunables) -> Decision:
    """Training is done: release its slice (once its RayJobs are finished or gone) and serve the
    export on the serve slice."""
    n, sv = builders.names(tft), tft.spec.serve
    assert sv is not None, "serving needs spec.serve enabled"
    s = sv.slice
    exported = ((obj.get("status") or {}).get("training") or {}).get(c.TrainingStatus.EXPORTED_MODEL.value)
    source = exported or builders.export_path(tft)
    holding = _release(d, obs, 0, tun)
    if not holding:
        d.act(Op.DELETE, c.RAYCLUSTER_KIND, n.cluster)
    d.act(Op.CREATE, c.RAYSERVICE_KIND, n.service, builders.build_rayservice(tft, source))
    d.st.setdefault("children", {})["rayService"] = n.service
    d.st["serving"] = {"service": n.serve_service, "port": c.SERVE_PORT, "model": tft.meta.name,
                       "url": f"http://{n.serve_service}.{tft.meta.namespace}.svc:{c.SERVE_PORT}",
                       "engine": sv.engine.value, "modelSource": source, "notReadySince": fmt_time(d.now)}
    msg = (f"training complete; deploying {tft.meta.name} with {sv.engine.value} on {s.generation} {s.topology} "
           f"x{sv.replicas} (RayService {n.service}; RayCluster {n.cluster} released"
           + (" once its RayJobs are gone)" if holding else ")"))
    d.cond(Condition.SERVING, ConditionStatus.FALSE, Reason.DEPLOYING, msg)
    d.go(Phase.SERVING, Reason.DEPLOYING, msg)
    d.wake(sv.timeout_seconds)
    return d.finish()


def _serving(d: _Draft, tft: TPUFinetune, obs: Observed, live_serve: bool, tun: Tunables) -> Decision:
    """The RayService until spec.serve.enabled goes false (-> Succeeded) or its app stays short of
    RUNNING for spec.serve.timeoutSeconds (-> Failed/ServeFailed, in the app's own words)."""
    n, sv = builders.names(tft), tft.spec.serve
    assert sv is not None, "serving needs spec.serve enabled"
    if obs.cluster is not None and not _release(d, obs, d.elapsed(), tun):   # the training slice, held by a RayJob
        d.act(Op.DELETE, c.RAYCLUSTER_KIND, n.cluster)
    if not live_serve:
        if obs.service is not None:
            d.act(Op.DELETE, c.RAYSERVICE_KIND, n.service)
        d.st.pop("serving", None)
        msg = f"training complete; serving stopped (spec.serve.enabled is false: RayService {n.service} deleted)"
        d.cond(Condition.SERVING, ConditionStatus.FALSE, Reason.SERVE_STOPPED, msg)
        d.go(Phase.SUCCEEDED, Reason.SERVE_STOPPED, msg)
        return d.finish()
    if obs.service is None:
        d.fail(Reason.CHILD_DELETED, f"RayService {n.service} was deleted while serving; recreate the TPUFinetune "
               "(with spec.checkpoint.resumeFrom to skip training) to serve again")
        return d.finish()
    serving = dict(d.st.get("serving") or {})
    if service_ready(obs.service.status):
        serving.pop("notReadySince", None)
        d.st["serving"] = serving
        msg = f"serving model {serving.get('model')} at {serving.get('url')} (OpenAI-compatible /v1)"
        d.cond(Condition.SERVING, ConditionStatus.TRUE, Reason.SERVING, msg)
        d.serving_ready = True
        d.go(Phase.SERVING, Reason.SERVING, msg)
        return d.finish()
    since = parse_time(serving.get("notReadySince")) or d.now
    serving["notReadySince"] = fmt_time(since)
    d.st["serving"] = serving
    progress = f"RayService {n.service}: {service_progress(obs.service.status)}"
    found = blocking(obs.pods)
    if found:
        progress += f"; {found[1]}"
        if found[1] not in (d.prev.get("message") or ""):
            d.event(EventType.WARNING, Reason.SLICE_BLOCKED, found[1])
    waited = (d.now - since).total_seconds()
    if waited >= sv.timeout_seconds:
        msg = f"the Serve app was not RUNNING within spec.serve.timeoutSeconds ({sv.timeout_seconds}s): {progress}"
        d.cond(Condition.SERVING, ConditionStatus.FALSE, Reason.SERVE_FAILED, msg)
        d.fail(Reason.SERVE_FAILED, msg)
        return d.finish()
    d.cond(Condition.SERVING, ConditionStatus.FALSE, Reason.DEPLOYING, progress)
    d.go(Phase.SERVING, Reason.DEPLOYING, f"deploying: {progress}")
    d.wake(sv.timeout_seconds - waited)
    return d.finish()


def wants_serve_pods(obj: Mapping[str, Any]) -> bool:
    """Serving and not (yet) ready: the serving cluster's pods say why (image pull, scheduling)."""
    st = owned(obj.get("status"))
    return st.get("phase") == Phase.SERVING.value and not serving_ready(st)


# --- Kueue: Queued, admitted, preempted ----------------------------------------------------------------
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
    phase = owned(obj.get("status")).get("phase")
    return phase == Phase.QUEUED.value or (cluster.suspended and phase != Phase.SUSPENDED.value)


def _evicted(tft: TPUFinetune, obs: Observed) -> bool:
    """A labelled object's RayCluster suspended while we did not ask (we do only in Suspended): Kueue
    has not admitted it, or has taken the admission back."""
    return bool(queue_name(tft)) and obs.cluster is not None and obs.cluster.suspended


def _kueue_words(q: QueueObs | None) -> str:
    if q is None or not q.workload:
        return "Kueue has not made a Workload for it yet"
    return q.waiting or (q.evicted and f"evicted ({q.evicted})") or f"Workload {q.workload} is waiting for quota"


def _requeue(d: _Draft, obj: Mapping, tft: TPUFinetune, obs: Observed) -> Decision:
    """Kueue suspended the RayCluster under a provisioning, verifying or training run. While a job
    runs that is a preemption: the jobs are stopped (checkpoints stay), status.recovery.preemptions
    counts it (never sliceReplacements), and the run waits Queued; re-admitted, it provisions,
    verifies again and resumes from its checkpoint (the same attempt, as after a suspend)."""
    n, was, q = builders.names(tft), d.phase or Phase.PENDING, obs.queue
    running = was in (Phase.VERIFYING, Phase.TRAINING)
    if running:
        # The jobs are stopped once KubeRay has deleted the pods (_queued), not now: deleting a
        # RayJob stops its Ray job at once, before the pods' preStop hook has let every rank save
        # a checkpoint at its next step (tpuft_workload.preemption).
        active = {Phase.VERIFYING: _verify_job(d, tft), Phase.TRAINING: d.st.get("children", {}).get("trainJob")}[was]
        _drop_resubmission(d)
        rec = copy.deepcopy(d.st.get("recovery") or {})
        rec["preemptions"] = int(rec.get("preemptions") or 0) + 1
        rec["lastPreemption"] = {"time": fmt_time(d.now), "phase": was.value, "cause": (q.evicted if q else "") or
                                 f"RayCluster {n.cluster} suspended by Kueue"}
        step = ((obj.get("status") or {}).get("training") or {}).get(c.TrainingStatus.STEP.value)
        if isinstance(step, int):
            rec["lastPreemption"]["step"] = step
        d.st["recovery"] = rec
        if tft.spec.verification.enabled:
            d.cond(Condition.COLLECTIVES_VERIFIED, ConditionStatus.UNKNOWN, Reason.PREEMPTED, "verified again once re-admitted")
    preempted = running or bool(q and q.evicted) or d.prev.get("reason") == Reason.PREEMPTED.value
    reason = Reason.PREEMPTED if preempted else Reason.QUEUED
    words = _kueue_words(q)
    if running:
        jobs = f"RayJob {active} stopped once its pods are gone; " if active else ""
        msg = (f"preempted by Kueue during {was.value} ({(q.evicted if q else '') or 'RayCluster suspended'}); "
               f"{jobs}checkpoints kept; it resumes from the last one once admitted again")
    else:
        msg = f"waiting for Kueue to admit RayCluster {n.cluster} again: {words}"
    d.cond(Condition.ADMITTED, ConditionStatus.FALSE, reason, words)
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, reason, "RayCluster suspended by Kueue")
    d.go(Phase.QUEUED, reason, msg)
    d.wake(c.QUEUE_POLL_SECONDS)
    return d.finish()


def _queued(d: _Draft, tft: TPUFinetune, obs: Observed) -> Decision:
    """Waiting for Kueue. Admitted (the RayCluster unsuspended): Provisioning, under a fresh
    deadline: time queued never counts against provisioningTimeoutSeconds."""
    n, q, queue = builders.names(tft), obs.queue, queue_name(tft)
    if obs.cluster is None and not obs.leftovers:   # deleted while queued: made again, queued again
        d.act(Op.CREATE, c.RAYCLUSTER_KIND, n.cluster, builders.build_raycluster(tft))
        d.event(EventType.WARNING, Reason.CHILD_DELETED, f"RayCluster {n.cluster} not found while queued; recreating it")
    if q is not None and not q.installed:
        msg = (f"label {c.KUEUE_QUEUE_LABEL}={queue} but Kueue is not installed (no {c.KUEUE_GROUP}/"
               f"{c.KUEUE_VERSION} Workload API): nothing queues this run, it provisions right away; install "
               "Kueue, or remove the label")
        d.cond(Condition.ADMITTED, ConditionStatus.FALSE, Reason.KUEUE_NOT_INSTALLED, msg)
        d.event(EventType.WARNING, Reason.KUEUE_NOT_INSTALLED, msg)
        return _admitted(d, tft, obs, f"not queued ({c.KUEUE_QUEUE_LABEL}={queue}, Kueue not installed)")
    admitted = obs.cluster is not None and not obs.cluster.suspended
    if obs.jobs:   # a preempted run's RayJobs: stopped once KubeRay has deleted its pods, gone before it runs again
        gone = obs.cluster is None or cluster_suspended(obs.cluster.status)
        if gone or admitted or d.elapsed() >= c.PREEMPTION_STOP_SECONDS:
            for name in sorted(obs.jobs):
                d.act(Op.DELETE, c.RAYJOB_KIND, name)
        d.wake(c.LEFTOVER_POLL_SECONDS)
        if admitted:
            d.go(Phase.QUEUED, Reason.PREEMPTED, f"admitted again; waiting for RayJob {', '.join(sorted(obs.jobs))} "
                 "(stopped after the preemption) to be gone")
            return d.finish()
    if admitted:
        d.cond(Condition.ADMITTED, ConditionStatus.TRUE, Reason.ADMITTED,
               f"admitted by Kueue (Workload {q.workload}, LocalQueue {queue})" if q and q.workload
               else f"admitted (LocalQueue {queue})")
        again = d.prev.get("reason") == Reason.PREEMPTED.value
        return _admitted(d, tft, obs, "admitted again after a preemption" if again else "admitted")
    timeout = tft.spec.queue_timeout_seconds
    words = _kueue_words(q)
    if timeout is not None and d.elapsed() >= timeout:
        msg = (f"not admitted by Kueue within spec.queueTimeoutSeconds ({timeout}s) in LocalQueue {queue}: {words}; "
               f"`kubectl describe localqueue {queue}` and its ClusterQueue show the quota")
        d.cond(Condition.ADMITTED, ConditionStatus.FALSE, Reason.QUEUE_TIMEOUT, msg)
        d.fail(Reason.QUEUE_TIMEOUT, msg)
        return d.finish()
    reason = Reason.PREEMPTED if d.prev.get("reason") == Reason.PREEMPTED.value else Reason.QUEUED
    if words not in (d.prev.get("message") or ""):   # one event per new reason Kueue gives
        d.event(EventType.NORMAL, Reason.QUEUED, f"LocalQueue {queue}: {words}")
    lead = ("preempted by Kueue; waiting to be admitted again (checkpoints kept)" if reason == Reason.PREEMPTED
            else f"waiting for Kueue to admit RayCluster {n.cluster}")
    d.cond(Condition.ADMITTED, ConditionStatus.FALSE, reason, words)
    d.go(Phase.QUEUED, reason, f"{lead} (LocalQueue {queue}): {words}")
    d.wake(c.QUEUE_POLL_SECONDS if timeout is None else min(c.QUEUE_POLL_SECONDS, timeout - d.elapsed()))
    return d.finish()


def _admitted(d: _Draft, tft: TPUFinetune, obs: Observed, how: str) -> Decision:
    s = tft.spec.slice
    progress = cluster_progress(tft, obs.cluster)
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.WAITING_FOR_SLICE, progress)
    d.go(Phase.PROVISIONING, Reason.WAITING_FOR_SLICE, f"{how}; waiting for slice {s.generation} {s.topology}: {progress}")
    d.wake(tft.spec.provisioning_timeout_seconds)
    return d.finish()


def _suspend(d: _Draft, tft: TPUFinetune, obs: Observed, tun: Tunables) -> Decision:
    n, was = builders.names(tft), d.phase or Phase.PENDING
    # Jobs cannot outlive their pods; the verify job goes too, so the resumed slice is verified again.
    # They go first: the RayCluster is suspended once they are gone (_suspended).
    verify = _verify_job(d, tft)
    active = {Phase.VERIFYING: verify, Phase.TRAINING: d.st.get("children", {}).get("trainJob")}.get(was)
    stop = frozenset(x for x in (verify, active) if x is not None)
    holding = _release(d, obs, 0, tun, stop=stop) if obs.cluster is not None else []
    _drop_resubmission(d)   # the resumed run verifies the slice, then submits again
    if obs.cluster is not None and not holding:
        d.act(Op.SUSPEND, c.RAYCLUSTER_KIND, n.cluster)
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED,
           f"RayCluster suspended once RayJob {', '.join(holding)} is gone" if holding else "RayCluster suspended")
    d.go(Phase.SUSPENDED, Reason.SUSPENDED, f"suspended during {was.value}" +
         (f" (RayJob {active} deleted; it resumes from its checkpoint)" if active else ""))
    return d.finish()


def _suspended(d: _Draft, tft: TPUFinetune, obs: Observed, live_suspend: bool, tun: Tunables) -> Decision:
    n = builders.names(tft)
    if live_suspend:
        if obs.cluster is not None and not obs.cluster.suspended and not _release(d, obs, d.elapsed(), tun):
            d.act(Op.SUSPEND, c.RAYCLUSTER_KIND, n.cluster)
            d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.SUSPENDED, "RayCluster suspended")
        return d.finish()
    if obs.cluster is not None:
        d.act(Op.RESUME, c.RAYCLUSTER_KIND, n.cluster)
    d.go(Phase.PROVISIONING, Reason.WAITING_FOR_SLICE, f"resumed; waiting for slice: {cluster_progress(tft, obs.cluster)}")
    d.cond(Condition.SLICE_PROVISIONED, ConditionStatus.FALSE, Reason.WAITING_FOR_SLICE, "resumed")
    d.wake(tft.spec.provisioning_timeout_seconds)
    return d.finish()


def _terminal(d: _Draft, tft: TPUFinetune, obs: Observed, tun: Tunables) -> Decision:
    ttl = d.ttl
    done = parse_time(d.st.get("completionTime"))
    left_over = [(kind, x.name) for kind, x in ((c.RAYCLUSTER_KIND, obs.cluster), (c.RAYSERVICE_KIND, obs.service))
                 if x is not None]
    if left_over and done is not None:
        left = ttl - (d.now - done).total_seconds()
        if left <= 0:
            for kind, name in left_over:
                if kind == c.RAYCLUSTER_KIND and _release(d, obs, -left, tun):
                    continue   # its RayJobs go first
                d.act(Op.DELETE, kind, name)
                d.event(EventType.NORMAL, Reason.TTL_EXPIRED, f"deleting {kind} {name}: ttlSecondsAfterFinished "
                        f"({ttl}s) has passed; status and checkpoints stay")
        else:
            d.wake(left)
    return d.finish()


# --- a RayCluster's RayJobs go before it does ----------------------------------------------------------
def _finishing(d: _Draft, job: JobObs, ctype: Condition, then: str, tun: Tunables) -> bool:
    """The job's outcome is known (ctype, just set, says it) but KubeRay has not finished its RayJob
    yet (observed.job_finishing): the phase stays, reason FinishingRayJob, until it has, for at
    most the grace from when ctype took its status. Past it the RayJob is deleted, so it and its
    submitter are gone before its RayCluster goes. True while waiting."""
    if not job_finishing(job):
        return False
    grace = tun.rayjob_grace_seconds
    before: Mapping[str, Any] = next((x for x in d.prev.get("conditions") or [] if x.get("type") == ctype.value), {})
    since = parse_time(before.get("lastTransitionTime")) if before.get("status") == d.conds[ctype][0].value else None
    waited = (d.now - since).total_seconds() if since else 0.0
    if waited < grace:
        d.go(d.phase or Phase.PENDING, Reason.FINISHING_RAYJOB,
             f"RayJob {job.name}: the job is {job.status.get('jobStatus')}; waiting for KubeRay to finish the RayJob "
             f"(its submitter to exit) before {then}")
        d.wake(grace - waited)
        return True
    d.act(Op.DELETE, c.RAYJOB_KIND, job.name)
    d.event(EventType.WARNING, Reason.FINISHING_RAYJOB, f"KubeRay did not finish RayJob {job.name} within {grace:g}s "
            f"of its job ending ({job_state(job)}); deleting it before its RayCluster goes")
    return False


def _release(d: _Draft, obs: Observed, waited: float, tun: Tunables, stop: frozenset[str] = frozenset()) -> list[str]:
    """Before a RayCluster goes (deleted or suspended) every RayJob on it is finished or gone: a
    submitter still following its job's logs when the head goes fails (its K8s Job ends Failed,
    the RayJob never Complete). A RayJob KubeRay is finishing may take the grace; the other
    unfinished ones, and those in `stop`, are deleted now (KubeRay's finalizer stops a Ray job
    still running while the head is up; the submitter Job goes with its RayJob). Returns the
    RayJobs still holding the cluster `waited` seconds after it was to go: none past twice the
    grace (KubeRay has not let them go: the cluster goes anyway)."""
    grace = tun.rayjob_grace_seconds
    holding = set(obs.jobs_deleting)
    for name, job in sorted(obs.jobs.items()):
        if name in holding or (name not in stop and job_settled(job)):
            continue
        if name in stop or not (job_finishing(job) and waited < grace):
            d.act(Op.DELETE, c.RAYJOB_KIND, name)
        holding.add(name)
    if not holding or waited >= 2 * grace:
        return []
    d.wake((grace if waited < grace else 2 * grace) - waited)
    return sorted(holding)


def note_error(obj: Mapping[str, Any], error: str, now: datetime) -> dict | None:
    """Status patch after an action failed transiently: phase kept (Pending if none), message says why."""
    prev = owned(obj.get("status"))
    patch: dict[str, Any] = {}
    if not prev.get("phase"):
        patch.update({"phase": Phase.PENDING.value, "reason": Reason.CREATED.value,
                      "phaseTransitionTime": fmt_time(now), "startTime": fmt_time(now)})
    msg = f"retrying: {error}"
    if prev.get("message") != msg:
        patch["message"] = msg
    return patch or None
