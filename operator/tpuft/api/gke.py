"""GKE's names for TPU slices: the TPU resource and node labels, Spot, reservations and flex-start
(queued provisioning), the TPU webhook's labels and annotations, and the Cloud Storage FUSE CSI
driver's."""
from __future__ import annotations


TPU_RESOURCE = "google.com/tpu"
GKE_TPU_ACCELERATOR_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
GKE_SPOT_SELECTOR = "cloud.google.com/gke-spot"
GKE_RESERVATION_NAME_SELECTOR = "cloud.google.com/reservation-name"
GKE_RESERVATION_AFFINITY_SELECTOR = "cloud.google.com/reservation-affinity"
# Flex-start with queued provisioning (GKE's Dynamic Workload Scheduler): its nodes carry the
# flex-start label and the queued-provisioning label and NoSchedule taint.
GKE_FLEX_START_SELECTOR = "cloud.google.com/gke-flex-start"
GKE_QUEUED_TAINT = "cloud.google.com/gke-queued"
# The longest a flex-start node runs (GKE: 7 days), passed as the ProvisioningRequest's parameter.
GKE_MAX_RUN_DURATION_PARAMETER = "maxRunDurationSeconds"
GKE_MAX_RUN_DURATION_SECONDS = 7 * 24 * 3600
GKE_NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"   # one multi-host TPU slice is one node pool

# The TPU webhook (kuberay-tpu-webhook) mutates pods labelled app.kubernetes.io/name=kuberay, labels
# them replicaIndex when KubeRay's own index labels are absent, and takes a worker group's topology
# from this annotation before the topology node selector we set from spec.topology.
TPU_WEBHOOK_REPLICA_LABEL = "replicaIndex"
TPU_NAME_ENV = "TPU_NAME"   # the slice's name (the webhook's `{group}-{replica}`): Ray's slice identity
TPU_SLICE_TOPOLOGY_ANNOTATION = "cloud.google.com/gke-tpu-slice-topology"
# GKE's Cloud Storage FUSE CSI driver: a Pod with a volume of this driver needs the annotation, or GKE
# injects no gcsfuse sidecar and the mount fails (GKE docs, "Cloud Storage FUSE CSI driver").
GCSFUSE_CSI_DRIVER = "gcsfuse.csi.storage.gke.io"
GCSFUSE_VOLUMES_ANNOTATION = "gke-gcsfuse/volumes"
