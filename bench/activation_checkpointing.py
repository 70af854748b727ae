"""Benchmark: activation checkpointing (spec.training.activationCheckpointing) off and on, one CPU worker.

Each setting runs in a fresh process (torch.multiprocessing spawn: a peak RSS of its own), a world
of one over gloo (no Ray: this measures the step, not the cluster), with the workload's own pieces:
the built-in Llama built larger than the tests' tiny one (--hidden, --layers), sharded by
tpuft_workload.model.shard (FSDP2, each decoder layer wrapped first when on), the step's objective
tpuft_workload.model.token_mean_loss, clipping and AdamW with tpuft_workload.model.decay_groups, on
random tokens in rows of --seq-len (position_ids as packed rows carry). Reported per setting: the
peak RSS the steps add over the model and optimizer (ru_maxrss after the steps minus before them,
the optimizer state allocated first), the bytes autograd keeps for the backward in one
forward (saved_tensors_hooks: a checkpointed layer keeps only its input), the first step's loss
(the same both ways) and the median step time.

    .venv/bin/python bench/activation_checkpointing.py [--seq-len 4096] [--hidden 256] [--layers 8]

Prints a table and writes bench/results/activation_checkpointing.json.
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
OUT = REPO / "bench" / "results" / "activation_checkpointing.json"
sys.path.insert(0, str(REPO))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(_: int, init_method: str, on: bool, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tpuft_workload import model as modellib
    from tpuft_workload import tiny
    from tpuft_workload.platform import PLATFORMS

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    vocab = len(tiny.build_tokenizer())
    model = tiny.build_model(vocab, seed=0, hidden=args.hidden, layers=args.layers)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, args.seq_len)
    params = modellib.shard(model, init_device_mesh("cpu", (1,)), PLATFORMS["cpu"], torch.device("cpu"),
                            activation_checkpointing=on)
    opt = torch.optim.AdamW(modellib.decay_groups(model, 0.01), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (args.batch, args.seq_len), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(args.seq_len).repeat(args.batch, 1)}

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss_sum, labelled = modellib.token_mean_loss(model, [batch])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (loss_sum / labelled).item(), time.perf_counter() - t0

    kept = 0

    def pack(t):
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    for p in params:   # the optimizer's state allocated before measuring (a zero gradient moves nothing)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = _rss_mb()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        first_loss, first_time = step()
    times = [first_time] + [step()[1] for _ in range(args.steps - 1)]
    result = {"activationCheckpointing": on, "peakRssAddedMb": round(_rss_mb() - before, 1),
              "peakRssMb": round(_rss_mb(), 1), "keptForBackwardMb": round(kept / 2**20, 1),
              "firstLoss": first_loss, "stepSecondsMedian": round(statistics.median(times), 3)}
    Path(out, f"{int(on)}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(on: bool, args: argparse.Namespace, out: str) -> dict:
    from tests.ranks import spawn_ranks

    spawn_ranks(_worker, 1, on, args, out)
    return json.loads(Path(out, f"{int(on)}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens a row (maxSeqLength)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="rows a step")
    ap.add_argument("--steps", type=int, default=3, help="steps measured")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpuft-bench-ac-") as out:
        off, on = (run(flag, args, out) for flag in (False, True))
    result = {"machine": {"cpus": os.cpu_count(), "python": _platform.python_version(),
                          "load1": round(os.getloadavg()[0], 2)},
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": [off, on],
              "ratios": {"peakRssAdded": round(on["peakRssAddedMb"] / max(off["peakRssAddedMb"], 1e-9), 3),
                         "keptForBackward": round(on["keptForBackwardMb"] / off["keptForBackwardMb"], 3),
                         "stepTime": round(on["stepSecondsMedian"] / off["stepSecondsMedian"], 3)}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| activation checkpointing | peak RSS added by the steps | kept for backward | first loss | step (median) |")
    print("|---|---|---|---|---|")
    for r in (off, on):
        print(f"| {'on' if r['activationCheckpointing'] else 'off'} | {r['peakRssAddedMb']} MB | "
              f"{r['keptForBackwardMb']} MB | {r['firstLoss']:.6f} | {r['stepSecondsMedian'] * 1000:.0f} ms |")
    print(f"\non / off: {result['ratios']}  (load average {result['machine']['load1']}; written to {args.out})")


if __name__ == "__main__":
    main()
