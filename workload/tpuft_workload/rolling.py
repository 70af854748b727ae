"""Continuous batching for the transformers engine: requests join a batch that is already decoding,
at its next step, instead of waiting for the whole batch to end (tpuft_workload.batching uses it
when `supported(model)`).

Why: with static batching, 8 closed-loop clients split into two groups (say 6 and 2) whose answers
come back out of phase; each group then waits for the other's whole batch, and every request pays
two batches' time. Here a request that arrives mid-batch is prefilled on its own and its KV cache
joins the running one, so the groups merge at the next step and stay merged.

The decoding loop is ours (model forward with a DynamicCache), so it only runs where joining caches
is plain tensor work: every cache layer a full-attention `DynamicLayer` ([batch, heads, tokens,
dim], grown by concatenation; Llama, Qwen, Mistral without a window). Rows are left-padded to a
common length, the padding masked out, positions counted per row; a row that ends is dropped from
the batch and padding no row needs any more is cut off the front. Sliding windows (Gemma), shared
KV layers and recurrent caches keep generate()'s static batching, which handles them.
"""
from __future__ import annotations

from dataclasses import dataclass


def supported(model) -> bool:
    """Whether `model`'s cache is full attention on every layer (its rows can join a running batch)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "forward", None)):
        return False
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config transformers cannot build a dynamic cache for: static batching
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


@dataclass
class Rows:
    """The running batch's tensors: its KV cache, its attention mask [rows, tokens] (0 over each
    row's left padding) and each row's next position (its real tokens so far)."""
    cache: object            # transformers.DynamicCache
    mask: object             # torch.LongTensor [rows, tokens]
    positions: object        # torch.LongTensor [rows]

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


def prefill(model, prompts: list[list[int]], pad_id: int):
    """The prompts' forward pass, left-padded into one batch: (their Rows, each row's last logits)."""
    import torch
    from transformers import DynamicCache

    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    return Rows(cache, mask, mask.sum(-1)), out.logits[:, -1, :]


def step(model, rows: Rows, tokens: list[int]):
    """One decoding step: each row's newest token in, each row's next logits out (rows grow by one)."""
    import torch

    device = rows.mask.device
    rows.mask = torch.cat([rows.mask, torch.ones_like(rows.mask[:, :1])], dim=1)
    ids = torch.tensor(tokens, device=device).unsqueeze(1)
    out = model(input_ids=ids, attention_mask=rows.mask, position_ids=rows.positions.unsqueeze(1),
                cache=rows.cache, use_cache=True, logits_to_keep=1)
    rows.positions = rows.positions + 1
    return out.logits[:, -1, :]


def join(running: Rows, joining: Rows) -> Rows:
    """One batch of both: the shorter side left-padded (masked) to the other's length, joined on rows."""
    import torch
    from torch.nn.functional import pad

    width = max(running.width, joining.width)
    left = (width - running.width, width - joining.width)   # tokens of padding each side gets
    for a, b in zip(running.cache.layers, joining.cache.layers):
        # [rows, heads, tokens, dim]: pad's last pair is the tokens axis' (before, after)
        a.keys = torch.cat([pad(a.keys, (0, 0, left[0], 0)), pad(b.keys, (0, 0, left[1], 0))])
        a.values = torch.cat([pad(a.values, (0, 0, left[0], 0)), pad(b.values, (0, 0, left[1], 0))])
    mask = torch.cat([pad(running.mask, (left[0], 0)), pad(joining.mask, (left[1], 0))])
    return Rows(running.cache, mask, torch.cat([running.positions, joining.positions]))


def keep(rows: Rows, indices: list[int]) -> Rows:
    """Only these rows, and only the tokens some kept row still attends to (old padding cut off)."""
    import torch

    index = torch.tensor(indices, device=rows.mask.device)
    mask = rows.mask.index_select(0, index)
    first = int(mask.any(0).int().argmax())   # the first token column any kept row uses
    for layer in rows.cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, first:, :]
        layer.values = layer.values.index_select(0, index)[:, :, first:, :]
    return Rows(rows.cache, mask[:, first:], rows.positions.index_select(0, index))
