"""Pure translation: a parsed TPUFinetune -> the KubeRay RayCluster, RayJobs, RayService, the workload
identity (ServiceAccount, Role, RoleBinding) and the NetworkPolicy it owns.

No client, clock or randomness: the same spec always gives byte-identical children, so
reconciles are idempotent and golden files are stable.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shlex
from dataclasses import dataclass
from typing import Mapping

import yaml

from tpuft.api import constants as c
from tpuft.api import gke
from tpuft.api import kuberay as kuberay_names
from tpuft.api import kueue
from tpuft.api.constants import RAY_VERSION_PIN
from tpuft.api.spec import Export, ServeReplicas, TPUFinetune, workload_document

HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
SHM_VOLUME = "dshm"
CHECKPOINT_VOLUME = "checkpoints"
SHM_PATH = "/dev/shm"
WORKLOAD_MODULE = "tpuft_workload"
# KubeRay's deadline for the verification job sits past the workload's own timeout, so the
# workload's precise message (which rank, which collective) arrives before KubeRay's generic one.
VERIFY_DEADLINE_GRACE_SECONDS = 60
# KubeRay's K8sJobMode submitter runs `ray job submit` and then follows the job's log: a tenth of a
# core while it waits. KubeRay's default asks 500m, so two runs' submitters alone took half of a
# 2-core node and the third run's spilled onto a node that does not run them (issue 34).
SUBMITTER_CONTAINER = "ray-job-submitter"   # KubeRay's name: it fills in the command of this one
SUBMITTER_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}

# Every Ray container we render (training and serving, head and workers) and the RayJobs' submitters.
# runAsNonRoot stays unset:
# Dockerfile.workload runs as root (no USER; Ray's /tmp/ray, pip's and Hugging Face's caches under
# /root), user-chosen serve images (vLLM TPU) may too, and KubeRay's own TPU sample
# (sample.ray-job.tpu-v6e-16-multihost.yaml) sets runAsUser: 0 on TPU workers although its image's
# default user is not root: the TPU device files (/dev/accel*, /dev/vfio) are not known to be usable
# by another user. Root without capabilities and without privilege escalation is what is left.
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# On the pod, so it covers any container KubeRay adds too.
POD_SECURITY_CONTEXT = {"seccompProfile": {"type": "RuntimeDefault"}}


@dataclass(frozen=True)
class ChildNames:
    cluster: str
    verify_job: str
    train_job: str
    identity: str
    worker_group: str
    service: str        # the RayService (spec.serve)
    network_policy: str
    publish_job: str    # spec.publish: the RayJob on the base's serving cluster

    @property
    def serve_service(self) -> str:
        """KubeRay's Service in front of the Serve proxies (port 8000)."""
        return self.service + kuberay_names.RAYSERVICE_SERVE_SVC_SUFFIX

    def train_attempt(self, attempt: int) -> str:
        """Training RayJob name for a resubmission; attempt 0 is the first."""
        return self.train_job if attempt == 0 else f"{self.train_job}-r{attempt}"

    def slice_group(self, index: int) -> str:
        """Slice `index`'s worker group where each slice has its own (Kueue TAS, slices > 1)."""
        return f"{self.worker_group}-s{index}"

    def verify_attempt(self, attempt: int) -> str:
        """Verification RayJob name; attempt 0 is the first, later ones follow a lost submission
        (a new name: KubeRay would take a same-named submitter Job still there for the new one's)."""
        return self.verify_job if attempt == 0 else f"{self.verify_job}-r{attempt}"


def cluster_name(tft_name: str) -> str:
    return f"{tft_name}-ray"


def names(tft: TPUFinetune) -> ChildNames:
    n = tft.meta.name
    s = tft.spec.slice
    group = f"{s.generation}-{s.devices}" if s.is_tpu else "cpu-workers"
    return ChildNames(cluster=cluster_name(n), verify_job=f"{n}-verify", train_job=f"{n}-train",
                      identity=f"{n}-workload", worker_group=group, service=f"{n}-serve",
                      network_policy=f"{n}-ray-ingress", publish_job=f"{n}-publish")


def unpublish_job_name(base: str, adapter: str, uid: str) -> str:
    """A base's RayJob removing one adapter (its fine-tune deleted): the adapter name (up to 63
    characters) would not fit in a child's name, so a hash of it and the publication's uid does."""
    digest = hashlib.sha256(f"{adapter}/{uid}".encode()).hexdigest()[:10]
    return f"{base}-unpublish-{digest}"


def service_account(tft: TPUFinetune) -> str:
    """The ServiceAccount the Ray pods run as: spec.serviceAccountName (the user's, never touched), else
    the one the operator creates ({name}-workload)."""
    return tft.spec.service_account_name or names(tft).identity


def child_labels(tft: TPUFinetune, component: c.Component) -> dict[str, str]:
    labels = dict(tft.spec.labels)
    labels.update({c.LABEL_NAME: tft.meta.name, c.LABEL_COMPONENT: component.value,
                   c.LABEL_MANAGED_BY: c.MANAGED_BY})
    return labels


def _metadata(tft: TPUFinetune, name: str, component: c.Component, extra_labels: dict | None = None) -> dict:
    labels = child_labels(tft, component)
    labels.update(extra_labels or {})
    meta: dict = {"name": name, "namespace": tft.meta.namespace, "labels": labels}
    if tft.spec.annotations:
        meta["annotations"] = dict(tft.spec.annotations)
    if tft.meta.uid:
        meta["ownerReferences"] = [{
            "apiVersion": c.API_VERSION, "kind": c.KIND, "name": tft.meta.name,
            "uid": tft.meta.uid, "controller": True,
        }]
    return meta


def _env(tft: TPUFinetune) -> list[dict]:
    """Container env shared by head and workers. The HF token only ever by reference."""
    env: list[dict] = []
    secret = tft.spec.hf_token_secret
    if secret is not None:
        env.append({"name": c.HF_TOKEN_ENV,
                    "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    if tft.spec.slice.tpu_resource_per_chip > 1:
        # Head too: the driver reads it when Ray Train validates the ScalingConfig.
        env.append({"name": kuberay_names.RAY_TPU_RESOURCE_PER_CHIP_ENV, "value": str(tft.spec.slice.tpu_resource_per_chip)})
    # Who the pod is to Google Cloud under Workload Identity Federation: storage errors name it.
    env += [{"name": c.SERVICE_ACCOUNT_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {"name": c.SERVICE_ACCOUNT_NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    env.extend(dict(e) for e in tft.spec.env)
    return env


def _resources(cpu: str, memory: str, override: Mapping[str, Mapping[str, str]], tpu_chips: int | None) -> dict:
    """Requests equal limits, as GKE's Ray-on-TPU tutorial sets them, unless the user sets both apart.

    An override on one side moves the other with it, so `requests.cpu: 100` alone never
    produces a pod whose request exceeds the default limit (which the API server rejects).
    """
    req_over, lim_over = override.get("requests", {}), override.get("limits", {})
    requests, limits = {}, {}
    for key in dict.fromkeys(["cpu", "memory", *req_over, *lim_over]):
        default = {"cpu": cpu, "memory": memory}.get(key)
        requests[key] = req_over.get(key, lim_over.get(key, default))
        limits[key] = lim_over.get(key, requests[key])
    if tpu_chips is not None:
        requests[gke.TPU_RESOURCE] = limits[gke.TPU_RESOURCE] = str(tpu_chips)
    return {"limits": limits, "requests": requests}


def _pod_template(tft: TPUFinetune, component: c.Component, containers: list[dict],
                  extra: dict | None = None) -> dict:
    meta: dict = {"labels": child_labels(tft, component)}
    annotations = {**tft.spec.annotations, **_gcsfuse_annotation(tft)}
    if annotations:
        meta["annotations"] = annotations
    spec = {"serviceAccountName": service_account(tft), "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
            "containers": containers}
    spec.update(extra or {})
    if tft.spec.scheduling.priority_class_name:
        spec["priorityClassName"] = tft.spec.scheduling.priority_class_name
    return {"metadata": meta, "spec": spec}


def _container(tft: TPUFinetune, name: str) -> dict:
    out: dict = {"name": name, "image": tft.spec.image}
    if tft.spec.image_pull_policy:
        out["imagePullPolicy"] = tft.spec.image_pull_policy
    env = _env(tft)
    if env:
        out["env"] = env
    out["securityContext"] = copy.deepcopy(CONTAINER_SECURITY_CONTEXT)
    return out


def _stop_at_a_checkpoint(container: dict) -> None:
    """A training Ray container's preStop hook (tpuft_workload.preemption): SIGTERM to the pod's Ray
    Train workers, then wait until they saved a checkpoint at the next step boundary and ended (the
    head: until the train driver ended), before the runtime's SIGTERM to `ray start` ends them all."""
    container["lifecycle"] = {"preStop": {"exec": {"command": [
        "python", "-m", f"{WORKLOAD_MODULE}.preemption", "--timeout-seconds", str(c.PRESTOP_WAIT_SECONDS)]}}}


# KubeRay's own readiness check for Ray >= 2.53 (GET the dashboard agent's /api/healthz), looked at
# sooner and more often than KubeRay's default (first after 10 s, then every 5 s): a replaced host
# is Ready, and the slice whole again, as soon as its Ray node is up. The same 50 s of failures
# before a pod counts as not Ready (a lost host), so a busy host is not taken for a lost one.
READINESS_PERIOD_SECONDS = 1
READINESS_FAILURE_SECONDS = 50


def _ready_soon(container: dict, head: bool) -> None:
    container["readinessProbe"] = {
        "httpGet": {"path": kuberay_names.RAY_NODE_HEALTH_PATH, "port": kuberay_names.RAY_DASHBOARD_AGENT_PORT},
        "initialDelaySeconds": 1, "periodSeconds": READINESS_PERIOD_SECONDS, "timeoutSeconds": 5 if head else 2,
        "successThreshold": 1, "failureThreshold": READINESS_FAILURE_SECONDS // READINESS_PERIOD_SECONDS}


def _node_selector(tft: TPUFinetune) -> dict[str, str]:
    sel = dict(tft.spec.scheduling.node_selector)
    sched = tft.spec.scheduling
    if sched.spot:
        sel[gke.GKE_SPOT_SELECTOR] = "true"
    if sched.reservation:
        sel[gke.GKE_RESERVATION_NAME_SELECTOR] = sched.reservation
        sel[gke.GKE_RESERVATION_AFFINITY_SELECTOR] = "specific"
    sel.update(tft.spec.slice.node_selector)  # the topology selectors always win
    return sel


def _slice_topology(tft: TPUFinetune) -> dict[str, str]:
    """Kueue Topology Aware Scheduling's pod-set annotation for each slice's worker group (one Kueue
    pod set per group): all of its hosts in one node pool, GKE's unit of a multi-host slice. Only
    when asked (scheduling.topologyAware) and queued: TAS is Kueue's, and a flavor without a
    Topology does not admit an annotated pod set."""
    s = tft.spec.slice
    if not (tft.spec.scheduling.topology_aware and tft.meta.labels.get(kueue.KUEUE_QUEUE_LABEL) and s.is_tpu
            and s.hosts > 1):
        return {}
    return {kueue.KUEUE_TAS_REQUIRED: gke.GKE_NODEPOOL_LABEL}


def _provisioning_parameters(tft: TPUFinetune) -> dict[str, str]:
    """The RayCluster's annotations Kueue passes to its ProvisioningRequest as spec.parameters
    (prefix provreq.kueue.x-k8s.io/): flex-start's maximum run duration."""
    sched = tft.spec.scheduling
    if not (sched.flex_start and sched.max_run_duration_seconds):
        return {}
    return {kueue.PROVREQ_PARAMETER_PREFIX + gke.GKE_MAX_RUN_DURATION_PARAMETER: str(sched.max_run_duration_seconds)}


def _gcsfuse_annotation(tft: TPUFinetune) -> dict[str, str]:
    """GKE injects the Cloud Storage FUSE sidecar only into a Pod annotated for it: the Ray pods get the
    annotation when spec.checkpoint.volume is that driver's, so spec.annotations (on every child) need not."""
    volume = tft.spec.checkpoint.volume or {}
    if (volume.get("csi") or {}).get("driver") == gke.GCSFUSE_CSI_DRIVER:
        return {gke.GCSFUSE_VOLUMES_ANNOTATION: "true"}
    return {}


def _checkpoint_volume(tft: TPUFinetune) -> tuple[list[dict], list[dict]]:
    """(volumeMounts, volumes) for spec.checkpoint.volume: the same storage at storagePath on
    the head (Ray Train's driver) and every worker."""
    ck = tft.spec.checkpoint
    if not ck.volume:
        return [], []
    kind, source = next(iter(ck.volume.items()))
    return ([{"name": CHECKPOINT_VOLUME, "mountPath": ck.storage_path}],
            [{"name": CHECKPOINT_VOLUME, kind: copy.deepcopy(source)}])


def build_raycluster(tft: TPUFinetune) -> dict:
    n = names(tft)
    # Kueue's labels pass through to the RayCluster (its webhook suspends a labelled one until admitted)
    extra_labels = {k: tft.meta.labels[k] for k in (kueue.KUEUE_QUEUE_LABEL, kueue.KUEUE_PRIORITY_LABEL)
                    if tft.meta.labels.get(k)}
    body: dict = {
        "apiVersion": kuberay_names.RAY_API_VERSION,
        "kind": kuberay_names.RAYCLUSTER_KIND,
        "metadata": _metadata(tft, n.cluster, c.Component.CLUSTER, extra_labels),
        "spec": _cluster_spec(tft, c.Component.CLUSTER),
    }
    if parameters := _provisioning_parameters(tft):
        body["metadata"]["annotations"] = {**body["metadata"].get("annotations", {}), **parameters}
    if tft.spec.suspend:
        body["spec"]["suspend"] = True
    return body


def _cluster_spec(tft: TPUFinetune, component: c.Component, max_slices: int | None = None) -> dict:
    """A RayClusterSpec for tft.spec's slice: the training cluster's, and (through serving_view)
    the RayService's rayClusterConfig. With max_slices above spec.slices, the worker group may grow
    to that many slices (whole slices: one group replica each on TPU) and Ray's autoscaler runs."""
    s, spec, n = tft.spec.slice, tft.spec, names(tft)
    head = _container(tft, HEAD_CONTAINER)
    head["ports"] = [{"containerPort": port, "name": pname} for pname, port in kuberay_names.RAY_PORTS]
    head["resources"] = _resources(s.head_pod.cpu, s.head_pod.memory, spec.resources.head, None)
    ck_mounts, ck_volumes = _checkpoint_volume(tft)
    if ck_mounts:
        head["volumeMounts"] = ck_mounts
    # Training only: serving images are the user's (vLLM) and a replica holds no training state.
    training = component == c.Component.CLUSTER
    head_extra: dict = {"volumes": copy.deepcopy(ck_volumes)} if ck_volumes else {}

    defaults = s.worker_pod
    worker = _container(tft, WORKER_CONTAINER)
    worker["resources"] = _resources(defaults.cpu, defaults.memory, spec.resources.worker,
                                     s.chips_per_host if s.is_tpu else None)
    worker["volumeMounts"] = [{"mountPath": SHM_PATH, "name": SHM_VOLUME}] + copy.deepcopy(ck_mounts)
    pod_extra: dict = {"volumes": [{"name": SHM_VOLUME, "emptyDir": {
        "medium": "Memory", "sizeLimit": spec.resources.shm_size or defaults.shm}}] + ck_volumes}
    selector = _node_selector(tft)
    # Flex-start is the training slice's (Kueue's ProvisioningRequest for the queued RayCluster); the
    # serving RayService is not queued, so it takes the pools as the rest of spec.scheduling says.
    flex_start = training and spec.scheduling.flex_start
    if flex_start:
        selector = {**selector, gke.GKE_FLEX_START_SELECTOR: "true"}
    if selector:
        pod_extra["nodeSelector"] = selector
    tolerations = [dict(t) for t in spec.scheduling.tolerations]
    if flex_start:   # GKE taints queued-provisioning nodes; the TPU taint is tolerated by admission
        tolerations.append({"key": gke.GKE_QUEUED_TAINT, "operator": "Exists", "effect": "NoSchedule"})
    topology = _slice_topology(tft) if training else {}
    if topology:
        # Kueue's TAS node controller reads the Workload's pod template, not the pods: the toleration
        # the API server's ExtendedResourceToleration adds to each pod is not there, and a node with
        # an untolerated NoSchedule taint counts as failed (its pods terminated, the Workload evicted).
        tolerations.append({"key": gke.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        pod_extra["tolerations"] = tolerations
    if training:
        for container in (head, worker):
            _stop_at_a_checkpoint(container)
            _ready_soon(container, head=container is head)
        for extra in (head_extra, pod_extra):
            extra["terminationGracePeriodSeconds"] = c.TRAINING_TERMINATION_GRACE_SECONDS

    most = max(max_slices or spec.slices, spec.slices)
    if s.is_tpu:
        # One replica per slice, numOfHosts VMs per slice: what the TPU webhook checks (one group of
        # `slices` replicas; under Kueue TAS a group per slice, _group_per_slice).
        per_slice, hosts = 1, s.hosts
        start_params: dict[str, str] = {}
    else:
        per_slice, hosts = s.hosts, 1
        start_params = {"num-cpus": defaults.cpu}
    template = _pod_template(tft, component, [worker], pod_extra)
    if topology:
        template["metadata"]["annotations"] = {**template["metadata"].get("annotations", {}), **topology}
    group = {
        "groupName": n.worker_group,
        "replicas": per_slice * spec.slices,
        "minReplicas": per_slice * spec.slices,
        "maxReplicas": per_slice * most,
        "numOfHosts": hosts,
        "rayStartParams": start_params,
        "template": template,
    }
    if s.tpu_resource_per_chip > 1:
        group["resources"] = {kuberay_names.RAY_TPU_CUSTOM_RESOURCE: str(s.devices_per_host)}
    groups = _group_per_slice(tft, group) if topology and spec.slices > 1 else [group]
    # The training head keeps its ServiceAccount token: the Ray job's driver runs there and patches
    # status.verification (and status.training.message when a resume is refused); the workers' rank 0
    # patches status.training. Serving pods turn it off (build_rayservice).
    return {
        "rayVersion": RAY_VERSION_PIN,
        # Only an autoscaled RayService grows: the autoscaler adds a group replica (a slice) when
        # Serve wants a replica that fits nowhere, and removes idle ones.
        "enableInTreeAutoscaling": most > spec.slices,
        "authOptions": {"mode": kuberay_names.RAY_AUTH_MODE_TOKEN},
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "0"},
            "template": _pod_template(tft, component, [head], head_extra or None),
        },
        "workerGroupSpecs": groups,
    }


def worker_container(group: dict) -> dict:
    """A rendered worker group's Ray worker container."""
    return next(x for x in group["template"]["spec"]["containers"] if x["name"] == WORKER_CONTAINER)


def _group_per_slice(tft: TPUFinetune, group: dict) -> list[dict]:
    """`slices: N` under Kueue TAS: one worker group per slice (`{group}-s{i}`, one replica), so each
    slice is a Kueue pod set placed on one node pool. A single group of N replicas is one pod set,
    whose pods Kueue v0.17 spreads over the node pools by count, not by replica (a pool got hosts of
    two slices, and the TPU webhook's per-replica affinity left them Pending). TPU_NAME is each
    slice's name as the webhook writes it for replica i of the one group (`{group}-{i}`), so Ray's
    slice names and the workload's slice index are the same either way."""
    n, out = names(tft), []
    for i in range(tft.spec.slices):
        one = copy.deepcopy(group)
        one.update({"groupName": n.slice_group(i), "replicas": 1, "minReplicas": 1, "maxReplicas": 1})
        worker_container(one).setdefault("env", []).append({"name": gke.TPU_NAME_ENV, "value": f"{n.worker_group}-{i}"})
        out.append(one)
    return out


def run_document(tft: TPUFinetune, slices: int | None = None) -> str:
    """The workload's fields of the spec, as the one JSON document both entrypoints carry
    (tpuft.api.spec.workload_document; the workload reads it with tpuft.api.spec.parse_run). export.merge
    says whether merged weights are written: asked for, or needed by vLLM (merges). `slices`: a
    training job on fewer slices than the spec's (spec.recovery.elastic), with elastic_accumulation's
    accumulation (the same global batch)."""
    spec = dataclasses.replace(tft.spec, export=Export(merge=merges(tft)))
    if slices is not None and slices != spec.slices:
        accumulation = elastic_accumulation(spec.training.gradient_accumulation_steps, spec.slices, slices)
        spec = dataclasses.replace(spec, slices=slices, training=dataclasses.replace(
            spec.training, gradient_accumulation_steps=accumulation))
    return json.dumps(workload_document(spec), sort_keys=True, separators=(",", ":"))


def elastic_accumulation(accumulation: int, slices: int, active: int) -> int:
    """Gradient accumulation steps on `active` of `slices` slices that keep the global batch (2 slices
    to 1: twice the steps). The workload refuses to resume a checkpoint at another global batch (the
    data's place and the schedule would not match), so `active` must divide accumulation x slices:
    elastic_slices picks such a count."""
    if (accumulation * slices) % active:
        raise ValueError(f"{active} slices cannot keep the global batch of {slices} x {accumulation} accumulation steps")
    return accumulation * slices // active


def elastic_slices(accumulation: int, slices: int, whole: int) -> int:
    """The most of the `whole` slices (fewer than `slices`) a run can train on at its global batch."""
    return next(k for k in range(min(whole, slices - 1), 0, -1) if (accumulation * slices) % k == 0) if whole else 0


def verify_entrypoint(tft: TPUFinetune) -> str:
    """--run-name: the verification checks first that the run's directory can be written."""
    return shlex.join(["python", "-m", WORKLOAD_MODULE, "verify", "--spec", run_document(tft),
                       "--run-name", run_name(tft), "--log-file", log_path(tft, c.Component.VERIFY)])


def run_name(tft: TPUFinetune) -> str:
    """Ray Train run name, the run's directory under spec.checkpoint.storagePath.

    Stable for one object (retries, preemption, suspend/resume, operator restarts resume
    there) and different for a re-created object with the same name, whose UID differs: a new
    object starts fresh and never reads another's checkpoints (spec.checkpoint.resumeFrom
    continues one on purpose). Without a UID (`tpuft render` of a file) there is no identity
    to add; the operator always has one.
    """
    base = f"{tft.meta.namespace}-{tft.meta.name}"
    return f"{base}-{tft.meta.uid}" if tft.meta.uid else base


def train_entrypoint(tft: TPUFinetune, slices: int | None = None, after_verification: bool = False) -> str:
    return shlex.join(["python", "-m", WORKLOAD_MODULE, "train", "--spec", run_document(tft, slices),
                       "--run-name", run_name(tft), "--log-file", log_path(tft, c.Component.TRAIN),
                       *(["--after-verification"] if after_verification else [])])


def merges(tft: TPUFinetune) -> bool:
    """Whether a LoRA run also exports merged weights: asked for (spec.export.merge), or needed by
    vLLM, which serves them when the object serves itself (adapters served on a shared base are
    spec.publish's: docs/serving.md)."""
    sv = tft.spec.serve
    return tft.spec.training.lora is not None and (
        tft.spec.export.merge or (sv is not None and sv.engine == c.ServeEngine.VLLM))


def _rayjob(tft: TPUFinetune, name: str, component: c.Component, entrypoint: str,
            active_deadline: int | None, cluster: str | None = None, submitter_of: str | None = None) -> dict:
    """cluster: the RayCluster it runs on (default the run's own); submitter_of: the TPUFinetune whose
    NetworkPolicy must let the submitter reach that cluster's dashboard (default this one)."""
    runtime_env = {"env_vars": {c.ENV_CR_NAMESPACE: tft.meta.namespace, c.ENV_CR_NAME: tft.meta.name}}
    spec: dict = {
        "entrypoint": entrypoint,
        "runtimeEnvYAML": yaml.safe_dump(runtime_env, sort_keys=True),
        # KubeRay reads the cluster's name under this key (rayjob_controller: RayJobDefaultClusterSelectorKey).
        "clusterSelector": {kuberay_names.RAY_CLUSTER_LABEL: cluster or names(tft).cluster},
        "submissionMode": "K8sJobMode",
        # A job that cannot even start within the provisioning budget fails instead of
        # sitting in Initializing forever.
        "preRunningDeadlineSeconds": tft.spec.provisioning_timeout_seconds,
    }
    if active_deadline is not None:
        spec["activeDeadlineSeconds"] = active_deadline
    spec["submitterPodTemplate"] = _submitter_template(tft, component, submitter_of)
    return {"apiVersion": kuberay_names.RAY_API_VERSION, "kind": kuberay_names.RAYJOB_KIND,
            "metadata": _metadata(tft, name, component), "spec": spec}


def _submitter_template(tft: TPUFinetune, component: c.Component, labelled_as: str | None = None) -> dict:
    """The submitter pod KubeRay runs for a RayJob: the run's labels (so the run's NetworkPolicy
    lets it reach its head), small requests, no Kubernetes API token (it only talks to the Ray
    dashboard; KubeRay adds the Ray token's env when the cluster has authOptions)."""
    container = {"name": SUBMITTER_CONTAINER, "image": tft.spec.image, "resources": copy.deepcopy(SUBMITTER_RESOURCES),
                 "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT)}
    if tft.spec.image_pull_policy:
        container["imagePullPolicy"] = tft.spec.image_pull_policy
    spec: dict = {"restartPolicy": "Never", "automountServiceAccountToken": False,
                  "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT), "containers": [container]}
    if tft.spec.scheduling.priority_class_name:
        spec["priorityClassName"] = tft.spec.scheduling.priority_class_name
    labels = child_labels(tft, component)
    if labelled_as is not None:
        labels[c.LABEL_NAME] = labelled_as
    return {"metadata": {"labels": labels}, "spec": spec}


def build_verify_job(tft: TPUFinetune, attempt: int = 0) -> dict:
    deadline = tft.spec.verification.timeout_seconds + VERIFY_DEADLINE_GRACE_SECONDS
    return _rayjob(tft, names(tft).verify_attempt(attempt), c.Component.VERIFY, verify_entrypoint(tft), deadline)


def build_train_job(tft: TPUFinetune, attempt: int = 0, slices: int | None = None,
                    after_verification: bool = False) -> dict:
    """`slices`: fewer than spec.slices while a lost slice is not back (spec.recovery.elastic).
    `after_verification`: submitted beside the slice's re-verification; its trainer waits for it."""
    return _rayjob(tft, names(tft).train_attempt(attempt), c.Component.TRAIN,
                   train_entrypoint(tft, slices, after_verification), None)


PUBLISH_DEADLINE_SECONDS = 1800   # copying one adapter folder: far less, unless the storage is failing


def adapters_root(tft: TPUFinetune) -> str:
    """A base's adapters (spec.serve.adapters): {run dir}/adapters, one folder per adapter name."""
    return "/".join([run_dir(tft), c.ADAPTERS_DIR])


def build_publish_job(tft: TPUFinetune, base: str, cluster: str, root: str, export: str, eval_loss: float | None,
                      eval_set: str | None) -> dict:
    """spec.publish: the RayJob copying the fine-tune's adapter export under the base's adapters root.
    It runs on the base's serving RayCluster (`cluster`), whose pods hold the base's storage identity;
    its submitter carries the base's name label, so the base's NetworkPolicy lets it reach that head."""
    adapter = tft.adapter_name
    assert adapter is not None, "build_publish_job needs spec.publish"
    argv = ["python", "-m", WORKLOAD_MODULE, c.Component.PUBLISH.value, "--export", export, "--adapters-root", root,
            "--name", adapter, "--source", tft.meta.ref, "--uid", tft.meta.uid, "--eval-set", eval_set or ""]
    if eval_loss is not None:
        argv += ["--eval-loss", repr(float(eval_loss))]
    return _rayjob(tft, names(tft).publish_job, c.Component.PUBLISH, shlex.join(argv), PUBLISH_DEADLINE_SECONDS,
                   cluster=cluster, submitter_of=base)


def build_unpublish_job(base: TPUFinetune, cluster: str, adapter: str, uid: str) -> dict:
    """A base's RayJob removing the adapter of a fine-tune that was deleted, on the base's own serving
    RayCluster; the workload removes the folder only while its marker names that fine-tune's uid."""
    argv = ["python", "-m", WORKLOAD_MODULE, c.Component.UNPUBLISH.value, "--adapters-root", adapters_root(base),
            "--name", adapter, "--uid", uid]
    return _rayjob(base, unpublish_job_name(base.meta.name, adapter, uid), c.Component.UNPUBLISH, shlex.join(argv),
                   PUBLISH_DEADLINE_SECONDS, cluster=cluster)


def build_workload_identity(tft: TPUFinetune) -> list[dict]:
    """The Ray pods' ServiceAccount, allowed exactly one thing: get and patch this TPUFinetune's status.
    With spec.serviceAccountName the account is the user's: only the Role and a RoleBinding to it are
    the run's (the operator never creates, changes or deletes an account it does not own)."""
    n = names(tft).identity

    def meta() -> dict:  # a fresh dict each: shared objects would serialise as YAML aliases
        return _metadata(tft, n, c.Component.IDENTITY)

    account_meta = meta()
    if tft.spec.service_account_annotations:   # on this account only, beside spec.annotations
        account_meta["annotations"] = {**account_meta.get("annotations", {}), **tft.spec.service_account_annotations}
    own = [] if tft.spec.service_account_name else [{"apiVersion": "v1", "kind": "ServiceAccount",
                                                     "metadata": account_meta}]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(),
        "rules": [{"apiGroups": [c.GROUP], "resources": [f"{c.PLURAL}/status"],
                   "resourceNames": [tft.meta.name], "verbs": ["get", "patch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n},
        "subjects": [{"kind": "ServiceAccount", "name": service_account(tft), "namespace": tft.meta.namespace}],
    }
    return [*own, role, binding]


def run_dir(tft: TPUFinetune) -> str:
    """{storagePath}/{run name}: the run's checkpoints, export, driver logs and TensorBoard files."""
    return "/".join([tft.spec.checkpoint.storage_path.rstrip("/"), run_name(tft)])


def export_path(tft: TPUFinetune) -> str:
    """Where the training job writes the Hugging Face export (tpuft_workload.train: run_dir/export)."""
    return "/".join([run_dir(tft), c.EXPORT_DIR])


def log_path(tft: TPUFinetune, job: c.Component) -> str:
    """Where the verify or train job's driver tees its log (--log-file; `tpuft logs` reads it there
    once the head is gone)."""
    return "/".join([run_dir(tft), c.LOGS_DIR, f"{job.value}.log"])


def served_source(tft: TPUFinetune) -> str:
    """What the RayService serves before the run reports an export: where training writes it, or with
    training.method none spec.model itself."""
    return export_path(tft) if tft.spec.trains else tft.spec.model


def serving_view(tft: TPUFinetune) -> TPUFinetune:
    """The object as the serving cluster sees it: the serve slice (one per replica, min replicas to
    start with), image and resources in place of training's, so the training cluster's builders give
    the RayService's rayClusterConfig (numOfHosts, google.com/tpu, selectors, TPU7x env and TPU: "8", /dev/shm)."""
    sv = tft.spec.serve
    assert sv is not None, "serving_view needs spec.serve enabled"
    return dataclasses.replace(tft, spec=dataclasses.replace(
        tft.spec, slice=sv.slice, slices=sv.replicas.min, image=sv.image, image_pull_policy=sv.image_pull_policy,
        resources=sv.resources))


def serve_app(tft: TPUFinetune, model_source: str) -> dict:
    """The one Serve application, as serveConfigV2 lists it."""
    sv, model_id = tft.spec.serve, tft.meta.name
    assert sv is not None, "serve_app needs spec.serve enabled"
    if sv.engine == c.ServeEngine.VLLM:
        return {"name": c.SERVE_APP_NAME, "route_prefix": c.SERVE_ROUTE_PREFIX, "import_path": c.SERVE_VLLM_IMPORT_PATH,
                "args": {"llm_configs": [llm_config(tft, model_source)]}}
    args: dict = {c.ServeArg.MODEL_SOURCE.value: model_source, c.ServeArg.MODEL_ID.value: model_id}
    if sv.max_model_length:
        args[c.ServeArg.MAX_MODEL_LEN.value] = sv.max_model_length
    if sv.adapters is not None:
        args[c.ServeArg.ADAPTERS_ROOT.value] = adapters_root(tft)
        args[c.ServeArg.MAX_ADAPTERS.value] = sv.adapters.max_per_replica
    return {"name": c.SERVE_APP_NAME, "route_prefix": c.SERVE_ROUTE_PREFIX, "import_path": c.SERVE_TRANSFORMERS_IMPORT_PATH,
            "args": args, "deployments": [{"name": c.SERVE_DEPLOYMENT_NAME, **serve_replicas(sv.replicas)}]}


def serve_replicas(r: ServeReplicas) -> dict:
    """A deployment's replica count for Ray Serve: fixed, or autoscaled between min and max (Serve
    refuses num_replicas beside an autoscaling_config)."""
    if r.fixed:
        return {"num_replicas": r.min}
    return {"autoscaling_config": {"min_replicas": r.min, "max_replicas": r.max}}


def llm_config(tft: TPUFinetune, model_source: str) -> dict:
    """Ray Serve LLM's LLMConfig for vLLM. The slice topology (accelerator_config) is easily left out:
    without it the replica's per-chip bundles can straddle slices and the app sits in DEPLOYING
    forever; with it the replica reserves one whole slice (Ray's slice_placement_group)."""
    sv = tft.spec.serve
    assert sv is not None, "llm_config needs spec.serve enabled"
    s = sv.slice
    engine: dict = {"tensor_parallel_size": s.devices if s.is_tpu else 1}
    if sv.max_model_length:
        engine["max_model_len"] = sv.max_model_length
    if merges(tft):   # the adapter's sibling: vLLM serves the merged weights
        model_source = "/".join([model_source.rstrip("/").rpartition("/")[0], c.EXPORT_MERGED_DIR])
    out: dict = {"model_loading_config": {"model_id": tft.meta.name, "model_source": model_source},
                 "engine_kwargs": engine, "deployment_config": serve_replicas(sv.replicas)}
    if sv.adapters is not None:   # Ray Serve LLM's multi-LoRA: <model_id>:<adapter> loads <path>/<adapter>
        engine.update({"enable_lora": True, "max_lora_rank": sv.adapters.max_rank})
        out["lora_config"] = {"dynamic_lora_loading_path": adapters_root(tft),
                              "max_num_adapters_per_replica": sv.adapters.max_per_replica}
    if s.is_tpu:
        out["accelerator_type"] = s.ray_accelerator_type
        out["accelerator_config"] = {"kind": "tpu", "topology": s.topology}
        if s.multi_host:   # vLLM's TPU backend spreads one model over the slice's hosts through Ray
            out["runtime_env"] = {"env_vars": {c.TPU_MULTIHOST_BACKEND_ENV: "ray"}}
    return out


def build_rayservice(tft: TPUFinetune, model_source: str | None = None) -> dict:
    """The KubeRay RayService serving the fine-tuned model (spec.serve): model_source is the export
    the training job reported (status.training.exportedModel), else where it writes it."""
    view, n, sv = serving_view(tft), names(tft), tft.spec.serve
    assert sv is not None, "build_rayservice needs spec.serve enabled"
    replicas = sv.replicas
    cluster = _cluster_spec(view, c.Component.SERVE, max_slices=replicas.max)
    head_tmpl = cluster["headGroupSpec"]["template"]
    for tmpl in [head_tmpl, *(g["template"] for g in cluster["workerGroupSpecs"])]:
        # Serving never calls the Kubernetes API, except the autoscaler sidecar KubeRay adds to an
        # autoscaled head: it scales the worker group through the head's ServiceAccount (KubeRay binds it).
        tmpl["spec"]["automountServiceAccountToken"] = tmpl is head_tmpl and not replicas.fixed
    cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"].append(
        {"containerPort": c.SERVE_PORT, "name": "serve"})   # the port KubeRay's serve Service targets
    key = sv.api_key_secret
    if key is not None:   # by reference only: the key never appears in a rendered manifest
        for tmpl in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
            tmpl["spec"]["containers"][0].setdefault("env", []).append(
                {"name": c.SERVE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}}})
    app = serve_app(tft, model_source or served_source(tft))
    return {"apiVersion": kuberay_names.RAY_API_VERSION, "kind": kuberay_names.RAYSERVICE_KIND,
            "metadata": _metadata(tft, n.service, c.Component.SERVE),
            "spec": {"serveConfigV2": yaml.safe_dump({"applications": [app]}, sort_keys=False),
                     "rayClusterConfig": cluster}}


def build_network_policy(tft: TPUFinetune) -> dict:
    """Ingress to the run's pods (every pod with its name label: the training cluster's, the
    RayService's and the RayJobs' submitters). Enforced only where the cluster's network plugin
    enforces NetworkPolicy.

    - From the run's own pods, every port: Ray uses many (GCS 6379, dashboard 8265, client 10001, raylet,
      object manager, worker ports, Train's and Serve's own); the submitters (`ray job submit` to the
      dashboard) carry the run's labels (_submitter_template).
    - The dashboard (job submission and status) from KubeRay's operator pod, in any namespace, which
      polls it for job and Serve status. A KubeRay that does not run as a pod on the
      pod network (a host process, as on the local cluster, or one that reaches the dashboard through
      the API server's proxy, --use-kubernetes-proxy) sends no pod traffic: NetworkPolicy always
      admits traffic from a pod's own node, but from anywhere else such a KubeRay needs an ipBlock
      rule of its own.
    - Ray's metrics port (Prometheus text, read-only: the workload's training gauges and Ray's own)
      from any pod in any namespace: the Prometheus that the chart's PodMonitor configures runs in
      a monitoring namespace of its own, and NetworkPolicy cannot name it otherwise.
    - With spec.serve, Ray Serve's HTTP port from any pod in the namespace (only the serving pods listen
      there; `kubectl port-forward`, as `tpuft chat` uses, does not pass through NetworkPolicy).
    Labels are not an identity: any pod that may carry these labels is admitted (spec.labels cannot
    set them, c.RESERVED_LABELS)."""
    n, own = names(tft), {c.LABEL_NAME: tft.meta.name}
    kuberay = {"namespaceSelector": {},
               "podSelector": {"matchLabels": {kuberay_names.KUBERAY_COMPONENT_LABEL: kuberay_names.KUBERAY_OPERATOR_COMPONENT}}}
    ingress: list[dict] = [
        {"from": [{"podSelector": {"matchLabels": dict(own)}}]},
        {"from": [kuberay], "ports": [{"protocol": "TCP", "port": kuberay_names.RAY_DASHBOARD_PORT}]},
        {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": kuberay_names.RAY_METRICS_PORT}]},
    ]
    if tft.spec.serve:
        ingress.append({"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": c.SERVE_PORT}]})
    return {"apiVersion": f"{c.NETWORKING_GROUP}/{c.NETWORKING_VERSION}", "kind": c.NETWORK_POLICY_KIND,
            "metadata": _metadata(tft, n.network_policy, c.Component.NETWORK),
            "spec": {"podSelector": {"matchLabels": dict(own)}, "policyTypes": ["Ingress"], "ingress": ingress}}


def build_children(tft: TPUFinetune) -> list[dict]:
    """Everything the operator will create, RayCluster first (the order `tpuft render` prints);
    the RayService last, created once training has succeeded."""
    serve = [build_rayservice(tft)] if tft.spec.serve else []
    if not tft.spec.trains:   # training.method none: spec.model served as it is, no training cluster
        return [*build_workload_identity(tft), build_network_policy(tft), *serve]
    jobs = [build_verify_job(tft)] if tft.spec.verification.enabled else []
    return [build_raycluster(tft), *jobs, build_train_job(tft), *build_workload_identity(tft),
            build_network_policy(tft), *serve]
