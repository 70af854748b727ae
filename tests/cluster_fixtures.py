"""Fixtures for the real local cluster (tpuft_local.cluster), loaded by tests/conftest.py: one
cluster per test session, shared by tests/cluster and tests/e2e. A cluster already running in the state dir (a developer's `tpuft cluster up`) is
reused and left running; one this session started is taken down at the end, host changes undone.

Fixtures:
  local_cluster  session  tpuft_local.cluster.LocalCluster, up (node, KubeRay, KWOK pools,
                 TPU webhook stand-in, our operator from its image through helm)
  cluster_api    session  kubernetes.client.ApiClient for it (admin)
  cluster_kubectl session kubectl(*args, check=False, input=None) -> CompletedProcess
  cluster_ns     function a fresh namespace, deleted after the test (and its pods gone)
  cluster_bucket function gs://BUCKET on the cluster's GCS stand-in with a model and a dataset in it;
                 this process's env (and its children's) reaches it and the cluster
  family_model(bucket, family, tmp_path)  a tiny model of a family tests/workload/jax_families
                 builds (e.g. gemma3-text, qwen3), with the built-in tokenizer speaking that family's
                 chat turns, uploaded to BUCKET/models/tiny-FAMILY; its gs:// URI
  clear_namespace(kubectl, ns)  delete what a test left in a namespace and wait for its pods to go,
                 so the next test finds the node's CPUs and the simulated TPU hosts free
  drop_namespace(kubectl, ns)  clear_namespace, then the namespace deleted (not waited for)
  assert_nothing_left_failed(kubectl, ns)  after a run has ended: no Job Failed, no pod Failed, no
                 RayJob whose job has ended while KubeRay still calls its deployment unfinished
  demo_command(ns, result, *extra)  `tpuft demo` as a user runs it, in namespace ns, writing its
                 result JSON to `result`: argv for subprocess (the demo starts no local Ray: it
                 drives the cluster's KubeRay, so it needs no Ray auth settings)

Marker `real_node`: a test that trains on the real node (CPU-heavy); `make test` runs those in
one lane and the rest of the cluster tests (simulated TPU hosts, mostly waiting) beside them.
"""
from __future__ import annotations

import json
import re
import sys
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
        # A healthy running cluster is used as it is: `make test`'s cluster lane has just brought
        # it up, and the other lane's session would only wait on that `up`'s lock to repeat it.
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
    drop_namespace(cluster_kubectl, name)


# Everything a run makes hangs off these (owner references): deleting them deletes the rest.
RUN_KINDS = "tpufinetunes.tpufinetune.dev,rayjobs.ray.io,rayclusters.ray.io,rayservices.ray.io"
RAY_POD_LABEL = "ray.io/node-type"   # on every pod KubeRay makes
# past the training pods' terminationGracePeriodSeconds (300 s: their preStop hook may wait for a
# stop checkpoint) plus the kubelet's own pace under load
PODS_GONE_S = 420


@pytest.fixture
def cluster_bucket(local_cluster, tmp_path, monkeypatch) -> str:
    """gs://BUCKET on the local cluster's GCS stand-in, holding builtin:tiny-llama saved as a model
    folder (models/tiny-llama) and builtin:dolly-mini's JSONL (data/dolly-mini.jsonl), uploaded
    through the workload's own storage code from this host (the bridge address)."""
    from tpuft_local import gcs
    from tpuft_workload import checkpoint, tiny

    for key, value in gcs.workload_env(local_cluster.gcs_endpoint, local_cluster.metadata_root).items():
        monkeypatch.setenv(key, value)   # this process and its children (`tpuft logs`, `tpuft plot`) reach the bucket
    monkeypatch.setenv("KUBECONFIG", str(local_cluster.kubeconfig))
    name = f"e2e-{uuid.uuid4().hex[:12]}"
    uri = gcs.create_bucket(local_cluster.gcs_endpoint, name)
    tokenizer = tiny.build_tokenizer()
    model = tmp_path / "tiny-llama"
    tiny.build_model(len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    checkpoint.upload_dir(str(model), f"{uri}/models/tiny-llama")
    checkpoint.write_bytes(f"{uri}/data/dolly-mini.jsonl", tiny.dolly_mini_path().read_bytes())
    return uri


# Each family's documented turn format (the chat template shipped with its instruct checkpoints, less
# tool calls), the turn markers its tokenizer holds as special tokens, and its role names (words
# dolly-mini's vocabulary lacks). Gemma 3 folds a system message into the first user turn.
FAMILY_CHAT = {
    "gemma3-text": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
        "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + m['content'] | trim }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
        ("<start_of_turn>", "<end_of_turn>"), ("user", "model")),
}


def family_model(bucket: str, family: str, tmp_path) -> str:
    """tests/workload/jax_families' tiny `family` model (transformers' own config class, random
    weights) over the built-in tokenizer (it covers builtin:dolly-mini's words) with the family's
    chat template, turn markers and role names, saved as safetensors and uploaded to BUCKET/models/tiny-FAMILY
    (cluster_bucket's environment reaches the bucket). Returns its gs:// URI."""
    from tests.workload import jax_families
    from tpuft_workload import checkpoint, tiny

    from tokenizers import AddedToken

    template, markers, roles = FAMILY_CHAT[family]
    tokenizer = tiny.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(markers)})
    tokenizer.add_tokens([AddedToken(role, single_word=True) for role in roles])
    tokenizer.chat_template = template
    folder = tmp_path / f"tiny-{family}"
    jax_families.save(family, str(folder), tokenizer=tokenizer)
    uri = f"{bucket}/models/tiny-{family}"
    checkpoint.upload_dir(str(folder), uri)
    return uri


def clear_namespace(kubectl, ns: str, timeout: float = PODS_GONE_S) -> None:
    kubectl("delete", RUN_KINDS, "--all", "-n", ns, "--wait=false", "--ignore-not-found")

    # Their runs are deleted, nothing is left to save: the pods go with a 1 s grace period if this
    # delete comes before the garbage collector's (the kubelet does not shorten a grace period it
    # has begun). A verifying run's namespace then cleared in 5 s, not 64 s (its preStop hooks); a
    # served model's pods still took their 30 s in CI runs 18 and 19 (teardowns of 33 s).
    def gone() -> bool:
        kubectl("delete", "pods", "-n", ns, "-l", RAY_POD_LABEL, "--grace-period=1", "--wait=false",
                "--ignore-not-found")
        res = kubectl("get", "pods", "-n", ns, "-l", RAY_POD_LABEL, "-o", "name")
        return res.returncode != 0 or not res.stdout.strip()
    wait_until(gone, timeout=timeout, interval=2, what=f"KubeRay's pods in {ns} to go")


def drop_namespace(kubectl, ns: str) -> None:
    """clear_namespace, then the namespace deleted, not waited for (gone by the next session, whose
    setup would otherwise wait some 10 s for it)."""
    clear_namespace(kubectl, ns)
    kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found")


def demo_command(ns: str, result, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tpuft.cli", "demo", "--namespace", ns, "--result", str(result), *extra]


JOB_ENDED = ("SUCCEEDED", "FAILED", "STOPPED")   # KubeRay's IsJobTerminal (RayJob status.jobStatus)
DEPLOYMENT_ENDED = ("Complete", "Failed")         # IsJobDeploymentTerminal (status.jobDeploymentStatus)


def assert_nothing_left_failed(kubectl, ns: str) -> None:
    """After a run has ended (Succeeded, Serving, Failed, Suspended): nothing it made is left in a
    failed or half-finished state. No Job with a Failed condition (e.g. KubeRay's submitter, whose
    head went while it followed the job's logs), no pod in phase Failed, no RayJob whose job has
    ended (jobStatus SUCCEEDED/FAILED/STOPPED) while its jobDeploymentStatus is not Complete/Failed.
    Objects already being deleted (deletionTimestamp set) are on their way out and not counted."""
    res = kubectl("get", "jobs.batch,pods,rayjobs.ray.io", "-n", ns, "-o", "json", check=True)
    offenders = []
    for item in json.loads(res.stdout)["items"]:
        meta, st = item["metadata"], item.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        what = f"{item['kind']} {meta['name']}"
        if item["kind"] == "Job":
            failed = [x for x in st.get("conditions") or [] if x.get("type") == "Failed" and x.get("status") == "True"]
            offenders += [f"{what}: Failed ({x.get('reason')}: {x.get('message')})" for x in failed]
        elif item["kind"] == "Pod" and st.get("phase") == "Failed":
            exits = [f"{c['name']} exit {c['state']['terminated'].get('exitCode')} "
                     f"({c['state']['terminated'].get('reason')})"
                     for c in st.get("containerStatuses") or [] if (c.get("state") or {}).get("terminated")]
            offenders.append(f"{what}: phase Failed" + (f" ({', '.join(exits)})" if exits else ""))
        elif (item["kind"] == "RayJob" and st.get("jobStatus") in JOB_ENDED
              and st.get("jobDeploymentStatus") not in DEPLOYMENT_ENDED):
            offenders.append(f"{what}: jobStatus {st.get('jobStatus')} but jobDeploymentStatus "
                             f"{st.get('jobDeploymentStatus') or '-'} (KubeRay never finished it)")
    assert not offenders, f"left failed or half-finished in namespace {ns}:\n  " + "\n  ".join(offenders)
