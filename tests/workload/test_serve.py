"""tpuft_workload.serve and tpuft_workload.chat_api on the tiny model's Hugging Face export (written by
checkpoint.export_hf, as training writes it): the pure rules, the engine and the HTTP app without Ray
(streamed and whole answers, every bad input a 4xx), then the application end to end under a local
Ray Serve on 127.0.0.1 (requests in the official SDK's shape, and tpuft.cli.chat as the client)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
from types import SimpleNamespace

import pytest
import yaml

from tests.paths import EXAMPLES
from tests.ranks import free_port
from tpuft.controller import builders
from tpuft.cli import chat
from tpuft.api.constants import (SERVE_API_KEY_ENV, SERVE_APP_NAME, SERVE_CHAT_PATH, SERVE_COMPLETIONS_PATH,
                             SERVE_DEPLOYMENT_NAME, SERVE_MODELS_PATH, SERVE_TRANSFORMERS_IMPORT_PATH, ServeArg)
from tpuft.api.spec import parse
from tpuft_workload import chat_api, checkpoint, data, engine_process, render, serve as serveapp, tiny

MODEL_ID = "tiny-finetuned"
HELLO = [{"role": "user", "content": "What is a dog?"}]
KEY = "sk-test-0123456789"
LONG = "dog " * 4096   # more tokens than the tiny model's max_position_embeddings
# Gemma's chat template (google/gemma-2-2b-it): no system role, and user/model turns must alternate
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> str:
    tok = tiny.build_tokenizer()
    dest = str(tmp_path_factory.mktemp("serve") / "export")
    # seed 0: this untrained model's greedy reply to HELLO does not start with EOS (non-empty text)
    assert checkpoint.export_hf(tiny.build_model(len(tok), seed=0), tok, dest, rank=0) == dest
    return dest


@pytest.fixture(scope="module")
def engine(export):
    engine = serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": MODEL_ID}))
    yield engine
    engine.close()


def _req(**kw) -> chat_api.ChatRequest:
    return chat_api.parse_request({"model": MODEL_ID, "messages": HELLO, **kw})


def _answer(engine, req: chat_api.GenerationRequest) -> chat_api.Answer:
    return asyncio.run(engine.answer(req))


# --- args ----------------------------------------------------------------------------------

def test_the_import_path_the_operator_writes_builds_the_app(export):
    import importlib

    from ray.serve import Application

    module, _, attr = SERVE_TRANSFORMERS_IMPORT_PATH.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert builder is serveapp.build_app
    assert isinstance(builder({"model_source": export, "model_id": MODEL_ID}), Application)   # bind: no Ray needed


def test_the_operators_serve_config_is_what_build_app_accepts(export):
    """tpuft.controller.builders' transformers application (the local CPU example serves): its args parse here
    (the export path swapped for this test's) and its deployment is this one."""
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["metadata"]["uid"] = "u-1"
    svc = builders.build_rayservice(parse(doc), model_source=export)
    app = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]
    assert (app["name"], app["import_path"], app["route_prefix"]) == (SERVE_APP_NAME, serveapp.IMPORT_PATH,
                                                                     serveapp.ROUTE_PREFIX)
    assert [d["name"] for d in app["deployments"]] == [serveapp.DEPLOYMENT_NAME]
    assert serveapp.parse_args(app["args"]) == serveapp.ServeArgs(
        export, doc["metadata"]["name"], doc["spec"]["serve"]["maxModelLength"])


def test_args_are_parsed_with_defaults(export):
    args = serveapp.parse_args({"model_source": export, "model_id": MODEL_ID})
    assert args == serveapp.ServeArgs(export, MODEL_ID, None)
    assert args.max_tokens_default is None   # a request without max_tokens gets the rest of the context
    custom = serveapp.parse_args({"model_source": export, "model_id": "m", "max_model_len": 256,
                                  "max_tokens_default": 8})
    assert (custom.max_model_len, custom.max_tokens_default) == (256, 8)
    assert serveapp.parse_args({"model_source": export, "model_id": "m", "max_batch_size": 1}).max_batch_size == 1
    assert {a.value for a in ServeArg} == {f for f in serveapp.ServeArgs.__dataclass_fields__}


@pytest.mark.parametrize("args, message", [
    ({"model_id": "m"}, "serve arg model_source is required"),
    ({"model_source": "X", "model_id": ""}, "serve arg model_id is required"),
    ({"model_source": "X", "model_id": "m", "max_model_len": 0}, "max_model_len=0: must be a positive integer"),
    ({"model_source": "X", "model_id": "m", "max_tokens_default": "64"}, "max_tokens_default='64'"),
    ({"model_source": "X", "model_id": "m", "max_model_length": 9}, "unknown serve arg(s) max_model_length"),
    ({"model_source": "X", "model_id": "m", "max_batch_size": 65}, "max_batch_size=65: give at most 64"),
])
def test_bad_args_name_the_arg(export, args, message):
    args = {k: (export if v == "X" else v) for k, v in args.items()}
    with pytest.raises(serveapp.ServeArgsError) as e:
        serveapp.build_app(args)
    assert message in str(e.value)


def test_a_missing_or_empty_export_names_the_path_and_training(tmp_path):
    for path, what in ((tmp_path / "nope", "is not a folder"), (tmp_path, "has no config.json and no weights")):
        with pytest.raises(serveapp.ServeArgsError) as e:
            serveapp.parse_args({"model_source": str(path), "model_id": "m"})
        assert f"model_source: {path} {what}" in str(e.value) and "training" in str(e.value)


def test_max_model_len_defaults_to_the_models_positions_and_cannot_exceed_them(engine):
    config = engine.process.ready.config   # the model lives in the engine process
    assert engine.max_model_len == serveapp.model_len(None, config) == config.max_position_embeddings
    assert serveapp.model_len(128, config) == 128
    with pytest.raises(serveapp.ServeArgsError, match="exceeds the model's max_position_embeddings"):
        serveapp.model_len(config.max_position_embeddings + 1, config)


# --- chat_api: prompts, budget, errors, response -------------------------------------------

def test_the_exported_tokenizer_renders_a_question_as_training_rendered_it(engine):
    tok = engine.tokenizer   # the export's: the chat template travelled through save_pretrained
    assert tok.chat_template == render.DOLLY_TEMPLATE
    ids = chat_api.prompt_ids(tok, _req().messages)
    trained = data.example_of(tok, {"instruction": HELLO[0]["content"], "response": "Hello ."},
                              data.recordslib.detect(["instruction", "response"]))
    assert trained.input_ids[:len(ids)] == ids and set(trained.labels[:len(ids)]) == {render.IGNORE}


def test_a_tokenizer_without_a_template_gets_role_lines_and_an_assistant_cue(engine):
    messages = chat_api.parse_request({"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}).messages
    assert chat_api.fallback_prompt(messages) == "system: be brief\nuser: hi\nassistant:"
    tok = tiny.build_tokenizer()
    tok.chat_template = None
    assert chat_api.prompt_ids(tok, messages) == tok("system: be brief\nuser: hi\nassistant:")["input_ids"]


def _gemma_tokenizer():
    tok = tiny.build_tokenizer()
    tok.chat_template = GEMMA_TEMPLATE
    return tok


@pytest.mark.parametrize("messages, why", [
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "System role not supported"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}], "Conversation roles must alternate"),
    ([{"role": "assistant", "content": "hi"}], "Conversation roles must alternate"),
])
def test_messages_the_chat_template_refuses_are_a_400_quoting_it(messages, why):
    req = chat_api.parse_request({"model": "m", "messages": messages})
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.prompt_ids(_gemma_tokenizer(), req.messages)
    err = e.value.body()["error"]
    assert (e.value.status, err["type"], err["param"]) == (400, "invalid_request_error", "messages")
    assert err["message"].startswith(f"the model's chat template refuses these messages: {why}")


def test_a_conversation_the_chat_template_accepts_renders_in_its_turn_format():
    tok = _gemma_tokenizer()
    messages = chat_api.parse_request({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"}]}).messages
    text = "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n" \
           "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    assert tok.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True,
                                   tokenize=False) == text.replace("<bos>", tok.bos_token)
    assert chat_api.prompt_ids(tok, messages) == tok(text.replace("<bos>", tok.bos_token),
                                                     add_special_tokens=False)["input_ids"]


def test_a_chat_template_that_does_not_parse_is_not_the_requests_fault():
    from jinja2.exceptions import TemplateSyntaxError

    tok = tiny.build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}"   # no endfor
    with pytest.raises(TemplateSyntaxError):
        chat_api.prompt_ids(tok, _req().messages)


def test_the_budget_caps_prompt_plus_completion_to_max_model_len():
    assert chat_api.completion_budget(10, 32, 100) == 32
    assert chat_api.completion_budget(90, 32, 100) == 10
    assert chat_api.completion_budget(10, None, 100) == 90   # none asked: the rest of the context
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.completion_budget(100, 32, 100, "prompt")
    assert e.value.status == 400 and e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    assert "the prompt is 100 tokens and max_model_len is 100" in e.value.message


COMPLETION = chat_api.CompletionRequest


@pytest.mark.parametrize("body, model, param, message", [
    ({"model": "m", "messages": []}, None, "messages", "at least 1 item"),
    ({"model": "m"}, None, "messages", "Field required"),
    ({"model": "m", "messages": HELLO, "max_tokens": 0}, None, "max_tokens", "greater than or equal to 1"),
    ({"model": "m", "messages": HELLO, "max_completion_tokens": -1}, None, "max_completion_tokens", "greater than"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, None, "messages.0.role", "'system', 'user'"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None,
     "messages.0.content", "only text parts"),
    ({"model": "m", "messages": HELLO, "n": 2}, None, "n", "exactly one choice"),
    ({"model": "m", "messages": HELLO, "logprobs": True}, None, "logprobs", "leave logprobs unset"),
    ({"model": "m", "messages": HELLO, "temperature": 2.5}, None, "temperature", "less than or equal to 2"),
    ({"model": "m", "messages": HELLO, "top_p": 0}, None, "top_p", "greater than 0"),
    ({"model": "m", "messages": HELLO, "seed": 2 ** 63}, None, "seed", "less than"),
    ({"model": "m", "messages": HELLO, "stop": list("abcde")}, None, "stop", "at most 4 stop sequences, got 5"),
    ({"model": "m", "messages": HELLO, "stop": ["a", ""]}, None, "stop.1", "at least 1 character"),
    ({"model": "m", "messages": HELLO, "stop": 7}, None, "stop", "valid tuple"),
    ({"model": "m", "messages": HELLO, "stream_options": {"include_usage": True}}, None, "stream_options",
     "only allowed with \"stream\": true"),
    ({"model": "m", "messages": HELLO, "stream": "sometimes"}, None, "stream", "valid boolean"),
    ({"model": 7, "messages": HELLO}, None, "model", "valid string"),
    ([1, 2], None, "body", "valid dictionary"),
    (None, None, "body", "valid dictionary"),
    ({"model": "m"}, COMPLETION, "prompt", "Field required"),
    ({"model": "m", "prompt": ["a", "b"]}, COMPLETION, "prompt", "one prompt string per request"),
    ({"model": "m", "prompt": [1, 2, 3]}, COMPLETION, "prompt", "one prompt string per request"),
    ({"model": "m", "prompt": "a", "echo": True}, COMPLETION, "echo", "echo is not supported"),
    ({"model": "m", "prompt": "a", "best_of": 3}, COMPLETION, "best_of", "best_of=3"),
    ({"model": "m", "prompt": "a", "suffix": "z"}, COMPLETION, "suffix", "suffix"),
    ({"model": "m", "prompt": "a", "logprobs": 2}, COMPLETION, "logprobs", "logprobs"),
])
def test_a_bad_body_is_a_400_naming_the_field(body, model, param, message):
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.parse_request(body, model or chat_api.ChatRequest)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    assert message in err["message"], err["message"]


def test_requests_take_what_clients_send():
    req = chat_api.parse_request({"model": "m", "stop": "###", "max_completion_tokens": 5, "stream": True,
                                  "stream_options": {"include_usage": True}, "tools": [], "user": "u",
                                  "messages": [{"role": "developer", "content": "be brief"},
                                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}]})
    assert [m.model_dump() for m in req.messages] == [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "a\nb"}]
    assert (req.stop, req.requested_tokens(64), req.include_usage) == (("###",), 5, True)
    assert chat_api.parse_request({"model": "m", "messages": HELLO, "stop": None}).stop == ()
    assert chat_api.parse_request({"model": "m", "messages": HELLO, "max_tokens": 3}).requested_tokens(64) == 3
    text = chat_api.parse_request({"model": "m", "prompt": ["once upon"], "stop": ["a", "b"]}, COMPLETION)
    assert (text.prompt, text.stop, text.requested_tokens(64), text.include_usage) == ("once upon", ("a", "b"), 64, False)
    assert text.requested_tokens(None) is None


def _modelless_engine(tokenizer, max_tokens_default: int | None = None, max_model_len: int = 100):
    """An Engine without a model: its submit returns (prompt tokens, completion budget) it would queue."""
    engine = serveapp.Engine.__new__(serveapp.Engine)
    engine.tokenizer, engine.max_model_len, engine.max_tokens_default = tokenizer, max_model_len, max_tokens_default
    engine.model_id, engine.adapters = MODEL_ID, None
    engine.process = SimpleNamespace(submit=lambda ids, budget, *rest: (len(ids), budget))
    return engine


def _budget(max_tokens_default: int | None, **kw) -> tuple[int, int]:
    return _modelless_engine(tiny.build_tokenizer(), max_tokens_default).submit(_req(**kw))


def test_a_request_without_max_tokens_gets_the_rest_of_the_context_unless_the_server_sets_a_default():
    prompt, budget = _budget(None)
    assert budget == 100 - prompt and budget > 64
    assert _budget(16)[1] == 16                                   # the server's configured default
    assert _budget(None, max_tokens=5)[1] == _budget(16, max_completion_tokens=5)[1] == 5
    assert _budget(16, max_tokens=500)[1] == 100 - prompt           # what was asked, capped by the context


@pytest.mark.parametrize("text, stops, final, shown, hit", [
    (" Paris", (), True, " Paris", False),         # as generated: a completion's leading space stays
    (" a b ", (), False, " a b", False),           # trailing whitespace waits: punctuation may absorb it
    (" a b ", (), True, " a b ", False),
    ("a b ##", ("###",), False, "a b", False),     # "##" may become the stop: held back
    ("a b ##", ("###",), True, "a b ##", False),
    ("a b ### c", ("###", "c"), False, "a b ", True),   # cut before the first stop, whichever it is
    ("c a ###", ("###", "c"), True, "", True),
    ("caf\ufffd", (), False, "caf", False),       # half a character waits for its other bytes
    ("a \ufffd", (), False, "a", False),
])
def test_visible_text_is_cut_at_a_stop_and_holds_back_what_may_change(text, stops, final, shown, hit):
    assert chat_api.visible(text, stops, final) == (shown, hit)


@pytest.mark.parametrize("decoded, stops", [
    ([" The", " The capital", " The capital is", " The capital is Paris"], ()),
    (["Hello", "Hello ", "Hello.", "Hello. Bye"], ()),      # a clean-up that drops a space before "."
    (["caf\ufffd", "café", "café\n", "café\n\n", "café\n\n##"], ("\n\n###",)),
])
def test_every_text_a_stream_shows_is_the_start_of_the_whole_answer(decoded, stops):
    """The decoded text after each token: what `visible` shows before the end is always a prefix of
    what it shows at the end, which is the text as generated."""
    final, _ = chat_api.visible(decoded[-1], stops, final=True)
    assert final == decoded[-1]
    for text in decoded[:-1]:
        shown, _ = chat_api.visible(text, stops, final=False)
        assert final.startswith(shown), (text, shown)


def test_a_wrong_model_is_a_404_naming_the_served_one():
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.check_model("gpt-4", MODEL_ID)
    assert e.value.status == 404 and e.value.body()["error"]["code"] == "model_not_found"
    assert f"serves '{MODEL_ID}'" in e.value.message


def test_the_responses_have_openais_shape_and_counts():
    answer = chat_api.Answer("a b", "stop", 5, 3)
    done = chat_api.response(chat_api.Endpoint.CHAT, "m", answer, now=1000.0)
    assert done["object"] == "chat.completion" and done["id"].startswith("chatcmpl-") and done["created"] == 1000
    assert done["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "a b"}, "finish_reason": "stop"}]
    assert done["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    text = chat_api.response(chat_api.Endpoint.TEXT, "m", answer)
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-") and text["usage"] == done["usage"]
    assert text["choices"] == [{"index": 0, "text": "a b", "logprobs": None, "finish_reason": "stop"}]
    assert chat_api.models_list("m") == {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "tpufinetune"}]}


def _events(sse: str) -> list:
    """The data of each server-sent event, JSON decoded ("[DONE]" as is)."""
    assert sse.endswith("\n\n") and all(block.startswith("data: ") for block in sse[:-2].split("\n\n")), sse
    return [d if d == "[DONE]" else json.loads(d) for d in (b[6:] for b in sse[:-2].split("\n\n"))]


def test_the_chunks_have_openais_stream_format():
    answer = chat_api.Answer("a b", "length", 5, 2)
    chat = chat_api.Chunks(chat_api.Endpoint.CHAT, "m", include_usage=True, now=1000.0)
    first, a, b, last, usage, done = _events(chat.start() + chat.text("a") + chat.text(" b") + chat.end(answer))
    assert {c["id"] for c in (first, a, b, last, usage)} == {first["id"]} and first["id"].startswith("chatcmpl-")
    assert {(c["object"], c["created"], c["model"]) for c in (first, a, last, usage)} == {("chat.completion.chunk", 1000, "m")}
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    assert [c["choices"][0]["delta"] for c in (a, b, last)] == [{"content": "a"}, {"content": " b"}, {}]
    assert last["choices"][0]["finish_reason"] == "length" and {a["usage"], last["usage"]} == {None}
    assert (usage["choices"], usage["usage"], done) == ([], answer.usage(), "[DONE]")

    text = chat_api.Chunks(chat_api.Endpoint.TEXT, "m", include_usage=False)
    assert text.start() == ""
    a, last, done = _events(text.text("a") + text.end(answer))
    assert a["object"] == "text_completion" and "usage" not in a and done == "[DONE]"
    assert [c["choices"] for c in (a, last)] == [[{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
                                                  [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]]
    error, done = _events(chat_api.Chunks.error(chat_api.ApiError(500, "boom", None)))
    assert error["error"]["message"] == "boom" and error["error"]["type"] == "server_error" and done == "[DONE]"


@pytest.mark.parametrize("authorization, code", [
    (None, None), ("", None), ("Bearer", None), ("Bearer   ", None), (f"Basic {KEY}", None),   # no key given
    ("Bearer sk-wrong", "invalid_api_key"), (f"Bearer {KEY}x", "invalid_api_key"), (f"Bearer {KEY[:-1]}", "invalid_api_key"),
])
def test_a_missing_or_wrong_api_key_is_openais_401(authorization, code):
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.check_api_key(authorization, KEY)
    assert e.value.status == 401
    assert e.value.body() == {"error": {"message": e.value.message, "type": "invalid_request_error",
                                        "param": None, "code": code}}
    assert e.value.message.startswith("Incorrect API key provided" if code else "You didn't provide an API key")
    assert "spec.serve.apiKeySecret" in e.value.message and KEY not in e.value.message


@pytest.mark.parametrize("authorization", [f"Bearer {KEY}", f"bearer {KEY}", f"  Bearer  {KEY} "])
def test_the_right_api_key_passes_and_no_key_set_leaves_it_open(authorization):
    chat_api.check_api_key(authorization, KEY)
    for sent in (None, authorization, "Bearer anything"):
        chat_api.check_api_key(sent, "")


def test_the_replica_reads_its_api_key_from_its_environment(monkeypatch):
    monkeypatch.delenv(SERVE_API_KEY_ENV, raising=False)
    assert serveapp.replica_api_key() == ""
    monkeypatch.setenv(SERVE_API_KEY_ENV, f"{KEY}\n")   # a Secret made from a file often ends in a newline
    assert serveapp.replica_api_key() == KEY


# --- the engine, no Ray --------------------------------------------------------------------

def test_greedy_is_deterministic_stops_at_the_budget_and_is_what_generate_gives(engine, export):
    import torch

    a, b = (_answer(engine, _req(max_tokens=12, temperature=0)) for _ in range(2))
    ids = chat_api.prompt_ids(engine.tokenizer, _req().messages)
    assert a.text and a == b and a.prompt_tokens == len(ids) and a.completion_tokens <= 12
    assert (a.finish_reason == "length") == (a.completion_tokens == 12)
    # the batcher's hooks change nothing for a greedy row: the model's own generate() says the same
    loaded = engine_process.load(export)   # the model as the engine's process loads it
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=loaded.pad_id)
    assert engine.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True) == a.text


def test_sampling_with_a_seed_is_reproducible(engine):
    runs = [_answer(engine, _req(max_tokens=12, temperature=1.0, seed=s)).text for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_stop_sequence_cuts_the_text_before_it_and_finishes_stop(engine):
    whole = _answer(engine, _req(max_tokens=12, temperature=0))
    words = whole.text.split()
    cut = _answer(engine, _req(max_tokens=12, temperature=0, stop=["no such text", f" {words[2]}"]))
    assert (cut.text, cut.finish_reason) == (" ".join(words[:2]), "stop")
    assert cut.completion_tokens < whole.completion_tokens   # generation ended there, not at the budget


def test_max_model_len_caps_the_completion(export):
    prompt = len(chat_api.prompt_ids(tiny.build_tokenizer(), _req().messages))
    small = serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": MODEL_ID,
                                                 "max_model_len": prompt + 3}))
    try:
        done = _answer(small, _req(max_tokens=50, temperature=0))
        assert done.prompt_tokens + done.completion_tokens <= prompt + 3
        with pytest.raises(chat_api.ApiError, match="no room for a completion; shorten the messages"):
            small.submit(_req(messages=HELLO * 3))
    finally:
        small.close()


# --- the HTTP app, no Ray: requests straight into its ASGI interface --------------------------

async def _acall(app, method: str, path: str, authorization: str | None = None, body: dict | None = None,
                 raw: bytes | None = None):
    """(status, headers, body) of one request to an ASGI app: the body JSON decoded, or as text
    when it is an event stream."""
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json")] + (
        [(b"authorization", authorization.encode())] if authorization is not None else [])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": data, "more_body": False}]
    finished = asyncio.Event()

    async def receive():
        if incoming:
            return incoming.pop(0)
        await finished.wait()   # a client that stays connected until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            finished.set()
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    return start["status"], headers, text if headers["content-type"].startswith("text/event-stream") else json.loads(text)


def _call(app, *args, **kwargs):
    return asyncio.run(_acall(app, *args, **kwargs))


def _app(engine, api_key: str = ""):
    return serveapp.make_api(engine, serveapp.parse_args({"model_source": "gs://unused", "model_id": MODEL_ID}), api_key)


def test_with_an_api_key_the_openai_routes_need_it_and_healthz_stays_open(engine):
    app = _app(engine, KEY)
    for sent, code in ((None, None), ("Bearer sk-wrong", "invalid_api_key")):
        for method, path in (("GET", SERVE_MODELS_PATH), ("POST", SERVE_CHAT_PATH), ("POST", SERVE_COMPLETIONS_PATH),
                             ("GET", "/v1/nope")):
            status, headers, body = _call(app, method, path, sent, {"model": MODEL_ID, "messages": HELLO})
            assert (status, body["error"]["code"], headers["www-authenticate"]) == (401, code, "Bearer"), path
    assert _call(app, "GET", "/healthz")[:3:2] == (200, {"status": "ok", "model": MODEL_ID})
    status, _, models = _call(app, "GET", SERVE_MODELS_PATH, f"Bearer {KEY}")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_ID]
    status, _, done = _call(app, "POST", SERVE_CHAT_PATH, f"Bearer {KEY}",
                            {"model": MODEL_ID, "messages": HELLO, "max_tokens": 2, "temperature": 0})
    assert status == 200 and done["object"] == "chat.completion"


def test_without_an_api_key_the_app_is_open(engine):
    app = _app(engine)
    status, _, models = _call(app, "GET", SERVE_MODELS_PATH)
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_ID]


@pytest.mark.parametrize("path, body, status, code", [
    (SERVE_CHAT_PATH, {"model": "other", "messages": HELLO}, 404, "model_not_found"),
    (SERVE_COMPLETIONS_PATH, {"model": "other", "prompt": "hi"}, 404, "model_not_found"),
    (SERVE_CHAT_PATH, {"model": MODEL_ID, "messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
    (SERVE_COMPLETIONS_PATH, {"model": MODEL_ID, "prompt": LONG, "stream": True}, 400, "context_length_exceeded"),
    (SERVE_CHAT_PATH, {"model": MODEL_ID, "messages": HELLO, "n": 3, "stream": True}, 400, "unsupported_value"),
    (SERVE_COMPLETIONS_PATH, {"model": MODEL_ID, "messages": HELLO}, 400, "invalid_value"),   # no prompt
    (SERVE_CHAT_PATH, {"model": MODEL_ID, "messages": HELLO, "stop": [None]}, 400, "invalid_value"),
    (SERVE_CHAT_PATH, b"{", 400, "invalid_json"),
    (SERVE_COMPLETIONS_PATH, b"\xff\xfe", 400, "invalid_json"),
    (SERVE_CHAT_PATH, b"", 400, "invalid_value"),
])
def test_bad_input_is_a_4xx_in_openais_shape_never_a_500(engine, path, body, status, code):
    raw = body if isinstance(body, bytes) else None
    got, _, answer = _call(_app(engine), "POST", path, body=None if raw is not None else body, raw=raw)
    assert (got, answer["error"]["code"], answer["error"]["type"]) == (status, code, "invalid_request_error"), answer
    if code == "context_length_exceeded":
        assert f"max_model_len is {engine.max_model_len}" in answer["error"]["message"]


def test_messages_the_chat_template_refuses_are_a_400_over_http_not_a_500():
    system = [{"role": "system", "content": "be brief"}, *HELLO]
    status, _, answer = _call(_app(_modelless_engine(_gemma_tokenizer())), "POST", SERVE_CHAT_PATH,
                              body={"model": MODEL_ID, "messages": system, "stream": True})
    err = answer["error"]
    assert (status, err["type"], err["param"], err["code"]) == (400, "invalid_request_error", "messages",
                                                                 "invalid_value"), answer
    assert "System role not supported" in err["message"]


@pytest.mark.parametrize("path, body", [
    (SERVE_CHAT_PATH, {"messages": HELLO}),
    (SERVE_COMPLETIONS_PATH, {"prompt": "### Instruction:\nWhat is a dog?\n\n### Response:\n"}),
])
def test_a_streamed_answer_is_the_whole_answer_in_openais_chunks(engine, path, body):
    app, endpoint = _app(engine), chat_api.Endpoint.CHAT if path == SERVE_CHAT_PATH else chat_api.Endpoint.TEXT
    body = {"model": MODEL_ID, "max_tokens": 10, "temperature": 0, **body}
    status, _, whole = _call(app, "POST", path, body=body)
    assert status == 200 and whole["object"] == endpoint.obj and whole["usage"]["completion_tokens"] >= 1
    status, headers, sse = _call(app, "POST", path, body={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = _events(sse)
    assert done == "[DONE]" and usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert {c["object"] for c in chunks} == {endpoint.chunk} and len({c["id"] for c in chunks}) == 1
    choices = [c["choices"][0] for c in chunks]
    if endpoint is chat_api.Endpoint.CHAT:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["text"] for c in choices)
        assert text == whole["choices"][0]["text"]
    assert len(choices) > 3   # token by token, not one chunk
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [whole["choices"][0]["finish_reason"]]
    # without include_usage: no usage chunk, no usage key
    *chunks, done = _events(_call(app, "POST", path, body={**body, "stream": True})[2])
    assert done == "[DONE]" and chunks[-1]["choices"] and all("usage" not in c for c in chunks)


def test_requests_join_a_running_batch_and_answer_as_alone(engine):
    """Continuous batching: four requests sent while a longer one decodes join it at its next steps,
    end before it (their rows leave, its padding is cut) and, like it, answer what they answer alone."""
    app = _app(engine)
    prompts = ["What is a dog?", "Name three colors.", "Why is the sky blue?", "Write a haiku about rain."]
    bodies = [{"model": MODEL_ID, "messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0}
              for p in prompts]
    long = {**bodies[3], "max_tokens": 64}
    alone = [_call(app, "POST", SERVE_CHAT_PATH, body=b)[2]["choices"] for b in bodies]
    long_alone = _call(app, "POST", SERVE_CHAT_PATH, body=long)[2]["choices"]
    assert engine.process.continuous
    before = len(engine.process.batch_sizes())

    async def together():
        plug = asyncio.create_task(_acall(app, "POST", SERVE_CHAT_PATH, body=long))
        while len(engine.process.batch_sizes()) == before:
            await asyncio.sleep(0.001)
        answers = await asyncio.gather(*(_acall(app, "POST", SERVE_CHAT_PATH, body=b) for b in bodies))
        return [a[2]["choices"] for a in answers], (await plug)[2]["choices"]
    answers, long_answer = asyncio.run(together())
    assert answers == alone and long_answer == long_alone
    sizes = engine.process.batch_sizes()[before:]
    assert sizes[0] == 1 and max(sizes) == 5   # all four rode beside the long one


def test_a_dead_engine_process_fails_its_requests_with_a_500_and_the_health_check(export):
    """The model's process killed under a request (the kernel's OOM killer, say): that request and every
    later one get OpenAI's 500, and the replica's health check fails so Serve replaces the replica."""
    dying = serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": MODEL_ID}))
    app, body = _app(dying), {"model": MODEL_ID, "messages": HELLO, "max_tokens": 8, "temperature": 0}
    dying.check_health()
    os.kill(dying.process.pid, signal.SIGSTOP)   # the request below is surely pending when it dies

    async def killed_under_a_request():
        request = asyncio.create_task(_acall(app, "POST", SERVE_CHAT_PATH, body=body))
        for _ in range(500):
            if dying.process._pending:
                break
            await asyncio.sleep(0.01)
        os.kill(dying.process.pid, signal.SIGKILL)
        return await request
    try:
        for status, _, error in (asyncio.run(killed_under_a_request()), _call(app, "POST", SERVE_CHAT_PATH, body=body)):
            assert status == 500 and error["error"]["message"] == (
                "generation failed: the engine process exited with code -9"), error
        with pytest.raises(RuntimeError, match="the engine process exited with code -9"):
            dying.check_health()
    finally:
        dying.close()


# --- end to end under local Ray Serve --------------------------------------------------------

@pytest.fixture(scope="module")
def served(ray_cluster, export):
    """The app under SERVE_APP_NAME at route prefix "/", Serve's proxy on 127.0.0.1:<free port>; its
    replica has the API key in its environment, as the operator puts it on a serving pod."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = serveapp.parse_args({"model_source": export, "model_id": MODEL_ID, "max_tokens_default": 16})
    keyed = serveapp.ChatDeployment.options(
        ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": {SERVE_API_KEY_ENV: KEY}}})
    try:
        serve.run(keyed.bind(args), name=SERVE_APP_NAME, route_prefix=serveapp.ROUTE_PREFIX)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_app_answers_openai_requests_under_ray_serve(served):
    """With the replica's API key (from its environment): refused without it, answered with it;
    streamed through Serve's proxy as the official SDK asks (stream=True, a Bearer key), concurrent
    requests batched in the replica."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from ray import serve

    assert list(serve.status().applications[SERVE_APP_NAME].deployments) == [SERVE_DEPLOYMENT_NAME]
    for headers, code in (({}, None), ({"Authorization": "Bearer sk-wrong"}, "invalid_api_key")):
        refused = requests.get(served + SERVE_MODELS_PATH, headers=headers, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == code, refused.text
    assert requests.get(served + "/healthz", timeout=30).status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    models = requests.get(served + SERVE_MODELS_PATH, headers=auth, timeout=30)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL_ID]

    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 8, "temperature": 0}
    first, second = (requests.post(served + SERVE_CHAT_PATH, json=body, headers=auth, timeout=60) for _ in range(2))
    assert first.status_code == 200, first.text
    done = first.json()
    usage = done["usage"]
    assert done["object"] == "chat.completion" and done["model"] == MODEL_ID
    assert done["choices"][0]["message"]["content"].strip()
    assert 1 <= usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert second.json()["choices"] == done["choices"]   # greedy: the same text twice

    wrong = requests.post(served + SERVE_CHAT_PATH, json={**body, "model": "other"}, headers=auth, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    garbage = requests.post(served + SERVE_CHAT_PATH, data=b"{", headers=auth, timeout=30)
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_json"

    # the openai SDK's request: its JSON body with stream true, Bearer key, Accept application/json
    sdk = {**auth, "Accept": "application/json", "User-Agent": "OpenAI/Python 2.0.0", "X-Stainless-Lang": "python"}
    with requests.post(served + SERVE_CHAT_PATH, headers=sdk, stream=True, timeout=60,
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in streamed.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        done["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == usage and len(chunks) > 3

    text = requests.post(served + SERVE_COMPLETIONS_PATH, headers=auth, timeout=60,
                         json={"model": MODEL_ID, "prompt": "The dog", "max_tokens": 4, "temperature": 0})
    assert text.status_code == 200 and text.json()["object"] == "text_completion", text.text

    # 8 at once: all reach the replica (max_ongoing_requests), and greedy answers do not depend on the batch
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda _: requests.post(served + SERVE_CHAT_PATH, json=body, headers=auth,
                                                         timeout=60), range(8)))
    assert [r.status_code for r in together] == [200] * 8
    assert {r.json()["choices"][0]["message"]["content"] for r in together} == {done["choices"][0]["message"]["content"]}

    # the operator's client against the real app
    assert chat.chat(served, MODEL_ID, HELLO[0]["content"], max_tokens=8,
                     api_key=KEY) == done["choices"][0]["message"]["content"]
    assert "".join(chat.chat_stream(served, MODEL_ID, HELLO[0]["content"], max_tokens=8,
                                    api_key=KEY)) == done["choices"][0]["message"]["content"]
    assert [m["id"] for m in chat.models(served, api_key=KEY)] == [MODEL_ID]
    with pytest.raises(chat.ChatError) as e:
        chat.chat(served, "other", "hi", api_key=KEY)
    assert e.value.status == 404 and f"serves '{MODEL_ID}'" in e.value.message
    with pytest.raises(chat.ChatError) as e:
        chat.chat(served, MODEL_ID, "hi")
    assert e.value.status == 401 and e.value.message.startswith("You didn't provide an API key")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_official_openai_sdk_is_a_client_of_the_app(served):
    """The `openai` package, as a user points it at the served model (base_url, api_key): models,
    chat whole and streamed (the same greedy text), completions, and each refusal as the SDK's own
    exception class."""
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL_ID]

    whole = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.model == MODEL_ID and text.strip()
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert 1 <= whole.usage.completion_tokens <= 8

    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # max_completion_tokens (the newer name) caps the same way
    capped = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_completion_tokens=2, temperature=0)
    assert capped.usage.completion_tokens <= 2 and text.startswith(capped.choices[0].message.content)

    done = client.completions.create(model=MODEL_ID, prompt="The dog", max_tokens=4, temperature=0)
    streamed = client.completions.create(model=MODEL_ID, prompt="The dog", max_tokens=4, temperature=0, stream=True)
    assert done.object == "text_completion" and done.usage.completion_tokens >= 1
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    sampled = [client.completions.create(model=MODEL_ID, prompt="The dog", max_tokens=4, temperature=0.9,
                                         top_p=0.9, seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]   # a seed makes sampling reproducible

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=HELLO, n=2)
    assert e.value.status_code == 400 and e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=LONG, stream=True)
    assert e.value.code == "context_length_exceeded" and "max_model_len is" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="other", messages=HELLO)
    assert e.value.code == "model_not_found" and MODEL_ID in e.value.message
    wrong = openai.OpenAI(base_url=served + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    for call in (wrong.models.list, lambda: wrong.chat.completions.create(model=MODEL_ID, messages=HELLO, stream=True),
                 lambda: wrong.completions.create(model=MODEL_ID, prompt="hi")):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        assert e.value.code == "invalid_api_key"
