"""Dolly instruction data: template, tokenization, packing, padding.

Pure functions (lists in, lists out) so the label rules are unit-tested without a model. The
training job runs them inside Ray Data (tpuft_workload.pipeline). `load_records`, `build_blocks`,
`rank_batches` and `collate` are the per-rank path the workload used before (every rank built
every row, then took its slice): the reference the pipeline's rows are tested against and the
baseline of bench/data_pipeline.py.

Label rules (HF causal LMs shift internally: the label at position j is predicted from
positions < j):
- prompt tokens (template, instruction, context) are -100: we train on the response + EOS;
- every example ends with EOS, so the model learns to stop;
- the FIRST token of every example is -100, always. Inside a packed block that token would
  otherwise be "predicted" from the previous example's EOS; masking it means no label ever
  crosses from one example into the next;
- padding is -100 and exists only at the tail of the last packed block.

Attention across packed examples: each block carries position_ids that restart at 0 at
every example start. With no attention_mask, transformers (masking_utils,
find_packed_sequence_indices) turns such position_ids into a block-diagonal causal mask, so
an example never attends to the one before it; RoPE positions restart too. An example cut
at a block edge continues in the next block with continuing positions (it loses the
context in the previous block; that is the price of zero padding).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

IGNORE = -100

PROMPT = "### Instruction:\n{instruction}\n\n{context}### Response:\n"
CONTEXT = "### Context:\n{context}\n\n"
# Words of the template, for the built-in tokenizer's vocabulary.
TEMPLATE_WORDS = PROMPT.format(instruction="", context=CONTEXT.format(context=""))


def format_prompt(record: dict) -> str:
    ctx = (record.get("context") or "").strip()
    return PROMPT.format(instruction=(record.get("instruction") or "").strip(),
                         context=CONTEXT.format(context=ctx) if ctx else "")


def format_example(record: dict) -> tuple[str, str]:
    """(prompt, response) in the dolly template; context only when present."""
    return format_prompt(record), (record.get("response") or "").strip()


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def tokenize_example(tokenizer, record: dict, mask_prompt: bool = True) -> Example:
    """Prompt (with the tokenizer's BOS if it adds one) + response + EOS."""
    prompt, response = format_example(record)
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] if response else []
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: packing needs it to separate examples")
    ids = list(p) + list(r) + [eos]
    labels = ([IGNORE] * len(p) if mask_prompt else list(p)) + list(r) + [eos]
    labels[0] = IGNORE  # never trained to predict an example's first token from what precedes it
    return Example(ids, labels)


@dataclass
class Block:
    """One fixed-length training row. n_real = non-pad tokens."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    attention_mask: list[int] | None = None
    n_real: int = 0
    meta: dict = field(default_factory=dict)


def pack_examples(examples: list[Example], block_len: int, pad_id: int) -> list[Block]:
    """Concatenate examples (each already ends with EOS) and cut into block_len rows.

    Examples are never truncated; only the last block is padded.
    """
    if block_len < 2:
        raise ValueError(f"block length must be >= 2 (got {block_len})")
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for ex in examples:
        ids.extend(ex.input_ids)
        labels.extend(ex.labels)
        pos.extend(range(len(ex.input_ids)))
    blocks = []
    for s in range(0, len(ids), block_len):
        b_ids, b_lab, b_pos = ids[s:s + block_len], labels[s:s + block_len], pos[s:s + block_len]
        n_real = len(b_ids)
        pad = block_len - n_real
        if pad:
            b_ids = b_ids + [pad_id] * pad
            b_lab = b_lab + [IGNORE] * pad
            b_pos = b_pos + list(range(pad))  # its own segment: real tokens never attend to pads
        blocks.append(Block(b_ids, b_lab, b_pos, None, n_real))
    return blocks


def pad_examples(examples: list[Example], max_len: int, pad_id: int) -> list[Block]:
    """Without packing, as the GKE tutorial trains: one example per row, truncated/padded to max_len,
    attention_mask."""
    blocks = []
    for ex in examples:
        ids, lab = ex.input_ids[:max_len], ex.labels[:max_len]
        n = len(ids)
        pad = max_len - n
        blocks.append(Block(ids + [pad_id] * pad, lab + [IGNORE] * pad, None, [1] * n + [0] * pad, n))
    return blocks


def pad_fraction(blocks: list[Block]) -> float:
    total = sum(len(b.input_ids) for b in blocks)
    return 1.0 - sum(b.n_real for b in blocks) / total if total else 0.0


def steps_per_epoch(num_blocks: int, world: int, batch: int) -> int:
    return num_blocks // (world * batch)


def rank_batches(num_blocks: int, world: int, rank: int, batch: int, epoch: int, seed: int) -> list[list[int]]:
    """Block indices for each step of one epoch on one rank.

    Same permutation on every rank (seeded by seed+epoch), disjoint slices per rank, and the
    same number of steps everywhere (the remainder is dropped: FSDP collectives need every
    rank to run every step). Deterministic, so a resumed run can skip finished steps.
    """
    steps = steps_per_epoch(num_blocks, world, batch)
    if steps == 0:
        raise ValueError(
            f"{num_blocks} training rows cannot fill one global batch of {world} workers x {batch} "
            "per device: use a larger --dataset-split, a smaller --batch-size-per-device or "
            "--max-seq-length, or fewer workers")
    order = list(range(num_blocks))
    random.Random(seed * 1000003 + epoch).shuffle(order)
    gb = world * batch
    return [order[s * gb + rank * batch: s * gb + (rank + 1) * batch] for s in range(steps)]


def collate(blocks: list[Block], idxs: list[int]):
    """Rows -> dict of LongTensors: input_ids, labels, and position_ids (packed) or attention_mask."""
    import torch

    rows = [blocks[i] for i in idxs]
    out = {"input_ids": torch.tensor([b.input_ids for b in rows], dtype=torch.long),
           "labels": torch.tensor([b.labels for b in rows], dtype=torch.long)}
    if rows[0].position_ids is not None:
        out["position_ids"] = torch.tensor([b.position_ids for b in rows], dtype=torch.long)
    if rows[0].attention_mask is not None:
        out["attention_mask"] = torch.tensor([b.attention_mask for b in rows], dtype=torch.long)
    return out


def build_blocks(tokenizer, records: list[dict], max_len: int, packing: bool, mask_prompt: bool = True) -> list[Block]:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = [tokenize_example(tokenizer, r, mask_prompt) for r in records]
    return pack_examples(examples, max_len, pad_id) if packing else pad_examples(examples, max_len, pad_id)


# ---- loading ------------------------------------------------------------------------------

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_records(dataset: str, split: str = "train") -> list[dict]:
    """builtin:dolly-mini, a local file/dir, a gs:// file, or a hub name -> list of records.

    `split` uses datasets' split syntax ("train[:64]", "train[10%:20%]").
    """
    from datasets import load_dataset

    from tpuft_workload.tiny import BUILTIN_DATASET, dolly_mini_path

    if dataset == BUILTIN_DATASET:
        ds = load_dataset("json", data_files={"train": str(dolly_mini_path())}, split=split)
    else:
        suffix = next((s for s in _FORMATS if dataset.lower().endswith(s)), None)
        if suffix is not None:  # a single file, local or remote (gs:// needs gcsfs in the image)
            ds = load_dataset(_FORMATS[suffix], data_files={"train": dataset}, split=split)
        else:  # a hub name, or a local/remote directory datasets knows how to read
            ds = load_dataset(dataset, split=split)
    missing = {"instruction", "response"} - set(ds.column_names)
    if missing:
        raise ValueError(f"dataset {dataset!r} has no {sorted(missing)} columns (found {ds.column_names}); "
                         "the dolly template needs instruction, response and optionally context")
    return [dict(r) for r in ds]
