"""tpuft_workload.adapters and the transformers engine serving LoRA adapters side by side on one base:
publish/unpublish on a local folder and on gs:// (fake-gcs-server), the LRU, per-adapter batching,
and the engine (serve.Engine with its engine process, no Ray) answering `base:a` as the base with
adapter a merged would, the base as the base, an adapter published after start without a restart,
and an unknown one as OpenAI's 404."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpuft.api.constants import SERVE_CHAT_PATH, SERVE_MODELS_PATH
from tpuft_workload import adapters, batching, chat_api, checkpoint, engine_process, serve as serveapp, tiny

REPO = Path(__file__).resolve().parents[2]
BASE_ID = "tiny-base"
HELLO = [{"role": "user", "content": "What is a dog?"}]
MAX_TOKENS = 8
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


# --- a tiny base and deterministic adapters on it --------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    tok = tiny.build_tokenizer()
    dest = str(tmp_path_factory.mktemp("adapters") / "base")
    checkpoint.export_hf(tiny.build_model(len(tok), seed=0), tok, dest, rank=0)
    return dest


def _peft(base: str, seed: int):
    """The base with one LoRA adapter whose lora_B is non-zero (seeded), so its outputs differ from the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)   # lora_A's initialisation
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8,
                                                                                 target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def make_adapter(base: str, dest: Path, seed: int) -> str:
    """An adapter export as tpuft_workload.lora writes one: adapter weights, tokenizer, generation config."""
    from transformers import AutoTokenizer, GenerationConfig

    model = _peft(base, seed)
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(str(dest))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(dest))
    GenerationConfig.from_pretrained(base).save_pretrained(str(dest))
    return str(dest)


def merged(base: str, adapter: str):
    """What serving a LoRA export alone gives: the base with the adapter merged (engine_process.load_causal_lm)."""
    import torch

    return engine_process.load_causal_lm(adapter, torch.float32).eval()


SEEDS = {"a": 1, "b": 2, "c": 3}


@pytest.fixture(scope="module")
def exports(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("exports")
    return {name: make_adapter(base, root / name, seed) for name, seed in SEEDS.items()}


def _publish(exports, root, name: str, uid: str | None = None) -> dict:
    return adapters.publish(exports[name], str(root), name, f"ns/ft-{name}", uid or f"uid-{name}", "fp-1", 0.5)


# --- publish / unpublish -------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpuft_workload", *args], capture_output=True, text=True,
                          timeout=120)


def test_publish_copies_the_export_and_writes_the_marker_through_the_cli(exports, tmp_path):
    root = tmp_path / "adapters"
    done = _cli("publish", "--export", exports["a"], "--adapters-root", str(root), "--name", "a",
                "--source", "ns/ft-a", "--uid", "u-1", "--eval-set", "fp-1", "--eval-loss", "0.25")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["published"] == str(root / "a") and line["uid"] == "u-1" and line["evalLoss"] == 0.25
    marker = json.loads((root / "a" / adapters.PUBLICATION).read_text())
    assert {k: v for k, v in marker.items() if k != "publishedAt"} == {
        "adapter": "a", "source": "ns/ft-a", "uid": "u-1", "evalLoss": 0.25, "evalSet": "fp-1"}
    assert sorted(p.name for p in (root / "a").iterdir()) == sorted(line["files"])
    assert [p.name for p in root.iterdir()] == ["a"]   # no staging copy left
    assert adapters.list_published(str(root))["a"].uid == "u-1"


def test_a_republication_replaces_the_folder_and_an_interrupted_copy_leaves_no_marker(exports, tmp_path, monkeypatch):
    root = tmp_path / "adapters"
    _publish(exports, root, "a", "u-1")
    _publish(exports, root, "a", "u-2")   # the same name again: replaced
    assert adapters.read_publication(str(root / "a")).uid == "u-2"
    assert [p.name for p in root.iterdir()] == ["a"]

    real = checkpoint.write_bytes

    def interrupted(uri, data, *a, **kw):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "write_bytes", interrupted)   # the marker is the last write
    with pytest.raises(adapters.PublishError, match=f"replacing {root / 'b'} failed"):
        _publish(exports, root, "b", "u-3")
    monkeypatch.setattr(checkpoint, "write_bytes", real)
    assert not (root / "b").exists() and not list(root.rglob(f"b*/{adapters.PUBLICATION}"))
    assert list(adapters.list_published(str(root))) == ["a"]   # the staging copy is never listed


def test_an_adapter_published_without_an_eval_set_is_listed(exports, tmp_path):
    """spec.publish.when always with no spec.evaluation: the operator passes --eval-set '' and the
    server still lists and serves the adapter."""
    root = tmp_path / "adapters"
    done = _cli("publish", "--export", exports["a"], "--adapters-root", str(root), "--name", "a",
                "--source", "ns/ft-a", "--uid", "u-1", "--eval-set", "")
    assert done.returncode == 0, done.stderr
    listed = adapters.list_published(str(root))
    assert list(listed) == ["a"] and listed["a"].eval_set is None and listed["a"].eval_loss is None


def test_unpublish_by_another_uid_deletes_nothing_and_says_whose_it_is(exports, tmp_path):
    root = tmp_path / "adapters"
    _publish(exports, root, "a", "u-1")
    done = _cli("unpublish", "--adapters-root", str(root), "--name", "a", "--uid", "u-other")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["unpublished"] is False and "published by ns/ft-a (uid u-1)" in line["reason"]
    assert (root / "a" / adapters.PUBLICATION).is_file()
    assert adapters.unpublish(str(root), "a", "u-1")["unpublished"] is True
    assert not (root / "a").exists() and adapters.list_published(str(root)) == {}


def test_the_rayjobs_the_operator_renders_publish_then_unpublish_through_these_commands(exports, tmp_path):
    """The operator's publish and unpublish RayJobs (builders, from examples/adapters-on-a-base.yaml)
    run exactly these commands: their entrypoints, run here, publish the fine-tune's export under the
    base's adapters root with its eval figures, then remove it by the fine-tune's uid."""
    import shlex

    import yaml

    from tpuft.controller import builders
    from tpuft.api.spec import parse

    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all((REPO / "examples/adapters-on-a-base.yaml").read_text())}
    for doc in docs.values():
        doc["metadata"].update(namespace="team-a", uid=f"uid-{doc['metadata']['name']}")
        doc["spec"]["checkpoint"]["storagePath"] = str(tmp_path / "ck")
    base, fine_tune = parse(docs["tiny-chat"]), parse(docs["facts-lora"])
    root = builders.adapters_root(base)
    job = builders.build_publish_job(fine_tune, base.meta.name, "tiny-chat-serve-raycluster-x", root, exports["a"],
                                     0.75, fine_tune.spec.eval_set)
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "tiny-chat-serve-raycluster-x"}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "tpuft_workload"]
    done = _cli(*argv[3:])
    assert done.returncode == 0, done.stderr
    marker = json.loads((Path(root) / "facts" / adapters.PUBLICATION).read_text())
    assert (marker["source"], marker["uid"], marker["evalLoss"]) == ("team-a/facts-lora", "uid-facts-lora", 0.75)
    assert marker["evalSet"] == fine_tune.spec.eval_set
    unpublish = builders.build_unpublish_job(base, "tiny-chat-serve-raycluster-x", "facts", "uid-facts-lora")
    done = _cli(*shlex.split(unpublish["spec"]["entrypoint"])[3:])
    assert done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1])["unpublished"] is True
    assert adapters.list_published(root) == {}


def test_bad_names_and_exports_are_refused_naming_them(exports, tmp_path):
    with pytest.raises(ValueError, match="adapter name 'Bad_Name' is not a DNS-1123 label"):
        _publish({"Bad_Name": exports["a"]}, tmp_path, "Bad_Name")
    with pytest.raises(adapters.PublishError, match=f"{tmp_path} is not a LoRA adapter export"):
        adapters.publish(str(tmp_path), str(tmp_path / "root"), "a", "ns/x", "u", "fp")
    done = _cli("publish", "--export", exports["a"], "--adapters-root", str(tmp_path), "--name", "a")
    assert done.returncode == 2 and "--source" in done.stderr


def test_publish_and_unpublish_on_gcs(gcs, exports, tmp_path, monkeypatch):
    monkeypatch.setenv("TPUFT_MODEL_CACHE", str(tmp_path / "cache"))   # the replica's copies of gs:// adapters
    root = gcs.path("runs", "base", "adapters")
    written = adapters.publish(exports["a"], root, "a", "ns/ft-a", "u-1", "fp-1", None)
    assert written["published"] == f"{root}/a"
    assert gcs.local("runs", "base", "adapters", "a", adapters.PUBLICATION).is_file()
    assert not list(gcs.local("runs", "base", "adapters").glob("a.staging-*/*"))
    assert {k: p.uid for k, p in adapters.list_published(root).items()} == {"a": "u-1"}
    adapters.publish(exports["b"], root, "a", "ns/ft-a2", "u-2", "fp-1", 0.1)   # replaced in place
    assert adapters.read_publication(f"{root}/a").source == "ns/ft-a2"
    local = adapters.local_folder(root, "a", "u-2")
    assert (Path(local) / "adapter_model.safetensors").read_bytes() == (
        Path(exports["b"]) / "adapter_model.safetensors").read_bytes()
    assert adapters.unpublish(root, "a", "u-1")["unpublished"] is False
    assert adapters.unpublish(root, "a", "u-2")["unpublished"] is True
    assert adapters.list_published(root) == {}


# --- the LRU and per-adapter batching (pure) -----------------------------------------------------

def test_the_lru_evicts_the_least_recently_used_and_reloads_a_new_uid():
    lru = adapters.Lru(2)
    assert lru.use("a", "1") == (True, []) and lru.use("b", "1") == (True, [])
    assert lru.use("a", "1") == (False, [])          # used again: now the most recent
    assert lru.use("c", "1") == (True, ["b"])        # b was the least recently used
    assert lru.use("a", "2") == (True, ["a"])        # republished: the old version goes
    assert lru.names == ["c", "a"]


def _job(adapter: str | None, seq: int) -> batching.Job:
    ref = None if adapter is None else adapters.AdapterRef(adapter, "u", "/x", frozenset({3}))
    return batching.Job([1], 4, batching.Sampling(0, 1, None), (), False, lambda e: None, adapter=ref, seq=seq)


def test_waiting_jobs_are_grouped_by_adapter_and_the_oldest_group_goes_first():
    waiting = batching.Waiting()
    for seq, adapter in enumerate(["a", "b", "a", None, "b"]):
        waiting.add(_job(adapter, seq))
    assert waiting.oldest_group() == ("a", "u")
    assert [j.seq for j in waiting.take(("a", "u"), 8)] == [0, 2]
    assert waiting.oldest_group() == ("b", "u") and waiting.others_waiting(("b", "u"))
    assert [j.seq for j in waiting.take(("b", "u"), 1)] == [1]
    assert waiting.oldest_group() is None and len(waiting) == 2   # the base (seq 3) before b's second


def test_an_adapters_stop_ids_are_its_generation_configs_turn_end_included(tmp_path):
    """Issue 59's rule per adapter: its folder's generation_config.json (the export puts the chat
    template's turn end there) decides where its answers stop; without one, its tokenizer's EOS."""
    from transformers import GenerationConfig

    tok = tiny.build_tokenizer()
    GenerationConfig(eos_token_id=[tok.eos_token_id, 7]).save_pretrained(str(tmp_path / "with"))
    assert adapters.stop_ids(str(tmp_path / "with"), tok, frozenset({99})) == {tok.eos_token_id, 7}
    (tmp_path / "without").mkdir()
    assert adapters.stop_ids(str(tmp_path / "without"), tok, frozenset({99})) == {tok.eos_token_id}


# --- the engine: numerics in process, then serve.Engine over its engine process ------------------

def _prompt(tokenizer) -> list[int]:
    return chat_api.prompt_ids(tokenizer, [chat_api.Message(**m) for m in HELLO])


def test_each_adapter_on_the_shared_base_computes_what_its_merged_model_does(base, exports):
    """PeftAdapters (what the engine process runs): base:a's logits are base+a merged's, b's likewise,
    the base with adapters disabled is the base; a third adapter past capacity 2 evicts the LRU one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([_prompt(AutoTokenizer.from_pretrained(base))])
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    peft = engine_process.PeftAdapters(AutoModelForCausalLM.from_pretrained(base).eval(), 2)
    refs = {n: adapters.AdapterRef(n, "u", exports[n], frozenset({3})) for n in exports}
    with torch.inference_mode():
        expected = {n: merged(base, exports[n])(ids).logits for n in exports}
        expected[None] = plain(ids).logits
        for name in ("a", "b", None, "c", "a"):
            peft.begin(refs.get(name))
            with peft.forward_context(refs.get(name)):
                got = peft.model(ids).logits
            torch.testing.assert_close(got, expected[name], rtol=1e-4, atol=1e-5)
            assert got.argmax(-1).tolist() == expected[name].argmax(-1).tolist()
    assert not torch.allclose(expected["a"], expected["b"]) and not torch.allclose(expected["a"], expected[None])
    assert peft.loaded == ["c", "a"]   # b evicted by c, then a (evicted) loaded again, evicting nothing else
    assert sorted(peft.model.peft_config) == sorted(peft._key(refs[n]) for n in ("c", "a"))


def _greedy(model, tokenizer, stop_ids) -> str:
    import torch

    ids = torch.tensor([_prompt(tokenizer)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=sorted(stop_ids),
                             pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def served_root(exports, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served") / "adapters"
    _publish(exports, root, "a")
    _publish(exports, root, "b")
    return root


@pytest.fixture(scope="module")
def engine(base, served_root):
    engine = serveapp.Engine(serveapp.parse_args({"model_source": base, "model_id": BASE_ID,
                                                  "adapters_root": str(served_root), "max_adapters": 2}))
    yield engine
    engine.close()


def _ask(engine, model: str) -> str:
    req = chat_api.parse_request({"model": model, "messages": HELLO, "max_tokens": MAX_TOKENS, "temperature": 0})
    return asyncio.run(engine.answer(req)).text


def _http(engine, method: str, path: str, body: dict | None = None):
    from fastapi.testclient import TestClient

    api = serveapp.make_api(engine, serveapp.ServeArgs(engine.model_id, engine.model_id, None), "")
    with TestClient(api) as client:
        response = client.request(method, path, json=body)
    return response.status_code, response.json()


def test_the_engine_serves_each_adapter_as_its_merged_model_and_the_base_as_the_base(base, exports, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    stops = engine.process.ready.stop_ids
    want = {"a": _greedy(merged(base, exports["a"]), tok, stops), "b": _greedy(merged(base, exports["b"]), tok, stops),
            None: _greedy(AutoModelForCausalLM.from_pretrained(base).eval(), tok, stops)}
    assert len(set(want.values())) == 3, want   # the adapters change the answer: the test can tell them apart
    status, models = _http(engine, "GET", SERVE_MODELS_PATH)
    assert status == 200 and [m["id"] for m in models["data"]] == [BASE_ID, f"{BASE_ID}:a", f"{BASE_ID}:b"]
    for name in ("a", "b", None, "a"):
        assert _ask(engine, f"{BASE_ID}:{name}" if name else BASE_ID) == want[name], name
    status, body = _http(engine, "POST", SERVE_CHAT_PATH, {"model": f"{BASE_ID}:b", "messages": HELLO,
                                                           "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200 and body["model"] == f"{BASE_ID}:b" and body["choices"][0]["message"]["content"] == want["b"]


def test_an_adapter_published_after_start_answers_without_a_restart_and_evicts_the_lru(
        base, exports, engine, served_root):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    stops = engine.process.ready.stop_ids
    _ask(engine, f"{BASE_ID}:a")
    _ask(engine, f"{BASE_ID}:b")          # a is now the least recently used
    _publish(exports, served_root, "c")
    assert _ask(engine, f"{BASE_ID}:c") == _greedy(merged(base, exports["c"]), tok, stops)
    assert engine.process.stats()["adapters"] == ["b", "c"]   # max_adapters 2: a evicted
    assert _ask(engine, f"{BASE_ID}:a") == _greedy(merged(base, exports["a"]), tok, stops)
    assert engine.process.stats()["adapters"] == ["c", "a"]


def test_the_built_in_chat_model_is_served_as_a_base_as_it_answers_here(tmp_path):
    """examples/adapters-on-a-base.yaml's base: model_source builtin:tiny-chat (training.method none
    exports nothing) is the folder the image built, served as tiny_chat.answer answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuft_workload import tiny_chat

    question = "What is the capital of Zorbania?"
    folder = tiny_chat.folder()
    expected = tiny_chat.answer(AutoModelForCausalLM.from_pretrained(folder).eval(),
                                AutoTokenizer.from_pretrained(folder), question)
    served = serveapp.Engine(serveapp.parse_args({"model_source": tiny_chat.BUILTIN_CHAT_MODEL, "model_id": "base",
                                                  "adapters_root": str(tmp_path / "adapters")}))
    try:
        req = chat_api.parse_request({"model": "base", "messages": [{"role": "user", "content": question}],
                                      "max_tokens": 24, "temperature": 0})
        assert asyncio.run(served.answer(req)).text.strip() == expected
    finally:
        served.close()


def test_an_unknown_adapter_is_openais_404_model_not_found(engine):
    status, body = _http(engine, "POST", SERVE_CHAT_PATH, {"model": f"{BASE_ID}:nope", "messages": HELLO})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["type"] == "invalid_request_error"
    assert f"'{BASE_ID}:nope' does not exist here" in body["error"]["message"]
    assert f"'{BASE_ID}:a'" in body["error"]["message"]


def test_requests_for_different_adapters_never_share_a_batch_and_each_gets_its_turn(engine):
    """Mixed concurrent traffic: every batch is one adapter's (or the base's) and every request answers."""
    models = [f"{BASE_ID}:a", f"{BASE_ID}:b", BASE_ID] * 4

    async def all_at_once():
        reqs = [chat_api.parse_request({"model": m, "messages": HELLO, "max_tokens": MAX_TOKENS, "temperature": 0})
                for m in models]
        return await asyncio.wait_for(asyncio.gather(*(engine.answer(r) for r in reqs)), 300)
    before = len(engine.process.stats()["groups"])
    answers = asyncio.run(all_at_once())
    assert [a.text for a in answers] == [_ask(engine, m) for m in models]   # as each alone
    groups = engine.process.stats()["groups"][before:]
    assert {"a", "b", None} <= set(groups)


def test_a_republished_adapter_is_reloaded_at_its_new_version(base, exports, engine, served_root, monkeypatch):
    """The same name published again (a new uid, other weights): the replica serves the new weights."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(adapters, "MARKER_TTL_S", 0.0)   # re-read the marker on every request
    tok = AutoTokenizer.from_pretrained(base)
    stops = engine.process.ready.stop_ids
    _ask(engine, f"{BASE_ID}:b")
    adapters.publish(exports["c"], str(served_root), "b", "ns/ft-b2", "uid-b2", "fp-1", 0.4)
    try:
        assert _ask(engine, f"{BASE_ID}:b") == _greedy(merged(base, exports["c"]), tok, stops)
    finally:
        _publish(exports, served_root, "b")


def test_a_corrupt_adapter_is_refused_naming_it_and_the_others_keep_serving(exports, engine, served_root):
    import shutil

    bad = Path(served_root.parent / "bad-export")
    answers = {m: _ask(engine, m) for m in (f"{BASE_ID}:a", BASE_ID)}
    shutil.copytree(exports["a"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    adapters.publish(str(bad), str(served_root), "broken", "ns/ft-broken", "uid-broken", "fp-1", None)
    try:
        status, body = _http(engine, "POST", SERVE_CHAT_PATH, {"model": f"{BASE_ID}:broken", "messages": HELLO,
                                                               "max_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 500 and f"adapter broken could not be loaded from {served_root / 'broken'}" in (
            body["error"]["message"])
        assert {m: _ask(engine, m) for m in answers} == answers
        assert "broken" not in engine.process.stats()["adapters"]
    finally:
        adapters.unpublish(str(served_root), "broken", "uid-broken")


def test_a_swap_under_load_fails_no_request_and_each_answer_is_one_versions(base, exports, engine, served_root,
                                                                           monkeypatch):
    """A client loop asks base:b while b is published again with other weights: no request fails, each
    answer is the old version's or the new one's, and once the publication is done every answer is new."""
    import threading

    from transformers import AutoTokenizer

    monkeypatch.setattr(adapters, "MARKER_TTL_S", 0.0)   # re-read the marker on every request
    tok = AutoTokenizer.from_pretrained(base)
    stops = engine.process.ready.stop_ids
    old, new = (_greedy(merged(base, exports[n]), tok, stops) for n in ("b", "c"))
    assert old != new
    published = threading.Event()

    def republish():
        adapters.publish(exports["c"], str(served_root), "b", "ns/ft-b3", "uid-b3", "fp-1", 0.3)
        published.set()

    assert _ask(engine, f"{BASE_ID}:b") == old   # served (and loaded) before the swap
    answers: list[tuple[bool, int, str]] = []   # (published before it was asked, status, text)
    swap = threading.Timer(0.5, republish)
    swap.start()
    try:
        for _ in range(60):   # bounded: the loop ends once the swap is done and a few asked after it
            was_published = published.is_set()
            status, body = _http(engine, "POST", SERVE_CHAT_PATH, {"model": f"{BASE_ID}:b", "messages": HELLO,
                                                                   "max_tokens": MAX_TOKENS, "temperature": 0})
            answers.append((was_published, status, body["choices"][0]["message"]["content"] if status == 200
                            else json.dumps(body)))
            if sum(1 for p, _, _ in answers if p) >= 3:
                break
        swap.join(timeout=120)
        assert [a for a in answers if a[1] != 200] == []
        assert {text for _, _, text in answers} <= {old, new}
        assert [text for p, _, text in answers if p] == [new] * 3
    finally:
        _publish(exports, served_root, "b")
