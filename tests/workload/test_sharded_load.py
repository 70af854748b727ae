"""A saved model loaded shard by shard (tpuft_workload.sharded_load) is the model a full load
gives, parameter for parameter, while each rank reads only its rows.

Two gloo ranks (torch.multiprocessing, spawned), a small Llama saved as several safetensors files
(untied, and with tied embeddings), FSDP2 over both ranks: every parameter gathered after the
sharded load equals the one gathered after from_pretrained; the buffers (rotary tables) are equal;
each rank read about half of the bytes; a LoRA-wrapped base fills the same and its adapters get
PEFT's initialisation (B zero); with bf16 compute, the frozen base is stored in bf16 and the
adapters in fp32."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.workload.rendezvous import file_rendezvous
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
        modellib.shard(empty, mesh, platform, torch.device("cpu"))
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
    folders["untied-lora"] = folders["untied"]
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
