"""The local stand-in for the KubeRay TPU webhook (tpuft_local.tpu_webhook): what it injects
into TPU worker pods, which RayClusters it refuses, its AdmissionReview answers and its HTTPS
server. Expected values are spelled literally, as the real webhook's tests and e2e fixtures
spell them (ai-on-gke/kuberay-tpu-webhook), never derived from the module under test."""
from __future__ import annotations

import base64
import copy
import http.client
import json
import ssl
import threading

import pytest
import yaml

from tests.paths import EXAMPLES
from tpuft.controller import builders
from tpuft.api import catalog
from tpuft.api.spec import parse
from tpuft_local import kubepki
from tpuft_local import tpu_webhook as w

try:
    import jsonpatch
except ImportError:  # pragma: no cover - jsonpatch ships with the kubernetes client today
    jsonpatch = None

V6E, TPU7X = "tpu-v6e-slice", "tpu7x"


# --- Factories ----------------------------------------------------------------------------------
def worker_group(name="tpu-group", accelerator=V6E, topology="4x4", chips="4", hosts=4, replicas=1, env=None):
    container = {"name": "ray-worker", "image": "rayproject/ray:2.60.0",
                 "resources": {"limits": {"cpu": "1", "google.com/tpu": chips},
                               "requests": {"cpu": "1", "google.com/tpu": chips}}}
    if env is not None:
        container["env"] = env
    selector = {"cloud.google.com/gke-tpu-accelerator": accelerator, "cloud.google.com/gke-tpu-topology": topology}
    return {"groupName": name, "replicas": replicas, "numOfHosts": hosts, "rayStartParams": {},
            "template": {"spec": {"containers": [container], "nodeSelector": selector}}}


def raycluster(*groups, name="rc"):
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name, "namespace": "ns"},
            "spec": {"headGroupSpec": {"template": {"spec": {"containers": [{"name": "ray-head"}]}}},
                     "workerGroupSpecs": list(groups)}}


def kuberay_pod(cluster: dict, group: dict) -> dict:
    """A worker pod as KubeRay creates it from `group` (before any webhook ran)."""
    template = group["template"]
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    labels.update({"ray.io/cluster": cluster["metadata"]["name"], "ray.io/group": group["groupName"],
                   "ray.io/node-type": "worker", "app.kubernetes.io/name": "kuberay",
                   "app.kubernetes.io/created-by": "kuberay-operator"})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": f"{cluster['metadata']['name']}-{group['groupName']}-worker-",
                         "namespace": cluster["metadata"]["namespace"], "labels": labels},
            "spec": copy.deepcopy(template["spec"])}


def apply(doc: dict, ops) -> dict:
    """Apply a JSONPatch the way the API server does (jsonpatch if present, else the two ops used)."""
    if jsonpatch is not None:
        return jsonpatch.apply_patch(doc, list(ops))
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target.append(op["value"]) if last == "-" else target.insert(int(last), op["value"])
        else:
            target[last] = op["value"]
    return doc


def create_pods(cluster: dict, group: dict, count: int) -> list[dict]:
    """KubeRay creating `count` pods one after another, each admitted with the earlier ones listed."""
    made: list[dict] = []
    for _ in range(count):
        pod = kuberay_pod(cluster, group)
        made.append(apply(pod, w.mutate_pod(pod, siblings=made).ops))
    return made


def env_of(pod: dict, container: int = 0) -> dict:
    """Env as the kubelet resolves it: for a repeated name the last entry wins."""
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in pod["spec"]["containers"][container].get("env", [])}


# --- Mutation -----------------------------------------------------------------------------------
def test_v6e_4x4_four_hosts_get_ids_hostnames_and_one_tpu_name():
    group = worker_group()
    pods = create_pods(raycluster(group), group, 4)
    hostnames = ("tpu-group-0-0.rc-headless,tpu-group-0-1.rc-headless,"
                 "tpu-group-0-2.rc-headless,tpu-group-0-3.rc-headless")
    for i, pod in enumerate(pods):
        env = env_of(pod)
        assert env["TPU_WORKER_ID"] == str(i)
        assert env["TPU_NAME"] == "tpu-group-0"
        assert env["TPU_WORKER_HOSTNAMES"] == hostnames
        assert pod["spec"]["hostname"] == f"tpu-group-0-{i}"
        assert pod["spec"]["subdomain"] == "rc-headless"
        assert pod["metadata"]["labels"]["replicaIndex"] == "tpu-group-0"
        assert env["TORCH_TPU_TOPOLOGY"] == "4,4,1"
        assert env["TPU_DEVICE_PLUGIN_HOST_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
        assert env["TPU_DEVICE_PLUGIN_ADDR"] == "$(TPU_DEVICE_PLUGIN_HOST_IP):2112"
    addresses = env_of(pods[0])["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == 16  # one per chip, four chips on each of four hosts
    assert addresses[:5] == ["tpu-group-0-0.rc-headless:8471", "tpu-group-0-0.rc-headless:8472",
                             "tpu-group-0-0.rc-headless:8473", "tpu-group-0-0.rc-headless:8474",
                             "tpu-group-0-1.rc-headless:8471"]
    assert addresses[-1] == "tpu-group-0-3.rc-headless:8474"


def test_v6e_multi_host_pods_of_a_slice_attract_each_other_and_repel_other_slices():
    group = worker_group()
    (pod,) = create_pods(raycluster(group), group, 1)
    affinity = pod["spec"]["affinity"]
    (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["topologyKey"] == "cloud.google.com/gke-nodepool"
    assert together["labelSelector"]["matchExpressions"] == [
        {"key": "replicaIndex", "operator": "In", "values": ["tpu-group-0"]},
        {"key": "ray.io/cluster", "operator": "In", "values": ["rc"]}]
    other_slice, other_cluster = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert other_slice["labelSelector"]["matchExpressions"][0] == {
        "key": "replicaIndex", "operator": "NotIn", "values": ["tpu-group-0"]}
    assert other_cluster["labelSelector"]["matchExpressions"] == [
        {"key": "ray.io/cluster", "operator": "NotIn", "values": ["rc"]},
        {"key": "replicaIndex", "operator": "Exists"}]


def test_tpu7x_2x2x2_two_hosts_with_the_chiplet_suffix_and_process_addresses():
    group = worker_group(accelerator=TPU7X, topology="2x2x2", chips="4", hosts=2)
    pods = create_pods(raycluster(group), group, 2)
    for i, pod in enumerate(pods):
        env = env_of(pod)
        assert env["TPU_WORKER_ID"] == str(i)
        assert env["TORCH_TPU_TOPOLOGY"] == "2,2,2,2"
        assert env["TPU_WORKER_HOSTNAMES"] == "tpu-group-0-0.rc-headless,tpu-group-0-1.rc-headless"
        assert env["TPU_PROCESS_ADDRESSES"] == "tpu-group-0-0.rc-headless:8471,tpu-group-0-1.rc-headless:8471"
        assert env["TPU_PROCESS_PORT"] == "8471"
    addresses = env_of(pods[1])["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    # 8 devices per host (4 chips x 2 chiplets), ports 8471..8478 on each host.
    assert addresses == [f"tpu-group-0-{h}.rc-headless:{8471 + d}" for h in range(2) for d in range(8)]


def test_single_host_v6e_2x4_has_no_hostnames_and_bootstraps_on_localhost():
    group = worker_group(topology="2x4", chips="8", hosts=1)
    (pod,) = create_pods(raycluster(group), group, 1)
    env = env_of(pod)
    assert "TPU_WORKER_HOSTNAMES" not in env
    assert "hostname" not in pod["spec"] and "subdomain" not in pod["spec"] and "affinity" not in pod["spec"]
    assert env["TPU_WORKER_ID"] == "0"
    assert env["TPU_NAME"] == "tpu-group-0"
    assert env["TORCH_TPU_TOPOLOGY"] == "2,4,1"
    # The real webhook's e2e fixture v6e-8-single-host expects exactly this list.
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == (
        "localhost:8471,localhost:8472,localhost:8473,localhost:8474,"
        "localhost:8475,localhost:8476,localhost:8477,localhost:8478")


@pytest.mark.parametrize("topology,chips,hosts", [("4x4", "4", 4), ("2x2", "4", 1)], ids=["multi-host", "single-host"])
def test_multi_slice_group_gets_one_tpu_name_per_slice(topology, chips, hosts):
    group = worker_group(topology=topology, chips=chips, hosts=hosts, replicas=2)
    pods = create_pods(raycluster(group), group, 2 * hosts)
    by_name: dict[str, list[str]] = {}
    for pod in pods:
        env = env_of(pod)
        by_name.setdefault(env["TPU_NAME"], []).append(env["TPU_WORKER_ID"])
    assert by_name == {"tpu-group-0": [str(i) for i in range(hosts)], "tpu-group-1": [str(i) for i in range(hosts)]}
    if hosts > 1:
        assert env_of(pods[-1])["TPU_WORKER_HOSTNAMES"].split(",")[0] == "tpu-group-1-0.rc-headless"
        assert pods[-1]["spec"]["hostname"] == "tpu-group-1-3"


def test_megascale_env_only_when_the_user_sets_megascale_num_slices():
    group = worker_group(replicas=2, env=[{"name": "MEGASCALE_NUM_SLICES", "value": "2"}])
    pods = create_pods(raycluster(group), group, 5)
    env = env_of(pods[4])  # first host of the second slice
    assert (env["MEGASCALE_SLICE_ID"], env["MEGASCALE_PORT"]) == ("1", "8081")
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "tpu-group-0-0.rc-headless"
    assert "MEGASCALE_SLICE_ID" not in env_of(create_pods(raycluster(worker_group()), worker_group(), 1)[0])


def test_non_tpu_pod_is_left_untouched():
    group = worker_group(name="cpu-group")
    del group["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"]
    del group["template"]["spec"]["containers"][0]["resources"]["requests"]["google.com/tpu"]
    result = w.mutate_pod(kuberay_pod(raycluster(group), group))
    assert result.ops == () and result.slot is None


def test_a_freed_host_index_is_reused_and_deleting_pods_do_not_count():
    group = worker_group()
    pods = create_pods(raycluster(group), group, 4)
    pods[1]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # host 1 is going away
    survivors = [pods[0], pods[1], pods[3]]
    replacement = w.mutate_pod(kuberay_pod(raycluster(group), group), siblings=survivors)
    assert replacement.slot == w.Slot(replica=0, host=1)


def test_two_pods_claiming_one_host_refuse_the_next_pod():
    group = worker_group()
    first = create_pods(raycluster(group), group, 1)
    with pytest.raises(w.Refusal, match="Identical TPU_WORKER_ID assigned to multiple TPU workers in slice"):
        w.mutate_pod(kuberay_pod(raycluster(group), group), siblings=[first[0], copy.deepcopy(first[0])])


def test_kuberay_index_labels_win_over_counting_siblings():
    group = worker_group()
    pod = kuberay_pod(raycluster(group), group)
    pod["metadata"]["labels"].update({"ray.io/worker-group-replica-index": "1", "ray.io/replica-host-index": "2",
                                      "ray.io/worker-group-replica-name": "tpu-group-xh3hf"})
    out = apply(pod, w.mutate_pod(pod).ops)
    assert (env_of(out)["TPU_WORKER_ID"], env_of(out)["TPU_NAME"], out["spec"]["hostname"]) == (
        "2", "tpu-group-1", "tpu-group-1-2")
    assert "replicaIndex" not in out["metadata"]["labels"]  # KubeRay's labels make the webhook's redundant
    term = out["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchExpressions"][0] == {
        "key": "ray.io/worker-group-replica-name", "operator": "In", "values": ["tpu-group-xh3hf"]}


def test_values_the_user_set_are_kept():
    group = worker_group(env=[{"name": "TORCH_TPU_TOPOLOGY", "value": "mine"}, {"name": "TPU_NAME", "value": "x"}])
    (pod,) = create_pods(raycluster(group), group, 1)
    env = env_of(pod)
    assert (env["TORCH_TPU_TOPOLOGY"], env["TPU_NAME"]) == ("mine", "x")
    assert "TORCH_TPU_SLICEBUILDER_ADDRESSES" not in env  # skipped together with the topology


@pytest.mark.parametrize("breakage,message", [
    (lambda p: p["metadata"]["labels"].pop("ray.io/cluster"), "missing RayCluster label"),
    (lambda p: p["metadata"]["labels"].pop("ray.io/group"), "missing Group label"),
    (lambda p: p["spec"]["nodeSelector"].pop("cloud.google.com/gke-tpu-topology"), "missing TPU topology nodeSelector"),
    (lambda p: p["spec"]["nodeSelector"].update({"cloud.google.com/gke-tpu-topology": "4xfour"}), "invalid TPU topology"),
])
def test_malformed_tpu_pods_are_refused(breakage, message):
    group = worker_group()
    pod = kuberay_pod(raycluster(group), group)
    breakage(pod)
    with pytest.raises(w.Refusal, match=message):
        w.mutate_pod(pod)


def test_long_cluster_names_shorten_the_headless_service_as_kuberay_does():
    assert w.headless_service_name("really-really-extremely-long-test-raycluster-name") == (
        "eally-extremely-long-test-raycluster-name-headless")


# --- Validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [
    worker_group(),                                                    # v6e 4x4: 4 hosts
    worker_group(topology="2x4", chips="8", hosts=1),                  # v6e 2x4 on one 8-chip VM
    worker_group(accelerator=TPU7X, topology="2x2x2", chips="4", hosts=2),
    worker_group(topology="16x16", chips="4", hosts=64, replicas=2),
], ids=["v6e-4x4", "v6e-2x4", "tpu7x-2x2x2", "v6e-16x16-x2"])
def test_groups_whose_hosts_match_their_topology_are_admitted(group):
    assert w.validate_raycluster(raycluster(group)).allowed


def test_wrong_num_of_hosts_is_refused_with_the_real_message():
    decision = w.validate_raycluster(raycluster(worker_group(name="cpu", hosts=1, chips="0"), worker_group(hosts=1)))
    assert not decision.allowed
    assert decision.message.startswith("Number of workers in worker group not equal to specified topology")
    assert "'tpu-group'" in decision.message and "needs 4" in decision.message


@pytest.mark.parametrize("edit,message", [
    (lambda g: g["template"]["spec"]["nodeSelector"].pop("cloud.google.com/gke-tpu-topology"),
     "TPU topology not specified"),
    (lambda g: g.update(numOfHosts=0), "workerGroupSpec NumOfHosts not set"),
    (lambda g: g["template"]["spec"]["nodeSelector"].update({"cloud.google.com/gke-tpu-topology": "4by4"}),
     "invalid TPU topology"),
])
def test_incomplete_tpu_groups_are_refused(edit, message):
    group = worker_group()
    edit(group)
    decision = w.validate_raycluster(raycluster(group))
    assert not decision.allowed and decision.message.startswith(message)
    assert "'tpu-group'" in decision.message


def test_a_group_without_google_com_tpu_is_not_the_webhooks_business():
    # The real webhook passes such a group through (it is not a TPU group to it), even with
    # TPU node selectors: the operator must not rely on the webhook to catch a missing limit.
    group = worker_group()
    for kind in ("limits", "requests"):
        del group["template"]["spec"]["containers"][0]["resources"][kind]["google.com/tpu"]
    assert w.validate_raycluster(raycluster(group)).allowed


def _tpufinetune(accelerator: str, topology: str, slices: int) -> dict:
    doc = yaml.safe_load((EXAMPLES / "v6e-4x4.yaml").read_text())
    doc["spec"].update(accelerator=accelerator, topology=topology, slices=slices)
    return doc


SHAPES = [(g.name, t) for g in catalog.GENERATIONS for t in g.topologies]


@pytest.mark.parametrize("accelerator,topology", SHAPES, ids=[f"{a}-{t}" for a, t in SHAPES])
def test_every_raycluster_the_operator_renders_is_admitted_and_sized_right(accelerator, topology):
    cluster = builders.build_raycluster(parse(_tpufinetune(accelerator, topology, slices=2)))
    assert w.validate_raycluster(cluster).allowed, w.validate_raycluster(cluster).message
    (group,) = cluster["spec"]["workerGroupSpecs"]
    tp = w.read_tpu_pod(kuberay_pod(cluster, group))
    assert tp.hosts == group["numOfHosts"] == catalog.resolve_slice(accelerator, topology).hosts


# --- AdmissionReview ----------------------------------------------------------------------------
def review(kind: str, obj, operation="CREATE", uid="0b1c2d3e"):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": kind},
                        "operation": operation, "namespace": "ns", "object": obj}}


def test_mutate_review_round_trip_applies_cleanly():
    group = worker_group()
    pod = kuberay_pod(raycluster(group), group)
    pod["metadata"].pop("namespace")  # the API server may not have filled it in yet
    seen = []
    body, decision = w.answer("/mutate", review("Pod", pod),
                              lambda ns, cluster, grp: seen.append((ns, cluster, grp)) or [])
    response = body["response"]
    assert (body["kind"], response["uid"], response["allowed"], response["patchType"]) == (
        "AdmissionReview", "0b1c2d3e", True, "JSONPatch")
    patched = apply(pod, json.loads(base64.b64decode(response["patch"])))
    assert env_of(patched)["TPU_WORKER_ID"] == "0" and patched["spec"]["hostname"] == "tpu-group-0-0"
    assert seen == [("ns", "rc", "tpu-group")]  # siblings listed from the request's namespace


def test_validate_review_denial_carries_the_message():
    body, _ = w.answer("/validate", review("RayCluster", raycluster(worker_group(hosts=2)), operation="UPDATE"))
    response = body["response"]
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["message"].startswith("Number of workers in worker group not equal to specified topology")


def test_non_tpu_pod_review_is_allowed_without_a_patch():
    body, _ = w.answer("/mutate", review("Pod", {"metadata": {}, "spec": {"containers": [{"name": "c"}]}}))
    assert body["response"] == {"uid": "0b1c2d3e", "allowed": True}


@pytest.mark.parametrize("path,payload,message", [
    ("/mutate", None, "not an AdmissionReview"),
    ("/mutate", {"request": "nope"}, "not an AdmissionReview"),
    ("/mutate", review("RayCluster", {}), "Invalid Kind"),
    ("/validate", review("Pod", {}), "Invalid Kind"),
    ("/validate", review("RayCluster", None), "has no object"),
    ("/elsewhere", review("Pod", {}), "unknown webhook path"),
    ("/mutate", review("Pod", {"spec": {"containers": "garbage"}}), "could not read the object"),
])
def test_odd_input_is_answered_never_raised(path, payload, message):
    body, decision = w.answer(path, payload)
    assert body["response"]["allowed"] is False and message in body["response"]["status"]["message"]


def test_a_failing_pod_lister_refuses_the_pod_and_names_the_group():
    group = worker_group()

    def broken(*_):
        raise ConnectionError("refused")

    body, _ = w.answer("/mutate", review("Pod", kuberay_pod(raycluster(group), group)), broken)
    assert body["response"]["allowed"] is False
    assert "cannot list pods of RayCluster ns/rc group 'tpu-group'" in body["response"]["status"]["message"]


def test_pods_admitted_but_not_yet_listed_keep_their_slot_until_listed_or_expired():
    now = [0.0]
    pending = w.PendingSlots(ttl=5.0, clock=lambda: now[0])
    group = worker_group()
    pod = kuberay_pod(raycluster(group), group)

    def slot_of(siblings=()):
        return w.decide_mutation(review("Pod", pod)["request"], lambda *_: list(siblings), pending).detail

    assert "replica=0 host=0" in slot_of()
    assert "replica=0 host=1" in slot_of()  # the first pod is not listed yet: its slot stays taken
    now[0] = 10.0
    assert "replica=0 host=0" in slot_of()  # neither appeared within the ttl: both freed


# --- Registration -------------------------------------------------------------------------------
def test_webhook_configurations_point_at_the_url_with_the_real_rules():
    mutating, validating = w.webhook_configurations("https://10.88.0.1:9443", b"-----BEGIN CERTIFICATE-----\n")
    (m,), (v,) = mutating["webhooks"], validating["webhooks"]
    assert m["clientConfig"]["url"] == "https://10.88.0.1:9443/mutate"
    assert v["clientConfig"]["url"] == "https://10.88.0.1:9443/validate"
    assert base64.b64decode(m["clientConfig"]["caBundle"]) == b"-----BEGIN CERTIFICATE-----\n"
    assert m["objectSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kuberay"}}
    assert m["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                           "resources": ["pods"], "scope": "Namespaced"}]
    assert v["rules"][0]["resources"] == ["rayclusters"] and v["rules"][0]["apiGroups"] == ["ray.io"]
    assert set(v["rules"][0]["operations"]) == {"CREATE", "UPDATE"}
    for hook in (m, v):
        assert (hook["failurePolicy"], hook["sideEffects"], hook["admissionReviewVersions"]) == ("Fail", "None", ["v1"])
        assert hook["timeoutSeconds"] <= 10
    with pytest.raises(ValueError, match="https"):
        w.webhook_configurations("http://10.88.0.1:9443", b"")


# --- HTTPS server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    pki = tmp_path_factory.mktemp("pki")
    kubepki.ensure_pki(pki)
    cert, key = w.mint_serving_cert(pki, "127.0.0.1")
    client = ssl.create_default_context(cafile=str(pki / "ca.crt"))  # verifies the IP SAN too
    return cert, key, client


def _post(server: w.WebhookServer, client: ssl.SSLContext, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection(server.host, server.port, context=client, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_https_round_trip_with_a_freshly_minted_cert(tls):
    cert, key, client = tls
    group = worker_group()
    existing = create_pods(raycluster(group), group, 1)  # host 0 of slice 0 already runs
    lookups = []

    def lister(namespace, cluster, grp):
        lookups.append(threading.current_thread().name)
        return existing

    with w.WebhookServer("127.0.0.1", 0, cert, key, lister) as server:
        assert server.url.startswith("https://127.0.0.1:")
        status, raw = _post(server, client, "/mutate", json.dumps(review("Pod", kuberay_pod(raycluster(group), group))).encode())
        assert status == 200
        response = json.loads(raw)["response"]
        patched = apply(kuberay_pod(raycluster(group), group), json.loads(base64.b64decode(response["patch"])))
        assert env_of(patched)["TPU_WORKER_ID"] == "1" and lookups

        status, raw = _post(server, client, "/validate",
                            json.dumps(review("RayCluster", raycluster(worker_group(hosts=3)))).encode())
        assert status == 200 and json.loads(raw)["response"]["allowed"] is False

        status, raw = _post(server, client, "/mutate", b"{not json")
        assert (status, raw) == (400, b"Error decoding request body")


def test_server_refuses_clients_that_do_not_trust_its_ca(tls):
    cert, key, _ = tls
    with w.WebhookServer("127.0.0.1", 0, cert, key) as server:
        with pytest.raises(ssl.SSLCertVerificationError):
            _post(server, ssl.create_default_context(), "/validate", b"{}")
