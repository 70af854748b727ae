"""tpuft_workload.serve and tpuft_workload.chat_api on the tiny model's Hugging Face export (written by
checkpoint.export_hf, as training writes it): the pure rules and the engine without Ray, then the
application end to end under a local Ray Serve on 127.0.0.1 (with tpuft.chat as the client)."""
from __future__ import annotations

import socket

import pytest
import yaml

from tests.paths import EXAMPLES
from tpuft import builders, chat
from tpuft.constants import (SERVE_APP_NAME, SERVE_CHAT_PATH, SERVE_DEPLOYMENT_NAME, SERVE_MODELS_PATH,
                             SERVE_TRANSFORMERS_IMPORT_PATH, ServeArg)
from tpuft.spec import parse
from tpuft_workload import chat_api, checkpoint, data, serve as serveapp, tiny

MODEL_ID = "tiny-finetuned"
HELLO = [{"role": "user", "content": "What is a dog?"}]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> str:
    tok = tiny.build_tokenizer()
    dest = str(tmp_path_factory.mktemp("serve") / "export")
    # seed 0: this untrained model's greedy reply to HELLO does not start with EOS (non-empty text)
    assert checkpoint.export_hf(tiny.build_model(len(tok), seed=0), tok, dest, rank=0) == dest
    return dest


@pytest.fixture(scope="module")
def engine(export):
    return serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": MODEL_ID}))


def _req(**kw) -> chat_api.ChatRequest:
    return chat_api.parse_request({"model": MODEL_ID, "messages": HELLO, **kw})


# --- args ----------------------------------------------------------------------------------

def test_the_import_path_the_operator_writes_builds_the_app(export):
    import importlib

    from ray.serve import Application

    module, _, attr = SERVE_TRANSFORMERS_IMPORT_PATH.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert builder is serveapp.build_app
    assert isinstance(builder({"model_source": export, "model_id": MODEL_ID}), Application)   # bind: no Ray needed


def test_the_operators_serve_config_is_what_build_app_accepts(export):
    """tpuft.builders' transformers application (the local CPU example serves): its args parse here
    (the export path swapped for this test's) and its deployment is this one."""
    doc = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    doc["metadata"]["uid"] = "u-1"
    svc = builders.build_rayservice(parse(doc), model_source=export)
    app = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]
    assert (app["name"], app["import_path"], app["route_prefix"]) == (SERVE_APP_NAME, serveapp.IMPORT_PATH,
                                                                     serveapp.ROUTE_PREFIX)
    assert [d["name"] for d in app["deployments"]] == [serveapp.DEPLOYMENT_NAME]
    assert serveapp.parse_args(app["args"]) == serveapp.ServeArgs(
        export, doc["metadata"]["name"], doc["spec"]["serve"]["maxModelLength"], serveapp.MAX_TOKENS_DEFAULT)


def test_args_are_parsed_with_defaults(export):
    args = serveapp.parse_args({"model_source": export, "model_id": MODEL_ID})
    assert args == serveapp.ServeArgs(export, MODEL_ID, None, serveapp.MAX_TOKENS_DEFAULT)
    assert serveapp.parse_args({"model_source": export, "model_id": "m", "max_model_len": 256,
                                "max_tokens_default": 8}).max_model_len == 256
    assert {a.value for a in ServeArg} == {f for f in serveapp.ServeArgs.__dataclass_fields__}


@pytest.mark.parametrize("args, message", [
    ({"model_id": "m"}, "serve arg model_source is required"),
    ({"model_source": "X", "model_id": ""}, "serve arg model_id is required"),
    ({"model_source": "X", "model_id": "m", "max_model_len": 0}, "max_model_len=0: must be a positive integer"),
    ({"model_source": "X", "model_id": "m", "max_tokens_default": "64"}, "max_tokens_default='64'"),
    ({"model_source": "X", "model_id": "m", "max_model_length": 9}, "unknown serve arg(s) max_model_length"),
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
    config = engine.model.config
    assert engine.max_model_len == serveapp.model_len(None, config) == config.max_position_embeddings
    assert serveapp.model_len(128, config) == 128
    with pytest.raises(serveapp.ServeArgsError, match="exceeds the model's max_position_embeddings"):
        serveapp.model_len(config.max_position_embeddings + 1, config)


# --- chat_api: prompts, budget, errors, response -------------------------------------------

def test_the_tiny_tokenizer_renders_a_user_message_as_training_rendered_an_instruction(engine):
    tok = engine.tokenizer   # the export's: the chat template travelled through save_pretrained
    assert tok.chat_template == tiny.CHAT_TEMPLATE
    ids = chat_api.prompt_ids(tok, _req().messages)
    assert ids == tok(data.format_prompt({"instruction": HELLO[0]["content"]}))["input_ids"]


def test_a_tokenizer_without_a_template_gets_role_lines_and_an_assistant_cue(engine):
    messages = chat_api.parse_request({"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}).messages
    assert chat_api.fallback_prompt(messages) == "system: be brief\nuser: hi\nassistant:"
    tok = tiny.build_tokenizer()
    tok.chat_template = None
    assert chat_api.prompt_ids(tok, messages) == tok("system: be brief\nuser: hi\nassistant:")["input_ids"]


def test_the_budget_caps_prompt_plus_completion_to_max_model_len():
    assert chat_api.completion_budget(10, 32, 100) == 32
    assert chat_api.completion_budget(90, 32, 100) == 10
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.completion_budget(100, 32, 100)
    assert e.value.status == 400 and "the prompt is 100 tokens and max_model_len is 100" in e.value.message


@pytest.mark.parametrize("body, param, message", [
    ({"model": "m", "messages": []}, "messages", "at least 1 item"),
    ({"model": "m"}, "messages", "Field required"),
    ({"model": "m", "messages": HELLO, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'system', 'user'"),
    ({"model": "m", "messages": HELLO, "stream": True}, "stream", "streaming is not supported by the transformers engine"),
    ({"model": "m", "messages": HELLO, "n": 2}, "n", "exactly one choice"),
    ([1, 2], "body", "valid dictionary"),
])
def test_a_bad_body_is_a_400_naming_the_field(body, param, message):
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.parse_request(body)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    assert message in err["message"]


def test_a_wrong_model_is_a_404_naming_the_served_one():
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.check_model("gpt-4", MODEL_ID)
    assert e.value.status == 404 and e.value.body()["error"]["code"] == "model_not_found"
    assert f"serves '{MODEL_ID}'" in e.value.message


def test_the_completion_has_openais_shape_and_counts():
    done = chat_api.completion("m", "a b", 5, [7, 8, 3], {3}, now=1000.0).model_dump()
    assert done["object"] == "chat.completion" and done["id"].startswith("chatcmpl-") and done["created"] == 1000
    assert done["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "a b"}, "finish_reason": "stop"}]
    assert done["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert chat_api.completion("m", "a", 5, [7, 8], {3}).choices[0].finish_reason == "length"
    assert chat_api.models_list("m") == {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "tpufinetune"}]}


# --- the engine, no Ray --------------------------------------------------------------------

def test_greedy_is_deterministic_and_stops_at_the_budget(engine):
    a, b = (engine.chat(_req(max_tokens=12, temperature=0), MODEL_ID, 64) for _ in range(2))
    assert a.choices[0].message.content and a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 12 and a.usage.prompt_tokens == len(chat_api.prompt_ids(engine.tokenizer, _req().messages))
    assert (a.choices[0].finish_reason == "length") == (a.usage.completion_tokens == 12)


def test_sampling_with_a_seed_is_reproducible(engine):
    runs = [engine.chat(_req(max_tokens=12, temperature=1.0, seed=s), MODEL_ID, 64).choices[0].message.content
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_max_model_len_caps_the_completion(export):
    prompt = len(chat_api.prompt_ids(tiny.build_tokenizer(), _req().messages))
    small = serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": MODEL_ID,
                                                 "max_model_len": prompt + 3}))
    done = small.chat(_req(max_tokens=50, temperature=0), MODEL_ID, 64)
    assert done.usage.total_tokens <= prompt + 3
    with pytest.raises(chat_api.ApiError, match="no room for a completion"):
        serveapp.Engine.chat(small, _req(messages=HELLO * 3), MODEL_ID, 64)


# --- end to end under local Ray Serve --------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_cluster, export):
    """The app under SERVE_APP_NAME at route prefix "/", Serve's proxy on 127.0.0.1:<free port>."""
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(serveapp.build_app({"model_source": export, "model_id": MODEL_ID, "max_tokens_default": 16}),
                  name=SERVE_APP_NAME, route_prefix=serveapp.ROUTE_PREFIX)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_app_answers_openai_requests_under_ray_serve(served):
    import requests

    from ray import serve

    assert list(serve.status().applications[SERVE_APP_NAME].deployments) == [SERVE_DEPLOYMENT_NAME]
    models = requests.get(served + SERVE_MODELS_PATH, timeout=30)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL_ID]

    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 8, "temperature": 0}
    first, second = (requests.post(served + SERVE_CHAT_PATH, json=body, timeout=60) for _ in range(2))
    assert first.status_code == 200, first.text
    done = first.json()
    usage = done["usage"]
    assert done["object"] == "chat.completion" and done["model"] == MODEL_ID
    assert done["choices"][0]["message"]["content"].strip()
    assert 1 <= usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert second.json()["choices"] == done["choices"]   # greedy: the same text twice

    wrong = requests.post(served + SERVE_CHAT_PATH, json={**body, "model": "other"}, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    stream = requests.post(served + SERVE_CHAT_PATH, json={**body, "stream": True}, timeout=30)
    assert stream.status_code == 400 and "streaming is not supported" in stream.json()["error"]["message"]
    garbage = requests.post(served + SERVE_CHAT_PATH, data=b"{", timeout=30)
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_json"

    # the operator's client against the real app
    assert chat.chat(served, MODEL_ID, HELLO[0]["content"], max_tokens=8) == done["choices"][0]["message"]["content"]
    with pytest.raises(chat.ChatError) as e:
        chat.chat(served, "other", "hi")
    assert e.value.status == 404 and f"serves '{MODEL_ID}'" in e.value.message
