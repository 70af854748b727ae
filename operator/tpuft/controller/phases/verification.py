"""VerifyingCollectives: the verification RayJob's outcome, its deadline, then training."""
from __future__ import annotations

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import Verification
from tpuft.controller import builders
from tpuft.controller.observed import (
    Decision,
    Observed,
    Tunables,
    job_failed,
    job_failure_detail,
    job_lost,
    job_state,
    job_succeeded,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import (
    _finishing,
    _full_log,
    _resubmission_due,
    _start_training,
    _start_verification,
    _stop_waiting_train_job,
    _storage_not_writable,
    _training_says,
    _verify_job,
    _waiting_train_job,
)
from tpuft.controller.phases.queue import _evicted, _requeue
from tpuft.controller.phases.recovery import (
    _host_loss,
    _killed_for_memory,
    _lost_cluster,
    _memory_advice,
    _memory_kill,
    _replace_slice,
)


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
        timed_out = job.status.get("reason") == kuberay.RAYJOB_REASON_DEADLINE_EXCEEDED
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
