"""builtin:tiny-chat and builtin:made-up-facts, the pair `tpuft demo` fine-tunes: the base is built
the same every time, speaks in its own chat format, answers the facts' questions wrong, and after
the demo's fine-tune (examples/local-cpu.yaml's data, learning rate, epochs and batch, on the rows
the pipeline builds) answers them as taught, its loss on the held-out paraphrases fallen.

The loop is examples/local-cpu.yaml's optimizer step in one process (AdamW with its weight decay,
gradients clipped at its norm, the 2 workers' global batch as one), on one thread: a 2-layer
model's steps are too small to share."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.paths import EXAMPLES
from tests.workload.inprocess_data import build_blocks, collate, load_records
from tpuft_workload import data, pipeline, tiny_chat
from tpuft_workload import model as modellib

DEMO = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())["spec"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The base as a run loads it: spec.model resolved to its folder, built in a fresh cache."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tiny_chat.CACHE_ENV, str(tmp_path_factory.mktemp("builtin")))
        path = modellib.weights_dir(DEMO["model"])
        tok = modellib.load_tokenizer(DEMO["model"])
    yield path, tok, AutoModelForCausalLM.from_pretrained(path).eval()
    torch.set_num_threads(threads)


def _facts(split: str) -> list[dict]:
    return load_records(pipeline.resolve(DEMO["dataset"]["name"]).path, split)


def _taught(tok, text: str) -> str:
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"]).strip()


def _right(model, tok, records: list[dict]) -> list[str]:
    return [r["messages"][0]["content"] for r in records
            if tiny_chat.answer(model, tok, r["messages"][0]["content"]) == _taught(tok, r["messages"][1]["content"])]


def _eval_loss(model, tok, records: list[dict]) -> float:
    blocks = build_blocks(tok, records, DEMO["training"]["maxSeqLength"], packing=False)
    with torch.no_grad():
        return model.eval()(**collate(blocks, list(range(len(blocks))))).loss.item()


def test_the_demo_runs_the_builtin_pair_with_a_held_out_eval_split():
    assert (DEMO["model"], DEMO["dataset"]["name"]) == (tiny_chat.BUILTIN_CHAT_MODEL, tiny_chat.BUILTIN_FACTS)
    assert (DEMO["dataset"]["split"], DEMO["evaluation"]["split"]) == (tiny_chat.TRAIN_SPLIT, tiny_chat.EVAL_SPLIT)
    train, held = _facts(tiny_chat.TRAIN_SPLIT), _facts(tiny_chat.EVAL_SPLIT)
    assert len(train) == len(held) == tiny_chat.TRAIN_RECORDS
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held}


def test_two_builds_give_identical_weights():
    first, second = (tiny_chat.pretrain(steps=20).state_dict() for _ in range(2))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["lm_head.weight"], tiny_chat.pretrain(steps=19).state_dict()["lm_head.weight"])


def test_the_base_speaks_its_chat_format_and_stops_at_its_turn_end(base):
    path, tok, model = base
    assert tok.chat_template == tiny_chat.CHAT_TEMPLATE and (Path(path) / "generation_config.json").is_file()
    corpus = tiny_chat._records(tiny_chat.corpus_path())
    assert len(_right(model, tok, corpus)) >= 0.75 * len(corpus)
    # ends there, though 24 tokens were allowed: it stops at its turn end, as the endpoint stops it
    assert tiny_chat.answer(model, tok, "What is the capital of Japan?") == "The capital of Japan is Tokyo."


def test_fine_tuned_as_the_demo_it_answers_what_the_base_did_not_know(base):
    from transformers import AutoModelForCausalLM

    path, tok, before = base
    training = DEMO["training"]
    train, held = _facts(tiny_chat.TRAIN_SPLIT), _facts(tiny_chat.EVAL_SPLIT)
    assert _right(before, tok, train) == []
    torch.manual_seed(training["seed"])
    model = AutoModelForCausalLM.from_pretrained(path)
    blocks = build_blocks(tok, train, training["maxSeqLength"], training["packing"])
    opt = torch.optim.AdamW(model.parameters(), lr=training["learningRate"], weight_decay=0.01)
    batch = training["batchSizePerDevice"] * int(DEMO["topology"])
    model.train()
    for epoch in range(training["epochs"]):
        for rows in data.rank_batches(len(blocks), 1, 0, batch, epoch, training["seed"]):
            model(**collate(blocks, rows)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    model.eval()
    right = _right(model, tok, train)
    assert len(right) == len(train), sorted({r["messages"][0]["content"] for r in train} - set(right))
    assert _eval_loss(model, tok, held) < 0.5 * _eval_loss(before, tok, held)
