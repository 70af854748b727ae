"""Types the reconciler passes around (observation in, decision out) and how KubeRay's status
fields are read, and the table of child kinds (CHILD_KINDS). Pure, like tpuft.controller.phases.
"""
from __future__ import annotations

import copy
import enum
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Collection, Iterable, Mapping

from tpuft.controller import builders
from tpuft.api import constants as c
from tpuft.api import kuberay
from tpuft.api import kueue
from tpuft.api.constants import Condition, ConditionStatus, EventType, Reason
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.hosts import NodeObs
from tpuft.api.spec import TPUFinetune

LIVE_SPEC_FIELDS = ("suspend", "ttlSecondsAfterFinished")
SERVE_ENABLED_FIELD = "spec.serve.enabled"   # acts live when set to false: serving stops
CONDITION_ORDER = (Condition.ADMITTED, Condition.SLICE_PROVISIONED, Condition.COLLECTIVES_VERIFIED, Condition.TRAINING_SUCCEEDED,
                   Condition.SERVING, Condition.READY, Condition.FAILED)
FAILED_JOB_STATES = {kuberay.JobDeploymentStatus.FAILED.value, kuberay.JobDeploymentStatus.VALIDATION_FAILED.value}
FAILED_JOB_STATUSES = {kuberay.JobStatus.FAILED.value, kuberay.JobStatus.STOPPED.value}
ENDED_JOB_STATUSES = {kuberay.JobStatus.SUCCEEDED.value, *FAILED_JOB_STATUSES}   # KubeRay's IsJobTerminal
DONE_JOB_STATES = {kuberay.JobDeploymentStatus.COMPLETE.value, kuberay.JobDeploymentStatus.FAILED.value}   # IsJobDeploymentTerminal
DEFAULT_VERIFY_GRACE_SECONDS = builders.VERIFY_DEADLINE_GRACE_SECONDS


@dataclass(frozen=True)
class IndexedChild:
    """A child (CHILD_KINDS) as kopf's index keeps it (handlers.py), or as a GET confirmed it."""
    name: str
    status: Mapping[str, Any] = field(default_factory=dict)
    suspend: bool = False             # spec.suspend
    deleting: bool = False            # metadata.deletionTimestamp is set
    generation: int | None = None     # metadata.generation
    # The UID of the TPUFinetune that owns it: a re-created object of the same name must not
    # take the previous object's children (same names) for its own while the garbage
    # collector is still removing them.
    owner_uid: str | None = None
    uid: str | None = None            # its own metadata.uid: the owner its pods name

    @classmethod
    def of(cls, name: str, spec: Mapping | None, status: Mapping | None, meta: Mapping) -> IndexedChild:
        owners = [o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("kind") == c.KIND]
        return cls(name, copy.deepcopy(dict(status or {})), bool((spec or {}).get("suspend")),
                   bool(meta.get("deletionTimestamp")), meta.get("generation"), owners[0] if owners else None,
                   meta.get("uid"))

    def belongs_to(self, uid: str | None) -> bool:
        return self.owner_uid is None or not uid or self.owner_uid == uid


@dataclass(frozen=True)
class ClusterObs:
    name: str
    status: Mapping[str, Any] = field(default_factory=dict)
    suspended: bool = False          # spec.suspend as the object says
    generation: int | None = None    # metadata.generation: status older than this is stale
    uid: str | None = None           # metadata.uid: the owner KubeRay writes on its pods


@dataclass(frozen=True)
class JobObs:
    name: str
    status: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServiceObs:
    """The RayService serving the model (spec.serve)."""
    name: str
    status: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckObs:
    """One of a Workload's status.admissionChecks: a ClusterQueue's AdmissionCheck (e.g. Kueue's
    ProvisioningRequest check, whose message is the ProvisioningRequest's own condition message)."""
    name: str
    state: str        # Pending, Ready, Retry or Rejected (c.CHECK_*)
    message: str = ""


@dataclass(frozen=True)
class QueueObs:
    """Kueue's view of the RayCluster (its Workload), read only for objects with a queue label
    while Kueue's answer matters (phases.wants_queue). `installed` False: no Workload API served."""
    installed: bool = True
    workload: str | None = None     # None: Kueue has not made one (yet)
    admitted: bool = False
    waiting: str = ""               # QuotaReserved=False: why not admitted, in Kueue's words
    evicted: str = ""               # Evicted=True: "<reason>: <message>" (Preempted, InactiveWorkload, ...)
    quota_reserved: bool = False    # QuotaReserved=True: what is left is the admission checks
    active: bool = True             # spec.active; Kueue sets it false when it rejects an admission check
    checks: tuple[CheckObs, ...] = ()
    # For a Rejected check, the ProvisioningRequest's lost booking: "CapacityRevoked: <message>" or
    # "BookingExpired: <message>" (a preemption: requeued); "" when it Failed instead (or none was read).
    booking_lost: str = ""
    booking_read: bool = True       # False: a Rejected check's ProvisioningRequests could not be read

    @classmethod
    def of(cls, workload: Mapping[str, Any] | None,
           provisioning_requests: tuple[Mapping[str, Any], ...] | None = ()) -> QueueObs:
        """From the Workload and, for a Rejected check, the ProvisioningRequests it owns (None: not
        readable)."""
        if workload is None:
            return cls()
        status = workload.get("status") or {}
        conditions = {x.get("type"): x for x in status.get("conditions") or []}

        def true(ctype: str) -> dict | None:
            found = conditions.get(ctype) or {}
            return found if found.get("status") == "True" else None
        quota = conditions.get(kueue.KUEUE_QUOTA_RESERVED) or {}
        evicted = true(kueue.KUEUE_EVICTED)
        name = (workload.get("metadata") or {}).get("name")
        checks = tuple(CheckObs(str(x.get("name", "")), str(x.get("state", "")), str(x.get("message") or ""))
                       for x in status.get("admissionChecks") or [])
        return cls(workload=name, admitted=true(kueue.KUEUE_ADMITTED) is not None,
                   waiting=quota.get("message", "") if quota.get("status") != "True" else "",
                   evicted=f"{evicted.get('reason', '')}: {evicted.get('message', '')}" if evicted else "",
                   quota_reserved=quota.get("status") == "True",
                   active=(workload.get("spec") or {}).get("active", True) is not False, checks=checks,
                   booking_lost=booking_lost(name, provisioning_requests or ()),
                   booking_read=provisioning_requests is not None)

    @property
    def pending_check(self) -> CheckObs | None:
        """The first admission check not yet Ready (what the quota-reserved Workload waits for)."""
        return next((x for x in self.checks if x.state != kueue.CHECK_READY), None)

    @property
    def capacity_check(self) -> CheckObs | None:
        """Quota reserved and not evicted: the admission check still waited for (for Kueue's
        ProvisioningRequest check, the capacity itself), or None."""
        return self.pending_check if self.quota_reserved and not self.evicted else None

    @property
    def rejected_check(self) -> CheckObs | None:
        return next((x for x in self.checks if x.state == kueue.CHECK_REJECTED), None)

    @property
    def check_rejected(self) -> bool:
        """Kueue rejected an admission check: the check says so, or (once the eviction has reset the
        checks to Pending) the deactivated Workload's eviction reason does."""
        return self.rejected_check is not None or (not self.active and self.evicted.startswith(
            kueue.KUEUE_DEACTIVATED_BY_CHECK))


def booking_lost(workload: str | None, requests: tuple[Mapping[str, Any], ...]) -> str:
    """The newest of the Workload's ProvisioningRequests (Kueue makes one per attempt, owned by the
    Workload): "<condition>: <message>" when its booking was revoked or expired, else ""."""
    owned = [r for r in requests if any(o.get("kind") == kueue.WORKLOAD_KIND and o.get("name") == workload
                                        for o in (r.get("metadata") or {}).get("ownerReferences") or [])]
    if not owned:
        return ""
    newest = max(owned, key=lambda r: (r.get("metadata") or {}).get("creationTimestamp") or "")
    for x in (newest.get("status") or {}).get("conditions") or []:
        if x.get("type") in (kueue.PROVREQ_CAPACITY_REVOKED, kueue.PROVREQ_BOOKING_EXPIRED) and x.get("status") == "True":
            return f"{x['type']}: {x.get('message', '')}"
    return ""


def section(obj: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    """obj[key] when it is an object, else empty: a peer's spec or status read without trusting its shape."""
    value = (obj or {}).get(key)
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True)
class PublishedObs:
    """A fine-tune's adapter as its status.serving says it is published (spec.publish)."""
    source: str                 # namespace/name
    uid: str
    base: str
    adapter: str
    eval_loss: float | None
    eval_set: str | None
    published_at: str


@dataclass(frozen=True)
class PeerObs:
    """Another TPUFinetune of the namespace, read from the operator's index (never written): a base and
    the fine-tunes that publish to it decide from each other's spec and status."""
    name: str
    uid: str = ""
    model: str = ""                   # spec.model
    adapters: bool = False            # spec.serve.adapters is set (it serves adapters)
    max_rank: int | None = None       # spec.serve.adapters.maxRank
    engine: str = ""                  # spec.serve.engine, or its default: vllm on TPU, transformers on cpu
    serving_ready: bool = False       # Serving, Ready True
    ray_cluster: str | None = None    # status.serving.rayCluster: where a publish RayJob runs
    adapters_root: str | None = None  # status.serving.adaptersRoot
    published: PublishedObs | None = None   # its status.serving says its adapter is served

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> PeerObs:
        meta, spec, status = section(body, "metadata"), section(body, "spec"), section(body, "status")
        serve, serving = section(spec, "serve"), section(status, "serving")
        adapters = serve.get("adapters")
        record = section(serving, "published")
        published = None
        if record and serving.get("reason") == Reason.PUBLISHED.value and serving.get("base"):
            loss = record.get("evalLoss")
            published = PublishedObs(
                source=f"{meta.get('namespace')}/{meta.get('name')}", uid=str(meta.get("uid") or ""),
                base=str(serving["base"]), adapter=str(serving.get("adapter") or ""),
                eval_loss=float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None,
                eval_set=record.get("evalSet"), published_at=str(record.get("publishedAt") or ""))
        rank = section(serve, "adapters").get("maxRank")
        on_cpu = str(serve.get("accelerator") or spec.get("accelerator") or "").lower() == c.CPU_ACCELERATOR
        engine = serve.get("engine") or (c.ServeEngine.TRANSFORMERS if on_cpu else c.ServeEngine.VLLM).value
        return cls(name=str(meta.get("name") or ""), uid=str(meta.get("uid") or ""), model=str(spec.get("model") or ""),
                   adapters=isinstance(adapters, Mapping) and serve.get("enabled") is True,
                   max_rank=rank if isinstance(rank, int) else None, engine=str(engine),
                   serving_ready=serving_ready(status),
                   ray_cluster=serving.get("rayCluster"), adapters_root=serving.get("adaptersRoot"),
                   published=published)


@dataclass(frozen=True)
class AdmissionError:
    kind: str
    name: str
    message: str


@dataclass(frozen=True)
class Observed:
    """What exists. None / missing key = confirmed absent (or being deleted)."""
    cluster: ClusterObs | None = None
    jobs: Mapping[str, JobObs] = field(default_factory=dict)
    # RayJobs of ours on their way out (KubeRay's finalizer, the garbage collector removing their
    # submitter Job and pods): they still hold the RayCluster (phases.jobs._release). Read only while
    # there is a RayCluster.
    jobs_deleting: tuple[str, ...] = ()
    service: ServiceObs | None = None
    admission_error: AdmissionError | None = None
    # The RayCluster's pods, read while the slice is coming up (phases.wants_pods): the cause
    # of a stall, in the scheduler's or the kubelet's words (tpuft.controller.diagnosis); and once a running
    # slice's job has failed or lost a host (phases.wants_failure_pods): a pod killed for memory.
    pods: tuple[PodObs, ...] = ()
    # What an earlier object of the same name left behind and the garbage collector has not
    # removed yet (its RayCluster, its pods): nothing of ours is created beside it.
    leftovers: tuple[str, ...] = ()
    # TPU node pools seen on nodes, (accelerator, topology, nodes), read only for a slice the
    # scheduler cannot place and only where the operator may list nodes; None: not known.
    pools: tuple[tuple[str, str, int], ...] | None = None
    # Kueue's Workload for the RayCluster (objects with a queue label, phases.wants_queue); None: not read.
    queue: QueueObs | None = None
    # The RayCluster's own pods as the pod watch keeps them (tpuft.controller.hosts), and those of their nodes that
    # are not Ready or carry a GKE maintenance notice, by name.
    hosts: tuple[PodObs, ...] = ()
    nodes: Mapping[str, NodeObs] = field(default_factory=dict)
    # spec.publish: the base it names (None: no such TPUFinetune in the namespace); a base: None.
    base: PeerObs | None = None
    # The adapters published under the base (a fine-tune's spec.publish.to, or the base itself), other
    # than this object's own, as their fine-tunes' status.serving says; read only for objects with
    # spec.publish or spec.serve.adapters.
    published: tuple[PublishedObs, ...] = ()
    # A base: the uids of the TPUFinetunes of its namespace that are not being deleted (an adapter whose
    # fine-tune is gone is unpublished).
    live_uids: frozenset[str] = frozenset()


class Op(str, enum.Enum):
    CREATE = "create"
    SUSPEND = "suspend"      # patch RayCluster spec.suspend=true
    RESUME = "resume"        # patch RayCluster spec.suspend=false
    DELETE = "delete"


@dataclass(frozen=True)
class Action:
    op: Op
    kind: str
    name: str
    body: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: Reason
    message: str


@dataclass(frozen=True)
class Decision:
    status: dict                       # the full operator-owned status after this reconcile
    patch: dict | None                 # merge patch for the status subresource; None = no write
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")


@dataclass(frozen=True)
class Tunables:
    verify_grace_seconds: float = DEFAULT_VERIFY_GRACE_SECONDS
    rayjob_grace_seconds: float = kuberay.RAYJOB_FINISH_GRACE_SECONDS
    resubmit_backoff_seconds: float = c.LOST_SUBMISSION_BACKOFF_SECONDS


# --- the child kinds: one row each ----------------------------------------------------------------------
Found = Mapping[str, IndexedChild]   # a kind's live children of one TPUFinetune, by name


@dataclass(frozen=True)
class ChildKind:
    """A kind of object the operator creates per TPUFinetune and watches: kopf indexes it by its
    owner's key (label tpufinetune.dev/name) and queues the owner on its events (handlers.py); the
    reconciler confirms the expected ones the index lacks with a GET and hands what it found to
    `observe`, whose answer is the Observed field `field`. A new kind: a row here, its builder, its
    Observed field."""
    kind: str
    plural: str
    expected: tuple[str, ...]   # the status.children keys naming the ones expected
    field: str
    observe: Callable[[Found, tuple[str | None, ...]], Any]   # (found, the expected names) -> the field's value
    group: str = kuberay.RAY_GROUP
    version: str = kuberay.RAY_VERSION


def _cluster(found: Found, names: tuple[str | None, ...]) -> ClusterObs | None:
    x = found.get(names[0]) if names[0] else None
    return ClusterObs(x.name, x.status, x.suspend, x.generation, x.uid) if x else None


def _jobs(found: Found, names: tuple[str | None, ...]) -> dict[str, JobObs]:
    return {name: JobObs(name, x.status) for name, x in found.items()}   # every live one, expected or not


def _service(found: Found, names: tuple[str | None, ...]) -> ServiceObs | None:
    x = found.get(names[0]) if names[0] else None
    return ServiceObs(x.name, x.status) if x else None


CHILD_KINDS = (
    ChildKind(kuberay.RAYCLUSTER_KIND, kuberay.RAYCLUSTER_PLURAL, ("rayCluster",), "cluster", _cluster),
    ChildKind(kuberay.RAYJOB_KIND, kuberay.RAYJOB_PLURAL, ("verifyJob", "trainJob", "publishJob", "unpublishJob"), "jobs", _jobs),
    ChildKind(kuberay.RAYSERVICE_KIND, kuberay.RAYSERVICE_PLURAL, ("rayService",), "service", _service),
)


def live(entries: Iterable[IndexedChild], kind: str, uid: str | None,
         removed: Collection[tuple[str, str]]) -> dict[str, IndexedChild]:
    """The entries that count as this object's children now: not being deleted, not another
    object's (an earlier one of the same name), not deleted by us (tpuft.controller.ledger: the index may lag)."""
    return {x.name: x for x in entries if not x.deleting and x.belongs_to(uid) and (kind, x.name) not in removed}


def fmt_time(t: datetime) -> str:
    """Whole seconds, as Kubernetes writes times, rounded UP: deadlines measured from a stored
    time then fire at or after their bound, never up to a second early."""
    if t.microsecond:
        t = t.replace(microsecond=0) + timedelta(seconds=1)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


# --- KubeRay readings ------------------------------------------------------------------------
def cluster_provisioned(status: Mapping, generation: int | None = None) -> bool:
    """KubeRay v1.7.0: condition RayClusterProvisioned=True; older: state ready with all workers.
    Not while suspending/suspended, and not from a status KubeRay wrote for an older spec (right
    after a resume, the status may still describe the cluster as it was before the suspend)."""
    seen = status.get("observedGeneration")
    if generation is not None and isinstance(seen, int) and seen < generation:
        return False
    if any(x.get("type") in (kuberay.RAYCLUSTER_SUSPENDING, kuberay.RAYCLUSTER_SUSPENDED) and x.get("status") == ConditionStatus.TRUE.value
           for x in status.get("conditions") or []):
        return False
    for cond in status.get("conditions") or []:
        if cond.get("type") == kuberay.RAYCLUSTER_PROVISIONED and cond.get("status") == ConditionStatus.TRUE.value:
            return True
    ready, desired = status.get("readyWorkerReplicas") or 0, status.get("desiredWorkerReplicas") or 0
    return status.get("state") == kuberay.RAYCLUSTER_STATE_READY and ready >= desired


def cluster_suspended(status: Mapping) -> bool:
    """KubeRay has finished suspending the RayCluster (condition RayClusterSuspended=True): its
    pods are gone."""
    return any(x.get("type") == kuberay.RAYCLUSTER_SUSPENDED and x.get("status") == ConditionStatus.TRUE.value
               for x in status.get("conditions") or [])


def slice_loss(status: Mapping) -> str | None:
    """A host of a provisioned slice is gone (pod deleted or failed, node lost, preempted), as
    KubeRay's status shows it: the head not ready, or fewer ready workers than desired. KubeRay
    recreates the lost pods itself; the operator's part is to stop the jobs, wait and verify again."""
    head = _cond(status, kuberay.RAYCLUSTER_HEAD_POD_READY)
    if head is not None and head.get("status") == ConditionStatus.FALSE.value:
        return f"the head pod is not ready ({head.get('reason') or 'HeadPodNotReady'})"
    ready, desired = status.get("readyWorkerReplicas"), status.get("desiredWorkerReplicas")
    if isinstance(ready, int) and isinstance(desired, int) and ready < desired:
        return f"{ready}/{desired} worker hosts ready"
    return None


def _cond(status: Mapping, ctype: str) -> Mapping | None:
    return next((x for x in status.get("conditions") or [] if x.get("type") == ctype), None)


def cluster_progress(tft: TPUFinetune, obs: ClusterObs | None) -> str:
    want = tft.spec.slice.hosts * tft.spec.slices
    if obs is None:
        return f"0/{want} worker hosts ready (RayCluster not found)"
    status = obs.status
    ready = status.get("readyWorkerReplicas") or 0
    desired = status.get("desiredWorkerReplicas") or want
    head = _cond(status, kuberay.RAYCLUSTER_HEAD_POD_READY)
    out = f"{ready}/{desired} worker hosts ready, head pod {'ready' if head and head.get('status') == 'True' else 'not ready'}"
    failure = _cond(status, kuberay.RAYCLUSTER_REPLICA_FAILURE)
    if failure and failure.get("status") == ConditionStatus.TRUE.value:
        out += f"; ReplicaFailure: {failure.get('message') or failure.get('reason')}"
    return out


def job_state(job: JobObs) -> str:
    return (f"jobDeploymentStatus={job.status.get('jobDeploymentStatus') or '-'} "
            f"jobStatus={job.status.get('jobStatus') or '-'}")


def job_succeeded(job: JobObs) -> bool:
    return job.status.get("jobStatus") == kuberay.JobStatus.SUCCEEDED.value


def job_failed(job: JobObs) -> bool:
    status = job.status
    return status.get("jobStatus") in FAILED_JOB_STATUSES or status.get("jobDeploymentStatus") in FAILED_JOB_STATES


def job_finishing(job: JobObs) -> bool:
    """The Ray job has ended but KubeRay has not finished the RayJob yet. In K8sJobMode KubeRay
    (rayjob_controller.go, v1.6.2) sets jobDeploymentStatus Complete/Failed only once the
    submitter Job, which follows the job's logs from the head, has finished too; its RayCluster
    must stay until then, or the submitter loses the head and its Job ends Failed."""
    status = job.status
    return status.get("jobStatus") in ENDED_JOB_STATUSES and status.get("jobDeploymentStatus") == kuberay.JobDeploymentStatus.RUNNING.value


def job_settled(job: JobObs) -> bool:
    """KubeRay is done with it: the Ray job has ended and so has the RayJob, or the RayJob is
    lost (no Ray job of it on the cluster, its submitter done). Anything else may still run on the
    cluster (a job past its deadline, a submitter still waiting for the head)."""
    status = job.status
    return (status.get("jobStatus") in ENDED_JOB_STATUSES and status.get("jobDeploymentStatus") in DONE_JOB_STATES) or job_lost(job)


def job_lost(job: JobObs) -> bool:
    """KubeRay failed the RayJob because its submitter Job completed while the dashboard answered
    404 for the job id (v1.6.2 rayjob_controller.go, the Running case: reason AppFailed, message
    c.RAYJOB_MESSAGE_JOB_NOT_FOUND). No Ray job of it ended, so no user code failed: the Ray job
    was never submitted, or the head lost it. jobStatus is whatever KubeRay last read ("" if it
    never read the job); an ended one (a Ray job that did fail) is not lost."""
    status = job.status
    return (status.get("jobDeploymentStatus") == kuberay.JobDeploymentStatus.FAILED.value
            and status.get("reason") == kuberay.RAYJOB_REASON_APP_FAILED
            and str(status.get("message") or "").startswith(kuberay.RAYJOB_MESSAGE_JOB_NOT_FOUND)
            and status.get("jobStatus") not in ENDED_JOB_STATUSES)


def job_failure_detail(job: JobObs, full_log: str = "") -> str:
    """What a failed RayJob says, fit for status.message, conditions and events: its states,
    KubeRay's reason and its message shortened (job_message); where the message was shortened,
    `full_log` (the command that prints the whole log) follows it."""
    status = job.status
    bits = [job_state(job)]
    if status.get("reason"):
        bits.append(f"reason={status['reason']}")
    message, shortened = job_message(job)
    if message:
        bits.append(message)
    return f"RayJob {job.name}: " + ", ".join(bits) + (f"; the full log: {full_log}" if shortened and full_log else "")


# --- a failed RayJob's message ---------------------------------------------------------------------------
# Ray's job supervisor (ray/dashboard/modules/job/job_supervisor.py) ends a failed job's message with
# up to 20,000 characters of the driver's log, whose lines carry ANSI colour codes (their ESC may be
# lost on the way); KubeRay copies that message into the RayJob's status.message.
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\[\d{1,3}(?:;\d{1,3})*m")
RAY_LOG_TAIL = re.compile(r",? *last available logs \(truncated to [\d,]+ chars\):?")
MAX_JOB_MESSAGE = 300   # characters of a RayJob's message kept in status


def job_message(job: JobObs) -> tuple[str, bool]:
    """The RayJob's status.message without colour codes or the log's tail (the log stays in
    `tpuft logs`): its first line, at most MAX_JOB_MESSAGE characters. Returns (the text, whether
    anything was left out)."""
    raw = ANSI_COLOUR.sub("", str(job.status.get("message") or "")).strip()
    tail = RAY_LOG_TAIL.search(raw)
    first = (raw[:tail.start()] if tail else raw).split("\n", 1)[0].strip()
    short = first if len(first) <= MAX_JOB_MESSAGE else first[:MAX_JOB_MESSAGE - 3] + "..."
    return short, short != raw


# Ray's memory monitor (the raylet) killing a worker process, as a failed job's log shows it. Ray 2.60:
#   "1 worker(s) were killed due to the node running low on memory. ... Memory on the node (IP: 10.4.1.7,
#   ID: 5f..) was 190.12GB used / 200.00GB limit (0.950600)\nOOM kill reason: Memory usage 204..B exceeded
#   threshold of 204..B (95.0% of 214..B limit)", the actor's error "Worker exit type: NODE_OUT_OF_MEMORY";
# earlier Ray: "Task was killed due to the node running low on memory. Memory on the node (IP: .., ID: ..)
#   where the task (..) was running was 190.12GB / 200.00GB (0.9506), which exceeds the memory usage
#   threshold of 0.95."; a task's error: ray.exceptions.OutOfMemoryError.
# Not Ray's guess about a process that died ("... killed by the OOM killer due to high memory usage, (2)
# ray stop --force ..."): the kernel's kills are read from the pods (diagnosis.PodObs.oom_killed).
RAY_OOM_SIGN = re.compile(kuberay.RAY_MEMORY_KILL_SIGN)
RAY_OOM_NODE = re.compile(r"Memory on the node \(IP: ([0-9A-Fa-f.:]+)")
RAY_OOM_USAGE = re.compile(r"was ([\d.]+ ?GB)(?: used)? / ([\d.]+ ?GB)")
RAY_OOM_THRESHOLD = re.compile(r"exceeded threshold of \d+ ?B \((\d+(?:\.\d+)?%)|memory usage threshold of (\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class RayMemoryKill:
    """Ray's memory monitor killed a worker process: where and why, in its own numbers where the
    message has them ("" where it does not)."""
    node_ip: str = ""     # the Ray node's address: its pod's IP
    used: str = ""        # "190.12GB": the node's memory in use when it killed
    total: str = ""       # "200.00GB": what the node has (the pod's limit, in a container)
    threshold: str = ""   # "95.0%" (Ray 2.60) or "0.95" (earlier): RAY_memory_usage_threshold

    @classmethod
    def of(cls, message: str) -> RayMemoryKill | None:
        """From a RayJob's status.message (its log tail); None: no sign of Ray's memory monitor."""
        text = ANSI_COLOUR.sub("", message)
        sign = RAY_OOM_SIGN.search(text)
        if sign is None:
            return None
        node = RAY_OOM_NODE.search(text, sign.start(), sign.start() + 2000)   # the kill's own report follows it
        start = node.end() if node else sign.start()
        usage = RAY_OOM_USAGE.search(text, start, start + 400) if node else None
        threshold = RAY_OOM_THRESHOLD.search(text, start, start + 1000)
        return cls(node.group(1) if node else "", usage.group(1).replace(" ", "") if usage else "",
                   usage.group(2).replace(" ", "") if usage else "",
                   next((g for g in threshold.groups() if g), "") if threshold else "")


class Killer(str, enum.Enum):
    KERNEL = "the kernel's OOM killer"   # the container ended OOMKilled: its memory limit was reached
    RAY = "Ray's memory monitor"         # the raylet killed a worker process over RAY_memory_usage_threshold


@dataclass(frozen=True)
class MemoryKill:
    """A pod of the slice that had a process killed for memory while a job ran."""
    killer: Killer
    pod: PodObs | None = None   # None: Ray's message names no node that a listed pod has
    memory_limit: str = ""      # the killed container's limits.memory (the kernel), the Ray container's (Ray)
    ray: RayMemoryKill | None = None
    others: int = 0             # more pods whose containers the kernel killed in the same job


def _time(text: str | None) -> datetime | None:
    try:
        return parse_time(text)
    except ValueError:
        return None


def memory_kill(pods: Iterable[PodObs], job: JobObs | None, started: datetime | None = None,
                reported: str = "") -> MemoryKill | None:
    """Whether the head or a worker was killed for memory while `job` ran (it failed, or the slice
    lost a host under it): a container the kernel's OOM killer ended since the job's status.startTime
    (else `started`; an older kill in a restarted container's lastState was an earlier job's), the
    first to end named; else Ray's memory monitor in the job's message or in `reported` (the training
    driver's own report of this job's failure: KubeRay's message may carry no log), its node named
    by the pod with that IP."""
    alive = tuple(p for p in pods if not p.deleting)
    since = (_time(job.status.get("startTime")) if job is not None else None) or started
    kills = sorted(((when, pod.name, pod, kill) for pod in alive for kill in pod.oom_killed
                    if (when := _time(kill.finished_at)) is not None and (since is None or when >= since)),
                   key=lambda k: (k[0], k[1]))
    if kills:
        _, first, killed, kill = kills[0]
        return MemoryKill(Killer.KERNEL, killed, kill.memory_limit, others=len({k[1] for k in kills} - {first}))
    ray = (RayMemoryKill.of(str(job.status.get("message") or "")) if job is not None else None) or (
        RayMemoryKill.of(reported) if reported else None)
    if ray is None:
        return None
    node = next((p for p in alive if ray.node_ip and p.ip == ray.node_ip), None)
    return MemoryKill(Killer.RAY, node, node.memory_limit if node else "", ray)


def serve_app_state(status: Mapping) -> tuple[str, str]:
    """(Ray Serve's status of our app, its message) as KubeRay reports it: the active cluster's
    once it has one, else the pending one's (a RayService's first cluster is pending until ready)."""
    for side in ("activeServiceStatus", "pendingServiceStatus"):
        app = ((status.get(side) or {}).get("applicationStatuses") or {}).get(c.SERVE_APP_NAME)
        if app:
            return str(app.get("status") or ""), str(app.get("message") or "")
    return "", ""


def service_ready(status: Mapping) -> bool:
    """KubeRay: condition Ready True (v1.3+; older: no conditions) and our app RUNNING."""
    ready = _cond(status, kuberay.RAYSERVICE_READY)
    return (serve_app_state(status)[0] == kuberay.ServeAppStatus.RUNNING.value
            and (ready is None or ready.get("status") == ConditionStatus.TRUE.value))


def serving_ready(status: Mapping) -> bool:
    """A TPUFinetune's status (not KubeRay's): Serving with Ready True, the model answering."""
    ready = _cond(status, Condition.READY.value)
    return (status.get("phase") == c.Phase.SERVING.value and ready is not None
            and ready.get("status") == ConditionStatus.TRUE.value)


def service_progress(status: Mapping) -> str:
    app, message = serve_app_state(status)
    out = f"app {c.SERVE_APP_NAME} {app or 'not deployed yet'}"
    if message:
        out += f": {message.strip()[:600]}"
    ready = _cond(status, kuberay.RAYSERVICE_READY)
    if ready is not None and ready.get("status") != ConditionStatus.TRUE.value and ready.get("reason"):
        out += f" (RayService Ready={ready.get('status')}: {ready.get('reason')})"
    return out


def spec_diff(a: Any, b: Any, path: str = "spec") -> list[str]:
    """Dotted paths where two specs differ, live fields excluded."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            if path == "spec" and k in LIVE_SPEC_FIELDS:
                continue
            out += spec_diff(a.get(k), b.get(k), f"{path}.{k}")
        return out
    return [] if a == b else [path]
