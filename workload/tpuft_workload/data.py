"""Training examples: records rendered (tpuft_workload.render), whole examples bin-packed into
fixed-length rows or padded one per row, and the rows each rank trains on in each epoch.

Pure functions (lists in, lists out) so the label rules are unit-tested without a model. The
training driver runs them (tpuft_workload.pipeline: Ray Data reads and tokenizes, the driver packs);
tests and bench/ build the same rows in one process (tests/workload/inprocess_data.py).

Label rules (HF causal LMs shift internally: the label at position j is predicted from
positions < j):
- only the trained assistant turns' tokens (their content and the template's turn end) are
  labels; a text example's every token but its first;
- the FIRST token of every example is -100, always (the renderer never labels it): inside a
  packed row it would otherwise be "predicted" from the previous example's last token;
- padding is -100.

Packing: best-fit decreasing over whole examples (the longest first, each into the row it fills
most tightly), so no example is ever split across rows; one longer than a row is truncated or
dropped (spec.dataset.overlong), and the counts are reported. Each row carries position_ids that
restart at 0 at every example start. With no attention_mask, transformers (masking_utils,
find_packed_sequence_indices) turns such position_ids into a block-diagonal causal mask, so an
example never attends to the one before it; RoPE positions restart too.

Order: every epoch a seeded permutation of all rows (`rank_batches`), the same on every rank, each
rank taking its own slice of each global batch; a resumed epoch skips exactly the batches trained.
"""
from __future__ import annotations

import bisect
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from tpuft.api.constants import Overlong
from tpuft.api import records as recordslib
from tpuft_workload.render import IGNORE, Example, render, render_text

__all__ = ["IGNORE", "Example"]


def example_of(tokenizer, record: Mapping, layout: recordslib.Layout, number: int = 1) -> Example:
    """One record -> token ids and labels (RecordError if it does not fit its layout)."""
    read = recordslib.read(record, layout, number)
    return render_text(tokenizer, read) if isinstance(read, str) else render(tokenizer, read)


@dataclass
class Block:
    """One fixed-length training row. n_real = non-pad tokens."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    attention_mask: list[int] | None = None
    n_real: int = 0
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Fitted:
    """Examples that fit a row, and how many did not: cut to the row (`truncated`) or left out
    (`dropped`: too long under overlong=drop, or nothing trained left after the cut)."""
    examples: list[Example]
    truncated: int
    dropped: int


def fit(examples: list[Example], max_len: int, overlong: str = Overlong.TRUNCATE.value) -> Fitted:
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex.input_ids) <= max_len:
            kept.append(ex)
            continue
        cut = Example(ex.input_ids[:max_len], ex.labels[:max_len])
        if overlong == Overlong.DROP.value or cut.trained == 0:
            dropped += 1
        else:
            kept.append(cut)
            truncated += 1
    return Fitted(kept, truncated, dropped)


def bin_pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: example indices per row, every length <= capacity, no example split.
    Deterministic: ties keep the examples' order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []    # (room left, row index), sorted
    for i in order:
        need = lengths[i]
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, row = free.pop(at)
            rows[row].append(i)
            bisect.insort(free, (room - need, row))
        else:
            rows.append([i])
            bisect.insort(free, (capacity - need, len(rows) - 1))
    return rows


def pack_examples(examples: list[Example], block_len: int, pad_id: int) -> list[Block]:
    """Whole examples (each at most block_len tokens: `fit` first) bin-packed into block_len rows,
    position_ids restarting per example, the rest of each row padding."""
    if block_len < 2:
        raise ValueError(f"block length must be >= 2 (got {block_len})")
    too_long = [len(ex.input_ids) for ex in examples if len(ex.input_ids) > block_len]
    if too_long:
        raise ValueError(f"{len(too_long)} example(s) longer than a row of {block_len} tokens: fit() them first")
    blocks = []
    for members in bin_pack([len(ex.input_ids) for ex in examples], block_len):
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        for i in members:
            ids.extend(examples[i].input_ids)
            labels.extend(examples[i].labels)
            pos.extend(range(len(examples[i].input_ids)))
        n_real = len(ids)
        pad = block_len - n_real
        # the padding is a segment of its own: real tokens never attend to it
        blocks.append(Block(ids + [pad_id] * pad, labels + [IGNORE] * pad, pos + list(range(pad)), None, n_real))
    return blocks


def pad_examples(examples: list[Example], max_len: int, pad_id: int) -> list[Block]:
    """Without packing, as the GKE tutorial trains: one example per row (at most max_len tokens:
    `fit` first), padded to max_len, attention_mask."""
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


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def blocks_of(examples: list[Example], max_len: int, packing: bool, pad_id: int,
              overlong: str = Overlong.TRUNCATE.value) -> tuple[list[Block], Fitted]:
    """Examples -> rows: those longer than a row fitted (`fit`), then packed or padded; and the fit's counts."""
    fitted = fit(examples, max_len, overlong)
    return (pack_examples if packing else pad_examples)(fitted.examples, max_len, pad_id), fitted
