{{/*
The operator's application rules: the same list in the cluster-wide ClusterRole and in each
watched namespace's Role. No wildcards, no Secrets (tests/chart/test_rbac.py asserts the
exact set).
*/}}
{{- define "tpuft.rbac.applicationRules" -}}
# The TPUFinetune objects it reconciles: read only. The operator writes no annotations or
# finalizers (no kopf change handlers), and spec belongs to the user (or Git).
- apiGroups: ["tpufinetune.dev"]
  resources: ["tpufinetunes"]
  verbs: ["get", "list", "watch"]
# status.phase / conditions / observedGeneration. The operator also hands get+patch on
# one CR's status to that CR's workload ServiceAccount, and RBAC lets it grant only what
# it holds.
- apiGroups: ["tpufinetune.dev"]
  resources: ["tpufinetunes/status"]
  verbs: ["get", "patch"]
# The KubeRay children: one RayCluster, then the verification and fine-tuning RayJobs.
- apiGroups: ["ray.io"]
  resources: ["rayclusters", "rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.serve: the RayService serving the fine-tuned model, created once training succeeds and
# deleted when serving is turned off. Never patched (its spec is built once, like the jobs').
- apiGroups: ["ray.io"]
  resources: ["rayservices"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Events kopf and the handlers post about progress and errors (both Event APIs).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# A RayCluster's pods, listed (by its ray.io/cluster label) while its slice comes up and after a job failed
# or a host was lost (a worker killed for memory), and the
# serving cluster's (by our labels) until its app runs: the scheduler's and the kubelet's reason
# for a stall goes into status, and a re-created object waits for the deleted one's pods to go.
# Watched too (our labels and ray.io/cluster): a lost host is seen the moment its pod is told to
# stop, fails or is replaced (tpuft.controller.hosts). Read only; nothing else on pods.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# Per-CR workload identity: a ServiceAccount plus a Role/RoleBinding allowing only
# get,patch on tpufinetunes/status with resourceNames=[that CR]. Deletion is left to the
# garbage collector through ownerReferences.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Per-CR NetworkPolicy (ingress to that run's Ray pods), created with the workload identity; get
# only to adopt our own on a conflict. Deletion is left to the garbage collector as above.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
# Kueue's Workload of a RayCluster with a queue label (kueue.x-k8s.io/queue-name), listed by
# its job-uid label while the run is queued or was just evicted: Kueue's own words go into
# status (why it is not admitted, why it was preempted). Read only.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list"]
# The ProvisioningRequests Kueue's ProvisioningRequest admission check makes (GKE flex-start), listed
# only when Kueue has rejected a queued run's check: a revoked or expired booking (their
# CapacityRevoked/BookingExpired condition) queues the run again, a failed one fails it. Read only.
- apiGroups: ["autoscaling.x-k8s.io"]
  resources: ["provisioningrequests"]
  verbs: ["list"]
{{- end -}}

{{/*
kopf's own cluster-scoped needs (kopf 1.45, --standalone so no kopfpeerings):
CustomResourceDefinitions list/watch in both modes (the resource observer); Namespaces
list/watch only in namespaced mode (the namespace observer lists them only when not
--all-namespaces). Plus, cluster-wide only and optional, list/watch on nodes (node pool hints, and
a node under a slice that is not Ready or carries a GKE maintenance notice).
*/}}
{{- define "tpuft.rbac.frameworkRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- else if .Values.rbac.nodePoolHints }}
# Node pool hints (rbac.nodePoolHints): the TPU node pools' labels, for a slice the scheduler
# cannot place; and, watched, a node under a running slice that is not Ready or carries GKE's
# maintenance notice (a checkpoint is asked for before the host goes). Read only, cluster-wide
# installs only; without it kopf warns once and the pods' own Ready condition still shows a lost node.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- end }}
{{- end -}}
