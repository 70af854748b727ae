"""The operator (kopf, in-process, --standalone --namespace=NS) against the real local control
plane, with tests/kuberay_standin.py playing KubeRay's part by writing RayCluster/RayJob status
the way KubeRay v1.7.0 does.

Only what needs the API server lives here (admission, watches, RBAC, restarts, deletion,
deadlines measured on a live operator). Pure lifecycle rules (a failed verification never
trains, retries then TrainingFailed, a deleted child, a spec change recorded not applied) run
against a fake API in tests/unit/test_reconciler.py."""
from __future__ import annotations

import contextlib
import json
import time

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client

from tests.factories import small_object
from tests.kuberay_standin import KubeRay, entrypoint_failed, train_controller_log
from tests.waiting import wait_until

NAME = "ft"
RESYNC = "1"
VERIFY_GRACE = "1"
MARGIN = 4.0  # seconds the operator may take beyond a deadline (resync 1 s, watch latency, 2 cores)




@pytest.fixture
def operator(kubeconfig, namespace, monkeypatch):
    """start() -> context manager running the operator for this namespace."""
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.setenv("TPUFT_RESYNC_SECONDS", RESYNC)
    monkeypatch.setenv("TPUFT_POD_LIST_SECONDS", RESYNC)
    monkeypatch.setenv("TPUFT_VERIFY_GRACE_SECONDS", VERIFY_GRACE)
    monkeypatch.setenv("TPUFT_METRICS_PORT", "0")

    @contextlib.contextmanager
    def start():
        args = ["run", "--standalone", f"--namespace={namespace}", "-m", "tpuft.controller.handlers"]
        with KopfRunner(args, timeout=60) as runner:
            yield runner
        assert runner.exit_code == 0, runner.output
        assert runner.exception is None, runner.output

    return start


@pytest.fixture
def kuberay(kube_api, namespace) -> KubeRay:
    return KubeRay(kube_api, namespace)


@pytest.fixture
def tft(kube_api, namespace, kubectl):
    api = client.CustomObjectsApi(kube_api)

    class TFT:
        def body(self, **spec) -> dict:
            return small_object(NAME, namespace, **spec)

        def apply(self, **spec):
            kubectl("apply", "-f", "-", input=yaml.safe_dump(self.body(**spec)), check=True)

        def get(self) -> dict:
            return api.get_namespaced_custom_object("tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes", NAME)

        def status(self) -> dict:
            return self.get().get("status") or {}

        def patch(self, spec: dict) -> None:
            api.patch_namespaced_custom_object("tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes", NAME,
                                               {"spec": spec})

        def wait(self, phase: str, timeout: float = 30.0) -> dict:
            def check():
                st = self.status()
                return st if st.get("phase") == phase else None
            try:
                return wait_until(check, timeout, f"phase {phase}")
            except AssertionError:
                raise AssertionError(f"phase {phase} not reached; status: {json.dumps(self.status(), indent=1)}")

        def children(self, plural: str) -> list[str]:
            items = api.list_namespaced_custom_object("ray.io", "v1", namespace, plural,
                                                      label_selector=f"tpufinetune.dev/name={NAME}")["items"]
            return sorted(i["metadata"]["name"] for i in items)

        def events(self) -> list[dict]:
            out = kubectl("get", "events", "-n", namespace, "-o", "json",
                          f"--field-selector=involvedObject.name={NAME},involvedObject.kind=TPUFinetune", check=True)
            return json.loads(out.stdout)["items"]

    return TFT()


def cond(status: dict, ctype: str) -> dict:
    return next(x for x in status["conditions"] if x["type"] == ctype)


# --- the whole run ---------------------------------------------------------------------------------
def test_full_lifecycle_to_succeeded(operator, tft, kuberay, kubectl, namespace):
    with operator():
        tft.apply(ttlSecondsAfterFinished=2)
        st = tft.wait("Provisioning")
        uid = tft.get()["metadata"]["uid"]
        assert st["children"] == {"rayCluster": f"{NAME}-ray", "serviceAccount": f"{NAME}-workload"}
        assert st["slice"]["hosts"] == 4 and st["slice"]["devices"] == 16
        assert st["observedGeneration"] == st["appliedGeneration"] == 1
        # Children are owned by the CR (controller ownerReference) and labelled with its name.
        for kind in ("raycluster", "serviceaccount", "role", "rolebinding"):
            obj = json.loads(kubectl("get", kind, f"{NAME}-ray" if kind == "raycluster" else f"{NAME}-workload",
                                     "-n", namespace, "-o", "json", check=True).stdout)
            assert [(r["uid"], r["controller"]) for r in obj["metadata"]["ownerReferences"]] == [(uid, True)], kind
        # The workload identity may patch only this CR's status.
        who = f"--as=system:serviceaccount:{namespace}:{NAME}-workload"
        can = lambda *a: kubectl("auth", "can-i", *a, "-n", namespace, who).stdout.strip()  # noqa: E731
        assert can("patch", f"tpufinetunes.tpufinetune.dev/{NAME}", "--subresource=status") == "yes"
        assert can("patch", "tpufinetunes.tpufinetune.dev/other", "--subresource=status") == "no"
        assert can("patch", f"tpufinetunes.tpufinetune.dev/{NAME}") == "no"
        assert can("delete", f"tpufinetunes.tpufinetune.dev/{NAME}") == "no"
        assert can("get", "secrets") == "no"

        kuberay.cluster_provisioning(f"{NAME}-ray", ready_workers=2)
        wait_until(lambda: "2/4 worker hosts ready" in tft.status().get("message", ""), what="progress message")
        kuberay.cluster_ready(f"{NAME}-ray")
        st = tft.wait("VerifyingCollectives")
        assert cond(st, "SliceProvisioned")["status"] == "True"
        assert tft.children("rayjobs") == [f"{NAME}-verify"]
        kuberay.job_initializing(f"{NAME}-verify")
        kuberay.job_running(f"{NAME}-verify")
        kuberay.job_succeeded(f"{NAME}-verify")
        st = tft.wait("Training")
        assert cond(st, "CollectivesVerified")["status"] == "True" and st["trainingAttempts"] == 1
        # The workload reports progress with its own identity; the operator never overwrites it.
        kubectl("patch", f"tpufinetunes.tpufinetune.dev/{NAME}", "-n", namespace, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {"training": {"loss": 2.5, "epoch": 1}}}), who, check=True)
        kuberay.job_running(f"{NAME}-train")
        wait_until(lambda: (tft.status().get("training") or {}).get("loss") == 2.5, what="the workload's report")
        time.sleep(1)  # a running job must not change what the operator wrote: one write per phase change
        assert tft.status()["message"].startswith(f"training (RayJob {NAME}-train, attempt 1 of ")
        table = kubectl("get", "tft", NAME, "-n", namespace, "-o", "wide", check=True).stdout
        assert "PHASE" in table and "Training" in table and "v6e" in table and "4x4" in table and "2.5" in table
        kuberay.job_succeeded(f"{NAME}-train")
        st = tft.wait("Succeeded")
        assert st["training"] == {"loss": 2.5, "epoch": 1}
        assert cond(st, "Ready")["status"] == "True" and cond(st, "TrainingSucceeded")["status"] == "True"
        assert st["completionTime"] and st["reason"] == "TrainingComplete"
        res = kubectl("wait", f"tft/{NAME}", "-n", namespace, "--for=condition=Ready", "--timeout=10s")
        assert res.returncode == 0, res.stderr
        # ttlSecondsAfterFinished: 2 -> the RayCluster goes, the jobs and status stay.
        wait_until(lambda: tft.children("rayclusters") == [], 2 + MARGIN + 5, "the TTL deletion")
        assert tft.children("rayjobs") == [f"{NAME}-train", f"{NAME}-verify"]
    obj = tft.get()
    assert not obj["metadata"].get("finalizers")
    assert not [k for k in obj["metadata"].get("annotations", {}) if "kopf" in k]
    reasons = [e["reason"] for e in tft.events()]
    for reason in ("WaitingForSlice", "Verifying", "Training", "TrainingComplete", "TTLExpired"):
        assert reason in reasons, reasons
    from prometheus_client import generate_latest

    from tpuft.controller import metrics
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'tpuft_reconcile_total{result="ok"}' in text and "tpuft_phase_duration_seconds_bucket" in text


def test_serving_after_training_then_stopped(operator, tft, kuberay, kubectl, namespace):
    """spec.serve on a live operator: the training slice is released once KubeRay has finished the
    training RayJob (not when its job has ended: the submitter still follows the job from the head),
    the RayService (owned, labelled) is watched through its own index, Ready follows KubeRay's
    status, serve.enabled: false ends it."""
    with operator():
        tft.apply(accelerator="cpu", topology="2", serve={"enabled": True, "topology": "1"}, verification={"enabled": False})
        tft.wait("Provisioning")
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("Training")
        kuberay.job_ended(f"{NAME}-train")   # SUCCEEDED; KubeRay's submitter is still following the job's logs
        wait_until(lambda: tft.status().get("reason") == "FinishingRayJob", 10, "waiting for KubeRay's RayJob")
        time.sleep(1.5)
        assert tft.status()["phase"] == "Training" and tft.children("rayclusters") == [f"{NAME}-ray"]  # the head stays
        assert tft.children("rayservices") == []
        kuberay.job_succeeded(f"{NAME}-train")   # the submitter exited: KubeRay marks the RayJob Complete
        st = tft.wait("Serving")
        assert st["reason"] == "Deploying" and st["children"]["rayService"] == f"{NAME}-serve"
        wait_until(lambda: tft.children("rayclusters") == [], 10, "the training RayCluster released")
        svc = json.loads(kubectl("get", "rayservice", f"{NAME}-serve", "-n", namespace, "-o", "json", check=True).stdout)
        assert [r["uid"] for r in svc["metadata"]["ownerReferences"]] == [tft.get()["metadata"]["uid"]]
        kuberay.service_status(f"{NAME}-serve", "DEPLOYING", "Deploying app 'llm'")
        wait_until(lambda: "app llm DEPLOYING: Deploying app 'llm'" in tft.status().get("message", ""),
                   what="Serve's own status in the message")
        kuberay.service_status(f"{NAME}-serve", "RUNNING", ready=True, side="activeServiceStatus")
        res = kubectl("wait", f"tft/{NAME}", "-n", namespace, "--for=condition=Ready", "--timeout=20s")
        assert res.returncode == 0, res.stderr
        st = tft.status()
        assert st["phase"] == "Serving" and cond(st, "Serving")["status"] == "True"
        assert st["serving"]["url"] == f"http://{NAME}-serve-serve-svc.{namespace}.svc:8000"
        tft.patch({"serve": {"enabled": False}})
        st = tft.wait("Succeeded")
        assert st["reason"] == "ServeStopped" and "serving" not in st and "ignoredSpecChange" not in st
        wait_until(lambda: tft.children("rayservices") == [], 10, "the RayService deleted")


# --- failures, each with its reason ------------------------------------------------------------------
DEADLINE = 15


def test_provisioning_timeout(operator, tft, kuberay, kubectl, namespace):
    """One topology line wrong -> workers never come: Failed with a reason, within the timeout.
    DEADLINE leaves the operator time to say the scheduler's reason before it (at 5 s, with the
    machine's load average at 40 during a clean-clone run, it reached the deadline first)."""
    with operator():
        tft.apply(provisioningTimeoutSeconds=DEADLINE)
        st = tft.wait("Provisioning")
        began = time.monotonic()
        kuberay.cluster_provisioning(f"{NAME}-ray", ready_workers=1)
        why = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
        kuberay.unschedulable_worker(f"{NAME}-ray", f"{NAME}-ray-tpu-worker-x", why)
        # the cause is in status while still Provisioning, not only at the deadline
        st = wait_until(lambda: (s := tft.status()).get("phase") == "Provisioning" and why in s["message"] and s,
                        timeout=DEADLINE - 1, what="the scheduler's reason while Provisioning")
        assert f"pod {NAME}-ray-tpu-worker-x cannot be scheduled: the scheduler says: {why}" in st["message"]
        assert why in cond(st, "SliceProvisioned")["message"]
        st = tft.wait("Failed", timeout=DEADLINE + MARGIN + 2)
        assert time.monotonic() - began <= DEADLINE + MARGIN
        assert f"the scheduler says: {why}" in st["message"], st["message"]
        entered = time.mktime(time.strptime(st["startTime"], "%Y-%m-%dT%H:%M:%SZ"))
        failed = time.mktime(time.strptime(st["completionTime"], "%Y-%m-%dT%H:%M:%SZ"))
        assert DEADLINE <= failed - entered <= DEADLINE + MARGIN
        assert st["reason"] == "ProvisioningTimeout"
        assert "1/4 worker hosts ready" in st["message"] and "4x4" in st["message"], st["message"]
        res = kubectl("wait", f"tft/{NAME}", "-n", namespace, "--for=condition=Failed", "--timeout=5s")
        assert res.returncode == 0
        assert tft.children("rayjobs") == []
    warnings = [e for e in tft.events() if e["type"] == "Warning"]
    assert "ProvisioningTimeout" in [e["reason"] for e in warnings]
    blocked = [e for e in warnings if e["reason"] == "SliceBlocked"]
    assert len(blocked) == 1 and blocked[0]["count"] == 1, blocked  # once per cause, not per resync


def verifying(tft, kuberay, **spec) -> dict:
    tft.apply(**spec)
    tft.wait("Provisioning")
    kuberay.cluster_ready(f"{NAME}-ray")
    return tft.wait("VerifyingCollectives")


def test_collective_timeout_without_kuberay_deadline(operator, tft, kuberay):
    """The verification job runs but never finishes (a host that never joins the collective)."""
    bound = 10 + float(VERIFY_GRACE)
    with operator():
        verifying(tft, kuberay, verification={"enabled": True, "timeoutSeconds": 10})
        began = time.monotonic()
        kuberay.job_running(f"{NAME}-verify")
        st = tft.wait("Failed", timeout=bound + MARGIN + 2)
        took = time.monotonic() - began
        # Lower bound: status times have 1 s resolution and the phase was entered before we saw it.
        assert bound - 2 <= took <= bound + MARGIN, took
        assert st["reason"] == "CollectiveTimeout", st
        assert "did not finish within 10s" in st["message"] and "jobStatus=RUNNING" in st["message"]
        assert tft.children("rayjobs") == [f"{NAME}-verify"]  # never trained


def test_admission_rejected(operator, tft, kubectl, namespace):
    """A ValidatingAdmissionPolicy plays the TPU webhook: it rejects multi-host worker groups."""
    policy = f"tpu-webhook-{namespace}"
    docs = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": ["ray.io"], "apiVersions": ["v1"],
                                                          "operations": ["CREATE"], "resources": ["rayclusters"]}]},
                  "validations": [{"expression": "object.spec.workerGroupSpecs.all(g, g.numOfHosts == 1)",
                                   "message": "stand-in TPU webhook: Number of workers in worker group not equal "
                                              "to specified topology"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy},
         "spec": {"policyName": policy, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}},
    ]
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), check=True)
    try:
        probe = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "probe", "namespace": namespace},
                 "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
                     {"name": "h", "image": "i"}]}}},
                          "workerGroupSpecs": [{"groupName": "g", "numOfHosts": 4, "rayStartParams": {},
                                                "template": {"spec": {"containers": [{"name": "w", "image": "i"}]}}}]}}
        wait_until(lambda: kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe)).returncode != 0,
                   30, "the admission policy to take effect", interval=0.5)
        with operator():
            tft.apply()
            st = tft.wait("Failed")
            assert st["reason"] == "AdmissionRejected", st
            assert "not equal to specified topology" in st["message"] and f"{NAME}-ray" in st["message"]
            assert tft.children("rayclusters") == []
    finally:
        kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy, "--ignore-not-found")


ENV_RULE = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/env/items/x-kubernetes-validations"


def test_invalid_spec_stored_under_a_looser_crd(operator, tft, kubectl, namespace, control_plane):
    """The CRD rejects every invalid spec at admission (tests/integration/test_crd.py); an object
    stored before the CRD gained a rule still reaches the operator: Failed InvalidSpec naming
    the field, nothing created. Simulated by dropping one CEL rule for the duration."""
    from tpuft_local.controlplane import REPO_ROOT

    bad = {"env": [{"name": "X", "value": "a", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}
    crd = "tpufinetunes.tpufinetune.dev"
    kubectl("patch", "crd", crd, "--type=json", "-p", json.dumps([{"op": "remove", "path": ENV_RULE}]), check=True)
    try:
        wait_until(lambda: kubectl("apply", "-f", "-", input=yaml.safe_dump(tft.body(**bad))).returncode == 0,
                   20, "the looser CRD to take effect", interval=0.5)
    finally:
        control_plane.install_crds([REPO_ROOT / "crds" / "tpufinetune.yaml"])
    with operator():
        st = tft.wait("Failed")
        assert st["reason"] == "InvalidSpec" and "spec.env[0]" in st["message"], st
        time.sleep(1.5)
        assert tft.children("rayclusters") == []
        assert kubectl("get", "serviceaccount", f"{NAME}-workload", "-n", namespace).returncode != 0
    assert "InvalidSpec" in [e["reason"] for e in tft.events() if e["type"] == "Warning"]
    again = tft.body(**bad)
    again["metadata"]["name"] = "another"
    res = kubectl("apply", "-f", "-", input=yaml.safe_dump(again))  # the rule is back for new objects
    assert res.returncode != 0 and "value or valueFrom" in res.stderr


# --- suspend ----------------------------------------------------------------------------------------
def test_suspend_and_resume(operator, tft, kuberay):
    """Suspended mid-verification: verify job deleted, then (once it is gone) the cluster suspended;
    resumed: the slice is waited for again (KubeRay's pre-suspend 'ready' status is not trusted) and re-verified."""
    with operator():
        tft.apply()
        tft.wait("Provisioning")
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("VerifyingCollectives")
        first = kuberay.get("rayjobs", f"{NAME}-verify")["metadata"]["uid"]
        tft.patch({"suspend": True})
        st = tft.wait("Suspended")
        assert "suspended during VerifyingCollectives" in st["message"]
        wait_until(lambda: kuberay.get("rayclusters", f"{NAME}-ray")["spec"].get("suspend") is True, what="suspend")
        assert tft.children("rayjobs") == []   # the verify job went first: its submitter never loses the head
        tft.patch({"suspend": False})
        tft.wait("Provisioning")
        wait_until(lambda: kuberay.get("rayclusters", f"{NAME}-ray")["spec"].get("suspend") is False, what="resume")
        time.sleep(2)
        assert tft.status()["phase"] == "Provisioning"  # the old "ready" describes the pre-suspend cluster
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("VerifyingCollectives")
        assert kuberay.get("rayjobs", f"{NAME}-verify")["metadata"]["uid"] != first


def test_a_host_lost_in_training_replaces_the_slice_and_resumes(operator, tft, kuberay):
    """A worker pod lost mid-training: the train job is stopped, the slice waited for and verified
    again, the same attempt resubmitted (it resumes from its checkpoint); status.recovery survives
    the API server's schema (unknown status fields would be pruned silently)."""
    with operator():
        tft.apply(recovery={"maxSliceReplacements": 1})
        tft.wait("Provisioning")
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("VerifyingCollectives")
        kuberay.job_succeeded(f"{NAME}-verify")
        tft.wait("Training")
        kuberay.job_running(f"{NAME}-train")
        first = kuberay.get("rayjobs", f"{NAME}-train")["metadata"]["uid"]
        kuberay.worker_lost(f"{NAME}-ray", ready=3)
        st = tft.wait("Provisioning")
        assert st["reason"] == "ReplacingSlice" and "3/4 worker hosts ready" in st["message"], st
        assert st["recovery"]["sliceReplacements"] == 1
        (h,) = st["recovery"]["history"]
        assert (h["phase"], h["hostsReady"], h["hosts"]) == ("Training", 3, 4) and h["time"]
        wait_until(lambda: tft.children("rayjobs") == [], what="the slice's jobs stopped")
        time.sleep(2)
        assert tft.status()["phase"] == "Provisioning"   # not verified while a host is missing
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("VerifyingCollectives")
        kuberay.job_succeeded(f"{NAME}-verify")
        st = tft.wait("Training")
        assert kuberay.get("rayjobs", f"{NAME}-train")["metadata"]["uid"] != first and st["trainingAttempts"] == 1
        kuberay.job_running(f"{NAME}-train")
        kuberay.worker_lost(f"{NAME}-ray", ready=2)   # one more than allowed
        st = tft.wait("Failed")
        assert st["reason"] == "SliceLost" and [h["hostsReady"] for h in st["recovery"]["history"]] == [3, 2]
    # the event is posted after the status write that says Failed: wait for it (bounded)
    reasons = wait_until(lambda: (found := [e["reason"] for e in tft.events() if e["type"] == "Warning"])
                         and "SliceLost" in found and found, 30, "the SliceLost event")
    assert reasons.count("ReplacingSlice") == 1 and "SliceLost" in reasons


def test_a_pod_told_to_stop_is_seen_at_once_and_its_job_left_to_save(operator, tft, kuberay, kube_api, namespace,
                                                                     monkeypatch):
    """The pod watch: a worker pod deleted mid-training (graceful: it stays terminating, here for want
    of a kubelet) is a lost host the moment the API server marks it, well before any resync (a minute
    here), while KubeRay's ready count has not moved. The training job is left to save the stop
    checkpoint the pod's preStop asks for, and deleted once it has ended."""
    monkeypatch.setenv("TPUFT_RESYNC_SECONDS", "60")
    core = client.CoreV1Api(kube_api)
    with operator():
        tft.apply(verification={"enabled": False}, recovery={"maxSliceReplacements": 1})
        tft.wait("Provisioning")
        pods = kuberay.running_pods(f"{NAME}-ray", NAME, workers=4)
        kuberay.cluster_ready(f"{NAME}-ray")
        st = tft.wait("Training")
        assert len(st["recovery"]["slicePods"]) == 5, st["recovery"]
        kuberay.job_running(f"{NAME}-train")
        time.sleep(1)   # the job's RUNNING seen
        started = time.monotonic()
        core.delete_namespaced_pod(pods[2], namespace)
        st = tft.wait("Provisioning", timeout=10)
        seen = time.monotonic() - started
        print(f"a pod told to stop, seen as a lost host after {seen:.2f} s")
        assert seen < 5, seen
        (loss,) = st["recovery"]["history"]
        assert f"pod {pods[2]} on node node-2 is being deleted" == loss["cause"] and loss["hostsReady"] == 3, loss
        assert kuberay.get("rayclusters", f"{NAME}-ray")["status"]["readyWorkerReplicas"] == 4   # KubeRay: no dip yet
        time.sleep(2)
        assert tft.children("rayjobs") == [f"{NAME}-train"]   # left to save its checkpoint
        assert "saving its checkpoint" in tft.status()["message"]
        kuberay.job_failed(f"{NAME}-train", "Job entrypoint command failed with exit code 143")
        wait_until(lambda: tft.children("rayjobs") == [], timeout=10, what="the ended job deleted")


def test_a_maintenance_notice_on_a_node_under_the_slice_asks_for_a_checkpoint(operator, tft, kuberay, kube_api,
                                                                             namespace, monkeypatch):
    """GKE's notice (its label) on the Node under a training pod: the operator asks for a checkpoint
    at once (the watch: resync at a minute), once; the job's answer (played here: rank 0 patches
    status.training as the workload does) is recorded with the step saved; training goes on."""
    monkeypatch.setenv("TPUFT_RESYNC_SECONDS", "60")
    core = client.CoreV1Api(kube_api)
    prefix = f"n-{namespace}"[:50]   # Nodes are cluster-wide: this test's own
    node_name = f"{prefix}-2"
    with operator():
        tft.apply(verification={"enabled": False})
        tft.wait("Provisioning")
        kuberay.running_pods(f"{NAME}-ray", NAME, workers=4, node_prefix=prefix)
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("Training")
        kuberay.job_running(f"{NAME}-train")
        try:
            core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name}})
            started = time.monotonic()
            core.patch_node(node_name, {"metadata": {"labels": {
                "cloud.google.com/scheduled-maintenance-time": "1767268800"}}})
            st = wait_until(lambda: (s := tft.status()).get("recovery", {}).get("checkpointRequestedAt") and s,
                            timeout=10, interval=0.2, what="the checkpoint asked for")
        finally:
            core.delete_node(node_name)
        print(f"maintenance notice to checkpoint request: {time.monotonic() - started:.2f} s")
        notice = st["recovery"]["lastMaintenance"]
        assert notice["node"] == node_name and "scheduled-maintenance-time=1767268800" in notice["notice"], notice
        requested = st["recovery"]["checkpointRequestedAt"]
        api = client.CustomObjectsApi(kube_api)
        api.patch_namespaced_custom_object_status("tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes", NAME,
                                                  {"status": {"training": {"step": 12, "checkpointRequestSaved": requested}}},
                                                  _content_type="application/merge-patch+json")
        st = wait_until(lambda: (s := tft.status())["recovery"]["lastMaintenance"].get("checkpointStep") and s,
                        timeout=10, interval=0.2, what="the saved checkpoint recorded")
        assert st["recovery"]["lastMaintenance"]["checkpointStep"] == 12 and st["phase"] == "Training", st
    reasons = sorted((e["type"], e["reason"]) for e in tft.events() if e["reason"] == "MaintenanceNotice")
    assert reasons == [("Normal", "MaintenanceNotice"), ("Warning", "MaintenanceNotice")], reasons   # one of each


def test_a_worker_killed_for_memory_is_named_and_the_log_stays_out_of_status(operator, tft, kuberay, namespace):
    """The kernel's OOM killer ended a worker's container (its pod's lastState as the kubelet writes
    it, read through the real API server), then the training RayJob failed with KubeRay's message of
    20,000 coloured characters: Failed/OutOfMemory naming the pod, where it sits and its limit; no log
    in status or events."""
    with operator():
        tft.apply(verification={"enabled": False}, training={"maxJobRetries": 0})
        tft.wait("Provisioning")
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("Training")
        kuberay.job_running(f"{NAME}-train")
        kuberay.oom_killed_worker(f"{NAME}-ray", f"{NAME}-ray-tpu-worker-x", "200Gi", replica=0, host=2)
        log = train_controller_log(400, "ray.exceptions.ActorDiedError: The actor died because its node has died.\n")
        kuberay.job_failed(f"{NAME}-train", entrypoint_failed(log))
        st = tft.wait("Failed")
        assert st["reason"] == "OutOfMemory", st
        assert st["message"] == (
            f"training failed after 1 attempt(s): RayJob {NAME}-train: worker pod {namespace}/{NAME}-ray-tpu-worker-x "
            "(host 2 of slice 0) was killed for memory by the kernel's OOM killer (limit 200Gi): give the workers more "
            "memory (spec.resources.worker.limits.memory), a bigger slice, spec.training.method: lora, or a smaller "
            f"spec.training.batchSizePerDevice or maxSeqLength; the full log: tpuft logs {NAME} -n {namespace}")
        assert "TrainController" not in json.dumps(st)
    events = tft.events()
    assert "OutOfMemory" in [e["reason"] for e in events if e["type"] == "Warning"]
    assert not [e for e in events if "TrainController" in e["message"]]


def test_a_lost_submission_is_resubmitted_without_spending_a_retry(operator, tft, kuberay, monkeypatch):
    """KubeRay fails a RayJob whose submitter completed while the dashboard knew no job of it: the
    next attempt is submitted after the backoff, training.maxJobRetries (0) untouched, and
    status.recovery's new fields survive the API server's schema."""
    monkeypatch.setenv("TPUFT_RESUBMIT_BACKOFF_SECONDS", "3")
    with operator():
        tft.apply(verification={"enabled": False})
        tft.wait("Provisioning")
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("Training")
        kuberay.job_lost(f"{NAME}-train")
        st = wait_until(lambda: (s := tft.status()).get("reason") == "SubmissionLost" and s, what="the backoff")
        assert st["recovery"]["resubmit"]["rayJob"] == f"{NAME}-train" and st["recovery"]["resubmit"]["at"]
        st = wait_until(lambda: (s := tft.status()).get("trainingAttempts") == 2 and s, 3 + MARGIN, "the resubmission")
        assert st["children"]["trainJob"] == f"{NAME}-train-r1" and "resubmit" not in st["recovery"]
        (lost,) = st["recovery"]["lostSubmissions"]
        assert (lost["phase"], lost["rayJob"], lost["resubmittedAs"]) == ("Training", f"{NAME}-train", f"{NAME}-train-r1")
        assert lost["time"]
        kuberay.job_succeeded(f"{NAME}-train-r1")
        st = tft.wait("Succeeded")
        assert st["message"] == f"training complete (RayJob {NAME}-train-r1, attempt 1)"
    assert [e["reason"] for e in tft.events() if e["type"] == "Warning"] == ["SubmissionLost"]


# --- operator restarts and deletion ------------------------------------------------------------------
def test_operator_restarted_at_each_phase(operator, tft, kuberay, kubectl, namespace):
    with operator():
        tft.apply()
        tft.wait("Provisioning")
    kuberay.cluster_ready(f"{NAME}-ray")          # happens while the operator is down
    with operator():
        tft.wait("VerifyingCollectives")
    kuberay.job_succeeded(f"{NAME}-verify")
    with operator():
        tft.wait("Training")
    kuberay.job_succeeded(f"{NAME}-train")
    with operator():
        st = tft.wait("Succeeded")
        time.sleep(1.5)
    assert tft.children("rayclusters") == [f"{NAME}-ray"]
    assert tft.children("rayjobs") == [f"{NAME}-train", f"{NAME}-verify"]
    assert st["trainingAttempts"] == 1 and st["phase"] == "Succeeded"
    sas = json.loads(kubectl("get", "serviceaccounts", "-n", namespace, "-o", "json",
                             "-l", f"tpufinetune.dev/name={NAME}", check=True).stdout)["items"]
    assert len(sas) == 1
    transitions = [e["reason"] for e in tft.events() if e["reason"] in ("Verifying", "Training", "TrainingComplete")]
    assert sorted(transitions) == ["Training", "TrainingComplete", "Verifying"]  # one event per transition


def test_deletion_removes_children(operator, tft, kuberay, kubectl, namespace):
    with operator():
        tft.apply()
        tft.wait("Provisioning")
        kuberay.cluster_ready(f"{NAME}-ray")
        tft.wait("VerifyingCollectives")
        kubectl("delete", "tft", NAME, "-n", namespace, "--wait=true", "--timeout=20s", check=True)

        def gone():
            left = [k for k in ("raycluster", "rayjob", "serviceaccount", "role", "rolebinding")
                    if kubectl("get", k, "-n", namespace, "-l", f"tpufinetune.dev/name={NAME}", "-o", "name",
                               check=True).stdout.strip()]
            return not left
        wait_until(gone, 30, "garbage collection of the children", interval=0.5)


# --- adapters on a shared base (spec.serve.adapters, spec.publish) -----------------------------------
BASE = "tiny"


def test_lora_fine_tunes_publish_to_a_served_base_gated_on_eval_loss(operator, kuberay, kubectl, kube_api,
                                                                     namespace):
    """A base (training.method none) serves from the start; a LoRA fine-tune whose training succeeds is
    published by a RayJob on the base's serving RayCluster, and the base lists it; a second one of the
    same adapter name with a worse eval loss stays unpublished with both figures; deleting the published
    one has the base remove its adapter."""
    api = client.CustomObjectsApi(kube_api)

    def status(name: str) -> dict:
        return api.get_namespaced_custom_object("tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes",
                                                name).get("status") or {}

    def apply(doc: dict) -> None:
        kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=True)

    def rayjob(name: str) -> dict:
        return api.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)

    def fine_tune(name: str, eval_loss: float) -> str:
        """Applies a LoRA fine-tune publishing as `chat`, runs its training to success with `eval_loss`
        reported; returns its uid."""
        apply(small_object(name, namespace, accelerator="cpu", topology="2", verification={"enabled": False},
                           training={"method": "lora"}, evaluation={"fraction": 0.1},
                           publish={"to": BASE, "as": "chat"}))
        wait_until(lambda: status(name).get("phase") == "Provisioning", 30, f"{name} Provisioning")
        kuberay.cluster_ready(f"{name}-ray")
        wait_until(lambda: status(name).get("phase") == "Training", 30, f"{name} Training")
        kubectl("patch", f"tpufinetunes.tpufinetune.dev/{name}", "-n", namespace, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {"training": {
                    "evalLoss": eval_loss, "exportedModel": f"/ck/{name}/export"}}}), check=True)
        kuberay.job_succeeded(f"{name}-train")
        wait_until(lambda: status(name).get("phase") == "Succeeded", 30, f"{name} Succeeded")
        return api.get_namespaced_custom_object("tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes",
                                                name)["metadata"]["uid"]

    base = small_object(BASE, namespace, accelerator="cpu", topology="1", training={"method": "none"},
                        serve={"enabled": True, "adapters": {"maxPerReplica": 2}})
    base["spec"].pop("dataset")
    with operator():
        apply(base)
        wait_until(lambda: status(BASE).get("reason") == "Deploying", 30, "the base deploying")
        assert kubectl("get", "rayclusters", "-n", namespace, "-o", "name", check=True).stdout.strip() == ""
        kuberay.service_status(f"{BASE}-serve", "RUNNING", ready=True, side="activeServiceStatus")
        wait_until(lambda: status(BASE).get("reason") == "Serving", 30, "the base serving")
        cluster = f"{BASE}-serve-raycluster-abcde"   # what the stand-in, as KubeRay, names its RayCluster
        assert status(BASE)["serving"]["rayCluster"] == cluster and status(BASE)["adapters"] == {"count": 0}

        first_uid = fine_tune("ft-a", 1.0)
        wait_until(lambda: status("ft-a").get("reason") == "Publishing", 30, "ft-a publishing")
        job = rayjob("ft-a-publish")
        assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
        argv = job["spec"]["entrypoint"].split()
        assert argv[3] == "publish" and argv[argv.index("--name") + 1] == "chat"
        assert argv[argv.index("--adapters-root") + 1] == status(BASE)["serving"]["adaptersRoot"]
        assert argv[argv.index("--uid") + 1] == first_uid and argv[argv.index("--eval-loss") + 1] == "1.0"
        kuberay.job_succeeded("ft-a-publish")
        wait_until(lambda: status("ft-a").get("reason") == "Published", 30, "ft-a published")
        served = status("ft-a")["serving"]
        assert served["model"] == f"{BASE}:chat" and served["published"]["evalLoss"] == 1.0
        wait_until(lambda: (status(BASE).get("adapters") or {}).get("count") == 1, 30, "the base listing ft-a")
        assert status(BASE)["adapters"]["served"][0]["source"] == f"{namespace}/ft-a"
        table = kubectl("get", "tft", BASE, "-n", namespace, check=True).stdout.splitlines()
        assert table[1][table[0].index("ADAPTERS"):].split()[0] == "1"   # by position: the LOSS cell is empty

        fine_tune("ft-b", 1.5)
        wait_until(lambda: status("ft-b").get("reason") == "NotPromoted", 30, "ft-b kept unpublished")
        message = status("ft-b")["serving"]["message"]
        assert "1.5000" in message and "1.0000" in message and f"{namespace}/ft-a" in message
        assert "published" not in status("ft-b")["serving"]

        kubectl("delete", "tft", "ft-a", "-n", namespace, "--wait=true", "--timeout=20s", check=True)
        wait_until(lambda: (status(BASE).get("children") or {}).get("unpublishJob"), 30, "the base unpublishing")
        unpublish = rayjob(status(BASE)["children"]["unpublishJob"])
        argv = unpublish["spec"]["entrypoint"].split()
        assert argv[3] == "unpublish" and argv[argv.index("--uid") + 1] == first_uid
        assert unpublish["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
        kuberay.job_succeeded(unpublish["metadata"]["name"])
        wait_until(lambda: not (status(BASE).get("adapters") or {}).get("served"), 30, "the adapter dropped")
