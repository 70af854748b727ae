"""The JAX causal LM against transformers' torch models on the same weights (no Ray).

Tolerance: the first-step loss (before any update) and the loss after one AdamW step agree to
1e-4 relative in float32 (measured: 0 to ~1e-7, summation order only); logits to 1e-4 absolute.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.workload.inprocess_data import build_blocks, load_records  # noqa: E402
from tpuft_workload import jax_model, pipeline, tiny  # noqa: E402

REL_TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


def _rows(tokenizer, packing: bool, n: int = 4) -> dict:
    records = load_records(tiny.BUILTIN_DATASET, "train[:40]")
    return pipeline.rows_of(build_blocks(tokenizer, records, 128, packing)[:n], np)


def _torch_loss(model, rows: dict, packing: bool) -> float:
    import torch

    keys = ("input_ids", "labels", "position_ids" if packing else "attention_mask")
    return model(**{k: torch.as_tensor(rows[k], dtype=torch.long) for k in keys}).loss


def _jax_loss(params, cfg, rows: dict, packing: bool) -> float:
    import jax

    return float(jax.jit(lambda p, b: jax_model.loss(p, cfg, b))(params, jax_model.inputs_from_rows(rows, packing)))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_first_step_loss_matches_torch_on_the_same_tiny_weights(tokenizer, packing):
    import torch

    model = tiny.build_model(len(tokenizer), seed=42)
    _, cfg, params = jax_model.from_torch(model)
    rows = _rows(tokenizer, packing)
    with torch.no_grad():
        want = float(_torch_loss(model, rows, packing))
    got = _jax_loss(params, cfg, rows, packing)
    assert abs(got - want) <= REL_TOL * want, (got, want)


def test_packed_examples_do_not_attend_across_their_boundary(tokenizer):
    """The same first example alone or followed by another: its logits do not change."""
    import jax.numpy as jnp

    _, cfg, params = jax_model.from_torch(tiny.build_model(len(tokenizer), seed=1))
    ids = jnp.arange(4, 20, dtype=jnp.int32)[None]
    restart = jnp.concatenate([jnp.arange(8), jnp.arange(8)])[None].astype(jnp.int32)
    ones = jnp.ones_like(ids)
    packed = jax_model.forward(params, cfg, ids, restart, ones)
    alone = jax_model.forward(params, cfg, ids[:, 8:], restart[:, 8:], ones[:, 8:])
    assert np.allclose(packed[:, 8:], alone, atol=1e-5)
    causal_only = jax_model.forward(params, cfg, ids, jnp.arange(16, dtype=jnp.int32)[None], ones)
    assert not np.allclose(causal_only[:, 8:], alone, atol=1e-3)   # the check can fail


def test_one_adamw_step_matches_torch(tokenizer):
    """optax chain(clip 1.0, adamw wd 0.01) is the torch path's clip_grad_norm_ + AdamW(wd 0.01)."""
    import jax
    import optax
    import torch

    model = tiny.build_model(len(tokenizer), seed=42)
    _, cfg, params = jax_model.from_torch(model)
    rows = _rows(tokenizer, True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    _torch_loss(model, rows, True).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        want = float(_torch_loss(model, rows, True))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.01))
    batch = jax_model.inputs_from_rows(rows, True)
    # jitted: one XLA compile instead of an eager dispatch (and compile) per op of the backward pass
    grads = jax.jit(jax.grad(lambda p: jax_model.loss(p, cfg, batch)))(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    got = _jax_loss(optax.apply_updates(params, updates), cfg, rows, True)
    assert abs(got - want) <= REL_TOL * want, (got, want)


def test_activation_checkpointing_remats_each_layer_with_the_same_loss_and_gradients(tokenizer):
    import jax

    _, cfg, params = jax_model.from_torch(tiny.build_model(len(tokenizer), seed=5))
    batch = jax_model.inputs_from_rows(_rows(tokenizer, True, n=2), True)

    def loss_and_grads(remat: bool):
        return jax.jit(jax.value_and_grad(lambda p: jax_model.loss(p, cfg, batch, remat=remat)))(params)

    (plain, plain_grads), (remat, remat_grads) = loss_and_grads(False), loss_and_grads(True)
    assert abs(float(remat) - float(plain)) <= REL_TOL * float(plain)
    for name, g in plain_grads.items():
        assert np.allclose(remat_grads[name], g, rtol=REL_TOL, atol=1e-7), name
    traced = str(jax.make_jaxpr(lambda p: jax_model.loss(p, cfg, batch, remat=True))(params))
    assert traced.count("remat2[") == cfg.num_layers   # one jax.checkpoint per decoder layer


def test_weight_decay_applies_to_weight_matrices_only(tokenizer):
    """Norm scales (1-D) and the embedding table are left out; projections and an untied lm_head decay."""
    _, cfg, params = jax_model.from_torch(tiny.build_model(len(tokenizer)))
    mask = jax_model.decay_mask(params)
    assert not cfg.tie_word_embeddings and mask["lm_head.weight"]
    assert not mask["model.embed_tokens.weight"] and not mask["model.norm.weight"]
    assert not mask["model.layers.0.input_layernorm.weight"]
    assert mask["model.layers.1.self_attn.q_proj.weight"] and mask["model.layers.0.mlp.down_proj.weight"]
    assert not jax_model.decays("model.layers.0.self_attn.q_proj.bias", (64,))


def _gemma(tmp_path, **overrides):
    import torch
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, **overrides)
    torch.manual_seed(0)
    model = GemmaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


def test_a_gemma_shaped_checkpoint_loads_and_matches_transformers(tmp_path):
    """Gemma (v1): tied embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, GELU-tanh, head_dim
    apart from hidden/heads, one KV head."""
    import torch

    model = _gemma(tmp_path)
    hf, cfg, params = jax_model.load_hf_dir(str(tmp_path))
    assert cfg.gemma and cfg.tie_word_embeddings and "lm_head.weight" not in params
    ids = np.arange(1, 25, dtype=np.int32)[None] % 96
    pos = np.arange(24, dtype=np.int32)[None]
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    got = np.asarray(jax_model.forward(params, cfg, ids, pos, np.ones_like(ids)))
    assert np.abs(got - want).max() < 1e-4


def test_the_export_loads_in_transformers_with_the_same_logits(tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = tiny.build_model(len(tokenizer), seed=3).eval()
    hf, cfg, params = jax_model.from_torch(model)
    jax_model.save_hf(params, hf, str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.arange(4, 30)[None]
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


@pytest.mark.parametrize("change,words", [
    ({"model_type": "gemma4_text"}, "model_type 'gemma4_text' is not implemented: Gemma 4"),
    ({"model_type": "phi3"}, "model_type 'phi3' is not implemented"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}}, "rope_type 'yarn'"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_architectures_are_refused_by_name(tokenizer, change, words):
    hf = {**tiny.build_model(len(tokenizer)).config.to_dict(), **change}
    with pytest.raises(jax_model.ModelError) as err:
        jax_model.config_from_hf(hf)
    assert words in str(err.value) and str(err.value).startswith("spec.model (training.framework jax)")


def test_the_serve_app_answers_with_a_jax_written_export(tokenizer, tmp_path):
    """The serving engine (tpuft_workload.serve, what spec.serve runs on cpu) loads the JAX path's
    export as it loads the torch path's and answers a chat request."""
    from tpuft_workload import chat_api
    from tpuft_workload import serve as serveapp

    hf, _, params = jax_model.from_torch(tiny.build_model(len(tokenizer), seed=0))
    jax_model.save_hf(params, hf, str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    engine = serveapp.Engine(serveapp.parse_args({"model_source": str(tmp_path), "model_id": "jax-tiny"}))
    request = chat_api.parse_request({"model": "jax-tiny", "messages": [{"role": "user", "content": "What is a dog?"}],
                                      "max_tokens": 8, "temperature": 0})
    try:
        reply = asyncio.run(engine.answer(request))
    finally:
        engine.close()
    assert 0 < reply.completion_tokens <= 8 and reply.text.strip()


_TWO_SLICES = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
from functools import partial
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.workload.inprocess_data import build_blocks, load_records
from tpuft_workload import jax_model as jm, jax_train as jt, pipeline, tiny

tok = tiny.build_tokenizer()
_, mcfg, host = jt.load_weights(tiny.BUILTIN_MODEL, tok, 0)
blocks = build_blocks(tok, load_records(tiny.BUILTIN_DATASET, "train[:40]"), 64, True)[:8]
rows = pipeline.rows_of(blocks, np)
rows = {**jm.inputs_from_rows(rows, True), "n_real": rows["n_real"].astype("int32")}   # as _Jax.step
micro = {k: v[None] for k, v in rows.items()}   # one micro-batch
out = {}
for slices in (1, 2):
    mesh = jt.build_mesh(jax, slices)
    params = {n: jt._put(jax, a, NamedSharding(mesh, jt.param_spec(a.shape, mesh.shape["fsdp"])))
              for n, a in host.items()}
    tx = jt.optimizer(host, 0.01, 1.0)
    opt = tx.init(params)
    batch = {k: jt._put(jax, v, NamedSharding(mesh, P(None, jt.MESH_AXES))) for k, v in micro.items()}
    step = jax.jit(partial(jt.train_step, tx, mcfg, None, False))
    losses = []
    for _ in range(3):
        params, opt, sums, _ = step(params, opt, batch, np.float32(1e-2))
        losses.append(float(sums["loss_sum"] / sums["labelled"]))
    out[slices] = {"mesh": dict(mesh.shape), "losses": losses}
try:
    jt.build_mesh(jax, 3)
except ValueError as e:
    out["refused"] = str(e)
print(json.dumps(out))
"""


def test_two_cpu_slices_make_a_data_by_fsdp_mesh_that_trains_like_one_slice():
    """slices: 2 on four CPU devices (which carry no slice_index): mesh (data, fsdp) = (2, 2), the
    parameters sharded over 2, and the same losses as one slice of 4 (one jit over the same global
    batch). In a process of its own: the device count is fixed when JAX first starts."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _TWO_SLICES], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["1"]["mesh"] == {"data": 1, "fsdp": 4} and out["2"]["mesh"] == {"data": 2, "fsdp": 2}
    one, two = out["1"]["losses"], out["2"]["losses"]
    assert one[-1] < one[0]
    assert two == pytest.approx(one, rel=REL_TOL)
    assert out["refused"] == "4 JAX devices do not split into 3 equal slices"


_SHARD_BY_SHARD = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np, torch
from jax.sharding import NamedSharding
from transformers import LlamaConfig, LlamaForCausalLM
from tpuft_workload import jax_model as jm, jax_train as jt

folder = sys.argv[1]
torch.manual_seed(3)
LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
                 ).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
_, _, whole = jm.load_hf_dir(folder)
_, _, lazy = jm.open_hf_dir(folder)
mesh = jt.build_mesh(jax, 1)
out = {"files": len(lazy.handles), "tensors": {}}
for name, saved in lazy.items():
    sharding = NamedSharding(mesh, jt.param_spec(saved.shape, mesh.shape["fsdp"]))
    by_shard, from_whole = jt._put(jax, saved, sharding), jt._put(jax, whole[name], sharding)
    out["tensors"][name] = {"equal": bool((np.asarray(by_shard) == np.asarray(from_whole)).all()),
                            "sharded": bool(jt.param_spec(saved.shape, 4)), "read": saved.read_bytes,
                            "bytes": saved.size * 4}
lazy.close()
print(json.dumps(out))
"""


def test_a_saved_model_is_placed_shard_by_shard_with_the_weights_of_a_whole_read(tmp_path):
    """A bf16 checkpoint in several files, placed over four CPU devices: each parameter equals the
    one placed from the whole tensor, and a sharded one is read once in total (each device's rows
    once), never whole per device. In a process of its own: the device count is fixed when JAX
    first starts."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SHARD_BY_SHARD, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["files"] > 1
    tensors = out["tensors"]
    assert tensors and all(t["equal"] for t in tensors.values())
    sharded = [t for t in tensors.values() if t["sharded"]]
    assert sharded and all(t["read"] == t["bytes"] for t in sharded)   # 4 devices' rows, each once
