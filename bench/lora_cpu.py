"""Benchmark: full fine-tuning vs LoRA on 2 CPU workers (gloo, FSDP2), one run, the same data.

Each method runs in its own 2 worker processes (torch.multiprocessing, no Ray: this measures the
training step, not the cluster) over the built-in Llama built larger than the tests' tiny one
(--hidden, --layers), the built-in dolly-mini packed into 128-token rows, the workload's own
pieces: tpuft_workload.model.shard (FSDP2), tpuft_workload.lora.wrap (PEFT), and
tpuft_workload.checkpoint.save (DCP; LoRA's holds the adapters only). Reported per method:
trainable and total parameters, the checkpoint's size on disk, the median step time after
--warmup steps, each worker's peak RSS (ru_maxrss: torch's own ~0.4 GB included).

    .venv/bin/python bench/lora_cpu.py [--hidden 512] [--layers 4] [--steps 12] [--rank 16]

Prints a table and writes bench/results/lora_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "lora_cpu.json"
sys.path.insert(0, str(REPO))  # tests.workload.inprocess_data, in the spawned workers too
WORLD = 2


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _worker(rank: int, init_method: str, method: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.workload.inprocess_data import build_blocks, collate, load_records
    from tpuft.api.constants import LORA_DEFAULT_TARGET_MODULES
    from tpuft_workload import checkpoint, lora, tiny
    from tpuft_workload import model as modellib
    from tpuft_workload.platform import PLATFORMS

    torch.set_num_threads(1)   # the 2 workers share the 2 cores, as the tests' do
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(len(tok), seed=0, hidden=args.hidden, layers=args.layers)
    if method == "lora":
        settings = lora.LoraSettings(rank=args.rank, alpha=2 * args.rank, dropout=0.05,
                                     target_modules=LORA_DEFAULT_TARGET_MODULES["llama"])
        model = lora.wrap(model, settings)
    params = modellib.shard(model, init_device_mesh("cpu", (WORLD,)), PLATFORMS["cpu"], torch.device("cpu"))
    trainable, total = lora.parameter_counts(model)
    opt = torch.optim.AdamW(params, lr=1e-3 if method == "full" else 1e-2, weight_decay=0.01)
    blocks = build_blocks(tok, load_records("builtin:dolly-mini", "train"), 128, packing=True)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        rows = [(step * WORLD * args.batch + rank * args.batch + i) % len(blocks) for i in range(args.batch)]
        batch = collate(blocks, rows)
        t0 = time.perf_counter()
        loss = model(**{k: batch[k] for k in ("input_ids", "labels", "position_ids")}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    ckpt = Path(out) / f"{method}-checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)   # each rank writes its shard into the shared folder
    checkpoint.save(model, opt, {"step": args.steps}, str(ckpt), rank, trainable_only=method == "lora")
    dist.barrier()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"rank": rank, "trainable": trainable, "total": total, "stepSeconds": statistics.median(times),
              "peakRssMb": round(peak_mb), "firstLoss": losses[0], "lastLoss": losses[-1],
              "checkpointBytes": _dir_bytes(ckpt) if rank == 0 else None}
    Path(out, f"{method}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(method: str, args: argparse.Namespace, out: str) -> dict:
    from tests.ranks import spawn_ranks

    spawn_ranks(_worker, WORLD, method, args, out)
    ranks = [json.loads(Path(out, f"{method}-{r}.json").read_text()) for r in range(WORLD)]
    first = ranks[0]
    return {"method": method, "trainableParameters": first["trainable"], "totalParameters": first["total"],
            "checkpointMB": round(first["checkpointBytes"] / 1e6, 2),
            "stepSecondsMedian": round(statistics.median(r["stepSeconds"] for r in ranks), 4),
            "peakRssMbPerWorker": [r["peakRssMb"] for r in ranks],
            "loss": [round(first["firstLoss"], 3), round(first["lastLoss"], 3)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="rows per worker per step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="tpuft-bench-lora-") as out:
        rows = [run(m, args, out) for m in ("full", "lora")]
    full, lo = rows
    result = {"machine": {"cpus": os.cpu_count(), "python": _platform.python_version(),
                          "load1": round(os.getloadavg()[0], 2)},
              "args": vars(args), "runs": rows,
              "ratios": {"trainable": round(lo["trainableParameters"] / full["trainableParameters"], 4),
                         "checkpoint": round(lo["checkpointMB"] / full["checkpointMB"], 4),
                         "stepTime": round(lo["stepSecondsMedian"] / full["stepSecondsMedian"], 3),
                         "peakRss": round(max(lo["peakRssMbPerWorker"]) / max(full["peakRssMbPerWorker"]), 3)}}
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print("| method | trainable / total parameters | checkpoint | step (median) | peak RSS per worker | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['trainableParameters']:,} / {r['totalParameters']:,} | {r['checkpointMB']} MB | "
              f"{r['stepSecondsMedian'] * 1000:.0f} ms | {', '.join(f'{m} MB' for m in r['peakRssMbPerWorker'])} | "
              f"{r['loss'][0]} -> {r['loss'][1]} |")
    print(f"\nLoRA / full: {result['ratios']}  (load average {result['machine']['load1']}; written to {OUT})")


if __name__ == "__main__":
    main()
