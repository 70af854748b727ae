"""The operator under faults: SIGKILLs and a misbehaving API server, each promise checked with a count.

Summary (seed 9, TPUFT_CHAOS_SEED overrides; 2:00-3:10 for the module on 2 noisy cores incl. the
25-40 s control plane start; the proxy test is 40 s unless a key backs off the full 60 s):
  test_sigkill_chaos      20 concurrent lifecycles (6 Succeeded, 2 Succeeded with
                          ttlSecondsAfterFinished 1 so the RayCluster is deleted, 4 Failed/
                          VerificationFailed, 4 Failed/ProvisioningTimeout, 4 Succeeded after 1
                          training retry via spec.training.maxJobRetries) while the operator (a real `kopf run`
                          subprocess) is SIGKILLed 5 times and restarted. Each kill comes at a seeded
                          random moment 0-2.5 s after that run's first status write; >= 3 of the 5
                          must land in a run that wrote status while lifecycles were unfinished.
                          Typical: ~75 phase changes watched, ~10 children created by a killed run
                          and adopted by the next.
  test_api_fault_proxy    10 lifecycles (3/1/2/2/2 of the same kinds), the operator talking to the
                          API server through tests/faultproxy.py, which injects on a seeded schedule
                          500s (before forwarding, and after: write applied, response lost), 429s
                          with Retry-After, 409s on writes, dropped watch streams and slow responses;
                          each type must fire >= MIN_EACH_FAULT (2) times. Typical per run: ~350
                          proxied requests, ~15 500s, ~15 429s, ~16 409s, ~30 drops, ~20 slow.
  test_watch_expired_relist_deleted_objects_left_alone
                          every RayCluster/TPUFinetune watch held 3 s then answered 410 Expired
                          (>= 3 injected), so kopf only re-lists and its indexes keep deleted
                          objects: 3 TTL lifecycles -> exactly 3 DELETEs and 3 TTLExpired Events;
                          1 TPUFinetune deleted while Provisioning -> <= 1 RayCluster recreate and
                          <= 3 status writes, no RayCluster left (bugs 2 and 3).
  test_lost_status_write_response_never_regresses
                          the bug the proxy found (Provisioning -> Pending after a lost 500),
                          pinned deterministically with the unit tests' fake API.

End checks, both lifecycle tests: every TPUFinetune in its expected terminal phase with its
expected reason (and trainingAttempts); exactly the expected children per object (RayCluster,
RayJobs, workload ServiceAccount/Role/RoleBinding: 110 for 20 objects, 55 for 10), each with a
single controller ownerReference to its TPUFinetune, and no other RayCluster/RayJob/Role/
RoleBinding in the namespace; no status regression (a watch records every (phase, reason) each
object shows: the sequence never goes backwards in Pending < Provisioning < VerifyingCollectives
< Training < Succeeded|Failed, and a terminal phase/reason never changes); the same after 3 more
seconds of resyncs (a TTL-deleted RayCluster stays deleted); no transition or TTLExpired Event
posted twice; the operator never logged a crashed
reconcile (a bug, not an API error). Each test prints a COUNTS line.

KubeRay's part is played by a background thread ("Player") writing RayCluster/RayJob status
through tests/kuberay_standin.py, with seeded random delays, whether the operator runs or not.
"""
from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client, config, watch

from tests.faultproxy import TYPES, FaultPlan, FaultProxy
from tests.kuberay_standin import KubeRay

GROUP, VERSION, PLURAL = "tpufinetune.dev", "v1alpha1", "tpufinetunes"
LABEL = "tpufinetune.dev/name"
ORDER = {None: -1, "Pending": 0, "Provisioning": 1, "VerifyingCollectives": 2, "Training": 3,
         "Succeeded": 4, "Failed": 4}
TERMINAL = ("Succeeded", "Failed")

# script -> (expected phase, reason, RayJob name suffixes, trainingAttempts or None)
SCRIPTS = {
    "ok": ("Succeeded", "TrainingComplete", ("verify", "train"), 1),
    "ttl": ("Succeeded", "TrainingComplete", ("verify", "train"), 1),   # ttlSecondsAfterFinished 1: cluster goes
    "verifyfail": ("Failed", "VerificationFailed", ("verify",), 0),
    "timeout": ("Failed", "ProvisioningTimeout", (), 0),
    "retry": ("Succeeded", "TrainingComplete", ("verify", "train", "train-r1"), 2),
}
PROVISIONING_TIMEOUT = 15  # s, for the "timeout" script (the CRD's minimum is 5)
IDENTITY_KINDS = ("serviceaccounts", "roles", "rolebindings")
TRANSITION_REASONS = ("WaitingForSlice", "Verifying", "Training", "TrainingComplete", "VerificationFailed",
                      "ProvisioningTimeout", "Retrying", "TTLExpired")


# --- the operator as a real subprocess ------------------------------------------------------------
def _pdeathsig() -> None:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class OperatorProcess:
    """`kopf run --standalone -m tpuft.handlers --namespace=NS`; output appended to `log`."""

    def __init__(self, kubeconfig: str | Path, namespace: str, log: Path, *kopf_args: str, **env: str):
        self.log, self.namespace, self.kopf_args = log, namespace, kopf_args
        self.env = dict(os.environ, KUBECONFIG=str(kubeconfig), TPUFT_RESYNC_SECONDS="1", TPUFT_METRICS_PORT="0",
                        TPUFT_VERIFY_GRACE_SECONDS="5", PYTHONUNBUFFERED="1", **env)
        self.proc: subprocess.Popen | None = None
        self.starts = self.kills = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as fh:
            fh.write(f"\n==== start {self.starts + 1} at {time.time():.3f}\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", "--standalone", f"--namespace={self.namespace}",
                 *self.kopf_args, "-m", "tpuft.handlers"], env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_pdeathsig)
        self.starts += 1

    def sigkill(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, f"operator exited by itself:\n{self.tail()}"
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.kills += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def since_start(self) -> str:
        with open(self.log, "rb") as fh:
            fh.seek(self.offset)
            return fh.read().decode(errors="replace")

    def wait_working(self, timeout: float = 90) -> float:
        """Until this run wrote its first status (it is reconciling); returns seconds waited."""
        began = time.monotonic()
        while "reconciled tft=" not in self.since_start():
            assert self.alive(), f"operator exited:\n{self.tail()}"
            assert time.monotonic() - began < timeout, f"operator not started after {timeout}s:\n{self.tail()}"
            time.sleep(0.1)
        return time.monotonic() - began

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-n:])


# --- KubeRay's part ----------------------------------------------------------------------------------
CLUSTER_STEPS = {"ok": ("provisioning", "ready"), "timeout": ("provisioning",)}
JOB_STEPS = {"verify-ok": ("initializing", "running", "succeeded"),
             "verify-fail": ("initializing", "running", "failed"),
             "train-ok": ("running", "succeeded"), "train-fail": ("running", "failed")}


class Player(threading.Thread):
    """Advances each child of a scripted TPUFinetune one KubeRay status step at a time, with
    seeded random pauses (0.2-1.2 s) between steps, whether the operator is running or not."""

    def __init__(self, kubeconfig: str, namespace: str, scripts: dict[str, str], seed: int):
        super().__init__(name="kuberay-player", daemon=True)
        self.api_client = config.new_client_from_config(config_file=kubeconfig)
        self.kuberay = KubeRay(self.api_client, namespace)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.ns, self.scripts, self.rng = namespace, scripts, random.Random(seed)
        self.state: dict[str, list] = {}     # uid -> [next step index, not before]
        self.writes = 0
        self.errors: list[str] = []
        self.halt = threading.Event()

    def _steps(self, plural: str, item: dict) -> tuple[str, ...]:
        meta = item["metadata"]
        script = self.scripts.get(meta["labels"].get(LABEL, ""))
        if script is None:
            return ()
        if plural == "rayclusters":
            return CLUSTER_STEPS["timeout" if script == "timeout" else "ok"]
        component = meta["labels"].get("tpufinetune.dev/component")
        if component == "verify":
            return JOB_STEPS["verify-fail" if script == "verifyfail" else "verify-ok"]
        first_attempt = not meta["name"].endswith("-r1")
        return JOB_STEPS["train-fail" if script == "retry" and first_attempt else "train-ok"]

    def _apply(self, plural: str, name: str, step: str) -> None:
        k = self.kuberay
        {"provisioning": lambda: k.cluster_provisioning(name, ready_workers=1),
         "ready": lambda: k.cluster_ready(name),
         "initializing": lambda: k.job_initializing(name),
         "running": lambda: k.job_running(name),
         "succeeded": lambda: k.job_succeeded(name),
         "failed": lambda: k.job_failed(name, "all_reduce sum 120 != expected 136" if "verify" in name
                                        else "preempted: host lost")}[step]()

    def tick(self) -> None:
        now = time.monotonic()
        for plural in ("rayclusters", "rayjobs"):
            for item in self.custom.list_namespaced_custom_object("ray.io", "v1", self.ns, plural)["items"]:
                uid, steps = item["metadata"]["uid"], self._steps(plural, item)
                st = self.state.setdefault(uid, [0, now + self.rng.uniform(0.2, 1.2)])
                if st[0] < len(steps) and now >= st[1]:
                    try:
                        self._apply(plural, item["metadata"]["name"], steps[st[0]])
                    except client.ApiException as e:
                        if e.status != 404:
                            raise
                        continue
                    self.writes += 1
                    st[0], st[1] = st[0] + 1, now + self.rng.uniform(0.2, 1.2)

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))
            self.halt.wait(0.25)
        self.api_client.close()


# --- what the world saw -----------------------------------------------------------------------------
class PhaseRecorder(threading.Thread):
    """Watches the namespace's TPUFinetunes (directly, never through a fault proxy) and records
    every (phase, reason) each object shows, in order."""

    def __init__(self, kubeconfig: str, namespace: str):
        super().__init__(name="phase-recorder", daemon=True)
        self.api_client = config.new_client_from_config(config_file=kubeconfig)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.ns = namespace
        self.seen: dict[str, list[tuple[str | None, str | None]]] = collections.defaultdict(list)
        self.latest: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.relists = 0

    def _record(self, obj: dict) -> None:
        name, st = obj["metadata"]["name"], obj.get("status") or {}
        entry = (st.get("phase"), st.get("reason"))
        with self.lock:
            self.latest[name] = st
            if not self.seen[name] or self.seen[name][-1] != entry:
                self.seen[name].append(entry)

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                listing = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)
                self.relists += 1
                for obj in listing["items"]:
                    self._record(obj)
                w = watch.Watch()
                for ev in w.stream(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.ns, PLURAL,
                                   resource_version=listing["metadata"]["resourceVersion"], timeout_seconds=5):
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._record(ev["object"])
                    if self.halt.is_set():
                        w.stop()
            except Exception:  # noqa: BLE001 - relist
                self.halt.wait(0.2)
        self.api_client.close()

    def phases(self) -> dict[str, str | None]:
        with self.lock:
            return {k: v.get("phase") for k, v in self.latest.items()}

    def regressions(self) -> list[str]:
        out = []
        with self.lock:
            for name, seq in self.seen.items():
                for (p1, r1), (p2, r2) in zip(seq, seq[1:]):
                    if p1 in TERMINAL and (p2, r2) != (p1, r1):
                        out.append(f"{name}: terminal {p1}/{r1} changed to {p2}/{r2} ({seq})")
                    elif ORDER.get(p2, -2) < ORDER.get(p1, -2):
                        out.append(f"{name}: {p1} -> {p2} goes backwards ({seq})")
        return out


# --- the scenario -------------------------------------------------------------------------------------
def tft_body(namespace: str, name: str, script: str) -> dict:
    spec = {"accelerator": "v6e", "topology": "4x4", "image": "img:1", "model": "m", "dataset": {"name": "d"},
            "checkpoint": {"storagePath": "gs://bucket/ck"}, "ttlSecondsAfterFinished": 3600}
    if script == "ttl":
        spec["ttlSecondsAfterFinished"] = 1
    if script == "timeout":
        spec["provisioningTimeoutSeconds"] = PROVISIONING_TIMEOUT
    if script == "retry":
        spec["training"] = {"maxJobRetries": 1}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFinetune",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def make_scripts(mix: dict[str, int]) -> dict[str, str]:
    return {f"{script}-{i}": script for script, n in mix.items() for i in range(n)}


def create_staggered(custom: client.CustomObjectsApi, namespace: str, scripts: dict[str, str],
                     rng: random.Random, spread: float) -> threading.Thread:
    names = list(scripts)
    rng.shuffle(names)
    gaps = [rng.uniform(0, 2 * spread / max(len(names), 1)) for _ in names]

    def run() -> None:
        for name, gap in zip(names, gaps):
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                   tft_body(namespace, name, scripts[name]))
            time.sleep(gap)

    t = threading.Thread(target=run, name="creator", daemon=True)
    t.start()
    return t


def wait_all_terminal(recorder: PhaseRecorder, scripts: dict[str, str], timeout: float, op: OperatorProcess) -> None:
    deadline = time.monotonic() + timeout
    while True:
        phases = recorder.phases()
        left = {n: phases.get(n) for n in scripts if phases.get(n) not in TERMINAL}
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not terminal after {timeout}s: {left}\noperator log tail:\n{op.tail()}")
        time.sleep(0.5)


def check_end_state(kube_api, namespace: str, scripts: dict[str, str], recorder: PhaseRecorder,
                    op: OperatorProcess) -> dict[str, int]:
    """The shared end checks; returns counts."""
    custom, core = client.CustomObjectsApi(kube_api), client.CoreV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    objs = {o["metadata"]["name"]: o for o in
            custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]}
    assert sorted(objs) == sorted(scripts)
    wrong = []
    for name, script in scripts.items():
        phase, reason, _, attempts = SCRIPTS[script]
        st = objs[name].get("status") or {}
        if (st.get("phase"), st.get("reason")) != (phase, reason) or st.get("trainingAttempts") != attempts:
            wrong.append(f"{name} ({script}): {st.get('phase')}/{st.get('reason')} attempts={st.get('trainingAttempts')} "
                         f"want {phase}/{reason} attempts={attempts}: {st.get('message')}")
    assert not wrong, "\n".join(wrong)

    uids = {name: o["metadata"]["uid"] for name, o in objs.items()}
    children: dict[str, list[dict]] = {}
    for plural in ("rayclusters", "rayjobs"):
        children[plural] = custom.list_namespaced_custom_object("ray.io", "v1", namespace, plural)["items"]
    children["serviceaccounts"] = [core.api_client.sanitize_for_serialization(x) for x in
                                   core.list_namespaced_service_account(namespace, label_selector=LABEL).items]
    children["roles"] = [rbac.api_client.sanitize_for_serialization(x) for x in
                         rbac.list_namespaced_role(namespace).items]
    children["rolebindings"] = [rbac.api_client.sanitize_for_serialization(x) for x in
                                rbac.list_namespaced_role_binding(namespace).items]
    expected = {
        "rayclusters": sorted(f"{n}-ray" for n, s in scripts.items() if s != "ttl"),
        "rayjobs": sorted(f"{n}-{suffix}" for n, s in scripts.items() for suffix in SCRIPTS[s][2]),
        **{k: sorted(f"{n}-workload" for n in scripts) for k in IDENTITY_KINDS},
    }
    total = 0
    for plural, want in expected.items():
        got = sorted(x["metadata"]["name"] for x in children[plural])
        assert got == want, f"{plural}: extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}"
        for x in children[plural]:
            meta = x["metadata"]
            owner = meta.get("labels", {}).get(LABEL)
            refs = [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in meta.get("ownerReferences") or []]
            assert refs == [("TPUFinetune", owner, uids.get(owner), True)], f"{plural}/{meta['name']}: {refs}"
            total += 1
    regressions = recorder.regressions()
    assert not regressions, "\n".join(regressions)
    text = op.text()
    assert " crashed attempt=" not in text, op.tail(120)  # a reconcile raised something not an API error
    transitions = sum(len(seq) - 1 for seq in recorder.seen.values())
    # Events: one per transition at most (one may be lost when the operator dies between the status
    # write and the event post; never posted twice).
    events = collections.Counter(
        (e.involved_object.name, e.reason) for e in core.list_namespaced_event(namespace).items
        if e.reporting_component == "tpufinetune-operator" and e.reason in TRANSITION_REASONS)
    duplicated = {k: n for k, n in events.items() if n > 1}
    assert not duplicated, duplicated
    return {"lifecycles": len(scripts), "children": total, "phase_changes_observed": transitions,
            "transition_events": sum(events.values()), "children_adopted": text.count("=adopted"),
            "by_outcome": dict(collections.Counter(f"{SCRIPTS[s][0]}/{SCRIPTS[s][1]}" for s in scripts.values()))}


def settle_and_recheck(kube_api, namespace, scripts, recorder, op, seconds: float = 3.0) -> dict:
    """All terminal: once the TTL deletions are done, check everything twice, some resyncs apart."""
    custom, deadline = client.CustomObjectsApi(kube_api), time.monotonic() + 30
    want = sorted(f"{n}-ray" for n, s in scripts.items() if s != "ttl")
    while sorted(x["metadata"]["name"] for x in custom.list_namespaced_custom_object(
            "ray.io", "v1", namespace, "rayclusters")["items"]) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    first = check_end_state(kube_api, namespace, scripts, recorder, op)
    time.sleep(seconds)
    second = check_end_state(kube_api, namespace, scripts, recorder, op)
    assert first["children"] == second["children"]
    return second


# --- the tests -----------------------------------------------------------------------------------------
KILLS = 5


def test_sigkill_chaos(kubeconfig, kube_api, namespace, tmp_path):
    seed = int(os.environ.get("TPUFT_CHAOS_SEED", "9"))
    rng = random.Random(seed)
    scripts = make_scripts({"ok": 6, "ttl": 2, "verifyfail": 4, "timeout": 4, "retry": 4})
    op = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log")
    recorder = PhaseRecorder(kubeconfig, namespace)
    player = Player(kubeconfig, namespace, scripts, seed)
    recorder.start()
    player.start()
    began = time.monotonic()
    busy_at_kill, reconciles_before_kill, startup_s = [], [], []
    try:
        op.start()
        creator = create_staggered(client.CustomObjectsApi(kube_api), namespace, scripts, rng, spread=8.0)
        for _ in range(KILLS):
            startup_s.append(round(op.wait_working(), 1))
            time.sleep(rng.uniform(0.0, 2.5))   # a random moment while the reconciler is working
            phases = recorder.phases()
            busy_at_kill.append(sum(1 for n in scripts if phases.get(n) not in TERMINAL))
            op.sigkill()
            reconciles_before_kill.append(op.since_start().count("reconciled tft="))
            time.sleep(rng.uniform(0.2, 1.0))
            op.start()
        creator.join(30)
        wait_all_terminal(recorder, scripts, 150, op)
        counts = settle_and_recheck(kube_api, namespace, scripts, recorder, op)
    finally:
        player.halt.set()
        recorder.halt.set()
        op.stop()
    assert not player.errors, player.errors[:5]
    counts.update({"kills": op.kills, "operator_starts": op.starts, "nonterminal_objects_at_each_kill": busy_at_kill,
                   "status_writes_in_each_killed_run": reconciles_before_kill, "seconds_to_first_write": startup_s,
                   "kuberay_status_writes": player.writes, "seed": seed,
                   "wall_s": round(time.monotonic() - began, 1)})
    print("\nCOUNTS test_sigkill_chaos:", json.dumps(counts))
    assert op.kills == KILLS and op.starts == KILLS + 1
    assert counts["lifecycles"] == 20
    # The kills landed mid-lifecycle, in runs that were changing things.
    assert sum(1 for b, r in zip(busy_at_kill, reconciles_before_kill) if b > 0 and r > 0) >= 3, \
        (busy_at_kill, reconciles_before_kill)


MIN_EACH_FAULT = 2


def test_api_fault_proxy(kubeconfig, kube_api, namespace, tmp_path, control_plane):
    seed = int(os.environ.get("TPUFT_CHAOS_SEED", "9"))
    rng = random.Random(seed)
    scripts = make_scripts({"ok": 3, "ttl": 1, "verifyfail": 2, "timeout": 2, "retry": 2})
    proxy = FaultProxy(control_plane.server_url, control_plane.pki, seed=seed, plan=FaultPlan()).start()
    op = OperatorProcess(proxy.write_kubeconfig(tmp_path / "proxy.kubeconfig"), namespace, tmp_path / "operator.log")
    recorder = PhaseRecorder(kubeconfig, namespace)
    player = Player(kubeconfig, namespace, scripts, seed)
    began = time.monotonic()
    try:
        recorder.start()
        player.start()
        proxy.active.set()
        op.start()
        create_staggered(client.CustomObjectsApi(kube_api), namespace, scripts, rng, spread=5.0).join(30)
        wait_all_terminal(recorder, scripts, 240, op)  # a key can back off 60 s after 7 faults in a row
        proxy.active.clear()
        counts = settle_and_recheck(kube_api, namespace, scripts, recorder, op)
    finally:
        player.halt.set()
        recorder.halt.set()
        op.stop()
        proxy.stop()
    assert not player.errors, player.errors[:5]
    faults = {t: proxy.counts[t] for t in TYPES}
    counts.update({"proxied_requests": proxy.requests, "faults": faults,
                   "error500_split": {k: proxy.counts[k] for k in ("error500-before", "error500-after-write")},
                   "seed": seed, "wall_s": round(time.monotonic() - began, 1)})
    print("\nCOUNTS test_api_fault_proxy:", json.dumps(counts))
    assert counts["lifecycles"] == 10
    for t in TYPES:
        assert faults[t] >= MIN_EACH_FAULT, faults


# --- the bug the proxy found, pinned without a control plane ------------------------------------------------
def test_lost_status_write_response_never_regresses():
    """A status write that lands but whose response is lost (the proxy's 'error500-after-write'),
    then a reconcile from the still-lagging index whose create fails: the error note must not
    write phase Pending over the Provisioning the server already has (it did, before
    handlers.Controller re-read the object after a failed status write)."""
    from tests.unit.test_reconcile import NAME as UNAME, NS as UNS, FakeKube, controller, indexed, tft
    from tpuft.kube import KubeError

    class LostResponse(FakeKube):
        lose_next = True

        def patch_status(self, ns, name, patch):
            applied = super().patch_status(ns, name, patch)
            if self.lose_next:
                self.lose_next = False
                raise KubeError("patch status: HTTP 500: response lost after the write")
            return applied

    kube = LostResponse(tft())
    ctl = controller(kube)
    stale = indexed(kube)                      # the index: no status yet, and it stays that way below
    with pytest.raises(KubeError):
        ctl.reconcile((UNS, UNAME), stale, [], [])
    assert kube.objects[("TPUFinetune", UNAME)]["status"]["phase"] == "Provisioning"
    kube.fail[("RoleBinding", f"{UNAME}-workload")] = KubeError("create RoleBinding: HTTP 500")
    try:
        ctl.reconcile((UNS, UNAME), stale, [], [])
    except KubeError:
        pass
    assert kube.objects[("TPUFinetune", UNAME)]["status"]["phase"] == "Provisioning"
    assert ("get", "TPUFinetune", UNAME) in kube.log


def test_watch_expired_relist_deleted_objects_left_alone(kubeconfig, kube_api, namespace, tmp_path, control_plane):
    """Every RayCluster and TPUFinetune watch is held 3 s then answered 410 Expired, so kopf only
    ever re-lists and never sees a DELETED event: its indexes keep deleted objects forever.
      * 3 TTL lifecycles: the TTL-deleted RayCluster must not be taken as still there (it was:
        DELETE + a TTLExpired Event on every resync, 13 in 20 s);
      * 1 TPUFinetune deleted while Provisioning: the operator must not keep recreating its
        RayCluster against the garbage collector (it did: ~14 POSTs + status PATCHes a second)."""
    scripts = make_scripts({"ttl": 3})
    plan = FaultPlan(p_error500=0, p_throttle=0, p_conflict=0, p_drop=0, p_slow=0, p_gone=1.0,
                     gone_only="/rayclusters|/tpufinetunes", gone_hold=3.0)
    proxy = FaultProxy(control_plane.server_url, control_plane.pki, seed=1, plan=plan).start()
    op = OperatorProcess(proxy.write_kubeconfig(tmp_path / "proxy.kubeconfig"), namespace, tmp_path / "operator.log")
    recorder = PhaseRecorder(kubeconfig, namespace)
    player = Player(kubeconfig, namespace, scripts, seed=1)
    custom = client.CustomObjectsApi(kube_api)
    began = time.monotonic()
    try:
        recorder.start()
        player.start()
        proxy.active.set()
        op.start()
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, tft_body(namespace, "doomed", "ok"))
        deadline = time.monotonic() + 60
        while recorder.phases().get("doomed") != "Provisioning":
            assert time.monotonic() < deadline, op.tail()
            time.sleep(0.2)
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "doomed")
        create_staggered(custom, namespace, scripts, random.Random(1), 1.0).join(30)
        wait_all_terminal(recorder, scripts, 90, op)
        counts = settle_and_recheck(kube_api, namespace, scripts, recorder, op)  # 3 s: 3 resyncs
    finally:
        player.halt.set()
        recorder.halt.set()
        op.stop()
        proxy.stop()
    deletes = [p for m, p in proxy.seen if m == "DELETE" and "/rayclusters/" in p]
    creates = [p for m, p in proxy.seen if m == "POST" and p.split("?")[0].endswith("/rayclusters")]
    doomed_writes = [p for m, p in proxy.seen if m == "PATCH" and "/tpufinetunes/doomed/" in p]
    ttl_events = [e for e in client.CoreV1Api(kube_api).list_namespaced_event(namespace).items
                  if e.reason == "TTLExpired"]
    counts.update({"gone_410s": proxy.counts["gone"], "raycluster_deletes": len(deletes),
                   "raycluster_creates": len(creates), "doomed_status_writes": len(doomed_writes),
                   "ttl_events": len(ttl_events), "wall_s": round(time.monotonic() - began, 1)})
    print("\nCOUNTS test_watch_expired_relist_deleted_objects_left_alone:", json.dumps(counts))
    assert proxy.counts["gone"] >= 3
    assert len(deletes) == 3 and len(ttl_events) == 3, (deletes, [e.message for e in ttl_events])
    # 3 + doomed's first, + at most one recreate (and one status write) before the 404 says it is gone.
    assert len(creates) <= 5 and len(doomed_writes) <= 3, counts
