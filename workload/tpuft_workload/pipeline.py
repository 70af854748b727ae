"""Training input through Ray Data: read, apply the template, tokenize and pack ONCE for the
whole run (CPU tasks, before and outside the accelerator hosts' step loop), then stream disjoint
shards to the workers (Ray Train's DataConfig splits it; each worker reads
`get_dataset_shard("train").iter_torch_batches`, or `iter_batches` as numpy on the JAX path).

Stages (driver, `build`):
  read       a builtin, a local or gs:// JSONL / Parquet file (`--dataset-format` when the suffix
             does not say), or a Hugging Face dataset by name. Plain files with split "train"
             are read by Ray Data itself (streamed, never whole on the driver); split slicing
             ("train[:1024]") and hub datasets go through `datasets` first.
  check      missing path or missing columns: DataError naming spec.dataset.name and the path,
             before any worker exists.
  tokenize   map_batches over record batches, in parallel (tpuft_workload.data.tokenize_example:
             the template, prompt masking, EOS).
  pack       one ordered task over the tokenized examples (tpuft_workload.data.pack_examples /
             pad_examples): the same rows as every rank used to build for itself, label masking
             across packed boundaries included. Packing only concatenates and cuts; it is cheap.
  materialize the rows live in the object store for every epoch; each epoch re-splits them.

Shapes stay static: every row is max_seq_length long; `drop_last` drops the ragged end of a
worker's shard (DataConfig splits with equal=True, so every worker runs the same step count).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tpuft.constants import DatasetFormat as Format
from tpuft_workload import data as datalib

TOKENIZE_BATCH = 256        # records per tokenize task batch
TOKENIZE_ACTORS_MAX = 8     # tokenizer actors at most (each loads the tokenizer; a TPU host has ~180 CPUs)
ROW_COLUMNS = ("input_ids", "labels", "position_ids", "attention_mask", "n_real")
PLAIN_SPLIT = re.compile(r"^[A-Za-z0-9_-]+$")   # a whole split: no slicing, so Ray Data may read the file itself


SUFFIXES = {".json": Format.JSON, ".jsonl": Format.JSON, ".parquet": Format.PARQUET}
REQUIRED_COLUMNS = ("instruction", "response")


class DataError(ValueError):
    """The dataset cannot be used: what, where (the spec field and the path), what to do."""

    def __init__(self, message: str):
        super().__init__(f"spec.dataset.name: {message}")


@dataclass(frozen=True)
class Source:
    name: str                 # as the user wrote it
    path: str                 # the file (or hub id) read
    format: Format | None     # None: a Hugging Face dataset by name (or a directory datasets reads)

    @property
    def is_local(self) -> bool:
        return self.format is not None and "://" not in self.path


def resolve(name: str, fmt: str | None = None) -> Source:
    from tpuft_workload.tiny import BUILTIN_DATASET, dolly_mini_path

    if name == BUILTIN_DATASET:
        return Source(name, str(dolly_mini_path()), Format.JSON)
    if fmt:
        return Source(name, name, Format(fmt))
    suffix = next((s for s in SUFFIXES if name.lower().endswith(s)), None)
    return Source(name, name, SUFFIXES[suffix] if suffix else None)


def _read(src: Source, split: str):
    import ray.data

    if src.is_local and not os.path.exists(src.path):
        raise DataError(f"{src.path} does not exist (a local file must be on a volume every Ray pod mounts)")
    if src.format is not None and PLAIN_SPLIT.fullmatch(split):
        reader = ray.data.read_json if src.format == Format.JSON else ray.data.read_parquet
        try:   # the name is the file: its suffix (or spec.dataset.format) already said how to read it
            return reader(src.path, file_extensions=None)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise DataError(f"cannot read {src.path} as {src.format.value}: {e}") from None
    from datasets import load_dataset

    try:
        if src.format is not None:
            ds = load_dataset(src.format.value, data_files={"train": src.path}, split=split)
        else:
            ds = load_dataset(src.path, split=split)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"cannot load {src.path} (split {split!r}): {e}") from None
    # Not ray.data.from_huggingface: before reading the table it asks whether the dataset is one of
    # the Hub's public ones, by loading it again under its builder's name ("json" for a local file),
    # and datasets then globs the working directory for data files: the whole container's
    # filesystem in a pod (270 CPU-seconds of a training driver on the local cluster), every run.
    # Its fallback is this: the rows, as one Arrow table (the split's slice applied).
    return ray.data.from_arrow(ds.with_format("arrow")[:])


def _check_columns(ds, src: Source) -> None:
    names = list(ds.schema().names) if ds.schema() is not None else []
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{src.path} has no {missing} column(s) (found {names}); the dolly template needs "
                        "instruction, response and optionally context")


class _Tokenize:
    """map_batches stage: one tokenizer per actor, records -> (input_ids, labels) per example."""

    def __init__(self, model: str, mask_prompt: bool):
        from tpuft_workload import model as modellib

        self.tokenizer = modellib.load_tokenizer(model)
        self.mask_prompt = mask_prompt

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        n = len(batch["instruction"])
        context = batch.get("context")
        ids, labels = np.empty(n, dtype=object), np.empty(n, dtype=object)
        for i in range(n):
            record = {"instruction": batch["instruction"][i], "response": batch["response"][i],
                      "context": context[i] if context is not None else ""}
            ex = datalib.tokenize_example(self.tokenizer, record, self.mask_prompt)
            ids[i], labels[i] = np.asarray(ex.input_ids, dtype=np.int64), np.asarray(ex.labels, dtype=np.int64)
        return {"input_ids": ids, "labels": labels}


def _pack(batch: dict, max_len: int, packing: bool, pad_id: int) -> dict:
    """The whole tokenized stream, in order -> fixed-length rows (one task: packing is cheap)."""
    import numpy as np

    examples = [datalib.Example(list(map(int, i)), list(map(int, lab)))
                for i, lab in zip(batch["input_ids"], batch["labels"])]
    blocks = (datalib.pack_examples if packing else datalib.pad_examples)(examples, max_len, pad_id)
    return rows_of(blocks, np)


def rows_of(blocks: list, np) -> dict:
    """Blocks as columns: input_ids, labels, position_ids (packed) or attention_mask (padded),
    n_real; the unused one of position_ids / attention_mask is all ones (never read)."""
    n = len(blocks)
    width = len(blocks[0].input_ids) if blocks else 0
    ones = np.ones((n, width), dtype=np.int64)
    return {
        "input_ids": np.asarray([b.input_ids for b in blocks], dtype=np.int64).reshape(n, width),
        "labels": np.asarray([b.labels for b in blocks], dtype=np.int64).reshape(n, width),
        "position_ids": (np.asarray([b.position_ids for b in blocks], dtype=np.int64).reshape(n, width)
                         if blocks and blocks[0].position_ids is not None else ones),
        "attention_mask": (np.asarray([b.attention_mask for b in blocks], dtype=np.int64).reshape(n, width)
                           if blocks and blocks[0].attention_mask is not None else ones),
        "n_real": np.asarray([b.n_real for b in blocks], dtype=np.int64),
    }


@dataclass(frozen=True)
class Packed:
    dataset: object           # a materialized ray.data.Dataset of ROW_COLUMNS
    rows: int
    examples: int
    pad_fraction: float


def build(name: str, split: str, fmt: str | None, model: str, max_len: int, packing: bool,
          mask_prompt: bool = True) -> Packed:
    """Read, check, tokenize, pack, materialize. DataError for a source that cannot be used."""
    from ray.data import DataContext

    from tpuft_workload import model as modellib

    DataContext.get_current().execution_options.preserve_order = True   # packing follows the records' order
    src = resolve(name, fmt)
    ds = _read(src, split)
    _check_columns(ds, src)
    tokenizer = modellib.load_tokenizer(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = ds.map_batches(_Tokenize, fn_constructor_args=(model, mask_prompt), batch_size=TOKENIZE_BATCH,
                              batch_format="numpy", concurrency=(1, max(1, min(TOKENIZE_ACTORS_MAX, (os.cpu_count() or 2) // 2))),
                              num_cpus=1)
    rows = examples.repartition(1).map_batches(_pack, batch_size=None, batch_format="numpy", num_cpus=1,
                                               fn_kwargs={"max_len": max_len, "packing": packing,
                                                          "pad_id": pad_id}).materialize()
    # Read from the materialized block, not by rows.sum(): an aggregate is another execution
    # (a hash shuffle: 6 s on a 2-core pod, at every training start).
    real = [int(b["n_real"].sum()) for b in rows.iter_batches(batch_size=None, batch_format="numpy")
            if len(b["n_real"])]
    count = rows.count()
    pad = 1.0 - sum(real) / (count * max_len) if count else 0.0
    return Packed(rows, count, ds.count(), pad)


def torch_batches(shard, batch_size: int, seed: int, epoch: int, skip: int = 0):
    """One epoch of a worker's shard: [batch_size, max_len] LongTensors, the ragged end dropped,
    shuffled locally with a seed per epoch, prefetched; the first `skip` batches passed over
    (a resumed epoch)."""
    import torch

    it = shard.iter_torch_batches(batch_size=batch_size, drop_last=True, dtypes=torch.long, prefetch_batches=2,
                                  local_shuffle_buffer_size=4 * batch_size, local_shuffle_seed=seed * 1000003 + epoch)
    for i, batch in enumerate(it):
        if i >= skip:
            yield batch


def numpy_batches(shard, batch_size: int, seed: int, epoch: int, skip: int = 0):
    """torch_batches' twin for the JAX path: the same rows, order and skipping, as numpy arrays
    (the worker turns them into global jax.Arrays over its mesh; see jax_train)."""
    it = shard.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=True, prefetch_batches=2,
                            local_shuffle_buffer_size=4 * batch_size, local_shuffle_seed=seed * 1000003 + epoch)
    for i, batch in enumerate(it):
        if i >= skip:
            yield batch
