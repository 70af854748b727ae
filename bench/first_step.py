"""Time from `kubectl apply` to the first training step, on the local cluster (`tpuft cluster up`):
ours (one TPUFinetune) against the GKE tutorial's manual flow (a hand-written RayCluster,
bench/manual/raycluster.yaml, then `ray job submit` of verification and of training), same
cluster, same image, same requests, same run, alternating.

    .venv/bin/python bench/first_step.py --runs 3 --out bench/results/first_step.json

Both flows are timed by the same signal: the first `Epoch E/N | step S/T` line in the training
job's log, read from the Ray head's job API (the head pod's IP, port 8265, polled every 0.5 s).
The manual flow's waits are as fast as a script can make them (`kubectl wait` on the RayCluster's
state, then a blocking `ray job submit`), so the ratio shows only what the operator adds. Each
run is deleted as soon as it trains, and the next starts once its pods are gone.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "bench-first-step"
STEP_LINE = re.compile(r"Epoch \d+/\d+ \| step \d+/\d+")
POLL_S = 0.5
RUN_BOUND_S = 600  # one run never waits longer than this, whatever happens

# What the user types for the manual flow: the GKE tutorial's two `ray job submit` commands with this
# example's settings (checked against our renderer at start, so both flows run the same job).
MANUAL_VERIFY = ("python -m tpuft_workload verify --accelerator cpu --topology 2 --slices 1 --timeout-seconds 120 "
                 "--log-file /tmp/tpuft-checkpoints/{run}/logs/verify.log")
MANUAL_TRAIN = ("python -m tpuft_workload train --accelerator cpu --topology 2 --slices 1 --model builtin:tiny-llama "
                "--dataset builtin:dolly-mini --dataset-split train --epochs 3 --batch-size-per-device 4 "
                "--max-seq-length 128 --learning-rate 0.003 --storage-path /tmp/tpuft-checkpoints "
                "--run-name {run} --checkpoint-every-steps 10 --keep-checkpoints 2 --max-failures 1 "
                "--report-every-steps 5 --log-file /tmp/tpuft-checkpoints/{run}/logs/train.log")


def say(msg: str) -> None:
    print(f"[first_step] {msg}", file=sys.stderr, flush=True)


class Cluster:
    def __init__(self, kubeconfig: Path):
        self.kubeconfig = kubeconfig

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        from tpuft_local import toolchain
        res = subprocess.run([toolchain.tool_path("kubectl", build=False), f"--kubeconfig={self.kubeconfig}",
                              "-n", NAMESPACE, *args], input=input, capture_output=True, text=True)
        if check and res.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def head_ip(self, cluster: str) -> str | None:
        out = self.kubectl("get", "pods", "-l", f"ray.io/cluster={cluster},ray.io/node-type=head",
                           "-o", "jsonpath={.items[*].status.podIP}", check=False).split()
        return out[0] if out else None

    def ray_token(self, cluster: str) -> str | None:
        """The Ray token KubeRay made for the cluster (authOptions mode token): a Secret of its name."""
        raw = self.kubectl("get", "secret", cluster, "-o", "jsonpath={.data.auth_token}", check=False).strip()
        return base64.b64decode(raw).decode() if raw else None

    def wait_gone(self, selector: str) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if not self.kubectl("get", "pods", "-l", selector, "-o", "name", check=False).strip():
                return
            time.sleep(1)
        raise RuntimeError(f"pods {selector} still present after 180 s")


def _get_json(url: str, token: str):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def first_step_seen(ip: str | None, token: str | None) -> bool:
    """Whether the head's training job has logged a step yet."""
    if not ip or not token:
        return False
    try:
        jobs = _get_json(f"http://{ip}:8265/api/jobs/", token)
        for job in jobs:
            if "tpuft_workload train" in (job.get("entrypoint") or ""):
                logs = _get_json(f"http://{ip}:8265/api/jobs/{job['submission_id']}/logs", token).get("logs", "")
                if STEP_LINE.search(logs):
                    return True
    except (OSError, ValueError):
        pass  # head not serving yet
    return False


def wait_first_step(cl: Cluster, cluster: str, t0: float, failed=lambda: None) -> float:
    token = None
    while time.monotonic() - t0 < RUN_BOUND_S:
        token = token or cl.ray_token(cluster)
        if first_step_seen(cl.head_ip(cluster), token):
            return time.monotonic() - t0
        reason = failed()
        if reason:
            raise RuntimeError(reason)
        time.sleep(POLL_S)
    raise RuntimeError(f"no training step within {RUN_BOUND_S} s")


def ours(cl: Cluster, i: int) -> float:
    doc = yaml.safe_load((REPO / "examples" / "local-cpu.yaml").read_text())
    name = doc["metadata"]["name"] = f"ours-{i}"

    def failed():
        phase = cl.kubectl("get", "tft", name, "-o", "jsonpath={.status.phase}", check=False)
        return f"{name} Failed" if phase == "Failed" else None

    t0 = time.monotonic()
    cl.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    try:
        return wait_first_step(cl, f"{name}-ray", t0, failed)
    finally:
        cl.kubectl("delete", "tft", name, "--wait=false", check=False)
        cl.wait_gone(f"ray.io/cluster={name}-ray")


def manual(cl: Cluster, i: int) -> float:
    doc = yaml.safe_load((REPO / "bench" / "manual" / "raycluster.yaml").read_text())
    name = doc["metadata"]["name"] = f"manual-{i}-ray"
    t0 = time.monotonic()
    cl.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    try:
        cl.kubectl("wait", f"raycluster/{name}", "--for=jsonpath={.status.state}=ready", "--timeout=300s")
        address = f"http://{cl.head_ip(name)}:8265"
        # Ray's own CLI (`ray job submit`), through this interpreter: the venv's packages may live
        # in the shared dependency venv (hack/venv.sh), whose bin/ holds the `ray` script
        ray = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
        # the token as a user of a token-auth cluster passes it to `ray job submit`
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": cl.ray_token(name) or ""}
        run = f"manual-{i}-{int(time.time())}"
        subprocess.run([*ray, "job", "submit", "--address", address, "--", *MANUAL_VERIFY.format(run=run).split()],
                       check=True, capture_output=True, text=True, timeout=300, env=env)
        subprocess.run([*ray, "job", "submit", "--address", address, "--no-wait", "--",
                        *MANUAL_TRAIN.format(run=run).split()],
                       check=True, capture_output=True, text=True, timeout=120, env=env)
        return wait_first_step(cl, name, t0)
    finally:
        cl.kubectl("delete", "raycluster", name, "--wait=false", check=False)
        cl.wait_gone(f"ray.io/cluster={name}")


def check_same_commands() -> None:
    """The hand-written commands run what our operator renders for the example (run name aside): the
    workload's own CLI reads both (flags by hand, the --spec document rendered) into the same command."""
    from tpuft.controller import builders
    from tpuft.api import spec
    from tpuft_workload import __main__ as workload_cli
    tft = spec.parse({**yaml.safe_load((REPO / "examples" / "local-cpu.yaml").read_text()),
                      "metadata": {"name": "local-cpu", "namespace": NAMESPACE, "uid": "u"}})
    run = builders.run_name(tft)   # also in the drivers' --log-file paths
    for mine, theirs in ((MANUAL_VERIFY, builders.verify_entrypoint(tft)), (MANUAL_TRAIN, builders.train_entrypoint(tft))):
        by_hand = workload_cli.parse_args(shlex.split(mine.format(run=run))[3:])[0]
        rendered = workload_cli.parse_args(shlex.split(theirs)[3:])[0]
        if by_hand != rendered:
            raise SystemExit(f"bench/first_step.py: the manual command drifted from the example:\n  {by_hand}\n  "
                             f"{rendered}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    check_same_commands()
    from tpuft_local.cluster import LocalCluster
    cl = Cluster(LocalCluster().kubeconfig)
    cl.kubectl("create", "namespace", NAMESPACE, check=False)
    rows = []
    for i in range(args.runs):
        order = (("ours", ours), ("manual", manual)) if i % 2 == 0 else (("manual", manual), ("ours", ours))
        pair = {}
        for flow, fn in order:
            pair[flow] = round(fn(cl, i), 2)
            say(f"run {i + 1}/{args.runs} {flow}: first training step {pair[flow]} s after apply")
        rows.append(pair)
    ours_s, manual_s = [r["ours"] for r in rows], [r["manual"] for r in rows]
    result = {"bench": "first_step", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f} at end",
              "runs": rows, "ours_median_s": statistics.median(ours_s), "manual_median_s": statistics.median(manual_s),
              "ratio_median": statistics.median(r["ours"] / r["manual"] for r in rows)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
