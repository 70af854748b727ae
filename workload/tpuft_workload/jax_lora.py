"""spec.training.method: lora on the JAX path: PEFT's LoRA on tpuft_workload.jax_model's flat params.

The same adapters as the torch path (tpuft_workload.lora): the driver resolves LoraSettings on the
meta model (targets by PEFT's suffix rule, the model_type's default when none are given), and each
targeted linear layer gains A [rank, in] and B [out, rank] beside its weight, under the names PEFT
saves them with less its `base_model.model.` prefix (`model.layers.0.self_attn.q_proj.lora_A.weight`).
A starts as PEFT's (Kaiming-uniform, a = sqrt(5)), B at zero; the layer adds
alpha / rank * B(A(dropout(x))) (jax_model.Adapters). Only the adapters are trained, checkpointed
and exported; the export is written by tpuft_workload.lora.write_export, the torch path's own, so
both frameworks write the same PEFT adapter folder.
"""
from __future__ import annotations

import math

from tpuft_workload import jax_model as jm
from tpuft_workload.lora import PEFT_PREFIX, LoraSettings, matches

WEIGHT = ".weight"


def adapters(settings: LoraSettings) -> jm.Adapters:
    return jm.Adapters(scale=settings.alpha / settings.rank, dropout=settings.dropout)


def targeted(cfg: jm.ModelConfig, settings: LoraSettings) -> list[str]:
    """The base weights (HF names) whose linear layer `settings.target_modules` names."""
    found = []
    for i in range(cfg.num_layers):
        for module in jm.LINEAR_MODULES:
            path = f"model.layers.{i}.{module}"
            if any(matches(path, t) for t in settings.target_modules):
                found.append(path + WEIGHT)
    return found


def adapter_names(weight: str) -> tuple[str, str]:
    """(A's name, B's name) of the adapters on base weight `weight`."""
    module = weight.removesuffix(WEIGHT)
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def init(cfg: jm.ModelConfig, settings: LoraSettings, shapes: dict, seed: int) -> dict:
    """{adapter name: float32 numpy}: A as PEFT draws it (uniform within 1/sqrt(in)), B zero, so
    training starts from the base's own outputs. `shapes`: each targeted weight's [out, in]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for weight in targeted(cfg, settings):
        n_out, n_in = shapes[weight]
        a, b = adapter_names(weight)
        bound = 1.0 / math.sqrt(n_in)   # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) x sqrt(3 / fan_in)
        out[a] = rng.uniform(-bound, bound, size=(settings.rank, n_in)).astype(np.float32)
        out[b] = np.zeros((n_out, settings.rank), np.float32)
    return out


def peft_state(base: dict, trained: dict, settings: LoraSettings, cfg: jm.ModelConfig) -> dict:
    """The PEFT model's state dict (torch tensors) of `trained` adapters over `base` (either may be
    empty): what tpuft_workload.lora.write_export rebuilds the PEFT model from."""
    import numpy as np
    import torch

    adapted = set(targeted(cfg, settings))
    state = {}
    for name, value in base.items():
        key = name.replace(WEIGHT, ".base_layer.weight") if name in adapted else name
        state[PEFT_PREFIX + key] = torch.from_numpy(np.asarray(value, np.float32).copy())
    for name, value in trained.items():
        state[PEFT_PREFIX + name.replace(".weight", ".default.weight")] = torch.from_numpy(
            np.asarray(value, np.float32).copy())
    return state
