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
and its usage, the kubelet's working set and Ray's "used" are sampled per phase (PodMemory), the
first forward is traced layer by layer, and tpuft.api.model_sizes' prediction of the step's peak is
printed beside the measured one. `--limit-mib 4096` limits each rank's cgroup as a 4Gi pod's is;
`--activation-checkpointing` and `--steps` as spec.training's; the workers give freed tensors
back to the kernel as train.py's do (sharded_load.unmap_freed_tensors; not with --glibc-default).

    .venv/bin/python bench/sharded_load.py [--workers 2,4] [--step-workers 2] [--hidden 2048 --layers 22]

The model is written once under --cache (about 2.2 GB in bf16 at the default size). Writes
bench/results/sharded_load.json by default. One configuration at a time: both paths of N workers
share the machine's memory, so a full load of 4 workers needs 4 x the model's fp32 bytes.
"""
from __future__ import annotations

import argparse
import json
import platform as _platform
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
        self._note(self.read())
        max_usage = int((self.folder / "memory.max_usage_in_bytes").read_text())
        return {"max_usage": max_usage, "at_end_of": self.marks, "peak_in": self.peaks}


def _cgroup(rank: int, limit_mib: int | None = None) -> Path | None:
    """A fresh memory cgroup for one rank (root and cgroup v1 needed; None without them), limited
    to `limit_mib` as a pod's memory limit is (the kernel kills the rank above it)."""
    folder = CGROUP_ROOT / f"tpuft-bench-rank{rank}"
    try:
        if folder.exists():
            folder.rmdir()
        folder.mkdir()
        if limit_mib:
            (folder / "memory.limit_in_bytes").write_text(str(limit_mib * 2**20))
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
    from tpuft.api.constants import LORA_DEFAULT_TARGET_MODULES
    from tpuft_workload.lora import LoraSettings

    return LoraSettings(rank=8, alpha=16, dropout=0.05, target_modules=tuple(LORA_DEFAULT_TARGET_MODULES["llama"]))


def _worker(rank: int, world: int, init_method: str, folder: str, path: str, out: str, step: bool, method: str = "full",
            batch: int = 1, seq: int = 32, cgroup: str | None = None, recompute: bool = False, steps: int = 1,
            glibc_default: bool = False) -> None:
    t0 = time.perf_counter()
    if not glibc_default:   # as train.py's workers
        from tpuft_workload.sharded_load import unmap_freed_tensors

        unmap_freed_tensors()
    pod = PodMemory(Path(cgroup)) if cgroup else None
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpuft_workload import lora as loralib
    from tpuft_workload import model as modellib
    from tpuft_workload import sharded_load
    from tpuft_workload.platform import PLATFORMS

    cpu = PLATFORMS["cpu"]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    mesh = modellib.device_mesh(cpu, world)
    if pod:
        pod.mark("runtime", "load")
    read = 0
    if path == "full":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        read = sum(p.numel() * p.element_size() for p in model.parameters())   # every tensor of the files
        read = read if folder.endswith("float32") else read // 2
        model = loralib.wrap(model, _lora()) if method == "lora" else model
        params = modellib.shard(model, mesh, cpu, torch.device("cpu"), recompute)
    else:
        with sharded_load.parameters_on_meta():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        model = loralib.wrap(model, _lora()) if method == "lora" else model   # as train.py: before sharding
        params = modellib.shard(model, mesh, cpu, torch.device("cpu"), recompute)
        read = sharded_load.fill(model, folder)["bytes"]
    loaded = time.perf_counter() - t0
    at_load = sharded_load.peak_rss_bytes()
    first_step = None
    if pod:
        pod.mark("load", "forward")
    layers = _trace_layers(model, pod) if pod else None
    if step:   # full: the step adds the shard's gradients and AdamW's moments (12 bytes a parameter) on CPU
        opt = torch.optim.AdamW(modellib.decay_groups(model, 0.0), lr=1e-5)
        model.train()
        for i in range(steps):
            ids = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(i))
            # one micro-batch as model.token_mean_loss takes it: divided by the global labelled tokens
            total = modellib.labelled_tokens(ids) * world
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=total).loss
            if pod and i == 0:
                pod.mark("forward", "backward")
            (loss * world).backward()
            if pod and i == 0:
                pod.mark("backward", "step")
            opt.step()
            opt.zero_grad(set_to_none=True)
            if pod and i == 0 and steps > 1:
                pod.mark("step", "later_steps")
            first_step = first_step or round(time.perf_counter() - t0, 2)
    memory = pod.close() if pod else None
    result = {"rank": rank, "peak_rss_bytes_at_load": at_load, "peak_rss_bytes": sharded_load.peak_rss_bytes(),
              "seconds_to_load": round(loaded, 2), "seconds_to_first_step": first_step, "bytes_read": read,
              "trained": sum(p.numel() for p in params), "cgroup": memory, "layers": layers}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _trace_layers(model, pod: PodMemory) -> dict:
    """Ray's used after each decoder layer's first forward, and at the output layer's input and
    output: the steps of the first forward, to tell activations (a rise per layer) from the
    logits and the loss. Filled as the forward runs; a recomputed layer (activation
    checkpointing, in the backward pass) is not recorded."""
    trace: dict = {"after_layer": [], "before_lm_head": None, "after_lm_head": None}

    def after_layer(module, args, output) -> None:
        if pod.phase == "forward":
            trace["after_layer"].append(pod.read()["ray_used"])

    def before_head(module, args) -> None:
        if pod.phase == "forward" and trace["before_lm_head"] is None:
            trace["before_lm_head"] = pod.read()["ray_used"]

    def after_head(module, args, output) -> None:
        if pod.phase == "forward" and trace["after_lm_head"] is None:
            trace["after_lm_head"] = pod.read()["ray_used"]

    for name, module in model.named_modules():
        if type(module).__name__.endswith("DecoderLayer"):
            module.register_forward_hook(after_layer)
        elif name.endswith("lm_head"):
            module.register_forward_pre_hook(before_head)
            module.register_forward_hook(after_head)
    return trace


def _join(cgroup: Path | None):
    """A preexec_fn: the child enters its rank's cgroup before it runs anything."""
    import os

    def enter() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    return enter


def run(folder: Path, world: int, path: str, step: bool, method: str = "full", batch: int = 1, seq: int = 32,
        env: dict[str, str] | None = None, recompute: bool = False, steps: int = 1,
        limit_mib: int | None = None, glibc_default: bool = False) -> list[dict]:
    """N ranks, each a process of its own (in its own memory cgroup where one can be made, limited
    to `limit_mib`)."""
    import os
    import subprocess
    import tempfile

    sys.path.insert(0, str(REPO))
    from tests.ranks import file_rendezvous

    _drop_file_cache(folder)
    cgroups = [_cgroup(rank, limit_mib) for rank in range(world)]
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryDirectory() as meeting:
        rendezvous = file_rendezvous(meeting)
        procs = []
        try:
            for rank in range(world):
                args = [rank, world, rendezvous, str(folder), path, out.name, step, method, batch, seq,
                        str(cgroups[rank]) if cgroups[rank] else None, recompute, steps, glibc_default]
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
            raise RuntimeError(f"a rank failed: exit codes {codes}" + (
                f" (-9: killed, e.g. by the kernel at the {limit_mib} MiB limit)" if limit_mib else ""))
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


def predicted(hidden: int, layers: int, world: int, method: str, tokens: int, recompute: bool,
              loaded_mib: int | None) -> dict:
    """tpuft.api.model_sizes' figures for this shape and step, in MiB: its StepMemory terms, the
    trained parameters' gradients and AdamW moments (12 bytes each, this rank's shard), and the
    step's peak predicted from the measured loaded rank (`loaded_mib`: Ray's used at the end of the
    load, the shard and this process's runtime) plus both."""
    from tpuft.api import model_sizes

    cfg = _config(hidden, layers)
    shape = model_sizes.shape_of(cfg.to_dict(), "bench")
    lora = _lora()
    run = model_sizes.Run(method=method, rank=lora.rank, targets=lora.target_modules, tokens=tokens,
                          activation_checkpointing=recompute)
    step = model_sizes.step_memory(shape, run)
    trained = shape.lora_parameters(lora.rank, lora.target_modules) if method == "lora" else shape.parameters()
    optimizer = 12 * trained / world
    out = {"output": _mib(step.output), "layer": _mib(step.layer), "kept": _mib(step.kept), "logits": _mib(step.logits),
           "gradients_and_moments": _mib(optimizer)}
    if loaded_mib is not None:
        out["peak"] = loaded_mib + _mib(step.total + optimizer)
    return out


def forward_steps(workers: list[dict]) -> dict | None:
    """The worst rank's first forward in MiB of Ray's used: the median rise per decoder layer (the
    activations it keeps), all layers' rise over the loaded rank (with the first layer's gathering
    of the root unit), the rise across the output layer (`logits`: the logits, less the output
    layer's gathered weight where model.embedding_units made it a unit freed at its forward's end)
    and the loss's (from the output layer to the forward's end); None without cgroups."""
    if not all(w["layers"] and w["layers"]["after_layer"] for w in workers):
        return None

    def one(w: dict) -> dict:
        trace, marks = w["layers"], w["cgroup"]["at_end_of"]
        after = trace["after_layer"]
        return {"per_layer": _mib(statistics.median(b - a for a, b in zip(after, after[1:]))) if len(after) > 1 else None,
                "layers_total": _mib(after[-1] - marks["load"]["ray_used"]),
                "logits": _mib(trace["after_lm_head"] - trace["before_lm_head"]),
                "loss": _mib(marks["forward"]["ray_used"] - trace["after_lm_head"])}
    return max((one(w) for w in workers), key=lambda f: f["layers_total"])


def _loaded_mib(workers: list[dict]) -> int | None:
    """The worst rank's Ray's used at the end of the load; None without cgroups."""
    if not all(w["cgroup"] for w in workers):
        return None
    return max(_mib(w["cgroup"]["at_end_of"]["load"]["ray_used"]) for w in workers)


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
    p.add_argument("--steps", type=int, default=1, help="optimizer steps the stepping workers take (default 1)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="each decoder layer's activations recomputed in the backward pass "
                        "(spec.training.activationCheckpointing: model.shard's)")
    p.add_argument("--limit-mib", type=int, default=None,
                   help="each rank's cgroup memory limit, as a pod's (e.g. 4096 for 4Gi): the kernel kills a rank "
                        "above it, Ray's memory monitor at 95%% of it (Ray's used)")
    p.add_argument("--glibc-default", action="store_true",
                   help="leave glibc's malloc as it starts (no sharded_load.unmap_freed_tensors): freed gathered "
                        "weights stay charged to the rank")
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
            try:
                workers = run(folder, world, path, world in stepping, args.method, args.batch, args.seq, env,
                              args.activation_checkpointing, args.steps, args.limit_mib, args.glibc_default)
            except RuntimeError as failed:   # e.g. a rank killed at --limit-mib: recorded, with the prediction
                rows.append({"workers": world, "path": path, "method": args.method, "batch": args.batch,
                             "seq": args.seq, "activation_checkpointing": args.activation_checkpointing,
                             "limit_mib": args.limit_mib, "failed": str(failed),
                             "predicted_mib": predicted(args.hidden, args.layers, world, args.method,
                                                        args.batch * args.seq, args.activation_checkpointing, None)})
                print(f"{world} workers {path}: {failed}; predicted (MiB, beside the loaded rank): "
                      f"{rows[-1]['predicted_mib']}", flush=True)
                continue

            def gib(key: str, pick=statistics.median) -> float:
                return round(pick(w[key] for w in workers) / 2**30, 2)

            row = {"workers": world, "path": path, "method": args.method, "file_dtype": args.file_dtype,
                   "batch": args.batch, "seq": args.seq, "env": env, "steps": args.steps,
                   "activation_checkpointing": args.activation_checkpointing, "limit_mib": args.limit_mib,
                   "glibc_default": args.glibc_default,
                   "first_forward_mib": forward_steps(workers),
                   "predicted_mib": predicted(args.hidden, args.layers, world, args.method, args.batch * args.seq,
                                              args.activation_checkpointing, _loaded_mib(workers)),
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
                        print(f"    {phase:11s} {f['usage']:6d} / {f['working_set']:6d} / {f['ray_used']:6d} / "
                              f"{f['rss']:6d} / {f['cache']:6d}", flush=True)
                stepped_peak = max(f["ray_used"] for phase, f in row["pod_mib"].items()
                                   if phase not in ("max_usage_mib", "runtime", "load"))
                print(f"  first forward (MiB of Ray's used): {row['first_forward_mib']}", flush=True)
                print(f"  predicted (tpuft.api.model_sizes, MiB): {row['predicted_mib']}; measured step peak of Ray's "
                      f"used {stepped_peak}" + (f", limit {args.limit_mib} (Ray kills at "
                                                f"{int(0.95 * args.limit_mib)})" if args.limit_mib else ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"parameters": parameters, "fp32_bytes": model_bytes, "rows": rows,
                                    "machine": {"python": sys.version.split()[0], "cpu": _platform.processor() or
                                                _platform.machine()}}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
