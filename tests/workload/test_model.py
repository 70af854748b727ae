"""The non-built-in model path, FSDP2 sharding, DCP save/restore and the HF export, in one
process (a world of 1 over gloo, no Ray, conftest's `world_of_one`): what every training worker
does around its loop."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.ranks import file_rendezvous
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


def _hsdp_worker(rank: int, rendezvous: str, model_dir: str, out: str) -> None:
    """One of four gloo ranks: the same three steps (each rank its own rows) as FSDP over one slice
    of 4 and as HSDP over 2 slices of 2, then the HSDP checkpoint restored into the FSDP layout."""
    import json

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=HSDP_WORLD)
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

    rendezvous = file_rendezvous(tmp_path)
    mp.start_processes(_hsdp_worker, args=(rendezvous, hub_like_dir, str(tmp_path)), nprocs=HSDP_WORLD,
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


# ---- the optimizer's weight decay -----------------------------------------------------------------
def _decayed(model, weight_decay: float = 0.1) -> tuple[set[str], set[str]]:
    """(names with decay, names without) as decay_groups makes them."""
    groups = modellib.decay_groups(model, weight_decay)
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    names = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}   # a tied one: both names
    return ({n for n, i in names.items() if i in by_decay.get(weight_decay, ())},
            {n for n, i in names.items() if i in by_decay.get(0.0, ())})


def test_weight_decay_is_on_weight_matrices_only():
    """A Llama: norms and the input embedding without decay, every projection with it (the output
    layer too, untied); tied, the output layer is the embedding. Biases: a module of each kind."""
    model = tiny.build_model(len(tiny.build_tokenizer()), seed=0)
    decay, plain = _decayed(model)
    assert plain == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{norm}.weight" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")}
    assert "lm_head.weight" in decay and all(n.endswith("_proj.weight") for n in decay - {"lm_head.weight"})
    assert len(decay) == 2 * 7 + 1
    model.lm_head.weight = model.model.embed_tokens.weight   # tied
    decay, plain = _decayed(model)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= plain and len(decay) == 2 * 7
    toy = torch.nn.ModuleDict({"wte": torch.nn.Embedding(10, 4), "pos_embed": torch.nn.Linear(4, 4),
                               "proj": torch.nn.Linear(4, 4), "ln": torch.nn.LayerNorm(4)})
    decay, plain = _decayed(toy)
    assert decay == {"proj.weight"}
    assert plain == {"wte.weight", "pos_embed.weight", "pos_embed.bias", "proj.bias", "ln.weight", "ln.bias"}


def test_with_zero_gradients_only_the_weight_matrices_shrink(world_of_one):
    """AdamW's decoupled decay, sharded as a worker shards: a zero gradient moves nothing else."""
    model = tiny.build_model(len(tiny.build_tokenizer()), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    modellib.shard(model, world_of_one, CPU, torch.device("cpu"))
    decay, _ = _decayed(model)
    opt = torch.optim.AdamW(modellib.decay_groups(model, 0.1), lr=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        after = p.full_tensor()
        assert torch.allclose(after, before[n] * (1 - 0.5 * 0.1) if n in decay else before[n]), n


# ---- activation checkpointing -----------------------------------------------------------------------
def _saved_bytes(model, inputs: dict) -> tuple[float, int]:
    """(the loss, the bytes a forward keeps for the backward: tensors autograd saves outside a
    checkpointed layer, which keeps only its inputs), then the backward."""
    kept = 0

    def pack(t):
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    return loss.item(), kept


@pytest.mark.parametrize("method", ["full", "lora"])
def test_activation_checkpointing_keeps_the_loss_and_gradients_and_keeps_less(world_of_one, method):
    """At 1024 tokens a row: the same loss and gradients with every decoder layer recomputed (LoRA:
    the frozen base's inputs need no gradient, which non-reentrant recomputation allows), the state
    dict's names unchanged (checkpoints and exports do not see the wrapper), and far fewer bytes held
    for the backward. bench/activation_checkpointing.py measures the peak RSS."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from tpuft_workload import lora

    tok = tiny.build_tokenizer()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(tok), (2, 1024), generator=gen)
    inputs = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(1024).repeat(2, 1)}
    settings = lora.LoraSettings(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))
    got = {}
    for on in (False, True):
        model = tiny.build_model(len(tok), seed=0)
        if method == "lora":
            torch.manual_seed(0)   # the adapters' initial weights
            model = lora.wrap(model, settings)
        modellib.shard(model, world_of_one, CPU, torch.device("cpu"), activation_checkpointing=on)
        loss, kept = _saved_bytes(model, inputs)
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
                 for n, p in model.named_parameters() if p.requires_grad}
        nonzero = {n for n, g in grads.items() if g.abs().sum() > 0}
        # LoRA's B starts at zero: A has no gradient yet, B has
        assert nonzero == ({n for n in grads if "lora_B" in n} if method == "lora" else set(grads))
        got[on] = loss, kept, grads, set(get_model_state_dict(model))
    (loss_off, kept_off, grads_off, keys_off), (loss_on, kept_on, grads_on, keys_on) = got[False], got[True]
    assert loss_on == pytest.approx(loss_off, rel=1e-6) and keys_on == keys_off
    assert grads_on.keys() == grads_off.keys()
    assert max((grads_on[n] - grads_off[n]).abs().max().item() for n in grads_on) < 1e-6
    assert kept_on < kept_off / 2, (kept_on, kept_off)


@pytest.mark.parametrize("tied", [False, True])
def test_untied_embeddings_are_units_of_their_own_and_train_the_same(world_of_one, tied):
    """Untied, the input and the output embedding are FSDP2 units of their own (gathered for their
    own forward and backward only, not from the first layer to the last as the root is); tied, the
    root holds the one matrix. The loss and gradients are an unsharded model's either way."""
    import copy

    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, use_cache=False)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    sharded = copy.deepcopy(plain)
    modellib.shard(sharded, world_of_one, CPU, torch.device("cpu"))
    units = [isinstance(m, FSDPModule) for m in (sharded.model.embed_tokens, sharded.lm_head)]
    assert units == [not tied, not tied]
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, sharded):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        assert torch.allclose(p.grad, q.grad.full_tensor(), atol=1e-6), name
