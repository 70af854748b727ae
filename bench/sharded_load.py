"""Benchmark: loading a saved model shard by shard vs every rank loading the whole model.

A synthetic Llama (default about 1.1B parameters: TinyLlama's shape, random weights) saved once
as sharded safetensors in bf16 (as the Hub's checkpoints are), then loaded in fp32 (the optimizer's
master copy) by N gloo CPU workers (torch.multiprocessing) both ways:
  full     today's path before sharding: from_pretrained in fp32 on every rank, then FSDP2
  sharded  tpuft_workload.sharded_load: built on the meta device, FSDP2, each rank reads its rows
Per worker: peak RSS (VmHWM) once loaded and, for --step-workers, after the first optimizer
step (AdamW, one sequence of 32 tokens: on CPU the shard's gradients and moments are host memory
too, 12 bytes a parameter, where a TPU holds them in HBM), the seconds to each, and the bytes of
tensor data read; where the process may make cgroup v1 memory groups (root), each rank runs in its own
and its usage, the kubelet's working set and Ray's "used" are sampled per phase (PodMemory).

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


def save_model(folder: Path, hidden: int, layers: int, dtype: str = "bfloat16") -> int:
    """The synthetic model's safetensors under `folder` in `dtype` (written once); its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    from tpuft_workload import sharded_load

    marker = folder / "parameters.txt"
    if marker.exists():
        return int(marker.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(hidden, layers)).to(getattr(torch, dtype))   # bf16: as the Hub's are
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size="1GB")
    del model
    assert sharded_load.loadable(str(folder))
    marker.write_text(str(count))
    return count


CGROUP_ROOT = Path("/sys/fs/cgroup/memory")   # cgroup v1's memory controller, as the local cluster's kubelet uses


class PodMemory:
    """A rank's own cgroup, read as the kubelet and Ray's memory monitor read a pod's: usage (page
    cache included), the working set (usage - inactive_file: the kubelet's eviction figure) and
    Ray 2.60's "used" (usage - inactive_file - active_file: its memory monitor's, which kills a
    worker at 95% of the limit). A thread samples them every 50 ms (Ray's monitor: every 250)
    and keeps each phase's peak."""

    KEYS = ("usage", "working_set", "ray_used", "rss", "cache", "active_file", "inactive_file", "mapped_file")

    def __init__(self, folder: Path):
        import threading

        self.folder, self.phase, self.peaks, self.marks = folder, "runtime", {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def read(self) -> dict[str, int]:
        stat = dict(line.split() for line in (self.folder / "memory.stat").read_text().splitlines())
        usage = int((self.folder / "memory.usage_in_bytes").read_text())
        inactive, active = int(stat["total_inactive_file"]), int(stat["total_active_file"])
        return {"usage": usage, "working_set": usage - inactive, "ray_used": usage - inactive - active,
                "rss": int(stat["total_rss"]), "cache": int(stat["total_cache"]), "active_file": active,
                "inactive_file": inactive, "mapped_file": int(stat["total_mapped_file"])}

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self._note(self.read())

    def _note(self, now: dict[str, int]) -> None:
        peak = self.peaks.setdefault(self.phase, dict(now))
        for key in self.KEYS:
            peak[key] = max(peak[key], now[key])

    def mark(self, phase_done: str, next_phase: str) -> None:
        """`phase_done` is over: its figures now, and its peaks; `next_phase` starts."""
        now = self.read()
        self._note(now)
        self.marks[phase_done] = now
        self.phase = next_phase

    def close(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        max_usage = int((self.folder / "memory.max_usage_in_bytes").read_text())
        return {"max_usage": max_usage, "at_end_of": self.marks, "peak_in": self.peaks}


def _cgroup(rank: int) -> Path | None:
    """A fresh memory cgroup for one rank (root and cgroup v1 needed; None without them)."""
    folder = CGROUP_ROOT / f"tpuft-bench-rank{rank}"
    try:
        if folder.exists():
            folder.rmdir()
        folder.mkdir()
    except OSError:
        return None
    return folder


def _remove_cgroup(folder: Path) -> None:
    for _ in range(50):   # the rank's process must have left it; bounded
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _drop_file_cache(folder: Path) -> None:
    """The checkpoint's pages out of the page cache (clean pages: a hint the kernel honours), so
    each run reads cold, as a fresh pod does, and the pages it reads are charged to its cgroup."""
    import os

    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)   # a page still dirty (a model just written) is not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _lora():
    """examples/local-cpu-lora.yaml's adapters (rank 8, alpha 16, the CRD's dropout) on Llama's default targets."""
    from tpuft.constants import LORA_DEFAULT_TARGET_MODULES
    from tpuft_workload.lora import LoraSettings

    return LoraSettings(rank=8, alpha=16, dropout=0.05, target_modules=tuple(LORA_DEFAULT_TARGET_MODULES["llama"]))


def _worker(rank: int, world: int, port: int, folder: str, path: str, out: str, step: bool, method: str = "full",
            batch: int = 1, seq: int = 32, cgroup: str | None = None) -> None:
    t0 = time.perf_counter()
    pod = PodMemory(Path(cgroup)) if cgroup else None
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpuft_workload import lora as loralib
    from tpuft_workload import model as modellib
    from tpuft_workload import sharded_load
    from tpuft_workload.platform import PLATFORMS

    cpu = PLATFORMS["cpu"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = modellib.device_mesh(cpu, world)
    if pod:
        pod.mark("runtime", "load")
    read = 0
    if path == "full":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        read = sum(p.numel() * p.element_size() for p in model.parameters())   # every tensor of the files
        read = read if folder.endswith("float32") else read // 2
        model = loralib.wrap(model, _lora()) if method == "lora" else model
        params = modellib.shard(model, mesh, cpu, torch.device("cpu"))
    else:
        with sharded_load.parameters_on_meta():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        model = loralib.wrap(model, _lora()) if method == "lora" else model   # as train.py: before sharding
        params = modellib.shard(model, mesh, cpu, torch.device("cpu"))
        read = sharded_load.fill(model, folder)["bytes"]
    loaded = time.perf_counter() - t0
    at_load = sharded_load.peak_rss_bytes()
    first_step = None
    if pod:
        pod.mark("load", "forward")
    if step:   # full: the step adds the shard's gradients and AdamW's moments (12 bytes a parameter) on CPU
        opt = torch.optim.AdamW(modellib.decay_groups(model, 0.0), lr=1e-5)
        model.train()
        ids = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss   # one micro-batch of model.token_mean_loss
        if pod:
            pod.mark("forward", "backward")
        (loss * world).backward()
        if pod:
            pod.mark("backward", "step")
        opt.step()
        opt.zero_grad(set_to_none=True)
        first_step = round(time.perf_counter() - t0, 2)
    memory = pod.close() if pod else None
    result = {"rank": rank, "peak_rss_bytes_at_load": at_load, "peak_rss_bytes": sharded_load.peak_rss_bytes(),
              "seconds_to_load": round(loaded, 2), "seconds_to_first_step": first_step, "bytes_read": read,
              "trained": sum(p.numel() for p in params), "cgroup": memory}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _join(cgroup: Path | None):
    """A preexec_fn: the child enters its rank's cgroup before it runs anything."""
    import os

    def enter() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    return enter


def run(folder: Path, world: int, path: str, step: bool, method: str = "full", batch: int = 1, seq: int = 32,
        env: dict[str, str] | None = None) -> list[dict]:
    """N ranks, each a process of its own (in its own memory cgroup where one can be made)."""
    import os
    import subprocess
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _drop_file_cache(folder)
    cgroups = [_cgroup(rank) for rank in range(world)]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        procs = []
        try:
            for rank in range(world):
                args = [rank, world, port, str(folder), path, out.name, step, method, batch, seq,
                        str(cgroups[rank]) if cgroups[rank] else None]
                code = f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import sharded_load as b; " \
                       f"b._worker(*__import__('json').loads(sys.argv[1]))"
                procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(args)],
                                              env={**os.environ, **(env or {})}, preexec_fn=_join(cgroups[rank])))
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
            for cgroup in cgroups:
                if cgroup is not None:
                    _remove_cgroup(cgroup)
        if any(codes):
            raise RuntimeError(f"a rank failed: exit codes {codes}")
        return json.loads(Path(out.name).read_text())


def _mib(value: float) -> int:
    return round(value / 2**20)


def pod_figures(workers: list[dict]) -> dict | None:
    """Per phase, the worst rank's cgroup peaks in MiB: usage (page cache included), the kubelet's
    working set and Ray's "used"; None without cgroups."""
    if not all(w["cgroup"] for w in workers):
        return None
    phases = workers[0]["cgroup"]["peak_in"]
    return {"max_usage_mib": max(_mib(w["cgroup"]["max_usage"]) for w in workers),
            **{phase: {key: max(_mib(w["cgroup"]["peak_in"][phase][key]) for w in workers)
                       for key in ("usage", "working_set", "ray_used", "rss", "cache")} for phase in phases}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048: about 1.1B parameters with 22 layers)")
    p.add_argument("--layers", type=int, default=22, help="decoder layers (default 22)")
    p.add_argument("--paths", default="full,sharded", help="which loads to run (default full,sharded)")
    p.add_argument("--step-workers", default="2",
                   help="worker counts that also take the first optimizer step (default 2: on CPU the step "
                        "holds the shard's gradients and AdamW's moments in host memory too)")
    p.add_argument("--method", choices=("full", "lora"), default="full",
                   help="full: every weight trained; lora: examples/local-cpu-lora.yaml's adapters, the base frozen")
    p.add_argument("--file-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the saved files' dtype (default bfloat16, as the Hub's checkpoints are)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the first step (default 1)")
    p.add_argument("--seq", type=int, default=32, help="tokens a sequence in the first step (default 32)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the ranks (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--cache", type=Path, default=Path("/tmp/tpuft-bench-sharded-model"),
                   help="where the synthetic model is written once (default /tmp/tpuft-bench-sharded-model)")
    p.add_argument("--out", type=Path, default=OUT, help=f"results JSON (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    suffix = "bf16" if args.file_dtype == "bfloat16" else "float32"
    folder = args.cache / f"llama-h{args.hidden}-l{args.layers}-{suffix}"
    parameters = save_model(folder, args.hidden, args.layers, args.file_dtype)
    model_bytes = parameters * 4
    env = dict(e.split("=", 1) for e in args.env)
    print(f"model: {parameters / 1e9:.2f}B parameters, {model_bytes / 2**30:.2f} GiB in fp32, {folder}")
    rows = []
    stepping = {int(w) for w in args.step_workers.split(",") if w}
    for world in (int(w) for w in args.workers.split(",")):
        for path in args.paths.split(","):
            workers = run(folder, world, path, world in stepping, args.method, args.batch, args.seq, env)

            def gib(key: str, pick=statistics.median) -> float:
                return round(pick(w[key] for w in workers) / 2**30, 2)

            row = {"workers": world, "path": path, "method": args.method, "file_dtype": args.file_dtype,
                   "batch": args.batch, "seq": args.seq, "env": env,
                   "peak_rss_gib_at_load_median": gib("peak_rss_bytes_at_load"),
                   "peak_rss_gib_at_load_max": gib("peak_rss_bytes_at_load", max),
                   "peak_rss_gib_after_first_step_median": gib("peak_rss_bytes") if world in stepping else None,
                   "seconds_to_load_median": statistics.median(w["seconds_to_load"] for w in workers),
                   "seconds_to_first_step_median": (statistics.median(w["seconds_to_first_step"] for w in workers)
                                                    if world in stepping else None),
                   "gib_read_per_worker_median": gib("bytes_read"),
                   "target_gib_at_load": round((model_bytes / world) / 2**30 + 1.5, 2),
                   "pod_mib": pod_figures(workers), "per_worker": workers}
            rows.append(row)
            stepped = (f", after the first step {row['peak_rss_gib_after_first_step_median']:.2f} GiB at "
                       f"{row['seconds_to_first_step_median']:.1f} s" if world in stepping else "")
            print(f"{world} workers {path:8s} peak RSS at load median {row['peak_rss_gib_at_load_median']:6.2f} GiB "
                  f"(max {row['peak_rss_gib_at_load_max']:.2f}; target {row['target_gib_at_load']:.2f}), loaded in "
                  f"{row['seconds_to_load_median']:.1f} s, read {row['gib_read_per_worker_median']:.2f} GiB/worker"
                  f"{stepped}", flush=True)
            if row["pod_mib"]:
                print(f"  cgroup peaks (MiB, worst rank; usage / working set / Ray's used / rss / cache): "
                      f"max_usage {row['pod_mib']['max_usage_mib']}", flush=True)
                for phase, f in row["pod_mib"].items():
                    if phase != "max_usage_mib":
                        print(f"    {phase:9s} {f['usage']:6d} / {f['working_set']:6d} / {f['ray_used']:6d} / "
                              f"{f['rss']:6d} / {f['cache']:6d}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"parameters": parameters, "fp32_bytes": model_bytes, "rows": rows,
                                    "machine": {"python": sys.version.split()[0], "cpu": _platform.processor() or
                                                _platform.machine()}}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
