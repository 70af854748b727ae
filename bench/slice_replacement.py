"""Host loss to training resumed, on the local cluster (`tpuft cluster up`, the real KubeRay):
one CPU TPUFinetune (examples/local-cpu.yaml, checkpoints every 5 steps, enough epochs to last)
has a KubeRay worker pod deleted N times mid-training; each time the operator replaces the slice
(KubeRay recreates the pod), verifies it again and resumes the same attempt from its checkpoint.

    .venv/bin/python bench/slice_replacement.py --repetitions 5 --out bench/results/slice_replacement.json

Per repetition: seconds from the pod deletion to (a) the operator seeing the loss
(status.recovery grows), (b) training resumed (status.training.resumedFromStep set by the new
job, and a step beyond it reported), and the steps lost (last step reported before the loss
minus the step resumed from; the true loss is at most checkpoint.everySteps), and where the time
went: when each stage was first seen (the slice being replaced, verifying again, the training job
submitted, the checkpoint loaded). Medians at the end.
Every wait is bounded; the object is deleted at the end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "bench-replacement"
NAME = "bench-heal"
EVERY = 5
POLL_S = 0.25
WAIT_BOUND_S = 600   # no single wait lasts longer than this


def say(msg: str) -> None:
    print(f"[slice_replacement] {msg}", file=sys.stderr, flush=True)


def kubectl(kubeconfig: Path, *args: str, input: str | None = None, check: bool = True) -> str:
    from tpuft_local import toolchain
    res = subprocess.run([toolchain.tool_path("kubectl", build=False), f"--kubeconfig={kubeconfig}", "-n", NAMESPACE,
                          *args], input=input, capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))   # a second early: status' times are whole seconds


def status(kc: Path) -> dict:
    return json.loads(kubectl(kc, "get", "tft", NAME, "-o", "json")).get("status") or {}


def wait(kc: Path, what: str, ok) -> dict:
    end = time.monotonic() + WAIT_BOUND_S
    while time.monotonic() < end:
        st = status(kc)
        if st.get("phase") in ("Failed", "Succeeded") and not ok(st):
            raise RuntimeError(f"{what}: the run ended {st.get('phase')}/{st.get('reason')}: {st.get('message')}")
        if ok(st):
            return st
        time.sleep(POLL_S)
    raise RuntimeError(f"{what}: not within {WAIT_BOUND_S} s")


def manifest(repetitions: int, storage: str) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "local-cpu.yaml").read_text())
    doc["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = doc["spec"]
    spec["checkpoint"].update(storagePath=storage, everySteps=EVERY)
    spec["checkpoint"]["volume"]["hostPath"]["path"] = storage
    spec["training"]["epochs"] = 6 + 4 * repetitions   # long enough to be killed N times
    spec["recovery"] = {"maxSliceReplacements": repetitions}
    return doc


def one_loss(kc: Path, index: int) -> dict:
    before = status(kc)
    step_before = (before.get("training") or {}).get("step", 0)
    pods = json.loads(kubectl(kc, "get", "pods", "-l", f"ray.io/cluster={NAME}-ray,ray.io/node-type=worker",
                              "-o", "json"))["items"]
    victim = sorted(p["metadata"]["name"] for p in pods)[index % len(pods)]
    t0 = time.monotonic()
    kubectl(kc, "delete", "pod", victim, "--wait=false")
    marks: dict[str, float] = {}   # where the time goes: when each stage was first seen, from the deletion

    def mark(st: dict) -> None:
        stage = {"Provisioning": "slice_replacing", "VerifyingCollectives": "verifying",
                 "Training": "train_job_submitted"}.get(st.get("phase") or "")
        if stage and stage not in marks and (stage != "train_job_submitted" or "verifying" in marks):
            marks[stage] = round(time.monotonic() - t0, 2)

    def seen_loss(st: dict) -> bool:
        mark(st)
        return (st.get("recovery") or {}).get("sliceReplacements", 0) > index

    seen = wait(kc, "the loss seen", seen_loss)
    t_seen = time.monotonic() - t0
    step_lost_at = seen["recovery"]["history"][-1].get("step", step_before)

    submitted: list[str] = []   # when the resumed job's Training began (UTC, status' own format)

    def resumed(st: dict) -> bool:
        mark(st)
        tr = st.get("training") or {}
        if st.get("phase") != "Training" or "verifying" not in marks:
            return False
        if not submitted:
            submitted.append(_now())
        fresh = tr.get("updatedAt", "") > submitted[0]   # written by the new job, not the stopped one's last report
        if fresh and tr.get("resumedFromStep") is not None and "resumed_from_checkpoint" not in marks:
            marks["resumed_from_checkpoint"] = round(time.monotonic() - t0, 2)
        return fresh and tr.get("resumedFromStep") is not None and tr.get("step", 0) > tr["resumedFromStep"]

    st = wait(kc, "training resumed", resumed)
    t_resumed = time.monotonic() - t0
    from_step = st["training"]["resumedFromStep"]
    out = {"victim": victim, "loss_seen_s": round(t_seen, 2), "training_resumed_s": round(t_resumed, 2),
           "resumed_at": st["training"]["updatedAt"],
           "stages_s": marks, "last_reported_step": step_lost_at, "resumed_from_step": from_step,
           # status lags the run (a report every 10 s): the stop checkpoint can be past the last step shown
           "steps_lost": max(0, step_lost_at - from_step),
           "resumed_past_reported_steps": max(0, from_step - step_lost_at)}
    say(f"loss {index + 1}: {out}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from tpuft_local.cluster import LocalCluster
    kc = LocalCluster().kubeconfig
    if not kc.exists():
        say("no local cluster: run `tpuft cluster up` first")
        return 2
    kubectl(kc, "create", "namespace", NAMESPACE, check=False)
    storage = f"/tmp/tpuft-bench-replacement-{int(time.time())}"
    kubectl(kc, "delete", "tft", NAME, "--ignore-not-found", "--wait=true")
    kubectl(kc, "apply", "-f", "-", input=json.dumps(manifest(args.repetitions, storage)))
    losses = []
    try:
        for i in range(args.repetitions):
            wait(kc, f"training before loss {i + 1}", lambda st: st.get("phase") == "Training"
                 and (st.get("training") or {}).get("step", 0) >= (st.get("training") or {}).get("resumedFromStep", 0) + EVERY + 1
                 and (not losses or (st.get("training") or {}).get("updatedAt", "") > losses[-1]["resumed_at"]))
            losses.append(one_loss(kc, i))
    finally:
        kubectl(kc, "delete", "tft", NAME, "--ignore-not-found", "--wait=false", check=False)
    result = {"repetitions": len(losses), "checkpoint_every_steps": EVERY, "losses": losses,
              "median_loss_seen_s": statistics.median(x["loss_seen_s"] for x in losses),
              "median_training_resumed_s": statistics.median(x["training_resumed_s"] for x in losses),
              "median_stages_s": {k: statistics.median(x["stages_s"][k] for x in losses if k in x["stages_s"])
                                  for k in ("slice_replacing", "verifying", "train_job_submitted",
                                            "resumed_from_checkpoint")
                                  if any(k in x["stages_s"] for x in losses)},
              "median_steps_lost": statistics.median(x["steps_lost"] for x in losses),
              "max_steps_lost": max(x["steps_lost"] for x in losses),
              "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
