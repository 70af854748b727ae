"""Fixtures for the real local cluster (tpuft_local.cluster), loaded by tests/conftest.py: one
cluster per test session, shared by tests/cluster and tests/e2e. A cluster already running in the state dir (a developer's `tpuft cluster up`) is
reused and left running; one this session started is taken down at the end, host changes undone.

Fixtures:
  local_cluster  session  tpuft_local.cluster.LocalCluster, up (node, KubeRay, KWOK pools,
                 TPU webhook stand-in, our operator from its image through helm)
  cluster_api    session  kubernetes.client.ApiClient for it (admin)
  cluster_kubectl session kubectl(*args, check=False, input=None) -> CompletedProcess
  cluster_ns     function a fresh namespace, deleted after the test (and its pods gone)
  clear_namespace(kubectl, ns)  delete what a test left in a namespace and wait for its pods to go,
                 so the next test finds the node's CPUs and the simulated TPU hosts free
  assert_nothing_left_failed(kubectl, ns)  no Job Failed, no pod Failed, no RayJob whose job ended
                 while its deployment did not: what a run that succeeded must leave (issue 24)

Marker `real_node`: a test that trains on the real node (CPU-heavy); `make test` runs those in
one lane and the rest of the cluster tests (simulated TPU hosts, mostly waiting) beside them.
"""
from __future__ import annotations

import json
import re
import uuid

import pytest

from tests.waiting import wait_until


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "local_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def local_cluster():
    from tpuft_local.cluster import LocalCluster

    cluster = LocalCluster()
    was_running = cluster.cp.ready() and cluster.pid_of("kubelet") is not None
    if not (was_running and cluster.status_lines()[1]):
        # A healthy running cluster is used as it is: `make test` runs two cluster lanes at once,
        # and two `up`s at the same time would both helm-upgrade the operator.
        cluster.up()
    yield cluster
    if not was_running:
        cluster.down()


@pytest.fixture(scope="session")
def cluster_api(local_cluster):
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(local_cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="session")
def cluster_kubectl(local_cluster):
    def run(*args, check: bool = False, input: str | None = None, timeout: float = 120):
        return local_cluster.cp.kubectl(*args, check=check, input=input, timeout=timeout)
    return run


@pytest.fixture
def cluster_ns(request, cluster_kubectl):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:30].strip("-") or "test"
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    cluster_kubectl("create", "namespace", name, check=True)
    wait_until(lambda: cluster_kubectl("get", "serviceaccount", "default", "-n", name).returncode == 0,
               timeout=90, what=f"serviceaccount default in {name}")
    yield name
    clear_namespace(cluster_kubectl, name)
    cluster_kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def clear_namespace(kubectl, ns: str, timeout: float = 240) -> None:
    kubectl("delete", "tft,rayjobs,rayclusters,rayservices", "--all", "-n", ns, "--wait=false", "--ignore-not-found")

    def gone() -> bool:
        res = kubectl("get", "pods", "-n", ns, "-l", "ray.io/node-type", "-o", "name")
        return res.returncode != 0 or not res.stdout.strip()
    wait_until(gone, timeout=timeout, interval=2, what=f"KubeRay's pods in {ns} to go")


JOB_ENDED = {"SUCCEEDED", "FAILED", "STOPPED"}
DEPLOYMENT_ENDED = {"Complete", "Failed"}


def assert_nothing_left_failed(kubectl, ns: str) -> None:
    """What a run that succeeded leaves in its namespace: no Job with a Failed condition, no pod
    in phase Failed, and no RayJob whose Ray job has ended while KubeRay's deployment of it has not."""
    def items(kind: str) -> list[dict]:
        return json.loads(kubectl("get", kind, "-n", ns, "-o", "json", check=True).stdout)["items"]

    failed_jobs = [j["metadata"]["name"] for j in items("jobs")
                   if any(c["type"] == "Failed" and c["status"] == "True" for c in j["status"].get("conditions") or [])]
    failed_pods = [p["metadata"]["name"] for p in items("pods") if p["status"].get("phase") == "Failed"]
    half_done = [f"{r['metadata']['name']} (jobStatus {st.get('jobStatus')}, jobDeploymentStatus "
                 f"{st.get('jobDeploymentStatus')})" for r in items("rayjobs") if (st := r.get("status") or {})
                 and st.get("jobStatus") in JOB_ENDED and st.get("jobDeploymentStatus") not in DEPLOYMENT_ENDED]
    assert not (failed_jobs or failed_pods or half_done), \
        f"in {ns}: Failed Jobs {failed_jobs}, Failed pods {failed_pods}, RayJobs ended but not Complete {half_done}"
