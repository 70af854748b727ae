"""A saved model loaded shard by shard (tpuft_workload.sharded_load) is the model a full load
gives, parameter for parameter, while each rank reads only its rows.

Two gloo ranks (torch.multiprocessing, spawned), a small Llama saved as several safetensors files
(untied, and with tied embeddings), FSDP2 over both ranks: every parameter gathered after the
sharded load equals the one gathered after from_pretrained; the buffers (rotary tables) are equal;
each rank read about half of the bytes; a LoRA-wrapped base fills the same and its adapters get
PEFT's initialisation (B zero); with bf16 compute, the frozen base is stored in bf16 and the
adapters in fp32; with activation checkpointing (each layer wrapped before sharding) it fills the
same."""
from __future__ import annotations

import dataclasses
import platform
import subprocess
import sys

import pytest
import torch

from tests.ranks import file_rendezvous
from tpuft_workload import model as modellib
from tpuft_workload import sharded_load
from tpuft_workload.platform import PLATFORMS

WORLD = 2
CPU = PLATFORMS["cpu"]
MIXED_CPU = dataclasses.replace(CPU, mixed_precision=True)   # bf16 compute, as on an accelerator


def _config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=tied, use_cache=False)


def _save(folder, tied: bool) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    LlamaForCausalLM(_config(tied)).save_pretrained(folder, max_shard_size="60KB")


def _gathered(model) -> dict:
    out = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
           for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def _rank(rank: int, rendezvous: str, folders: dict, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    mesh = modellib.device_mesh(CPU, WORLD)
    result = {}
    for case, folder in folders.items():
        full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        modellib.shard(full, mesh, CPU, torch.device("cpu"))
        with sharded_load.parameters_on_meta():
            empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
        lora = case.endswith("lora")
        if lora:
            from peft import LoraConfig, get_peft_model

            empty = get_peft_model(empty, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        # LoRA as on an accelerator (bf16 compute): the frozen base is stored in bf16
        platform = MIXED_CPU if lora else CPU
        modellib.shard(empty, mesh, platform, torch.device("cpu"), activation_checkpointing=case.endswith("recompute"))
        stats = sharded_load.fill(empty, folder)
        result[case] = {"full": _gathered(full), "sharded": _gathered(empty), "bytes": stats["bytes"],
                        "tied": full.lm_head.weight is full.model.embed_tokens.weight,
                        "dtypes": {n: p.to_local().dtype if hasattr(p, "to_local") else p.dtype
                                   for n, p in empty.named_parameters()}}
        if lora:   # one step trains: the adapters get gradients, the bf16 base none
            ids = torch.arange(16).unsqueeze(0)
            loss = empty(input_ids=ids, labels=ids).loss
            loss.backward()
            result[case]["step"] = {"loss": float(loss), "grads": sorted(n for n, p in empty.named_parameters()
                                                                           if p.grad is not None)}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {case: r["bytes"] for case, r in result.items()})
    if rank == 0:
        for case in result:
            result[case]["bytes_per_rank"] = [g[case] for g in gathered]
        torch.save(result, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("sharded")
    folders = {}
    for tied in (False, True):
        folder = root / ("tied" if tied else "untied")
        _save(folder, tied)
        folders["tied" if tied else "untied"] = str(folder)
    folders["untied-lora"] = folders["untied-recompute"] = folders["untied"]
    out = str(root / "result.pt")
    rendezvous = file_rendezvous(root)
    mp.start_processes(_rank, args=(rendezvous, folders, out), nprocs=WORLD, start_method="spawn")
    result = torch.load(out)
    result["files"] = {case: len(set(sharded_load.weight_files(folder).values())) for case, folder in folders.items()}
    result["bytes"] = {case: sum((p.stat().st_size for p in __import__("pathlib").Path(folder).glob("*.safetensors")))
                       for case, folder in folders.items()}
    return result


@pytest.mark.parametrize("case", ["untied", "tied"])
def test_every_parameter_and_buffer_is_the_full_loads(loaded, case):
    got = loaded[case]
    assert loaded["files"][case] > 1   # several safetensors files, through the index
    assert got["full"].keys() == got["sharded"].keys()
    for name, tensor in got["full"].items():
        assert torch.equal(tensor, got["sharded"][name]), name
    assert got["tied"] is (case == "tied")


@pytest.mark.parametrize("case", ["untied", "tied"])
def test_each_rank_reads_about_its_half(loaded, case):
    per_rank = loaded[case]["bytes_per_rank"]
    file_bytes = loaded["bytes"][case]
    assert sum(per_rank) <= file_bytes   # no tensor read twice (a tied one once), nothing read whole by both
    assert max(per_rank) <= 0.6 * file_bytes, per_rank


def test_a_base_whose_layers_are_recomputed_fills_the_same(loaded):
    got = loaded["untied-recompute"]["sharded"]
    assert any(sharded_load.CHECKPOINT_WRAPPED in name for name in got)   # the wrapper is in the names
    unwrapped = {name.replace(sharded_load.CHECKPOINT_WRAPPED, "."): tensor for name, tensor in got.items()}
    assert unwrapped.keys() == loaded["untied"]["full"].keys()
    for name, tensor in loaded["untied"]["full"].items():
        assert torch.equal(tensor, unwrapped[name]), name


def test_a_lora_base_fills_the_same_and_its_adapters_start_at_peft_s_init(loaded):
    got = loaded["untied-lora"]
    base = {n.replace("base_model.model.", "").replace(".base_layer.", "."): t for n, t in got["sharded"].items()
            if ".lora_" not in n}
    for name, tensor in loaded["untied"]["full"].items():   # the base, as bf16 holds it
        assert torch.equal(tensor.to(base[name].dtype), base[name]), name
    dtypes = got["dtypes"]
    assert {dtypes[n] for n in dtypes if ".lora_" in n} == {torch.float32}   # the trained adapters: fp32
    assert {dtypes[n] for n in dtypes if ".lora_" not in n} == {torch.bfloat16}   # the frozen base: bf16
    assert torch.isfinite(torch.tensor(got["step"]["loss"]))
    assert got["step"]["grads"] and all(".lora_" in n for n in got["step"]["grads"])
    adapters_b = [t for n, t in got["sharded"].items() if ".lora_B." in n]
    adapters_a = [t for n, t in got["sharded"].items() if ".lora_A." in n]
    assert adapters_b and all(torch.count_nonzero(t) == 0 for t in adapters_b)
    assert adapters_a and all(torch.count_nonzero(t) > 0 and t.abs().max() < 1 for t in adapters_a)


FREED_AFTER = """
import os, sys, torch
from tpuft_workload import sharded_load
if sys.argv[1] == "unmapped":
    assert sharded_load.unmap_freed_tensors()
def rss():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
first = torch.ones(2 * 2**20)   # 8 MiB: glibc's dynamic threshold rises past it when it is freed
del first
layer = torch.ones(2 * 2**20)   # as the next layer's gathered weight
kept = torch.ones(1024)   # an activation allocated after it: the weight is not at the heap's top
before = rss()
del layer
print((before - rss()) / 2**20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize("malloc", ["unmapped", "glibc-default"])
def test_a_freed_gathered_weight_leaves_the_pod_s_memory(malloc):
    """FSDP2 frees each layer's gathered weights after its forward; the pod is charged for them
    until malloc gives them back to the kernel (bench/sharded_load.py: up to 41 MiB a layer)."""
    out = subprocess.run([sys.executable, "-c", FREED_AFTER, malloc], capture_output=True, text=True, timeout=120,
                         check=True)
    returned_mib = float(out.stdout.split()[-1])
    if malloc == "unmapped":
        assert returned_mib >= 7.9
    else:   # what unmap_freed_tensors is for: glibc keeps the freed chunk in its heap
        assert returned_mib < 1


# ---- a LoRA run's export from the sharded load ---------------------------------------------------------
# A Qwen2.5-like base (tests.factories.chatml_tokenizer: turns end with <|im_end|>, its generation config
# stops on <|endoftext|> and another id, with sampling settings), saved as several safetensors files.
# Its final norm is zero, so every logit is 0 and the greedy answer is id 0, <|im_end|>: the serving
# engine must stop there at once. Each world loads it shard by shard, wraps rank-8 adapters, fills them
# and exports as a worker does (model.as_served, then lora.export; with 2 ranks also a full export).
LORA_RANK = 8
EXPORT_WORLDS = (2, 4)
BASE_GENERATION = {"eos_token_id": [1, 5], "temperature": 0.6, "top_p": 0.9, "do_sample": True}


def _chatml_base(folder) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    from tests.factories import chatml_tokenizer

    tok = chatml_tokenizer()
    config = _config(tied=False)
    config.vocab_size, config.pad_token_id, config.eos_token_id = len(tok), tok.pad_token_id, tok.eos_token_id
    config.use_cache = True
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.generation_config = GenerationConfig(**BASE_GENERATION)
    model.save_pretrained(folder, max_shard_size="60KB")
    tok.save_pretrained(folder)


def _export_rank(rank: int, world: int, rendezvous: str, base: str, run_dir: str) -> None:
    import torch.distributed as dist

    from tpuft_workload import checkpoint, lora

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    torch.manual_seed(0)   # every rank alike, as a training worker seeds it (train._Torch)
    mesh = modellib.device_mesh(CPU, world)
    tok = modellib.load_tokenizer(base)
    settings = lora.LoraSettings(rank=LORA_RANK, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))
    model = lora.wrap(modellib.empty_model(base, CPU), settings)
    modellib.shard(model, mesh, CPU, torch.device("cpu"))
    sharded_load.fill(model, base, seed=0)
    modellib.as_served(model, base)
    lora.export(model, tok, settings, base, f"{run_dir}/lora", rank)
    if world == 2:
        full = modellib.empty_model(base, CPU)
        modellib.shard(full, mesh, CPU, torch.device("cpu"))
        sharded_load.fill(full, base)
        modellib.as_served(full, base)
        checkpoint.export_hf(full, tok, f"{run_dir}/full", rank)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """{world: its run folder (lora/export, and for 2 ranks full/)}, and "base": the base's folder."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("lora-export")
    base = root / "base"
    _chatml_base(base)
    out = {"base": base}
    for world in EXPORT_WORLDS:
        out[world] = root / f"world-{world}"
        mp.start_processes(_export_rank, args=(world, file_rendezvous(root), str(base), str(out[world])),
                           nprocs=world, start_method="spawn")
    return out


@pytest.mark.parametrize("world", EXPORT_WORLDS)
def test_the_exported_adapters_have_full_rank_whatever_the_world(exported, world):
    """Every lora_A, as PEFT reloads it from the export, has rank r: the shards do not repeat each other."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(exported["base"]))
    model = PeftModel.from_pretrained(base, str(exported[world] / "lora" / "export"))
    adapters = {n: p.detach() for n, p in model.named_parameters() if ".lora_A." in n}
    assert len(adapters) == 2 * _config(tied=False).num_hidden_layers   # q_proj and v_proj of each layer
    ranks = {n: int(torch.linalg.matrix_rank(a)) for n, a in adapters.items()}
    assert set(ranks.values()) == {LORA_RANK}, ranks
    firsts = [a[0] for a in adapters.values()]
    assert all(not torch.equal(firsts[0], f) for f in firsts[1:])   # each module its own draw


def _generation_json(folder) -> dict:
    import json

    saved = json.loads((folder / "generation_config.json").read_text())
    saved.pop("transformers_version", None)
    return saved


def test_every_export_carries_the_base_s_generation_config_with_the_turn_end(exported):
    """The full export and the adapter export: the base's generation_config.json (its stop ids and
    sampling settings), <|im_end|> (id 0) added to its stop ids; config.json's use_cache the base's."""
    import json

    base = _generation_json(exported["base"])
    assert base["eos_token_id"] == [1, 5]
    wanted = {**base, "eos_token_id": [1, 5, 0]}
    for folder in (exported[2] / "full", exported[2] / "lora" / "export", exported[4] / "lora" / "export"):
        assert _generation_json(folder) == wanted, folder
    config = json.loads((exported[2] / "full" / "config.json").read_text())
    assert config["use_cache"] is json.loads((exported["base"] / "config.json").read_text())["use_cache"] is True


def test_the_engine_stops_an_adapter_export_at_the_turn_end(exported):
    """Served through the transformers engine: the stop ids hold <|im_end|>, and the answer (the base
    emits <|im_end|> first) ends there, not at the token budget."""
    import asyncio

    from tpuft_workload import chat_api, engine_process
    from tpuft_workload import serve as serveapp

    export = str(exported[2] / "lora" / "export")
    assert engine_process.load(export).stop_ids == {1, 5, 0}
    engine = serveapp.Engine(serveapp.parse_args({"model_source": export, "model_id": "qwen-lora"}))
    request = chat_api.parse_request({"model": "qwen-lora", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 8, "temperature": 0})
    try:
        reply = asyncio.run(engine.answer(request))
    finally:
        engine.close()
    assert reply.finish_reason == chat_api.FINISH_STOP and reply.completion_tokens <= 1, reply


def test_a_pods_memory_limit_is_read_from_its_cgroup_v2_or_v1_file(tmp_path):
    from tpuft_workload import platform as platformlib

    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert platformlib.memory_limit((str(v2), str(v1))) is None   # neither file: no limit known
    v1.write_text("9223372036854771712\n")                          # v1's "no limit"
    assert platformlib.memory_limit((str(v2), str(v1))) is None
    v1.write_text(f"{4 * 2**30}\n")
    assert platformlib.memory_limit((str(v2), str(v1))) == 4 * 2**30
    v2.write_text("max\n")                                          # v2 first: no limit
    assert platformlib.memory_limit((str(v2), str(v1))) is None
    v2.write_text(f"{5 * 2**30}\n")
    assert platformlib.memory_limit((str(v2), str(v1))) == 5 * 2**30


def test_left_out_on_cpu_a_worker_recomputes_when_its_pod_could_not_hold_the_step(capsys):
    """The held-out ~1B LoRA run (TinyLlama's shape, 2 workers, 4 x 128 tokens) in 4 GiB pods turns
    activation checkpointing on, rank 0 saying why; in 64 GiB pods, or with no limit, it stays off."""
    from types import SimpleNamespace

    from tpuft_workload import lora as loralib
    from tpuft_workload.train import recompute_for_memory

    config = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
              "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False}
    cfg = SimpleNamespace(lora=loralib.LoraSettings(rank=8, alpha=16, dropout=0.05, target_modules=("q_proj", "v_proj")),
                          training=SimpleNamespace(batch_size_per_device=4, max_seq_length=128))
    assert recompute_for_memory(config, cfg, 2, 0, limit=4 * 2**30) is True
    assert "activation checkpointing on" in capsys.readouterr().out
    assert recompute_for_memory(config, cfg, 2, 1, limit=4 * 2**30) is True   # every rank alike, rank 0 says it
    assert capsys.readouterr().out == ""
    assert recompute_for_memory(config, cfg, 2, 0, limit=64 * 2**30) is False
    with pytest.MonkeyPatch.context() as patch:
        from tpuft_workload import platform as platformlib
        patch.setattr(platformlib, "memory_limit", lambda: None)
        assert recompute_for_memory(config, cfg, 2, 0) is False
