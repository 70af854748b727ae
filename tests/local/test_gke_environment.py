"""The local GKE environment stand-in: KubeRay's Ray pods get where GCS and the metadata server are,
a container's own value wins, and the same webhook process answers on its own path."""
import base64
import json

from tpuft_local import gke_environment, tpu_webhook

ENV = {"CLOUD_STORAGE_EMULATOR_ENDPOINT": "http://10.9.0.1:4443", "GCE_METADATA_ROOT": "10.9.0.1:8080"}


def _pod(*containers: dict) -> dict:
    return {"metadata": {"labels": dict(gke_environment.RAY_POD_LABELS)}, "spec": {"containers": list(containers)}}


def _apply(pod: dict, patch: list[dict]) -> dict:
    """A minimal JSONPatch 'add' (the only op the stand-in makes), as the API server applies it."""
    for op in patch:
        assert op["op"] == "add"
        *parents, last = op["path"].strip("/").split("/")
        target = pod
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if last == "-":
            target.append(op["value"])
        else:
            target[last] = op["value"]
    return pod


def test_every_container_gets_both_variables_and_a_value_of_its_own_is_kept():
    pod = _pod({"name": "ray-head"},
               {"name": "ray-worker", "env": [{"name": "GCE_METADATA_ROOT", "value": "mine:1"}, {"name": "A", "value": "b"}]})
    out = _apply(pod, gke_environment.mutate_pod(pod, ENV))
    head, worker = out["spec"]["containers"]
    assert {e["name"]: e["value"] for e in head["env"]} == ENV
    assert {e["name"]: e["value"] for e in worker["env"]} == {
        "GCE_METADATA_ROOT": "mine:1", "A": "b", "CLOUD_STORAGE_EMULATOR_ENDPOINT": ENV["CLOUD_STORAGE_EMULATOR_ENDPOINT"]}
    assert gke_environment.mutate_pod(out, ENV) == []   # nothing left to add


def test_the_webhook_process_answers_the_gke_environment_path_only_when_given_the_variables():
    pod = _pod({"name": "ray-worker"})
    review = {"request": {"uid": "u1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod}}
    body, decision = tpu_webhook.answer(gke_environment.MUTATE_PATH, review, gke_env=ENV)
    assert decision.allowed and body["response"]["uid"] == "u1"
    patch = json.loads(base64.b64decode(body["response"]["patch"]))
    assert {e["name"] for e in _apply(pod, patch)["spec"]["containers"][0]["env"]} == set(ENV)
    _, refused = tpu_webhook.answer(gke_environment.MUTATE_PATH, review)
    assert not refused.allowed and "unknown webhook path" in refused.message


def test_the_configuration_selects_kuberay_s_pods_and_fails_closed():
    (hook,) = gke_environment.webhook_configuration("https://10.9.0.1:9443", b"CA")["webhooks"]
    assert hook["clientConfig"]["url"] == "https://10.9.0.1:9443" + gke_environment.MUTATE_PATH
    assert hook["objectSelector"] == {"matchLabels": {"app.kubernetes.io/created-by": "kuberay-operator"}}
    assert hook["failurePolicy"] == "Fail" and hook["rules"][0]["resources"] == ["pods"]
    assert gke_environment.parse_env(["A=b=c"]) == {"A": "b=c"}
