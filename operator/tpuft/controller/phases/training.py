"""Training: the attempt's outcome, retries, and what ends the phase (success, serving,
publishing, failure)."""
from __future__ import annotations

from tpuft.api import constants as c
from tpuft.api.constants import Condition, ConditionStatus, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import Training as TrainingProgress
from tpuft.controller import builders
from tpuft.controller.observed import (
    Decision,
    Observed,
    Tunables,
    job_failed,
    job_failure_detail,
    job_lost,
    job_settled,
    job_succeeded,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import (
    _finishing,
    _full_log,
    _resubmission_due,
    _resubmit_training,
    _storage_not_writable,
    _training_says,
)
from tpuft.controller.phases.queue import _evicted, _requeue
from tpuft.controller.phases.recovery import (
    _grow_back,
    _host_loss,
    _killed_for_memory,
    _lost_cluster,
    _maintenance,
    _memory_advice,
    _memory_kill,
    _replace_slice,
)
from tpuft.controller.phases.serving import _publication, _start_serving


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
