"""What going through Kueue costs, and what a preemption loses, on the local cluster
(`tpuft cluster up`, which runs the real Kueue with the ClusterQueue `local`).

    .venv/bin/python bench/kueue_admission.py --runs 2 --out bench/results/kueue_admission.json

1. apply-to-first-step: the CPU example (examples/local-cpu.yaml, training only, verification off)
   applied with and without `kueue.x-k8s.io/queue-name: local`, alternating; the signal is the
   first status.training.step > 0 the operator's object shows (the same for both). Medians and the
   ratio go to --out.
2. steps lost per preemption: one queued low-priority run, preempted by a high-priority one once it
   has trained past its first periodic checkpoint (every 5 steps), admitted again once that one is
   deleted; lost = the last step it reported before the preemption - the step it resumed from
   (status.recovery.lastPreemption.step, status.training.resumedFromStep). A run that saved at its
   next step on SIGTERM loses 0 (or resumes ahead of the last report); one that did not, up to 4.

Every wait is bounded (RUN_BOUND_S); each run's object is deleted and its pods gone before the next.
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

from tpuft.api import kueue
from tpuft_local import kueue as localkueue

REPO = Path(__file__).resolve().parents[1]

NS = "bench-kueue"   # its own LocalQueue `local` onto `cluster up`'s ClusterQueue `local` (the demo's
                     # namespace refuses the example's hostPath volume: Pod Security baseline)
RUN_BOUND_S = 900
PRIORITIES = (("bench-low", 100), ("bench-high", 1000))
TIGHT = "bench-one-run"   # a ClusterQueue and LocalQueue with CPU for one local-cpu run (0.6 CPU) only


def say(msg: str) -> None:
    print(f"[kueue_admission] {msg}", file=sys.stderr, flush=True)


def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
    from tpuft_local import toolchain
    from tpuft_local.cluster import LocalCluster
    res = subprocess.run([toolchain.tool_path("kubectl", build=False), f"--kubeconfig={LocalCluster().kubeconfig}",
                          *args], input=input, capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def status(name: str) -> dict:
    out = kubectl("get", "tft", name, "-n", NS, "-o", "json", check=False)
    return (json.loads(out).get("status") or {}) if out else {}


def doc(name: str, queued: bool, priority: str | None = None, epochs: int = 3,
        queue: str = localkueue.LOCAL_QUEUE) -> dict:
    d = yaml.safe_load((REPO / "examples" / "local-cpu.yaml").read_text())
    d["spec"].pop("serve", None)
    d["spec"]["verification"] = {"enabled": False}
    d["spec"]["training"]["epochs"] = epochs
    d["spec"]["checkpoint"]["everySteps"] = 5
    d["metadata"] = {"name": name, "labels": {}}
    if queued:
        d["metadata"]["labels"][kueue.KUEUE_QUEUE_LABEL] = queue
    if priority:
        d["metadata"]["labels"][kueue.KUEUE_PRIORITY_LABEL] = priority
    return d


def apply(d: dict) -> None:
    kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(d))


def wait(what: str, check, bound: float = RUN_BOUND_S, interval: float = 0.5):
    end = time.monotonic() + bound
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(interval)
    raise RuntimeError(f"{what}: not within {bound:.0f} s")


def delete(name: str) -> None:
    kubectl("delete", "tft", name, "-n", NS, "--ignore-not-found", "--wait=false")
    wait(f"{name}'s pods to go", lambda: not kubectl("get", "pods", "-n", NS, "-l", f"ray.io/cluster={name}-ray",
                                                     "-o", "name", check=False).strip(), interval=1)


def first_step(queued: bool, i: int) -> float:
    name = f"bench-{'q' if queued else 'direct'}-{i}"
    start = time.monotonic()
    apply(doc(name, queued))
    wait(f"{name}'s first step", lambda: _trained(name, 1))
    took = time.monotonic() - start
    delete(name)
    return took


def _trained(name: str, steps: int) -> bool:
    st = status(name)
    if st.get("phase") == "Failed":
        raise RuntimeError(f"{name} failed: {st.get('message')}")
    return (st.get("training") or {}).get("step", 0) >= steps


def steps_lost() -> dict:
    api = f"{kueue.KUEUE_GROUP}/{kueue.KUEUE_VERSION}"
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        *[{"apiVersion": api, "kind": "WorkloadPriorityClass", "metadata": {"name": n}, "value": v}
          for n, v in PRIORITIES],
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": TIGHT},
         "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                      {"name": localkueue.CPU_FLAVOR, "resources": [{"name": "cpu", "nominalQuota": "1"},
                                                                    {"name": "memory", "nominalQuota": "16Gi"}]}]}]}},
        localkueue.local_queue(NS, TIGHT, TIGHT)]}))
    apply(doc("bench-low", True, PRIORITIES[0][0], epochs=4, queue=TIGHT))
    wait("bench-low past its first checkpoint", lambda: _trained("bench-low", 6))
    apply(doc("bench-high", True, PRIORITIES[1][0], epochs=1, queue=TIGHT))   # two do not fit: low is preempted
    st = wait("bench-low preempted", lambda: (s := status("bench-low")).get("reason") == "Preempted" and s, bound=300)
    wait("bench-high admitted", lambda: status("bench-high").get("phase") not in (None, "Pending", "Queued"))
    delete("bench-high")
    wait("bench-low resumed", lambda: (status("bench-low").get("training") or {}).get("resumedFromStep", 0) > 0)
    done = status("bench-low")
    out = {"lastReportedStep": st["recovery"]["lastPreemption"].get("step"),
           "resumedFromStep": done["training"]["resumedFromStep"]}
    out["stepsLost"] = out["lastReportedStep"] - out["resumedFromStep"]
    delete("bench-low")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kueue_admission.json")
    p.add_argument("--skip-preemption", action="store_true")
    args = p.parse_args()
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        localkueue.local_queue(NS, localkueue.CLUSTER_QUEUE, localkueue.LOCAL_QUEUE)]}))
    times: dict[str, list[float]] = {"direct": [], "queued": []}
    for i in range(args.runs):
        for queued in (False, True):
            t = first_step(queued, i)
            times["queued" if queued else "direct"].append(round(t, 1))
            say(f"run {i} {'queued' if queued else 'direct'}: first step {t:.1f} s after apply")
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"applyToFirstStepSeconds": times, "median": med, "ratioQueuedToDirect": round(med["queued"] / med["direct"], 3)}
    if not args.skip_preemption:
        result["preemption"] = steps_lost()
        say(f"preemption: {result['preemption']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
