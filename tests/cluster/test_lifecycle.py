"""One CPU run through every disruption a real cluster has, against the real KubeRay and the real
Kueue, so that the node trains it once instead of once per disruption:

1. queued under a ClusterQueue with room for one such run, it is preempted mid-training by a
   higher-priority one (Kueue suspends its RayCluster, KubeRay's pods go away, each rank saves a
   checkpoint at its next step on the way out), waits Queued, is admitted again once the other is
   gone and resumes from that checkpoint, losing at most one step (preemption is not loss);
2. a KubeRay worker pod is then deleted mid-training (a host lost): KubeRay recreates it, our
   operator stops the jobs, waits for the whole slice and resumes the same training attempt from
   its last checkpoint, counting one slice replacement;
   then GKE's maintenance notice (its label) goes on the node: the run saves a checkpoint at its
   next step and trains on;
3. our operator's pod is deleted while the resumed training runs (the Deployment starts another,
   which picks the run up), and training still ends;
4. it then serves with an image that does not exist: the kubelet's pull error is in status while
   Serving, and the run fails ServeFailed at spec.serve.timeoutSeconds naming it (the serving
   hang "DEPLOYING forever", caught and named; the happy path is tests/cluster/test_demo.py).

Verification is off: it would run after each of the three starts and prove nothing asserted here
(re-verification after a resume or replacement is tests/unit/phases/'s and
tests/integration/test_handlers.py's; the demo verifies on the real cluster). A user's spec.suspend
is tests/integration/test_handlers.py's.

Everything the run keeps is in a bucket, as on GKE (issue 58): its model, its dataset (a sliced
split) and its storagePath are gs:// URIs on the local cluster's GCS stand-in (fake-gcs-server, a
real GCS JSON API), the pods' tokens from the GKE metadata server's stand-in; the checkpoints that
each resume reads, the export and the logs land there, and the bucket's listing afterwards is the
run layout docs/checkpoints.md describes."""
from __future__ import annotations

import json
import os
import time

import pytest
import yaml

from tests.cluster_fixtures import assert_nothing_left_failed
from tests.paths import EXAMPLES
from tests.waiting import wait_until
from tpuft.api import kueue
from tpuft_local import chart, node

ONE_RUN_CPU = "1"   # local-cpu.yaml's pods ask 0.6 CPU (head 100m, two workers 250m): one run fits, two do not
EVERY = 5           # checkpoint.everySteps: the most a host loss may cost
# 22 steps an epoch (the whole dolly-mini is 25): 44 in life's 2 epochs leave room after each
# disruption (preempted near step 10, the host lost near step 20, each resumed a step later).
SPLIT = "train[:340]"
# Ray Train's own poll interval (its default), not the driver's 0.5 s: a report then waits up to 2 s,
# which paces these steps so that each disruption lands mid-training. At 0.5 s the run trained from
# step 20 to 42 of its 44 while Kueue's preemption reached its pods (a clean-clone CI run,
# 2026-12-07), and it had ended before the maintenance notice. A value in spec.env is the user's and stays.
PACE_ENV = {"name": "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "value": "2"}
SERVE_TIMEOUT = 60
BAD_IMAGE = "docker.io/tpufinetune/serving:does-not-exist"
MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"   # GKE's notice of an upcoming host maintenance


def _tft(kubectl, ns: str, name: str) -> dict:
    return json.loads(kubectl("get", "tft", name, "-n", ns, "-o", "json", check=True).stdout)


def _status(kubectl, ns: str, name: str) -> dict:
    return _tft(kubectl, ns, name).get("status") or {}


def _operator_pods(kubectl) -> list[dict]:
    res = kubectl("get", "pods", "-n", chart.NAMESPACE, "-l", f"app.kubernetes.io/instance={chart.RELEASE}", "-o", "json")
    return json.loads(res.stdout)["items"] if res.returncode == 0 else []


def _kill_a_worker(kubectl, ns: str, name: str) -> str:
    pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", f"ray.io/cluster={name}-ray,ray.io/node-type=worker",
                              "-o", "json", check=True).stdout)["items"]
    victim = sorted(p["metadata"]["name"] for p in pods)[0]
    kubectl("delete", "pod", victim, "-n", ns, "--wait=false", check=True)
    return victim


def _queue(kubectl, ns: str) -> tuple[str, list[str]]:
    """A ClusterQueue with CPU for one run (preempting lower priority), its LocalQueue and two
    priorities; returns (LocalQueue, [priority class low, high])."""
    api = f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}"
    prios = [f"low-{ns}", f"high-{ns}"]
    docs = [{"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": f"cq-{ns}"},
             "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                          {"name": "cpu", "resources": [{"name": "cpu", "nominalQuota": ONE_RUN_CPU},
                                                        {"name": "memory", "nominalQuota": "16Gi"}]}]}]}},
            {"apiVersion": api, "kind": "LocalQueue", "metadata": {"name": "lq", "namespace": ns},
             "spec": {"clusterQueue": f"cq-{ns}"}},
            *[{"apiVersion": api, "kind": "WorkloadPriorityClass", "metadata": {"name": p}, "value": v}
              for p, v in zip(prios, (100, 1000))]]
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}), check=True)
    return "lq", prios


@pytest.fixture
def cpu_queue(cluster_kubectl, cluster_ns):
    yield _queue(cluster_kubectl, cluster_ns)
    cluster_kubectl("delete", "tft", "--all", "-n", cluster_ns, "--wait=false")
    wait_until(lambda: not json.loads(cluster_kubectl("get", "workloads", "-n", cluster_ns, "-o", "json",
                                                      check=True).stdout)["items"], timeout=300, interval=2,
               what="the Workloads to go")
    cluster_kubectl("delete", "clusterqueue", f"cq-{cluster_ns}", "--ignore-not-found")
    cluster_kubectl("delete", "workloadpriorityclass", f"low-{cluster_ns}", f"high-{cluster_ns}", "--ignore-not-found")


def _bucket_listing(uri: str) -> list[str]:
    """Every object under `uri`, as paths relative to it (GCS lists no folders)."""
    import pyarrow.fs as pafs

    from tpuft_workload import storage

    fs, path = storage.filesystem(uri)
    return sorted(f.path[len(path.rstrip("/")) + 1:] for f in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                  if f.type == pafs.FileType.File)


def _run(name: str, bucket: str, queue: str, priority: str, epochs: int, serve: bool) -> dict:
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "labels": {kueue.KUEUE_QUEUE_LABEL: queue, kueue.KUEUE_PRIORITY_LABEL: priority}}
    doc["spec"]["model"] = f"{bucket}/models/tiny-llama"
    doc["spec"]["dataset"] = {"name": f"{bucket}/data/dolly-mini.jsonl", "split": SPLIT}
    doc["spec"].pop("evaluation", None)
    doc["spec"]["checkpoint"] = {"storagePath": f"{bucket}/runs", "everySteps": EVERY, "keep": 2}
    doc["spec"]["training"] = {"epochs": epochs, "batchSizePerDevice": 4, "maxSeqLength": 128,
                               "learningRate": 3.0e-3, "reportEverySteps": 5}
    doc["spec"]["verification"] = {"enabled": False}
    doc["spec"]["recovery"] = {"maxSliceReplacements": 1}
    doc["spec"]["env"] = [*doc["spec"].get("env", []), PACE_ENV]
    if serve:
        doc["spec"]["serve"].update(image=BAD_IMAGE, timeoutSeconds=SERVE_TIMEOUT)
        doc["spec"]["serve"].pop("apiKeySecret")
    else:
        doc["spec"].pop("serve")
    return doc


@pytest.mark.real_node
@pytest.mark.timeout(2700)
def test_preemption_host_loss_operator_restart_then_a_missing_serving_image(cluster_kubectl, cluster_ns, cpu_queue,
                                                                            cluster_bucket):
    bucket = cluster_bucket
    queue, (low, high) = cpu_queue
    kubectl, ns = cluster_kubectl, cluster_ns
    doc = _run("life", bucket, queue, low, epochs=2, serve=True)   # 44 steps
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc), check=True)

    def training(at_least: int, resumed_past: int = -1):
        st = _status(kubectl, ns, "life")
        assert st.get("phase") not in ("Failed", "Succeeded", "Serving"), st
        t = st.get("training") or {}
        return (st.get("phase") == "Training" and t.get("step", 0) >= at_least
                and t.get("resumedFromStep", 0) > resumed_past and st)

    # 1. Preempted by a higher priority, queued, admitted again: resumed from its own stop checkpoint.
    st = wait_until(lambda: training(EVERY + 1), timeout=900, interval=2, what="training past its first checkpoint")
    assert next(x for x in st["conditions"] if x["type"] == "Admitted")["status"] == "True", st["conditions"]
    # Every pod of the run on the real node: a simulated node would only pretend to run it.
    ray_pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", "ray.io/node-type", "-o", "json",
                                  check=True).stdout)["items"]
    assert ray_pods and {p["spec"]["nodeName"] for p in ray_pods} == {node.NODE_NAME}, \
        [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in ray_pods]
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_run("bump", bucket, queue, high, 1, False)),
            check=True)
    st = wait_until(lambda: (s := _status(kubectl, ns, "life")).get("phase") in ("Queued", "Succeeded", "Failed")
                    and s, timeout=300, interval=1, what="life preempted")
    assert (st["phase"], st["reason"]) == ("Queued", "Preempted"), st
    preempted = st["recovery"]["lastPreemption"]
    assert preempted["phase"] == "Training" and "Preempted" in preempted["cause"], preempted
    # The other one runs; once it is gone, Kueue admits life again.
    wait_until(lambda: _status(kubectl, ns, "bump").get("phase") not in (None, "Pending", "Queued"),
               timeout=300, interval=2, what="bump admitted")
    kubectl("delete", "tft", "bump", "-n", ns, "--wait=false", check=True)
    # the resumed workload writes resumedFromStep as it loads the checkpoint, then trains on
    st = wait_until(lambda: training(0, resumed_past=EVERY - 1), timeout=900, interval=2,
                    what="the preempted run training again")
    first_resume = st["training"]["resumedFromStep"]
    lost = preempted.get("step", 0) - first_resume
    print(f"steps lost to the preemption: {lost} (last reported step {preempted.get('step')}, "
          f"resumed from {first_resume})")
    assert lost <= 1, (preempted, st["training"])   # the ranks saved at their next step on the way out
    # preemption is not loss: counted as one, never as a slice replacement
    assert st["recovery"]["preemptions"] == 1 and not st["recovery"].get("sliceReplacements"), st["recovery"]

    # 2. A host lost mid-training: the slice replaced, the same attempt resumed from its checkpoint.
    # One step past the resume, not a checkpoint interval: the deleted pod's preStop makes the ranks
    # save at their next step anyway, and status lags the run by up to its 10 s throttle; waiting
    # longer once let the loss land on the run's last step under a clean-clone CI's load (2026-12-04).
    wait_until(lambda: training(first_resume + 1), timeout=600, interval=2,
               what=f"training past step {first_resume + 1}")
    victim = _kill_a_worker(kubectl, ns, "life")
    seen = wait_until(lambda: (s := _status(kubectl, ns, "life")).get("recovery", {}).get("history") and s,
                      timeout=180, interval=1, what="the host loss to be seen")
    assert seen["phase"] in ("Provisioning", "Training"), seen
    wait_until(lambda: training(0, resumed_past=first_resume), timeout=900, interval=2,
               what="training resumed on the replaced slice")

    # 2b. GKE's maintenance notice on the node under the slice: a checkpoint at the next step, training going on.
    notice = f"{MAINTENANCE_LABEL}={int(time.time()) + 3600}"
    try:
        kubectl("label", "node", node.NODE_NAME, notice, "--overwrite", check=True)
        st = wait_until(lambda: ((s := _status(kubectl, ns, "life")).get("recovery", {}).get("lastMaintenance") or {})
                        .get("checkpointStep") is not None and s, timeout=300, interval=1,
                        what="the checkpoint asked for by the maintenance notice")
    finally:
        kubectl("label", "node", node.NODE_NAME, f"{MAINTENANCE_LABEL}-")
    maintenance, t = st["recovery"]["lastMaintenance"], st["training"]
    assert maintenance["node"] == node.NODE_NAME and MAINTENANCE_LABEL in maintenance["notice"], maintenance
    assert t["checkpointRequestSaved"] == st["recovery"]["checkpointRequestedAt"], (t, st["recovery"])
    assert st["phase"] == "Training" and maintenance["checkpointStep"] >= maintenance.get("step", 0), st

    # 3. The operator's pod deleted mid-training: its Deployment's next pod carries on.
    (old,) = [p["metadata"]["name"] for p in _operator_pods(kubectl)]
    kubectl("delete", "pod", old, "-n", chart.NAMESPACE, "--wait=false", check=True)
    wait_until(lambda: any(p["metadata"]["name"] != old and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
        for p in _operator_pods(kubectl)), timeout=180, interval=2, what="a new operator pod Ready")

    # Training ends; serving starts (its image does not exist).
    st = wait_until(lambda: (s := _status(kubectl, ns, "life")).get("phase") in ("Serving", "Failed", "Succeeded")
                    and s, timeout=1200, interval=2, what="training to end and serving to start")
    assert st["phase"] == "Serving", st
    recovery, t = st["recovery"], st["training"]
    # the preemption still one, the host loss one slice replacement
    assert recovery["preemptions"] == 1 and recovery["sliceReplacements"] == 1, recovery
    (loss,) = recovery["history"]
    assert loss["phase"] == "Training" and loss["hostsReady"] < loss["hosts"] == 2, (victim, loss)
    # resumed from its own checkpoint, losing at most one checkpoint interval of reported progress
    assert t["resumedFromStep"] >= max(loss.get("step", 0) - EVERY, first_resume), (t, loss)
    assert t["step"] == t["totalSteps"] and t.get("loss") is not None, t
    assert st["goodput"]["queuedSeconds"] > 0, st["goodput"]
    events = json.loads(kubectl("get", "events", "-n", ns, "-o", "json", "--field-selector",
                                "involvedObject.name=life,reason=ReplacingSlice", check=True).stdout)["items"]
    assert len(events) == 1 and "a host was lost during Training" in events[0]["message"], events
    # the training slice was released before serving started
    assert kubectl("get", "raycluster", "life-ray", "-n", ns).returncode != 0
    _check_the_bucket(bucket, ns, st)
    # the suspended and the stopped attempts' RayJobs went before their pods; the last is Complete (issue 24)
    assert_nothing_left_failed(kubectl, ns)

    # 4. The kubelet's pull error, in status while still Serving; then ServeFailed naming it. (The
    # bound itself is the operator's, counted from status.serving.notReadySince: tests/unit/phases/.)
    blocked = wait_until(lambda: "cannot be pulled" in ((s := _status(kubectl, ns, "life")).get("message") or "")
                         and s, timeout=3 * SERVE_TIMEOUT, interval=2, what="the pull error in status")
    assert blocked["phase"] == "Serving" and "serving:does-not-exist" in blocked["message"], blocked
    failed = wait_until(lambda: (s := _status(kubectl, ns, "life")).get("phase") == "Failed" and s,
                        timeout=3 * SERVE_TIMEOUT, interval=2, what="ServeFailed at spec.serve.timeoutSeconds")
    assert failed["reason"] == "ServeFailed", failed
    assert f"spec.serve.timeoutSeconds ({SERVE_TIMEOUT}s)" in failed["message"]
    assert "serving:does-not-exist cannot be pulled" in failed["message"], failed["message"]
    conditions = {x["type"]: x["status"] for x in failed["conditions"]}
    assert conditions["TrainingSucceeded"] == "True" and conditions["Serving"] == "False", conditions


def _check_the_bucket(bucket: str, ns: str, status: dict) -> None:
    """The run's directory in the bucket is docs/checkpoints.md's layout: every checkpoint a resume
    could read committed, no more of them than spec.checkpoint.keep, the export the server would
    load, both drivers' logs and the TensorBoard events."""
    training = status["training"]
    run_dir = training["lastCheckpoint"].rsplit("/", 1)[0]
    assert run_dir.startswith(f"{bucket}/runs/{ns}-life-"), training
    assert training["exportedModel"] == f"{run_dir}/export", training
    files = _bucket_listing(run_dir)
    checkpoints = {f.split("/")[0] for f in files if f.startswith("checkpoint_step_")}
    assert checkpoints and all(f"{ck}/COMMITTED" in files for ck in checkpoints), files
    assert len(checkpoints) <= 2, checkpoints   # keep: 2
    assert training["lastCheckpoint"].rsplit("/", 1)[1] in checkpoints
    assert {"tpuft-run.json", "export/config.json", "export/model.safetensors", "logs/train.log"} <= set(files), files
    assert any(f.startswith("tensorboard/") for f in files), files
    _check_logs_and_plot_from_the_bucket(ns, run_dir)


def _check_logs_and_plot_from_the_bucket(ns: str, run_dir: str) -> None:
    """`tpuft logs` and `tpuft plot` on a laptop, once the training head is gone: both read the bucket."""
    import subprocess
    import sys
    import tempfile

    from tpuft_local.toolchain import tool_path

    kubectl = tool_path("kubectl")
    logs = subprocess.run([sys.executable, "-m", "tpuft.cli", "logs", "life", "-n", ns, "--job", "train",
                           "--kubectl", kubectl], capture_output=True, text=True, timeout=180)
    assert logs.returncode == 0, logs.stderr
    assert f"{run_dir}/logs/train.log" in logs.stderr and "TPUFT_TRAIN_RESULT" in logs.stdout, (logs.stderr, logs.stdout[-2000:])
    with tempfile.TemporaryDirectory() as out:
        plot = subprocess.run([sys.executable, "-m", "tpuft.cli", "plot", "life", "-n", ns, "--source", "tensorboard",
                               "-o", f"{out}/loss.png", "--kubectl", kubectl], capture_output=True, text=True, timeout=180)
        assert plot.returncode == 0 and os.path.getsize(f"{out}/loss.png") > 0, plot.stderr
