"""The Hugging Face token never appears anywhere, and the workload identity is least-privilege.

  test_hf_token_never_leaks   1 Secret with a fresh random token; 2 TPUFinetunes (one using the
                              Secret via spec.hfTokenSecret, one not) driven to Succeeded by the
                              operator (a real `kopf run --debug` subprocess, talking to the API
                              server through tests/faultproxy.py with no faults, only to record
                              every request) and the KubeRay player. The token, raw and base64,
                              is searched for in 5 places: `tpuft render` output, every object in
                              the namespace (`kubectl get all,rayclusters,rayjobs,tpufinetunes,
                              events,serviceaccounts,roles,rolebindings -o yaml`), `kubectl describe
                              tft`, the operator's log, and the operator's request log. Positive
                              control: the same search finds it in `kubectl get secret -o yaml`.
                              The operator made 0 requests to any secrets path; every HF_TOKEN env
                              in the rendered and live children is a secretKeyRef.
  test_workload_identity_rbac 8 `kubectl auth can-i` checks on the identities the operator made in
                              that run, impersonating NAME-workload: may patch (and get) tpufinetunes/
                              NAME status; may not patch OTHER's status, patch NAME itself, get
                              secrets (list or by name), create rayjobs; OTHER-workload may not patch
                              NAME's status.

(The operator ServiceAccount from the chart is checked in tests/chart/.)
"""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.faultproxy import FaultProxy
from tests.operator_harness import (GROUP, PLURAL, VERSION, OperatorProcess, PhaseRecorder, Player, tft_body,
                                    wait_all_terminal)

NAME, OTHER = "ft", "other"
SECRET, KEY = "hf-token", "token"
GET_EVERYTHING = "all,rayclusters,rayjobs,tpufinetunes,events,serviceaccounts,roles,rolebindings"


def hf_env_refs(obj, out=None) -> list[dict]:
    """Every container env entry named HF_TOKEN anywhere in a (nested) object."""
    out = [] if out is None else out
    if isinstance(obj, dict):
        if obj.get("name") == "HF_TOKEN" and ("value" in obj or "valueFrom" in obj):
            out.append(obj)
        for v in obj.values():
            hf_env_refs(v, out)
    elif isinstance(obj, list):
        for v in obj:
            hf_env_refs(v, out)
    return out


def with_token(namespace: str, name: str) -> dict:
    body = tft_body(namespace, name, "ok")
    body["spec"]["hfTokenSecret"] = {"name": SECRET, "key": KEY}
    return body


@pytest.fixture(scope="module")
def lifecycle(kubeconfig, kube_api, kubectl, control_plane, tmp_path_factory):
    """A namespace with the Secret and 2 TPUFinetunes run to Succeeded; what the tests search."""
    namespace = f"hftoken-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", namespace, check=True)
    tmp_path = tmp_path_factory.mktemp("secrets")
    token = "hf_" + uuid.uuid4().hex + uuid.uuid4().hex[:6]
    kubectl("create", "secret", "generic", SECRET, "-n", namespace, f"--from-literal={KEY}={token}", check=True)
    manifest = tmp_path / "ft.yaml"
    manifest.write_text(yaml.safe_dump(with_token(namespace, NAME)))
    custom = client.CustomObjectsApi(kube_api)
    proxy = FaultProxy(control_plane.server_url, control_plane.pki, seed=0).start()  # never activated: no faults
    op = OperatorProcess(proxy.write_kubeconfig(tmp_path / "proxy.kubeconfig"), namespace, tmp_path / "operator.log",
                         "--debug", TPUFT_LOG_LEVEL="DEBUG")
    scripts = {NAME: "ok", OTHER: "ok"}
    recorder, player = PhaseRecorder(kubeconfig, namespace), Player(kubeconfig, namespace, scripts, seed=3)
    try:
        recorder.start()
        player.start()
        op.start()
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, with_token(namespace, NAME))
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, tft_body(namespace, OTHER, "ok"))
        wait_all_terminal(recorder, scripts, 90, op)
        time.sleep(1.5)  # a few more resyncs, logged at DEBUG
    finally:
        player.halt.set()
        recorder.halt.set()
        op.stop()
        proxy.stop()
    assert not player.errors, player.errors
    assert {n: recorder.phases()[n] for n in scripts} == {NAME: "Succeeded", OTHER: "Succeeded"}
    yield namespace, token, manifest, op, proxy
    kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def test_hf_token_never_leaks(lifecycle, kubectl):
    namespace, token, manifest, op, proxy = lifecycle
    forms = {"raw": token, "base64": base64.b64encode(token.encode()).decode()}

    render = subprocess.run([str(Path(sys.executable).with_name("tpuft")), "render", str(manifest)],
                            capture_output=True, text=True, check=True)
    everything = kubectl("get", GET_EVERYTHING, "-n", namespace, "-o", "yaml", check=True).stdout
    describe = kubectl("describe", "tft", NAME, "-n", namespace, check=True).stdout
    places = {
        "tpuft render": render.stdout + render.stderr,
        f"kubectl get {GET_EVERYTHING}": everything,
        "kubectl describe tft": describe,
        "operator log": op.text(),
        "operator requests": "\n".join(f"{m} {p}" for m, p in proxy.seen),
    }
    leaks = [f"{form} token in {where}" for where, text in places.items() for form, value in forms.items()
             if value in text]
    assert not leaks, leaks

    # Positive control: the same search does find it where it is meant to be.
    secret = kubectl("get", "secret", SECRET, "-n", namespace, "-o", "yaml", check=True).stdout
    assert forms["base64"] in secret

    # The searches covered something: the objects, the events and the status are all there.
    objects = yaml.safe_load(everything)["items"]
    kinds = sorted({o["kind"] for o in objects})
    assert {"RayCluster", "RayJob", "TPUFinetune", "Event", "ServiceAccount", "Role", "RoleBinding"} <= set(kinds)
    assert "Succeeded" in describe and "TrainingComplete" in describe

    # The operator never asked for a Secret.
    secret_requests = [f"{m} {p}" for m, p in proxy.seen if re.search(r"/secrets(/|\?|$)", p)]
    assert not secret_requests, secret_requests

    # Every HF_TOKEN env var is a reference, in what render prints and in what the API server holds.
    rendered = [d for d in yaml.safe_load_all(render.stdout) if d]
    live = [o for o in objects if o["kind"] in ("RayCluster", "RayJob") and
            o["metadata"]["labels"].get("tpufinetune.dev/name") == NAME]
    refs = {"render": hf_env_refs(rendered), "live": hf_env_refs(live)}
    for where, found in refs.items():
        assert found, f"no HF_TOKEN env in {where}"
        for env in found:
            assert env == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": KEY}}}, env
    other = [o for o in objects if o["kind"] in ("RayCluster", "RayJob") and
             o["metadata"]["labels"].get("tpufinetune.dev/name") == OTHER]
    assert other and not hf_env_refs(other)

    counts = {"lifecycles": 2, "places_searched": len(places), "forms": len(forms),
              "objects_searched": len(objects), "kinds": kinds, "operator_log_lines": len(op.text().splitlines()),
              "operator_requests": len(proxy.seen), "operator_secret_requests": len(secret_requests),
              "hf_token_refs": {k: len(v) for k, v in refs.items()}, "leaks": len(leaks)}
    print("\nCOUNTS test_hf_token_never_leaks:", json.dumps(counts))


def test_workload_identity_rbac(lifecycle, kubectl):
    """The operator made NAME-workload (ServiceAccount, Role, RoleBinding) during the lifecycle."""
    namespace = lifecycle[0]
    who = f"--as=system:serviceaccount:{namespace}:{NAME}-workload"

    def can(*args: str) -> str:
        res = kubectl("auth", "can-i", *args, "-n", namespace, who)
        return res.stdout.strip()

    checks = [
        (("patch", f"tpufinetunes.tpufinetune.dev/{NAME}", "--subresource=status"), "yes"),
        (("get", f"tpufinetunes.tpufinetune.dev/{NAME}", "--subresource=status"), "yes"),
        (("patch", f"tpufinetunes.tpufinetune.dev/{OTHER}", "--subresource=status"), "no"),
        (("patch", f"tpufinetunes.tpufinetune.dev/{NAME}"), "no"),
        (("get", "secrets"), "no"),
        (("get", f"secrets/{SECRET}"), "no"),
        (("create", "rayjobs.ray.io"), "no"),
    ]
    results = [(args, want, can(*args)) for args, want in checks]
    # ... and OTHER's identity may not write NAME's status either.
    res = kubectl("auth", "can-i", "patch", f"tpufinetunes.tpufinetune.dev/{NAME}", "--subresource=status",
                  "-n", namespace, f"--as=system:serviceaccount:{namespace}:{OTHER}-workload")
    results.append((("as other-workload: patch", NAME, "status"), "no", res.stdout.strip()))
    assert kubectl("get", "serviceaccount", f"{NAME}-workload", "-n", namespace).returncode == 0
    wrong = [r for r in results if r[1] != r[2]]
    assert not wrong, wrong
    print("\nCOUNTS test_workload_identity_rbac:", json.dumps({"can_i_checks": len(results), "allowed": sum(
        1 for r in results if r[2] == "yes"), "denied": sum(1 for r in results if r[2] == "no")}))
