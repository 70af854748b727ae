"""tpuft_workload.pipeline on a real local Ray: the Ray Data path gives exactly the rows each rank
used to build for itself, from a builtin, a JSON lines and a Parquet source; two workers' shards are
disjoint and equal; a source that cannot be used fails on the driver, naming the field and path."""
from __future__ import annotations

import json
import threading
from collections import Counter

import pytest

from tpuft_workload import data as datalib
from tpuft_workload import model as modellib
from tpuft_workload import pipeline
from tpuft_workload.tiny import BUILTIN_DATASET, BUILTIN_MODEL, dolly_mini_path

MAX_LEN = 128


def _rows(ds) -> Counter:
    cols = ("input_ids", "labels", "position_ids")
    return Counter(tuple(tuple(int(x) for x in r[c]) for c in cols) for r in ds.iter_rows())


def _today(split: str, packing: bool = True) -> Counter:
    """The per-rank path every worker ran before: load, tokenize, pack, in one process."""
    tok = modellib.load_tokenizer(BUILTIN_MODEL)
    blocks = datalib.build_blocks(tok, datalib.load_records(BUILTIN_DATASET, split), MAX_LEN, packing)
    np = pytest.importorskip("numpy")
    cols = pipeline.rows_of(blocks, np)
    return Counter(tuple(tuple(int(x) for x in cols[c][i]) for c in ("input_ids", "labels", "position_ids"))
                   for i in range(len(blocks)))


@pytest.fixture(scope="module")
def packed_builtin(ray_cluster):
    """The builtin data, packed: built once, read by the row and the shard tests."""
    return pipeline.build(BUILTIN_DATASET, "train", None, BUILTIN_MODEL, MAX_LEN, True)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded-and-sliced"])
def test_the_pipeline_gives_the_same_rows_as_the_per_rank_path(packed_builtin, ray_cluster, packing, monkeypatch):
    """Packed, the whole split; padded, a sliced split (`train[:40]`, which goes through datasets):
    one Ray Data build each (a build is most of a minute on the 2 cores beside the cluster lanes).
    The sliced split never asks whether it is a Hub dataset (ray.data.from_huggingface does, by
    loading "json" again, which globs the working directory: the whole filesystem of a pod)."""
    from ray.data._internal.datasource.huggingface_datasource import HuggingFaceDatasource

    def no_hub_lookup(*args, **kwargs):
        raise AssertionError("the pipeline asked the Hub about a local dataset")
    monkeypatch.setattr(HuggingFaceDatasource, "list_parquet_urls_from_dataset", staticmethod(no_hub_lookup))
    split = "train" if packing else "train[:40]"
    built = packed_builtin if packing else pipeline.build(BUILTIN_DATASET, split, None, BUILTIN_MODEL, MAX_LEN, False)
    expected = _today(split, packing)
    assert _rows(built.dataset) == expected
    assert built.rows == sum(expected.values())
    assert built.examples == (len(datalib.load_records(BUILTIN_DATASET)) if packing else 40)
    for r in built.dataset.take(3):
        assert len(r["input_ids"]) == MAX_LEN   # static shapes


def _records() -> list[dict]:
    return [json.loads(line) for line in dolly_mini_path().read_text().splitlines() if line.strip()]


def test_parquet_and_a_suffixless_json_file_with_a_format_read_the_same(ray_cluster, tmp_path):
    """Ray Data's two readers; a `.jsonl` suffix reads as the suffixless file with format json does
    (resolve, below, maps the suffix)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _records()
    parquet = tmp_path / "dolly.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    bare = tmp_path / "dolly-export"
    bare.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = _today("train")
    for name, fmt in ((str(parquet), None), (str(bare), "json")):
        packed = pipeline.build(name, "train", fmt, BUILTIN_MODEL, MAX_LEN, True)
        assert _rows(packed.dataset) == expected, name


def test_two_workers_get_disjoint_equal_shards(packed_builtin):
    packed = packed_builtin
    shards = packed.dataset.streaming_split(2, equal=True)
    seen: list[list[tuple]] = [[], []]

    def consume(i: int) -> None:   # a split's iterators are read side by side, as the workers do
        for batch in pipeline.torch_batches(shards[i], batch_size=4, seed=7, epoch=0):
            assert tuple(batch["input_ids"].shape) == (4, MAX_LEN)
            seen[i] += [tuple(row.tolist()) for row in batch["input_ids"]]

    threads = [threading.Thread(target=consume, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(seen[0]) == len(seen[1]) == (packed.rows // 2) // 4 * 4
    every = Counter(tuple(int(x) for x in r["input_ids"]) for r in packed.dataset.iter_rows())
    assert Counter(seen[0]) + Counter(seen[1]) <= every   # no row handed out more often than it exists


def test_a_missing_file_fails_naming_the_field_and_the_path(ray_cluster, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(pipeline.DataError) as e:
        pipeline.build(str(missing), "train", None, BUILTIN_MODEL, MAX_LEN, True)
    assert str(e.value).startswith("spec.dataset.name: ") and str(missing) in str(e.value)


def test_a_missing_column_fails_naming_it(ray_cluster, tmp_path):
    bad = tmp_path / "questions.jsonl"
    bad.write_text("".join(json.dumps({"question": r["instruction"]}) + "\n" for r in _records()[:10]))
    with pytest.raises(pipeline.DataError) as e:
        pipeline.build(str(bad), "train", None, BUILTIN_MODEL, MAX_LEN, True)
    assert "spec.dataset.name" in str(e.value) and "'instruction'" in str(e.value) and str(bad) in str(e.value)


def test_resolve_reads_the_suffix_or_the_format():
    assert pipeline.resolve("gs://b/d.parquet").format == pipeline.Format.PARQUET
    assert pipeline.resolve("/data/d.JSONL").format == pipeline.Format.JSON
    assert pipeline.resolve("/data/d", "parquet").format == pipeline.Format.PARQUET
    assert pipeline.resolve("databricks/databricks-dolly-15k").format is None
    assert not pipeline.resolve("gs://b/d.jsonl").is_local
