"""tpuft_workload.batching's static path with a stand-in model whose generate() drives the batcher's
hooks as transformers' does (a logits processor, then a stopping criterion, once per step): which
requests share a batch, what each row's client receives, and what a failure or a client that leaves
does. Then the continuous path (tpuft_workload.rolling) on the builtin tiny model: which
architectures take it, rows joining and leaving, a failure. The real engine behind the same batcher
is tests/workload/test_serve.py's (requests joining a running batch answer as alone)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tpuft_workload import batching, chat_api

torch = pytest.importorskip("torch")

EOS, VOCAB = 3, 16
GREEDY = batching.Sampling(0.0, 1.0, None)


class Tokenizer:
    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(f"w{t}" for t in tokens if not (skip_special_tokens and t == EOS))


class Model:
    """generate() over the padded batch: greedy rows get token 4 + step (EOS from step `eos_at`); each
    call records its batch and can be held at its start until `gate` opens, and at step `hold_at`
    until `resume` is set."""
    device = torch.device("cpu")

    def __init__(self, eos_at: int = 99, fail: bool = False):
        self.eos_at, self.fail = eos_at, fail
        self.batches: list[list[list[int]]] = []   # each call's prompts, unpadded
        self.ended: list[list[list[int]]] = []     # each call's rows as generate() returned them
        self.entered, self.gate = threading.Event(), threading.Event()
        self.gate.set()
        self.hold_at: int | None = None
        self.resume = threading.Event()

    def scores(self, step: int, rows: int):
        scores = torch.zeros(rows, VOCAB)
        scores[:, EOS if step >= self.eos_at else 4 + step % 10] = 1.0
        return scores

    def generate(self, ids, attention_mask, generation_config, logits_processor, stopping_criteria):
        self.batches.append([row[mask.bool()].tolist() for row, mask in zip(ids, attention_mask)])
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail:
            raise RuntimeError("out of memory")
        for step in range(generation_config.max_new_tokens):
            if step == self.hold_at:
                assert self.resume.wait(30)
            scores = logits_processor(ids, self.scores(step, ids.shape[0]))
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=-1)
            if stopping_criteria(ids, scores).all():
                break
        self.ended.append(ids.tolist())
        return ids


def _batcher(model: Model, max_batch_size: int = 8, wait_s: float = 0.0) -> batching.Batcher:
    return batching.Batcher(model, Tokenizer(), {EOS}, 0, max_batch_size, wait_s)


async def _behind_one(batcher: batching.Batcher, model: Model, first: tuple, rest: list[tuple]) -> list:
    """The answers to `first` and then `rest` (submit() arguments), the model held at the start of
    first's batch until all of rest is queued: rest then shares the next batch(es)."""
    model.entered.clear()
    model.gate.clear()
    gens = [batcher.submit(*first)]
    await asyncio.to_thread(model.entered.wait, 30)
    gens += [batcher.submit(*r) for r in rest]
    model.gate.set()
    return await asyncio.gather(*(g.answer() for g in gens))


def test_queued_requests_share_a_batch_of_at_most_max_batch_size_and_each_gets_its_own_answer():
    model = Model()
    batcher = _batcher(model, max_batch_size=2)
    answers = asyncio.run(_behind_one(batcher, model, ([1, 2], 3, GREEDY, (), False),
                                      [([1] * n, n, GREEDY, (), False) for n in (1, 2, 3, 4)]))
    assert batcher.batch_sizes == [1, 2, 2]
    assert model.batches == [[[1, 2]], [[1], [1, 1]], [[1, 1, 1], [1, 1, 1, 1]]]   # unpadded prompts, in order
    assert [(a.text, a.finish_reason, a.prompt_tokens, a.completion_tokens) for a in answers] == [
        ("w4 w5 w6", "length", 2, 3), ("w4", "length", 1, 1), ("w4 w5", "length", 2, 2),
        ("w4 w5 w6", "length", 3, 3), ("w4 w5 w6 w7", "length", 4, 4)]   # each row's own budget


def test_after_a_batch_of_k_the_next_waits_for_k_requests_and_a_lone_client_never_waits():
    model = Model()
    batcher = _batcher(model, wait_s=5.0)
    one = ([1], 1, GREEDY, (), False)

    async def go():
        await _behind_one(batcher, model, one, [one, one])
        late = batcher.submit(*one)
        await asyncio.sleep(0.2)                  # the second client of the pair comes back later
        await asyncio.gather(late.answer(), batcher.submit(*one).answer())
    asyncio.run(go())
    assert batcher.batch_sizes == [1, 2, 2]

    lone = _batcher(Model(), wait_s=5.0)

    async def alone():
        for _ in range(3):
            await asyncio.wait_for(lone.submit([1], 1, GREEDY, (), False).answer(), 2.0)   # never 5 s
    asyncio.run(alone())
    assert lone.batch_sizes == [1, 1, 1]


def test_a_stream_sends_each_final_delta_and_stops_at_eos_or_a_stop_sequence():
    batcher = _batcher(Model(eos_at=3))

    async def events(stops: tuple[str, ...]):
        return [e async for e in batcher.submit([1], 10, GREEDY, stops, True)]
    *deltas, answer = asyncio.run(events(()))
    assert deltas == ["w4", " w5", " w6"] and (answer.text, answer.finish_reason) == ("w4 w5 w6", "stop")
    assert answer.completion_tokens == 4   # the EOS counts, and is not text
    # "w5" may begin the stop: held, then cut; the text before the stop is kept as generated, its space too
    *deltas, answer = asyncio.run(events(("w5 w", "w9")))
    assert deltas == ["w4", " "] and (answer.text, answer.finish_reason, answer.completion_tokens) == ("w4 ", "stop", 3)


def test_a_client_that_leaves_ends_its_row_and_the_batch_goes_on_for_the_others():
    model = Model()
    batcher = _batcher(model)

    async def go():
        model.gate.clear()
        model.hold_at = 2   # the second batch waits there until the client has left: no race with its steps
        plug = batcher.submit([1], 1, GREEDY, (), False)   # one step: never held
        await asyncio.to_thread(model.entered.wait, 30)
        leaving = batcher.submit([1], 50, GREEDY, (), True)
        staying = batcher.submit([1], 5, GREEDY, (), True)
        model.gate.set()
        await plug.answer()
        events = aiter(leaving)
        await anext(events)
        await events.aclose()   # what Starlette does to a stream whose client disconnected
        model.resume.set()
        answer = await staying.answer()
        async with asyncio.timeout(30):
            while len(model.ended) < 2:
                await asyncio.sleep(0.01)
        return answer
    assert asyncio.run(go()).completion_tokens == 5
    assert batcher.batch_sizes == [1, 2]
    assert len(model.ended[1][0]) < 1 + 50   # the leaving row stopped long before its budget


def test_a_failed_generate_reaches_every_client_in_the_batch_and_the_next_request_is_served():
    model = Model(fail=True)
    batcher = _batcher(model)

    async def go():
        model.gate.clear()
        gens = [batcher.submit([1], 3, GREEDY, (), s) for s in (False, True)]
        model.gate.set()
        return await asyncio.gather(*(g.answer() for g in gens), return_exceptions=True)
    assert [str(e) for e in asyncio.run(go())] == ["out of memory"] * 2
    model.fail = False

    async def again():
        return await batcher.submit([1], 2, GREEDY, (), False).answer()
    assert asyncio.run(again()).text == "w4 w5"


def test_a_seeded_row_samples_the_same_tokens_whatever_shares_its_batch():
    class Flat(Model):   # every token about as likely: sampling shows
        def scores(self, step: int, rows: int):
            return (torch.arange(VOCAB, dtype=torch.float32) / 100).repeat(rows, 1)

    model = Flat()
    batcher = _batcher(model)
    seeded, sampled = ([1], 8, batching.Sampling(1.0, 1.0, 11), (), False), ([1], 8, batching.Sampling(1.0, 1.0, None), (), False)
    greedy = ([1], 8, GREEDY, (), False)
    alone = asyncio.run(_behind_one(batcher, model, greedy, [seeded]))[1]
    crowded = asyncio.run(_behind_one(batcher, model, greedy, [seeded, greedy, sampled, greedy, sampled]))[1:]
    assert batcher.batch_sizes == [1, 1, 1, 5]
    assert crowded[0] == alone and len(set(alone.text.split())) > 1
    assert crowded[1].text == crowded[3].text == " ".join(["w15"] * 8)   # greedy rows: the argmax


def test_top_p_samples_only_from_the_nucleus():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([3.0, 2.9, 0.0, 0.0, 0.0])   # p ~ 0.45, 0.41, then 0.05 each
    assert {batching.sample(logits, 1.0, 0.5, gen) for _ in range(200)} == {0, 1}
    assert {batching.sample(logits, 1.0, 0.4, gen) for _ in range(50)} == {0}
    assert {batching.sample(logits, 1.0, 1.0, gen) for _ in range(400)} == {0, 1, 2, 3, 4}


def test_an_answer_carries_its_prompts_length():
    async def go():
        return await _batcher(Model()).submit([1, 2, 3], 2, GREEDY, (), False).answer()
    assert asyncio.run(go()) == chat_api.Answer("w4 w5", "length", 3, 2)


# --- continuous batching (tpuft_workload.rolling), on the builtin tiny model --------------------

@pytest.mark.parametrize("config, continuous", [
    (lambda t: t.LlamaConfig(), True),                       # full attention on every layer
    (lambda t: t.Qwen2Config(), True),
    (lambda t: t.MistralConfig(sliding_window=64), False),   # a window: generate()'s cache keeps it right
    (lambda t: t.Gemma3TextConfig(), False),                 # sliding and full layers mixed
], ids=["llama", "qwen2", "mistral-window", "gemma3"])
def test_only_models_whose_cache_is_full_attention_on_every_layer_join_rows_mid_batch(config, continuous):
    import transformers

    model = type("M", (), {"config": config(transformers), "forward": lambda self: None})()
    assert batching.rolling.supported(model) is continuous
    assert batching.rolling.supported(Model()) is False   # no config: the stand-in above is static


@pytest.fixture(scope="module")
def tiny_model():
    from tpuft_workload import tiny

    tok = tiny.build_tokenizer()
    return tiny.build_model(len(tok), seed=0).eval(), tok


def _tiny_batcher(tiny_model) -> batching.Batcher:
    model, tok = tiny_model
    batcher = batching.Batcher(model, tok, {tok.eos_token_id}, tok.pad_token_id, 4)
    assert batcher.continuous
    return batcher


def test_rows_join_at_the_next_step_and_leave_as_they_end_each_answering_as_alone(tiny_model):
    """Prompts of different lengths and budgets, sent one after another while earlier ones decode:
    each joins the running rows (never more than max_batch_size) and its greedy tokens are the ones
    it gets alone; a row that ends leaves and the others go on."""
    model, tok = tiny_model
    batcher = _tiny_batcher(tiny_model)
    prompts = [tok(t)["input_ids"] for t in ("what is a dog", "name three colors of the sky at night please",
                                            "why", "write a haiku about rain on a quiet street", "hello there")]
    budgets = [24, 6, 30, 12, 18]

    async def one(i: int, delay: float = 0.0):
        await asyncio.sleep(delay)
        return await batcher.submit(prompts[i], budgets[i], GREEDY, (), False).answer()

    async def staggered():
        return await asyncio.gather(*(one(i, 0.003 * i) for i in range(len(prompts))))
    alone = [asyncio.run(one(i)) for i in range(len(prompts))]
    assert batcher.batch_sizes == [1] * len(prompts)
    together = asyncio.run(staggered())
    assert [a.text for a in together] == [a.text for a in alone]
    assert [a.completion_tokens for a in together] == [a.completion_tokens for a in alone]
    joined = batcher.batch_sizes[len(prompts):]
    assert max(joined) > 1 and max(joined) <= 4 and len(joined) > 1   # joined in more than one admission


def test_the_decoding_loop_records_no_autograd_history(tiny_model, monkeypatch):
    """Every step runs in inference mode: a batch that never empties under steady load would otherwise
    keep every step's activations alive through the KV cache."""
    import torch

    model, tok = tiny_model
    batcher = _tiny_batcher(tiny_model)
    real_step, modes = batching.rolling.step, []

    def spy(*args):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return real_step(*args)
    monkeypatch.setattr(batching.rolling, "step", spy)

    async def one():
        return await batcher.submit(tok("what is a dog")["input_ids"], 6, GREEDY, (), False).answer()
    assert asyncio.run(one()).completion_tokens > 1
    assert modes and set(modes) == {(True, False)}


def test_a_failed_step_reaches_every_running_client_and_the_next_request_is_served(tiny_model, monkeypatch):
    model, tok = tiny_model
    batcher = _tiny_batcher(tiny_model)
    prompt = tok("what is a dog")["input_ids"]

    async def one(stream: bool = False):
        return await batcher.submit(prompt, 20, GREEDY, (), stream).answer()
    alone = asyncio.run(one())
    assert alone.completion_tokens > 4   # still running at the failing step below
    real_step, calls = batching.rolling.step, []

    def failing_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real_step(*args)
    monkeypatch.setattr(batching.rolling, "step", failing_step)

    async def go():
        return await asyncio.gather(one(False), one(True), return_exceptions=True)
    assert [str(e) for e in asyncio.run(go())] == ["out of memory"] * 2
    assert asyncio.run(one()) == alone
