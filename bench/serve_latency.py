"""Chat completion latency and throughput of the `transformers` engine's Serve app
(tpuft_workload.serve) on the builtin tiny model's Hugging Face export, under a local Ray Serve.

    .venv/bin/python bench/serve_latency.py --requests 40 --concurrency 1,8 --out bench/results/serve_latency.json

The export is written by checkpoint.export_hf (as training writes it) into a temporary folder; the
app runs as the RayService runs it (build_app with the same args, route prefix "/"), Serve's proxy
on 127.0.0.1. Each request is one user message (a dolly-mini instruction, in order, so prompt
lengths vary), `max_tokens` as given, temperature 0. Per concurrency level C, C client threads send
--requests requests in all, each thread waiting for its answer before sending the next, after
--warmup requests that are not counted.

Per level (results["levels"]["<C>"]):
  p50Ms, p99Ms           request latency as the client sees it (HTTP round trip, proxy included)
  requestsPerSecond      counted requests / wall time of the level
  completionTokensPerSecond  usage.completion_tokens summed / wall time
  meanCompletionTokens   usage.completion_tokens per request (below max_tokens when the model ends
                         on EOS: the tiny model is untrained)
Nothing else runs Ray on the machine while it runs (the host-wide Ray lock is taken).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY_LOCK = "/tmp/tpuft-ray.lock"
MODEL_ID = "tiny-bench"


def say(msg: str) -> None:
    print(f"[serve_latency] {msg}", file=sys.stderr, flush=True)


def take_lock(wait_s: float):
    lock = open(RAY_LOCK, "w")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                sys.exit(f"another local Ray holds {RAY_LOCK} for more than {wait_s:.0f} s; try again later")
            time.sleep(1)


def export_tiny(dest: str) -> str:
    from tpuft_workload import checkpoint, tiny

    tok = tiny.build_tokenizer()
    return checkpoint.export_hf(tiny.build_model(len(tok), seed=0), tok, dest, rank=0)


def instructions(n: int) -> list[str]:
    from tpuft_workload.tiny import dolly_mini_path

    with open(dolly_mini_path()) as f:
        texts = [json.loads(line)["instruction"] for line in f]
    return [texts[i % len(texts)] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def one_level(url: str, prompts: list[str], concurrency: int, max_tokens: int, timeout: float) -> dict:
    import requests

    local = threading.local()

    def call(prompt: str) -> tuple[float, int]:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        resp = session.post(url, json=body, timeout=timeout)
        latency = time.perf_counter() - t0
        resp.raise_for_status()
        return latency, resp.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        done = list(pool.map(call, prompts))
        wall = time.perf_counter() - t0
    latencies = [lat * 1000 for lat, _ in done]
    tokens = sum(n for _, n in done)
    return {"requests": len(done), "p50Ms": statistics.median(latencies), "p99Ms": percentile(latencies, 99),
            "requestsPerSecond": len(done) / wall, "completionTokensPerSecond": tokens / wall,
            "meanCompletionTokens": tokens / len(done), "wallSeconds": wall}


def run_app(export: str, replicas: int, port: int) -> str:
    from ray import serve

    from tpuft.constants import SERVE_APP_NAME, SERVE_CHAT_PATH
    from tpuft_workload import serve as serveapp

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = serveapp.parse_args({"model_source": export, "model_id": MODEL_ID})
    serve.run(serveapp.ChatDeployment.options(num_replicas=replicas).bind(args),
              name=SERVE_APP_NAME, route_prefix=serveapp.ROUTE_PREFIX)
    return f"http://127.0.0.1:{port}{SERVE_CHAT_PATH}"


def table(levels: dict) -> str:
    rows = ["| concurrency | requests | p50 ms | p99 ms | requests/s | completion tokens/s | mean completion tokens |",
            "|---|---|---|---|---|---|---|"]
    for c, r in levels.items():
        rows.append(f"| {c} | {r['requests']} | {r['p50Ms']:.1f} | {r['p99Ms']:.1f} | {r['requestsPerSecond']:.2f} "
                    f"| {r['completionTokensPerSecond']:.1f} | {r['meanCompletionTokens']:.1f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="counted requests per concurrency level")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120, help="seconds one request may take")
    ap.add_argument("--lock-wait", type=float, default=900, help="seconds to wait for the host-wide Ray lock")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    lock = take_lock(args.lock_wait)   # one local Ray on the machine
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    results: dict = {"levels": {}}
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="tpuft-bench-serve-") as tmp:
            url = run_app(export_tiny(f"{tmp}/export"), args.replicas, free_port())
            one_level(url, instructions(args.warmup), 1, args.max_tokens, args.timeout)
            for c in levels:
                r = one_level(url, instructions(args.requests), c, args.max_tokens, args.timeout)
                results["levels"][str(c)] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
                say(f"concurrency {c}: {results['levels'][str(c)]}")
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        fcntl.flock(lock, fcntl.LOCK_UN)
    results["config"] = {"model": "builtin:tiny-llama (untrained, seed 0)", "maxTokens": args.max_tokens,
                         "temperature": 0, "replicas": args.replicas, "warmup": args.warmup,
                         "command": " ".join([Path(sys.executable).name, *sys.argv]),
                         "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "loadAverage": [round(x, 2) for x in os.getloadavg()]}
    print(table(results["levels"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
