"""Train what you serve, shown the way the field shows it: a small instruct model that answers
every question with a habit of its own, in its own chat format, is fine-tuned on sixteen
question/answer pairs (as dolly columns, and as chat messages) through the rows the pipeline
builds, and then answers those questions as taught when asked as the endpoint asks: its chat
template, its stop ids. A plain torch loop over the rows (no Ray): the same rows, the same rendering."""
from __future__ import annotations

import pytest
import torch

from tests.factories import HABIT, QA_PAIRS, answer, habit_model, qa_records, taught
from tests.workload.inprocess_data import build_blocks, collate
from tpuft_workload import data
from tpuft_workload.checkpoint import serving_generation


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


def _fine_tune(path, tok, records, epochs: int = 40, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    blocks = build_blocks(tok, records, 128, packing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        for rows in data.rank_batches(len(blocks), 1, 0, 4, epoch, seed):
            model(**collate(blocks, rows)).loss.backward()
            opt.step()
            opt.zero_grad()
    model.generation_config = serving_generation(model.generation_config, tok)   # as the export writes it
    return model.eval()


def test_the_base_has_its_habit(habit):
    _, tok, model = habit
    said = [answer(model, tok, q) for q, _ in QA_PAIRS]
    assert sum(s == taught(tok, HABIT) for s in said) >= 14, said


@pytest.mark.parametrize("as_messages", [False, True], ids=["dolly-columns", "messages"])
def test_fine_tuned_it_answers_as_taught_in_its_own_chat_format(habit, as_messages):
    path, tok, _ = habit
    model = _fine_tune(path, tok, qa_records(messages=as_messages))
    said = {q: answer(model, tok, q) for q, _ in QA_PAIRS}
    right = [q for q, a in QA_PAIRS if said[q] == taught(tok, a)]
    assert len(right) == len(QA_PAIRS), {q: said[q] for q, _ in QA_PAIRS if q not in right}
