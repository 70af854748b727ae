"""The non-built-in model path, FSDP2 sharding, DCP save/restore and the HF export, in one
process (a world of 1 over gloo, no Ray, conftest's `world_of_one`): what every training worker
does around its loop."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from tests.factories import tiny_batch
from tests.workload.inprocess_data import build_blocks, collate, load_records
from tpuft_workload import checkpoint, model as modellib, tiny
from tpuft_workload.platform import PLATFORMS

CPU = PLATFORMS["cpu"]


@pytest.fixture(scope="module")
def hub_like_dir(tmp_path_factory):
    """A folder shaped like a downloaded hub model: config, safetensors, tokenizer."""
    d = tmp_path_factory.mktemp("hub-model")
    tok = tiny.build_tokenizer()
    tiny.build_model(len(tok), seed=3).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_load_shard_checkpoint_export_roundtrip(hub_like_dir, world_of_one, tmp_path):
    from transformers import AutoModelForCausalLM

    tok = modellib.load_tokenizer(hub_like_dir)
    m = modellib.load_model(hub_like_dir, tok, CPU, seed=0)
    assert type(m).__name__ == "LlamaForCausalLM" and next(m.parameters()).dtype == torch.float32
    assert [type(x).__name__ for x in modellib._decoder_layers(m)] == ["LlamaDecoderLayer"] * 2

    params = modellib.shard(m, world_of_one, CPU, torch.device("cpu"))
    assert type(m).__name__.startswith("FSDP")                 # fully_shard wrapped the root
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = tiny_batch(tok)

    def step():
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    checkpoint.save(m, opt, {"step": 1}, str(ckpt), rank=0)
    with torch.no_grad():
        saved_loss = m(**batch).loss.item()
    step()                                                     # move away from the checkpoint
    with torch.no_grad():
        assert m(**batch).loss.item() != pytest.approx(saved_loss, abs=1e-7)
    assert checkpoint.load(m, opt, str(ckpt)) == {"step": 1}
    with torch.no_grad():
        assert m(**batch).loss.item() == pytest.approx(saved_loss, abs=1e-6)

    export = tmp_path / "export"
    assert checkpoint.export_hf(m, tok, str(export), rank=0) == str(export)
    reloaded = AutoModelForCausalLM.from_pretrained(str(export))
    with torch.no_grad():
        assert reloaded(**batch).loss.item() == pytest.approx(saved_loss, abs=1e-5)

    checkpoint.mark_committed(str(ckpt))
    assert checkpoint.find_latest_committed(str(tmp_path)) is None  # not named checkpoint_step_*
    named = tmp_path / "checkpoint_step_0000001"
    ckpt.rename(named)
    (tmp_path / "checkpoint_step_0000002").mkdir()            # newer but never committed
    assert checkpoint.find_latest_committed(str(tmp_path)) == str(named)


@pytest.mark.parametrize("ref", ["builtin", "hub-like folder"])
def test_the_meta_model_has_the_architecture_load_model_builds(hub_like_dir, ref):
    """What the driver checks a resume point against (no weights read) is what the workers load."""
    model_ref = tiny.BUILTIN_MODEL if ref == "builtin" else hub_like_dir
    loaded = modellib.load_model(model_ref, modellib.load_tokenizer(model_ref), CPU, seed=0)
    meta = modellib.meta_model(model_ref)
    assert all(p.is_meta for p in meta.parameters())
    assert checkpoint.architecture(meta) == checkpoint.architecture(loaded)


# ---- HSDP: slices > 1 ----------------------------------------------------------------------------
HSDP_WORLD, HSDP_STEPS, ROWS_PER_RANK = 4, 3, 2


def _hsdp_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    """One of four gloo ranks: the same three steps (each rank its own rows) as FSDP over one slice
    of 4 and as HSDP over 2 slices of 2, then the HSDP checkpoint restored into the FSDP layout."""
    import json

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=HSDP_WORLD)
    tok = modellib.load_tokenizer(model_dir)
    blocks = build_blocks(tok, load_records("builtin:dolly-mini", "train[:96]"), 64, packing=True)
    # rows with something to learn (a row of prompt only has no label: its mean loss is NaN)
    rows = [i for i in range(len(blocks)) if (collate(blocks, [i])["labels"] != -100).any()]

    def batch(step: int) -> dict:
        first = (step * HSDP_WORLD + rank) * ROWS_PER_RANK
        return collate(blocks, rows[first:first + ROWS_PER_RANK])

    def build(slices: int):
        m = modellib.load_model(model_dir, tok, CPU, seed=0)
        params = modellib.shard(m, modellib.device_mesh(CPU, HSDP_WORLD, slices), CPU, torch.device("cpu"))
        return m, torch.optim.AdamW(params, lr=1e-2)

    def mean_loss(m, b) -> float:
        with torch.no_grad():
            loss = m(**b).loss.detach()
        dist.all_reduce(loss)
        return loss.item() / HSDP_WORLD

    result: dict = {"meshes": {}}
    for slices in (1, 2):
        m, opt = build(slices)
        result["meshes"][slices] = [list(m.model.embed_tokens.weight.device_mesh.shape)]
        losses = []
        for step in range(HSDP_STEPS):
            loss = m(**batch(step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            summed = loss.detach().clone()
            dist.all_reduce(summed)
            losses.append(summed.item() / HSDP_WORLD)
        result[slices] = losses
    ckpt = f"{out}/ckpt"   # the HSDP model (the last built) saved, then resumed as one slice
    checkpoint.save(m, opt, {"step": HSDP_STEPS}, ckpt, rank=rank)
    probe = batch(HSDP_STEPS)
    result["hsdp_probe"] = mean_loss(m, probe)
    fsdp, fsdp_opt = build(1)
    result["restored_state"] = checkpoint.load(fsdp, fsdp_opt, ckpt)
    result["fsdp_probe"] = mean_loss(fsdp, probe)
    if rank == 0:
        with open(f"{out}/result.json", "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def test_hsdp_over_two_slices_trains_like_fsdp_over_one_and_its_checkpoint_resumes_on_one(hub_like_dir, tmp_path):
    """slices: 2 of a 2-device CPU slice is four workers: parameters shard inside a slice and replicate
    across slices. With the same global batch the losses equal one 4-device slice's (the same
    mean gradient, summed in a different order), and a checkpoint taken as HSDP resumes as FSDP."""
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_hsdp_worker, args=(port, hub_like_dir, str(tmp_path)), nprocs=HSDP_WORLD,
                       start_method="spawn")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["meshes"] == {"1": [[4]], "2": [[2, 2]]}
    fsdp, hsdp = result["1"], result["2"]
    assert fsdp[-1] < fsdp[0]                                   # it trains
    assert hsdp == pytest.approx(fsdp, rel=1e-4)
    assert result["restored_state"] == {"step": HSDP_STEPS}
    assert result["fsdp_probe"] == pytest.approx(result["hsdp_probe"], rel=1e-5)


def test_device_mesh_refuses_slices_that_do_not_divide_the_workers():
    with pytest.raises(ValueError, match="6 workers do not split into 4 equal slices"):
        modellib.device_mesh(CPU, 6, 4)
