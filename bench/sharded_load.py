"""Benchmark: loading a saved model shard by shard vs every rank loading the whole model.

A synthetic Llama (default about 1.1B parameters: TinyLlama's shape, random weights) saved once
as sharded safetensors in bf16 (as the Hub's checkpoints are), then loaded in fp32 (the optimizer's
master copy) by N gloo CPU workers (torch.multiprocessing) both ways:
  full     today's path before sharding: from_pretrained in fp32 on every rank, then FSDP2
  sharded  tpuft_workload.sharded_load: built on the meta device, FSDP2, each rank reads its rows
Per worker: peak RSS (VmHWM) once loaded and, for --step-workers, after the first optimizer
step (AdamW, one sequence of 32 tokens: on CPU the shard's gradients and moments are host memory
too, 12 bytes a parameter, where a TPU holds them in HBM), the seconds to each, and the bytes of
tensor data read.

    .venv/bin/python bench/sharded_load.py [--workers 2,4] [--step-workers 2] [--hidden 2048 --layers 22]

The model is written once under --cache (about 2.2 GB in bf16 at the default size). Writes
bench/results/sharded_load.json by default. One configuration at a time: both paths of N workers
share the machine's memory, so a full load of 4 workers needs 4 x the model's fp32 bytes.
"""
from __future__ import annotations

import argparse
import json
import platform as _platform
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "sharded_load.json"


def _config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                       num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                       num_key_value_heads=max(1, hidden // 512), max_position_embeddings=2048,
                       tie_word_embeddings=False, use_cache=False)


def save_model(folder: Path, hidden: int, layers: int) -> int:
    """The synthetic model's safetensors under `folder` (written once); its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    from tpuft_workload import sharded_load

    marker = folder / "parameters.txt"
    if marker.exists():
        return int(marker.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(hidden, layers)).to(torch.bfloat16)   # as checkpoints on the Hub are
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size="1GB")
    del model
    assert sharded_load.loadable(str(folder))
    marker.write_text(str(count))
    return count


def _worker(rank: int, world: int, port: int, folder: str, path: str, out: str, step: bool) -> None:
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpuft_workload import model as modellib
    from tpuft_workload import sharded_load
    from tpuft_workload.platform import PLATFORMS

    cpu = PLATFORMS["cpu"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = modellib.device_mesh(cpu, world)
    read = 0
    if path == "full":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        read = sum(p.numel() * 2 for p in model.parameters())   # every tensor of the bf16 files
        params = modellib.shard(model, mesh, cpu, torch.device("cpu"))
    else:
        with sharded_load.parameters_on_meta():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        params = modellib.shard(model, mesh, cpu, torch.device("cpu"))
        read = sharded_load.fill(model, folder)["bytes"]
    loaded = time.perf_counter() - t0
    at_load = sharded_load.peak_rss_bytes()
    first_step = None
    if step:   # on CPU the step adds the shard's gradients and AdamW's moments (12 bytes a parameter)
        opt = torch.optim.AdamW(params, lr=1e-5)
        ids = torch.arange(32).unsqueeze(0) % 1000
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        first_step = round(time.perf_counter() - t0, 2)
    result = {"rank": rank, "peak_rss_bytes_at_load": at_load, "peak_rss_bytes": sharded_load.peak_rss_bytes(),
              "seconds_to_load": round(loaded, 2), "seconds_to_first_step": first_step, "bytes_read": read}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run(folder: Path, world: int, path: str, step: bool) -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.start_processes(_worker, args=(world, port, str(folder), path, out.name, step), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048: about 1.1B parameters with 22 layers)")
    p.add_argument("--layers", type=int, default=22, help="decoder layers (default 22)")
    p.add_argument("--paths", default="full,sharded", help="which loads to run (default full,sharded)")
    p.add_argument("--step-workers", default="2",
                   help="worker counts that also take the first optimizer step (default 2: on CPU the step "
                        "holds the shard's gradients and AdamW's moments in host memory too)")
    p.add_argument("--cache", type=Path, default=Path("/tmp/tpuft-bench-sharded-model"),
                   help="where the synthetic model is written once (default /tmp/tpuft-bench-sharded-model)")
    p.add_argument("--out", type=Path, default=OUT, help=f"results JSON (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    folder = args.cache / f"llama-h{args.hidden}-l{args.layers}-bf16"
    parameters = save_model(folder, args.hidden, args.layers)
    model_bytes = parameters * 4
    print(f"model: {parameters / 1e9:.2f}B parameters, {model_bytes / 2**30:.2f} GiB in fp32, {folder}")
    rows = []
    stepping = {int(w) for w in args.step_workers.split(",") if w}
    for world in (int(w) for w in args.workers.split(",")):
        for path in args.paths.split(","):
            workers = run(folder, world, path, world in stepping)

            def gib(key: str, pick=statistics.median) -> float:
                return round(pick(w[key] for w in workers) / 2**30, 2)

            row = {"workers": world, "path": path, "peak_rss_gib_at_load_median": gib("peak_rss_bytes_at_load"),
                   "peak_rss_gib_at_load_max": gib("peak_rss_bytes_at_load", max),
                   "peak_rss_gib_after_first_step_median": gib("peak_rss_bytes") if world in stepping else None,
                   "seconds_to_load_median": statistics.median(w["seconds_to_load"] for w in workers),
                   "seconds_to_first_step_median": (statistics.median(w["seconds_to_first_step"] for w in workers)
                                                    if world in stepping else None),
                   "gib_read_per_worker_median": gib("bytes_read"),
                   "target_gib_at_load": round((model_bytes / world) / 2**30 + 1.5, 2), "per_worker": workers}
            rows.append(row)
            stepped = (f", after the first step {row['peak_rss_gib_after_first_step_median']:.2f} GiB at "
                       f"{row['seconds_to_first_step_median']:.1f} s" if world in stepping else "")
            print(f"{world} workers {path:8s} peak RSS at load median {row['peak_rss_gib_at_load_median']:6.2f} GiB "
                  f"(max {row['peak_rss_gib_at_load_max']:.2f}; target {row['target_gib_at_load']:.2f}), loaded in "
                  f"{row['seconds_to_load_median']:.1f} s, read {row['gib_read_per_worker_median']:.2f} GiB/worker"
                  f"{stepped}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"parameters": parameters, "fp32_bytes": model_bytes, "rows": rows,
                                    "machine": {"python": sys.version.split()[0], "cpu": _platform.processor() or
                                                _platform.machine()}}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
