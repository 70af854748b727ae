"""Measurement: google-tunix 0.1.7's Flax NNX models against transformers, on the parity test's tiny
models (tests/workload/jax_families.py), float32, packed rows and the same rows as one example
each: the library column of docs/jax.md's parity table.

tunix is not a dependency (docs/jax.md says why): it goes into a throwaway folder beside the
project's jax, with no dependencies resolved (pip would replace transformers 5.25 by 5.12):

    pip install --no-deps --target /tmp/tunix-site google-tunix==0.1.7 qwix==0.1.8 flax==0.12.8 \
        treescope jaxtyping wadler_lindig msgpack rich markdown-it-py mdurl pygments einops
    PYTHONPATH=/tmp/tunix-site:workload:operator:. .venv/bin/python bench/jax_tunix_parity.py

tunix/__init__.py imports its trainers (metrax, grain, tensorflow-datasets); only tunix.models is
measured, so the package is entered without running that file. Each family's tunix config is
filled from the transformers config; where tunix cannot express a setting of the tiny model
(Gemma 2/3: query scaling other than by head_dim; Gemma 3: a layer pattern other than its fixed
5 local : 1 global), the tiny model is built with what it can express, and the row says so.
Prints one line per family and writes bench/results/jax_tunix_parity.json.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile
import types
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.workload.jax_families: the parity test's tiny models
SITE = os.environ.get("TUNIX_SITE", "/tmp/tunix-site")
RESULTS = Path(__file__).parent / "results" / "jax_tunix_parity.json"
ADJUSTED = {"gemma2": "query_pre_attn_scalar = head_dim",
            "gemma3-text": "query_pre_attn_scalar = head_dim, both layers sliding"}


def _enter_tunix_models() -> None:
    package = types.ModuleType("tunix")
    package.__path__ = [os.path.join(SITE, "tunix")]
    sys.modules["tunix"] = package


def _config(family: str, hf):
    """(tunix module name, its ModelConfig) for the transformers config `hf`."""
    import jax.numpy as jnp

    shape = dict(num_layers=hf.num_hidden_layers, embed_dim=hf.hidden_size, hidden_dim=hf.intermediate_size,
                 num_heads=hf.num_attention_heads, head_dim=hf.head_dim, num_kv_heads=hf.num_key_value_heads)
    if family in ("llama-3.x", "mistral"):   # tunix has no Mistral: the Llama layout it shares
        m = importlib.import_module("tunix.models.llama3.model")
        return "llama3", m.ModelConfig(**shape, vocab_size=hf.vocab_size, norm_eps=hf.rms_norm_eps,
                                       rope_theta=hf.rope_parameters["rope_theta"],
                                       weight_tying=hf.tie_word_embeddings)
    if family in ("qwen2.5", "qwen3"):
        name = "qwen2" if family == "qwen2.5" else "qwen3"
        m = importlib.import_module(f"tunix.models.{name}.model")
        known = {f.name for f in dataclasses.fields(m.ModelConfig)}
        settings = dict(**shape, vocab_size=hf.vocab_size, norm_eps=hf.rms_norm_eps,
                        rope_theta=int(hf.rope_parameters["rope_theta"]), use_tied_embedding=hf.tie_word_embeddings)
        return name, m.ModelConfig(**{k: v for k, v in settings.items() if k in known})
    if family == "gemma2":
        m = importlib.import_module("tunix.models.gemma.model")
        kinds = [m.AttentionType.LOCAL_SLIDING if t == "sliding_attention" else m.AttentionType.GLOBAL
                 for t in hf.layer_types]
        return "gemma", m.ModelConfig(**shape, num_embed=hf.vocab_size, final_logit_softcap=hf.final_logit_softcapping,
                                      use_post_attn_norm=True, use_post_ffw_norm=True, attention_types=kinds,
                                      attn_logits_soft_cap=hf.attn_logit_softcapping,
                                      sliding_window_size=hf.sliding_window)
    if family == "gemma3-text":
        m = importlib.import_module("tunix.models.gemma3.model")
        rope = hf.rope_parameters
        return "gemma3", m.ModelConfig(**shape, num_embed=hf.vocab_size, sliding_window_size=hf.sliding_window,
                                       local_base_frequency=int(rope["sliding_attention"]["rope_theta"]),
                                       global_base_frequency=int(rope["full_attention"]["rope_theta"]),
                                       global_scale_factor=rope["full_attention"].get("factor", 1.0),
                                       param_dtype=jnp.float32)
    raise KeyError(family)


def measure(family: str) -> dict:
    import jax.numpy as jnp
    import numpy as np
    import torch

    from tests.workload import jax_families
    from tpuft_workload.jax_model import attention_mask

    directory = tempfile.mkdtemp()
    model = jax_families.save(family, directory)
    row = {"family": family, "candidate": "tunix 0.1.7", "adjusted": ADJUSTED.get(family, "")}
    try:
        name, cfg = _config(family, model.config)
        loader = importlib.import_module(f"tunix.models.{name}.params" + ("_safetensors" if "gemma" in name else ""))
        jax_model = loader.create_model_from_safe_tensors(directory, cfg, mesh=None, dtype=jnp.float32)
    except Exception as e:   # noqa: BLE001  (a measurement: the failure is the result)
        return {**row, "result": f"cannot build: {type(e).__name__}: {e}"[:300]}
    ids, packed = jax_families.packed_inputs()
    whole = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    for label, positions in (("packed", packed), ("whole", whole)):   # whole: one example a row
        with torch.no_grad():
            want = model(input_ids=torch.as_tensor(ids).long(), position_ids=torch.as_tensor(positions).long(),
                         use_cache=False).logits.numpy()
        mask = attention_mask(jnp.asarray(positions), jnp.ones_like(jnp.asarray(ids)))
        got, _ = jax_model(jnp.asarray(ids), jnp.asarray(positions), None, mask)
        row[f"max_abs_diff_{label}"] = float(np.abs(np.asarray(got) - want).max())
    return row


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written (default: %(default)s)")
    args = parser.parse_args(argv)
    _enter_tunix_models()
    from tests.workload import jax_families

    jax_families.FAMILIES["gemma2"][1]["query_pre_attn_scalar"] = 16        # = head_dim
    jax_families.FAMILIES["gemma3-text"][1]["query_pre_attn_scalar"] = 16
    jax_families.FAMILIES["gemma3-text"][1]["layer_types"] = ["sliding_attention", "sliding_attention"]
    rows = [measure(f) for f in ("llama-3.x", "mistral", "qwen2.5", "qwen3", "gemma2", "gemma3-text")]
    for r in rows:
        found = r.get("result") or f"packed {r['max_abs_diff_packed']:.1e}, whole rows {r['max_abs_diff_whole']:.1e}"
        print(f"{r['family']:12s} {r['candidate']}: {found} {r['adjusted']}")
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
