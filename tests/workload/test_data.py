"""Template, tokenization, packing and per-rank batching: the label rules training relies on."""
from __future__ import annotations

import pytest
import torch

from tpuft_workload import data, tiny
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


def test_template_includes_context_only_when_present():
    with_ctx = data.format_example({"instruction": "Sum up.", "context": "Some text.", "response": "Ok."})
    without = data.format_example({"instruction": "Sum up.", "context": "  ", "response": "Ok."})
    assert with_ctx[0] == "### Instruction:\nSum up.\n\n### Context:\nSome text.\n\n### Response:\n"
    assert without[0] == "### Instruction:\nSum up.\n\n### Response:\n"
    assert with_ctx[1] == without[1] == "Ok."


def test_tokenize_masks_prompt_and_ends_with_eos(tok):
    rec = {"instruction": "Tell me about Paris.", "context": "", "response": "Paris is the capital of France."}
    e = data.tokenize_example(tok, rec)
    prompt_ids = tok(data.format_prompt(rec))["input_ids"]
    assert e.input_ids[0] == tok.bos_token_id and e.input_ids[-1] == tok.eos_token_id
    assert e.labels[:len(prompt_ids)] == [IGNORE] * len(prompt_ids)
    assert e.labels[len(prompt_ids):] == e.input_ids[len(prompt_ids):]
    assert tok.unk_token_id not in e.input_ids  # the built-in vocabulary covers the shipped data
    unmasked = data.tokenize_example(tok, rec, mask_prompt=False)
    assert unmasked.labels[0] == IGNORE and unmasked.labels[1:] == unmasked.input_ids[1:]


def test_packing_never_lets_a_label_cross_an_example_boundary():
    a, b, c = ex(3, [1, 2]), ex(2, [3, 4, 5], start=20), ex(4, [6], start=30)
    blocks = data.pack_examples([a, b, c], block_len=8, pad_id=PAD)
    ids = [t for blk in blocks for t in blk.input_ids]
    labels = [t for blk in blocks for t in blk.labels]
    pos = [t for blk in blocks for t in blk.position_ids]
    stream = a.input_ids + b.input_ids + c.input_ids
    assert ids[:len(stream)] == stream                           # nothing dropped or reordered
    starts = [0, len(a.input_ids), len(a.input_ids) + len(b.input_ids)]
    for s in starts:
        assert labels[s] == IGNORE                               # first token of every example
        assert pos[s] == 0                                       # positions restart per example
    assert labels[starts[1] - 1] == EOS and labels[starts[2] - 1] == EOS  # EOS is trained
    # labels only ever copy the token at the same position (HF shifts internally)
    assert all(lab in (IGNORE, tid) for lab, tid in zip(labels, ids))


def test_padding_only_in_last_block_and_pad_fraction():
    exs = [ex(3, [1, 2, 3]) for _ in range(5)]                   # 5 x 7 = 35 tokens
    blocks = data.pack_examples(exs, block_len=8, pad_id=PAD)
    assert len(blocks) == 5 and all(len(b.input_ids) == 8 for b in blocks)
    assert [b.n_real for b in blocks] == [8, 8, 8, 8, 3]
    assert all(PAD not in b.input_ids for b in blocks[:-1])
    last = blocks[-1]
    assert last.input_ids[3:] == [PAD] * 5 and last.labels[3:] == [IGNORE] * 5
    assert last.position_ids[3:] == [0, 1, 2, 3, 4]              # a segment of its own
    assert data.pad_fraction(blocks) == pytest.approx(5 / 40)


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
    recs = data.load_records("builtin:dolly-mini", "train[:2]")
    a, b = (data.tokenize_example(tok, r) for r in recs)
    block = data.pack_examples([a, b], len(a.input_ids) + len(b.input_ids), tok.pad_token_id)[0]
    with torch.no_grad():
        packed = model(**data.collate([block], [0])).logits[0, len(a.input_ids):]
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
    recs = data.load_records("builtin:dolly-mini", "train[:64]")
    assert len(recs) == 64
    assert {"instruction", "context", "response", "category"} <= set(recs[0])
    assert len(data.load_records("builtin:dolly-mini", "train")) >= 300


def test_tokenizer_is_deterministic(tok):
    again = tiny.build_tokenizer()
    assert again.get_vocab() == tok.get_vocab()


def test_padding_does_not_change_the_loss(tok):
    """--no-packing rows: pads are masked out of attention and loss (same loss as unpadded)."""
    model = tiny.build_model(len(tok), seed=0).eval()
    rec = data.load_records("builtin:dolly-mini", "train[:1]")[0]
    e = data.tokenize_example(tok, rec)
    padded = data.pad_examples([e], len(e.input_ids) + 37, tok.pad_token_id)
    with torch.no_grad():
        a = model(**data.collate(padded, [0])).loss
        b = model(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels])).loss
    assert torch.allclose(a, b, atol=1e-5)


def test_local_dataset_files_and_a_clear_error_for_wrong_columns(tmp_path):
    import json

    good = tmp_path / "mine.jsonl"
    good.write_text("".join(json.dumps({"instruction": f"q{i}", "context": "", "response": f"a{i}"}) + "\n"
                            for i in range(5)))
    assert [r["instruction"] for r in data.load_records(str(good), "train[:2]")] == ["q0", "q1"]
    bad = tmp_path / "other.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"no \['instruction', 'response'\] columns"):
        data.load_records(str(bad), "train")
