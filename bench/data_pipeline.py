"""Training input: the per-rank path (every training worker loads, tokenizes and packs the whole
dataset, then takes its slice; no longer the workload's: tests/workload/inprocess_data.py) against
the pipeline (tpuft_workload.pipeline: Ray Data tokenizes once, the driver packs whole examples and
puts the rows in the object store once, each worker reads its rows of every global batch of the
epoch's permutation), same local Ray, same synthetic data, same run.

    .venv/bin/python bench/data_pipeline.py --records 10000,100000 --workers 4 --out bench/results/data_pipeline.json

Data: synthetic dolly-shaped records (instruction, optional context, response) drawn from the
builtin tokenizer's words with log-normal lengths (median near 150 tokens per example, a long
tail), written as JSONL; the builtin tiny model's tokenizer.

Per path and size (keys of results["per-rank"|"ray-data"]["<records>"]):
  tokenizeCpuSeconds      (per-rank) the workers' own process_time() around load + tokenize + pack, summed
  buildSeconds, driverCpuSeconds (ray-data) pipeline.build's wall time, and the driver's CPU in it
                          (the record check, collecting the examples, bin-packing, ray.put)
  epochReadCpuSecondsPerWorker (ray-data) a worker's CPU for one whole epoch of its batches, the
                          permutation and the row gathers included
  rows, truncated, dropped, padFraction (ray-data) what packing whole examples gave
  onePassCpuSeconds       one single-process pass over the same records here (load, tokenize, pack)
  timeToFirstStepSeconds  from the start until every training worker holds its first
                          [batch, max_len] batch (the model step itself is the same in both paths
                          and is left out)
  peakRssPerWorkerMB      the largest peak RSS among the training workers (fresh processes)
Nothing else runs Ray on the machine while it runs (the host-wide Ray lock is taken).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import random
import resource
import secrets
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.workload.inprocess_data: the per-rank path, out of the package
RAY_LOCK = "/tmp/tpuft-ray.lock"
MODEL = "builtin:tiny-llama"
MAX_LEN, BATCH = 512, 4


def say(msg: str) -> None:
    print(f"[data_pipeline] {msg}", file=sys.stderr, flush=True)


def synthetic(n: int, path: Path, seed: int = 0) -> None:
    """Dolly-shaped records: instruction ~12 words, context in a third of them, response log-normal
    with a long tail, so an example (template included) is ~150 tokens at the median."""
    from tpuft_workload.tiny import _vocab

    words = [w for w in _vocab() if w.isalpha()][:5000]
    rnd = random.Random(seed)

    def text(median: float, sigma: float) -> str:
        k = max(1, min(4000, int(rnd.lognormvariate(math.log(median), sigma))))
        return " ".join(rnd.choice(words) for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            rec = {"instruction": text(12, 0.5), "response": text(90, 0.9),
                   "context": text(60, 0.8) if rnd.random() < 0.33 else ""}
            f.write(json.dumps(rec) + "\n")


def one_pass(path: Path) -> float:
    from tests.workload.inprocess_data import build_blocks, load_records
    from tpuft_workload import model as modellib

    t0 = time.process_time()
    tok = modellib.load_tokenizer(MODEL)
    build_blocks(tok, load_records(str(path), "train"), MAX_LEN, True)
    return time.process_time() - t0


def _fresh() -> dict:
    # a distinct runtime_env starts a new worker process: its peak RSS is its own. The repository on
    # its path for tests.workload.inprocess_data: Ray gives workers only bench/ and the driver's cwd.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"TPUFT_BENCH_PROCESS": uuid.uuid4().hex, "PYTHONPATH": path}}


def per_rank(path: Path, workers: int) -> dict:
    import ray

    @ray.remote(num_cpus=1)
    class Rank:
        def first_batch(self, rank: int, world: int) -> tuple[float, float]:
            from tests.workload.inprocess_data import build_blocks, collate, load_records
            from tpuft_workload import data as datalib
            from tpuft_workload import model as modellib

            cpu = time.process_time()
            tok = modellib.load_tokenizer(MODEL)
            blocks = build_blocks(tok, load_records(str(path), "train"), MAX_LEN, True)
            cpu = time.process_time() - cpu
            batch = datalib.rank_batches(len(blocks), world, rank, BATCH, 0, 42)[0]
            collate(blocks, batch)
            return time.monotonic(), cpu

        def peak_rss_mb(self) -> float:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    t0 = time.monotonic()
    ranks = [Rank.options(runtime_env=_fresh()).remote() for _ in range(workers)]
    done = ray.get([r.first_batch.remote(i, workers) for i, r in enumerate(ranks)])
    out = {"tokenizeCpuSeconds": sum(cpu for _, cpu in done), "timeToFirstStepSeconds": max(t for t, _ in done) - t0,
           "peakRssPerWorkerMB": max(ray.get([r.peak_rss_mb.remote() for r in ranks]))}
    for r in ranks:
        ray.kill(r)
    return out


def ray_data(path: Path, workers: int) -> dict:
    import ray

    from tpuft.api.spec import Dataset
    from tpuft_workload import pipeline

    @ray.remote(num_cpus=1)
    class Worker:
        def first_batch(self, rows_ref: list, rank: int, world: int) -> tuple[float, float]:
            rows = ray.get(rows_ref[0])   # the shared rows, mapped from the node's object store
            t, cpu = None, time.process_time()
            for _ in pipeline.torch_batches(rows, world, rank, BATCH, 42, 0):   # the whole epoch
                t = t or time.monotonic()
            return t, time.process_time() - cpu

        def peak_rss_mb(self) -> float:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    t0, cpu0 = time.monotonic(), time.process_time()
    packed = pipeline.build(Dataset(str(path)), MODEL, MAX_LEN, True)
    build_s, driver_cpu = time.monotonic() - t0, time.process_time() - cpu0
    ws = [Worker.options(runtime_env=_fresh()).remote() for _ in range(workers)]
    done = ray.get([w.first_batch.remote([packed.ref], i, workers) for i, w in enumerate(ws)])
    out = {"buildSeconds": build_s, "driverCpuSeconds": driver_cpu, "rows": packed.rows,
           "truncated": packed.truncated, "dropped": packed.dropped, "padFraction": packed.pad_fraction,
           "epochReadCpuSecondsPerWorker": max(c for _, c in done),
           "timeToFirstStepSeconds": max(t for t, _ in done) - t0,
           "peakRssPerWorkerMB": max(ray.get([w.peak_rss_mb.remote() for w in ws]))}
    for w in ws:
        ray.kill(w)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default="10000,100000")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sizes = [int(x) for x in args.records.split(",")]
    lock = open(RAY_LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)   # one local Ray on the machine
    # Ray's default token auth, with a token for this run in the env instead of ~/.ray/auth_token;
    # before `import ray`, which reads RAY_AUTH_MODE once
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    import ray

    ray.init(num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False)
    results: dict = {"per-rank": {}, "ray-data": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="tpuft-bench-data-") as tmp:
            for n in sizes:
                path = Path(tmp) / f"dolly-{n}.jsonl"
                synthetic(n, path)
                single = one_pass(path)
                say(f"{n} records: one single-process pass {single:.1f} s CPU")
                for name, fn in (("per-rank", per_rank), ("ray-data", ray_data)):
                    r = {**fn(path, args.workers), "onePassCpuSeconds": single}
                    results[name][str(n)] = {k: round(v, 2) for k, v in r.items()}
                    say(f"{n} records, {name}: {results[name][str(n)]}")
    finally:
        ray.shutdown()
        fcntl.flock(lock, fcntl.LOCK_UN)
    rd = results["ray-data"]
    small, big = str(sizes[0]), str(sizes[-1])
    results["targets"] = {
        "rayDataRssGrowth": round(rd[big]["peakRssPerWorkerMB"] / rd[small]["peakRssPerWorkerMB"] - 1, 3),
        "firstStepRayDataOverPerRank": {k: round(rd[k]["timeToFirstStepSeconds"] / results["per-rank"][k]["timeToFirstStepSeconds"], 2)
                                        for k in rd},
    }
    results["config"] = {"workers": args.workers, "maxSeqLength": MAX_LEN, "batch": BATCH, "model": MODEL,
                         "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "medianExampleTokensTarget": 150}
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
