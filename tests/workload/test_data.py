"""Rendering, packing and per-rank batching: the label rules training relies on."""
from __future__ import annotations

import pytest
import torch

from tests.workload.inprocess_data import collate, load_records
from tpuft_workload import chat_api, data, tiny
from tpuft_workload.data import IGNORE, Example

EOS, PAD = 99, 0


def ex(prompt_len: int, resp: list[int], start: int = 10) -> Example:
    """A fake tokenized example: prompt tokens start.., response `resp`, then EOS."""
    prompt = list(range(start, start + prompt_len))
    ids = prompt + resp + [EOS]
    labels = [IGNORE] * prompt_len + resp + [EOS]
    labels[0] = IGNORE
    return Example(ids, labels)


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def _layout(*columns):
    return data.recordslib.detect(columns)


def test_an_instruction_is_the_user_turn_and_its_context_follows(tok):
    layout = _layout("instruction", "context", "response")
    q, c, a = "Tell me about Paris .", "It is in France .", "Paris is the capital of France ."
    with_ctx = data.example_of(tok, {"instruction": q, "context": c, "response": a}, layout)
    without = data.example_of(tok, {"instruction": q, "context": "  ", "response": a}, layout)
    assert tok.decode(with_ctx.input_ids) == f"<s> ### Instruction : {q} {c} ### Response : {a} </s>"
    assert tok.decode(without.input_ids) == f"<s> ### Instruction : {q} ### Response : {a} </s>"


def test_only_the_answer_and_its_eos_are_trained(tok):
    rec = {"instruction": "Tell me about Paris.", "context": "", "response": "Paris is the capital of France."}
    e = data.example_of(tok, rec, _layout("instruction", "context", "response"))
    served = chat_api.prompt_ids(tok, [chat_api.Message(role="user", content=rec["instruction"])])
    assert e.input_ids[0] == tok.bos_token_id and e.input_ids[-1] == tok.eos_token_id
    assert e.input_ids[:len(served)] == served            # what the endpoint sends for the question
    assert e.labels[:len(served)] == [IGNORE] * len(served)
    assert e.labels[len(served):] == e.input_ids[len(served):]
    assert tok.unk_token_id not in e.input_ids  # the built-in vocabulary covers the shipped data


def test_packing_keeps_every_example_whole_and_no_label_crosses_a_boundary():
    exs = [ex(3, [1, 2]), ex(2, [3, 4, 5], start=20), ex(4, [6], start=30), ex(1, [7, 8, 9, 10, 11], start=40)]
    blocks = data.pack_examples(exs, block_len=8, pad_id=PAD)
    whole = {tuple(e.input_ids) for e in exs}
    found = []
    for blk in blocks:
        starts = [j for j, p in enumerate(blk.position_ids[:blk.n_real]) if p == 0] + [blk.n_real]
        for s, e in zip(starts, starts[1:]):
            found.append(tuple(blk.input_ids[s:e]))       # every segment is one whole example
            assert blk.labels[s] == IGNORE                # the first token of each is never a label
        assert all(lab in (IGNORE, tid) for lab, tid in zip(blk.labels, blk.input_ids))
        assert blk.labels[blk.n_real:] == [IGNORE] * (8 - blk.n_real)
    assert sorted(found) == sorted(whole)
    assert len(blocks) == 4                               # 6, 6, 6 and 7 tokens: no two fit one row of 8


def test_best_fit_decreasing_fills_rows_tightly():
    lengths = [5, 3, 4, 4, 2, 6, 1, 7]                    # 32 tokens
    rows = data.bin_pack(lengths, 8)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 8 for r in rows)
    assert len(rows) == 4                                 # 32 tokens in 4 rows of 8: no padding at all


def test_overlong_examples_are_truncated_or_dropped_and_counted():
    short, long, prompt_only = ex(3, [1, 2]), ex(2, list(range(1, 12))), ex(9, [1])
    kept = data.fit([short, long, prompt_only], 8, "truncate")
    assert (kept.truncated, kept.dropped) == (1, 1)       # nothing of prompt_only's answer is left in 8 tokens
    assert [len(e.input_ids) for e in kept.examples] == [6, 8]
    dropped = data.fit([short, long, prompt_only], 8, "drop")
    assert (dropped.truncated, dropped.dropped, len(dropped.examples)) == (0, 2, 1)


def test_no_packing_is_the_seed_recipe():
    exs = [ex(3, [1, 2]), ex(2, list(range(1, 12)))]             # 6 and 14 tokens
    blocks = data.pad_examples(exs, max_len=8, pad_id=PAD)
    assert [b.n_real for b in blocks] == [6, 8]                   # second one truncated
    assert blocks[0].attention_mask == [1] * 6 + [0] * 2 and blocks[0].labels[6:] == [IGNORE] * 2
    assert blocks[0].position_ids is None
    assert data.pad_fraction(blocks) == pytest.approx(2 / 16)


def test_packed_examples_do_not_attend_to_each_other(tok):
    """Logits of example B inside a packed row equal B's logits alone (block-diagonal mask)."""
    model = tiny.build_model(len(tok), seed=0).eval()
    recs = load_records("builtin:dolly-mini", "train[:2]")
    a, b = (data.example_of(tok, r, _layout(*r)) for r in recs)
    block = data.pack_examples([a, b], len(a.input_ids) + len(b.input_ids), tok.pad_token_id)[0]
    at = 0 if block.input_ids[:len(b.input_ids)] == b.input_ids else len(a.input_ids)   # the longer one first
    assert block.input_ids[at:at + len(b.input_ids)] == b.input_ids
    with torch.no_grad():
        packed = model(**collate([block], [0])).logits[0, at:at + len(b.input_ids)]
        alone = model(input_ids=torch.tensor([b.input_ids])).logits[0]
    assert torch.allclose(packed, alone, atol=1e-5)


def test_rank_batches_disjoint_equal_and_deterministic():
    per_rank = [data.rank_batches(50, world=2, rank=r, batch=4, epoch=1, seed=7) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 50 // 8       # remainder dropped on every rank
    flat = [i for r in per_rank for step in r for i in step]
    assert len(flat) == len(set(flat)) == 48
    assert per_rank[0] == data.rank_batches(50, 2, 0, 4, 1, 7)   # resume replays the same order
    assert per_rank[0] != data.rank_batches(50, 2, 0, 4, 2, 7)   # reshuffled per epoch
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        data.rank_batches(7, world=2, rank=0, batch=4, epoch=0, seed=0)


def test_builtin_dataset_split_and_columns():
    recs = load_records("builtin:dolly-mini", "train[:64]")
    assert len(recs) == 64
    assert {"instruction", "context", "response", "category"} <= set(recs[0])
    assert len(load_records("builtin:dolly-mini", "train")) >= 300


def test_tokenizer_is_deterministic(tok):
    again = tiny.build_tokenizer()
    assert again.get_vocab() == tok.get_vocab()


def test_padding_does_not_change_the_loss(tok):
    """--no-packing rows: pads are masked out of attention and loss (same loss as unpadded)."""
    model = tiny.build_model(len(tok), seed=0).eval()
    rec = load_records("builtin:dolly-mini", "train[:1]")[0]
    e = data.example_of(tok, rec, _layout(*rec))
    padded = data.pad_examples([e], len(e.input_ids) + 37, tok.pad_token_id)
    with torch.no_grad():
        a = model(**collate(padded, [0])).loss
        b = model(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels])).loss
    assert torch.allclose(a, b, atol=1e-5)


def test_local_dataset_files_load_in_order(tmp_path):
    import json

    good = tmp_path / "mine.jsonl"
    good.write_text("".join(json.dumps({"instruction": f"q{i}", "context": "", "response": f"a{i}"}) + "\n"
                            for i in range(5)))
    assert [r["instruction"] for r in load_records(str(good), "train[:2]")] == ["q0", "q1"]


def test_each_epoch_is_a_permutation_of_all_rows_and_a_resume_skips_exactly_what_was_trained():
    import numpy as np

    from tpuft_workload import pipeline

    rows = {"input_ids": np.arange(50)[:, None].repeat(4, axis=1), "n_real": np.full(50, 4)}

    def epoch(rank: int, e: int, skip: int = 0) -> list[list[int]]:
        return [b["input_ids"][:, 0].tolist() for b in pipeline.epoch_batches(rows, 2, rank, 4, 7, e, skip)]

    first = [epoch(r, 0) for r in (0, 1)]
    steps = [a + b for a, b in zip(*first)]                # the global batches
    assert len(steps) == 6 and len({i for s in steps for i in s}) == 48   # 48 distinct rows of 50
    assert sorted(i for s in steps for i in s) != [i for s in steps for i in s]   # not file order
    assert epoch(0, 1) != first[0]                         # another permutation next epoch
    assert epoch(0, 0, skip=4) == first[0][4:]             # resumed after step 4: the same rows, none again
