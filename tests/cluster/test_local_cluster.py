"""The local cluster is real where it says so: a Ready kubelet on containerd, KubeRay's own
controllers creating the pods, the real scheduler placing a v6e slice on a simulated v6e pool (and
two slices on two pools), the TPU webhook stand-in admitting through the API server, and guard rules
that keep the pods' traffic on the machine."""
from __future__ import annotations

import copy
import json
import subprocess

import yaml

from tests.cluster_fixtures import clear_namespace, demo_command
from tests.paths import EXAMPLES, REPO
from tests.waiting import wait_until
from tpuft_local import host, node, pools
from tpuft_local.tpu_webhook import MISMATCH_MESSAGE

OPERATOR_IMAGE = "ghcr.io/tpufinetune/tpufinetune-operator:0.1.0"


def _json(kubectl, *args):
    res = kubectl(*args, "-o", "json", check=True)
    return json.loads(res.stdout)


def test_the_node_is_a_real_kubelet_on_containerd(cluster_kubectl):
    n = _json(cluster_kubectl, "get", "node", node.NODE_NAME)
    assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert n["status"]["nodeInfo"]["kubeletVersion"] == "v1.35.3"
    assert pools.KWOK_ANNOTATION not in (n["metadata"].get("annotations") or {})
    assert {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"] == "True"


def test_simulated_pools_look_like_gke_tpu_node_pools(cluster_kubectl):
    nodes = _json(cluster_kubectl, "get", "nodes", "-l", "type=kwok")["items"]
    by_shape: dict[tuple, list[dict]] = {}
    for n in nodes:
        lbl = n["metadata"]["labels"]
        by_shape.setdefault((lbl.get("cloud.google.com/gke-tpu-accelerator"),
                             lbl.get("cloud.google.com/gke-tpu-topology"),
                             lbl["node.kubernetes.io/instance-type"]), []).append(n)
    assert len(by_shape[("tpu-v6e-slice", "4x4", "ct6e-standard-4t")]) == 8   # two slices, a node pool each
    assert len(by_shape[("tpu7x", "2x2x2", "tpu7x-standard-4t")]) == 2
    assert len(by_shape[(None, None, pools.CPU_POOL_MACHINE)]) == 1
    for n in by_shape[("tpu-v6e-slice", "4x4", "ct6e-standard-4t")]:
        assert n["status"]["capacity"]["google.com/tpu"] == "4"
        assert n["status"]["capacity"]["cpu"] == "180"
        assert {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"} in n["spec"]["taints"]
        assert {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"] == "True"


def test_guard_rules_keep_pod_traffic_on_the_machine(local_cluster, cluster_kubectl, cluster_ns):
    assert host.guard_in_place(local_cluster.net)
    machine_ip = _machine_address()
    probe = (f"import socket\n"
             f"print('kubernetes', socket.gethostbyname('kubernetes.default.svc.cluster.local'))\n"
             f"try:\n    socket.gethostbyname('pypi.org'); print('external name resolved')\n"
             f"except OSError:\n    print('external name refused')\n"
             f"s = socket.socket(); s.settimeout(3)\n"
             f"try:\n    s.connect(({machine_ip!r}, 22)); print('machine reachable')\n"
             f"except OSError:\n    print('machine unreachable')\n")
    cluster_kubectl("run", "probe", "-n", cluster_ns, "--restart=Never", f"--image={OPERATOR_IMAGE}",
                    "--image-pull-policy=Never", "--command", "--", "python", "-c", probe, check=True)
    wait_until(lambda: _json(cluster_kubectl, "get", "pod", "probe", "-n", cluster_ns)["status"]["phase"]
               in ("Succeeded", "Failed"), timeout=120, what="the probe pod to finish")
    out = cluster_kubectl("logs", "probe", "-n", cluster_ns, check=True).stdout
    assert f"kubernetes {local_cluster.net.kubernetes_service_ip}" in out
    assert "external name refused" in out and "machine unreachable" in out, out


def _machine_address() -> str:
    """The machine's own interface address (not loopback, not our bridge), read at run time."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        dev, addr = line.split()[1], line.split()[3].split("/")[0]
        if dev != "lo" and not dev.startswith("tpuft"):
            return addr
    raise AssertionError(f"no interface address in:\n{out}")


def _rehearsal(name: str) -> dict:
    doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["verification"]["timeoutSeconds"] = 60
    doc["spec"]["provisioningTimeoutSeconds"] = 300
    return doc


REHEARSAL_NS = "e2e-rehearse"


def test_rehearse_tpu_lands_the_slice_on_the_simulated_pool_with_the_webhooks_env_and_says_so(
        cluster_kubectl, tmp_path):
    """`tpuft demo --rehearse-tpu` (examples/v6e-4x4.yaml, as a user rehearses a slice here),
    watched from outside while it runs: KubeRay's own pods on the 4 simulated v6e hosts, the TPU
    webhook stand-in's env on them as the API server stored them, KubeRay's conditions read by our
    operator, verification started; then, since nothing executes on simulated hosts, the run ends
    at the verification deadline, which is the rehearsal going as designed: the demo says
    `rehearsal complete` and SIMULATED, and exits 0."""
    result = tmp_path / "result.json"
    demo = subprocess.Popen(demo_command(REHEARSAL_NS, result, "--rehearse-tpu"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _watch_the_rehearsal(cluster_kubectl, REHEARSAL_NS, "gemma4-dolly")
        out, _ = demo.communicate(timeout=900)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        clear_namespace(cluster_kubectl, REHEARSAL_NS)
    assert demo.returncode == 0 and "phase VerifyingCollectives" in out, out[-4000:]
    assert "rehearsal complete: its 4 Ray workers ran on SIMULATED hosts" in out, out[-4000:]
    assert "(verification cannot run on simulated hosts: the " in out and "did not go as designed" not in out, \
        out[-4000:]
    final = json.loads(result.read_text())
    workers = {k: v for k, v in final["placement"].items() if "worker" in k}
    assert len(workers) == 4 and all(v["simulated"] for v in workers.values()), final["placement"]
    assert final["object"]["status"]["reason"] in ("CollectiveTimeout", "VerificationFailed"), final["object"]["status"]


def _watch_the_rehearsal(kubectl, ns: str, name: str) -> None:
    def workers():
        res = kubectl("get", "pods", "-n", ns, "-l", "ray.io/node-type=worker", "-o", "json")
        pods = json.loads(res.stdout)["items"] if res.returncode == 0 else []
        return pods if len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods) else None

    pods = wait_until(workers, timeout=300, what="4 KubeRay worker pods placed")
    pool = pods[0]["spec"]["nodeName"].rsplit("-", 1)[0]   # either v6e pool; all four on that one
    assert sorted(p["spec"]["nodeName"] for p in pods) == [f"{pool}-{h}" for h in range(4)]
    for p in pods:
        assert p["metadata"]["labels"]["app.kubernetes.io/created-by"] == "kuberay-operator"
        assert p["metadata"]["ownerReferences"][0]["kind"] == "RayCluster"
    # The TPU webhook stand-in's mutation, on the pods the API server stored.
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env", [])} for p in pods]
    assert sorted(e["TPU_WORKER_ID"] for e in envs) == ["0", "1", "2", "3"]
    assert all(e["TORCH_TPU_TOPOLOGY"] == "4,4,1" and len(e["TPU_WORKER_HOSTNAMES"].split(",")) == 4 for e in envs)
    assert len({e["TPU_NAME"] for e in envs}) == 1
    assert all(p["spec"].get("hostname") and p["spec"].get("subdomain") for p in pods)
    # `kubectl logs` on a simulated host's pod is answered by that host (KWOK, saying no container
    # runs there), never by the real kubelet, which answered 404 for a pod it never ran.
    pod, container = pods[0]["metadata"]["name"], pods[0]["spec"]["containers"][0]["name"]
    logs = wait_until(lambda: (r := kubectl("logs", pod, "-n", ns, "-c", container)).returncode == 0 and r,
                      timeout=60, what=f"kubectl logs {pod} to answer")
    assert "simulated GKE host (KWOK): no container runs here" in logs.stdout, logs.stdout

    # KubeRay's own status, read by our operator: the slice is provisioned and verification starts.
    rc_name = pods[0]["metadata"]["labels"]["ray.io/cluster"]
    rc = wait_until(lambda: ((r := _json(kubectl, "get", "raycluster", rc_name, "-n", ns)).get("status") or {})
                    .get("state") == "ready" and r, timeout=180, what="KubeRay to mark the RayCluster ready")
    conds = {c["type"]: c["status"] for c in rc["status"]["conditions"]}
    assert conds["HeadPodReady"] == "True" and conds["RayClusterProvisioned"] == "True"
    tft = wait_until(lambda: (t := _json(kubectl, "get", "tft", name, "-n", ns))
                     ["status"].get("phase") in ("VerifyingCollectives", "Failed") and t,
                     timeout=120, what="our operator to start verification")
    assert tft["status"]["phase"] == "VerifyingCollectives", tft["status"]


def test_webhook_refuses_a_raycluster_whose_num_of_hosts_does_not_match(cluster_kubectl, cluster_ns):
    rendered = subprocess.run([".venv/bin/tpuft", "render", str(EXAMPLES / "v6e-4x4.yaml")], capture_output=True,
                              text=True, check=True).stdout
    rc = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "RayCluster")
    bad = copy.deepcopy(rc)
    bad["metadata"] = {"name": "wrong-hosts"}
    bad["spec"]["workerGroupSpecs"][0]["numOfHosts"] = 2
    res = cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(bad))
    assert res.returncode != 0
    assert "denied the request" in res.stderr and MISMATCH_MESSAGE in res.stderr, res.stderr
    assert cluster_kubectl("get", "raycluster", "wrong-hosts", "-n", cluster_ns).returncode != 0


def _tft(kubectl, ns: str, name: str) -> dict:
    return _json(kubectl, "get", "tft", name, "-n", ns)


def _provisioning_with(kubectl, ns: str, name: str, text: str, timeout: float) -> dict:
    """The object while still Provisioning, once its message carries `text`."""
    def check():
        st = _tft(kubectl, ns, name).get("status") or {}   # none yet: the operator has not seen it (or restarts)
        assert st.get("phase") in (None, "Pending", "Provisioning"), st
        return st if st.get("phase") == "Provisioning" and text in st.get("message", "") else None
    return wait_until(check, timeout=timeout, what=f"{text!r} in {name}'s status while Provisioning")


def test_a_shape_no_pool_offers_says_why_then_ends_in_provisioning_timeout(cluster_kubectl, cluster_ns):
    doc = _rehearsal("too-big")
    doc["spec"]["topology"] = "4x8"
    doc["spec"]["provisioningTimeoutSeconds"] = 120
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)
    # before the deadline, while still Provisioning: the scheduler's words on the pod, read by the
    # operator (which lists pods every 10 s; the margin covers a loaded machine or an operator
    # restarted by another lane's test)
    st = _provisioning_with(cluster_kubectl, cluster_ns, "too-big", "didn't match Pod's node affinity/selector", 110)
    assert "cannot be scheduled: the scheduler says: 0/" in st["message"], st["message"]
    slice_cond = next(x for x in st["conditions"] if x["type"] == "SliceProvisioned")
    assert "the scheduler says" in slice_cond["message"], slice_cond
    tft = wait_until(lambda: ((t := _json(cluster_kubectl, "get", "tft", "too-big", "-n", cluster_ns))
                              .get("status") or {}).get("phase") == "Failed" and t, timeout=210, what="ProvisioningTimeout")
    assert tft["status"]["reason"] == "ProvisioningTimeout"
    events = _json(cluster_kubectl, "get", "events", "-n", cluster_ns, "--field-selector", "reason=FailedScheduling")
    assert any("didn't match Pod's node affinity/selector" in e["message"] for e in events["items"]), events
    # the real cause, read by the operator (from its image, under the chart's RBAC), is in the status
    assert "the scheduler says: 0/" in tft["status"]["message"], tft["status"]["message"]
    assert "didn't match Pod's node affinity/selector" in tft["status"]["message"], tft["status"]["message"]


def test_an_image_that_does_not_exist_is_named_while_provisioning(cluster_kubectl, cluster_ns, tmp_path):
    """The kubelet's pull error on the real node (every registry here is a closed loopback port,
    so the pull fails at once, locally), in status while the object is still Provisioning."""
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["spec"].pop("serve")   # never gets that far
    doc["metadata"]["name"] = "no-image"
    doc["spec"]["image"] = "docker.io/tpufinetune/workload:does-not-exist"
    doc["spec"]["provisioningTimeoutSeconds"] = 600
    doc["spec"]["checkpoint"] = {"storagePath": str(tmp_path / "checkpoints")}
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)
    st = _provisioning_with(cluster_kubectl, cluster_ns, "no-image", "cannot be pulled", 120)
    assert "image docker.io/tpufinetune/workload:does-not-exist cannot be pulled (" in st["message"], st["message"]
    events = _json(cluster_kubectl, "get", "events", "-n", cluster_ns, "--field-selector",
                   "involvedObject.name=no-image,reason=SliceBlocked")["items"]
    assert events and "cannot be pulled" in events[0]["message"], events


def test_two_slices_land_each_whole_on_its_own_node_pool(cluster_kubectl, cluster_ns):
    """examples/v6e-4x4x2.yaml applied (the operator renders one worker group, replicas 2,
    numOfHosts 4) on the two simulated v6e 4x4 pools: the real scheduler, with the TPU webhook's
    per-slice pod affinity on cloud.google.com/gke-nodepool, puts each slice's 4 pods on one pool
    and the two slices on different pools; each slice has its own TPU_NAME, hostnames and worker
    ids 0-3."""
    doc = yaml.safe_load((EXAMPLES / "v6e-4x4x2.yaml").read_text())
    doc["metadata"]["name"] = "two-slices"
    cluster_kubectl("apply", "-n", cluster_ns, "-f", "-", input=json.dumps(doc), check=True)

    def placed():
        res = cluster_kubectl("get", "pods", "-n", cluster_ns, "-l", "ray.io/cluster=two-slices-ray,ray.io/node-type=worker",
                              "-o", "json")
        pods = json.loads(res.stdout)["items"] if res.returncode == 0 else []
        return pods if len(pods) == 8 and all(p["spec"].get("nodeName") for p in pods) else None

    try:
        pods = wait_until(placed, timeout=300, what="8 worker pods of two v6e 4x4 slices placed")
        nodes = {n["metadata"]["name"]: n["metadata"]["labels"][pools.POOL_LABEL]
                 for n in _json(cluster_kubectl, "get", "nodes", "-l", "type=kwok")["items"]}
        slices: dict[str, list[tuple[str, dict]]] = {}
        for p in pods:
            env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env", [])}
            slices.setdefault(env["TPU_NAME"], []).append((nodes[p["spec"]["nodeName"]], env))
        assert len(slices) == 2 and all(len(members) == 4 for members in slices.values()), slices.keys()
        pools_used = [{pool for pool, _ in members} for members in slices.values()]
        assert all(len(used) == 1 for used in pools_used), pools_used          # each slice whole on one pool
        assert sorted(next(iter(u)) for u in pools_used) == ["v6e-4x4-0", "v6e-4x4-1"]   # never sharing one
        for members in slices.values():
            assert sorted(env["TPU_WORKER_ID"] for _, env in members) == ["0", "1", "2", "3"]
            assert len({env["TPU_WORKER_HOSTNAMES"] for _, env in members}) == 1
        assert len({members[0][1]["TPU_WORKER_HOSTNAMES"] for members in slices.values()}) == 2
    finally:
        cluster_kubectl("delete", "tft", "two-slices", "-n", cluster_ns, "--ignore-not-found", "--wait=false")
