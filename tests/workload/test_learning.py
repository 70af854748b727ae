"""Train what you serve, shown the way the field shows it: a small instruct model that answers
every question with a habit of its own, in its own chat format, is fine-tuned on sixteen
question/answer pairs (as dolly columns, and as chat messages) through the rows the pipeline
builds, and then answers those questions as taught when asked as the endpoint asks: its chat
template, its stop ids. The fine-tune is a plain loop over the rows (no Ray) in either framework:
torch's (AdamW), or the JAX path's own step (jax_train.train_step: clipping, AdamW, the rows as the
JAX backend batches them); each framework's export writer then writes the folder that the serving
engine (what the OpenAI endpoint answers with) loads, and the answers are asked of it as OpenAI
chat requests."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.factories import HABIT, QA_PAIRS, answer, habit_model, qa_records, taught  # noqa: E402
from tests.workload.inprocess_data import build_blocks, collate  # noqa: E402
from tpuft_workload import checkpoint, data  # noqa: E402


@pytest.fixture(scope="module")
def habit(tmp_path_factory):
    """One thread: a 2-layer model's steps are too small to share (23 ms a step alone, 136 ms on two
    threads beside other work on this 2-core machine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = habit_model(tmp_path_factory.mktemp("habit"))
    yield path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    torch.set_num_threads(threads)


EPOCHS, LEARNING_RATE, BATCH, SEED = 40, 1e-3, 4, 0


def _fine_tune_torch(path, tok, records, dest: str) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(path)
    blocks = build_blocks(tok, records, 128, packing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for epoch in range(EPOCHS):
        for rows in data.rank_batches(len(blocks), 1, 0, BATCH, epoch, SEED):
            model(**collate(blocks, rows)).loss.backward()
            opt.step()
            opt.zero_grad()
    return checkpoint.export_hf(model.eval(), tok, dest, rank=0)


def _fine_tune_jax(path, tok, records, dest: str) -> str:
    """The JAX backend's step on one process: its optimizer (clipped AdamW, decay on matrices), its
    batches of the shared rows (pipeline.epoch_batches), one micro-batch a step."""
    from functools import partial

    import jax
    import numpy as np

    from tpuft_workload import jax_model, jax_train, pipeline

    hf_config, cfg, params = jax_model.load_hf_dir(str(path))
    rows = pipeline.rows_of(build_blocks(tok, records, 128, packing=True), np)
    tx = jax_train.optimizer(params, weight_decay=0.01, max_grad_norm=1.0)
    opt_state = tx.init(params)
    step = jax.jit(partial(jax_train.train_step, tx, cfg, None, False))
    for epoch in range(EPOCHS):
        for batch in pipeline.epoch_batches(rows, 1, 0, BATCH, SEED, epoch):
            micro = {**jax_model.inputs_from_rows(batch, True), "n_real": batch["n_real"].astype("int32")}
            params, opt_state, _, _ = step(params, opt_state, {k: v[None] for k, v in micro.items()},
                                           np.float32(LEARNING_RATE))
    host = {name: np.asarray(p) for name, p in params.items()}
    return jax_train.write_export(host, hf_config, str(path), tok, dest)


FINE_TUNE = {"torch": _fine_tune_torch, "jax": _fine_tune_jax}


def _ask_the_endpoint(export: str, questions) -> dict:
    """{question: (text, finish_reason)}: each asked as an OpenAI chat request (no max_tokens, greedy)
    of the serving engine on `export`."""
    from tpuft_workload import chat_api
    from tpuft_workload import serve as serveapp

    engine = serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": "habit"}))
    try:
        said = {}
        for q in questions:
            reply = asyncio.run(engine.answer(chat_api.parse_request(
                {"model": "habit", "messages": [{"role": "user", "content": q}], "temperature": 0})))
            said[q] = (reply.text.strip(), reply.finish_reason)
        return said
    finally:
        engine.close()


def test_the_base_has_its_habit(habit):
    _, tok, model = habit
    said = [answer(model, tok, q) for q, _ in QA_PAIRS]
    assert sum(s == taught(tok, HABIT) for s in said) >= 14, said


@pytest.mark.parametrize("framework, as_messages", [("torch", False), ("torch", True), ("jax", True)],
                         ids=["torch-dolly-columns", "torch-messages", "jax-messages"])
def test_fine_tuned_it_answers_as_taught_in_its_own_chat_format(habit, framework, as_messages, tmp_path):
    path, tok, _ = habit
    export = FINE_TUNE[framework](path, tok, qa_records(messages=as_messages), str(tmp_path / "export"))
    said = _ask_the_endpoint(export, [q for q, _ in QA_PAIRS])
    # each answer as taught, ended by the model at its turn end (not by a token budget)
    wrong = {q: said[q] for q, a in QA_PAIRS if said[q] != (taught(tok, a), "stop")}
    assert not wrong, wrong
