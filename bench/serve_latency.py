"""Chat completion latency and throughput of the `transformers` engine's Serve app
(tpuft_workload.serve) on the builtin tiny model's Hugging Face export, under a local Ray Serve:
the batched engine (max_batch_size, default tpuft_workload.serve.MAX_BATCH_SIZE_DEFAULT) and the
unbatched one (max_batch_size 1: one request at a time) side by side, in the same run.

    .venv/bin/python bench/serve_latency.py --concurrency 1,8,32 --repeats 3 --out bench/results/serve_latency.json

The export is written by checkpoint.export_hf (as training writes it) into a temporary folder; each
engine is its own application (build_app's deployment, the same args but max_batch_size, route
prefix /<engine>) behind one Serve proxy on 127.0.0.1, --replicas replicas each (default 1). Each request is one user
message (a dolly-mini instruction, in order, so prompt lengths vary), `max_tokens` as given,
temperature 0, not streamed. Per concurrency level C, C client threads send max(--requests, 4*C)
requests in all, each thread waiting for its answer before sending the next, after C warm-up
requests that are not counted. Each engine runs its levels back to back (batched first), and the
whole round again --repeats times; the figures are medians over the repeats.

Per engine and level (results["engines"][<engine>]["<C>"]; every repeat in results["repeats"]):
  p50Ms, p99Ms           request latency as the client sees it (HTTP round trip, proxy included)
  requestsPerSecond      counted requests / wall time of the level
  completionTokensPerSecond  usage.completion_tokens summed / wall time
  meanCompletionTokens   usage.completion_tokens per request (below max_tokens when the model ends
                         on EOS: the tiny model is untrained)
  cpu<Who>MsPerRequest   CPU time (user + system, from /proc) spent during the level per counted
                         request, by who spent it: Engine (the engine's model process), Replica (its
                         Serve replica), Proxy (Serve's HTTP proxy), Client (this process: the
                         client threads, and Ray's driver), Rest (every other process on the machine:
                         Ray's GCS, raylet and controller, and anything else running)
  cpuCoresBusy           all of that over the level's wall time (2.0: both cores of the 2-core dev
                         machine busy the whole level)
results["vsOneClientPerRepeat"][<engine>]["<C>"]: each repeat's tokens/s and p50 at C over the same
engine's at 1 in that repeat (one engine's levels run back to back, so both sides of a ratio see the
host alike: on a shared 2-core host one client's p50 moved by half between repeats);
results["vsOneClient"][<engine>]["<C>"]: the medians of those.
The clients run on the same machine as Ray (they share its cores). Nothing else runs Ray on the
machine while it runs (the host-wide Ray lock is taken).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # tests.ranks
from tests.ranks import free_port  # noqa: E402

RAY_LOCK = "/tmp/tpuft-ray.lock"
MODEL_ID = "tiny-bench"
UNBATCHED = "unbatched"


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


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


CPU_WHO = ("Engine", "Replica", "Proxy", "Client", "Rest")   # cpu_roles' roles, then "Rest"


def cpu_seconds() -> dict[int, tuple[str, int, float]]:
    """pid -> (command line, parent pid, CPU seconds so far) of every process /proc shows."""
    tick, found = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:   # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state, ppid, ...
        found[int(pid)] = (cmd, int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return found


def cpu_roles(procs: dict, engine: str) -> dict[int, str]:
    """pid -> Engine, Replica, Proxy or Client for the processes serving `engine` (its app name)."""
    roles = {os.getpid(): "Client"}
    for pid, (cmd, _, _) in procs.items():
        if cmd.startswith("ray::ProxyActor"):
            roles[pid] = "Proxy"
        elif cmd.startswith(f"ray::ServeReplica:{engine}:"):
            roles[pid] = "Replica"
    for pid, (cmd, ppid, _) in procs.items():
        if "tpuft_workload.engine_process" in cmd and roles.get(ppid) == "Replica":
            roles[pid] = "Engine"
    return roles


def cpu_per_request(before: dict, after: dict, engine: str, requests: int, wall: float) -> dict:
    roles, spent = cpu_roles(after, engine), dict.fromkeys(CPU_WHO, 0.0)
    for pid, (_, _, seconds) in after.items():
        spent[roles.get(pid, "Rest")] += seconds - before.get(pid, ("", 0, 0.0))[2]
    return {**{f"cpu{who}MsPerRequest": 1000 * s / requests for who, s in spent.items()},
            "cpuCoresBusy": sum(spent.values()) / wall}


def one_level(url: str, prompts: list[str], concurrency: int, max_tokens: int, timeout: float,
              engine: str | None = None) -> dict:
    """One closed-loop level; with `engine` (its app name) also where the CPU went (Linux /proc)."""
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
        before = cpu_seconds() if engine else {}
        t0 = time.perf_counter()
        done = list(pool.map(call, prompts))
        wall = time.perf_counter() - t0
        cpu = cpu_per_request(before, cpu_seconds(), engine, len(done), wall) if engine else {}
    latencies = [lat * 1000 for lat, _ in done]
    tokens = sum(n for _, n in done)
    return {"requests": len(done), "p50Ms": statistics.median(latencies), "p99Ms": percentile(latencies, 99),
            "requestsPerSecond": len(done) / wall, "completionTokensPerSecond": tokens / wall,
            "meanCompletionTokens": tokens / len(done), "wallSeconds": wall, **cpu}


def run_apps(export: str, engines: dict[str, int], replicas: int, port: int) -> dict[str, str]:
    """One application per engine (name -> max_batch_size) behind one proxy; name -> its chat URL."""
    from ray import serve

    from tpuft.api.constants import SERVE_CHAT_PATH
    from tpuft_workload import serve as serveapp

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    urls = {}
    for name, batch in engines.items():
        args = serveapp.parse_args({"model_source": export, "model_id": MODEL_ID, "max_batch_size": batch})
        serve.run(serveapp.ChatDeployment.options(num_replicas=replicas).bind(args), name=name,
                  route_prefix=f"/{name}")
        urls[name] = f"http://127.0.0.1:{port}/{name}{SERVE_CHAT_PATH}"
    return urls


def medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) if isinstance(runs[0][k], float) else runs[0][k]
            for k in runs[0]}


RATIOS = {"tokensPerSecond": "completionTokensPerSecond", "p50": "p50Ms"}   # vsOneClient's name -> the level's


def paired_ratios(by_level: dict[str, list[dict]]) -> dict[str, dict[str, list[float]]]:
    """Per level, each repeat's tokens/s and p50 over the same repeat's one client."""
    return {c: {name: [round(r[key] / one[key], 2) for r, one in zip(runs, by_level["1"])]
                for name, key in RATIOS.items()}
            for c, runs in by_level.items()}


def table(engines: dict) -> str:
    names = list(engines)
    rows = ["| concurrency | " + " | ".join(f"{n} {what}" for what in ("p50 ms", "p99 ms", "completion tokens/s")
                                           for n in names) + " |",
            "|---" * (1 + 3 * len(names)) + "|"]
    for c in engines[names[0]]:
        cells = [f"{engines[n][c][k]:.1f}" for k in ("p50Ms", "p99Ms", "completionTokensPerSecond") for n in names]
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def cpu_table(engines: dict) -> str:
    """CPU ms per request by process, per engine and level (empty without /proc)."""
    rows = ["| engine | concurrency | " + " | ".join(f"{w.lower()} ms" for w in CPU_WHO) + " | cores busy |",
            "|---" * (3 + len(CPU_WHO)) + "|"]
    for name, by_level in engines.items():
        for c, m in by_level.items():
            if "cpuCoresBusy" in m:
                rows.append(f"| {name} | {c} | " + " | ".join(f"{m[f'cpu{w}MsPerRequest']:.1f}" for w in CPU_WHO)
                            + f" | {m['cpuCoresBusy']:.2f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200,
                    help="counted requests per level, at least 4 per client (fewer: the p50 ratios swing by 0.3x)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over every engine and level; medians reported")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="the batched engine's max_batch_size (default: the serve app's own default)")
    ap.add_argument("--no-unbatched", action="store_true", help="measure the batched engine only")
    ap.add_argument("--replicas", type=int, default=1, help="replicas of each engine's deployment")
    ap.add_argument("--timeout", type=float, default=120, help="seconds one request may take")
    ap.add_argument("--lock-wait", type=float, default=900, help="seconds to wait for the host-wide Ray lock")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    lock = take_lock(args.lock_wait)   # one local Ray on the machine
    # Ray's default token auth, with a token for this run in the env instead of ~/.ray/auth_token;
    # before `import ray`, which reads RAY_AUTH_MODE once
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    import ray
    from ray import serve

    from tpuft_workload.serve import MAX_BATCH_SIZE_DEFAULT

    batch = args.max_batch_size or MAX_BATCH_SIZE_DEFAULT
    engines = {f"batched{batch}": batch, **({} if args.no_unbatched else {UNBATCHED: 1})}
    repeats: dict = {name: {str(c): [] for c in levels} for name in engines}
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="tpuft-bench-serve-") as tmp:
            urls = run_apps(export_tiny(f"{tmp}/export"), engines, args.replicas, free_port())
            for url in urls.values():
                one_level(url, instructions(4), 1, args.max_tokens, args.timeout)
            for rep in range(args.repeats):
                # one engine's levels back to back: its ratios compare levels a minute apart, so a
                # host that speeds up or slows down between repeats moves both sides of a ratio
                for name, url in urls.items():
                    for c in levels:
                        one_level(url, instructions(c), c, args.max_tokens, args.timeout)   # warm-up round
                        r = one_level(url, instructions(max(args.requests, 4 * c)), c, args.max_tokens, args.timeout,
                                      engine=name if os.path.isdir("/proc") else None)
                        repeats[name][str(c)].append({k: (round(v, 2) if isinstance(v, float) else v)
                                                      for k, v in r.items()})
                        say(f"repeat {rep + 1} {name} concurrency {c}: {repeats[name][str(c)][-1]}")
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        fcntl.flock(lock, fcntl.LOCK_UN)
    results: dict = {"engines": {n: {c: medians(runs) for c, runs in by_level.items()} for n, by_level in repeats.items()}}
    results["vsOneClientPerRepeat"] = {n: paired_ratios(by_level) for n, by_level in repeats.items() if "1" in by_level}
    results["vsOneClient"] = {n: {c: {k: round(statistics.median(v), 2) for k, v in r.items()} for c, r in by_c.items()}
                              for n, by_c in results["vsOneClientPerRepeat"].items()}
    results["repeats"] = repeats
    results["config"] = {"model": "builtin:tiny-llama (untrained, seed 0)", "maxTokens": args.max_tokens,
                         "temperature": 0, "replicas": args.replicas, "engines": engines, "repeats": args.repeats,
                         "command": " ".join([Path(sys.executable).name, *sys.argv]),
                         "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "loadAverage": [round(x, 2) for x in os.getloadavg()]}
    print(table(results["engines"]))
    print(cpu_table(results["engines"]))
    print(json.dumps({"vsOneClient": results["vsOneClient"], "perRepeat": results["vsOneClientPerRepeat"]}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
