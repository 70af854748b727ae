"""The rows the training pipeline builds (tpuft_workload.pipeline), built in one process without Ray,
and batches of them as tensors: for tests and bench/, which train a step or a few in-process.

Not in the package: the workload itself always reads, tokenizes and shares its rows through
tpuft_workload.pipeline; what is here only saves a test a Ray cluster.
"""
from __future__ import annotations

from tpuft.api import records as recordslib
from tpuft.api.constants import Overlong
from tpuft_workload import data as datalib
from tpuft_workload.data import Block


def load_records(dataset: str, split: str = "train") -> list[dict]:
    """builtin:dolly-mini or a local JSON lines / Parquet file -> its records (split in datasets'
    syntax, "train[:64]")."""
    from datasets import load_dataset

    from tpuft_workload.tiny import BUILTIN_DATASET, dolly_mini_path

    path = str(dolly_mini_path()) if dataset == BUILTIN_DATASET else dataset
    kind = "parquet" if path.endswith(".parquet") else "json"
    return [dict(r) for r in load_dataset(kind, data_files={"train": path}, split=split)]


def build_blocks(tokenizer, records: list[dict], max_len: int, packing: bool,
                 overlong: str = Overlong.TRUNCATE.value) -> list[Block]:
    """What the pipeline builds: records (layout detected from the first's keys) -> rows."""
    layout = recordslib.detect(records[0].keys()) if records else None
    examples = [datalib.example_of(tokenizer, r, layout, n) for n, r in enumerate(records, start=1)]
    return datalib.blocks_of(examples, max_len, packing, datalib.pad_id_of(tokenizer), overlong)[0]


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
