"""Benchmark: the GKE tutorial's recipe (pad every example to 512) vs sequence packing, on CPU.

Same tiny model (builtin:tiny-llama), same batch size, same number of optimizer steps for
both recipes; what changes is how many real (non-padding) tokens each step carries.
Two datasets:
  dolly-mini   the shipped builtin:dolly-mini (short records, median ~60 tokens)
  dolly-shape  synthetic records with a dolly-15k-like length distribution: log-normal,
               median ~150 tokens, long tail (a few beyond 512, which the tutorial's recipe truncates)

    .venv/bin/python bench/packing.py [--steps 20] [--batch 4] [--seq 512]

Prints a table and writes bench/results/packing.json. Single process, no Ray: this measures
the data recipe, not the cluster.
"""
from __future__ import annotations

import argparse
import json
import math
import platform as _platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "packing.json"
sys.path.insert(0, str(REPO))  # tests.workload.inprocess_data

import torch  # noqa: E402

from tests.workload.inprocess_data import build_blocks, collate, load_records  # noqa: E402
from tpuft_workload import data, tiny  # noqa: E402


def synthetic_records(tok, n: int, seed: int, median_tokens: float = 150.0, sigma: float = 0.75) -> list[dict]:
    """Records whose token counts follow a dolly-15k-like log-normal (prompt ~1/3, response ~2/3)."""
    rng = random.Random(seed)
    words = [w for w in tok.get_vocab() if w.isalpha()]
    records = []
    for _ in range(n):
        total = max(8, min(4000, int(math.exp(rng.gauss(math.log(median_tokens), sigma)))))
        has_ctx = rng.random() < 0.3
        p = max(3, total // 3)
        ctx = " ".join(rng.choices(words, k=p // 2)) if has_ctx else ""
        instr = " ".join(rng.choices(words, k=max(2, p - len(ctx.split()))))
        resp = " ".join(rng.choices(words, k=max(1, total - p - 12)))  # ~12 tokens of template
        records.append({"instruction": instr, "context": ctx, "response": resp, "category": "synthetic"})
    return records


class _Runner:
    """One recipe: its own tiny model/optimizer, its rows, its counters."""

    def __init__(self, tok, blocks: list, steps: int, batch: int, seed: int):
        self.blocks, self.batch = blocks, batch
        self.model = tiny.build_model(len(tok), seed=0)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        order = list(range(len(blocks)))
        random.Random(seed).shuffle(order)
        need = (steps + 1) * batch
        self.order = (order * (need // len(order) + 1))[:need]
        self.real = self.padded = 0
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self, s: int) -> None:
        idx = self.order[s * self.batch:(s + 1) * self.batch]
        b = collate(self.blocks, idx)
        t0 = time.perf_counter()
        loss = self.model(**b).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.loss = float(loss.detach())
        if s:  # step 0 is warm-up, not timed
            self.times.append(dt)
            self.real += sum(self.blocks[i].n_real for i in idx)
            self.padded += b["input_ids"].numel()

    def summary(self) -> dict:
        secs = sum(self.times)
        med = statistics.median(self.times)
        steps_per_epoch = math.ceil(len(self.blocks) / self.batch)
        return {"rows": len(self.blocks), "padFraction": round(data.pad_fraction(self.blocks), 4),
                "stepTimeSeconds": round(med, 4),
                "realTokensPerSecond": round(self.real / secs, 1),
                "paddedTokensPerSecond": round(self.padded / secs, 1),
                "stepsPerEpoch": steps_per_epoch, "realTokensPerEpoch": sum(b.n_real for b in self.blocks),
                "estimatedEpochSeconds": round(steps_per_epoch * med, 2), "lastLoss": round(self.loss, 4)}


def run_pair(tok, recs: list[dict], steps: int, batch: int, seq: int, seed: int) -> dict:
    """Both recipes, steps interleaved so they share whatever load the machine has."""
    runners = {"seed-pad-to-max": _Runner(tok, build_blocks(tok, recs, seq, False), steps, batch, seed),
               "packed": _Runner(tok, build_blocks(tok, recs, seq, True), steps, batch, seed)}
    for s in range(steps + 1):
        for r in runners.values():
            r.step(s)
    return {k: r.summary() for k, r in runners.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: least sensitive to machine load)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = tiny.build_tokenizer()
    datasets = {
        "dolly-mini": load_records("builtin:dolly-mini", "train")[:a.records],
        "dolly-shape": synthetic_records(tok, a.records, a.seed),
    }
    results = {}
    for name, recs in datasets.items():
        layout = data.recordslib.detect(recs[0].keys())
        lengths = sorted(len(data.example_of(tok, r, layout, n).input_ids) for n, r in enumerate(recs, start=1))
        row = {"records": len(recs), "medianTokens": lengths[len(lengths) // 2],
               "p90Tokens": lengths[int(len(lengths) * 0.9)], "maxTokens": lengths[-1],
               "overSeq": sum(n > a.seq for n in lengths)}
        row.update(run_pair(tok, recs, a.steps, a.batch, a.seq, a.seed))
        s, p = row["seed-pad-to-max"], row["packed"]
        row["realTokensPerSecondRatio"] = round(p["realTokensPerSecond"] / s["realTokensPerSecond"], 2)
        row["epochSpeedup"] = round(s["estimatedEpochSeconds"] / p["estimatedEpochSeconds"], 2)
        results[name] = row

    hdr = f"{'dataset':<12} {'recipe':<16} {'rows':>5} {'pad%':>6} {'step s':>7} {'real tok/s':>11} {'padded tok/s':>13} {'epoch s':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name, row in results.items():
        for recipe in ("seed-pad-to-max", "packed"):
            r = row[recipe]
            print(f"{name:<12} {recipe:<16} {r['rows']:>5} {100 * r['padFraction']:>5.1f}% {r['stepTimeSeconds']:>7.3f} "
                  f"{r['realTokensPerSecond']:>11.1f} {r['paddedTokensPerSecond']:>13.1f} {r['estimatedEpochSeconds']:>8.2f}")
        print(f"{name:<12} {'packed/seed':<16} real tokens/s x{row['realTokensPerSecondRatio']}, "
              f"epoch time /{row['epochSpeedup']} (median {row['medianTokens']} tokens, "
              f"{row['overSeq']} records > {a.seq} truncated by the tutorial's recipe)")
    out = {"config": {"steps": a.steps, "batch": a.batch, "seq": a.seq, "records": a.records, "seed": a.seed,
                      "model": "builtin:tiny-llama", "device": "cpu", "torchThreads": torch.get_num_threads(),
                      "machine": _platform.machine(), "python": _platform.python_version(),
                      "torch": torch.__version__},
           "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
