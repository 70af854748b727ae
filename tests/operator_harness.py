"""The operator as a real `kopf run` subprocess, KubeRay's part played by a thread, and a watch
recording every phase each TPUFinetune shows: shared by the fault and secrets tests
(tests/integration/test_operator_faults.py, test_secrets.py)."""
from __future__ import annotations

import collections
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

from tests.factories import small_spec
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


# --- the operator as a real subprocess ------------------------------------------------------------
def _pdeathsig() -> None:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class OperatorProcess:
    """`kopf run --standalone -m tpuft.controller.handlers --namespace=NS`; output appended to `log`."""

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
                 *self.kopf_args, "-m", "tpuft.controller.handlers"], env=self.env, stdout=fh, stderr=subprocess.STDOUT,
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
        self.messages: dict[str, list[str | None]] = collections.defaultdict(list)   # status.message, per entry of seen
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
                self.messages[name].append(st.get("message"))

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
                for i, ((p1, r1), (p2, r2)) in enumerate(zip(seq, seq[1:])):
                    said = self.messages[name][i + 1]   # the operator's own words on the later entry
                    if p1 in TERMINAL and (p2, r2) != (p1, r1):
                        out.append(f"{name}: terminal {p1}/{r1} changed to {p2}/{r2} ({seq}): {said}")
                    elif ORDER.get(p2, -2) < ORDER.get(p1, -2):
                        out.append(f"{name}: {p1} -> {p2} goes backwards ({seq}): {said}")
        return out


def tft_body(namespace: str, name: str, script: str) -> dict:
    spec = small_spec(ttlSecondsAfterFinished=3600)
    if script == "ttl":
        spec["ttlSecondsAfterFinished"] = 1
    if script == "timeout":
        spec["provisioningTimeoutSeconds"] = PROVISIONING_TIMEOUT
    if script == "retry":
        spec["training"] = {"maxJobRetries": 1}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFinetune",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


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
