"""Which Gemma and Llama sizes fit a slice's HBM: full FSDP fine-tuning vs LoRA (issue 30).

Arithmetic, not a measurement: parameter counts from each model's published config (embeddings,
attention with grouped KV heads, gated MLP, norms), HBM per chip from the catalog
(tpuft.catalog.Generation.hbm_gb), everything sharded evenly over the slice's chips (FSDP2).

Bytes per parameter, as tpuft_workload trains:
  full  16: fp32 master weights (4), fp32 gradients (4), AdamW's two fp32 moments (8); the bf16
        compute copy of a layer is gathered one layer at a time (counted in the reserve below).
  lora   4 per frozen base weight (fp32, as the workload loads it: no gradient, no optimizer state;
        holding it in bf16, 2, is not done yet) + 16 per adapter weight.
Assumption, stated: activations, the gathered layer and XLA's workspace take RESERVE of each chip's
HBM (batch 4 x 512 tokens per device, the CRD's defaults; a long maxSeqLength needs more).

    .venv-unit/bin/python bench/lora_fit.py [--rank 16] [--reserve 0.3]

Prints a markdown table and writes bench/results/lora_fit.json.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tpuft import catalog
from tpuft.constants import LORA_DEFAULT_TARGET_MODULES

OUT = Path(__file__).resolve().parent / "results" / "lora_fit.json"
GB = 1e9


@dataclass(frozen=True)
class Model:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool   # input and output embeddings share one matrix

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer LoRA targets by default, one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.projections().values()) + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def lora_parameters(self, rank: int) -> int:
        assert set(self.projections()) == set(LORA_DEFAULT_TARGET_MODULES["llama"])   # the defaults we train
        return self.layers * sum(rank * (a + b) for a, b in self.projections().values())


# Published configs (config.json on each model's Hugging Face page).
MODELS = (
    Model("Llama 3.2 1B", 128256, 2048, 8192, 16, 32, 8, 64, True),
    Model("Llama 3.2 3B", 128256, 3072, 8192, 28, 24, 8, 128, True),
    Model("Llama 3.1 8B", 128256, 4096, 14336, 32, 32, 8, 128, False),
    Model("Llama 3.1 70B", 128256, 8192, 28672, 80, 64, 8, 128, False),
    Model("Gemma 3 1B", 262144, 1152, 6912, 26, 4, 1, 256, True),
    Model("Gemma 3 4B", 262208, 2560, 10240, 34, 8, 4, 256, True),
    Model("Gemma 3 12B", 262208, 3840, 15360, 48, 16, 8, 256, True),
    Model("Gemma 3 27B", 262208, 5376, 21504, 62, 32, 16, 128, True),
)
SLICES = (("v5e", "2x4"), ("v6e", "2x4"), ("v6e", "4x4"), ("tpu7x", "2x2x2"))
FULL_BYTES, FROZEN_BYTES, TRAINED_BYTES = 16, 4, 16


def per_chip_gb(model: Model, method: str, rank: int, chips: int) -> float:
    p = model.parameters()
    if method == "full":
        total = FULL_BYTES * p
    else:
        a = model.lora_parameters(rank)
        total = FROZEN_BYTES * p + TRAINED_BYTES * a
    return total / chips / GB


def table(rank: int, reserve: float) -> dict:
    shapes = [catalog.resolve_slice(acc, topo) for acc, topo in SLICES]
    rows = []
    for m in MODELS:
        row = {"model": m.name, "parameters": m.parameters(), "loraParameters": m.lora_parameters(rank), "fits": {}}
        for shape in shapes:
            chips = shape.chips
            budget = catalog.generation(shape.generation).hbm_gb * (1 - reserve)
            key = f"{shape.generation} {shape.topology}"
            need = {meth: per_chip_gb(m, meth, rank, chips) for meth in ("full", "lora")}
            row["fits"][key] = {meth: {"gbPerChip": round(gb, 2), "fits": gb <= budget} for meth, gb in need.items()}
        rows.append(row)
    return {"rank": rank, "reserve": reserve, "bytesPerParameter": {"full": FULL_BYTES, "frozen": FROZEN_BYTES,
                                                                  "adapter": TRAINED_BYTES},
            "slices": [{"slice": f"{s.generation} {s.topology}", "chips": s.chips,
                        "hbmGbPerChip": catalog.generation(s.generation).hbm_gb} for s in shapes],
            "models": [asdict(m) for m in MODELS], "rows": rows}


def markdown(t: dict) -> str:
    heads = [s["slice"] + f" ({s['chips']} x {s['hbmGbPerChip']:g} GB)" for s in t["slices"]]
    out = ["| model (params, LoRA r=%d adapters) | %s |" % (t["rank"], " | ".join(heads)),
           "|---|" + "---|" * len(heads)]
    for r in t["rows"]:
        cells = []
        for s in t["slices"]:
            f = r["fits"][s["slice"]]
            word = "full + LoRA" if f["full"]["fits"] else ("LoRA only" if f["lora"]["fits"] else "neither")
            cells.append(f"{word} ({f['full']['gbPerChip']:g} / {f['lora']['gbPerChip']:g} GB)")
        out.append(f"| {r['model']} ({r['parameters'] / 1e9:.1f}B, {r['loraParameters'] / 1e6:.0f}M) | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reserve", type=float, default=0.3, help="fraction of HBM left for activations and workspace")
    args = ap.parse_args()
    t = table(args.rank, args.reserve)
    OUT.write_text(json.dumps(t, indent=2) + "\n")
    print(markdown(t))
    print(f"\n(GB per chip: full / LoRA; fits when at most {1 - args.reserve:.0%} of the chip's HBM; "
          f"written to {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT})")


if __name__ == "__main__":
    main()
