"""Serving: the RayService, its app's state and deadline; adapters published to a shared base
(tpuft.controller.publishing judges, these act)."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Mapping

from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api.constants import Condition, ConditionStatus, EventType, Phase, Reason
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import (
    Adapter,
    Adapters,
    Children,
    Publication,
    Serving,
)
from tpuft.controller import builders, publishing
from tpuft.controller.diagnosis import blocking
from tpuft.controller.observed import (
    Decision,
    Observed,
    Op,
    Tunables,
    fmt_time,
    job_failed,
    job_failure_detail,
    job_settled,
    job_succeeded,
    parse_time,
    service_progress,
    service_ready,
    serving_ready,
)
from tpuft.controller.phases.draft import _Draft
from tpuft.controller.phases.jobs import _release


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
        draft.add_action(Op.DELETE, kuberay.RAYCLUSTER_KIND, names.cluster)
    draft.add_action(Op.CREATE, kuberay.RAYSERVICE_KIND, names.service, builders.build_rayservice(tft, source))
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
    draft.add_action(Op.CREATE, kuberay.RAYSERVICE_KIND, names.service, builders.build_rayservice(tft))
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
        draft.add_action(Op.DELETE, kuberay.RAYCLUSTER_KIND, names.cluster)
    if not live_serve:
        if obs.service is not None:
            draft.add_action(Op.DELETE, kuberay.RAYSERVICE_KIND, names.service)
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
        draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, job.name)
        draft.status = replace(draft.status, children=replace(draft.children, publish_job=None))
        published = Publication(eval_loss=publishing.eval_loss(tft, draft.status.training), eval_set=tft.spec.eval_set,
                                published_at=fmt_time(draft.now))
        say(Reason.PUBLISHED, f"served by {publish.to} as model {serving.model}",
            replace(serving, published=published, adapters_root=base.adapters_root if base else None), served=True)
        return
    if job is not None and job_failed(job):
        draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, job.name)
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
    draft.add_action(Op.CREATE, kuberay.RAYJOB_KIND, names.publish_job, body)
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
            draft.add_action(Op.DELETE, kuberay.RAYJOB_KIND, running)
            if job_failed(job) and done is not None:
                draft.add_event(EventType.WARNING, Reason.UNPUBLISHING, f"RayJob {running} could not remove adapter "
                                f"{done.name} from {serving.adapters_root}: {job_failure_detail(job, '')}")
        gone = [a for a in gone if a is not done]
        running = None
    if running is None and gone and cluster:
        first = gone[0]
        body = builders.build_unpublish_job(tft, cluster, first.name or "", first.uid or "")
        running = body["metadata"]["name"]
        draft.add_action(Op.CREATE, kuberay.RAYJOB_KIND, running, body)
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
