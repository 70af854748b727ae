"""Our own names: the ones the operator shares with Kubernetes and the workload. KubeRay's (and
Ray's), Kueue's and GKE's live in tpuft.api.kuberay, tpuft.api.kueue and tpuft.api.gke, each
with the upstream version it follows.

The names that more than one module (or the workload) relies on: API groups, labels, phases,
condition types and statuses, reasons. Closed sets are enums, so a
typo is an AttributeError. Core Kubernetes kinds and field names (ServiceAccount, Role, spec,
metadata) are spelled where they are used; tests/kuberay_standin.py spells KubeRay's strings
literally on purpose, so a wrong constant here fails a test.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from tpuft.api.gke import TPU_NAME_ENV, TPU_SLICE_TOPOLOGY_ANNOTATION, TPU_WEBHOOK_REPLICA_LABEL
from tpuft.api.kuberay import (
    KUBERAY_COMPONENT_LABEL,
    KUBERAY_CREATED_BY_LABEL,
    KUBERAY_NAME_LABEL,
    RAY_AUTH_MODE_ENV,
    RAY_AUTH_TOKEN_ENV,
    RAY_GROUP,
)

# --- Our API -------------------------------------------------------------------------
GROUP = "tpufinetune.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TPUFinetune"
PLURAL = "tpufinetunes"
SINGULAR = "tpufinetune"
SHORT_NAME = "tft"

# --- Ray, as our images carry it (KubeRay's and Ray's own names: tpuft.api.kuberay) -------------
RAY_VERSION_PIN = "2.60.0"   # the Ray the RayCluster runs and the workload image carries

# --- Queueing (Kueue's own names: tpuft.api.kueue) -------------------------------------------
# How often a Queued object looks at its Workload (Kueue's changes to it do not wake the operator;
# admission does: it unsuspends the RayCluster, which is watched).
QUEUE_POLL_SECONDS = 5

# The run's ingress policy (builders.build_network_policy), created by the operator like the workload identity.
NETWORKING_GROUP = "networking.k8s.io"
NETWORKING_VERSION = "v1"
NETWORK_POLICY_KIND = "NetworkPolicy"

# --- Labels and annotations we put on children ----------------------------------------
LABEL_PREFIX = GROUP
LABEL_NAME = f"{LABEL_PREFIX}/name"            # owning TPUFinetune's name
LABEL_COMPONENT = f"{LABEL_PREFIX}/component"  # cluster | verify | train | workload-identity | network-policy | serve
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tpufinetune-operator"


class Component(str, enum.Enum):
    CLUSTER = "cluster"
    VERIFY = "verify"
    TRAIN = "train"
    IDENTITY = "workload-identity"
    NETWORK = "network-policy"
    SERVE = "serve"
    PUBLISH = "publish"       # a LoRA fine-tune's adapter copied under its base's adapters root
    UNPUBLISH = "unpublish"   # an adapter removed from its base's adapters root


# --- The workload's environment, the operator's timings (GKE's names: tpuft.api.gke) ----------
HF_TOKEN_ENV = "HF_TOKEN"


# Environment the workload reads to report progress into its own TPUFinetune.
# How often a new object re-checks that an earlier one of its name has gone (phases.provisioning._wait_for_previous):
# the garbage collector removes a RayCluster's pods within seconds of its owner.
LEFTOVER_POLL_SECONDS = 2.0
# How long one list of a provisioning slice's pods is reused (tpuft.controller.ledger): a stall's cause shows
# within this, and a provisioning object costs one label-selected list per this many seconds.
POD_LIST_INTERVAL_SECONDS = 10.0
POOLS_CACHE_SECONDS = 30.0  # one list of TPU nodes serves every unschedulable slice for this long
RECOVERY_HISTORY_MAX = 10   # status.recovery.history keeps the latest this many losses
# A RayJob KubeRay failed because its submitter completed while the dashboard did not know its Ray
# job (observed.job_lost) is resubmitted as a new RayJob at most this many times per run (training
# and verification together), not counted against training.maxJobRetries: no user code failed. The
# first waits this long, each later one twice the one before (phases.jobs._resubmission_due;
# TPUFT_RESUBMIT_BACKOFF_SECONDS).
LOST_SUBMISSION_RETRIES = 3
LOST_SUBMISSION_BACKOFF_SECONDS = 10.0

# A run's Hugging Face export: {storagePath}/{run name}/export (tpuft_workload.checkpoint writes
# it; the RayService serves it from there).
EXPORT_DIR = "export"
# With spec.training.method lora, EXPORT_DIR holds the PEFT adapter; spec.export.merge (and serving
# with vLLM, which serves merged weights) also writes the base with the adapters merged in here.
EXPORT_MERGED_DIR = "export-merged"
# A base served for adapters (spec.serve.adapters): <run dir>/ADAPTERS_DIR/<adapter>/, each folder complete
# once its PUBLICATION_MARKER is there (written last by `tpuft_workload publish`).
ADAPTERS_DIR = "adapters"
PUBLICATION_MARKER = "tpuft-publication.json"
# The drivers' logs, {storagePath}/{run name}/logs/{verify,train}.log (tpuft_workload.driver_log tees
# them there; `tpuft logs` reads them once the head is gone), and rank 0's TensorBoard event files,
# {storagePath}/{run name}/tensorboard (tpuft_workload.metrics_log).
LOGS_DIR = "logs"
TENSORBOARD_DIR = "tensorboard"
# Rank 0's Prometheus gauges (tpuft_workload.metrics_log.Prometheus, through ray.util.metrics): Ray
# exports each as ray_<name> on every Ray pod's metrics port (KubeRay's container port "metrics",
# 8080), tagged tpufinetune=<the TPUFinetune's name>; the chart's PodMonitor scrapes them and its
# Grafana dashboard plots them (charts/tpufinetune-operator/dashboards/tpufinetune.json).
class TrainMetric(str, enum.Enum):
    TOKENS_PER_SECOND = "tpuft_train_tokens_per_second"
    STEP_TIME_SECONDS = "tpuft_train_step_time_seconds"
    LOSS = "tpuft_train_loss"
    MFU = "tpuft_train_mfu"
    STEP = "tpuft_train_step"

    @property
    def exported(self) -> str:
        """The name Prometheus sees: Ray prefixes application metrics with ray_."""
        return f"ray_{self.value}"


TRAIN_METRIC_TAG = "tpufinetune"

# status.training.history keeps at most this many (step, loss, tokensPerSecond) points
# (tpuft_workload.report.add_point halves it when full): 4352 bytes of JSON at most for 64 points with
# 7-digit steps and 8-digit tokens/s (tests/unit/test_report.py), far below etcd's 1.5 MiB per object.
HISTORY_MAX_POINTS = 64

ENV_CR_NAMESPACE = "TPUFT_NAMESPACE"
ENV_CR_NAME = "TPUFT_NAME"
# The Kubernetes ServiceAccount a Ray pod runs as and its namespace, through the downward API: with
# Workload Identity Federation for GKE, the principal a storage error names
# (.../subject/ns/NAMESPACE/sa/KSA). Kept apart from ENV_CR_NAMESPACE, whose presence turns status reporting on.
SERVICE_ACCOUNT_ENV = "TPUFT_SERVICE_ACCOUNT"
SERVICE_ACCOUNT_NAMESPACE_ENV = "TPUFT_SERVICE_ACCOUNT_NAMESPACE"

# --- Stopping a training pod (tpuft_workload.preemption) ------------------------------------------
# A worker writes <dir>/<pid>.json once its stop checkpoint is committed (the hook logs it).
STOP_MARKER_DIR = "/tmp/tpuft-stop"
# The pod's terminationGracePeriodSeconds (Kubernetes' default is 30). Sized for one training step
# (up to ~60 s for the largest models a slice here trains), one sharded checkpoint save to the run's
# storage (up to ~180 s for a multi-GB FSDP/Orbax state on GCS or Filestore) and 60 s of margin (Ray
# Train's controller notices the workers ended within a poll, the driver prints its result). A node's
# own shutdown budget still caps it: a GKE spot VM gives its pods about 30 s whatever this says.
TRAINING_TERMINATION_GRACE_SECONDS = 300
# A preempted run's RayJobs are deleted once KubeRay reports the RayCluster suspended (its pods gone,
# their preStop hooks done), or at the latest this long after the preemption was seen: past the pods'
# grace period, so a deletion never cuts a rank's stop checkpoint short.
PREEMPTION_STOP_SECONDS = TRAINING_TERMINATION_GRACE_SECONDS + 30
# How long the preStop hook waits: the grace period less what the runtime needs after it (SIGTERM to
# `ray start`, which stops raylet and GCS in seconds).
PRESTOP_WAIT_SECONDS = TRAINING_TERMINATION_GRACE_SECONDS - 15
# The train driver's exit status for a run that stopped on request (SIGTERM) after saving its step:
# the shell's code for "ended by SIGTERM". Not 0, so KubeRay marks the RayJob Failed, not Succeeded.
EXIT_STOPPED = 143


# --- Phases, conditions, reasons ------------------------------------------------------------
class Phase(str, enum.Enum):
    PENDING = "Pending"
    QUEUED = "Queued"     # Kueue has not admitted the RayCluster's Workload (or evicted it): no clock runs
    PROVISIONING = "Provisioning"
    VERIFYING = "VerifyingCollectives"
    TRAINING = "Training"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    SERVING = "Serving"   # not terminal: the model is (being) served until spec.serve.enabled is false

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class Condition(str, enum.Enum):
    ADMITTED = "Admitted"  # Kueue admitted the RayCluster's Workload (only objects with a queue label)
    SLICE_PROVISIONED = "SliceProvisioned"
    COLLECTIVES_VERIFIED = "CollectivesVerified"
    TRAINING_SUCCEEDED = "TrainingSucceeded"
    SERVING = "Serving"  # the RayService is Ready and its app RUNNING
    READY = "Ready"      # overall: True once Succeeded, or while Serving with the app RUNNING
    FAILED = "Failed"    # overall: True once Failed


class ConditionStatus(str, enum.Enum):
    """metav1.Condition status."""
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"

    @classmethod
    def of(cls, flag: bool) -> ConditionStatus:
        return cls.TRUE if flag else cls.FALSE


class Reason(str, enum.Enum):
    # progress
    PENDING = "Pending"  # before the first phase has a reason of its own
    CREATED = "Created"
    WAITING_FOR_SLICE = "WaitingForSlice"
    SLICE_READY = "SliceReady"
    VERIFYING = "Verifying"
    VERIFIED = "Verified"
    VERIFICATION_SKIPPED = "VerificationSkipped"
    TRAINING = "Training"
    TRAINING_COMPLETE = "TrainingComplete"
    SUSPENDED = "Suspended"
    RETRYING = "Retrying"
    WAITING_FOR_PREVIOUS = "WaitingForPrevious"  # an earlier object of this name is still being deleted
    REPLACING_SLICE = "ReplacingSlice"   # a host was lost: waiting for the replaced slice
    TRAINING_ON_FEWER_SLICES = "TrainingOnFewerSlices"   # spec.recovery.elastic: a lost slice not back in time
    RESIZING = "Resizing"     # every slice whole again (spec.recovery.elastic): back to training on all of them
    DEPLOYING = "Deploying"   # the RayService is being created / its Serve app is not RUNNING yet
    SERVING = "Serving"
    SERVE_STOPPED = "ServeStopped"   # spec.serve.enabled set to false: the RayService is deleted
    NOT_TRAINED = "NotTrained"       # spec.training.method none: spec.model is served as it is
    # spec.publish (condition Serving of a LoRA fine-tune, and its reason in Succeeded)
    PUBLISHING = "Publishing"        # the publish RayJob runs on the base's serving cluster
    PUBLISHED = "Published"          # its adapter is served by the base as <base id>:<adapter>
    NOT_PROMOTED = "NotPromoted"     # kept unpublished: not better than the served one (both figures in the message)
    SUPERSEDED = "Superseded"        # a newer fine-tune is published under the same adapter name
    BASE_NOT_SERVING = "BaseNotServing"   # the base is missing or not Serving: published once it is
    PUBLISH_FAILED = "PublishFailed"      # the publish RayJob failed
    UNPUBLISHING = "Unpublishing"    # a base removes the adapter of a fine-tune that was deleted
    FINISHING_RAYJOB = "FinishingRayJob"   # the Ray job ended: waiting for KubeRay to finish its RayJob
    SUBMISSION_LOST = "SubmissionLost"   # KubeRay lost a RayJob's Ray job: resubmitted (c.LOST_SUBMISSION_RETRIES)
    QUEUED = "Queued"         # waiting for Kueue to admit the Workload (Kueue's words in the message)
    WAITING_FOR_CAPACITY = "WaitingForCapacity"   # quota reserved; an admission check (a ProvisioningRequest) pending
    REQUEUING = "Requeuing"   # the booking was revoked or expired: the RayCluster is made again for a new Workload
    PREEMPTED = "Preempted"   # Kueue evicted the admitted Workload: the jobs stop, checkpoints stay
    ADMITTED = "Admitted"     # Kueue admitted it (condition Admitted)
    KUEUE_NOT_INSTALLED = "KueueNotInstalled"   # a queue label where no Workload API is served
    # failures
    INVALID_SPEC = "InvalidSpec"
    PROVISIONING_TIMEOUT = "ProvisioningTimeout"
    QUEUE_TIMEOUT = "QueueTimeout"   # not admitted within spec.queueTimeoutSeconds
    CAPACITY_REJECTED = "CapacityRejected"   # Kueue rejected an admission check (the ProvisioningRequest Failed for good)
    ADMISSION_REJECTED = "AdmissionRejected"
    COLLECTIVE_TIMEOUT = "CollectiveTimeout"
    # the run's storage (spec.checkpoint.storagePath) could not be written, found by the verify or train job
    STORAGE_NOT_WRITABLE = "StorageNotWritable"
    VERIFICATION_FAILED = "VerificationFailed"
    TRAINING_FAILED = "TrainingFailed"
    OUT_OF_MEMORY = "OutOfMemory"   # a worker (or the head) killed for memory: by the kernel's OOM killer or Ray's monitor
    CHILD_DELETED = "ChildDeleted"
    SLICE_LOST = "SliceLost"   # a host lost once more than spec.recovery.maxSliceReplacements allows
    SERVE_FAILED = "ServeFailed"   # the Serve app not RUNNING within spec.serve.timeoutSeconds
    BASE_MISMATCH = "BaseMismatch"   # spec.publish.to names another model, or an object that serves no adapters
    # notices (events / status.ignoredSpecChange; not phases)
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
    TTL_EXPIRED = "TTLExpired"
    SLICE_BLOCKED = "SliceBlocked"   # a new cause keeps the slice from coming up (tpuft.controller.diagnosis)
    SPEC_WARNING = "SpecWarning"     # what the spec may get wrong but is not refused for (spec.spec_warnings)
    MAINTENANCE_NOTICE = "MaintenanceNotice"   # GKE's notice on a node under the slice: a checkpoint is asked for
    RECONCILE_ERROR = "ReconcileError"


class Provisioning(str, enum.Enum):
    """spec.scheduling.provisioning: how the slice's capacity is obtained."""
    STANDARD = "standard"      # nodes already there or made by the autoscaler (on-demand, Spot or a reservation)
    FLEX_START = "flexStart"   # GKE flex-start with queued provisioning: a ProvisioningRequest through Kueue


class ImagePullPolicy(str, enum.Enum):
    """spec.imagePullPolicy: a Kubernetes container's imagePullPolicy, in Kubernetes' order."""
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class ServeEngine(str, enum.Enum):
    """spec.serve.engine: what answers the OpenAI-compatible API."""
    VLLM = "vllm"                  # Ray Serve LLM (ray.serve.llm) on vLLM: the TPU default
    TRANSFORMERS = "transformers"  # tpuft_workload.serve: plain transformers generate(), the CPU default


class DatasetFormat(str, enum.Enum):
    """spec.dataset.format: how to read a file whose name's suffix does not say."""
    JSON = "json"        # JSON lines (or a JSON array)
    PARQUET = "parquet"


class DatasetType(str, enum.Enum):
    """spec.dataset.type: what a record holds; left out, its columns say (tpuft.api.records)."""
    MESSAGES = "messages"                    # {"messages": [{"role", "content"}, ...]}: OpenAI's chat fine-tuning
    PROMPT_COMPLETION = "promptCompletion"   # {"prompt", "completion"}: one user turn, one answer
    INSTRUCTION = "instruction"              # dolly (instruction, context, response), alpaca (instruction, input, output)
    TEXT = "text"                            # {"text"}: every token trained (continued pre-training)


# spec.dataset.columns' keys: the column names a record type reads (its values: the user's names).
DATASET_COLUMN_KEYS = ("messages", "prompt", "completion", "instruction", "input", "response", "text")


class Overlong(str, enum.Enum):
    """spec.dataset.overlong: an example longer than spec.training.maxSeqLength."""
    TRUNCATE = "truncate"   # its first maxSeqLength tokens are trained (dropped when no answer token is left)
    DROP = "drop"           # left out


class TrainingFramework(str, enum.Enum):
    """spec.training.framework: which Ray Train trainer fine-tunes the model."""
    TORCH = "torch"      # TorchTrainer + FSDP2, one worker per device
    JAX = "jax"          # JaxTrainer, one worker per host (tpuft_workload.jax_train)


class LearningRateSchedule(str, enum.Enum):
    """spec.training.learningRateSchedule: the rate after the warmup."""
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class TrainingMethod(str, enum.Enum):
    """spec.training.method: which weights a run trains."""
    FULL = "full"    # every weight: FSDP2 shards weights, gradients and AdamW state
    LORA = "lora"    # low-rank adapters beside the frozen, sharded base (PEFT; tpuft_workload.lora)
    NONE = "none"    # nothing trained: spec.model is served as it is (a base for adapters, spec.serve.adapters)


class PublishWhen(str, enum.Enum):
    """spec.publish.when: which LoRA fine-tune is served under an adapter name already served."""
    ALWAYS = "always"       # the newest publication replaces the served one
    IF_BETTER = "ifBetter"  # only an eval loss below the served one's minus spec.publish.margin, on the same eval set


# spec.training.lora.targetModules when left out, by the model's Hugging Face `model_type`: the
# attention and MLP projections (PEFT matches these names as the last part of a module's path).
# The workload resolves it on the driver, before any worker starts; docs/lora.md lists it.
_LLAMA_STYLE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_DEFAULT_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    model_type: _LLAMA_STYLE_PROJECTIONS
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text",
                       "gemma4", "gemma4_text")
}


class EventType(str, enum.Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


# --- Status keys the workload writes (tpuft_workload.report) ---------------------------------------
# The CRD's status schema declares exactly these (tpuft.api.status declares them by these names): the API server
# prunes unknown status fields silently, so a key missing there would vanish without an error.
class VerificationStatus(str, enum.Enum):
    """status.verification, written by the verify job."""
    PASSED = "passed"
    RANKS = "ranks"
    HOSTS = "hosts"
    ALL_REDUCE_SUM = "allReduceSum"
    EXPECTED_SUM = "expectedSum"
    MAX_ABS_DIFF = "maxAbsDiff"
    SECONDS = "seconds"
    MESSAGE = "message"
    STORAGE_ERROR = "storageError"   # the run's storage could not be written: checked before any collective


class TrainingStatus(str, enum.Enum):
    """status.training, written by the training job's rank 0."""
    EPOCH = "epoch"
    EPOCHS = "epochs"
    STEP = "step"
    TOTAL_STEPS = "totalSteps"
    LOSS = "loss"
    TOKENS_PER_SECOND = "tokensPerSecond"
    PADDED_TOKENS_PER_SECOND = "paddedTokensPerSecond"
    STEP_TIME_SECONDS = "stepTimeSeconds"
    PAD_FRACTION = "padFraction"
    LAST_CHECKPOINT = "lastCheckpoint"
    RESUMED_FROM = "resumedFrom"
    RESUMED_FROM_STEP = "resumedFromStep"
    MESSAGE = "message"
    EXPORTED_MODEL = "exportedModel"
    TRAINABLE_PARAMETERS = "trainableParameters"   # what the optimizer updates (LoRA: the adapters only)
    TOTAL_PARAMETERS = "totalParameters"           # the model's, adapters included
    MFU = "mfu"            # model FLOPs utilisation (tpuft_workload.report.mfu); absent without a catalog peak
    HISTORY = "history"    # at most HISTORY_MAX_POINTS HistoryPoint objects, oldest first
    UPDATED_AT = "updatedAt"
    LEARNING_RATE = "learningRate"          # the scheduled rate of the latest step
    GLOBAL_BATCH_SIZE = "globalBatchSize"   # sequences per optimizer step
    EPOCH_LOSS = "epochLoss"                # the last finished epoch's mean loss (not in the per-report series)
    EVAL_LOSS = "evalLoss"                  # the latest evaluation's (spec.evaluation)
    EVAL_PERPLEXITY = "evalPerplexity"
    BEST_EVAL_LOSS = "bestEvalLoss"
    BEST_STEP = "bestStep"                  # the step of bestEvalLoss
    # status.recovery.checkpointRequestedAt answered: a committed checkpoint saved after it was seen
    CHECKPOINT_REQUEST_SAVED = "checkpointRequestSaved"
    STORAGE_ERROR = "storageError"   # the run's storage could not be written: the job refused to start


class HistoryPoint(str, enum.Enum):
    """One point of status.training.history."""
    STEP = "step"
    LOSS = "loss"
    TOKENS_PER_SECOND = "tokensPerSecond"
    EVAL_LOSS = "evalLoss"   # when an evaluation ran at that step


# --- status.goodput, written by the operator (tpuft.controller.goodput) -----------------------------------------
class GoodputCause(str, enum.Enum):
    """Where a run's wall-clock seconds went, by the phase (and reason) they were spent in."""
    PROVISIONING = "provisioning"   # Pending, Provisioning (the first slice, or after a resume)
    QUEUED = "queued"               # Queued: waiting for Kueue's admission (first, or after a preemption)
    VERIFICATION = "verification"   # VerifyingCollectives
    TRAINING = "training"           # Training: the productive seconds
    RECOVERY = "recovery"           # Provisioning a replacement slice after a lost host (ReplacingSlice)
    SUSPENDED = "suspended"         # Suspended (spec.suspend)

    @property
    def key(self) -> str:
        return f"{self.value}Seconds"


GOODPUT_TOTAL = "totalSeconds"
GOODPUT_RATIO = "ratio"




# --- Catalog-facing names ------------------------------------------------------------------
CPU_ACCELERATOR = "cpu"


# --- Ray Serve (the RayService's serveConfigV2; tpuft_workload.serve answers the same names) ----------
SERVE_APP_NAME = "llm"               # the one Serve application of a TPUFinetune's RayService
SERVE_PORT = 8000                    # Ray Serve's HTTP proxy; KubeRay's serve Service exposes it
SERVE_TRANSFORMERS_IMPORT_PATH = "tpuft_workload.serve:build_app"
SERVE_VLLM_IMPORT_PATH = "ray.serve.llm:build_openai_app"
SERVE_DEPLOYMENT_NAME = "ChatDeployment"   # the transformers engine's deployment (tpuft_workload.serve)
TPU_MULTIHOST_BACKEND_ENV = "TPU_MULTIHOST_BACKEND"   # vLLM TPU: "ray" spreads a model over the slice's hosts
# The transformers engine's application (tpuft_workload.serve.build_app reads these too):
SERVE_ROUTE_PREFIX = "/"                    # applications[].route_prefix
SERVE_CHAT_PATH = "/v1/chat/completions"    # OpenAI-compatible paths under the prefix (tpuft.cli.chat posts here)
SERVE_COMPLETIONS_PATH = "/v1/completions"
SERVE_MODELS_PATH = "/v1/models"
# spec.serve.apiKeySecret: the operator sets this env on the serving pods' Ray containers (head and
# workers) from that Secret, by secretKeyRef only; the app then answers /v1/* only with
# `Authorization: Bearer <key>` (tpuft chat reads the Secret and sends it).
SERVE_API_KEY_ENV = "TPUFT_SERVE_API_KEY"
SERVE_API_KEY_SECRET_KEY = "api-key"   # spec.serve.apiKeySecret.key when not given


class ServeArg(str, enum.Enum):
    """Keys of the transformers application's applications[].args (tpuft_workload.serve.build_app)."""
    MODEL_SOURCE = "model_source"              # required: the Hugging Face export folder (or a gs:// URI)
    MODEL_ID = "model_id"                      # required: the name clients send and /v1/models lists
    MAX_MODEL_LEN = "max_model_len"            # optional int: prompt + completion tokens at most
    MAX_TOKENS_DEFAULT = "max_tokens_default"  # optional int: completion tokens when a request gives none
    MAX_BATCH_SIZE = "max_batch_size"          # optional int: requests generated together (1: one at a time)
    ADAPTERS_ROOT = "adapters_root"            # optional URI: published LoRA adapters, one folder each
    MAX_ADAPTERS = "max_adapters"              # optional int: adapters loaded per replica at most (LRU)


# --- spec.labels / spec.annotations keys that are not the user's ---------------------------------------
@dataclass(frozen=True)
class Reserved:
    """Keys of one map (spec.labels or spec.annotations) refused by tpuft.api.spec and the CRD's CEL rule,
    each exact key and prefix with who relies on it (the refusal says so)."""
    prefixes: tuple[tuple[str, str], ...]
    keys: tuple[tuple[str, str], ...]

    def why(self, key: str) -> str | None:
        """Who relies on `key`, or None when it is the user's to set."""
        return dict(self.keys).get(key) or next((w for p, w in self.prefixes if key.startswith(p)), None)


_RESERVED_PREFIXES = (
    (f"{LABEL_PREFIX}/", "the operator's own prefix (its children and pods are found by these labels)"),
    (f"{RAY_GROUP}/", "KubeRay's prefix (it selects and configures Ray pods by these labels and annotations)"),
)
RESERVED_LABELS = Reserved(prefixes=_RESERVED_PREFIXES, keys=(
    (LABEL_MANAGED_BY, f"the operator marks its children {MANAGED_BY} with it"),
    (KUBERAY_NAME_LABEL, "KubeRay labels every Ray pod kuberay with it and the TPU webhook selects pods by it"),
    (KUBERAY_CREATED_BY_LABEL, "KubeRay labels every Ray pod with it"),
    (KUBERAY_COMPONENT_LABEL, "the run's NetworkPolicy admits the KubeRay operator's pods by it"),
    (TPU_WEBHOOK_REPLICA_LABEL, "the TPU webhook writes it (a slice replica's index)"),
))
RESERVED_ANNOTATIONS = Reserved(prefixes=_RESERVED_PREFIXES, keys=(
    (TPU_SLICE_TOPOLOGY_ANNOTATION, "the TPU webhook would take the slice shape from it instead of spec.topology"),
))
# spec.env names that are not the user's either: (name, who sets it).
RESERVED_ENV = (
    (RAY_AUTH_MODE_ENV, "KubeRay sets it for token auth (authOptions); set here it could switch the auth off"),
    (RAY_AUTH_TOKEN_ENV, "KubeRay sets it from the RayCluster's token Secret"),
    (SERVE_API_KEY_ENV, "it comes from spec.serve.apiKeySecret; set that instead"),
    (TPU_NAME_ENV, "the TPU webhook (or, one worker group per slice, the operator) names each slice by it"),
    (SERVICE_ACCOUNT_ENV, "the operator sets it from the pod's own spec.serviceAccountName (downward API)"),
    (SERVICE_ACCOUNT_NAMESPACE_ENV, "the operator sets it from the pod's namespace (downward API)"),
)
