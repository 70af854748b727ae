"""Recovery: a lost host replaces the slice, a maintenance notice asks for a checkpoint, an
elastic run trains on fewer slices and grows back, a kill for memory is named."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import (
    Children,
    Elastic,
    LostSlice,
    MaintenanceNotice,
    Recovery,
    RunStatus,
)
from tpuft.api.status import Training as TrainingProgress
from tpuft.controller import builders, hosts
from tpuft.controller.builders import elastic_accumulation, elastic_slices
from tpuft.controller.diagnosis import host_of
from tpuft.controller.observed import (
    Decision,
    JobObs,
    Killer,
    MemoryKill,
    Observed,
    Op,
    fmt_time,
    job_failed,
    job_lost,
    memory_kill,
    parse_time,
    slice_loss,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import _component, _full_log, _start_training, _verify_job


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
            draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, job)
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
    draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, job)
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
