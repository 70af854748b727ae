"""A run's RayJobs: submitting verification and training attempts, what a finished job says,
and how a RayCluster's RayJobs go before it does (_finishing, _release); lost submissions."""
from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import (
    LostSubmission,
    Resubmit,
)
from tpuft.controller import builders
from tpuft.controller.observed import (
    Decision,
    JobObs,
    Observed,
    Op,
    Tunables,
    fmt_time,
    job_failed,
    job_failure_detail,
    job_finishing,
    job_settled,
    job_state,
    job_succeeded,
    parse_time,
)
from tpuft.controller.phases.draft import _Draft

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
            draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, name)
            deleted.append(name)
        else:
            saving.append(name)
    return saving, deleted


def _start_verification(draft: _Draft, tft: TPUFinetune, reason: Reason = Reason.VERIFYING,
                        message: str | None = None, with_training: bool = False) -> Decision:
    index = draft.recovery.lost_count(Phase.VERIFYING)   # a fresh name after each lost submission
    name = builders.names(tft).verify_attempt(index)
    draft.add_action(Op.CREATE, kuberay.RAYJOB_KIND, name, builders.build_verify_job(tft, index))
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
        draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, train)


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
    draft.add_action(Op.CREATE, kuberay.RAYJOB_KIND, name, builders.build_train_job(tft, index, slices, after_verification))
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
    draft.add_action(Op.CREATE, kuberay.RAYJOB_KIND, next_job,
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
    draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, job.name)
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
            draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, name)
        holding.add(name)
    if not holding or waited >= 2 * grace:
        return []
    draft.requeue_after((grace if waited < grace else 2 * grace) - waited)
    return sorted(holding)
