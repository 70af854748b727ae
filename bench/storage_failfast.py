"""A run that cannot save, on the local cluster (`tpuft cluster up`): how long from `kubectl apply`
to Failed, and what status says. examples/local-cpu.yaml with `checkpoint.storagePath: gs://...`
on the cluster's GCS stand-in (fake-gcs-server) and pods that get their tokens from the GKE
metadata server's stand-in, in two cases:

  missing-bucket   storagePath names a bucket that does not exist
  no-credentials   the metadata stand-in stopped (no pod can get a token), an existing bucket

    .venv/bin/python bench/storage_failfast.py --repetitions 2 --out bench/results/storage_failfast.json

Per case and repetition: seconds from apply to phase Failed, the reason, and whether the message
names the bucket, the Kubernetes service account and the Workload Identity principal. Medians at the
end. Every wait is bounded; the object is deleted after each repetition, and the metadata stand-in
is started again (`tpuft cluster up`) after the no-credentials case.
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
NAMESPACE = "bench-storage"
NAME = "bench-nosave"
WAIT_BOUND_S = 600
POLL_S = 0.5


def say(msg: str) -> None:
    print(f"[storage_failfast] {msg}", file=sys.stderr, flush=True)


def kubectl(kubeconfig: Path, *args: str, input: str | None = None, check: bool = True) -> str:
    from tpuft_local import toolchain
    res = subprocess.run([toolchain.tool_path("kubectl", build=False), f"--kubeconfig={kubeconfig}", *args],
                         input=input, capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def document(storage: str) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "local-cpu.yaml").read_text())
    doc["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = doc["spec"]
    spec["checkpoint"] = {"storagePath": storage}
    spec.pop("serve")
    return doc


def one(cluster, storage: str) -> dict:
    kc = cluster.kubeconfig
    kubectl(kc, "delete", "tft", NAME, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    start = time.monotonic()
    kubectl(kc, "apply", "-f", "-", input=json.dumps(document(storage)))
    end = start + WAIT_BOUND_S
    status: dict = {}
    while time.monotonic() < end:
        status = json.loads(kubectl(kc, "get", "tft", NAME, "-n", NAMESPACE, "-o", "json")).get("status") or {}
        if status.get("phase") in ("Failed", "Succeeded"):
            break
        time.sleep(POLL_S)
    seconds = time.monotonic() - start
    kubectl(kc, "delete", "tft", NAME, "-n", NAMESPACE, "--wait=false")
    message = status.get("message") or ""
    bucket = storage.split("/")[2]
    return {"seconds": round(seconds, 1), "phase": status.get("phase"), "reason": status.get("reason"),
            "names_bucket": bucket in message, "names_ksa": f"{NAME}-workload" in message,
            "names_principal": "principal://iam.googleapis.com/" in message, "message": message[:600]}


def main(argv: list[str] | None = None) -> int:
    from tpuft_local import gcs, procs
    from tpuft_local.cluster import LocalCluster

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "storage_failfast.json")
    args = p.parse_args(argv)
    cluster = LocalCluster()
    kc = cluster.kubeconfig
    kubectl(kc, "create", "namespace", NAMESPACE, check=False)
    bucket = f"bench-{int(time.time())}"
    gcs.create_bucket(cluster.gcs_endpoint, bucket)
    runs: dict[str, list[dict]] = {"missing-bucket": [], "no-credentials": []}
    try:
        for rep in range(args.repetitions):
            runs["missing-bucket"].append(one(cluster, f"gs://no-such-bucket-{bucket}/runs"))
            say(f"missing-bucket #{rep + 1}: {runs['missing-bucket'][-1]}")
            pid = cluster.pid_of("gke-metadata")
            if pid is None:
                raise RuntimeError("the metadata stand-in is not running: `tpuft cluster up` first")
            procs.terminate(pid, "the GKE metadata server's stand-in")
            try:
                runs["no-credentials"].append(one(cluster, f"gs://{bucket}/runs"))
            finally:
                LocalCluster().up(images=False)   # starts the metadata stand-in again
            say(f"no-credentials #{rep + 1}: {runs['no-credentials'][-1]}")
    finally:
        kubectl(kc, "delete", "namespace", NAMESPACE, "--wait=false", check=False)
    summary = {case: {"median_seconds_to_failed": statistics.median(r["seconds"] for r in rs),
                      "reasons": sorted({str(r["reason"]) for r in rs}),
                      "every_message_names_bucket_ksa_principal": all(
                          r["names_bucket"] and r["names_ksa"] and r["names_principal"] for r in rs)}
               for case, rs in runs.items() if rs}
    result = {"command": "bench/storage_failfast.py --repetitions %d" % args.repetitions,
              "date": time.strftime("%Y-%m-%d"), "summary": summary, "runs": runs}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
