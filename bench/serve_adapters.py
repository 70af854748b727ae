"""Tokens/s of the `transformers` engine serving LoRA adapters on one base (tpuft_workload.serve.Engine
with adapters_root, its model in tpuft_workload.engine_process): the same closed-loop traffic sent to
the base alone, to one adapter, and to a mix of 4 adapters, in the same run.

    .venv/bin/python bench/serve_adapters.py --clients 8 --requests 32 --max-tokens 16 --repeats 3 --out bench/results/serve_adapters.json

The base is the builtin tiny model (hidden 64, 2 layers; --hidden/--layers for a bigger one), written
by checkpoint.export_hf into a temporary folder; 4 adapters (rank 8 on q/k/v/o and the MLP, lora_B
seeded non-zero so each answers differently) are published into its adapters root with
tpuft_workload.adapters.publish, as the operator's publish job does. One engine, max_adapters 4 (every
adapter stays loaded: the mix measures batching per adapter, not reloading) and max_batch_size 16.

Traffic: --clients client coroutines, each sending its next request when its answer comes back,
--requests requests in all per scenario after one warm-up round of --clients requests. A request is
one user message (a dolly-mini instruction, in order), max_tokens --max-tokens, temperature 0, not
streamed. Scenarios, run back to back in every repeat (the order rotated by one each repeat):
  base     every request to the base model id
  one      every request to <base>:a1
  mix4     client i to <base>:a<1 + i mod 4> (requests for 4 adapters interleave all the time)
Per scenario (results["scenarios"][<name>], medians over --repeats; every repeat in results["repeats"]):
  completionTokensPerSecond   completion tokens summed / wall time
  p50Ms                       request latency (engine.answer, no HTTP)
  meanBatchRows               rows per batch admission (the engine process's batch_sizes)
results["mix4VsOne"] and ["oneVsBase"]: the per-repeat tokens/s ratios' medians (each ratio is taken
within one repeat, whose scenarios ran back to back). No Ray: the replica's HTTP and Ray Serve's proxy
are left out, so the figures are the engine's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from serve_latency import instructions, percentile  # noqa: E402  (the prompts and percentiles serve_latency uses)
BASE_ID = "tiny-base"
ADAPTERS = ("a1", "a2", "a3", "a4")
SCENARIOS = ("base", "one", "mix4")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def say(msg: str) -> None:
    print(f"[serve_adapters] {msg}", file=sys.stderr, flush=True)


def write_base(dest: str, hidden: int, layers: int) -> str:
    from tpuft_workload import checkpoint, tiny

    tok = tiny.build_tokenizer()
    return checkpoint.export_hf(tiny.build_model(len(tok), seed=0, hidden=hidden, layers=layers), tok, dest, rank=0)


def write_adapter(base: str, dest: Path, seed: int, rank: int) -> str:
    """A LoRA export of `base` as training writes one (adapter, tokenizer, generation config)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(str(dest))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(dest))
    GenerationConfig.from_pretrained(base).save_pretrained(str(dest))
    return str(dest)


def model_of(scenario: str, client: int) -> str:
    if scenario == "base":
        return BASE_ID
    if scenario == "one":
        return f"{BASE_ID}:{ADAPTERS[0]}"
    return f"{BASE_ID}:{ADAPTERS[client % len(ADAPTERS)]}"


async def drive(engine, scenario: str, clients: int, requests: int, max_tokens: int, prompts: list[str]) -> dict:
    """`requests` requests from `clients` closed-loop clients; tokens/s, p50, rows per batch."""
    from tpuft_workload import chat_api

    left = iter(range(requests))
    latencies, tokens = [], 0

    async def client(i: int) -> None:
        nonlocal tokens
        for n in left:
            req = chat_api.parse_request({"model": model_of(scenario, i), "max_tokens": max_tokens,
                                          "temperature": 0, "messages": [{"role": "user", "content": prompts[n]}]})
            start = time.perf_counter()
            answer = await engine.answer(req)
            latencies.append(time.perf_counter() - start)
            tokens += answer.completion_tokens
    before = len(engine.process.batch_sizes())
    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - start
    sizes = engine.process.batch_sizes()[before:]
    return {"completionTokensPerSecond": round(tokens / wall, 1), "p50Ms": round(percentile(latencies, 50) * 1e3, 1),
            "meanBatchRows": round(statistics.mean(sizes), 2) if sizes else None, "requests": len(latencies),
            "completionTokens": tokens, "wallS": round(wall, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96, help="counted requests per scenario and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64, help="the base's hidden size (the tiny model's: 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8, help="the adapters' LoRA rank")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_adapters.json"))
    a = ap.parse_args(argv)

    from tpuft_workload import adapters, serve

    prompts = instructions(a.requests + a.clients)
    results: dict = {"command": " ".join(["bench/serve_adapters.py", *(argv if argv is not None else sys.argv[1:])]),
                     "clients": a.clients, "requests": a.requests, "maxTokens": a.max_tokens, "hidden": a.hidden,
                     "layers": a.layers, "rank": a.rank, "repeats": []}
    with tempfile.TemporaryDirectory(prefix="tpuft-bench-adapters-") as tmp:
        base = write_base(f"{tmp}/base", a.hidden, a.layers)
        root = f"{tmp}/adapters"
        for seed, name in enumerate(ADAPTERS, start=1):
            export = write_adapter(base, Path(tmp, f"export-{name}"), seed, a.rank)
            adapters.publish(export, root, name, f"bench/{name}", f"uid-{name}", "bench", None)
        engine = serve.Engine(serve.parse_args({"model_source": base, "model_id": BASE_ID, "adapters_root": root,
                                                "max_adapters": len(ADAPTERS)}))
        try:
            for repeat in range(a.repeats):
                round_: dict = {}
                order = SCENARIOS[repeat % 3:] + SCENARIOS[:repeat % 3]   # rotated: no scenario always first
                for scenario in order:
                    asyncio.run(drive(engine, scenario, a.clients, a.clients, a.max_tokens, prompts))   # warm-up
                    round_[scenario] = asyncio.run(drive(engine, scenario, a.clients, a.requests, a.max_tokens,
                                                         prompts[a.clients:]))
                    say(f"repeat {repeat + 1}/{a.repeats} {scenario}: {round_[scenario]}")
                results["repeats"].append(round_)
        finally:
            engine.close()
    reps = results["repeats"]
    results["scenarios"] = {s: {k: statistics.median(r[s][k] for r in reps)
                                for k in ("completionTokensPerSecond", "p50Ms", "meanBatchRows")}
                            for s in SCENARIOS}

    def ratio(x: str, y: str) -> float:
        return round(statistics.median(r[x]["completionTokensPerSecond"] / r[y]["completionTokensPerSecond"]
                                       for r in reps), 3)
    results["mix4VsOne"], results["oneVsBase"] = ratio("mix4", "one"), ratio("one", "base")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'scenario':<8} {'tokens/s':>10} {'p50 ms':>8} {'rows/batch':>10}")
    for s, row in results["scenarios"].items():
        print(f"{s:<8} {row['completionTokensPerSecond']:>10} {row['p50Ms']:>8} {row['meanBatchRows']:>10}")
    print(f"mix4/one tokens/s: {results['mix4VsOne']}  one/base: {results['oneVsBase']}  -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
