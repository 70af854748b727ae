"""Hugging Face causal LMs of the current families in plain JAX, on Hugging Face's own parameter names.

transformers 5 dropped its Flax models, so the JAX path carries its own forward pass. The
parameters are a flat dict keyed exactly as the transformers model's state_dict
(`model.layers.0.self_attn.q_proj.weight`, ...) with torch's [out, in] layout, so loading a
checkpoint, sharding by name and exporting safetensors that `from_pretrained` reads back are
each a dict operation, with no name or layout mapping to keep in step with transformers.

One decoder covers the families (FAMILIES: model_type -> what sets it apart), each matching
transformers' logits within 1e-4 in float32 (tests/workload/test_jax_parity.py, docs/jax.md):
Llama (1-3.x: default, linear and llama3 RoPE), Mistral (the Llama layout, a sliding window),
Qwen 2/2.5 (q/k/v biases), Qwen 3 (q/k RMSNorm per head), Gemma (v1: (1 + w) RMSNorm,
embeddings scaled by sqrt(hidden), GELU-tanh), Gemma 2 (and norms around attention and MLP,
attention and final logit soft-capping, sliding-window layers, query_pre_attn_scalar) and
Gemma 3 text (Gemma 2 with q/k norms and a RoPE per layer type). Refused by name: any other
model_type (Gemma 4: per-layer inputs, shared KV, k = v attention) and RoPE types not listed.

Attention follows what the torch path gives transformers: packed rows restart position_ids
per example and attention is block-diagonal across examples (a new example starts wherever
position_ids do not continue by one); padded rows use positions 0..T-1 and mask the padding.
A sliding window counts token offsets within an example, as transformers' masks do.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

IGNORE = -100
EMBEDDING = "model.embed_tokens.weight"   # also the output head when tie_word_embeddings
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Family:
    """What sets a model_type apart from the Llama layout (transformers' modeling_<type>.py)."""
    hf_class: str                              # the transformers class that loads the export
    gemma: bool = False                        # (1 + w) RMSNorm, embeddings scaled by sqrt(hidden)
    sandwich_norms: bool = False               # norms after attention and around the MLP (Gemma 2/3)
    qk_norm: bool = False                      # RMSNorm over each head's q and k before RoPE
    biased: tuple[str, ...] | None = None      # projections with a bias whatever attention_bias says
    rope_per_layer_type: bool = False          # rope_parameters keyed by layer type (Gemma 3)


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", biased=("q_proj", "k_proj", "v_proj")),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "gemma": Family("GemmaForCausalLM", gemma=True),
    "gemma2": Family("Gemma2ForCausalLM", gemma=True, sandwich_norms=True),
    "gemma3_text": Family("Gemma3ForCausalLM", gemma=True, sandwich_norms=True, qk_norm=True,
                          rope_per_layer_type=True),
}
SUPPORTED = tuple(FAMILIES)
# Named with what is missing, so the refusal says why (the model_type alone would not).
_NOT_IMPLEMENTED = {
    "gemma4": "Gemma 4 (per-layer input embeddings, KV shared across layers, k = v attention)",
    "gemma4_text": "Gemma 4 (per-layer input embeddings, KV shared across layers, k = v attention)",
}


class ModelError(ValueError):
    """spec.model's architecture is not one this JAX model implements: what differs, what to do."""

    def __init__(self, message: str):
        super().__init__(f"spec.model (training.framework jax): {message}; use a checkpoint of model_type "
                         f"{', '.join(SUPPORTED)}, or training.framework torch")


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding: rope_theta and transformers' rope_type with its parameters."""
    theta: float
    kind: str = "default"                      # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inverse_frequencies(self, head_dim: int):
        """transformers' inv_freq (modeling_rope_utils), float32 as it computes it."""
        import numpy as np

        inv = (1.0 / (np.float32(self.theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)))
        inv = inv.astype(np.float32)
        if self.kind == "linear":
            return inv / np.float32(self.factor)
        if self.kind == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = ((self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                      / (self.high_freq_factor - self.low_freq_factor))
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


_ROPE_TYPES = ("default", "linear", "llama3")


def _rope(params: dict, where: str) -> Rope:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ModelError(f"{where} rope_type {kind!r} is not implemented (implemented: {', '.join(_ROPE_TYPES)})")
    extra = {}
    if kind != "default":
        extra["factor"] = float(params["factor"])
    if kind == "llama3":
        extra.update(low_freq_factor=float(params["low_freq_factor"]),
                     high_freq_factor=float(params["high_freq_factor"]),
                     original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return Rope(theta=float(params["rope_theta"]), kind=kind, **extra)


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
    tie_word_embeddings: bool
    activation: str                            # silu | gelu_tanh
    ropes: tuple[Rope, ...]                    # one per layer
    windows: tuple[int | None, ...]            # each layer's sliding window (None: full attention)
    biased: tuple[str, ...] = ()               # attention projections with a bias
    attention_scale: float = 0.0               # 0: head_dim ** -0.5
    attention_softcap: float | None = None
    final_softcap: float | None = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def gemma(self) -> bool:
        return self.family.gemma


def _layer_ropes(hf: dict, kind: str, layer_types: list[str]) -> tuple[Rope, ...]:
    """Each layer's Rope from transformers 5's rope_parameters: one dict, or one per layer type
    (Gemma 3). open_hf_dir reads config.json through AutoConfig, which writes older configs'
    rope_theta / rope_scaling / rope_local_base_freq this way."""
    given = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)}
    if FAMILIES[kind].rope_per_layer_type:
        by_type = {t: _rope(given[t], f"rope_parameters.{t}") for t in set(layer_types)}
        return tuple(by_type[t] for t in layer_types)
    return (_rope(given, "rope_parameters"),) * len(layer_types)


def _windows(hf: dict, kind: str, layer_types: list[str]) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if kind == "mistral" or not hf.get("layer_types"):   # Mistral: every layer, when a window is set
        sliding = [kind == "mistral"] * len(layer_types)
    else:
        sliding = [t == "sliding_attention" for t in layer_types]
    return tuple(int(window) if s and window else None for s in sliding)


def config_from_hf(hf: dict) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig; ModelError when it is not supported."""
    kind = hf.get("model_type")
    if kind in _NOT_IMPLEMENTED:
        raise ModelError(f"model_type {kind!r} is not implemented: {_NOT_IMPLEMENTED[kind]}")
    if kind not in FAMILIES:
        raise ModelError(f"model_type {kind!r} is not implemented (supported: {', '.join(SUPPORTED)})")
    family = FAMILIES[kind]
    if hf.get("mlp_bias"):
        raise ModelError("mlp_bias: true is not implemented")
    if hf.get("use_bidirectional_attention"):
        raise ModelError("use_bidirectional_attention is not implemented (causal attention only)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise ModelError(f"activation {act!r} is not implemented (supported: {', '.join(_ACTIVATIONS)})")
    heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    layer_types = list(hf.get("layer_types") or ["full_attention"] * layers)
    if family.biased is not None:
        biased = family.biased
    else:
        biased = _PROJECTIONS if hf.get("attention_bias") else ()
    scalar = hf.get("query_pre_attn_scalar") if family.gemma else None
    return ModelConfig(
        model_type=kind, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.gemma)),
        activation=_ACTIVATIONS[act], ropes=_layer_ropes(hf, kind, layer_types),
        windows=_windows(hf, kind, layer_types), biased=tuple(biased),
        attention_scale=float(scalar) ** -0.5 if scalar else 0.0,
        attention_softcap=hf.get("attn_logit_softcapping") if family.gemma else None,
        final_softcap=hf.get("final_logit_softcapping") if family.gemma else None)


# ---- load / save on Hugging Face names --------------------------------------------------------

def param_names(cfg: ModelConfig) -> list[str]:
    """Every trainable parameter, as the family's transformers model names it."""
    family = cfg.family
    per_layer = [f"self_attn.{proj}.weight" for proj in _PROJECTIONS]
    per_layer += [f"self_attn.{proj}.bias" for proj in cfg.biased]
    per_layer += ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight"]
    if family.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if family.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names = [EMBEDDING, "model.norm.weight"]
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{n}" for n in per_layer]
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
    from transformers import AutoConfig

    # through transformers' config class: a config.json of an older transformers (rope_scaling,
    # Gemma 3's sliding_window_pattern) reads as the current fields (rope_parameters, layer_types)
    hf = AutoConfig.from_pretrained(path).to_dict()
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
    return FAMILIES[hf_config["model_type"]].hf_class


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


def _apply_rope(x, positions, layer: int, cfg: ModelConfig):
    """HF's rotate_half RoPE on [B, T, heads, head_dim], with layer `layer`'s frequencies."""
    import jax.numpy as jnp

    d = cfg.head_dim
    inv = jnp.asarray(cfg.ropes[layer].inverse_frequencies(d))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _linear(x, w, bias=None):
    y = x @ w.T.astype(x.dtype)   # HF [out, in] weights
    return y if bias is None else y + bias.astype(x.dtype)


@dataclass(frozen=True)
class Adapters:
    """LoRA on the forward pass (tpuft_workload.jax_lora): each adapted linear layer adds
    scale * B(A(dropout(x))), PEFT's LoraLayer; its A and B sit in the params beside the weight
    (`<module>.lora_A.weight` [r, in], `<module>.lora_B.weight` [out, r])."""
    scale: float
    dropout: float = 0.0


# Every linear layer of a decoder layer, in a fixed order (dropout's random stream per module).
LINEAR_MODULES = tuple(f"self_attn.{n}" for n in _PROJECTIONS) + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _adapted(p: dict, x, module: str, adapters: Adapters | None, rng):
    """Linear layer `module` (short name) on x, plus its LoRA adapters when `p` holds them."""
    import jax
    import jax.numpy as jnp

    y = _linear(x, p[f"{module}.weight"], p.get(f"{module}.bias"))
    a = p.get(f"{module}.lora_A.weight")
    if a is None or adapters is None:
        return y
    h = x
    if adapters.dropout and rng is not None:
        keep = jax.random.bernoulli(jax.random.fold_in(rng, LINEAR_MODULES.index(module)), 1.0 - adapters.dropout,
                                    x.shape)
        h = jnp.where(keep, x / (1.0 - adapters.dropout), jnp.zeros_like(x))
    return y + _linear(_linear(h, a), p[f"{module}.lora_B.weight"]) * jnp.asarray(adapters.scale, x.dtype)


def _attention(p: dict, x, positions, mask, layer: int, cfg: ModelConfig, adapters=None, rng=None):
    import jax
    import jax.numpy as jnp

    def project(name, h):
        return _adapted(p, h, f"self_attn.{name}", adapters, rng)

    b, t, _ = x.shape
    q = project("q_proj", x).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = project("k_proj", x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = project("v_proj", x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.family.qk_norm:
        q, k = _rms_norm(q, p["self_attn.q_norm.weight"], cfg), _rms_norm(k, p["self_attn.k_norm.weight"], cfg)
    q, k = _apply_rope(q, positions, layer, cfg), _apply_rope(k, positions, layer, cfg)
    groups = cfg.num_heads // cfg.num_kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scale = cfg.attention_scale or cfg.head_dim ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if cfg.attention_softcap:
        scores = jnp.tanh(scores / cfg.attention_softcap) * cfg.attention_softcap
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, cfg.num_heads * cfg.head_dim)
    return project("o_proj", out)


def _mlp(p: dict, x, cfg: ModelConfig, adapters=None, rng=None):
    import jax

    gate = _adapted(p, x, "mlp.gate_proj", adapters, rng)
    act = jax.nn.silu(gate) if cfg.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return _adapted(p, act * _adapted(p, x, "mlp.up_proj", adapters, rng), "mlp.down_proj", adapters, rng)


def attention_mask(position_ids, key_mask, window: int | None = None):
    """[B, T, T] causal mask, block-diagonal across packed examples, padding keys masked out;
    with `window`, a query sees only the `window` latest tokens (itself included)."""
    import jax.numpy as jnp

    b, t = position_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), position_ids[:, 1:] != position_ids[:, :-1] + 1], axis=1)
    segment = jnp.cumsum(starts, axis=1)
    causal = jnp.tril(jnp.ones((t, t), bool))
    if window:
        causal = causal & ~jnp.tril(jnp.ones((t, t), bool), -window)
    same = segment[:, :, None] == segment[:, None, :]
    return causal[None] & same & key_mask.astype(bool)[:, None, :]


def _decoder_layer(p: dict, x, positions, mask, rng, cfg: ModelConfig, layer: int, adapters: Adapters | None):
    """Decoder layer `layer` on the residual stream `x` (`p`: the layer's parameters, short names;
    `rng`: the adapters' dropout key for this layer, or None)."""
    attended = _attention(p, _rms_norm(x, p["input_layernorm.weight"], cfg), positions, mask, layer, cfg,
                          adapters, rng)
    if not cfg.family.sandwich_norms:
        x = x + attended
        return x + _mlp(p, _rms_norm(x, p["post_attention_layernorm.weight"], cfg), cfg, adapters, rng)
    x = x + _rms_norm(attended, p["post_attention_layernorm.weight"], cfg)
    fed = _mlp(p, _rms_norm(x, p["pre_feedforward_layernorm.weight"], cfg), cfg, adapters, rng)
    return x + _rms_norm(fed, p["post_feedforward_layernorm.weight"], cfg)


def forward(params: dict, cfg: ModelConfig, input_ids, position_ids, key_mask, dtype=None, remat: bool = False,
            adapters: Adapters | None = None, rng=None):
    """Logits [B, T, vocab] (float32). `dtype`: the compute dtype (bf16 on TPU); params stay as given.
    `remat` (spec.training.activationCheckpointing): each decoder layer keeps only its input for the
    backward pass and recomputes the rest (jax.checkpoint), trading compute for activation memory.
    `adapters`: LoRA on the layers whose A and B `params` holds; `rng` a key for their dropout
    (None: no dropout, as in evaluation)."""
    import jax
    import jax.numpy as jnp

    cast = (lambda a: a.astype(dtype)) if dtype is not None else (lambda a: a)
    embed = params[EMBEDDING]
    x = cast(embed[input_ids])
    if cfg.gemma:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=x.dtype)
    masks = {w: attention_mask(position_ids, key_mask, w) for w in set(cfg.windows)}
    layer = jax.checkpoint(_decoder_layer, static_argnums=(5, 6, 7)) if remat else _decoder_layer
    for i in range(cfg.num_layers):
        p = {k[len(f"model.layers.{i}."):]: cast(v) for k, v in params.items() if k.startswith(f"model.layers.{i}.")}
        key = None if rng is None else jax.random.fold_in(rng, i)
        x = layer(p, x, position_ids, masks[cfg.windows[i]], key, cfg, i, adapters)
    x = _rms_norm(x, cast(params["model.norm.weight"]), cfg)
    head = embed if cfg.tie_word_embeddings else params["lm_head.weight"]
    logits = _linear(x, cast(head)).astype(jnp.float32)
    if cfg.final_softcap:
        logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def _next_token_labels(labels):
    """Each position's target: the next token's label (HF's shift), IGNORE at the end."""
    import jax.numpy as jnp

    return jnp.concatenate([labels[..., 1:], jnp.full_like(labels[..., :1], IGNORE)], axis=-1)


def labelled_tokens(labels):
    """The tokens the loss scores in `labels` ([..., T]: loss_sums' count), before any forward pass."""
    return (_next_token_labels(labels) != IGNORE).sum()


def loss_sums(params: dict, cfg: ModelConfig, batch: dict, dtype=None, remat: bool = False,
              adapters: Adapters | None = None, rng=None):
    """(summed next-token cross entropy, labelled tokens) over `batch`: HF's ForCausalLMLoss
    before its division, so sums from several shards average exactly."""
    import jax
    import jax.numpy as jnp

    logits = forward(params, cfg, batch["input_ids"], batch["position_ids"], batch["key_mask"], dtype, remat,
                     adapters, rng)
    labels = _next_token_labels(batch["labels"])
    valid = labels != IGNORE
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return -(picked * valid).sum(), valid.sum()


def loss(params: dict, cfg: ModelConfig, batch: dict, dtype=None, remat: bool = False,
         adapters: Adapters | None = None, rng=None):
    total, count = loss_sums(params, cfg, batch, dtype, remat, adapters, rng)
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
