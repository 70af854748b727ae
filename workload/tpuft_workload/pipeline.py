"""Training input: Ray Data reads and tokenizes the dataset once for the whole run (CPU tasks, before
and outside the accelerator hosts' step loop); the driver packs whole examples into rows and puts
them in Ray's object store once; each worker reads its rows of every global batch from there.

Stages (driver, `build`):
  read       a builtin, a local or gs:// JSONL / Parquet file (`spec.dataset.format` when the suffix
             does not say), or a Hugging Face dataset by name. Plain files with split "train"
             are read by Ray Data itself (streamed, never whole on the driver); split slicing
             ("train[:1024]") and hub datasets go through `datasets` first, except on gs://,
             where the file is read through tpuft_workload.storage and the slice cut here.
  check      the layout (tpuft.api.records: spec.dataset.type, or detected from the columns,
             through spec.dataset.columns) and then every record, streamed through the driver:
             DataError naming spec.dataset.name, the path and the first record that does not fit,
             before any worker exists.
  tokenize   map_batches over record batches, in parallel: each record rendered through the
             model's chat template (tpuft_workload.render: what serving renders), labels on the
             trained assistant turns only. A record the template refuses, or cannot label, is a
             DataError naming its number, before any worker exists.
  pack       on the driver: examples longer than a row truncated or dropped (spec.dataset.overlong,
             counted), then whole examples bin-packed into max_seq_length rows
             (tpuft_workload.data.pack_examples) or padded one per row.
  share      the rows as numpy arrays, `ray.put` once: every worker on a node maps the same copy.
  keep       (`build_once`) the packed rows saved in the run's directory, keyed by everything that
             shapes them: a resumed attempt (a lost host, a preemption, a retry) loads them instead of
             reading and tokenizing again (seconds here, minutes for a large dataset).

Order (`epoch_batches`): every epoch a seeded permutation of all the rows, the same on every rank;
rank r takes its slice of each global batch; the ragged end is dropped so every rank runs the same
steps, and a resumed epoch skips exactly the batches already trained.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import re
from dataclasses import dataclass

from tpuft.api.constants import DatasetFormat as Format
from tpuft.api import records as recordslib
from tpuft.api.spec import Dataset, Evaluation
from tpuft_workload import data as datalib
from tpuft_workload.render import IGNORE, RenderError

CHECK_BATCH = 4096         # records per batch of the driver's check
TOKENIZE_BATCH = 256        # records per tokenize task batch
TOKENIZE_ACTORS_MAX = 8     # tokenizer actors at most (each loads the tokenizer; a TPU host has ~180 CPUs)
ROW_COLUMNS = ("input_ids", "labels", "position_ids", "attention_mask", "n_real")
PACKED_FORMAT = 1           # the kept rows' layout (packed_key): a change invalidates every kept copy
PACKED_DIR = "data"         # under the run's directory
PACKED_META = ("rows", "examples", "pad_fraction", "type", "truncated", "dropped")
log = logging.getLogger(__name__)
PLAIN_SPLIT = re.compile(r"^[A-Za-z0-9_-]+$")   # a whole split: no slicing, so Ray Data may read the file itself


SUFFIXES = {".json": Format.JSON, ".jsonl": Format.JSON, ".parquet": Format.PARQUET}


class DataError(ValueError):
    """The dataset cannot be used: what, where (the spec field and the path), what to do."""

    def __init__(self, message: str, field: str = "spec.dataset.name"):
        super().__init__(f"{field}: {message}")
        self.message = message


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
    from tpuft_workload.tiny_chat import BUILTIN_FACTS, facts_path

    if name in (BUILTIN_DATASET, BUILTIN_FACTS):
        return Source(name, str(dolly_mini_path() if name == BUILTIN_DATASET else facts_path()), Format.JSON)
    if fmt:
        return Source(name, name, Format(fmt))
    suffix = next((s for s in SUFFIXES if name.lower().endswith(s)), None)
    return Source(name, name, SUFFIXES[suffix] if suffix else None)


def _read(src: Source, split: str):
    import ray.data

    if src.is_local and not os.path.exists(src.path):
        raise DataError(f"{src.path} does not exist (a local file must be on a volume every Ray pod mounts)")
    if src.format is not None and "://" in src.path:
        return _read_remote(src, split)
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


def _read_remote(src: Source, split: str):
    """A JSONL or Parquet file on object storage, through the workload's one storage client
    (tpuft_workload.storage: the credentials and retry bound every gs:// read has): a whole split
    streamed by Ray Data, a sliced one ("train[:1000]") read whole and cut here (`remote_table`)."""
    import ray.data

    from tpuft_workload import storage

    try:
        storage.require(src.path, "dataset file")
        if PLAIN_SPLIT.fullmatch(split):
            fs, path = storage.filesystem(src.path)
            reader = ray.data.read_json if src.format == Format.JSON else ray.data.read_parquet
            return reader(path, filesystem=fs, file_extensions=None)
        return ray.data.from_arrow(remote_table(src, split))
    except storage.NotFound as e:
        raise DataError(f"{e}: check the bucket and object name") from None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {src.path} as {src.format.value}: "
                        f"{storage.failure(src.path, 'reading', e)}") from None


def remote_table(src: Source, split: str):
    """The rows of `split` of a remote JSONL or Parquet file (one split, "train", as `datasets`
    names a file's), as one Arrow table: the file read through tpuft_workload.storage, the split's
    slice ("train[:1000]", "train[10%:20%]") applied as `datasets` applies it."""
    import pyarrow as pa
    import pyarrow.json as pajson
    import pyarrow.parquet as pq
    from datasets import ReadInstruction

    from tpuft_workload import storage

    fs, path = storage.filesystem(src.path)
    if src.format == Format.PARQUET:
        table = pq.read_table(path, filesystem=fs)
    else:
        with fs.open_input_stream(path) as f:
            raw = f.read()
        try:
            table = pajson.read_json(pa.BufferReader(raw))
        except pa.ArrowInvalid:   # one JSON array of records, not JSON Lines
            table = pa.Table.from_pylist(json.loads(raw))
    parts = ReadInstruction.from_spec(split).to_absolute({"train": table.num_rows})
    return pa.concat_tables([table.slice(p.from_, p.to - p.from_) for p in parts])


def _layout(ds, src: Source, spec: Dataset) -> recordslib.Layout:
    names = list(ds.schema().names) if ds.schema() is not None else []
    try:
        return recordslib.detect(names, spec.type, dict(spec.columns))
    except ValueError as e:
        raise DataError(f"{src.path}: {e}") from None


def _check_records(ds, src: Source, layout: recordslib.Layout) -> int:
    """Every record read, in file order, on the driver (cheap: no tokenizer); their count."""
    number = 1
    try:
        for batch in ds.iter_batches(batch_size=CHECK_BATCH, batch_format="pyarrow"):
            rows = batch.to_pylist()
            recordslib.check(rows, layout, first_number=number)
            number += len(rows)
    except recordslib.RecordError as e:
        raise DataError(f"{src.path}: {e}") from None
    if number == 1:
        raise DataError(f"{src.path} has no records")
    return number - 1


class _Tokenize:
    """map_batches stage: one tokenizer per actor, records -> (input_ids, labels) per example."""

    def __init__(self, model: str, layout: recordslib.Layout):
        from tpuft_workload import model as modellib

        self.tokenizer = modellib.load_tokenizer(model)
        self.layout = layout

    def __call__(self, batch) -> dict:
        import numpy as np

        records = batch.to_pylist()
        ids, labels = np.empty(len(records), dtype=object), np.empty(len(records), dtype=object)
        errors = np.full(len(records), "", dtype=object)
        for i, record in enumerate(records):
            try:
                ex = datalib.example_of(self.tokenizer, record, self.layout)
            except RenderError as e:
                # returned, not raised: Ray Data would hand the driver a traceback. The driver, reading
                # the batches in order, knows the record's number; a batch does not.
                errors[i] = str(e)
                ex = datalib.Example([], [])
            ids[i], labels[i] = np.asarray(ex.input_ids, dtype=np.int32), np.asarray(ex.labels, dtype=np.int32)
        return {"input_ids": ids, "labels": labels, "error": errors}


def rows_of(blocks: list, np) -> dict:
    """Blocks as columns: input_ids, labels, position_ids (packed) or attention_mask (padded),
    n_real; the unused one of position_ids / attention_mask is all ones (never read)."""
    n = len(blocks)
    width = len(blocks[0].input_ids) if blocks else 0
    ones = np.ones((n, width), dtype=np.int32)
    return {
        "input_ids": np.asarray([b.input_ids for b in blocks], dtype=np.int32).reshape(n, width),
        "labels": np.asarray([b.labels for b in blocks], dtype=np.int32).reshape(n, width),
        "position_ids": (np.asarray([b.position_ids for b in blocks], dtype=np.int32).reshape(n, width)
                         if blocks and blocks[0].position_ids is not None else ones),
        "attention_mask": (np.asarray([b.attention_mask for b in blocks], dtype=np.int32).reshape(n, width)
                           if blocks and blocks[0].attention_mask is not None else ones),
        "n_real": np.asarray([b.n_real for b in blocks], dtype=np.int32),
    }


@dataclass(frozen=True)
class Packed:
    ref: object               # ray.ObjectRef of the rows (ROW_COLUMNS as numpy arrays)
    rows: int
    examples: int             # records read (an eval set held out of them: the records left to train on)
    pad_fraction: float
    type: str                 # the record type trained (constants.DatasetType value)
    truncated: int            # examples cut to max_len
    dropped: int              # examples left out (too long, or nothing trained left after the cut)
    eval: Packed | None = None   # spec.evaluation's set, rendered and packed the same way


def build(spec: Dataset, model: str, max_len: int, packing: bool, evaluation: Evaluation | None = None,
          seed: int = 0) -> Packed:
    """Read, check, tokenize, pack, share; with `evaluation`, its eval set too (held out of these
    records with `seed`, or read from its own split). DataError for a source or a record that
    cannot be used."""
    from ray.data import DataContext

    from tpuft_workload import model as modellib

    # the same records in the same order on every submission: a resumed run packs the same rows
    DataContext.get_current().execution_options.preserve_order = True
    examples, count, record_type = _examples(spec, model)
    pad = datalib.pad_id_of(modellib.load_tokenizer(model))
    held: list[datalib.Example] = []
    if evaluation is not None and evaluation.fraction is not None:
        chosen = set(random.Random(seed).sample(range(len(examples)), max(1, round(evaluation.fraction * len(examples)))))
        held = [e for i, e in enumerate(examples) if i in chosen]
        examples = [e for i, e in enumerate(examples) if i not in chosen]
        count -= len(held)
    elif evaluation is not None:
        own = Dataset(name=evaluation.name or spec.name, split=evaluation.split or spec.split,
                      format=None if evaluation.name else spec.format, type=spec.type, columns=spec.columns,
                      overlong=spec.overlong)
        held = _examples(own, model, "spec.evaluation.name" if evaluation.name else "spec.evaluation.split")[0]
    packed = _pack(examples, count, record_type, max_len, packing, pad, spec.overlong)
    if evaluation is None:
        return packed
    eval_packed = _pack(held, len(held), record_type, max_len, packing, pad, spec.overlong)
    if not eval_packed.rows:
        raise DataError(f"the eval set has no example that fits spec.training.maxSeqLength ({max_len} tokens): "
                        "hold out more records, or give a longer maxSeqLength", "spec.evaluation")
    return dataclasses.replace(packed, eval=eval_packed)


def packed_key(spec: Dataset, model: str, max_len: int, packing: bool, evaluation: Evaluation | None,
               seed: int) -> str:
    """What the packed rows depend on, hashed: the same run document gives the same rows."""
    shape = {"format": PACKED_FORMAT, "dataset": dataclasses.asdict(spec), "model": model, "max_len": max_len,
             "packing": packing, "evaluation": dataclasses.asdict(evaluation) if evaluation else None, "seed": seed}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:20]


def to_bytes(rows: dict, meta: dict, eval_rows: dict | None = None, eval_meta: dict | None = None) -> bytes:
    """Packed rows (and the eval set's) as one .npz, their counts in a JSON member."""
    import numpy as np

    arrays = {f"train.{k}": v for k, v in rows.items()}
    if eval_rows is not None:
        arrays |= {f"eval.{k}": v for k, v in eval_rows.items()}
    header = {"train": meta, "eval": eval_meta}
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def from_bytes(data: bytes) -> tuple[dict, dict, dict | None, dict | None]:
    """to_bytes' (rows, meta, eval rows, eval meta)."""
    import numpy as np

    with np.load(io.BytesIO(data)) as z:
        header = json.loads(z["meta"].tobytes().decode())
        rows = {k: z[f"train.{k}"] for k in ROW_COLUMNS}
        eval_rows = {k: z[f"eval.{k}"] for k in ROW_COLUMNS} if header["eval"] is not None else None
    return rows, header["train"], eval_rows, header["eval"]


def build_once(run_dir: str, spec: Dataset, model: str, max_len: int, packing: bool,
               evaluation: Evaluation | None = None, seed: int = 0) -> tuple[Packed, bool]:
    """`build`, kept in the run's directory (PACKED_DIR) the first time and loaded from there after:
    (the rows, whether they were loaded). A copy that cannot be read or written is only logged."""
    import ray

    from tpuft_workload import checkpoint as ckptlib

    uri = ckptlib.join(run_dir, PACKED_DIR, f"packed-{packed_key(spec, model, max_len, packing, evaluation, seed)}.npz")
    try:
        rows, meta, eval_rows, eval_meta = from_bytes(ckptlib.read_bytes(uri))
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a damaged copy: packed again, and written anew
        log.warning("the kept packed rows %s cannot be read (%s: %s); packing again", uri, type(e).__name__, e)
    else:
        held = None if eval_rows is None or eval_meta is None else Packed(ray.put(eval_rows), **eval_meta)
        return Packed(ray.put(rows), **meta, eval=held), True
    packed = build(spec, model, max_len, packing, evaluation, seed)
    try:
        meta = {k: getattr(packed, k) for k in PACKED_META}
        held = packed.eval
        ckptlib.write_bytes(uri, to_bytes(ray.get(packed.ref), meta, ray.get(held.ref) if held else None,
                                          {k: getattr(held, k) for k in PACKED_META} if held else None))
    except Exception as e:  # noqa: BLE001 - a resume then packs again: slower, not wrong
        log.warning("the packed rows cannot be kept at %s (%s: %s)", uri, type(e).__name__, e)
    return packed, False


def _examples(spec: Dataset, model: str, field: str = "spec.dataset.name") -> tuple[list, int, str]:
    """(the tokenized examples in record order, the records read, the record type)."""
    src = resolve(spec.name, spec.format)
    try:
        ds = _read(src, spec.split)
        layout = _layout(ds, src, spec)
        count = _check_records(ds, src, layout)
    except DataError as e:
        raise DataError(e.message, field) from None
    tokenized = ds.map_batches(_Tokenize, fn_constructor_args=(model, layout), batch_size=TOKENIZE_BATCH,
                               batch_format="pyarrow",
                               concurrency=(1, max(1, min(TOKENIZE_ACTORS_MAX, (os.cpu_count() or 2) // 2))),
                               num_cpus=1)
    examples = []
    for batch in tokenized.iter_batches(batch_size=None, batch_format="numpy"):
        refused = next((k for k, e in enumerate(batch["error"]) if e), None)
        if refused is not None:   # a record the chat template cannot label as serving renders it: the user's to fix
            number = len(examples) + refused + 1   # the rows come in record order (preserve_order, in build)
            raise DataError(f"{src.path}: record {number}: {batch['error'][refused]}", field)
        examples += [datalib.Example(i.tolist(), lab.tolist()) for i, lab in zip(batch["input_ids"], batch["labels"])]
    return examples, count, layout.type.value


def _pack(examples: list, count: int, record_type: str, max_len: int, packing: bool, pad: int,
          overlong: str) -> Packed:
    import numpy as np
    import ray

    blocks, fitted = datalib.blocks_of(examples, max_len, packing, pad, overlong)
    return Packed(ray.put(rows_of(blocks, np)), len(blocks), count, datalib.pad_fraction(blocks), record_type,
                  fitted.truncated, fitted.dropped)


def epoch_batches(rows, world: int, rank: int, batch_size: int, seed: int, epoch: int, skip: int = 0):
    """One epoch of this rank's batches from the shared rows (numpy arrays): the epoch's permutation
    (data.rank_batches), the first `skip` batches passed over (a resumed epoch)."""
    order = datalib.rank_batches(len(rows["n_real"]), world, rank, batch_size, epoch, seed)
    for indices in order[skip:]:
        yield {k: v[indices] for k, v in rows.items()}


def eval_batches(rows: dict, world: int, rank: int, batch_size: int):
    """This rank's share of the whole eval set (every row, in order), `batch_size` rows a batch
    (world x batch_size a global one). The last global batch is filled up with copies of the first
    rows, their labels all ignored: every row is scored exactly once, and every rank runs the same
    number of batches (a forward is a collective under FSDP2 and JAX's sharding)."""
    import numpy as np

    n, per = len(rows["n_real"]), world * batch_size
    for start in range(0, n, per):
        mine = np.arange(start + rank * batch_size, start + (rank + 1) * batch_size)
        batch = {k: v[mine % n] for k, v in rows.items()}
        batch["labels"] = np.where((mine < n)[:, None], batch["labels"], IGNORE)
        yield batch


def torch_batches(rows, world: int, rank: int, batch_size: int, seed: int, epoch: int, skip: int = 0):
    """epoch_batches as [batch_size, max_len] LongTensors."""
    import torch

    for batch in epoch_batches(rows, world, rank, batch_size, seed, epoch, skip):
        yield {k: torch.from_numpy(v.astype("int64")) for k, v in batch.items()}
