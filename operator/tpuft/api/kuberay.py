"""KubeRay's and Ray's names, as the operator and the workload use them: KubeRay's API
(ray-project/kuberay v1.7.0 types, its operator v1.6.2 as built here), its labels, status
vocabulary and Services, and Ray 2.60's own (ports, TPU resources, the memory monitor's words)."""
from __future__ import annotations

import enum


RAY_GROUP = "ray.io"
RAY_VERSION = "v1"

# Ray's memory monitor (the raylet) killing a worker process, in the words of Ray's messages (2.60: "N
# worker(s) were killed due to the node running low on memory", the actor's "Worker exit type:
# NODE_OUT_OF_MEMORY"; earlier: "Task was killed due to ...", ray.exceptions.OutOfMemoryError): the
# training driver finds it in the error Ray Train raises, the operator in the job's message (observed).
RAY_MEMORY_KILL_SIGN = (r"killed due to the node running low on memory|ray\.exceptions\.OutOfMemoryError"
                        r"|Worker exit type: NODE_OUT_OF_MEMORY")
# Ray's memory monitor kills a worker process when Ray's used memory (the cgroup's usage less its
# page cache) passes this fraction of the pod's limit (RAY_memory_usage_threshold's default in 2.60).
RAY_MEMORY_USAGE_THRESHOLD = 0.95
# Ray Train 2.60 starts a PreemptionWatcher actor (Ray imported: about 110 MiB in some pod) unless this is
# "0"; the driver's value reaches Ray Train's controller (ray.train.v2 ENV_VARS_TO_PROPAGATE).
RAY_TRAIN_PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Ray Train 2.60's controller polls each worker this often (2 s by default), and a worker's report()
# waits for the poll that takes its previous one (a result queue of one): reports closer than that
# (short epochs, each end a report; fast steps) wait for it. A 1-step-epoch LoRA run on the local
# node took 2 s a step at 2 s. The driver sets 0.5 s, passed on to the controller like the watcher's.
RAY_TRAIN_HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S = "0.5"
RAY_DASHBOARD_AGENT_PORT = 52365          # the dashboard agent's listen port (KubeRay's default)
RAY_NODE_HEALTH_PATH = "/api/healthz"     # its health check, KubeRay's readiness probe for Ray >= 2.53
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
RAY_NODE_TYPE_LABEL = "ray.io/node-type"   # KubeRay's label on Ray pods (head, worker): the PodMonitor's
# spec.authOptions.mode of every RayCluster and RayService cluster we render. With it KubeRay (v1.6.2)
# creates a Secret named after the RayCluster holding a random token, puts RAY_AUTH_MODE/RAY_AUTH_TOKEN
# on the Ray containers, and gives a clusterSelector RayJob's submitter the same env (from the selected
# RayCluster's authOptions), so RayJobs carry none. The operator never reads that Secret.
RAY_AUTH_MODE_TOKEN = "token"
# That Secret's key holding the token (`tpuft logs` reads it with the user's kubectl rights).
RAY_AUTH_TOKEN_SECRET_KEY = "auth_token"
RAY_HEAD_SERVICE_SUFFIX = "-head-svc"   # KubeRay's head Service, {RayCluster}-head-svc (dashboard port 8265)
# The env KubeRay sets for it. KubeRay leaves a variable a container already has alone, so one set in
# spec.env would switch the auth off or replace the token (RESERVED_ENV below; tpuft.api.spec refuses them).
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
# Labels KubeRay puts on what it creates: every Ray pod gets app.kubernetes.io/name=kuberay and
# created-by=kuberay-operator (pod template labels override them, ray.io/* aside); its own operator pod
# is app.kubernetes.io/component=kuberay-operator in both its Helm chart and its kustomize manifests.
KUBERAY_NAME_LABEL = "app.kubernetes.io/name"
KUBERAY_CREATED_BY_LABEL = "app.kubernetes.io/created-by"
KUBERAY_COMPONENT_LABEL = "app.kubernetes.io/component"
KUBERAY_OPERATOR_COMPONENT = "kuberay-operator"

RAY_TPU_RESOURCE_PER_CHIP_ENV = "RAY_TPU_RESOURCE_PER_CHIP"
RAY_TPU_CUSTOM_RESOURCE = "TPU"  # Ray's logical resource name

# Ray head ports, named and numbered as KubeRay's defaults.
RAY_DASHBOARD_PORT = 8265   # job submission and status: KubeRay's operator and RayJob submitters call it
RAY_PORTS = (("gcs", 6379), ("dashboard", RAY_DASHBOARD_PORT), ("client", 10001))

# A RayJob whose Ray job has ended is finished by KubeRay (jobDeploymentStatus Complete/Failed)
# only once its submitter, still following the job's logs, has exited: seconds, normally. Its
# RayCluster stays until then, for at most this long; past it the RayJob is deleted first, and a
# deleted RayJob holds its RayCluster (deleted or suspended) for at most this long again
# (phases.jobs._release; TPUFT_RAYJOB_GRACE_SECONDS).
RAYJOB_FINISH_GRACE_SECONDS = 60.0

RAY_METRICS_PORT_NAME = "metrics"   # KubeRay's name for the Ray containers' metrics-export port ...
RAY_METRICS_PORT = 8080             # ... and its default number (KubeRay adds it to every Ray container)

# The container runtime signals only PID 1 (`ray start --block`), whose SIGTERM ends raylet and with it
# every Ray worker at once: the training cluster's Ray containers get a preStop hook instead, which runs
# before that SIGTERM, sends SIGTERM to this pod's Ray Train worker processes (found by their process
# title) and waits until they have saved a checkpoint at the next step boundary and exited (the head,
# which hosts the job's driver, waits for the driver to end).
# Ray 2.60 titles a Ray Train worker actor's process "ray::RayTrainWorker" (".<method>" while it runs one).
RAY_TRAIN_WORKER_PROCESS_TITLE = "ray::RayTrainWorker"

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
