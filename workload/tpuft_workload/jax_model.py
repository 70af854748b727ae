"""A Hugging Face Llama-family causal LM in plain JAX, on Hugging Face's own parameter names.

transformers 5 dropped its Flax models, so the JAX path carries its own forward pass. The
parameters are a flat dict keyed exactly as LlamaForCausalLM's state_dict
(`model.layers.0.self_attn.q_proj.weight`, ...) with torch's [out, in] layout, so loading a
checkpoint, sharding by name and exporting safetensors that `from_pretrained` reads back are
each a dict operation, with no name or layout mapping to keep in step with transformers.

Supported: the Llama layout (RMSNorm, RoPE with the default rope type, grouped-query
attention, SwiGLU MLP, tied or untied embeddings) and Gemma (v1) on top of it (RMSNorm's
(1 + w), embeddings scaled by sqrt(hidden), GELU-tanh MLP, explicit head_dim, tied
embeddings). Refused with a clear error: anything else (Gemma 2/3 soft-capping, sliding
windows and q/k norms, scaled RoPE such as Llama 3.1's, attention or MLP biases).

Attention follows what the torch path gives transformers: packed rows restart position_ids
per example and attention is block-diagonal across examples (a new example starts wherever
position_ids do not continue by one); padded rows use positions 0..T-1 and mask the padding.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

IGNORE = -100
EMBEDDING = "model.embed_tokens.weight"   # also the output head when tie_word_embeddings
SUPPORTED = ("llama", "gemma")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}


class ModelError(ValueError):
    """spec.model's architecture is not one this JAX model implements: what differs, what to do."""

    def __init__(self, message: str):
        super().__init__(f"spec.model (training.framework jax): {message}; use a Llama or Gemma (v1) "
                         "checkpoint, or training.framework torch")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    activation: str          # silu | gelu_tanh

    @property
    def gemma(self) -> bool:
        return self.model_type == "gemma"


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ModelError(f"rope_type {kind!r} is not implemented (only the default RoPE)")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig; ModelError when it is not supported."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ModelError(f"model_type {kind!r} is not implemented (supported: {', '.join(SUPPORTED)})")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ModelError(f"{flag}: true is not implemented")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise ModelError(f"activation {act!r} is not implemented (supported: {', '.join(_ACTIVATIONS)})")
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
        model_type=kind, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", kind == "gemma")),
        activation=_ACTIVATIONS[act])


# ---- load / save on Hugging Face names --------------------------------------------------------

def param_names(cfg: ModelConfig) -> list[str]:
    """Every trainable parameter, as LlamaForCausalLM / GemmaForCausalLM name them."""
    names = [EMBEDDING, "model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "input_layernorm.weight",
                                  "post_attention_layernorm.weight")]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _check_names(cfg: ModelConfig, found: set, where: str) -> None:
    missing = [n for n in param_names(cfg) if n not in found]
    if missing:
        raise ModelError(f"{where} lacks {missing[:5]} ({len(missing)} missing): not a {cfg.model_type} layout")


def load_hf_dir(path: str):
    """(HF config dict, ModelConfig, {name: float32 numpy array}) from a from_pretrained() folder,
    every tensor read whole (tests; a worker reads its shards: open_hf_dir)."""
    import numpy as np

    hf, cfg, tensors = open_hf_dir(path)
    try:
        return hf, cfg, {name: np.asarray(t) for name, t in tensors.items()}
    finally:
        tensors.close()


class HostTensors(dict):
    """{name: SavedTensor} of one checkpoint folder, its files open (memory-mapped) until close()."""

    def __init__(self) -> None:
        super().__init__()
        self.handles: dict[str, object] = {}

    def close(self) -> None:
        self.handles.clear()


class SavedTensor:
    """One tensor of a safetensors file, read region by region as float32 numpy: `shape`, `size`
    and `ndim` without reading; `tensor[idx]` reads only that region (jax.make_array_from_callback
    asks each device's shard); `np.asarray(tensor)` reads it whole."""

    def __init__(self, handle, name: str):
        self.window = handle.get_slice(name)
        self.shape = tuple(self.window.get_shape())
        self.size = int(math.prod(self.shape))
        self.ndim = len(self.shape)
        self.read_bytes = 0

    def __getitem__(self, index):
        import torch

        region = self.window[index if index != () else slice(None)]
        self.read_bytes += region.numel() * 4
        return region.to(torch.float32).numpy()

    def __array__(self, dtype=None, copy=None):
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype)


def open_hf_dir(path: str) -> tuple[dict, ModelConfig, HostTensors]:
    """(HF config dict, ModelConfig, {name: SavedTensor}) of a from_pretrained() folder: the files
    opened, nothing read yet (torch's safetensors reader: bf16 files read without a device)."""
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf = hf.get("text_config", hf) if hf.get("model_type") not in SUPPORTED else hf
    cfg = config_from_hf(hf)
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ModelError(f"{path} holds no *.safetensors files")
    wanted, tensors = set(param_names(cfg)), HostTensors()
    for name in files:
        handle = safe_open(os.path.join(path, name), framework="pt")
        tensors.handles[name] = handle
        for key in handle.keys():
            if key in wanted:
                tensors[key] = SavedTensor(handle, key)
    _check_names(cfg, set(tensors), path)
    return hf, cfg, tensors


def from_torch(model):
    """(HF config dict, ModelConfig, params) of a transformers model in memory (the builtin)."""
    hf = model.config.to_dict()
    cfg = config_from_hf(hf)
    # copies: .numpy() shares the tensor's memory, which a torch optimizer would go on changing
    state = {k: v.detach().float().cpu().numpy().copy() for k, v in model.state_dict().items()}
    params = {n: state[n] for n in param_names(cfg)}
    return hf, cfg, params


def hf_class(hf_config: dict) -> str:
    """The transformers class that loads what save_hf writes."""
    return "GemmaForCausalLM" if hf_config.get("model_type") == "gemma" else "LlamaForCausalLM"


def decays(name: str, shape: tuple) -> bool:
    """Whether AdamW's weight decay applies to a parameter: weight matrices only, not norm scales
    (1-D; biases would be too) nor the embedding table (an untied lm_head is a weight matrix)."""
    return len(shape) >= 2 and name != EMBEDDING


def decay_mask(params: dict) -> dict:
    """{name: decays(...)} over `params`: optax's weight-decay mask."""
    return {name: decays(name, tuple(p.shape)) for name, p in params.items()}


def save_hf(params: dict, hf_config: dict, directory: str, dtype=None) -> None:
    """model.safetensors (HF names, [out, in] layout, `dtype` or float32) + config.json."""
    import numpy as np
    from safetensors.numpy import save_file

    if dtype is not None:
        import ml_dtypes  # noqa: F401  (a jax dependency: numpy's bfloat16)
    out = {k: np.ascontiguousarray(np.asarray(v, dtype=dtype or np.float32)) for k, v in params.items()}
    os.makedirs(directory, exist_ok=True)
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    hf = {**hf_config, "architectures": [hf_class(hf_config)], "use_cache": True}
    if dtype is not None:
        hf["dtype"] = np.dtype(dtype).name
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)


# ---- forward and loss -------------------------------------------------------------------------

def _rms_norm(x, w, cfg: ModelConfig):
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps))
    if cfg.gemma:  # Gemma scales by (1 + w), in float32
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * y.astype(x.dtype)


def _rope(x, positions, cfg: ModelConfig):
    """HF's rotate_half RoPE on [B, T, heads, head_dim]."""
    import jax.numpy as jnp

    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _linear(x, w):
    return x @ w.T.astype(x.dtype)   # HF [out, in] weights


def _attention(p: dict, x, positions, mask, cfg: ModelConfig):
    import jax
    import jax.numpy as jnp

    b, t, _ = x.shape
    q = _rope(_linear(x, p["self_attn.q_proj.weight"]).reshape(b, t, cfg.num_heads, cfg.head_dim), positions, cfg)
    k = _rope(_linear(x, p["self_attn.k_proj.weight"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, cfg)
    v = _linear(x, p["self_attn.v_proj.weight"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    groups = cfg.num_heads // cfg.num_kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * (cfg.head_dim ** -0.5)
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, cfg.num_heads * cfg.head_dim)
    return _linear(out, p["self_attn.o_proj.weight"])


def _mlp(p: dict, x, cfg: ModelConfig):
    import jax

    gate = _linear(x, p["mlp.gate_proj.weight"])
    act = jax.nn.silu(gate) if cfg.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return _linear(act * _linear(x, p["mlp.up_proj.weight"]), p["mlp.down_proj.weight"])


def attention_mask(position_ids, key_mask):
    """[B, T, T] causal mask, block-diagonal across packed examples, padding keys masked out."""
    import jax.numpy as jnp

    b, t = position_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), position_ids[:, 1:] != position_ids[:, :-1] + 1], axis=1)
    segment = jnp.cumsum(starts, axis=1)
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    same = segment[:, :, None] == segment[:, None, :]
    return causal & same & key_mask.astype(bool)[:, None, :]


def _decoder_layer(p: dict, x, positions, mask, cfg: ModelConfig):
    """One decoder layer on the residual stream `x` (`p`: the layer's parameters, short names)."""
    x = x + _attention(p, _rms_norm(x, p["input_layernorm.weight"], cfg), positions, mask, cfg)
    return x + _mlp(p, _rms_norm(x, p["post_attention_layernorm.weight"], cfg), cfg)


def forward(params: dict, cfg: ModelConfig, input_ids, position_ids, key_mask, dtype=None, remat: bool = False):
    """Logits [B, T, vocab] (float32). `dtype`: the compute dtype (bf16 on TPU); params stay as given.
    `remat` (spec.training.activationCheckpointing): each decoder layer keeps only its input for the
    backward pass and recomputes the rest (jax.checkpoint), trading compute for activation memory."""
    import jax
    import jax.numpy as jnp

    cast = (lambda a: a.astype(dtype)) if dtype is not None else (lambda a: a)
    embed = params[EMBEDDING]
    x = cast(embed[input_ids])
    if cfg.gemma:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=x.dtype)
    mask = attention_mask(position_ids, key_mask)
    layer = jax.checkpoint(_decoder_layer, static_argnums=(4,)) if remat else _decoder_layer
    for i in range(cfg.num_layers):
        p = {k[len(f"model.layers.{i}."):]: cast(v) for k, v in params.items() if k.startswith(f"model.layers.{i}.")}
        x = layer(p, x, position_ids, mask, cfg)
    x = _rms_norm(x, cast(params["model.norm.weight"]), cfg)
    head = embed if cfg.tie_word_embeddings else params["lm_head.weight"]
    return _linear(x, cast(head)).astype(jnp.float32)


def _next_token_labels(labels):
    """Each position's target: the next token's label (HF's shift), IGNORE at the end."""
    import jax.numpy as jnp

    return jnp.concatenate([labels[..., 1:], jnp.full_like(labels[..., :1], IGNORE)], axis=-1)


def labelled_tokens(labels):
    """The tokens the loss scores in `labels` ([..., T]: loss_sums' count), before any forward pass."""
    return (_next_token_labels(labels) != IGNORE).sum()


def loss_sums(params: dict, cfg: ModelConfig, batch: dict, dtype=None, remat: bool = False):
    """(summed next-token cross entropy, labelled tokens) over `batch`: HF's ForCausalLMLoss
    before its division, so sums from several shards average exactly."""
    import jax
    import jax.numpy as jnp

    logits = forward(params, cfg, batch["input_ids"], batch["position_ids"], batch["key_mask"], dtype, remat)
    labels = _next_token_labels(batch["labels"])
    valid = labels != IGNORE
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return -(picked * valid).sum(), valid.sum()


def loss(params: dict, cfg: ModelConfig, batch: dict, dtype=None, remat: bool = False):
    total, count = loss_sums(params, cfg, batch, dtype, remat)
    return total / count.clip(1)


def inputs_from_rows(rows: dict, packing: bool) -> dict:
    """Pipeline rows (numpy, tpuft_workload.pipeline.ROW_COLUMNS) -> forward()'s inputs, as the
    torch path hands them to transformers: packed rows keep their restarting position_ids and
    attend everywhere within an example; padded rows count positions from 0 and mask the pads."""
    import numpy as np

    ids = np.asarray(rows["input_ids"], dtype=np.int32)
    if packing:
        pos, keys = np.asarray(rows["position_ids"], dtype=np.int32), np.ones_like(ids)
    else:
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
        keys = np.asarray(rows["attention_mask"], dtype=np.int32)
    return {"input_ids": ids, "labels": np.asarray(rows["labels"], dtype=np.int32), "position_ids": pos,
            "key_mask": keys}
