"""STAND-IN for KubeRay v1.7.0 in the operator's integration tests: patches RayCluster and
RayJob status exactly as KubeRay's controllers would (ray-project/kuberay v1.7.0,
ray-operator/apis/ray/v1/raycluster_types.go and rayjob_types.go), and pod status as the kubelet
would; the messages Ray 2.60 writes for a failed job, which KubeRay copies. Not KubeRay.

Field names and values are spelled here literally, not imported from tpuft.api.constants, so a
wrong constant in the operator fails the tests instead of agreeing with itself.
"""
from __future__ import annotations

from datetime import datetime, timezone

from kubernetes import client

GROUP, VERSION = "ray.io", "v1"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- what Ray 2.60 writes into a failed job's message, which KubeRay copies to the RayJob's status.message ---
def entrypoint_failed(log_tail: str) -> str:
    """Ray's job supervisor (ray/dashboard/modules/job/job_supervisor.py) for an entrypoint that
    exited 1: the driver log's last lines (at most 20,000 characters) follow its first line."""
    return ("Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
            + log_tail[-20_000:])


def train_controller_log(lines: int, last: str) -> str:
    """A Ray Train driver's log as Ray prints it: each line of an actor's output prefixed with its
    name and pid in ANSI cyan; `last`, the error, at the end."""
    body = "".join(f"\x1b[36m(TrainController pid=2211)\x1b[0m [State Transition] RUNNING -> RUNNING. "
                   f"Worker group healthy, step {i}, loss 2.{i % 10}\n" for i in range(lines))
    return body + last


def memory_monitor_kill(node_ip: str) -> str:
    """An actor killed by Ray's memory monitor as its caller sees it (Ray 2.60: the raylet's OOM kill
    report, ray/core/src/ray/raylet/node_manager.cc, inside the ActorDiedError)."""
    return ("\x1b[36m(TrainController pid=2211)\x1b[0m ray.exceptions.ActorDiedError: The actor died unexpectedly "
            "before finishing this task.\n\tclass_name: RayTrainWorker\n\tactor_id: 9d1c6a1d2f0e4f6b8a01000000\n"
            f"\tpid: 415\n\tip: {node_ip}\nThe actor is dead because its worker process has died. Worker exit type: "
            "NODE_OUT_OF_MEMORY Worker exit detail: 1 worker(s) were killed due to the node running low on memory. "
            f"Memory on the node (IP: {node_ip}, ID: 5f3a0c9e1b7d4a2f8e6c) was 190.12GB used / 200.00GB limit "
            "(0.950600)\nOOM kill reason: Memory usage 204142837760B exceeded threshold of 204010946560B "
            "(95.0% of 214748364800B limit)\n")


class KubeRay:
    def __init__(self, api_client: client.ApiClient, namespace: str):
        self.api = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.ns = namespace

    def _status(self, plural: str, name: str, status: dict) -> None:
        self.api.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, plural, name, {"status": status})

    def get(self, plural: str, name: str) -> dict:
        return self.api.get_namespaced_custom_object(GROUP, VERSION, self.ns, plural, name)

    # --- RayCluster -------------------------------------------------------------------------------
    @staticmethod
    def _cond(ctype: str, status: str, reason: str, message: str) -> dict:
        return {"type": ctype, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": _now()}

    def desired_workers(self, name: str) -> int:
        spec = self.get("rayclusters", name)["spec"]
        return sum(int(g.get("replicas", 1)) * int(g.get("numOfHosts", 1)) for g in spec.get("workerGroupSpecs", []))

    def _cluster_status(self, name: str, status: dict) -> None:
        """KubeRay records the generation it reconciled (status.observedGeneration)."""
        status["observedGeneration"] = self.get("rayclusters", name)["metadata"]["generation"]
        self._status("rayclusters", name, status)

    def cluster_provisioning(self, name: str, ready_workers: int = 0) -> None:
        """Head up, workers still coming (e.g. no TPU node pool with that topology)."""
        desired = self.desired_workers(name)
        self._cluster_status(name, {
            "conditions": [self._cond("HeadPodReady", "True", "HeadPodRunningAndReady", "Head Pod ready"),
                           self._cond("RayClusterProvisioned", "False", "RayClusterPodsProvisioning",
                                      "RayCluster Pods are being provisioned for first time")],
            "readyWorkerReplicas": ready_workers, "availableWorkerReplicas": ready_workers,
            "desiredWorkerReplicas": desired, "minWorkerReplicas": desired, "maxWorkerReplicas": desired,
            "lastUpdateTime": _now()})

    def _worker_pod(self, cluster: str, pod: str, labels: dict | None = None, container: dict | None = None) -> None:
        """A worker pod as KubeRay creates it (label ray.io/cluster, controller ownerReference to
        the RayCluster)."""
        rc = self.get("rayclusters", cluster)["metadata"]
        self.core.create_namespaced_pod(self.ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "labels": {"ray.io/cluster": cluster, "ray.io/node-type": "worker", **(labels or {})},
                         "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": cluster,
                                              "uid": rc["uid"], "controller": True}]},
            "spec": {"containers": [{"name": "ray-worker", "image": "img:1", **(container or {})}],
                     "automountServiceAccountToken": False}})

    def running_pods(self, cluster: str, owner: str, workers: int, node_prefix: str = "node") -> list[str]:
        """The head and `workers` worker pods as KubeRay creates them from the RayCluster's template
        (ray.io/cluster, ray.io/node-type, the run's tpufinetune.dev/name), bound to nodes and
        reported Running and Ready as the kubelet would (this tier has neither). Returns their names."""
        rc = self.get("rayclusters", cluster)["metadata"]
        names = [f"{cluster}-head"] + [f"{cluster}-worker-{i}" for i in range(workers)]
        for i, pod in enumerate(names):
            node_type = "head" if i == 0 else "worker"
            self.core.create_namespaced_pod(self.ns, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "labels": {"ray.io/cluster": cluster, "ray.io/node-type": node_type,
                                                     "tpufinetune.dev/name": owner},
                             "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": cluster,
                                                  "uid": rc["uid"], "controller": True}]},
                "spec": {"nodeName": f"{node_prefix}-{i}", "containers": [{"name": f"ray-{node_type}", "image": "img:1"}],
                         "automountServiceAccountToken": False}})
            self.core.patch_namespaced_pod_status(pod, self.ns, {"status": {
                "phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": _now()}]}})
        return names

    def unschedulable_worker(self, cluster: str, pod: str, message: str) -> None:
        """A worker pod, then the PodScheduled condition kube-scheduler writes when it cannot place
        it (this tier has no scheduler)."""
        self._worker_pod(cluster, pod)
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": {"conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
            "lastTransitionTime": _now()}]}})

    def oom_killed_worker(self, cluster: str, pod: str, memory_limit: str, replica: int, host: int) -> None:
        """A worker pod (KubeRay's multi-host index labels) whose Ray container the kernel's OOM killer
        ended and the kubelet restarted (restartPolicy Always): what the kubelet writes, lastState
        terminated with reason OOMKilled and exit code 137 (this tier has no kubelet)."""
        self._worker_pod(cluster, pod, {"ray.io/worker-group-replica-index": str(replica),
                                        "ray.io/replica-host-index": str(host)},
                         {"resources": {"limits": {"memory": memory_limit}, "requests": {"memory": memory_limit}}})
        now = _now()
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": {
            "phase": "Running", "podIP": "10.4.1.7", "podIPs": [{"ip": "10.4.1.7"}],
            "containerStatuses": [{
                "name": "ray-worker", "image": "img:1", "imageID": "", "ready": False, "restartCount": 1,
                "started": True, "state": {"running": {"startedAt": now}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": now,
                                             "finishedAt": now}}}]}})

    def cluster_ready(self, name: str) -> None:
        desired = self.desired_workers(name)
        self._cluster_status(name, {
            "state": "ready",
            "conditions": [self._cond("HeadPodReady", "True", "HeadPodRunningAndReady", "Head Pod ready"),
                           self._cond("RayClusterProvisioned", "True", "AllPodRunningAndReadyFirstTime",
                                      "All Ray Pods are ready for the first time")],
            "readyWorkerReplicas": desired, "availableWorkerReplicas": desired, "desiredWorkerReplicas": desired,
            "minWorkerReplicas": desired, "maxWorkerReplicas": desired, "lastUpdateTime": _now()})

    def worker_lost(self, name: str, ready: int) -> None:
        """After a worker pod is gone: KubeRay v1.7.0 keeps RayClusterProvisioned True (it means
        "all pods were ready once") and lowers readyWorkerReplicas while it recreates the pod."""
        st = self.get("rayclusters", name).get("status") or {}
        self._cluster_status(name, {**st, "readyWorkerReplicas": ready, "availableWorkerReplicas": ready,
                                    "lastUpdateTime": _now()})

    # --- RayJob -----------------------------------------------------------------------------------
    def job_initializing(self, name: str) -> None:
        self._status("rayjobs", name, {"jobDeploymentStatus": "Initializing", "jobStatus": "",
                                       "startTime": _now()})

    def job_running(self, name: str) -> None:
        job = self.get("rayjobs", name)
        cluster = job["spec"].get("clusterSelector", {}).get("ray.io/cluster", "")
        self._status("rayjobs", name, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                       "jobId": f"{name}-abcde", "rayClusterName": cluster,
                                       "dashboardURL": f"{cluster}-head-svc:8265",
                                       "startTime": job.get("status", {}).get("startTime") or _now()})

    def job_ended(self, name: str, job_status: str = "SUCCEEDED") -> None:
        """The Ray job has ended (KubeRay read it from the dashboard) but the submitter Job, which
        follows the job's logs, has not finished yet: KubeRay keeps jobDeploymentStatus Running
        until it has (ray-operator/controllers/ray/rayjob_controller.go); job_succeeded or
        job_failed is the next step."""
        self._status("rayjobs", name, {"jobDeploymentStatus": "Running", "jobStatus": job_status})

    def job_succeeded(self, name: str) -> None:
        self._status("rayjobs", name, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED",
                                       "endTime": _now(), "succeeded": 1, "failed": 0})

    def job_failed(self, name: str, message: str = "Job entrypoint command failed with exit code 1") -> None:
        self._status("rayjobs", name, {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED",
                                       "reason": "AppFailed", "message": message, "endTime": _now(),
                                       "succeeded": 0, "failed": 1})

    def job_lost(self, name: str) -> None:
        """The submitter Job completed while the dashboard answered 404 for the job id: KubeRay
        v1.6.2 fails the deployment (rayjob_controller.go, the Running case); jobStatus stays as
        it was, "" when KubeRay never read the job."""
        job = self.get("rayjobs", name)
        cluster = job["spec"].get("clusterSelector", {}).get("ray.io/cluster", "")
        self._status("rayjobs", name, {"jobDeploymentStatus": "Failed", "reason": "AppFailed",
                                       "message": "Submitter completed but Ray job not found in RayCluster.",
                                       "jobId": f"{name}-b5khs", "rayClusterName": cluster,
                                       "dashboardURL": f"{cluster}-head-svc:8265", "failed": 1})

    def job_deadline_exceeded(self, name: str, deadline: int) -> None:
        """activeDeadlineSeconds passed: KubeRay fails the deployment; jobStatus stays as it was."""
        self._status("rayjobs", name, {"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded",
                                       "message": f"The RayJob has passed the activeDeadlineSeconds. "
                                                  f"ActiveDeadlineSeconds: {deadline}",
                                       "endTime": _now(), "failed": 1})

    # --- RayService (ray-operator/apis/ray/v1/rayservice_types.go) ----------------------------------
    def service_status(self, name: str, app_status: str, message: str = "", ready: bool = False,
                       side: str = "pendingServiceStatus") -> None:
        """What KubeRay writes while (side=pendingServiceStatus) its first cluster comes up and once
        (side=activeServiceStatus) it serves: Serve's status of each application, the Ready condition."""
        svc = self.get("rayservices", name)
        apps = {"llm": {"status": app_status, "message": message, "healthLastUpdateTime": _now()}}
        self._status("rayservices", name, {
            side: {"rayClusterName": f"{name}-raycluster-abcde", "applicationStatuses": apps},
            "conditions": [self._cond("Ready", "True" if ready else "False",
                                      "NonZeroServeEndpoints" if ready else "Initializing",
                                      "Number of serve endpoints is greater than 0" if ready else "")],
            "numServeEndpoints": 1 if ready else 0, "observedGeneration": svc["metadata"]["generation"],
            "serviceStatus": "Running" if ready else ""})
