"""Kueue's names (sigs.k8s.io/kueue v0.17.0), read only, for objects with a queue label: its API,
its labels and annotations, and the ProvisioningRequest API (cluster-autoscaler's) its
admission check creates."""
from __future__ import annotations


# Kueue's RayCluster webhook suspends a labelled RayCluster at creation and makes a Workload for it
# (owned by the RayCluster, labelled with its UID); admitting the Workload unsuspends the RayCluster,
# evicting it suspends it again (KubeRay deletes the pods).
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
WORKLOAD_KIND = "Workload"
WORKLOAD_PLURAL = "workloads"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# Workload status.conditions types (pkg/... workload_types.go)
KUEUE_QUOTA_RESERVED = "QuotaReserved"
KUEUE_ADMITTED = "Admitted"
KUEUE_EVICTED = "Evicted"
KUEUE_PREEMPTED = "Preempted"
# A Workload's status.admissionChecks[].state (Kueue's CheckState: Pending, Ready, Retry, Rejected):
# Ready admits (with quota reserved), Retry evicts and requeues, Rejected deactivates the Workload
# (spec.active false).
CHECK_READY = "Ready"
CHECK_REJECTED = "Rejected"
# The Evicted condition's reason when Kueue deactivated the Workload (spec.active false) for a
# Rejected check; the eviction then resets every check to Pending ("Previously: Rejected").
KUEUE_DEACTIVATED_BY_CHECK = "DeactivatedDueToAdmissionCheck"
# A ProvisioningRequest (autoscaling.x-k8s.io, cluster-autoscaler's API, created by Kueue's
# ProvisioningRequest admission check): read only, for a check Kueue rejected, to tell a revoked or
# expired booking (requeued like a preemption) from capacity that never came (the run fails).
PROVREQ_GROUP = "autoscaling.x-k8s.io"
PROVREQ_VERSION = "v1"
PROVREQ_PLURAL = "provisioningrequests"
PROVREQ_BOOKING_EXPIRED = "BookingExpired"
PROVREQ_CAPACITY_REVOKED = "CapacityRevoked"
# Kueue passes a job's annotations with this prefix to its ProvisioningRequests as spec.parameters.
PROVREQ_PARAMETER_PREFIX = "provreq.kueue.x-k8s.io/"

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"   # a WorkloadPriorityClass's name

# Kueue Topology Aware Scheduling (v0.17): a pod template's pod-set annotations.
KUEUE_TAS_REQUIRED = "kueue.x-k8s.io/podset-required-topology"
