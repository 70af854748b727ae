"""`tpuft demo`: the whole system on one machine, no cloud and no TPU.

1. the local cluster (`tpuft cluster up`: a real node, KubeRay's operator, simulated GKE TPU
   pools, our operator from its image through the Helm chart), reused when it already runs;
   or the cluster in $KUBECONFIG with --use-kubeconfig;
2. `examples/local-cpu.yaml` applied: our operator creates the RayCluster, KubeRay creates the
   pods, the kubelet runs them, KubeRay submits both RayJobs and reads their status;
3. the TPUFinetune's status streamed phase by phase until Succeeded or Failed (or, with spec.serve
   as in the CPU example, Serving with the model ready), then a summary; a served model answers
   one chat message (what `tpuft chat` does), printed.

`--gitops` commits the object to the local cluster's git repository and lets Argo CD sync it
(tpuft_local.demo_gitops), printing Argo CD's sync and health beside the phases.

`--rehearse-tpu` applies examples/v6e-4x4.yaml instead: KubeRay places the slice's 4 workers on
the 4 simulated v6e nodes and reports the RayCluster ready, the operator starts verification,
and since nothing executes on simulated hosts the run ends at the verification deadline. With
`--flex-start` the slice comes through Kueue's ProvisioningRequest check: the run waits for
capacity, the local stand-in for GKE's queued provisioning makes the flex-start nodes, and they go
when the run is deleted at the end. The object's phase is then Failed, as it must be; the demo
judges the rehearsal (judge_rehearsal) and exits 0 when every step of it happened.
An object queued to one of the local cluster's LocalQueues gets that LocalQueue in the namespace
it runs in (--namespace), as `tpuft cluster up` makes it in tpuft-demo.
Every step says what it is doing; a failing step says which and what to do.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from tpuft.api import constants as c
from tpuft.api import gke
from tpuft.api import kuberay
from tpuft.api import kueue as kueue_names
from tpuft.controller.observed import parse_time, serving_ready
from tpuft_local.demo_objects import DEMO_NAMESPACE, PSA_LABELS, DemoError, delete_previous

REPO = Path(__file__).resolve().parents[2]
DEFAULT_EXAMPLE = REPO / "examples" / "local-cpu.yaml"
REHEARSAL_EXAMPLE = REPO / "examples" / "v6e-4x4.yaml"
REHEARSAL_VERIFY_TIMEOUT = 90  # seconds: a rehearsal ends at this verification deadline
STEPS = 3
DEMO_STORAGE_CLASS = "tpuft-demo-hostpath"   # no provisioner: the demo's PersistentVolumes bind by name
DEMO_CLAIM_SIZE = "20Gi"


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s]"


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--example", type=Path, default=None, help="TPUFinetune manifest (default: the CPU example)")
    p.add_argument("--namespace", default=DEMO_NAMESPACE,
                   help="namespace to run it in (created if missing, with the local cluster's LocalQueue its object names)")
    p.add_argument("--use-kubeconfig", action="store_true",
                   help="use the cluster in $KUBECONFIG (KubeRay and our operator already installed there)")
    p.add_argument("--down", action="store_true", help="stop the local cluster at the end (keeps its packages)")
    p.add_argument("--timeout", type=float, default=1500, help="seconds to wait for a terminal phase")
    p.add_argument("--storage-path", default=None,
                   help="override spec.checkpoint.storagePath (and the hostPath volume mounted there)")
    p.add_argument("--provisioning-timeout", type=int, default=None,
                   help="override spec.provisioningTimeoutSeconds (see a slice that never comes up fail fast)")
    p.add_argument("--rehearse-tpu", action="store_true",
                   help="apply examples/v6e-4x4.yaml: 4 workers on the simulated v6e pool; ends at the "
                        "verification deadline, since nothing runs on simulated hosts (exit 0 when the rehearsal "
                        "went as designed)")
    p.add_argument("--flex-start", action="store_true",
                   help="with --rehearse-tpu: get the slice through GKE flex-start (Kueue's ProvisioningRequest check, "
                        "the local stand-in for GKE's queued provisioning); the slice's nodes go at the end")
    p.add_argument("--gitops", action="store_true",
                   help="through Argo CD: commit the object to the local cluster's git repository, an Application "
                        "syncs it (starts `tpuft cluster up --argocd`); prints Argo CD's sync and health")
    p.add_argument("--result", type=Path, default=None, help="write the final status and the loss history as JSON")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the local cluster's state (default: ${TPUFT_HOME:-~/.tpuft}/cluster)")


def _step(clock: Clock, n: int, text: str) -> None:
    print(f"{clock.stamp()} [{n}/{STEPS}] {text}", flush=True)


TR, VER = c.TrainingStatus, c.VerificationStatus  # the status keys the workload writes


def _training_line(tr: dict) -> str:
    parts = [f"Epoch {tr.get(TR.EPOCH, '?')}/{tr.get(TR.EPOCHS, '?')}",
             f"step {tr.get(TR.STEP, '?')}/{tr.get(TR.TOTAL_STEPS, '?')}"]
    if tr.get(TR.LOSS) is not None:
        parts.append(f"loss={tr[TR.LOSS]:.4f}")
    if tr.get(TR.TOKENS_PER_SECOND) is not None:
        parts.append(f"tokens/s={tr[TR.TOKENS_PER_SECOND]:.1f} (real)")
    if tr.get(TR.PAD_FRACTION) is not None:
        parts.append(f"pad={100 * tr[TR.PAD_FRACTION]:.1f}%")
    return " | ".join(parts)


TRANSIENT_API_STATUSES = (429, 500, 502, 503, 504)


def stream(custom, namespace: str, name: str, clock: Clock, timeout: float,
           on_poll=None) -> tuple[dict, list[float]]:
    """Print each phase change, the verification result and training progress; return the final object."""
    from kubernetes.client.rest import ApiException

    seen_phase, seen_verification, seen_training = None, None, None
    epoch_losses: dict[int, float] = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            obj = custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
        except ApiException as e:
            # A loaded 2-core machine's API server answers a read with 504 now and then: poll again.
            if e.status in TRANSIENT_API_STATUSES and time.monotonic() < end:
                time.sleep(1)
                continue
            raise DemoError(f"cannot read {c.KIND} {namespace}/{name}: {e.reason}") from None
        st = obj.get("status") or {}
        phase = st.get("phase")
        if phase and phase != seen_phase:
            detail = st.get("message") or st.get("reason") or ""
            print(f"{clock.stamp()} phase {phase}{': ' + detail if detail else ''}", flush=True)
            seen_phase = phase
        ver = st.get("verification")
        if ver and ver != seen_verification:
            print(f"{clock.stamp()}   verification: {'passed' if ver.get(VER.PASSED) else 'FAILED'} | "
                  f"ranks={ver.get(VER.RANKS)} | all_reduce_sum={ver.get(VER.ALL_REDUCE_SUM)} "
                  f"(expected {ver.get(VER.EXPECTED_SUM)}) | max|TP-ref|={ver.get(VER.MAX_ABS_DIFF)} | "
                  f"{ver.get(VER.SECONDS, 0):.1f}s", flush=True)
            seen_verification = ver
        tr = st.get("training")
        if tr and (tr.get(TR.STEP), tr.get(TR.EPOCH)) != seen_training:
            print(f"{clock.stamp()}   {_training_line(tr)}", flush=True)
            seen_training = (tr.get(TR.STEP), tr.get(TR.EPOCH))
            # an epoch's mean loss (epochLoss: reported at its end, so the last report of each
            # epoch holds that epoch's)
            epoch_loss = tr.get(TR.EPOCH_LOSS, tr.get(TR.LOSS))
            if tr.get(TR.EPOCH) is not None and epoch_loss is not None:
                epoch_losses[int(tr[TR.EPOCH])] = float(epoch_loss)
        if on_poll is not None:
            on_poll()
        if phase in (c.Phase.SUCCEEDED.value, c.Phase.FAILED.value) or serving_ready(st):
            return obj, [epoch_losses[k] for k in sorted(epoch_losses)]
        time.sleep(1)
    raise DemoError(f"{namespace}/{name} did not finish within {timeout:.0f}s (last phase: {seen_phase}); "
                    "raise --timeout or look at the logs printed below")


# What the demo asks: the first questions of builtin:made-up-facts, the facts examples/local-cpu.yaml
# teaches builtin:tiny-chat, read from the data file the workload ships (the laptop side imports no
# workload code). The same questions go to the base before and to the served fine-tune after.
BUILTIN_CHAT_MODEL, BUILTIN_FACTS = "builtin:tiny-chat", "builtin:made-up-facts"
FACTS_FILE = REPO / "workload" / "tpuft_workload" / "data" / "made-up-facts.jsonl"
DEMO_QUESTIONS = 3
ANSWER_TOKENS = 24


def demo_questions(manifest: dict) -> list[tuple[str, str]]:
    """(question, taught answer) pairs to ask: the facts' first ones when the object fine-tunes the
    built-in pair; otherwise one general question, nothing taught to compare."""
    spec = manifest.get("spec") or {}
    if (spec.get("model"), (spec.get("dataset") or {}).get("name")) != (BUILTIN_CHAT_MODEL, BUILTIN_FACTS):
        return [("What is the capital of France?", "")]
    records = [json.loads(line) for line in FACTS_FILE.read_text().splitlines()[:DEMO_QUESTIONS]]
    return [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in records]


class BaseAnswers:
    """The base's answers, asked on this machine in a child process while the cluster trains
    (`python -m tpuft_workload.tiny_chat QUESTION...`: the base built as the image builds it, asked
    through the endpoint's chat rendering and greedy decoding). None when the object's model is
    another, or this Python has no workload packages."""

    def __init__(self, manifest: dict, questions: list[str]) -> None:
        import subprocess

        self.proc = None
        if (manifest.get("spec") or {}).get("model") == BUILTIN_CHAT_MODEL:
            self.proc = subprocess.Popen([sys.executable, "-m", "tpuft_workload.tiny_chat", *questions],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         preexec_fn=lambda: os.nice(10))   # the cluster's pods come first

    def collect(self, timeout: float = 300) -> tuple[dict[str, str] | None, str]:
        """(question -> the base's answer, or None; why there are none)."""
        import subprocess

        if self.proc is None:
            return None, "the object's model is not builtin:tiny-chat"
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return None, f"python -m tpuft_workload.tiny_chat did not answer within {timeout:.0f}s"
        if self.proc.returncode != 0:
            return None, f"python -m tpuft_workload.tiny_chat failed: {(err.strip().splitlines() or ['?'])[-1]}"
        return json.loads(out.strip().splitlines()[-1]), ""


def eval_losses(status: dict) -> list[tuple[int, float]]:
    """(step, eval loss) of each evaluation status.training.history holds, oldest first."""
    history = (status.get("training") or {}).get(TR.HISTORY) or []
    return [(int(p[c.HistoryPoint.STEP.value]), float(p[c.HistoryPoint.EVAL_LOSS.value])) for p in history
            if p.get(c.HistoryPoint.EVAL_LOSS.value) is not None]


def _chat(obj: dict, kubeconfig: str, clock: Clock, questions: list[tuple[str, str]],
          before: dict[str, str] | None, no_before: str) -> dict:
    """The questions asked of the served model as `tpuft chat` asks (kubectl port-forward +
    /v1/chat/completions, one forward for all), printed beside the base's answers and what was taught."""
    from tpuft.cli import chat as chatlib
    from tpuft.cli import chat_cli
    from tpuft.cli.kubectl import port_forward
    from tpuft_local.toolchain import tool_path

    os.environ["KUBECONFIG"] = kubeconfig   # for the kubectl calls below
    meta, kubectl = obj["metadata"], tool_path("kubectl")
    print(f"{clock.stamp()} the same questions to the base ({obj['spec']['model']}, "
          f"{'asked on this machine' if before else no_before}) and to the fine-tune "
          f"(tpuft chat -n {meta['namespace']} {meta['name']} QUESTION)", flush=True)
    exchanges = []
    try:
        serving = chat_cli.endpoint(obj)
        key = chat_cli.api_key(kubectl, meta["namespace"], obj)
        with port_forward(kubectl, meta["namespace"], serving["service"], int(serving.get("port") or c.SERVE_PORT)) as local:
            model = serving["model"]
            for question, taught in questions:
                answer = chatlib.chat(f"http://127.0.0.1:{local}", model, question, max_tokens=ANSWER_TOKENS,
                                      temperature=0.0, api_key=key)
                exchanges.append({"question": question, "base": (before or {}).get(question), "answer": answer,
                                  "taught": taught})
    except Exception as e:  # noqa: BLE001 - NotServing, ChatError, a kubectl timeout: all mean the same here
        raise DemoError(f"the served model did not answer: {e}") from None
    width = max(len(model), len("base"), len("taught")) + 1
    for x in exchanges:
        print(f"  {'user:':<{width}} {x['question']}", flush=True)
        if before:
            print(f"  {'base:':<{width}} {x['base']!r}", flush=True)
        print(f"  {model + ':':<{width}} {x['answer']!r}", flush=True)
        if x["taught"]:
            print(f"  {'taught:':<{width}} {x['taught']!r}", flush=True)
    evals = eval_losses(obj.get("status") or {})
    if len(evals) > 1:
        (first_step, first), (last_step, last) = evals[0], evals[-1]
        print(f"  eval loss on the held-out records: {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step})",
              flush=True)
    return {"prompt": exchanges[0]["question"], "model": model, "answer": exchanges[0]["answer"],
            "exchanges": exchanges, "evalLosses": evals}


def _prepare(api_client, manifest: dict, namespace: str, clock: Clock, local_cluster: bool) -> None:
    """What the object needs beside it: its namespace, its Kueue LocalQueue, its API key Secret,
    its checkpoint claim."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(api_client)
    with contextlib.suppress(ApiException):   # already there: left as it is, labels included
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace, labels=PSA_LABELS)))
    manifest["metadata"]["namespace"] = namespace
    _ensure_local_queue(client.CustomObjectsApi(api_client), manifest, namespace, clock, local_cluster)
    _ensure_api_key(core, manifest, namespace, clock)
    _hostpath_as_claim(core, manifest, namespace, clock)


def _ensure_local_queue(custom, manifest: dict, namespace: str, clock: Clock, local_cluster: bool) -> None:
    """The LocalQueue the object's kueue.x-k8s.io/queue-name label names must be in its namespace, or
    Kueue keeps it Queued for good. On the local cluster a queue `tpuft cluster up` makes in the demo
    namespace (kueue.DEMO_LOCAL_QUEUES) is made here too, the same object; another cluster's queues,
    or another name, are its admin's: they are looked up, and a missing one is refused."""
    from kubernetes.client.rest import ApiException

    from tpuft_local import kueue

    queue = ((manifest.get("metadata") or {}).get("labels") or {}).get(kueue_names.KUEUE_QUEUE_LABEL)
    if not queue:
        return
    where = f"LocalQueue {namespace}/{queue} (the object's label {kueue_names.KUEUE_QUEUE_LABEL})"
    api = (kueue_names.KUEUE_GROUP, kueue_names.KUEUE_VERSION, namespace, "localqueues")
    make = local_cluster and queue in kueue.DEMO_LOCAL_QUEUES
    try:
        if make:
            custom.create_namespaced_custom_object(*api, kueue.demo_local_queue(namespace, queue))
            print(f"{clock.stamp()}       created {where} -> ClusterQueue {kueue.DEMO_LOCAL_QUEUES[queue]}, "
                  f"as `tpuft cluster up` makes it in {DEMO_NAMESPACE}", flush=True)
        else:
            custom.get_namespaced_custom_object(*api, queue)
        return
    except ApiException as e:
        if e.status == 409:   # made by an earlier run (or by hand): kept as it is
            return
        if e.status == 404 and make:
            raise DemoError(f"cannot create {where}: Kueue's API is not served (a cluster started with "
                            "`tpuft cluster up --no-kueue`?); start it with Kueue: tpuft cluster down && "
                            "tpuft cluster up") from None
        if e.status == 404:
            known = ", ".join(kueue.DEMO_LOCAL_QUEUES) if local_cluster else ""
            raise DemoError(f"{where} does not exist, and Kueue would keep the run Queued until it does: create it "
                            f"in {namespace}, or run in a namespace that has it"
                            + (f" (the local cluster's queues: {known})" if known else "")) from None
        raise DemoError(f"cannot {'create' if make else 'read'} {where}: {e.reason}") from None


def _apply(api_client, manifest: dict, namespace: str, clock: Clock) -> tuple[str, datetime]:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    custom = client.CustomObjectsApi(api_client)
    name = manifest["metadata"]["name"]
    delete_previous(custom, namespace, name, lambda text: print(f"{clock.stamp()}       {text}", flush=True))
    try:
        created = custom.create_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, manifest)
    except ApiException as e:
        body = json.loads(e.body).get("message", e.body) if e.body else e.reason
        raise DemoError(f"the API server rejected {namespace}/{name}: {body}") from None
    return name, parse_time(created["metadata"]["creationTimestamp"])


def _ensure_api_key(core, manifest: dict, namespace: str, clock: Clock) -> None:
    """spec.serve.apiKeySecret names a Secret the user provides; the demo makes one with a random
    key when it is missing. The key is never printed: `tpuft chat` reads it with kubectl."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    ref = ((manifest.get("spec") or {}).get("serve") or {}).get("apiKeySecret")
    if not ref:
        return
    name, key = ref["name"], ref.get("key", c.SERVE_API_KEY_SECRET_KEY)
    body = client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data={key: secrets.token_urlsafe(32)})
    try:
        core.create_namespaced_secret(namespace, body)
        print(f"{clock.stamp()}       created Secret {namespace}/{name} with a random API key for the served "
              f"model (spec.serve.apiKeySecret; `tpuft chat` reads it)", flush=True)
    except ApiException as e:
        if e.status != 409:   # 409: the user's own Secret, kept
            raise DemoError(f"cannot create the API key Secret {namespace}/{name}: {e.reason}") from None


def _hostpath_as_claim(core, manifest: dict, namespace: str, clock: Clock) -> None:
    """Pod Security `baseline` refuses hostPath volumes in pods, so the example's hostPath
    checkpoint volume becomes a claim on a hostPath PersistentVolume (the same directory on the
    node, bound to this namespace only): what a cluster admin does for a pod that may not mount
    the node's disk itself."""
    from kubernetes.client.rest import ApiException

    ck = (manifest.get("spec") or {}).get("checkpoint") or {}
    host = (ck.get("volume") or {}).get("hostPath")
    if not host:
        return
    digest = hashlib.sha256(f"{namespace}/{host['path']}".encode()).hexdigest()[:10]
    pv_name, claim = f"tpuft-demo-checkpoints-{digest}", f"checkpoints-{digest}"
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name, "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY}},
          "spec": {"capacity": {"storage": DEMO_CLAIM_SIZE}, "accessModes": ["ReadWriteMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": DEMO_STORAGE_CLASS,
                   "hostPath": dict(host), "claimRef": {"namespace": namespace, "name": claim}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": DEMO_STORAGE_CLASS, "volumeName": pv_name,
                    "resources": {"requests": {"storage": DEMO_CLAIM_SIZE}}}}
    try:
        old = core.read_persistent_volume(pv_name)
        if old.status.phase == "Released":   # its claim went with an earlier namespace: bind it anew
            core.delete_persistent_volume(pv_name)
            end = time.monotonic() + 60
            while time.monotonic() < end:
                core.read_persistent_volume(pv_name)
                time.sleep(0.5)
    except ApiException as e:
        if e.status != 404:
            raise DemoError(f"cannot read PersistentVolume {pv_name}: {e.reason}") from None
    for create, body in ((core.create_persistent_volume, pv),
                         (lambda b: core.create_namespaced_persistent_volume_claim(namespace, b), pvc)):
        try:
            create(body)
        except ApiException as e:
            if e.status != 409:
                raise DemoError(f"cannot create {body['kind']} {body['metadata']['name']}: {e.reason}") from None
    ck["volume"] = {"persistentVolumeClaim": {"claimName": claim}}
    print(f"{clock.stamp()}       checkpoints: claim {namespace}/{claim} on hostPath {host['path']} "
          f"(Pod Security baseline refuses hostPath in pods)", flush=True)


def _example(args) -> Path:
    return Path(args.example or (REHEARSAL_EXAMPLE if args.rehearse_tpu else DEFAULT_EXAMPLE))


def _manifest(args) -> dict:
    try:
        manifest = yaml.safe_load(_example(args).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DemoError(f"cannot read the example {_example(args)}: {e}") from None
    spec = manifest["spec"]
    if args.storage_path:
        ck = spec.setdefault("checkpoint", {})
        ck["storagePath"] = args.storage_path
        if "hostPath" in (ck.get("volume") or {}):
            ck["volume"]["hostPath"]["path"] = args.storage_path
    if args.provisioning_timeout is not None:
        spec["provisioningTimeoutSeconds"] = args.provisioning_timeout
    if args.rehearse_tpu:
        spec.setdefault("verification", {})["timeoutSeconds"] = REHEARSAL_VERIFY_TIMEOUT
    if getattr(args, "flex_start", False):
        if not args.rehearse_tpu:
            raise DemoError("--flex-start needs --rehearse-tpu: flex-start provisions a TPU slice (simulated here)")
        from tpuft_local.kueue import FLEX_START
        manifest.setdefault("metadata", {}).setdefault("labels", {})[kueue_names.KUEUE_QUEUE_LABEL] = FLEX_START
        spec.setdefault("scheduling", {})["provisioning"] = c.Provisioning.FLEX_START.value
    return manifest


def _release_flex_start(custom, core, namespace: str, name: str, clock: Clock, timeout: float = 180) -> bool:
    """Delete the run and wait (bounded) until the stand-in has removed its flex-start nodes:
    whether they went."""
    from tpuft_local.queued_provisioning import OWNER_LABEL
    with contextlib.suppress(Exception):
        custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
    print(f"{clock.stamp()}   deleted {name}: the booking ends, its flex-start nodes go", flush=True)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [n.metadata.name for n in core.list_node(label_selector=OWNER_LABEL).items]
        if not left:
            print(f"{clock.stamp()}   the flex-start nodes are gone", flush=True)
            return True
        time.sleep(2)
    print(f"{clock.stamp()}   flex-start nodes still there after {timeout:.0f} s: {', '.join(left)} "
          "(logs: queued-provisioning.log)", file=sys.stderr, flush=True)
    return False


def _cluster(args, clock: Clock):
    """(kubeconfig path, the LocalCluster or None)."""
    if args.use_kubeconfig:
        kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        _step(clock, 1, f"using the cluster in {kubeconfig}")
        return kubeconfig, None
    from tpuft_local.cluster import ClusterError, LocalCluster
    cluster = LocalCluster(args.state_dir, argocd=True if args.gitops else None)
    _step(clock, 1, f"local cluster (tpuft cluster up) in {cluster.state}: real node, KubeRay, simulated TPU "
                    "pools, our operator from its image via helm")
    try:
        cluster.up(unchanged_ok=True)
    except (ClusterError, RuntimeError) as e:
        raise DemoError(f"the local cluster did not come up: {e}") from None
    return str(cluster.kubeconfig), cluster


class Placement:
    """Prints once where each of this run's KubeRay pods landed: the real node or a simulated host
    (a flex-start one: from GKE's queued provisioning, the local stand-in here). A previous run's
    pods (same names, still shutting down) are older than this run's object."""

    def __init__(self, core, namespace: str, clock: Clock, since: datetime):
        self.core, self.namespace, self.clock, self.since = core, namespace, clock, since
        self.placed: dict[str, dict] = {}
        self._nodes: dict[str, tuple[bool, bool]] = {}

    def _node(self, node: str) -> tuple[bool, bool]:
        """(simulated, flex-start) of a node, read once."""
        if node not in self._nodes:
            from tpuft_local.pools import KWOK_ANNOTATION
            try:
                meta = self.core.read_node(node).metadata
                annotations, labels = meta.annotations or {}, meta.labels or {}
            except Exception:  # noqa: BLE001  (a node we may not read is shown as real)
                annotations, labels = {}, {}
            self._nodes[node] = (KWOK_ANNOTATION in annotations, labels.get(gke.GKE_FLEX_START_SELECTOR) == "true")
        return self._nodes[node]

    def poll(self) -> None:
        try:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=kuberay.RAY_NODE_TYPE_LABEL).items
        except Exception:  # noqa: BLE001  (best effort: the phase stream is what matters)
            return
        for pod in pods:
            if (pod.metadata.name in self.placed or not pod.spec.node_name or pod.metadata.deletion_timestamp
                    or pod.metadata.creation_timestamp < self.since):
                continue
            simulated, flex_start = self._node(pod.spec.node_name)
            self.placed[pod.metadata.name] = {"node": pod.spec.node_name, "simulated": simulated,
                                              "flexStart": flex_start,
                                              "role": (pod.metadata.labels or {}).get(kuberay.RAY_NODE_TYPE_LABEL)}
            kind = "SIMULATED host (KWOK): nothing executes there" if simulated else "real node"
            print(f"{self.clock.stamp()}   KubeRay pod {pod.metadata.name} -> {pod.spec.node_name} ({kind})",
                  flush=True)


def run_demo(args: argparse.Namespace) -> int:
    clock, cluster = Clock(), None
    try:
        if args.gitops and args.use_kubeconfig:
            raise DemoError("--gitops uses the local cluster's Argo CD and git repository; drop --use-kubeconfig")
        manifest = _manifest(args)
        kubeconfig, cluster = _cluster(args, clock)
        from kubernetes import client, config

        api_client = config.new_client_from_config(config_file=kubeconfig)
        custom, view = client.CustomObjectsApi(api_client), None
        if args.gitops:
            from tpuft_local import demo_gitops
            _step(clock, 2, f"git commit {_example(args).name} to the local repository; Argo CD syncs it "
                            f"(namespace {args.namespace})")
            _prepare(api_client, manifest, args.namespace, clock, cluster is not None)
            def say(text: str) -> None:
                print(f"{clock.stamp()}       {text}", flush=True)
            try:
                name, created, view = demo_gitops.apply(custom, cluster, manifest, args.namespace, say)
            except demo_gitops.GitopsError as e:
                raise DemoError(str(e)) from None
        else:
            _step(clock, 2, f"kubectl apply -f {_example(args)} (namespace {args.namespace})")
            _prepare(api_client, manifest, args.namespace, clock, cluster is not None)
            name, created = _apply(api_client, manifest, args.namespace, clock)
        _step(clock, 3, "watching status: our operator -> KubeRay -> the kubelet" + (" (and Argo CD)" if view else ""))
        questions = demo_questions(manifest)
        base = BaseAnswers(manifest, [q for q, _ in questions])
        placement = Placement(client.CoreV1Api(api_client), args.namespace, clock, created)
        polls = [placement.poll, *([view.poll] if view else [])]
        final, losses = stream(custom, args.namespace, name, clock, args.timeout,
                               on_poll=lambda: [poll() for poll in polls])
        released = (_release_flex_start(custom, client.CoreV1Api(api_client), args.namespace, name, clock)
                    if getattr(args, "flex_start", False) else None)
        st = final.get("status") or {}
        ended_well = st.get("phase") == c.Phase.SUCCEEDED.value or serving_ready(st)
        if args.rehearse_tpu and not ended_well:
            code = _rehearsal_summary(final, placement, getattr(args, "flex_start", False), released, clock)
        else:
            code = _summary(final, losses, placement, clock)
        if view is not None:   # Argo CD's own verdict on the phase the run ended in
            view.settle("Healthy" if ended_well else "Degraded")
        exchange = None
        if code == 0 and serving_ready(final.get("status") or {}):
            exchange = _chat(final, kubeconfig, clock, questions, *base.collect())
        if args.result:
            args.result.parent.mkdir(parents=True, exist_ok=True)
            args.result.write_text(json.dumps({"object": final, "epochLosses": losses, "chat": exchange,
                                               "placement": placement.placed,
                                               "argocd": {"history": view.history, "final": view.last} if view else None},
                                              indent=2, default=str))
        return code
    except DemoError as e:
        print(f"{clock.stamp()} demo failed: {e}", file=sys.stderr, flush=True)
        if cluster is not None:
            print(f"  component logs: {cluster.logs}/", file=sys.stderr)
        return 1
    finally:
        if cluster is not None and args.down:
            for line in cluster.down(keep_packages=True):
                print(f"{clock.stamp()}       {line}", flush=True)
            print(f"{clock.stamp()} local cluster stopped", flush=True)
        elif cluster is not None:
            print(f"The local cluster is still up:\n"
                  f'  eval "$(tpuft cluster env)"; kubectl get tft -n {args.namespace} -o wide\n'
                  f"  tpuft cluster down      # stop it and undo its host changes", flush=True)
        print(f"total {time.monotonic() - clock.t0:.1f}s", flush=True)


def _summary(obj: dict, losses: list[float], placement: Placement, clock: Clock) -> int:
    st = obj.get("status") or {}
    conds = {x["type"]: x["status"] for x in st.get("conditions", [])}
    if st.get("phase") == c.Phase.SUCCEEDED.value or serving_ready(st):
        tr = st.get("training") or {}
        print(f"{clock.stamp()} {st['phase']}: conditions {', '.join(f'{k}={v}' for k, v in conds.items())}")
        if losses:
            print(f"  loss per epoch: {' -> '.join(f'{x:.4f}' for x in losses)}")
        if tr:   # a base served as it is (training.method none) trained nothing
            print(f"  last checkpoint: {tr.get(TR.LAST_CHECKPOINT)}\n  exported model:  {tr.get(TR.EXPORTED_MODEL)}",
                  flush=True)
        if st.get("serving"):
            print(f"  served at:       {st['serving'].get('url')} (model {st['serving'].get('model')})", flush=True)
        return 0
    print(f"{clock.stamp()} Failed: {st.get('reason')}: {st.get('message')}", file=sys.stderr)
    simulated = sorted(p["node"] for p in placement.placed.values() if p["simulated"])
    if simulated:
        print(f"  the slice's hosts are SIMULATED (KWOK nodes {', '.join(simulated)}): KubeRay placed the pods and "
              "reported the cluster ready, but no Ray worker can start there, so the RayJob cannot complete",
              file=sys.stderr)
    print(f"  kubectl describe tft {obj['metadata']['name']} -n {obj['metadata']['namespace']}", file=sys.stderr,
          flush=True)
    return 1


# How verification ends on simulated hosts, where no Ray worker starts: at its deadline
# (CollectiveTimeout), or earlier when KubeRay gives the RayJob up because its submitter cannot
# reach the Ray head (VerificationFailed).
EXPECTED_ON_SIMULATED_HOSTS = (c.Reason.COLLECTIVE_TIMEOUT.value, c.Reason.VERIFICATION_FAILED.value)


@dataclass(frozen=True)
class RehearsalVerdict:
    """Whether a `--rehearse-tpu` run went as designed, in one line that says so or says what did not."""
    as_designed: bool
    line: str

    @property
    def exit_code(self) -> int:
        return 0 if self.as_designed else 1


def judge_rehearsal(status: dict, placed: dict[str, dict], workers: int, flex_start: bool,
                    nodes_released: bool | None) -> RehearsalVerdict:
    """A rehearsal is designed to show: (with flex-start, Kueue admitting the slice through the
    ProvisioningRequest check), the slice provisioned with its `workers` Ray workers on simulated
    hosts (flex-start ones with flex-start), verification started and ended the way it can only
    end there (EXPECTED_ON_SIMULATED_HOSTS), (with flex-start, its nodes gone once the run is
    deleted). The first of these that did not happen, in the order the run goes through them, is the verdict."""
    conds = {x.get("type"): x for x in status.get("conditions") or []}

    def holds(cond: c.Condition) -> bool:
        return (conds.get(cond.value) or {}).get("status") == c.ConditionStatus.TRUE.value

    def said(cond: c.Condition) -> str:
        x = conds.get(cond.value)
        if x is None:
            return f"no condition {cond.value}"
        return f"{cond.value}={x.get('status')}: {x.get('reason')}" + (f": {x['message']}" if x.get("message") else "")

    phase, reason = status.get("phase"), status.get("reason")
    ended = f"it ended in phase {phase}" + (f": {reason}" if reason else "") + (
        f": {status['message']}" if status.get("message") else "")
    pool = "flex-start " if flex_start else ""
    hosts = sorted(p["node"] for p in placed.values()
                   if p.get("role") == "worker" and p.get("simulated") and (p.get("flexStart") or not flex_start))
    if flex_start and not holds(c.Condition.ADMITTED):
        return RehearsalVerdict(False, f"never admitted: Kueue did not admit the slice through the flex-start check "
                                       f"({said(c.Condition.ADMITTED)}); {ended}")
    if not holds(c.Condition.SLICE_PROVISIONED):
        return RehearsalVerdict(False, f"never provisioned: the slice did not come up ({said(c.Condition.SLICE_PROVISIONED)}); "
                                       f"{ended}")
    if len(hosts) < workers:
        return RehearsalVerdict(False, f"{len(hosts)} of the slice's {workers} Ray workers were placed on simulated "
                                       f"{pool}hosts ({', '.join(hosts) or 'none'}); {ended}")
    if phase != c.Phase.FAILED.value or reason not in EXPECTED_ON_SIMULATED_HOSTS:
        return RehearsalVerdict(False, f"{ended}, not at the end verification can only reach on simulated hosts "
                                       f"({' or '.join(EXPECTED_ON_SIMULATED_HOSTS)})")
    if flex_start and nodes_released is not True:
        return RehearsalVerdict(False, "the flex-start nodes were still there when the demo ended "
                                       "(logs: queued-provisioning.log)")
    return RehearsalVerdict(True, "rehearsal complete: " + ("Kueue admitted the slice through the flex-start check, "
                                                            if flex_start else "")
                            + f"its {workers} Ray workers ran on SIMULATED {pool}hosts ({', '.join(hosts)}), KubeRay "
                            "reported the slice ready and verification started"
                            + (", and the flex-start nodes went with the run" if flex_start else "")
                            + f" (verification cannot run on simulated hosts: the {reason} is expected)")


def _rehearsal_summary(obj: dict, placement: Placement, flex_start: bool, nodes_released: bool | None,
                       clock: Clock) -> int:
    """The rehearsal's verdict (judge_rehearsal) printed; its exit code."""
    from tpuft.api.spec import parse

    spec = parse(obj).spec
    verdict = judge_rehearsal(obj.get("status") or {}, placement.placed, spec.slice.hosts * spec.slices,
                              flex_start, nodes_released)
    if verdict.as_designed:
        print(f"{clock.stamp()} {verdict.line}", flush=True)
    else:
        print(f"{clock.stamp()} the rehearsal did not go as designed: {verdict.line}\n"
              f"  kubectl describe tft {obj['metadata']['name']} -n {obj['metadata']['namespace']}",
              file=sys.stderr, flush=True)
    return verdict.exit_code


add_arguments, run = add_demo_arguments, run_demo
