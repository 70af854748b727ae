"""The reconciler's brain, pure: (the object, what its children look like, now) -> Decision.

No client, no clock, no randomness: `reconciler.py` gathers the observation, calls `decide`,
performs `Decision.actions` (idempotent creates by deterministic name, patches, deletes),
then writes `Decision.patch` (None when nothing changed) to the status subresource.

Rules worth knowing (see also docs/concepts.md):
  * The spec is validated first; an invalid spec fails with InvalidSpec and creates nothing.
    A corrected spec restarts the run, as long as nothing was ever created.
  * The spec the children are built from is stored in status.appliedSpec. Every child made
    later in the run (verify job, each training attempt, a recreated cluster) is built from it,
    so a spec edit mid-run is never half-applied; it is recorded (observedGeneration, a
    Warning event, status.ignoredSpecChange). Only `suspend` and `ttlSecondsAfterFinished`
    act live.
  * A RayCluster's RayJobs go before it does (_release): a RayJob whose Ray job has ended is
    finished by KubeRay (jobDeploymentStatus Complete/Failed) only once its submitter, following
    the job's logs from the head, has exited. So a job's outcome moves the run on (Succeeded,
    Serving, TrainingFailed, VerificationFailed) only once KubeRay has finished its RayJob
    (reason FinishingRayJob meanwhile, at most Tunables.rayjob_grace_seconds; past it the RayJob
    is deleted), and a RayCluster is deleted (serving, TTL) or suspended only once every RayJob on
    it is finished or gone (an unfinished one is deleted first; at most twice the grace).
  * A RayJob KubeRay failed because its submitter completed while the dashboard did not know its
    Ray job (observed.job_lost) is not the workload failing: after a backoff it is resubmitted as a
    new RayJob (training: the next attempt's name; verification: a fresh verify job), at most
    c.LOST_SUBMISSION_RETRIES times per run, not counted against training.maxJobRetries
    (status.recovery.lostSubmissions, reason and Warning event SubmissionLost). Past that it is a
    failed job like any other.
  * Suspend: the active RayJob and the verify job are deleted (they cannot outlive their pods;
    checkpoints stay), then the RayCluster is patched suspend=true. Resume -> Provisioning (clock
    restarts), then the new slice is verified again, then training continues with the same
    attempt, resuming from its checkpoint.
  * A child deleted out from under us: the RayCluster is recreated while Provisioning; in
    VerifyingCollectives/Training the run fails with ChildDeleted (the slice/job is gone).
  * After Succeeded/Failed the RayCluster is deleted once ttlSecondsAfterFinished has passed.
  * While the slice comes up, the first blocking cause its pods show (tpuft.controller.diagnosis: image
    pull, container config, crash loop, the scheduler's reason) is in status.message and the
    SliceProvisioned condition, and a SliceBlocked event is posted once per new cause; the
    ProvisioningTimeout message carries it. A re-created object waits (Pending,
    WaitingForPrevious) until the deleted one's RayCluster and pods are gone.
  * A job that failed, or a host lost under it, because a pod was killed for memory (a container
    the kernel's OOM killer ended, in the pods read then: wants_failure_pods; or Ray's memory
    monitor, in the job's message) is said so: which pod, where in the slice, its limit, what to
    change. Retries and slice replacements count as for any failure; a run that ends, ends
    OutOfMemory. A RayJob's message reaches status without colour codes or Ray's log tail
    (observed.job_message): the log stays in `tpuft logs`.
  * Adapters on a shared base (docs/serving.md): training.method none goes from Pending straight to
    Serving (no RayCluster, no RayJobs). A LoRA fine-tune with spec.publish is refused (BaseMismatch)
    before anything is created when its base is known to be wrong; once Succeeded, its reason follows
    the publication (tpuft.controller.publishing judges, _publication acts): BaseNotServing, NotPromoted,
    Publishing (a RayJob on the base's serving RayCluster), Published, Superseded, PublishFailed. A
    base derives status.adapters from its fine-tunes' status.serving and unpublishes a deleted one's
    adapter itself: no object writes another's status, and no finalizer is needed.
  * status.goodput (tpuft.controller.goodput): each time phaseTransitionTime moves, the seconds since the
    previous one go to the cause they were spent on (provisioning, verification, training,
    recovery, suspended); ratio = training / total."""
from tpuft.controller.phases.dispatch import decide
from tpuft.controller.phases.ending import note_error
from tpuft.controller.phases.jobs import STOPPING_LOOK_SECONDS
from tpuft.controller.phases.provisioning import wants_pods
from tpuft.controller.phases.queue import queue_name, wants_queue
from tpuft.controller.phases.recovery import wants_failure_pods
from tpuft.controller.phases.serving import BASE_POLL_SECONDS, wants_serve_pods

__all__ = ["decide", "note_error", "wants_pods", "wants_queue", "wants_failure_pods", "wants_serve_pods",
           "queue_name", "STOPPING_LOOK_SECONDS", "BASE_POLL_SECONDS"]
