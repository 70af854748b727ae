"""LOCAL STAND-IN for KubeRay's pod layer. Not KubeRay: the real KubeRay runs in clusters.

There is no kubelet on a developer machine, so nothing would ever run the pods a RayCluster
asks for. This small controller plays KubeRay's part for `tpuft demo` and the end-to-end
test, against a real API server:

- RayCluster: starts one real local Ray (one per machine) and marks the cluster ready the
  way KubeRay v1.7.0 does (conditions HeadPodReady/RayClusterProvisioned with KubeRay's
  reasons, state "ready", ready/desired worker replicas). TPU RayClusters are never marked
  ready (there is no TPU here), which is exactly the "no capacity" case the operator must
  time out on; `--rehearse-tpu` instead runs their jobs in CPU mode on a scaled-down world
  and says so in the RayJob's status message.
- RayJob: submits `spec.entrypoint` with `spec.runtimeEnvYAML` through Ray's job submission
  API and mirrors the job into status with KubeRay's field names and values (jobStatus
  PENDING/RUNNING/SUCCEEDED/FAILED/STOPPED, jobDeploymentStatus Initializing/Running/Complete/
  Failed, reason AppFailed/DeadlineExceeded/PreRunningDeadlineExceeded), honouring
  activeDeadlineSeconds and preRunningDeadlineSeconds.
- The workload reaches the API server as the pod's ServiceAccount would: the stand-in mints
  a token for the pod template's serviceAccountName (TokenRequest) and hands the job a
  kubeconfig holding only that token, so least privilege is exercised for real.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from tpuft import constants as c

log = logging.getLogger("tpuft_local.standin")

# Ray's job states -> KubeRay's jobStatus values (identical strings in KubeRay's JobStatus).
TERMINAL_JOB_STATUS = {"SUCCEEDED", "FAILED", "STOPPED"}
REHEARSAL_WORKERS = 2


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def is_tpu_cluster(cluster: dict) -> bool:
    for group in cluster.get("spec", {}).get("workerGroupSpecs", []):
        for ctr in group.get("template", {}).get("spec", {}).get("containers", []):
            if c.TPU_RESOURCE in (ctr.get("resources", {}).get("limits") or {}):
                return True
    return False


def desired_workers(cluster: dict) -> int:
    return sum(int(g.get("replicas", 1)) * int(g.get("numOfHosts", 1))
               for g in cluster.get("spec", {}).get("workerGroupSpecs", []))


def cluster_status(cluster: dict, ready: bool, suspended: bool, previous: dict | None) -> dict:
    """RayCluster status as KubeRay v1.7.0 writes it (ray-operator/apis/ray/v1/raycluster_types.go)."""
    prev = {cond["type"]: cond for cond in (previous or {}).get("conditions", [])}
    ts = now_iso()

    def cond(ctype: str, status: str, reason: str, message: str) -> dict:
        old = prev.get(ctype)
        keep = old and old.get("status") == status
        return {"type": ctype, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": old["lastTransitionTime"] if keep else ts}

    desired = desired_workers(cluster)
    if suspended:
        conditions = [cond("RayClusterSuspended", "True", "RayClusterSuspended", "RayCluster is suspended")]
        return {"state": "suspended", "conditions": conditions, "readyWorkerReplicas": 0,
                "availableWorkerReplicas": 0, "desiredWorkerReplicas": desired, "lastUpdateTime": ts,
                "observedGeneration": cluster["metadata"].get("generation", 1)}
    if ready:
        conditions = [cond("HeadPodReady", "True", "HeadPodRunningAndReady", "Head Pod ready"),
                      cond("RayClusterProvisioned", "True", "AllPodRunningAndReadyFirstTime",
                           "All Ray Pods are ready for the first time")]
    else:
        conditions = [cond("HeadPodReady", "True", "HeadPodRunningAndReady", "Head Pod ready"),
                      cond("RayClusterProvisioned", "False", "RayClusterPodsProvisioning",
                           "RayCluster Pods are being provisioned for first time")]
    status = {"conditions": conditions, "readyWorkerReplicas": desired if ready else 0,
              "availableWorkerReplicas": desired if ready else 0, "desiredWorkerReplicas": desired,
              "minWorkerReplicas": desired, "maxWorkerReplicas": desired, "lastUpdateTime": ts,
              "endpoints": {name: str(port) for name, port in c.RAY_PORTS},
              "head": {"podIP": "127.0.0.1", "serviceIP": "127.0.0.1",
                       "podName": f"{cluster['metadata']['name']}-head", "serviceName":
                       f"{cluster['metadata']['name']}-head-svc"},
              "observedGeneration": cluster["metadata"].get("generation", 1)}
    if ready:
        status["state"] = "ready"
    return status


def rehearsal_entrypoint(entrypoint: str) -> str:
    """Rewrite a TPU workload entrypoint to CPU mode on a scaled-down world."""
    args = shlex.split(entrypoint)
    for flag, value in (("--accelerator", c.CPU_ACCELERATOR), ("--topology", str(REHEARSAL_WORKERS)),
                        ("--slices", "1")):
        if flag in args:
            args[args.index(flag) + 1] = value
    return shlex.join(args)


class LocalRay:
    """The one local Ray this machine may run; started on first need, stopped on exit."""

    def __init__(self, num_cpus: int, dashboard_port: int, log_dir: Path):
        self.num_cpus, self.dashboard_port, self.log_dir = num_cpus, dashboard_port, log_dir
        self.started_here = False
        self._client = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _ray_bin(self) -> str:
        return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"

    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient  # heavy import: only when a cluster appears

            try:
                self._client = JobSubmissionClient(self.address)
            except Exception:  # nothing listening yet: start our own
                self.start()
                self._client = JobSubmissionClient(self.address)
        return self._client

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Job entrypoints say `python`: make that this environment's interpreter, as the image's is.
        path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PATH=path)
        cmd = [self._ray_bin(), "start", "--head", f"--num-cpus={self.num_cpus}", "--disable-usage-stats",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
        log.info("starting local Ray: %s", " ".join(cmd))
        with open(self.log_dir / "ray-start.log", "w") as out:
            subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=180)
        self.started_here = True

    def stop(self) -> None:
        if self.started_here:
            subprocess.run([self._ray_bin(), "stop", "--force"], capture_output=True, timeout=120)
            self.started_here = False


class StandIn:
    def __init__(self, api_client, namespaces: list[str] | None, ray: LocalRay, state_dir: Path,
                 rehearse_tpu: bool = False):
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.api_client = api_client
        self.namespaces = namespaces
        self.ray = ray
        self.state_dir = state_dir
        self.rehearse_tpu = rehearse_tpu

    # --- listing -------------------------------------------------------------------------
    def _list(self, plural: str) -> list[dict]:
        if self.namespaces:
            items = []
            for ns in self.namespaces:
                items += self.api.list_namespaced_custom_object(c.RAY_GROUP, c.RAY_VERSION, ns, plural)["items"]
            return items
        return self.api.list_cluster_custom_object(c.RAY_GROUP, c.RAY_VERSION, plural)["items"]

    def _patch_status(self, plural: str, obj: dict, status: dict) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.api.patch_namespaced_custom_object_status(
                c.RAY_GROUP, c.RAY_VERSION, obj["metadata"]["namespace"], plural, obj["metadata"]["name"],
                {"status": status})
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to report
                raise

    # --- RayCluster ----------------------------------------------------------------------
    def reconcile_cluster(self, cluster: dict) -> None:
        suspended = bool(cluster.get("spec", {}).get("suspend"))
        ready = not suspended and (not is_tpu_cluster(cluster) or self.rehearse_tpu)
        if ready:
            self.ray.client()  # a ready cluster has a running head
        status = cluster_status(cluster, ready, suspended, cluster.get("status"))
        old = dict(cluster.get("status") or {})
        if {k: v for k, v in old.items() if k != "lastUpdateTime"} != \
                {k: v for k, v in status.items() if k != "lastUpdateTime"}:
            self._patch_status(c.RAYCLUSTER_PLURAL, cluster, status)
            log.info("RayCluster %s/%s: state=%s", cluster["metadata"]["namespace"], cluster["metadata"]["name"],
                     status.get("state", "provisioning"))

    # --- RayJob --------------------------------------------------------------------------
    def _workload_kubeconfig(self, namespace: str, service_account: str) -> Path | None:
        """A kubeconfig holding only a token of the pod's ServiceAccount (as a pod would have)."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            token = self.core.create_namespaced_service_account_token(
                service_account, namespace,
                client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
                    audiences=[], expiration_seconds=24 * 3600))).status.token
        except ApiException as e:
            log.warning("no token for ServiceAccount %s/%s (%s): the job will not report status",
                        namespace, service_account, e.reason)
            return None
        cfg = self.api_client.configuration
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "workload",
            "clusters": [{"name": "local", "cluster": {"server": cfg.host, "certificate-authority": cfg.ssl_ca_cert}}],
            "users": [{"name": service_account, "user": {"token": token}}],
            "contexts": [{"name": "workload", "context": {"cluster": "local", "user": service_account,
                                                          "namespace": namespace}}],
        }
        path = self.state_dir / "tokens" / f"{namespace}.{service_account}.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(yaml.safe_dump(kubeconfig))
        path.chmod(0o600)
        return path

    def _find_cluster(self, job: dict, clusters: dict) -> dict | None:
        name = (job["spec"].get("clusterSelector") or {}).get(c.RAY_CLUSTER_LABEL)
        return clusters.get((job["metadata"]["namespace"], name))

    def _submit(self, job: dict, cluster: dict) -> tuple[str, str]:
        meta = job["metadata"]
        submission_id = f"{meta['namespace']}-{meta['name']}-{meta['uid'][:8]}"
        runtime_env = yaml.safe_load(job["spec"].get("runtimeEnvYAML") or "") or {}
        env_vars = dict(runtime_env.get("env_vars") or {})
        env_vars.setdefault("RAY_AUTH_MODE", "disabled")
        sa = cluster["spec"]["headGroupSpec"]["template"]["spec"].get("serviceAccountName")
        if sa:
            kubeconfig = self._workload_kubeconfig(meta["namespace"], sa)
            if kubeconfig:
                env_vars["KUBECONFIG"] = str(kubeconfig)
        runtime_env["env_vars"] = env_vars
        entrypoint = job["spec"]["entrypoint"]
        message = ""
        if is_tpu_cluster(cluster):
            entrypoint = rehearsal_entrypoint(entrypoint)
            message = (f"LOCAL STAND-IN: TPU job rehearsed on CPU with {REHEARSAL_WORKERS} workers "
                       f"(entrypoint: {entrypoint})")
        client = self.ray.client()
        try:
            client.get_job_info(submission_id)  # already submitted before a stand-in restart
        except Exception:
            client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id)
            log.info("RayJob %s/%s: submitted %s: %s", meta["namespace"], meta["name"], submission_id, entrypoint)
        return submission_id, message

    def reconcile_job(self, job: dict, clusters: dict) -> None:
        status = dict(job.get("status") or {})
        deployment = status.get("jobDeploymentStatus", "")
        if deployment in ("Complete", "Failed"):
            return
        spec, now = job["spec"], time.time()
        new = dict(status)
        if not deployment:
            new.update(jobDeploymentStatus="Initializing", startTime=now_iso(),
                       rayClusterName=(spec.get("clusterSelector") or {}).get(c.RAY_CLUSTER_LABEL, ""))
            deployment = "Initializing"
        started = _parse_time(new.get("startTime")) or now
        cluster = self._find_cluster(job, clusters)
        if deployment == "Initializing":
            ready = cluster is not None and (cluster.get("status") or {}).get("state") == "ready"
            deadline = spec.get("preRunningDeadlineSeconds")
            if not ready and deadline and now - started > deadline:
                new.update(jobDeploymentStatus="Failed", reason="PreRunningDeadlineExceeded", endTime=now_iso(),
                           message=f"RayJob has passed the preRunningDeadlineSeconds ({deadline}s) "
                                   "without starting", failed=1)
            elif ready:
                job_id, message = self._submit(job, cluster)
                new.update(jobDeploymentStatus="Running", jobId=job_id, jobStatus="PENDING",
                           dashboardURL=self.ray.address.removeprefix("http://"))
                if message:
                    new["message"] = message
        if new.get("jobDeploymentStatus") == "Running":
            self._mirror(job, new, started)
        if new != status:
            self._patch_status(c.RAYJOB_PLURAL, job, new)
            if new.get("jobDeploymentStatus") != status.get("jobDeploymentStatus") or \
                    new.get("jobStatus") != status.get("jobStatus"):
                log.info("RayJob %s/%s: %s/%s %s", job["metadata"]["namespace"], job["metadata"]["name"],
                         new.get("jobDeploymentStatus"), new.get("jobStatus", ""), new.get("reason", ""))

    def _mirror(self, job: dict, new: dict, started: float) -> None:
        client = self.ray.client()
        info = client.get_job_info(new["jobId"])
        ray_status = str(getattr(info.status, "value", info.status))
        new["jobStatus"] = ray_status
        deadline = job["spec"].get("activeDeadlineSeconds")
        if ray_status not in TERMINAL_JOB_STATUS and deadline and time.time() - started > deadline:
            client.stop_job(new["jobId"])
            new.update(jobDeploymentStatus="Failed", reason="DeadlineExceeded", endTime=now_iso(), failed=1,
                       message=f"The RayJob has passed the activeDeadlineSeconds ({deadline}s).")
        elif ray_status == "SUCCEEDED":
            new.update(jobDeploymentStatus="Complete", endTime=now_iso(), succeeded=1)
        elif ray_status in ("FAILED", "STOPPED"):
            new.update(jobDeploymentStatus="Failed", reason="AppFailed", endTime=now_iso(), failed=1,
                       message=(info.message or "job failed")[-2000:])
        if ray_status in TERMINAL_JOB_STATUS:
            self._save_logs(job, new["jobId"])

    def _save_logs(self, job: dict, job_id: str) -> None:
        path = self.state_dir / "jobs" / f"{job['metadata']['namespace']}.{job['metadata']['name']}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.write_text(self.ray.client().get_job_logs(job_id))
        except Exception as e:  # logs are a convenience; never fail the mirror for them
            log.warning("could not save logs of %s: %s", job_id, e)

    # --- loop --------------------------------------------------------------------------------
    def step(self) -> None:
        clusters = {}
        for cluster in self._list(c.RAYCLUSTER_PLURAL):
            if cluster["metadata"].get("deletionTimestamp"):
                continue
            self.reconcile_cluster(cluster)
            clusters[(cluster["metadata"]["namespace"], cluster["metadata"]["name"])] = self._get(
                c.RAYCLUSTER_PLURAL, cluster)
        for job in self._list(c.RAYJOB_PLURAL):
            if not job["metadata"].get("deletionTimestamp"):
                self.reconcile_job(job, clusters)

    def _get(self, plural: str, obj: dict) -> dict:
        return self.api.get_namespaced_custom_object(c.RAY_GROUP, c.RAY_VERSION, obj["metadata"]["namespace"],
                                                     plural, obj["metadata"]["name"])

    def run(self, interval: float, stop: list[bool]) -> None:
        while not stop:
            try:
                self.step()
            except Exception as e:  # keep serving; the next pass retries
                log.warning("stand-in pass failed: %s", e)
            time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tpuft_local.standin", description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    p.add_argument("--namespace", action="append", help="watch only these (repeatable); default all")
    p.add_argument("--state-dir", type=Path, default=Path(".tpuft/standin"))
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs the local Ray advertises")
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--rehearse-tpu", action="store_true", help="run TPU RayClusters' jobs in CPU mode")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(levelname)s %(message)s")
    from kubernetes import config

    api_client = config.new_client_from_config(config_file=args.kubeconfig)
    ray = LocalRay(args.num_cpus, args.dashboard_port, args.state_dir)
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        StandIn(api_client, args.namespace, ray, args.state_dir, args.rehearse_tpu).run(args.interval, stop)
    finally:
        ray.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
