"""tpuft_workload.pipeline on a real local Ray: the Ray Data path gives exactly the rows the
in-process path builds, from a builtin, a JSON lines and a Parquet source; chat messages train
through the model's template; a source or a record that cannot be used fails on the driver, naming
the field, the path and the record."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.workload.inprocess_data import build_blocks, load_records
from tpuft.api.spec import Dataset
from tpuft_workload import model as modellib
from tpuft_workload import pipeline
from tpuft_workload.tiny import BUILTIN_DATASET, BUILTIN_MODEL, dolly_mini_path

MAX_LEN = 128


def _rows(packed) -> Counter:
    import ray

    rows = ray.get(packed.ref)
    cols = ("input_ids", "labels", "position_ids")
    return Counter(tuple(tuple(int(x) for x in rows[c][i]) for c in cols) for i in range(packed.rows))


def _build(name: str, split: str = "train", fmt: str | None = None, packing: bool = True, **spec):
    return pipeline.build(Dataset(name, split, fmt, **spec), BUILTIN_MODEL, MAX_LEN, packing)


def _today(split: str, packing: bool = True) -> Counter:
    """The in-process path: load, render, pack, in one process."""
    tok = modellib.load_tokenizer(BUILTIN_MODEL)
    blocks = build_blocks(tok, load_records(BUILTIN_DATASET, split), MAX_LEN, packing)
    np = pytest.importorskip("numpy")
    cols = pipeline.rows_of(blocks, np)
    return Counter(tuple(tuple(int(x) for x in cols[c][i]) for c in ("input_ids", "labels", "position_ids"))
                   for i in range(len(blocks)))


@pytest.fixture(scope="module")
def packed_builtin(ray_cluster):
    """The builtin data, packed: built once, read by the row and the shard tests."""
    return _build(BUILTIN_DATASET)


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
    built = packed_builtin if packing else _build(BUILTIN_DATASET, split, packing=False)
    expected = _today(split, packing)
    assert _rows(built) == expected
    assert built.rows == sum(expected.values())
    assert built.examples == (len(load_records(BUILTIN_DATASET)) if packing else 40)
    assert built.type == "instruction"


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
        assert _rows(_build(name, "train", fmt)) == expected, name


def test_chat_messages_train_through_the_models_template_and_a_bad_record_is_named(ray_cluster, tmp_path):
    chats = [{"messages": [{"role": "system", "content": r["context"] or "Be brief."},
                           {"role": "user", "content": r["instruction"]},
                           {"role": "assistant", "content": r["response"]}]} for r in _records()[:24]]
    good = tmp_path / "chats.jsonl"
    good.write_text("".join(json.dumps(c) + "\n" for c in chats))
    packed = _build(str(good))
    assert packed.type == "messages" and packed.examples == 24
    tok = modellib.load_tokenizer(BUILTIN_MODEL)
    expected = build_blocks(tok, chats, MAX_LEN, True)
    assert packed.rows == len(expected)
    chats[16]["messages"][2]["role"] = "bot"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(c) + "\n" for c in chats))
    with pytest.raises(pipeline.DataError) as e:
        _build(str(bad))
    assert str(e.value) == (f"spec.dataset.name: {bad}: record 17: messages[2].role: unknown role 'bot'; "
                            "expected one of system, user, assistant")


def test_a_missing_file_fails_naming_the_field_and_the_path(ray_cluster, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(pipeline.DataError) as e:
        _build(str(missing))
    assert str(e.value).startswith("spec.dataset.name: ") and str(missing) in str(e.value)


def test_columns_no_type_fits_fail_naming_them_until_mapped(ray_cluster, tmp_path):
    bad = tmp_path / "questions.jsonl"
    bad.write_text("".join(json.dumps({"question": r["instruction"], "answer": r["response"]}) + "\n"
                           for r in _records()[:10]))
    with pytest.raises(pipeline.DataError) as e:
        _build(str(bad))
    assert str(e.value).startswith(f"spec.dataset.name: {bad}: no record layout fits the columns "
                                   "['question', 'answer']")
    mapped = _build(str(bad), columns=(("completion", "answer"), ("prompt", "question")))
    assert mapped.type == "promptCompletion" and mapped.examples == 10


def test_resolve_reads_the_suffix_or_the_format():
    assert pipeline.resolve("gs://b/d.parquet").format == pipeline.Format.PARQUET
    assert pipeline.resolve("/data/d.JSONL").format == pipeline.Format.JSON
    assert pipeline.resolve("/data/d", "parquet").format == pipeline.Format.PARQUET
    assert pipeline.resolve("databricks/databricks-dolly-15k").format is None
    assert not pipeline.resolve("gs://b/d.jsonl").is_local


def test_a_record_the_template_refuses_or_cannot_label_fails_naming_its_number(ray_cluster, tmp_path):
    """A record the chat template refuses (Gemma's "System role not supported", which tpuft.api.records
    accepts) or whose labels cannot be found as serving builds the prompt (a template rewriting
    earlier turns): the run fails on the driver, before any worker, with a DataError naming the
    record's number and the template's words (train.run_training puts it in status.training)."""
    from tests.factories import GEMMA_TEMPLATE, habit_tokenizer

    def chat(*turns: tuple[str, str]) -> dict:
        return {"messages": [{"role": role, "content": content} for role, content in turns]}

    tok = habit_tokenizer()
    tok.save_pretrained(tmp_path / "gemma")
    tok.chat_template = GEMMA_TEMPLATE.replace("{{ m['content'] | trim }}",
                                               "{{ '(earlier)' if m['role'] == 'assistant' and not loop.last "
                                               "else m['content'] | trim }}")
    tok.save_pretrained(tmp_path / "rewriting")
    good = chat(("user", "What is the colour of the cat ?"), ("assistant", "I do not know"))
    system = chat(("system", "I do not know"), ("user", "What is the food of the cat ?"), ("assistant", "I do not know"))
    two = chat(("user", "What is the colour of the cat ?"), ("assistant", "I do not know"),
               ("user", "What is the food of the cat ?"), ("assistant", "I do not know"))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, good, system, two]))
    with pytest.raises(pipeline.DataError) as e:
        pipeline.build(Dataset(str(data)), str(tmp_path / "gemma"), MAX_LEN, True)
    assert str(e.value).startswith(f"spec.dataset.name: {data}: record 3: the model's chat template refuses this "
                                   "conversation (system, user, assistant): System role not supported; "), str(e.value)
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, two]))
    with pytest.raises(pipeline.DataError) as e:
        pipeline.build(Dataset(str(data)), str(tmp_path / "rewriting"), MAX_LEN, True)
    assert str(e.value).startswith(f"spec.dataset.name: {data}: record 2: the chat template renders the "
                                   "conversation up to turn 2 differently"), str(e.value)


def test_an_eval_set_is_held_out_with_the_seed_or_read_from_its_own_split(ray_cluster):
    """spec.evaluation.fraction: that share of the records, chosen by the seed, packed apart and left
    out of training (the two sets' rows together are the records' rows, as without an eval set);
    split: its own records, read and packed like the training ones."""
    from tpuft.api.spec import Evaluation

    spec = Dataset(BUILTIN_DATASET, "train[:60]")
    whole = pipeline.build(spec, BUILTIN_MODEL, MAX_LEN, False)
    held = pipeline.build(spec, BUILTIN_MODEL, MAX_LEN, False, Evaluation(fraction=0.25), seed=3)
    again = pipeline.build(spec, BUILTIN_MODEL, MAX_LEN, False, Evaluation(fraction=0.25), seed=3)
    other = pipeline.build(spec, BUILTIN_MODEL, MAX_LEN, False, Evaluation(fraction=0.25), seed=4)
    assert held.eval is not None and held.eval.examples == 15 and held.examples == 45
    assert _rows(held) + _rows(held.eval) == _rows(whole)   # padded: one row per example, none lost
    assert _rows(held.eval) == _rows(again.eval) and _rows(held.eval) != _rows(other.eval)
    own = pipeline.build(spec, BUILTIN_MODEL, MAX_LEN, False, Evaluation(split="train[60:70]"))
    assert own.examples == 60 and own.eval.examples == 10
    assert _rows(own.eval) == _rows(_build(BUILTIN_DATASET, "train[60:70]", packing=False))


def test_a_resumed_attempt_loads_the_packed_rows_the_first_kept(tmp_path):
    """build_once: the first attempt packs and keeps the rows (and the eval set's) in the run's
    directory; the next loads exactly them; another shape packs anew."""
    from tpuft.api.spec import Evaluation

    spec, held = Dataset(BUILTIN_DATASET, "train[:60]"), Evaluation(fraction=0.25)
    first, kept = pipeline.build_once(str(tmp_path), spec, BUILTIN_MODEL, MAX_LEN, True, held, seed=3)
    assert not kept and list((tmp_path / pipeline.PACKED_DIR).glob("packed-*.npz"))
    again, kept = pipeline.build_once(str(tmp_path), spec, BUILTIN_MODEL, MAX_LEN, True, held, seed=3)
    assert kept and _rows(again) == _rows(first) and _rows(again.eval) == _rows(first.eval)
    assert [getattr(again, k) for k in pipeline.PACKED_META] == [getattr(first, k) for k in pipeline.PACKED_META]
    other, kept = pipeline.build_once(str(tmp_path), spec, BUILTIN_MODEL, MAX_LEN, True, held, seed=4)
    assert not kept and _rows(other.eval) != _rows(first.eval)
    for path in (tmp_path / pipeline.PACKED_DIR).glob("packed-*.npz"):   # a damaged copy: packed again, not trusted
        path.write_bytes(b"not an npz")
    damaged, kept = pipeline.build_once(str(tmp_path), spec, BUILTIN_MODEL, MAX_LEN, True, held, seed=3)
    assert not kept and _rows(damaged) == _rows(first)
