"""Every name the operator shares with Kubernetes, KubeRay and the workload, in one place.

The names that more than one module (or the workload) relies on: API groups, labels, phases,
condition types and statuses, reasons, KubeRay's status vocabulary. Closed sets are enums, so a
typo is an AttributeError. Core Kubernetes kinds and field names (ServiceAccount, Role, spec,
metadata) are spelled where they are used; tests/kuberay_standin.py spells KubeRay's strings
literally on purpose, so a wrong constant here fails a test.
"""
from __future__ import annotations

import enum

# --- Our API -------------------------------------------------------------------------
GROUP = "tpufinetune.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TPUFinetune"
PLURAL = "tpufinetunes"
SINGULAR = "tpufinetune"
SHORT_NAME = "tft"

# --- KubeRay's API (ray-project/kuberay v1.7.0) --------------------------------------
RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_API_VERSION = f"{RAY_GROUP}/{RAY_VERSION}"
RAYCLUSTER_KIND = "RayCluster"
RAYCLUSTER_PLURAL = "rayclusters"
RAYJOB_KIND = "RayJob"
RAYJOB_PLURAL = "rayjobs"
RAYSERVICE_KIND = "RayService"
RAYSERVICE_PLURAL = "rayservices"
RAYSERVICE_MAX_NAME_LENGTH = 47   # KubeRay rejects longer RayService names (its Services add suffixes)
RAYSERVICE_SERVE_SVC_SUFFIX = "-serve-svc"   # KubeRay's Service in front of the Serve proxies
RAY_CLUSTER_LABEL = "ray.io/cluster"  # KubeRay's clusterSelector key

# --- Labels and annotations we put on children ----------------------------------------
LABEL_PREFIX = GROUP
LABEL_NAME = f"{LABEL_PREFIX}/name"            # owning TPUFinetune's name
LABEL_COMPONENT = f"{LABEL_PREFIX}/component"  # cluster | verify | train | workload-identity
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tpufinetune-operator"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


class Component(str, enum.Enum):
    CLUSTER = "cluster"
    VERIFY = "verify"
    TRAIN = "train"
    IDENTITY = "workload-identity"
    SERVE = "serve"


# --- GKE / TPU ---------------------------------------------------------------------------
TPU_RESOURCE = "google.com/tpu"
GKE_TPU_ACCELERATOR_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
GKE_SPOT_SELECTOR = "cloud.google.com/gke-spot"
GKE_RESERVATION_NAME_SELECTOR = "cloud.google.com/reservation-name"
GKE_RESERVATION_AFFINITY_SELECTOR = "cloud.google.com/reservation-affinity"
RAY_TPU_RESOURCE_PER_CHIP_ENV = "RAY_TPU_RESOURCE_PER_CHIP"
RAY_TPU_CUSTOM_RESOURCE = "TPU"  # Ray's logical resource name
HF_TOKEN_ENV = "HF_TOKEN"

# Ray head ports (KubeRay defaults; the seed names them the same way).
RAY_PORTS = (("gcs", 6379), ("dashboard", 8265), ("client", 10001))

# Environment the workload reads to report progress into its own TPUFinetune.
# How often a new object re-checks that an earlier one of its name has gone (phases._wait_for_previous):
# the garbage collector removes a RayCluster's pods within seconds of its owner.
LEFTOVER_POLL_SECONDS = 2.0
# How long one list of a provisioning slice's pods is reused (tpuft.ledger): a stall's cause shows
# within this, and a provisioning object costs one label-selected list per this many seconds.
POD_LIST_INTERVAL_SECONDS = 10.0
POOLS_CACHE_SECONDS = 30.0  # one list of TPU nodes serves every unschedulable slice for this long
RECOVERY_HISTORY_MAX = 10   # status.recovery.history keeps the latest this many losses
# A RayJob whose Ray job has ended is finished by KubeRay (jobDeploymentStatus Complete/Failed)
# only once its submitter, still following the job's logs, has exited: seconds, normally. Its
# RayCluster stays until then, for at most this long; past it the RayJob is deleted first, and a
# deleted RayJob holds its RayCluster (deleted or suspended) for at most this long again
# (phases._release; TPUFT_RAYJOB_GRACE_SECONDS).
RAYJOB_FINISH_GRACE_SECONDS = 60.0
# A RayJob KubeRay failed because its submitter completed while the dashboard did not know its Ray
# job (observed.job_lost) is resubmitted as a new RayJob at most this many times per run (training
# and verification together), not counted against training.maxJobRetries: no user code failed. The
# first waits this long, each later one twice the one before (phases._resubmission_due;
# TPUFT_RESUBMIT_BACKOFF_SECONDS).
LOST_SUBMISSION_RETRIES = 3
LOST_SUBMISSION_BACKOFF_SECONDS = 10.0

# A run's Hugging Face export: {storagePath}/{run name}/export (tpuft_workload.checkpoint writes
# it; the RayService serves it from there).
EXPORT_DIR = "export"

ENV_CR_NAMESPACE = "TPUFT_NAMESPACE"
ENV_CR_NAME = "TPUFT_NAME"


# --- Phases, conditions, reasons ------------------------------------------------------------
class Phase(str, enum.Enum):
    PENDING = "Pending"
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
    DEPLOYING = "Deploying"   # the RayService is being created / its Serve app is not RUNNING yet
    SERVING = "Serving"
    SERVE_STOPPED = "ServeStopped"   # spec.serve.enabled set to false: the RayService is deleted
    FINISHING_RAYJOB = "FinishingRayJob"   # the Ray job ended: waiting for KubeRay to finish its RayJob
    SUBMISSION_LOST = "SubmissionLost"   # KubeRay lost a RayJob's Ray job: resubmitted (c.LOST_SUBMISSION_RETRIES)
    # failures
    INVALID_SPEC = "InvalidSpec"
    PROVISIONING_TIMEOUT = "ProvisioningTimeout"
    ADMISSION_REJECTED = "AdmissionRejected"
    COLLECTIVE_TIMEOUT = "CollectiveTimeout"
    VERIFICATION_FAILED = "VerificationFailed"
    TRAINING_FAILED = "TrainingFailed"
    CHILD_DELETED = "ChildDeleted"
    SLICE_LOST = "SliceLost"   # a host lost once more than spec.recovery.maxSliceReplacements allows
    SERVE_FAILED = "ServeFailed"   # the Serve app not RUNNING within spec.serve.timeoutSeconds
    # notices (events / status.ignoredSpecChange; not phases)
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
    TTL_EXPIRED = "TTLExpired"
    SLICE_BLOCKED = "SliceBlocked"   # a new cause keeps the slice from coming up (tpuft.diagnosis)
    RECONCILE_ERROR = "ReconcileError"


class ServeEngine(str, enum.Enum):
    """spec.serve.engine: what answers the OpenAI-compatible API."""
    VLLM = "vllm"                  # Ray Serve LLM (ray.serve.llm) on vLLM: the TPU default
    TRANSFORMERS = "transformers"  # tpuft_workload.serve: plain transformers generate(), the CPU default


class DatasetFormat(str, enum.Enum):
    """spec.dataset.format: how to read a file whose name's suffix does not say."""
    JSON = "json"        # JSON lines (or a JSON array)
    PARQUET = "parquet"


class TrainingFramework(str, enum.Enum):
    """spec.training.framework: which Ray Train trainer fine-tunes the model."""
    TORCH = "torch"      # TorchTrainer + FSDP2, one worker per device
    JAX = "jax"          # JaxTrainer, one worker per host (tpuft_workload.jax_train)


class EventType(str, enum.Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


# --- Status keys the workload writes (tpuft_workload.report) ---------------------------------------
# The CRD's status schema declares exactly these (tpuft.crd builds it from them): the API server
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
    UPDATED_AT = "updatedAt"


# --- KubeRay status vocabulary (ray-project/kuberay v1.7.0, ray-operator/apis/ray/v1/) ----
RAYCLUSTER_PROVISIONED = "RayClusterProvisioned"   # RayCluster condition type
RAYCLUSTER_HEAD_POD_READY = "HeadPodReady"
RAYCLUSTER_REPLICA_FAILURE = "ReplicaFailure"
RAYCLUSTER_SUSPENDING = "RayClusterSuspending"
RAYCLUSTER_SUSPENDED = "RayClusterSuspended"
RAYCLUSTER_STATE_READY = "ready"                   # status.state (deprecated but still set)


class JobStatus(str, enum.Enum):
    """RayJob status.jobStatus (Ray's job status)."""
    NEW = ""
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


class JobDeploymentStatus(str, enum.Enum):
    """RayJob status.jobDeploymentStatus (KubeRay's view)."""
    NEW = ""
    INITIALIZING = "Initializing"
    RUNNING = "Running"
    COMPLETE = "Complete"
    FAILED = "Failed"
    VALIDATION_FAILED = "ValidationFailed"
    SUSPENDING = "Suspending"
    SUSPENDED = "Suspended"
    RETRYING = "Retrying"
    WAITING = "Waiting"


RAYJOB_REASON_DEADLINE_EXCEEDED = "DeadlineExceeded"   # status.reason after activeDeadlineSeconds
RAYJOB_REASON_APP_FAILED = "AppFailed"
# status.message (reason AppFailed) once the submitter Job has completed and the dashboard answers 404
# for the job id (v1.6.2 controllers/ray/rayjob_controller.go, the Running case); matched as a prefix.
RAYJOB_MESSAGE_JOB_NOT_FOUND = "Submitter completed but Ray job not found in RayCluster"
RAYSERVICE_READY = "Ready"   # RayService condition type (v1.3+)


class ServeAppStatus(str, enum.Enum):
    """RayService status.{active,pending}ServiceStatus.applicationStatuses.<app>.status (Ray Serve's)."""
    NOT_STARTED = "NOT_STARTED"
    DEPLOYING = "DEPLOYING"
    RUNNING = "RUNNING"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    DELETING = "DELETING"
    UNHEALTHY = "UNHEALTHY"


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
SERVE_CHAT_PATH = "/v1/chat/completions"    # OpenAI-compatible paths under the prefix (tpuft.chat posts here)
SERVE_MODELS_PATH = "/v1/models"


class ServeArg(str, enum.Enum):
    """Keys of the transformers application's applications[].args (tpuft_workload.serve.build_app)."""
    MODEL_SOURCE = "model_source"              # required: the Hugging Face export folder (or a gs:// URI)
    MODEL_ID = "model_id"                      # required: the name clients send and /v1/models lists
    MAX_MODEL_LEN = "max_model_len"            # optional int: prompt + completion tokens at most
    MAX_TOKENS_DEFAULT = "max_tokens_default"  # optional int: completion tokens when a request gives none
