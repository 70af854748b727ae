"""Failure detection: time from fault to phase Failed (with the right reason) against the configured timeouts.

    .venv/bin/python bench/failure_detection.py            # 5 repetitions each; writes bench/results/
    .venv/bin/python bench/failure_detection.py --reps 3 --no-anchor

On the real local control plane, with the operator as a subprocess (production defaults:
TPUFT_RESYNC_SECONDS=5, TPUFT_WORKERS=4, TPUFT_VERIFY_GRACE_SECONDS unset = 60):

  (a) provisioning  provisioningTimeoutSeconds: 10; nothing ever marks the RayCluster ready.
                    fault = the harness's watch sees phase Provisioning; expected reason ProvisioningTimeout.
  (b) verification  verification.timeoutSeconds: 10; the stand-in marks the RayCluster ready and the
                    verify RayJob RUNNING, and it stays RUNNING (nothing enforces its
                    activeDeadlineSeconds: KubeRay is not running there). fault = phase
                    VerifyingCollectives seen; expected reason CollectiveTimeout. The operator's own
                    backstop is timeoutSeconds + TPUFT_VERIFY_GRACE_SECONDS, so this runs twice: with
                    the default grace (60 s) and with TPUFT_VERIFY_GRACE_SECONDS=0.
  anchor            KubeRay's own operator (hack/kuberay/, built by tpuft_local.toolchain) with a RayJob
                    without deadlines whose RayCluster never becomes ready, created when (a) starts:
                    its jobDeploymentStatus is read when (a) ends and when (b) ends.

Repetitions are separate objects created 2 s apart under one operator per scenario. Overshoot =
(fault -> Failed seen) - the configured bound. phaseTransitionTime has 1 s resolution, so the
operator may fire up to 1 s before the harness-measured bound (a negative overshoot).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import operator_burst as ob  # noqa: E402  (sets TPUFT_KCM_CONTROLLERS before tpuft_local.controlplane is imported)

TIMEOUT = 10


class Seen:
    def __init__(self):
        self.lock = threading.Lock()
        self.at: dict[tuple[str, str], float] = {}     # (name, phase) -> first seen
        self.final: dict[str, dict] = {}

    def on_tft(self, etype, obj, t):
        st = obj.get("status") or {}
        name = obj["metadata"]["name"]
        with self.lock:
            if st.get("phase"):
                self.at.setdefault((name, st["phase"]), t)
            self.final[name] = st


def start_operator(cl: ob.Cluster, ns: str, log: Path, grace: str | None) -> ob.Proc:
    env = dict(os.environ, KUBECONFIG=str(cl.cp.kubeconfig), TPUFT_METRICS_PORT="0", PYTHONUNBUFFERED="1")
    for k in ("TPUFT_RESYNC_SECONDS", "TPUFT_WORKERS", "TPUFT_VERIFY_GRACE_SECONDS"):
        env.pop(k, None)
    if grace is not None:
        env["TPUFT_VERIFY_GRACE_SECONDS"] = grace
    return ob.Proc(ob.operator_argv(ns), env, log)


def scenario(cl: ob.Cluster, kind: str, reps: int, grace: str | None, workdir: Path, on_start=None) -> dict:
    ns = cl.namespace(f"fd-{kind}-{'default' if grace is None else 'g' + grace}")
    seen = Seen()
    w = ob.Watcher(cl, ob.GROUP, ob.VERSION, ob.PLURAL, ns, seen.on_tft)
    op = start_operator(cl, ns, workdir / f"{ns}.log", grace)
    w.start()
    w.ready.wait(30)
    kr = ob.CountingStandIn(cl, ns, ob.Counter()).kr
    grace_s = 60.0 if grace is None else float(grace)
    bound = TIMEOUT if kind == "provisioning" else TIMEOUT + grace_s
    fault_phase = "Provisioning" if kind == "provisioning" else "VerifyingCollectives"
    want = "ProvisioningTimeout" if kind == "provisioning" else "CollectiveTimeout"
    names = [f"{kind[:4]}-{i}" for i in range(reps)]
    t0 = time.monotonic()
    try:
        # the operator is up once a warm-up object reaches Provisioning
        cl.custom.create_namespaced_custom_object(ob.GROUP, ob.VERSION, ns, ob.PLURAL, ob.tft_body("warmup"))
        ob.wait_for(lambda: ("warmup", "Provisioning") in seen.at, 120, "warm-up Provisioning")
        if on_start:
            on_start()
        t0 = time.monotonic()
        spec = ({"provisioningTimeoutSeconds": TIMEOUT} if kind == "provisioning"
                else {"verification": {"enabled": True, "timeoutSeconds": TIMEOUT}})

        def drive(name):
            if kind == "verification":
                ob.wait_for(lambda: (name, "Provisioning") in seen.at, 60, f"{name} Provisioning")
                kr.cluster_ready(f"{name}-ray")
                ob.wait_for(lambda: (name, "VerifyingCollectives") in seen.at, 60, f"{name} Verifying")
                kr.job_running(f"{name}-verify")

        threads = []
        for i, name in enumerate(names):
            if i:
                time.sleep(2.0)
            cl.custom.create_namespaced_custom_object(ob.GROUP, ob.VERSION, ns, ob.PLURAL, ob.tft_body(name, **spec))
            th = threading.Thread(target=drive, args=(name,), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(120)
        ob.wait_for(lambda: all((x, "Failed") in seen.at for x in names), bound + 120, "all Failed", interval=0.1)
        t_end = time.monotonic()
    finally:
        op.stop()
        w.stop()
    reps_out = []
    for x in names:
        took = seen.at[(x, "Failed")] - seen.at[(x, fault_phase)]
        st = seen.final[x]
        reps_out.append({"name": x, "fault_to_failed_s": round(took, 3), "overshoot_s": round(took - bound, 3),
                         "reason": st.get("reason"), "reason_ok": st.get("reason") == want,
                         "message": st.get("message")})
    over = [r["overshoot_s"] for r in reps_out]
    took = [r["fault_to_failed_s"] for r in reps_out]
    return {"scenario": kind, "namespace": ns, "configured_timeout_s": TIMEOUT, "verify_grace_s": grace_s if kind != "provisioning" else None,
            "bound_s": bound, "expected_reason": want, "reps": reps_out,
            "median_fault_to_failed_s": statistics.median(took), "max_fault_to_failed_s": max(took),
            "median_overshoot_s": statistics.median(over), "max_overshoot_s": max(over),
            "all_reasons_ok": all(r["reason_ok"] for r in reps_out), "wall_s": t_end - t0}


class Anchor:
    """KubeRay's operator + a RayJob without deadlines whose RayCluster never becomes ready."""

    def __init__(self, cl: ob.Cluster, workdir: Path):
        self.cl = cl
        self.ns = cl.namespace("fd-anchor")
        self.op = ob.Proc(ob.peer_args(self.ns, ob.free_port(), ob.free_port()) + [f"--kubeconfig={cl.cp.kubeconfig}"],
                          dict(os.environ, KUBECONFIG=str(cl.cp.kubeconfig)), workdir / "anchor-kuberay.log")
        self.t0: float | None = None
        self.samples: list[dict] = []

    def start(self) -> None:
        body = ob.rayjob_body("no-deadlines")
        assert "activeDeadlineSeconds" not in body["spec"] and "preRunningDeadlineSeconds" not in body["spec"]
        self.cl.custom.create_namespaced_custom_object(*ob.RAY, self.ns, "rayjobs", body)
        self.t0 = time.monotonic()

    def sample(self, when: str) -> dict:
        job = self.cl.custom.get_namespaced_custom_object(*ob.RAY, self.ns, "rayjobs", "no-deadlines")
        st = job.get("status") or {}
        s = {"when": when, "elapsed_s": round(time.monotonic() - self.t0, 1),
             "jobDeploymentStatus": st.get("jobDeploymentStatus"), "jobStatus": st.get("jobStatus") or "",
             "rayClusterName": st.get("rayClusterName"), "reason": st.get("reason"), "kuberay_alive": self.op.alive()}
        self.samples.append(s)
        ob.say(f"anchor: {s}")
        return s

    def stop(self) -> None:
        self.op.stop()


def table(results: list[dict], anchor: list[dict], meta: dict) -> str:
    lines = [f"failure_detection  {meta['started']}  machine: {meta['machine']}", f"command: {meta['command']}",
             f"operator code: HEAD {meta['code']['head']}, uncommitted in operator/tpuft: "
             f"{meta['code']['uncommitted'] or 'none'}", "",
             "fault -> phase Failed (seconds; fault = the harness's watch sees the phase the timeout counts from)"]
    lines.append(f"{'scenario':<28}{'timeout':>8}{'grace':>7}{'bound':>7}{'reps':>6}{'median':>8}{'max':>8}"
                 f"{'med over':>10}{'max over':>10}  reason")
    for r in results:
        name = r["scenario"] + (f" (grace {r['verify_grace_s']:g}s)" if r["verify_grace_s"] is not None else "")
        lines.append(f"{name:<28}{r['configured_timeout_s']:>8}{ob.fmt(r['verify_grace_s'], 0):>7}{r['bound_s']:>7.0f}"
                     f"{len(r['reps']):>6}{r['median_fault_to_failed_s']:>8.2f}{r['max_fault_to_failed_s']:>8.2f}"
                     f"{r['median_overshoot_s']:>10.2f}{r['max_overshoot_s']:>10.2f}  "
                     f"{r['expected_reason']} {sum(x['reason_ok'] for x in r['reps'])}/{len(r['reps'])}")
    lines.append("(over = overshoot beyond the bound the operator enforces: timeoutSeconds, plus the verify grace "
                 "for the verification backstop)")
    if anchor:
        lines.append("")
        lines.append(f"anchor: KubeRay {ob.PEER_VERSION} operator, RayJob without activeDeadlineSeconds/"
                     "preRunningDeadlineSeconds, RayCluster never ready:")
        for s in anchor:
            lines.append(f"  after {s['elapsed_s']:>6.1f} s ({s['when']}): jobDeploymentStatus={s['jobDeploymentStatus']} "
                         f"jobStatus={s['jobStatus'] or '-'} reason={s['reason'] or '-'} "
                         f"(KubeRay operator {'running' if s['kuberay_alive'] else 'NOT running'})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-anchor", action="store_true")
    ap.add_argument("--no-default-grace", action="store_true", help="skip (b) with the 60 s default grace")
    ap.add_argument("--out", type=Path, default=ob.RESULTS / "failure_detection.json")
    args = ap.parse_args()
    code = ob.code_state()
    state = Path(tempfile.mkdtemp(prefix="tpuft-bench-fd-"))
    cl = ob.Cluster(state / "cp").start()
    results, anchor = [], None
    t_start = time.monotonic()
    try:
        if not args.no_anchor:
            ob.build_peer()
            anchor = Anchor(cl, state)
        results.append(scenario(cl, "provisioning", args.reps, None, state, on_start=anchor.start if anchor else None))
        if anchor:
            anchor.sample(f"when (a) ended: its slowest detection took {results[-1]['max_fault_to_failed_s']:.1f} s")
        results.append(scenario(cl, "verification", args.reps, "0", state))
        if not args.no_default_grace:
            results.append(scenario(cl, "verification", args.reps, None, state))
        if anchor:
            anchor.sample("when (b) ended")
    finally:
        if anchor:
            anchor.stop()
        cl.stop()
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(["python"] + sys.argv),
            "machine": f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f} at end (shared)",
            "wall_s": time.monotonic() - t_start, "code": code}
    text = table(results, anchor.samples if anchor else [], meta)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "scenarios": results, "anchor": anchor.samples if anchor else []},
                                   indent=1) + "\n")
    args.out.with_suffix(".txt").write_text(text + "\n")
    ob.say(f"wrote {args.out}; logs in {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
