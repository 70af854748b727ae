"""Tiny random models of each family the JAX path is measured on, built by transformers from the
family's own config class and saved as safetensors (shared by tests/workload/test_jax_*.py).

Every parameter is drawn at random (norm scales around their init, biases too), so a missed bias,
norm or (1 + w) shows in the logits; small windows and low soft-caps make sliding-window layers
and soft-capping change them at these lengths.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

VOCAB = 128
_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_TWO_KINDS = ["sliding_attention", "full_attention"]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# family -> (transformers config class, its settings beyond _SHAPE)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama-3.x": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 6}),
    "qwen2.5": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": 6, "layer_types": _TWO_KINDS, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3-text": ("Gemma3TextConfig", {
        "sliding_window": 6, "layer_types": _TWO_KINDS, "query_pre_attn_scalar": 24,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    "gemma4-text": ("Gemma4TextConfig", {"hidden_size_per_layer_input": 0}),
}


def build(family: str, seed: int = 0, vocab: int = VOCAB):
    """The family's tiny transformers model (float32, eval mode), every parameter random."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, settings = FAMILIES[family]
    config = getattr(transformers, cls)(**{**_SHAPE, **settings, "vocab_size": vocab})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.05))
    return model


def save(family: str, directory: str, seed: int = 0, tokenizer=None):
    """build() saved as a from_pretrained() folder (safetensors), with `tokenizer` (its vocabulary
    then the model's) when given; the model."""
    model = build(family, seed, len(tokenizer) if tokenizer is not None else VOCAB)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return model


def packed_inputs():
    """Two rows of 24 tokens: the first packs three examples (position_ids restart), the second one."""
    import numpy as np

    rng = np.random.default_rng(7)
    ids = rng.integers(1, VOCAB, size=(2, 24)).astype(np.int32)
    positions = np.stack([np.concatenate([np.arange(10), np.arange(9), np.arange(5)]), np.arange(24)])
    return ids, positions.astype(np.int32)
