"""Pending and Provisioning: the first children, waiting for a deleted namesake, the slice
coming up (its blocking cause, its deadline)."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Mapping

from tpuft.api import constants as c
from tpuft.api import gke
from tpuft.api import kuberay
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune, spec_warnings
from tpuft.api.status import (
    Children,
    RunStatus,
    Slice,
)
from tpuft.controller import builders, hosts, publishing
from tpuft.controller.diagnosis import Blocker, blocking, pool_hint
from tpuft.controller.observed import (
    ClusterObs,
    Decision,
    Observed,
    Op,
    cluster_progress,
    cluster_provisioned,
    slice_loss,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import STOPPING_LOOK_SECONDS, _start_training, _start_verification, _stop_old_jobs
from tpuft.controller.phases.queue import _evicted, _requeue, queue_name
from tpuft.controller.phases.recovery import _elastic_slices, _train_on_fewer_slices
from tpuft.controller.phases.serving import _serve_as_is


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
    draft.add_action(Op.CREATE, kuberay.RAYCLUSTER_KIND, names.cluster, builders.build_raycluster(tft))
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
        draft.add_action(Op.CREATE, kuberay.RAYCLUSTER_KIND, names.cluster, body)
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
        where = (f"a TPU node pool with {gke.GKE_TPU_ACCELERATOR_SELECTOR}={shape.gke_accelerator} and "
                 f"{gke.GKE_TPU_TOPOLOGY_SELECTOR}={shape.topology} ({shape.hosts} hosts of {shape.machine_type}) "
                 "per slice"
                 if shape.is_tpu else "schedulable CPU nodes")
        msg = (f"slice not provisioned after {timeout}s: {progress}; check {where} has capacity and quota, "
               f"and `kubectl describe raycluster {names.cluster}` / "
               f"`kubectl get pods -l {kuberay.RAY_CLUSTER_LABEL}={names.cluster}`")
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
