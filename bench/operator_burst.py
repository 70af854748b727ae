"""Burst benchmark: the TPUFinetune operator vs KubeRay's own operator on one real local API server.

    .venv/bin/python bench/operator_burst.py                       # sizes 1,100,500; writes bench/results/
    .venv/bin/python bench/operator_burst.py --runs 1:3,100:3,500:1 --ours-only
    .venv/bin/python bench/operator_burst.py --build-peer          # only build/cache the KubeRay operator

What it does, per run (a fresh namespace each, operators run one at a time, never together):

  ours  `kopf run --standalone -m tpuft.controller.handlers --namespace=NS` as a subprocess (production defaults:
        TPUFT_RESYNC_SECONDS=5, TPUFT_WORKERS=4). After a warm-up object, N TPUFinetunes (v6e 4x4, so
        nothing executes) are created by 8 client threads; per object, from t0 (its create call returned
        or the harness's watch saw it ADDED, whichever came first) -> the harness's watch sees phase
        Provisioning with status.children set (the children are created before that
        status write), and -> its RayCluster ADDED. Then an idle window (requests/s while every object
        waits in Provisioning: the resync), then every object is driven to Succeeded by writing
        KubeRay-shaped RayCluster/RayJob status (as tests/kuberay_standin.py does).
  peer  KubeRay's operator (hack/kuberay/, built by tpuft_local.toolchain from the Go module proxy) with N RayJobs that carry
        an inline rayClusterSpec (small CPU head + 1 worker): t0 (as above) -> its RayCluster ADDED.

API requests come from the API server's own /metrics (apiserver_request_total, diffed), minus the
requests this harness made itself (counted exactly here). The harness observes through watches,
which the API server counts only when they end (after the last snapshot), so they do not pollute.
The kube-controller-manager runs only the namespace and service-account controllers
(TPUFT_KCM_CONTROLLERS; no garbage collector, whose owner lookups would be counted against the
operator); nothing in the benchmark needs garbage collection. Peak RSS is VmHWM from
/proc/PID/status of the operator process, read just before it is stopped.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
sys.path.insert(0, str(REPO))  # tests.kuberay_standin
os.environ.setdefault("TPUFT_KCM_CONTROLLERS", ",".join([
    "namespace-controller", "serviceaccount-controller", "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller", "clusterrole-aggregation-controller"]))

from kubernetes import client, config, watch  # noqa: E402

from tpuft_local.controlplane import ControlPlane, default_crd_paths  # noqa: E402
from tpuft_local import toolchain  # noqa: E402
from tests.ranks import free_port  # noqa: E402

PEER_VERSION = toolchain.KUBERAY_VERSION  # v1.7.0 is not served by the Go module proxy (403); see hack/kuberay/go.mod
PEER_MODULE = "github.com/ray-project/kuberay/ray-operator"
GROUP, VERSION, PLURAL = "tpufinetune.dev", "v1alpha1", "tpufinetunes"
RAY = ("ray.io", "v1")
CHILD_RESOURCES = {"rayclusters", "rayjobs", "serviceaccounts", "roles", "rolebindings", "pods", "services",
                   "jobs", "configmaps", "secrets", "ingresses", "routes", "networkpolicies"}
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"}
CREATORS = 8
RAYSERVICE_STUB_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "rayservices.ray.io"},
    "spec": {"group": "ray.io", "scope": "Namespaced",
             "names": {"plural": "rayservices", "singular": "rayservice", "kind": "RayService", "listKind": "RayServiceList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
OURS_ENV: dict[str, str] = {}  # --ours-env K=V
PROFILE = os.environ.get("BENCH_PYSPY")  # path of a py-spy binary: profile our operator


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    """q-th percentile, linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def med(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


# --- the control plane and its request counters --------------------------------------------------
class Cluster:
    def __init__(self, state_dir: Path):
        self.cp = ControlPlane(state_dir, die_with_parent=True, fast_etcd=True)

    def start(self) -> "Cluster":
        say(f"starting the control plane in {self.cp.state_dir}")
        self.cp.start()
        self.cp.install_crds(default_crd_paths())
        # KubeRay's operator also runs its RayService controller, whose informer must sync within 2 min
        # or the whole manager exits; a stub CRD (no RayService is ever created) lets it sync.
        self.cp.kubectl("apply", "-f", "-", input=json.dumps(RAYSERVICE_STUB_CRD), check=True)
        self.cp.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        "crd/rayservices.ray.io", check=True)
        self.api = config.new_client_from_config(config_file=str(self.cp.kubeconfig))
        self.api.configuration.connection_pool_maxsize = 32
        self.api = config.new_client_from_config(config_file=str(self.cp.kubeconfig),
                                                 client_configuration=self.api.configuration)
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        ctx = ssl.create_default_context(cafile=str(self.cp.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.cp.pki / "admin.crt"), str(self.cp.pki / "admin.key"))
        self._ssl = ctx
        return self

    def stop(self) -> None:
        self.cp.stop(quiet=True)

    def requests(self) -> Counter:
        """apiserver_request_total summed over code/component/scope/...: {(verb, resource, subresource): n}."""
        with urllib.request.urlopen(self.cp.server_url + "/metrics", context=self._ssl, timeout=30) as r:
            text = r.read().decode()
        out: Counter = Counter()
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels_s, value = line[len("apiserver_request_total{"):].rsplit("} ", 1)
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels_s))
            out[(labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))] += float(value)
        return out

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"metadata": {"name": name}})
        deadline = time.monotonic() + 60
        while True:
            try:
                self.core.read_namespaced_service_account("default", name)
                return name
            except client.ApiException:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no default serviceaccount in {name}")
                time.sleep(0.2)

    def delete_namespace(self, name: str, wait: float = 180) -> None:
        """Delete and wait for it to be gone, so the next run does not share the CPU with the cleanup."""
        try:
            self.core.delete_namespace(name)
        except client.ApiException:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                self.core.read_namespace(name)
            except client.ApiException as e:
                if e.status == 404:
                    return
            time.sleep(1)
        say(f"namespace {name} still terminating after {wait}s; going on")


def settle(cl: "Cluster", quiet_s: float = 2.0, limit_s: float = 90.0) -> tuple[Counter, float]:
    """Wait until the API server has counted no new write for `quiet_s` (the operator's follow-up work
    is done); returns the counters then and how long it took."""
    t0 = time.monotonic()
    last = cl.requests()
    quiet_since = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        time.sleep(0.5)
        now = cl.requests()
        if sum(v for (verb, _, _), v in now.items() if verb in WRITE_VERBS) != \
                sum(v for (verb, _, _), v in last.items() if verb in WRITE_VERBS):
            quiet_since = time.monotonic()
        last = now
        if time.monotonic() - quiet_since >= quiet_s:
            break
    return last, time.monotonic() - t0


def diff(after: Counter, before: Counter, harness: Counter) -> Counter:
    out = Counter()
    for k in set(after) | set(before):
        v = after.get(k, 0) - before.get(k, 0) - harness.get(k, 0)
        if abs(v) > 1e-9:
            out[k] = v
    return out


def by_kind(reqs: Counter, n: int) -> dict:
    """Per object: writes split into children / status / events / other; reads; watches apart."""
    kinds: dict[str, float] = defaultdict(float)
    detail: dict[str, float] = {}
    for (verb, resource, sub), v in reqs.items():
        if resource in ("leases", ""):  # API server's own identity leases; non-resource URLs (/metrics ...)
            continue
        label = f"{verb} {resource}{'/' + sub if sub else ''}"
        detail[label] = round(v / n, 3)
        if verb in ("WATCH", "WATCHLIST"):
            kinds["watches(total)"] += v
        elif verb in WRITE_VERBS:
            if resource == PLURAL and sub == "status":
                kinds["writes.status"] += v / n
            elif resource == "events":
                kinds["writes.events"] += v / n
            elif resource in CHILD_RESOURCES or resource == PLURAL:
                kinds["writes.children" if resource != PLURAL else "writes.other"] += v / n
            else:
                kinds["writes.other"] += v / n
        else:
            kinds[f"reads.{verb}"] += v / n
    out = {k: round(v, 3) for k, v in sorted(kinds.items())}
    out["writes.total"] = round(sum(v for k, v in kinds.items() if k.startswith("writes.")), 3)
    out["reads.total"] = round(sum(v for k, v in kinds.items() if k.startswith("reads.")), 3)
    out["detail"] = dict(sorted(detail.items()))
    return out


# --- processes ----------------------------------------------------------------------------------
class Proc:
    def __init__(self, argv: list[str], env: dict, log: Path):
        self.log = log
        self.fh = open(log, "w")
        self.p = subprocess.Popen(argv, env=env, stdout=self.fh, stderr=subprocess.STDOUT, cwd=str(REPO),
                                  start_new_session=True)

    def status_kb(self, field: str) -> int | None:
        try:
            for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def cpu_seconds(self) -> float | None:
        try:
            f = Path(f"/proc/{self.p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return None

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGINT)  # its own session (start_new_session): py-spy writes, kopf exits
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.fh.close()


# --- watches ------------------------------------------------------------------------------------
class Watcher(threading.Thread):
    """Streams one resource of a namespace; calls on_event(type, obj, t_monotonic) for every event."""

    def __init__(self, cluster: Cluster, group: str, version: str, plural: str, ns: str, on_event):
        super().__init__(daemon=True, name=f"watch-{plural}")
        self.cl, self.args, self.on_event = cluster, (group, version, ns, plural), on_event
        self.w = watch.Watch()
        self.stopped = False
        self.ready = threading.Event()

    def run(self) -> None:
        rv = None
        while not self.stopped:
            try:
                if rv is None:
                    lst = self.cl.custom.list_namespaced_custom_object(*self.args)
                    now = time.monotonic()
                    for obj in lst["items"]:
                        self.on_event("ADDED", obj, now)
                    rv = lst["metadata"]["resourceVersion"]
                    self.ready.set()
                for ev in self.w.stream(self.cl.custom.list_namespaced_custom_object, *self.args,
                                        resource_version=rv, timeout_seconds=3600, allow_watch_bookmarks=False):
                    now = time.monotonic()
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    self.on_event(ev["type"], obj, now)
            except Exception as e:  # noqa: BLE001 - reconnect
                if not self.stopped:
                    say(f"watch {self.args[3]} restarting: {type(e).__name__}: {e}")
                    rv = None
                    time.sleep(0.2)

    def stop(self) -> None:
        self.stopped = True
        self.w.stop()


# --- our operator -------------------------------------------------------------------------------
def tft_body(name: str, **spec) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFinetune", "metadata": {"name": name},
            "spec": {"accelerator": "v6e", "topology": "4x4", "image": "img:1", "model": "m",
                     "dataset": {"name": "d"}, "checkpoint": {"storagePath": "gs://bucket/ck"}, **spec}}


class TftState:
    """What the harness's watches saw of each TPUFinetune and its RayCluster."""

    def __init__(self):
        self.lock = threading.Lock()
        self.phase: dict[str, str] = {}
        self.added_at: dict[str, float] = {}
        self.provisioning_at: dict[str, float] = {}
        self.cluster_at: dict[str, float] = {}
        self.status_versions: dict[str, list[dict]] = defaultdict(list)  # each distinct status seen
        self.phases_seen: dict[str, list[str]] = defaultdict(list)

    def on_tft(self, etype: str, obj: dict, t: float) -> None:
        name = obj["metadata"]["name"]
        st = obj.get("status") or {}
        with self.lock:
            self.added_at.setdefault(name, t)
            versions = self.status_versions[name]
            if st and (not versions or versions[-1] != st):
                versions.append(st)
            ph = st.get("phase")
            if ph and (not self.phases_seen[name] or self.phases_seen[name][-1] != ph):
                self.phases_seen[name].append(ph)
            if ph:
                self.phase[name] = ph
            if ph == "Provisioning" and (st.get("children") or {}).get("rayCluster") and name not in self.provisioning_at:
                self.provisioning_at[name] = t

    def on_cluster(self, etype: str, obj: dict, t: float) -> None:
        owner = (obj["metadata"].get("labels") or {}).get("tpufinetune.dev/name")
        if owner and etype == "ADDED":
            with self.lock:
                self.cluster_at.setdefault(owner, t)


def wait_for(check, timeout: float, what: str, interval: float = 0.05) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic()


class CountingStandIn:
    """tests/kuberay_standin.py's KubeRay with every request it makes counted (for subtraction)."""

    def __init__(self, cluster: Cluster, ns: str, harness: Counter):
        from tests.kuberay_standin import KubeRay

        outer = self

        class Counted(KubeRay):
            def _status(self, plural, name, status):
                outer.count("PATCH", plural, "status")
                super()._status(plural, name, status)

            def get(self, plural, name):
                outer.count("GET", plural, "")
                return super().get(plural, name)

        self.kr = Counted(cluster.api, ns)
        self.harness, self.lock = harness, threading.Lock()

    def count(self, verb: str, resource: str, sub: str) -> None:
        with self.lock:
            self.harness[(verb, resource, sub)] += 1


def create_all(make, names: list[str]) -> tuple[dict[str, float], float, float]:
    """Create every object from CREATORS threads; returns ({name: t_created_returned}, t_first, t_last)."""
    created: dict[str, float] = {}
    t0 = time.monotonic()

    def one(name):
        make(name)
        created[name] = time.monotonic()

    with cf.ThreadPoolExecutor(CREATORS) as pool:
        list(pool.map(one, names))
    return created, t0, max(created.values())


def latencies(start: dict[str, float], end: dict[str, float], names: list[str]) -> list[float]:
    return [(end[n] - start[n]) * 1000 for n in names if n in end and n in start]


def first_known(created: dict[str, float], added: dict[str, float]) -> dict[str, float]:
    """t0 per object: the earliest moment the harness knew it existed (its create call returned, or its
    watch saw it ADDED, whichever came first; under load either can lag)."""
    return {n: min(t, added.get(n, t)) for n, t in created.items()}


def summarize_ms(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": pct(xs, 50), "p95_ms": pct(xs, 95), "p99_ms": pct(xs, 99), "max_ms": max(xs) if xs else None}


def scrape_operator_metrics(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("tpuft_status_writes_total", "tpuft_reconcile_total", "tpuft_actions_total",
                            "tpuft_reconcile_seconds_count", "tpuft_reconcile_seconds_sum")):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def operator_argv(namespace: str) -> list[str]:
    """Our operator on `namespace`, through this interpreter: a clone's venv holds only the clone's own
    scripts, and kopf's `kopf` script is in the shared dependency venv (hack/venv.sh)."""
    return [sys.executable, "-m", "kopf", "run", "--standalone", "-m", "tpuft.controller.handlers", f"--namespace={namespace}"]


def run_ours(cl: Cluster, n: int, tag: str, idle_s: float, lifecycle: bool, workdir: Path) -> dict:
    ns = cl.namespace(f"ours-{n}-{tag}")
    port = free_port()
    env = dict(os.environ, KUBECONFIG=str(cl.cp.kubeconfig), TPUFT_METRICS_PORT=str(port), PYTHONUNBUFFERED="1")
    for k in ("TPUFT_RESYNC_SECONDS", "TPUFT_WORKERS"):
        env.pop(k, None)  # production defaults, unless --ours-env says otherwise
    env.update(OURS_ENV)
    argv = operator_argv(ns)
    if PROFILE:  # sampled stacks of every thread, idle included (RSS is then py-spy's, not the operator's)
        argv = [PROFILE, "record", "--idle", "--threads", "--format", "raw", "--rate", "50",
                "-o", str(workdir / f"ours-{n}-{tag}.pyspy.txt"), "--"] + argv
    op = Proc(argv, env, workdir / f"ours-{n}-{tag}.log")
    state = TftState()
    w1 = Watcher(cl, GROUP, VERSION, PLURAL, ns, state.on_tft)
    w2 = Watcher(cl, *RAY, "rayclusters", ns, state.on_cluster)
    result: dict = {"operator": "ours", "n": n, "namespace": ns}
    try:
        w1.start(), w2.start()
        w1.ready.wait(30), w2.ready.wait(30)
        cl.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, tft_body("warmup"))
        wait_for(lambda: "warmup" in state.provisioning_at, 120, "the warm-up object to reach Provisioning")
        time.sleep(1.0)
        harness: Counter = Counter()
        cpu0 = op.cpu_seconds()
        m0 = cl.requests()
        names = [f"tft-{i:04d}" for i in range(n)]
        created, t_first, t_last_create = create_all(
            lambda nm: cl.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, tft_body(nm)), names)
        harness[("POST", PLURAL, "")] += n
        t_done = wait_for(lambda: all(x in state.provisioning_at for x in names), 300, "all Provisioning")
        cpu1 = op.cpu_seconds()
        m1, settle_s = settle(cl)  # the follow-up reconciles (triggered by its own writes) land
        burst_reqs = diff(m1, m0, harness)
        created = first_known(created, state.added_at)
        result.update({
            "create_to_provisioning": summarize_ms(latencies(created, state.provisioning_at, names)),
            "create_to_raycluster": summarize_ms(latencies(created, state.cluster_at, names)),
            "creates_s": t_last_create - t_first, "burst_total_s": t_done - t_first,
            "requests_burst_per_object": by_kind(burst_reqs, n), "settle_s": settle_s,
            "cpu_burst_s": (cpu1 or 0) - (cpu0 or 0),
        })
        say(f"ours n={n}: p50={result['create_to_provisioning']['p50_ms']:.0f}ms "
            f"p99={result['create_to_provisioning']['p99_ms']:.0f}ms total={result['burst_total_s']:.2f}s")
        if idle_s > 0:
            ma = cl.requests()
            time.sleep(idle_s)
            mb = cl.requests()
            idle = diff(mb, ma, Counter())
            result["idle_window_s"] = idle_s
            result["idle_requests_per_object_per_s"] = {
                f"{v} {r}{'/' + s if s else ''}": round(x / (n + 1) / idle_s, 4)
                for (v, r, s), x in idle.items() if r not in ("leases", "") and v not in ("WATCH",)}
        if lifecycle:
            kr = CountingStandIn(cl, ns, harness)
            stages = {}
            t = time.monotonic()

            def drive(fn, names_):
                with cf.ThreadPoolExecutor(4) as pool:
                    list(pool.map(fn, names_))

            drive(lambda nm: kr.kr.cluster_ready(f"{nm}-ray"), names)
            wait_for(lambda: all(state.phase.get(x) == "VerifyingCollectives" for x in names), 300, "Verifying")
            stages["to_verifying_s"] = time.monotonic() - t
            t = time.monotonic()

            def verify(nm):
                kr.kr.job_running(f"{nm}-verify")
                kr.kr.job_succeeded(f"{nm}-verify")
            drive(verify, names)
            wait_for(lambda: all(state.phase.get(x) == "Training" for x in names), 300, "Training")
            stages["to_training_s"] = time.monotonic() - t
            t = time.monotonic()
            drive(lambda nm: kr.kr.job_running(f"{nm}-train"), names)
            # A running job changes nothing the operator writes (one status write per phase
            # change), so there is no signal to wait for: give the event-driven reconciles and
            # one resync (TPUFT_RESYNC_SECONDS, 5 s) time to see RUNNING before it succeeds.
            time.sleep(6.0)
            drive(lambda nm: kr.kr.job_succeeded(f"{nm}-train"), names)
            wait_for(lambda: all(state.phase.get(x) == "Succeeded" for x in names), 300, "Succeeded")
            stages["to_succeeded_s"] = time.monotonic() - t
            time.sleep(2.0)
            m2 = cl.requests()
            life = diff(m2, m0, harness)
            # status writes as the watch saw them (a no-op patch makes no event; /metrics counts it)
            writes, trans, same = [], [], 0
            for x in names:
                versions, phases_ = state.status_versions[x], state.phases_seen[x]
                writes.append(len(versions))
                trans.append(len(phases_))
                same += sum(1 for a, b in zip(versions, versions[1:]) if a.get("phase") == b.get("phase"))
            status_patches = life.get(("PATCH", PLURAL, "status"), 0)
            result.update({
                "lifecycle_stages_s": stages,
                "lifecycle_wall_s": sum(stages.values()),
                "requests_lifecycle_per_object": by_kind(life, n),
                "phases_per_object": statistics.median(trans),
                "phase_sequence_example": state.phases_seen[names[0]],
                "status_versions_seen_per_object": {"median": statistics.median(writes), "max": max(writes)},
                "status_patches_per_object": round(status_patches / n, 3),
                "status_patches_per_phase_change": round(status_patches / max(sum(trans), 1), 3),
                "same_phase_status_changes_per_object": round(same / n, 3),
            })
            result["same_phase_change_example"] = same_phase_example(state.status_versions[names[0]])
        result["operator_metrics"] = scrape_operator_metrics(port)
        result["cpu_s"] = (op.cpu_seconds() or 0) - (cpu0 or 0)
    finally:
        result["peak_rss_mb"] = (op.status_kb("VmHWM") or 0) / 1024
        result["rss_end_mb"] = (op.status_kb("VmRSS") or 0) / 1024
        result["alive_at_end"] = op.alive()
        op.stop()
        w1.stop(), w2.stop()
    return result


def same_phase_example(versions: list[dict]) -> list[dict]:
    """The keys that changed in status writes that kept the phase (what made them necessary)."""
    out = []
    for a, b in zip(versions, versions[1:]):
        if a.get("phase") == b.get("phase"):
            changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            out.append({"phase": b.get("phase"), "changed": changed,
                        "message": [a.get("message"), b.get("message")] if "message" in changed else None})
    return out


# --- the peer: KubeRay's operator ------------------------------------------------------------------
def peer_binary() -> Path:
    return Path(toolchain.cached_path("kuberay-operator"))


def build_peer() -> Path:
    """The same KubeRay build `tpuft cluster up` runs (hack/kuberay's module, cached by version)."""
    return Path(toolchain.tool_path("kuberay-operator"))


def rayjob_body(name: str) -> dict:
    image = "rayproject/ray:2.52.0"
    res = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name},
            "spec": {"entrypoint": "python -c 'print(1)'", "shutdownAfterJobFinishes": False,
                     "rayClusterSpec": {
                         "rayVersion": "2.52.0",
                         "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
                             {"name": "ray-head", "image": image, "resources": res}]}}},
                         "workerGroupSpecs": [{"groupName": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                               "rayStartParams": {}, "template": {"spec": {"containers": [
                                                   {"name": "ray-worker", "image": image, "resources": res}]}}}]}}}


def peer_args(ns: str, metrics_port: int, probe_port: int) -> list[str]:
    return [str(peer_binary()), f"--watch-namespace={ns}", "--enable-leader-election=false",
            f"--metrics-addr=127.0.0.1:{metrics_port}", f"--health-probe-bind-address=127.0.0.1:{probe_port}"]


def run_peer(cl: Cluster, n: int, tag: str, workdir: Path) -> dict:
    ns = cl.namespace(f"peer-{n}-{tag}")
    env = dict(os.environ, KUBECONFIG=str(cl.cp.kubeconfig))
    op = Proc(peer_args(ns, free_port(), free_port()) + [f"--kubeconfig={cl.cp.kubeconfig}"], env,
              workdir / f"peer-{n}-{tag}.log")
    cluster_at: dict[str, float] = {}
    added_at: dict[str, float] = {}
    lock = threading.Lock()

    def on_job(etype, obj, t):
        with lock:
            added_at.setdefault(obj["metadata"]["name"], t)

    def on_cluster(etype, obj, t):
        owners = [r.get("name") for r in obj["metadata"].get("ownerReferences") or [] if r.get("kind") == "RayJob"]
        if owners and etype == "ADDED":
            with lock:
                cluster_at.setdefault(owners[0], t)

    w = Watcher(cl, *RAY, "rayclusters", ns, on_cluster)
    wj = Watcher(cl, *RAY, "rayjobs", ns, on_job)
    result: dict = {"operator": f"kuberay-{PEER_VERSION}", "n": n, "namespace": ns}
    try:
        w.start(), wj.start()
        w.ready.wait(30), wj.ready.wait(30)
        cl.custom.create_namespaced_custom_object(*RAY, ns, "rayjobs", rayjob_body("warmup"))
        wait_for(lambda: "warmup" in cluster_at, 120, "the warm-up RayJob's RayCluster")
        time.sleep(2.0)
        harness: Counter = Counter()
        cpu0 = op.cpu_seconds()
        m0 = cl.requests()
        names = [f"rj-{i:04d}" for i in range(n)]
        created, t_first, t_last_create = create_all(
            lambda nm: cl.custom.create_namespaced_custom_object(*RAY, ns, "rayjobs", rayjob_body(nm)), names)
        harness[("POST", "rayjobs", "")] += n
        t_done = wait_for(lambda: all(x in cluster_at for x in names), 300, "all RayClusters")
        cpu1 = op.cpu_seconds()
        m1, settle_s = settle(cl)  # until it stops writing: pods, services, statuses of the new clusters
        created = first_known(created, added_at)
        result.update({
            "create_to_raycluster": summarize_ms(latencies(created, cluster_at, names)),
            "creates_s": t_last_create - t_first, "burst_total_s": t_done - t_first,
            "requests_burst_per_object": by_kind(diff(m1, m0, harness), n), "settle_s": settle_s,
            "cpu_burst_s": (cpu1 or 0) - (cpu0 or 0), "cpu_s": (op.cpu_seconds() or 0) - (cpu0 or 0),
        })
        say(f"peer n={n}: p50={result['create_to_raycluster']['p50_ms']:.0f}ms "
            f"p99={result['create_to_raycluster']['p99_ms']:.0f}ms total={result['burst_total_s']:.2f}s")
    finally:
        result["peak_rss_mb"] = (op.status_kb("VmHWM") or 0) / 1024
        result["alive_at_end"] = op.alive()
        op.stop()
        w.stop(), wj.stop()
        drop_finalizers(cl, ns)
    return result


def drop_finalizers(cl: Cluster, ns: str) -> None:
    """KubeRay puts a finalizer on RayJobs; with its operator stopped the namespace could never go."""
    todo = [(plural, o["metadata"]["name"]) for plural in ("rayjobs", "rayclusters")
            for o in cl.custom.list_namespaced_custom_object(*RAY, ns, plural)["items"] if o["metadata"].get("finalizers")]
    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda pn: cl.custom.patch_namespaced_custom_object(
            *RAY, ns, pn[0], pn[1], {"metadata": {"finalizers": None}}), todo))


def code_state() -> dict:
    """Which operator code a run measured: the working tree is shared and may hold uncommitted edits."""
    import hashlib

    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    files = ["operator/tpuft/controller/handlers.py", "operator/tpuft/controller/reconciler.py", "operator/tpuft/controller/workqueue.py",
             "operator/tpuft/controller/kube.py", "operator/tpuft/controller/phases/"]
    return {"head": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "operator/tpuft").splitlines(),
            "sha256": {f: hashlib.sha256((REPO / f).read_bytes()).hexdigest()[:12] for f in files}}


# --- report -------------------------------------------------------------------------------------
def fmt(v, digits=0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def aggregate(runs: list[dict]) -> dict:
    """Medians over repetitions, per (operator, n)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["operator"], r["n"])].append(r)
    out = {}
    for (opname, n), rs in sorted(groups.items()):
        key = "create_to_provisioning" if opname == "ours" else "create_to_raycluster"
        a = {"runs": len(rs)}
        for q in ("p50_ms", "p95_ms", "p99_ms", "max_ms"):
            a[q] = med([r[key][q] for r in rs])
            a["raycluster_" + q] = med([r["create_to_raycluster"][q] for r in rs])
        a["burst_total_s"] = med([r["burst_total_s"] for r in rs])
        a["creates_s"] = med([r["creates_s"] for r in rs])
        a["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rs)
        a["cpu_burst_s"] = med([r.get("cpu_burst_s") for r in rs])
        a["writes_burst_per_object"] = med([r["requests_burst_per_object"]["writes.total"] for r in rs])
        a["reads_burst_per_object"] = med([r["requests_burst_per_object"]["reads.total"] for r in rs])
        out[f"{opname}@{n}"] = a
    return out


def table(runs: list[dict], agg: dict, meta: dict) -> str:
    code = meta.get("code") or {}
    lines = [f"operator_burst  {meta['started']}  machine: {meta['machine']}",
             f"command: {meta['command']}",
             f"operator code: HEAD {code.get('head')}, uncommitted in operator/tpuft: {code.get('uncommitted') or 'none'}",
             f"peer: {meta.get('peer')}; our operator's environment: {meta.get('ours_env')}", ""]
    lines.append("Per-object latency, t0 (create returned or ADDED seen, the earlier) -> ours: phase Provisioning with children created; "
                 "peer: its RayCluster created (medians over runs)")
    hdr = f"{'operator':<18}{'N':>5}{'runs':>5}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}{'burst s':>9}" \
          f"{'create s':>9}{'->RC p99':>10}{'RSS MB':>8}{'cpu s':>7}{'W/obj':>7}{'R/obj':>7}"
    lines.append(hdr)
    for key, a in agg.items():
        opname, n = key.split("@")
        lines.append(f"{opname:<18}{n:>5}{a['runs']:>5}{fmt(a['p50_ms']):>9}{fmt(a['p95_ms']):>9}{fmt(a['p99_ms']):>9}"
                     f"{fmt(a['max_ms']):>9}{fmt(a['burst_total_s'], 2):>9}{fmt(a['creates_s'], 2):>9}"
                     f"{fmt(a['raycluster_p99_ms']):>10}{fmt(a['peak_rss_mb'], 0):>8}{fmt(a['cpu_burst_s'], 1):>7}{fmt(a['writes_burst_per_object'], 2):>7}"
                     f"{fmt(a['reads_burst_per_object'], 2):>7}")
    lines.append("(burst s: first create -> last object done; create s: the harness's own 8 threads creating the N "
                 "objects; ->RC p99: t0 -> RayCluster ADDED; cpu s: operator CPU during the burst; W/obj, R/obj: API "
                 "writes/reads per object from the burst until the API server saw no write for 2 s, from "
                 "apiserver_request_total; the peer's include its RayCluster controller's pods/services/status)")
    ratios = meta.get("ratios") or {}
    if ratios:
        lines.append("")
        lines.append("ours/peer ratios (same N; median of per-run-pair ratios, each pair measured back to back)")
        for n, r in ratios.items():
            lines.append(f"  N={n}: p50 {fmt(r['p50'], 2)}  p99 {fmt(r['p99'], 2)}  burst total {fmt(r['total'], 2)}  "
                         f"(to RayCluster only: p99 {fmt(r['rc_p99'], 2)})  peak RSS {fmt(r['rss'], 2)}")
    life = [r for r in runs if r["operator"] == "ours" and "requests_lifecycle_per_object" in r]
    if life:
        lines.append("")
        lines.append("Ours, full lifecycle (create -> Succeeded, stand-in writes KubeRay status), API requests per object")
        lines.append(f"{'N':>5}{'children':>10}{'status':>8}{'events':>8}{'other':>7}{'reads':>7}{'phases':>8}"
                     f"{'st/phase':>10}{'same-phase st':>15}{'life s':>8}")
        for r in life:
            k = r["requests_lifecycle_per_object"]
            lines.append(f"{r['n']:>5}{fmt(k.get('writes.children', 0), 2):>10}{fmt(k.get('writes.status', 0), 2):>8}"
                         f"{fmt(k.get('writes.events', 0), 2):>8}{fmt(k.get('writes.other', 0), 2):>7}"
                         f"{fmt(k['reads.total'], 2):>7}{fmt(r['phases_per_object'], 0):>8}"
                         f"{fmt(r['status_patches_per_phase_change'], 2):>10}"
                         f"{fmt(r['same_phase_status_changes_per_object'], 2):>15}{fmt(r['lifecycle_wall_s'], 1):>8}")
        lines.append("(status = PATCH tpufinetunes/status; phases = phase values entered per object; st/phase = status "
                     "patches / phase changes, target <= 1; same-phase st = status changes the watch saw that kept the "
                     "phase)")
        idle = [r for r in runs if r["operator"] == "ours" and r.get("idle_requests_per_object_per_s")]
        if idle or any("idle_requests_per_object_per_s" in r for r in runs):
            lines.append("")
            lines.append("Ours, idle (every object waiting in Provisioning): requests per object per second")
            for r in runs:
                if r["operator"] == "ours" and "idle_requests_per_object_per_s" in r:
                    lines.append(f"  N={r['n']} ({r['idle_window_s']:g} s): {r['idle_requests_per_object_per_s'] or 'none'}")
    targets = meta.get("targets") or {}
    if targets:
        lines.append("")
        lines.append("Targets")
        for k, v in targets.items():
            lines.append(f"  {k}: {v}")
    return "\n".join(lines)


def evaluate(agg: dict, runs: list[dict]) -> tuple[dict, dict]:
    ratios, targets = {}, {}
    pairs = defaultdict(list)
    for r in runs:
        pairs[(r["n"], r["rep"])].append(r)
    by_n = defaultdict(list)
    for (n, rep), rs in pairs.items():
        ours = next((x for x in rs if x["operator"] == "ours"), None)
        peer = next((x for x in rs if x["operator"] != "ours"), None)
        if ours and peer:
            p, o = peer["create_to_raycluster"], ours["create_to_provisioning"]
            by_n[n].append({"p50": o["p50_ms"] / p["p50_ms"], "p99": o["p99_ms"] / p["p99_ms"],
                            "total": ours["burst_total_s"] / peer["burst_total_s"],
                            "rc_p99": ours["create_to_raycluster"]["p99_ms"] / p["p99_ms"],
                            "rss": ours["peak_rss_mb"] / peer["peak_rss_mb"] if peer["peak_rss_mb"] else None})
    for n, xs in sorted(by_n.items()):
        ratios[str(n)] = {k: med([x[k] for x in xs]) for k in xs[0]}
    o100, p100, o500 = agg.get("ours@100"), next((v for k, v in agg.items() if k.endswith("@100") and
                                                   not k.startswith("ours")), None), agg.get("ours@500")
    if o100:
        ok = o100["p99_ms"] < 250
        targets["p99 < 250 ms at N=100"] = f"{'MET' if ok else 'NOT MET'} (median p99 {o100['p99_ms']:.0f} ms)"
        if p100:
            ok = o100["p99_ms"] <= p100["p99_ms"]
            targets["p99 at N=100 no slower than the peer"] = (
                f"{'MET' if ok else 'NOT MET'} (ours {o100['p99_ms']:.0f} ms vs peer {p100['p99_ms']:.0f} ms)")
    if o500:
        targets["500-burst done in < 60 s"] = (f"{'MET' if o500['burst_total_s'] < 60 else 'NOT MET'} "
                                               f"({o500['burst_total_s']:.1f} s)")
        targets["peak RSS < 200 MB with 500 objects"] = (f"{'MET' if o500['peak_rss_mb'] < 200 else 'NOT MET'} "
                                                         f"({o500['peak_rss_mb']:.0f} MB)")
    life = [r for r in runs if r["operator"] == "ours" and "status_patches_per_phase_change" in r]
    if life:
        worst = max(r["status_patches_per_phase_change"] for r in life)
        targets["<= 1 status write per phase change"] = f"{'MET' if worst <= 1.0 else 'NOT MET'} (worst run {worst:.2f})"
    return ratios, targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="1:3,100:3,500:1", help="N:repetitions,... (default %(default)s)")
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--peer-only", action="store_true")
    ap.add_argument("--build-peer", action="store_true", help="build/cache KubeRay's operator and exit")
    ap.add_argument("--idle", type=float, default=10.0, help="idle window after the burst, seconds")
    ap.add_argument("--no-lifecycle", action="store_true")
    ap.add_argument("--ours-env", action="append", default=[], metavar="K=V",
                    help="environment for our operator (e.g. TPUFT_WORKERS=16); default: production defaults")
    ap.add_argument("--out", type=Path, default=RESULTS / "operator_burst.json")
    args = ap.parse_args()
    if args.build_peer:
        print(build_peer())
        return 0
    OURS_ENV.update(dict(x.split("=", 1) for x in args.ours_env))
    plan = [(int(n), int(r)) for n, r in (x.split(":") for x in args.runs.split(","))]
    if not args.ours_only:
        build_peer()
    code_at_start = code_state()
    state = Path(tempfile.mkdtemp(prefix="tpuft-bench-burst-"))
    cl = Cluster(state / "cp").start()
    runs: list[dict] = []
    t_start = time.monotonic()
    try:
        for n, reps in plan:
            for rep in range(reps):
                tag = f"r{rep}"
                order = ["ours", "peer"] if rep % 2 == 0 else ["peer", "ours"]
                for who in order:
                    if (who == "ours" and args.peer_only) or (who == "peer" and args.ours_only):
                        continue
                    if who == "ours":
                        r = run_ours(cl, n, tag, args.idle if rep == 0 else 0, not args.no_lifecycle and rep == 0, state)
                    else:
                        r = run_peer(cl, n, tag, state)
                    r["rep"] = rep
                    runs.append(r)
                    cl.delete_namespace(r["namespace"])
    finally:
        cl.stop()
    agg = aggregate(runs)
    ratios, targets = evaluate(agg, runs)
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(["python"] + sys.argv),
            "machine": f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f} at end (shared)",
            "peer": f"{PEER_MODULE} {PEER_VERSION} (v1.7.0 not served by the Go module proxy)",
            "ours_env": OURS_ENV or "production defaults",
            "wall_s": time.monotonic() - t_start, "ratios": ratios, "targets": targets, "code": code_at_start}
    text = table(runs, agg, meta)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": agg, "runs": runs}, indent=1, default=str) + "\n")
    args.out.with_suffix(".txt").write_text(text + "\n")
    say(f"wrote {args.out} and {args.out.with_suffix('.txt')}; state (logs) in {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
