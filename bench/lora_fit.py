"""Which Gemma and Llama sizes fit a slice: HBM per chip and memory per worker pod, full vs LoRA.

Arithmetic, not a measurement (tpuft.api.model_sizes, which `tpuft validate` warns from too): parameter
counts from each model's published config (embeddings, attention with grouped KV heads, gated MLP,
norms; the text model only), HBM per chip and the worker pod's memory from the catalog
(tpuft.api.catalog.Generation.hbm_gb and .worker, the default spec.resources.worker raises), the
weights sharded evenly over one slice's devices (FSDP2), one torch rank per device.

Bytes per parameter, as tpuft_workload trains:
  HBM    full 16: fp32 weights, fp32 gradients, AdamW's two fp32 moments;
         LoRA  2 per frozen base weight (bf16 on accelerators) + 16 per adapter weight.
  a worker pod's memory, each of its ranks adding the overhead below:
    at load      the sharded load (tpuft_workload.sharded_load): each of the host's ranks holds its
                 1/devices shard of the weights, 4 a full weight, 2 a frozen one, 4 an adapter (an
                 upper bound on TPU, where the shard goes through host memory into HBM);
    in training  the overhead only (the state is in HBM);
    at export    worker pod 0, where the whole model is gathered: full 6 (fp32 + its bf16 copy);
                 LoRA merged 4 (the bf16 base + the copies the adapters merge into; spec.export.merge,
                 or served by vLLM); LoRA not merged writes the adapters only.
Assumptions, stated: activations, the gathered layer and XLA's workspace take RESERVE of each chip's
HBM (batch 4 x 512 tokens per device, the CRD's defaults; a long maxSeqLength needs more). The
overhead per rank, 1.1 GiB, is the peak RSS of a CPU rank beyond its shard of weights, gradients and
moments, measured with `.venv/bin/python bench/sharded_load.py --workers 2 --hidden 512 --layers 4
--paths sharded` (1.10 GiB; at --hidden 1024, 1.12); libtpu's own host memory is not in it.
Ray's object store in /dev/shm holds data blocks only, left out. A pod's figures are compared with
95% of its memory: past that Ray's memory monitor kills a worker (RAY_MEMORY_USAGE_THRESHOLD).

    .venv-unit/bin/python bench/lora_fit.py [--rank 16] [--reserve 0.3] [--overhead-gib 1.1]

Prints two markdown tables (the slices, then what fits) and writes bench/results/lora_fit.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from tpuft.api import catalog, model_sizes
from tpuft.api.model_sizes import LORA

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "lora_fit.json"
SLICES = (("v5e", "2x4"), ("v6e", "2x4"), ("v6e", "4x4"), ("tpu7x", "2x2x2"))


def fits_of(model: model_sizes.ModelShape, shape: catalog.SliceShape, rank: int, reserve: float,
            overhead_gib: float) -> dict[str, model_sizes.Fit]:
    """full, LoRA (adapters exported) and LoRA with the merged weights exported, on one slice."""
    run = model_sizes.Run(rank=rank, reserve=reserve, rank_overhead_gib=overhead_gib)
    return {"full": model_sizes.fit(model, shape, run), "lora": model_sizes.fit(model, shape, replace(run, method=LORA)),
            "loraMerged": model_sizes.fit(model, shape, replace(run, method=LORA, merged=True))}


def _short(f: model_sizes.Fit) -> list[str]:
    return [x.name for x in f.figures if not x.fits]


def verdict(fits: dict[str, model_sizes.Fit]) -> str:
    """full and LoRA / LoRA only / LoRA, not merged / neither, and the figures short for the rest."""
    full, lora, merged = fits["full"], fits["lora"], fits["loraMerged"]
    if full.fits:
        return "full and LoRA"
    why_full = f"full: {', '.join(_short(full))}"
    if merged.fits:
        return f"LoRA only ({why_full})"
    if lora.fits:
        return f"LoRA, not merged ({why_full}; merged: {', '.join(_short(merged))})"
    return f"neither ({why_full}; LoRA: {', '.join(_short(lora))})"


def _figures(f: model_sizes.Fit) -> dict:
    out = {"fits": f.fits}
    if f.hbm is not None:
        out["hbmGbPerChip"] = round(f.hbm.need, 2)
    out.update(hostGibLoad=round(f.load.need, 1), hostGibTraining=round(f.training.need, 1),
               hostGibExport=round(f.export.need, 1))
    return out


def table(rank: int, reserve: float, overhead_gib: float) -> dict:
    shapes = [catalog.resolve_slice(acc, topo) for acc, topo in SLICES]
    rows = []
    for m in model_sizes.MODELS:
        row = {"model": m.name, "parameters": m.parameters(), "loraParameters": m.lora_parameters(rank), "fits": {}}
        for shape in shapes:
            fits = fits_of(m, shape, rank, reserve, overhead_gib)
            row["fits"][f"{shape.generation} {shape.topology}"] = {
                "verdict": verdict(fits), **{name: _figures(f) for name, f in fits.items()}}
        rows.append(row)
    tpu, cpu = model_sizes.TPU_BYTES, model_sizes.CPU_BYTES
    return {"rank": rank, "reserve": reserve, "rankOverheadGib": overhead_gib,
            "bytesPerParameter": {"hbm": tpu["state"], "hostWeights": tpu["weights"],
                                  "export": {k: v[0] for k, v in model_sizes.EXPORT_BYTES.items()},
                                  "cpu": {"state": cpu["state"], "weights": cpu["weights"]}},
            "slices": [{"slice": f"{s.generation} {s.topology}", "chips": s.chips,
                        "hbmGbPerChip": catalog.generation(s.generation).hbm_gb,
                        "hbmBudgetGbPerChip": round(catalog.generation(s.generation).hbm_gb * (1 - reserve), 2),
                        "workerPods": s.hosts, "ranksPerPod": s.devices_per_host,
                        "podMemory": s.worker_pod.memory} for s in shapes],
            "models": [asdict(m) for m in model_sizes.MODELS], "rows": rows}


def markdown(t: dict) -> str:
    out = [f"| slice | chips x HBM | HBM a chip may hold ({1 - t['reserve']:.0%}) | worker pods x memory | "
           "ranks a pod |", "|---|---|---|---|---|"]
    for s in t["slices"]:
        out.append(f"| {s['slice']} | {s['chips']} x {s['hbmGbPerChip']:g} GB | {s['hbmBudgetGbPerChip']:g} GB | "
                   f"{s['workerPods']} x {s['podMemory']} | {s['ranksPerPod']} |")
    out += ["", f"| model (parameters, LoRA r={t['rank']} adapters) | slice | HBM GB per chip, full / LoRA | "
                "pod GiB at load, full / LoRA | pod GiB in training | pod 0 GiB at export, full / LoRA merged | "
                "fits |", "|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        label = f"{r['model']} ({r['parameters'] / 1e9:.1f}B, {r['loraParameters'] / 1e6:.0f}M)"
        for key, f in r["fits"].items():
            full, lora, merged = f["full"], f["lora"], f["loraMerged"]
            out.append(f"| {label} | {key} | {full['hbmGbPerChip']:g} / {lora['hbmGbPerChip']:g} | "
                       f"{full['hostGibLoad']:g} / {lora['hostGibLoad']:g} | {full['hostGibTraining']:g} | "
                       f"{full['hostGibExport']:g} / {merged['hostGibExport']:g} | {f['verdict']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--reserve", type=float, default=model_sizes.HBM_RESERVE,
                    help=f"fraction of HBM left for activations and workspace (default {model_sizes.HBM_RESERVE})")
    ap.add_argument("--overhead-gib", type=float, default=model_sizes.RANK_OVERHEAD_GIB,
                    help=f"host memory per rank beyond its shard (default {model_sizes.RANK_OVERHEAD_GIB}, measured "
                         "with bench/sharded_load.py)")
    args = ap.parse_args(argv)
    t = table(args.rank, args.reserve, args.overhead_gib)
    OUT.write_text(json.dumps(t, indent=2) + "\n")
    print(markdown(t))
    print(f"\n(written to {OUT.relative_to(REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
