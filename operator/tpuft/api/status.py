"""A TPUFinetune's status, typed: one frozen dataclass per block, each field declared once with
tpuft.api.fields (its JSON name, type and description).

From these come the CRD's status schema (`schema`, which tpuft.api.crd places in the CRD), the value
tpuft.controller.phases decides on and edits through the methods below, and the JSON merge patch it writes
(the difference between two `RunStatus.owned_json()`). The blocks the workload writes
(`verification`, `training`) are declared key by key in the order of the tpuft.api.constants enums the
workload writes them with; a key on one side only fails at import. Pure: no I/O, no Kubernetes client.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from tpuft.api import catalog
from tpuft.api.constants import (GOODPUT_RATIO, GOODPUT_TOTAL, HISTORY_MAX_POINTS, LOST_SUBMISSION_RETRIES,
                             RECOVERY_HISTORY_MAX, ConditionStatus, GoodputCause, HistoryPoint, Phase,
                             TrainingStatus, VerificationStatus)
from tpuft.api.fields import declare, declared, from_json, schema_of, to_json

MAX_SLICE_PODS = 4097   # the head and 4096 hosts: more than any slice times spec.slices allows
DESCRIPTION = ("Observed state, written by the operator (phase, conditions, children) and by the workload "
               "(verification, training).")
WORKLOAD_BLOCKS = ("verification", "training")   # the workload's to write; the operator only reads them
_EXAMPLE_GENERATION = catalog.generation("v6e")    # tpuft.api.crd's spec descriptions name the same one


def _array_of(item: type, description: str, max_items: int | None = None,
              extra: Mapping[str, Any] | None = None) -> Callable[[], dict]:
    """schema= for an array of objects: the type alone says neither the items' description nor a bound."""
    def schema() -> dict:
        out: dict[str, Any] = {"type": "array", "items": schema_of(item, description)}
        if max_items is not None:
            out["maxItems"] = max_items
        return {**out, **(extra or {})}
    return schema


def _names_follow(cls: type, keys: Iterable[str]) -> None:
    """A block keyed by constants (the workload's, goodput's) declares exactly those keys, in their order."""
    names, expected = [d.name for d in declared(cls)], list(keys)
    if names != expected:
        raise TypeError(f"{cls.__name__} declares {names}; its constants say {expected}")


# --- what the operator writes ----------------------------------------------------------------------
@dataclass(frozen=True)
class RunCondition:
    type: str = declare("SliceProvisioned, CollectivesVerified, TrainingSucceeded, Serving, Ready or Failed.",
                        required=True, python_default="")
    status: ConditionStatus = declare("True, False or Unknown.", enum=tuple(s.value for s in ConditionStatus),
                                      required=True, python_default=ConditionStatus.UNKNOWN)
    reason: str | None = declare("CamelCase reason.")
    message: str | None = declare("Human-readable detail.")
    last_transition_time: str | None = declare("When status last changed.", format="date-time")
    observed_generation: int | None = declare("metadata.generation this condition reflects.")


@dataclass(frozen=True)
class Preemption:
    time: str | None = declare("When it was seen.", format="date-time")
    phase: str | None = declare("The phase it happened in.")
    cause: str | None = declare("Kueue's eviction reason and message.")
    step: int | None = declare("The training step last reported before it.")


@dataclass(frozen=True)
class LostSlice:
    time: str | None = declare("When the loss was seen.", format="date-time")
    phase: str | None = declare("The phase it happened in.")
    cause: str | None = declare("What was seen (ready hosts, the head).")
    hosts_ready: int | None = declare("Worker hosts ready when it was seen.")
    hosts: int | None = declare("Worker hosts the slice needs.")
    step: int | None = declare("The training step last reported before the loss.")


@dataclass(frozen=True)
class MaintenanceNotice:
    time: str | None = declare("When the notice was seen.", format="date-time")
    node: str | None = declare("The node under the slice that carries it.")
    notice: str | None = declare("GKE's notice: its label or taint and value.")
    step: int | None = declare("The training step last reported when it was seen.")
    checkpoint_step: int | None = declare("The step of the checkpoint the run saved for it (absent until saved).")


@dataclass(frozen=True)
class Elastic:
    slices: int | None = declare("The slices the current training job runs on (fewer than spec.slices while a "
                                 "lost slice has not come back).")
    gradient_accumulation_steps: int | None = declare("The accumulation that keeps the global batch on them.")
    since: str | None = declare("When training went on with fewer slices.", format="date-time")


@dataclass(frozen=True)
class LostSubmission:
    time: str | None = declare("When it was seen.", format="date-time")
    phase: str | None = declare("VerifyingCollectives or Training.")
    ray_job: str | None = declare("The RayJob KubeRay failed.")
    resubmitted_as: str | None = declare("The new RayJob.")


@dataclass(frozen=True)
class Resubmit:
    ray_job: str | None = declare("The RayJob KubeRay failed.")
    seen: str | None = declare("When it was seen.", format="date-time")
    at: str | None = declare("When it is resubmitted.", format="date-time")


@dataclass(frozen=True)
class Recovery:
    slice_replacements: int | None = declare("Replacements so far.")
    preemptions: int | None = declare("Times Kueue evicted the running RayCluster (not counted as slice "
                                      "replacements: the run waits Queued and resumes from its checkpoint once "
                                      "admitted again).")
    last_preemption: Preemption | None = declare("The latest Kueue eviction.")
    history: tuple[LostSlice, ...] | None = declare(
        "The latest losses, oldest first.", schema=_array_of(LostSlice, "One lost slice.", RECOVERY_HISTORY_MAX))
    lost_submissions: tuple[LostSubmission, ...] | None = declare(
        "RayJobs KubeRay failed with \"Submitter completed but Ray job not found in RayCluster\" and the operator "
        "resubmitted (not counted against training.maxJobRetries), oldest first.",
        schema=_array_of(LostSubmission, "One lost submission.", LOST_SUBMISSION_RETRIES))
    resubmit: Resubmit | None = declare("A lost RayJob waiting out its backoff before it is resubmitted; absent "
                                        "otherwise.")
    slice_pods: tuple[str, ...] | None = declare(
        "The UIDs of the RayCluster's pods when the slice was last found whole: one of them terminating, ended, not "
        "Ready or gone, or another pod in their place, is a lost host.", schema=lambda: {
            "type": "array", "items": {"type": "string"}, "maxItems": MAX_SLICE_PODS})
    checkpoint_requested_at: str | None = declare(
        "A checkpoint the operator asks the training job for (a maintenance notice on a node under the slice): the "
        "job saves at its next step boundary, goes on training and answers in training.checkpointRequestSaved.",
        format="date-time")
    last_maintenance: MaintenanceNotice | None = declare("The latest GKE maintenance notice seen under the slice.")
    elastic: Elastic | None = declare("Training on fewer slices than spec.slices (spec.recovery.elastic); absent "
                                      "while every slice trains.")

    def record_loss(self, loss: LostSlice) -> Recovery:
        """A host of the slice was lost: the loss joins the history (the latest RECOVERY_HISTORY_MAX
        kept), the replacements so far are stated (0 before the first), and a resubmission being
        waited for is dropped (the jobs are submitted again once the slice is back)."""
        return replace(self, slice_replacements=self.slice_replacements or 0,
                       history=(*(self.history or ()), loss)[-RECOVERY_HISTORY_MAX:], resubmit=None)

    def replacing_slice(self) -> Recovery:
        return replace(self, slice_replacements=(self.slice_replacements or 0) + 1)

    def record_preemption(self, preemption: Preemption) -> Recovery:
        return replace(self, preemptions=(self.preemptions or 0) + 1, last_preemption=preemption)

    def waiting_to_resubmit(self, resubmit: Resubmit) -> Recovery:
        return replace(self, resubmit=resubmit)

    def lost_submission(self, lost: LostSubmission) -> Recovery:
        """A lost RayJob resubmitted: recorded, and no longer waited for."""
        return replace(self, lost_submissions=(*(self.lost_submissions or ()), lost), resubmit=None)

    def slice_whole(self, pods: tuple[str, ...] | None) -> Recovery:
        return replace(self, slice_pods=pods)

    def maintenance_notice(self, notice: MaintenanceNotice, requested_at: str) -> Recovery:
        return replace(self, last_maintenance=notice, checkpoint_requested_at=requested_at)

    def lost_count(self, phase: Phase | None = None) -> int:
        """Lost submissions resubmitted so far in this run (in `phase` only, when given)."""
        return sum(1 for x in self.lost_submissions or () if phase is None or x.phase == phase.value)


@dataclass(frozen=True)
class IgnoredSpecChange:
    observed_generation: int | None = declare("The metadata.generation whose spec is not applied.")
    fields: tuple[str, ...] = declare("Spec fields that differ from appliedSpec (suspend and ttlSecondsAfterFinished "
                                      "act live and are never listed).", python_default=())
    valid: bool | None = declare("Whether the edited spec is valid at all.")
    message: str | None = declare("What is ignored, and how to apply it.")


@dataclass(frozen=True)
class Children:
    """The names observed.CHILD_KINDS reads (ChildKind.expected) are these fields' JSON names."""
    ray_cluster: str | None = declare("RayCluster name.")
    verify_job: str | None = declare("Verification RayJob name.")
    train_job: str | None = declare("Current training RayJob name.")
    publish_job: str | None = declare("The RayJob publishing the adapter on the base's serving cluster (spec.publish).")
    unpublish_job: str | None = declare("The RayJob removing a deleted fine-tune's adapter (a base).")
    service_account: str | None = declare("The ServiceAccount the Ray pods run as ({name}-workload, or "
                                          "spec.serviceAccountName), bound to a Role that may get and patch only "
                                          "this object's status.")
    ray_service: str | None = declare("RayService serving the model (spec.serve).")


@dataclass(frozen=True)
class Publication:
    eval_loss: float | None = declare("The fine-tune's eval loss it was published with (status.training's best, "
                                      "else its final evalLoss).")
    eval_set: str | None = declare("The eval set that loss was measured on (a fingerprint of spec.evaluation).")
    published_at: str | None = declare("When its publish RayJob was seen to succeed.", format="date-time")


@dataclass(frozen=True)
class Serving:
    service: str | None = declare("KubeRay's Service in front of the Serve proxies.")
    port: int | None = declare("Its port.")
    model: str | None = declare("The model id clients send: the TPUFinetune's name, or <base>:<adapter> for an "
                                "adapter published to a base (spec.publish).")
    base: str | None = declare("spec.publish: the base TPUFinetune that serves the adapter.")
    adapter: str | None = declare("spec.publish: the adapter's name on the base.")
    published: Publication | None = declare("spec.publish: what the served adapter was published with; absent while "
                                            "it is not served.")
    reason: str | None = declare("spec.publish: Publishing, Published, NotPromoted, Superseded, BaseNotServing or "
                                 "PublishFailed.")
    message: str | None = declare("spec.publish: where it is served, or why not (with both eval losses when not "
                                  "promoted).")
    ray_cluster: str | None = declare("The RayService's active RayCluster (a base's adapters are published on it).")
    adapters_root: str | None = declare("A base (spec.serve.adapters): where published adapters are loaded from; a "
                                        "published fine-tune: the base's adapters root it was published under.")
    url: str | None = declare("In-cluster base URL of the OpenAI-compatible API (/v1/...).")
    engine: str | None = declare("vllm or transformers.")
    model_source: str | None = declare("The Hugging Face export being served.")
    not_ready_since: str | None = declare("Since when the app has not been RUNNING (the serve timeout counts from "
                                          "here); absent while it is.", format="date-time")

    def ready(self) -> Serving:
        return replace(self, not_ready_since=None)

    def not_ready(self, since: str) -> Serving:
        return replace(self, not_ready_since=since)


def _chiplets() -> str:
    """'TPU7x: 2 per chip': the generations with more than one device per chip."""
    return ", ".join(f"{g.product}: {g.devices_per_chip} per chip" for g in catalog.GENERATIONS if g.devices_per_chip > 1)


@dataclass(frozen=True)
class Slice:
    accelerator: str | None = declare("Canonical generation.")
    topology: str | None = declare("Shape.")
    slices: int | None = declare("Slices.")
    hosts: int | None = declare("Hosts (VMs) per slice.")
    chips_per_host: int | None = declare("TPU chips per host.")
    devices_per_host: int | None = declare(f"Logical devices per host ({_chiplets()}).")
    devices: int | None = declare("Logical devices across all slices (training workers).")
    ray_accelerator_type: str | None = declare(f"Ray accelerator_type, e.g. {_EXAMPLE_GENERATION.ray_accelerator_type}.")


_SPENT_IN = {
    GoodputCause.PROVISIONING: "Pending and Provisioning (the first slice, or the slice after a resume).",
    GoodputCause.QUEUED: "Queued: waiting for Kueue's admission, first or after a preemption.",
    GoodputCause.VERIFICATION: "VerifyingCollectives.",
    GoodputCause.TRAINING: "Training: the productive seconds.",
    GoodputCause.RECOVERY: "Provisioning a replacement slice after a lost host (reason ReplacingSlice), or every "
                           "slice again after training on fewer (reason Resizing).",
    GoodputCause.SUSPENDED: "Suspended (spec.suspend).",
}


def _seconds_in(cause: GoodputCause) -> Any:
    return declare(f"Seconds in {_SPENT_IN[cause]}", name=cause.key, python_default=0)


@dataclass(frozen=True)
class Goodput:
    """Seconds per cause (tpuft.controller.goodput says which phase counts for which). Each cause's attribute
    is its value (GoodputCause.TRAINING: `training`), its JSON name its key (`trainingSeconds`)."""
    provisioning: int = _seconds_in(GoodputCause.PROVISIONING)
    queued: int = _seconds_in(GoodputCause.QUEUED)
    verification: int = _seconds_in(GoodputCause.VERIFICATION)
    training: int = _seconds_in(GoodputCause.TRAINING)
    recovery: int = _seconds_in(GoodputCause.RECOVERY)
    suspended: int = _seconds_in(GoodputCause.SUSPENDED)
    total: int = declare("Seconds counted (every cause above).", name=GOODPUT_TOTAL, python_default=0)
    ratio: float | None = declare("trainingSeconds / totalSeconds; absent while nothing is counted.", name=GOODPUT_RATIO)

    @classmethod
    def of(cls, seconds: Mapping[GoodputCause, int]) -> Goodput:
        """Every cause (0 where `seconds` has none), the total, and training / total unless it is 0."""
        by_cause = {k: int(seconds.get(k, 0)) for k in GoodputCause}
        total = sum(by_cause.values())
        return cls(**{k.value: v for k, v in by_cause.items()}, total=total,
                   ratio=round(by_cause[GoodputCause.TRAINING] / total, 4) if total else None)

    def seconds(self, cause: GoodputCause) -> int:
        return int(getattr(self, cause.value))

    def add(self, cause: GoodputCause, seconds: int) -> Goodput:
        by_cause = {k: self.seconds(k) for k in GoodputCause}
        by_cause[cause] += seconds
        return Goodput.of(by_cause)


_names_follow(Goodput, [*(k.key for k in GoodputCause), GOODPUT_TOTAL, GOODPUT_RATIO])


@dataclass(frozen=True)
class Adapter:
    name: str | None = declare("The adapter's name.")
    model: str | None = declare("The model id clients send: <base>:<name>.")
    source: str | None = declare("The fine-tune it was published from, namespace/name.")
    uid: str | None = declare("That fine-tune's metadata.uid (the adapter folder's tpuft-publication.json says it).")
    eval_loss: float | None = declare("Its eval loss when published.")
    published_at: str | None = declare("When it was published.", format="date-time")
    unpublishing: bool | None = declare("Its fine-tune was deleted: the adapter is being removed.")


@dataclass(frozen=True)
class Adapters:
    count: int | None = declare("Adapters served (kubectl get's ADAPTERS column).")
    served: tuple[Adapter, ...] | None = declare(
        "One per adapter name: the fine-tune (spec.publish naming this object) whose status.serving says it is "
        "published here.", schema=_array_of(Adapter, "A served adapter.", 256))


# --- what the workload writes (tpuft_workload.report) ---------------------------------------------------
@dataclass(frozen=True)
class Verification:
    passed: bool | None = declare("All checks passed.", name=VerificationStatus.PASSED.value)
    ranks: int | None = declare("Ranks that took part.", name=VerificationStatus.RANKS.value)
    hosts: int | None = declare("Hosts that took part.", name=VerificationStatus.HOSTS.value)
    all_reduce_sum: float | None = declare("all_reduce(rank+1) result.", name=VerificationStatus.ALL_REDUCE_SUM.value)
    expected_sum: float | None = declare("N(N+1)/2.", name=VerificationStatus.EXPECTED_SUM.value)
    max_abs_diff: float | None = declare("Tensor-parallel output vs single-device reference.",
                                         name=VerificationStatus.MAX_ABS_DIFF.value)
    seconds: float | None = declare("Wall time.", name=VerificationStatus.SECONDS.value)
    message: str | None = declare("Detail or failure reason.", name=VerificationStatus.MESSAGE.value)
    storage_error: str | None = declare("Why the run's storage (spec.checkpoint.storagePath) could not be written, "
                                        "found before the collectives ran (reason StorageNotWritable).",
                                        name=VerificationStatus.STORAGE_ERROR.value)


@dataclass(frozen=True)
class LossPoint:
    step: int | None = declare("Optimizer steps done.", name=HistoryPoint.STEP.value)
    loss: float | None = declare("The loss reported at that step.", name=HistoryPoint.LOSS.value)
    tokens_per_second: float | None = declare("The tokensPerSecond reported at that step.",
                                              name=HistoryPoint.TOKENS_PER_SECOND.value)
    eval_loss: float | None = declare("The eval loss, when an evaluation ran at that step.",
                                      name=HistoryPoint.EVAL_LOSS.value)


@dataclass(frozen=True)
class Training:
    epoch: int | None = declare("Current epoch (1-based).", name=TrainingStatus.EPOCH.value)
    epochs: int | None = declare("Total epochs.", name=TrainingStatus.EPOCHS.value)
    step: int | None = declare("Optimizer steps done.", name=TrainingStatus.STEP.value)
    total_steps: int | None = declare("Optimizer steps planned.", name=TrainingStatus.TOTAL_STEPS.value)
    loss: float | None = declare("Mean loss per labelled token of the global batch (all ranks), over the report "
                                 "window.", name=TrainingStatus.LOSS.value)
    tokens_per_second: float | None = declare("Real (non-padding) tokens per second.",
                                              name=TrainingStatus.TOKENS_PER_SECOND.value)
    padded_tokens_per_second: float | None = declare("Tokens per second counting padding.",
                                                     name=TrainingStatus.PADDED_TOKENS_PER_SECOND.value)
    step_time_seconds: float | None = declare("Mean step time.", name=TrainingStatus.STEP_TIME_SECONDS.value)
    pad_fraction: float | None = declare("Fraction of tokens that are padding.", name=TrainingStatus.PAD_FRACTION.value)
    last_checkpoint: str | None = declare("Latest checkpoint path.", name=TrainingStatus.LAST_CHECKPOINT.value)
    resumed_from: str | None = declare("Checkpoint this run resumed from: its own (a retry or restart) or "
                                       "spec.checkpoint.resumeFrom's.", name=TrainingStatus.RESUMED_FROM.value)
    resumed_from_step: int | None = declare("Step of that checkpoint.", name=TrainingStatus.RESUMED_FROM_STEP.value)
    message: str | None = declare("Workload detail, e.g. nothing left to do after resuming at the last step, or why "
                                  "spec.checkpoint.resumeFrom was refused.", name=TrainingStatus.MESSAGE.value)
    exported_model: str | None = declare("Hugging Face format export of the final model (with method lora: a PEFT "
                                         "adapter folder).", name=TrainingStatus.EXPORTED_MODEL.value)
    trainable_parameters: int | None = declare("Parameters the optimizer updates (lora: the adapters only).",
                                               name=TrainingStatus.TRAINABLE_PARAMETERS.value)
    total_parameters: int | None = declare("The model's parameters, adapters included.",
                                           name=TrainingStatus.TOTAL_PARAMETERS.value)
    mfu: float | None = declare(
        "Model FLOPs utilisation, 0 to 1: (6N + 12·L·H·Q·T) FLOPs per token (PaLM's: N parameters, L layers, H·Q "
        "heads x head dim, T maxSeqLength) x tokensPerSecond / the slice's peak bf16 FLOP/s (the catalog's: per TPU "
        "chip x chips, per listed GPU x GPUs); absent on CPU and on a GPU the catalog does not list: no peak to "
        "measure against.", name=TrainingStatus.MFU.value)
    history: tuple[LossPoint, ...] | None = declare(
        f"The loss curve, downsampled: at most {HISTORY_MAX_POINTS} reports, oldest first, evenly spaced in steps "
        "plus the latest (when full, every other point is dropped, the first and the latest kept).",
        name=TrainingStatus.HISTORY.value, schema=_array_of(LossPoint, "One report.", HISTORY_MAX_POINTS))
    updated_at: str | None = declare("When the workload last reported.", format="date-time",
                                     name=TrainingStatus.UPDATED_AT.value)
    learning_rate: float | None = declare("The learning rate of the latest step (spec.training's schedule).",
                                          name=TrainingStatus.LEARNING_RATE.value)
    global_batch_size: int | None = declare("Sequences per optimizer step: devices x batchSizePerDevice x "
                                            "gradientAccumulationSteps (all slices).",
                                            name=TrainingStatus.GLOBAL_BATCH_SIZE.value)
    epoch_loss: float | None = declare("The mean loss per labelled token of the last finished epoch.",
                                       name=TrainingStatus.EPOCH_LOSS.value)
    eval_loss: float | None = declare("Mean loss per labelled token of the eval set (spec.evaluation), at its "
                                      "latest evaluation.", name=TrainingStatus.EVAL_LOSS.value)
    eval_perplexity: float | None = declare("exp(evalLoss).", name=TrainingStatus.EVAL_PERPLEXITY.value)
    best_eval_loss: float | None = declare("The lowest evalLoss so far (with keepBest: the model exported).",
                                           name=TrainingStatus.BEST_EVAL_LOSS.value)
    best_step: int | None = declare("The step of bestEvalLoss.", name=TrainingStatus.BEST_STEP.value)
    checkpoint_request_saved: str | None = declare(
        "The status.recovery.checkpointRequestedAt value the workload answered: every rank saved a committed "
        "checkpoint (lastCheckpoint) at the step boundary after rank 0 saw it, and training went on.",
        name=TrainingStatus.CHECKPOINT_REQUEST_SAVED.value)
    storage_error: str | None = declare("Why the run's storage (spec.checkpoint.storagePath) could not be written: "
                                        "the job refused to start (reason StorageNotWritable).",
                                        name=TrainingStatus.STORAGE_ERROR.value)


_names_follow(Verification, (k.value for k in VerificationStatus))
_names_follow(Training, (k.value for k in TrainingStatus))
_names_follow(LossPoint, (k.value for k in HistoryPoint))


# --- the whole status ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunStatus:
    """The whole status: the operator's keys (OWNED_KEYS) and the workload's blocks, which the
    operator reads and never writes."""
    phase: Phase | None = declare("Where the run is.", enum=tuple(p.value for p in Phase))
    reason: str | None = declare("Why it is in this phase (e.g. ProvisioningTimeout).")
    message: str | None = declare("Human-readable detail for the phase.")
    observed_generation: int | None = declare("The metadata.generation the operator last acted on.")
    applied_generation: int | None = declare("The generation the children were built from; a later spec change "
                                             "during a run is recorded, not half-applied.")
    applied_spec: dict[str, Any] | None = declare(
        "The spec (of appliedGeneration) the children are built from; every child created later in the run is "
        "built from it too, never from a newer spec.",
        schema=lambda: {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
    phase_transition_time: str | None = declare("When the phase last changed.", format="date-time")
    start_time: str | None = declare("When the operator first acted on this object.", format="date-time")
    completion_time: str | None = declare("When it reached Succeeded or Failed.", format="date-time")
    training_attempts: int | None = declare("Training RayJobs submitted so far (1 + retries + resubmissions after a "
                                            "lost submission, status.recovery.lostSubmissions).")
    recovery: Recovery | None = declare("Recovery from what is not the workload's failure: slice replacements after "
                                        "a lost host (spec.recovery), RayJobs resubmitted after KubeRay lost their "
                                        "Ray job, Kueue preemptions.")
    ignored_spec_change: IgnoredSpecChange | None = declare(
        "A spec edit made during the run that the run does not apply (children are built from appliedSpec); gone "
        "once the spec matches it again.")
    conditions: tuple[RunCondition, ...] | None = declare(
        "Conditions; `kubectl wait --for=condition=Ready` works.",
        schema=_array_of(RunCondition, "A condition, as in metav1.Condition.",   # one per type, as kubectl wait reads
                         extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}))
    children: Children | None = declare("Names of the owned objects.")
    serving: Serving | None = declare("Where the fine-tuned model is served (spec.serve), while Serving; with "
                                      "spec.publish, where its adapter is served, or why not.")
    adapters: Adapters | None = declare("A base (spec.serve.adapters): the adapters it serves, derived from the "
                                        "fine-tunes that publish to it.")
    slice: Slice | None = declare("Slice facts derived from accelerator and topology.")
    goodput: Goodput | None = declare("Where the run's wall-clock seconds went, by phase, added each time the phase "
                                      "changes (the phase in progress counts once it ends; Serving is not counted).")
    verification: Verification | None = declare("Collective verification result (written by the workload).")
    training: Training | None = declare("Fine-tuning progress (written by the workload's rank 0).")

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> RunStatus:
        """The status as stored (None: none yet). A phase this version does not know reads as none."""
        raw = dict(raw or {})
        if raw.get("phase") not in _PHASES:
            raw.pop("phase", None)
        return from_json(cls, raw)

    def owned_json(self) -> dict:
        """The keys the operator writes, as JSON: what a merge patch compares."""
        return {k: v for k, v in to_json(self).items() if k in OWNED_KEYS}

    @property
    def reported_step(self) -> int | None:
        """The training step the workload last reported."""
        step = self.training.step if self.training is not None else None
        return step if isinstance(step, int) else None

    def restarted(self) -> RunStatus:
        """A corrected spec starts a run that failed before anything was created: what that run
        recorded about itself goes."""
        return replace(self, phase=None, reason=None, message=None, completion_time=None, phase_transition_time=None,
                       conditions=None, start_time=None, goodput=None)

    def without_resubmission(self) -> RunStatus:
        """The resubmission being waited for is off; the recovery block goes if nothing else is in it."""
        if self.recovery is None or self.recovery.resubmit is None:
            return self
        left = replace(self.recovery, resubmit=None)
        return replace(self, recovery=None if left == Recovery() else left)


_PHASES = {p.value for p in Phase}
OWNED_KEYS = tuple(d.name for d in declared(RunStatus) if d.name not in WORKLOAD_BLOCKS)


def owned(status: Mapping[str, Any] | None) -> dict:
    """The keys of a stored status the operator writes (the workload's blocks left out), as stored."""
    return {k: copy.deepcopy(v) for k, v in (status or {}).items() if k in OWNED_KEYS}


def schema() -> dict:
    """The CRD's status schema."""
    return schema_of(RunStatus, DESCRIPTION)
