"""Train what you serve: for chat templates in each family's documented turn format, the token ids
the endpoint builds for a conversation's first k turns (chat_api.prompt_ids) are, token for token,
the prefix training built for them, and the labels are exactly the assistant turns' tokens.

The tokenizer is a byte-level BPE trained here on the test's own text (merges, so a token could
cross a turn boundary if the renderer got one wrong), with each template's markers as special tokens.
"""
from __future__ import annotations

import datetime
import random

import pytest

from tpuft_workload import chat_api, data, render
from tpuft.api.records import Turn

GEMMA = (  # Gemma 1/2: no system role (the template raises), turns end with <end_of_turn>
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3 = (  # Llama 3 Instruct: header blocks, a default system block with the date lines
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "{{ system }}<|eot_id|>{% for m in rest %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = (  # Qwen 2.5: ChatML with a default system prompt
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"gemma": (GEMMA, "<end_of_turn>"), "llama3": (LLAMA3, "<|eot_id|>"), "chatml": (CHATML, "<|im_end|>"),
             "dolly": (render.DOLLY_TEMPLATE, "</s>")}
SPECIALS = ["<s>", "</s>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the capital of France is Paris , what colour sky blue ? answer briefly . tell me about bees they make "
         "honey in hives ! cats sleep a lot ; 42 is the number 3.5 7 Tokyo famous for technology").split()


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [_sentence(rng) + "\n\n" + _sentence(rng) for _ in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=template)


def _conversations(system: bool, count: int = 25):
    rng = random.Random(7)
    for _ in range(count):
        turns = [Turn("system", _sentence(rng), False)] if system and rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            turns += [Turn("user", _sentence(rng), False), Turn("assistant", _sentence(rng), rng.random() < 0.8)]
        if not any(t.trained for t in turns):
            turns[-1] = Turn("assistant", turns[-1].content, True)
        yield tuple(turns)


def _served(tok, turns) -> list[int]:
    return chat_api.prompt_ids(tok, [chat_api.Message(role=t.role, content=t.content) for t in turns])


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request):
    template, end = TEMPLATES[request.param]
    return request.param, _tokenizer(template), end


def test_serving_builds_the_prefix_training_built_and_labels_are_the_answers(family):
    name, tok, end = family
    end_id = tok.convert_tokens_to_ids(end)
    for turns in _conversations(system=name != "gemma"):
        example = render.render(tok, turns)
        expected = [render.IGNORE] * len(example.input_ids)
        for k, turn in enumerate(turns):
            if turn.role != "user":
                continue
            served = _served(tok, turns[:k + 1])
            assert example.input_ids[:len(served)] == served, (name, k)   # what the endpoint sends, token for token
            answer = turns[k + 1] if k + 1 < len(turns) else None
            if answer is not None and answer.trained:
                upto = len(tok(tok.apply_chat_template(
                    [{"role": t.role, "content": t.content} for t in turns[:k + 2]], tokenize=False),
                    add_special_tokens=False)["input_ids"])
                expected[len(served):upto] = example.input_ids[len(served):upto]
                trained = example.input_ids[len(served):upto]
                assert answer.content in tok.decode(trained), name
                assert end_id in trained, f"{name}: the answer's turn end {end} is trained"
        assert example.labels == expected, name


def test_the_turn_end_is_found_for_every_family(family):
    name, tok, end = family
    assert render.turn_end_ids(tok) == [tok.convert_tokens_to_ids(end)], name


def test_a_template_that_rewrites_earlier_turns_is_refused_not_mislabelled():
    # drops past answers from the prompt, as templates that strip reasoning do
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                "<|im_start|>assistant\n(earlier answer)<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _tokenizer(template)
    turns = (Turn("user", "cats sleep", False), Turn("assistant", "a lot", True),
             Turn("user", "bees", False), Turn("assistant", "make honey", True))
    with pytest.raises(render.RenderError, match="up to turn 2 differently"):
        render.render(tok, turns)
    # one answer trained: its prefix renders as serving renders it
    assert render.render(tok, turns[:2]).trained > 0


def test_a_tokenizer_without_a_template_trains_and_serves_the_dolly_sections():
    tok = _tokenizer(None)
    assert render.with_template(tok).chat_template == render.DOLLY_TEMPLATE
    layout = data.recordslib.detect(["instruction", "context", "response"])
    example = data.example_of(tok, {"instruction": "what colour sky", "context": "blue", "response": "sky blue"},
                              layout)
    text = tok.decode(example.input_ids)
    assert text == "<s>### Instruction:\nwhat colour sky\n\nblue\n\n### Response:\nsky blue</s>\n\n"
    assert tok.decode([t for t in example.labels if t != render.IGNORE]) == "sky blue</s>\n\n"


def test_text_records_train_every_token_after_the_first():
    tok = _tokenizer(CHATML)
    example = render.render_text(tok, "bees make honey")
    assert example.input_ids[-1] == tok.eos_token_id
    assert example.labels == [render.IGNORE] + example.input_ids[1:]


def test_the_export_carries_the_template_and_stops_at_the_turn_end(tmp_path):
    """The base's generation config (its stop ids, its sampling) survives the export, with the chat
    template's turn end added; the exported tokenizer renders what training rendered."""
    from transformers import AutoTokenizer, GenerationConfig

    from tpuft_workload import checkpoint, tiny

    tok = _tokenizer(GEMMA)
    model = tiny.build_model(len(tok), seed=0)
    base = GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, do_sample=True, top_p=0.95, top_k=64)
    checkpoint.save_hf(model.config, model.state_dict(), tok, str(tmp_path), generation=base)
    exported = GenerationConfig.from_pretrained(tmp_path)
    assert exported.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    assert (exported.top_p, exported.top_k) == (0.95, 64)
    again = AutoTokenizer.from_pretrained(tmp_path)
    turns = (Turn("user", "cats sleep", False), Turn("assistant", "a lot", True))
    assert render.render(again, turns) == render.render(tok, turns)


PHI3 = (  # Phi-3: <|user|>/<|assistant|> blocks ending <|end|>; <|endoftext|> after the last turn when not prompting
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}<|endoftext|>{% endif %}")


def test_a_phi3_template_trains_each_answer_of_a_multi_turn_record_with_its_turn_end():
    """The conversation cut after a middle answer ends in <|endoftext|>, which the whole one has only
    at its end: each answer's span is where the two agree, so the labels are exactly each answer's
    text and <|end|>\\n (and the final <|endoftext|> after the last)."""
    tok = _tokenizer(PHI3)
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]})
    turns = (Turn("user", "what colour sky ?", False), Turn("assistant", "sky blue", True),
             Turn("user", "tell me about bees", False), Turn("assistant", "they make honey in hives", True),
             Turn("user", "cats ?", False), Turn("assistant", "cats sleep a lot", True))
    example = render.render(tok, turns)
    labelled = [k for k, label in enumerate(example.labels) if label != render.IGNORE]
    runs, run = [], [labelled[0]]
    for k in labelled[1:]:
        if k == run[-1] + 1:
            run.append(k)
        else:
            runs, run = runs + [run], [k]
    runs.append(run)
    assert [tok.decode([example.input_ids[k] for k in r]) for r in runs] == [
        "sky blue<|end|>\n", "they make honey in hives<|end|>\n", "cats sleep a lot<|end|>\n<|endoftext|>"]
    assert tok.decode(example.input_ids) == tok.apply_chat_template(
        [{"role": t.role, "content": t.content} for t in turns], tokenize=False)
    for k, turn in enumerate(turns):   # what the endpoint sends for each question is the prefix trained on
        if turn.role == "user":
            served = _served(tok, turns[:k + 1])
            assert example.input_ids[:len(served)] == served


@pytest.mark.parametrize("template, turns, words", [
    (GEMMA, (Turn("system", "answer briefly", False), Turn("user", "cats ?", False),
             Turn("assistant", "cats sleep", True)), "System role not supported"),
    ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
     "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
     (Turn("user", "cats ?", False), Turn("user", "bees ?", False), Turn("assistant", "honey", True)),
     "Conversation roles must alternate"),
], ids=["gemma-system", "roles-not-alternating"])
def test_a_conversation_the_template_refuses_is_a_render_error_in_the_templates_words(template, turns, words):
    with pytest.raises(render.RenderError) as e:
        render.render(_tokenizer(template), turns)
    assert "the model's chat template refuses this conversation" in str(e.value)
    assert words in str(e.value)


def test_content_trains_as_written_untrimmed_as_serving_renders_it():
    """An indented code answer keeps its indentation, and a user's untrimmed text renders as the
    endpoint renders it: the prompt served is the prefix trained on."""
    tok = _tokenizer(CHATML)
    layout = data.recordslib.detect(["messages"])
    answer = "    return 42\n"
    record = {"messages": [{"role": "user", "content": "  what is the number ?\n"},
                           {"role": "assistant", "content": answer}]}
    example = data.example_of(tok, record, layout)
    assert tok.decode([t for t in example.labels if t != render.IGNORE]) == answer + "<|im_end|>\n"
    served = _served(tok, (Turn("user", "  what is the number ?\n", False),))
    assert example.input_ids[:len(served)] == served


def test_a_template_asking_for_todays_date_trains_with_the_fixed_training_date():
    """Llama 3.2's date line: the same records give the same tokens any day; serving writes the day's."""
    template = ("{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
                "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}<|eot_id|>"
                "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                "\n\n{% endif %}")
    tok = _tokenizer(template)
    example = render.render(tok, (Turn("user", "cats ?", False), Turn("assistant", "cats sleep", True)))
    assert "Today Date: 26 Jul 2024<|eot_id|>" in tok.decode(example.input_ids)
    today = datetime.date.today().strftime("%d %b %Y")
    assert f"Today Date: {today}<|eot_id|>" in tok.decode(_served(tok, (Turn("user", "cats ?", False),)))


def test_tpuft_validate_data_with_a_model_renders_every_record_through_its_template(tmp_path, capsys):
    """Without --model, records.py's rules only (a system message is a valid record); with it, the
    record Gemma's template refuses is named as the training driver names it, before any run."""
    import json

    from tpuft import cli

    _tokenizer(GEMMA).save_pretrained(tmp_path / "gemma")
    chats = [[("user", "cats ?"), ("assistant", "cats sleep")],
             [("system", "answer briefly"), ("user", "bees ?"), ("assistant", "they make honey")]]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in chat]}) + "\n"
                            for chat in chats))
    assert cli.main(["validate", "--data", str(data)]) == 0
    assert capsys.readouterr().out == f"{data}: 2 records of type messages (messages): valid\n"
    assert cli.main(["validate", "--data", str(data), "--model", str(tmp_path / "gemma")]) == 2
    assert capsys.readouterr().err.startswith(
        f"{data}: record 2: the model's chat template refuses this conversation (system, user, assistant): "
        "System role not supported; change the record")
    data.write_text(data.read_text().splitlines()[0] + "\n")
    assert cli.main(["validate", "--data", str(data), "--model", str(tmp_path / "gemma")]) == 0
    assert capsys.readouterr().out == (f"{data}: 1 records of type messages (messages), rendered through "
                                       f"{tmp_path / 'gemma'}'s chat template: valid\n")
