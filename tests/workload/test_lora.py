"""tpuft_workload.lora without Ray: the driver's checks (target modules, rank, a resume point's method,
the JAX refusal), then one LoRA-wrapped tiny model in one process (conftest's `world_of_one`, gloo)
sharded with FSDP2 as a training worker shards it: it trains, its checkpoint holds the adapters only
and restores exactly, its export loads with peft, its merged export equals base + adapters, and the
serving engine answers with it. The run through Ray (2 workers, a killed rank): test_lora_train.py."""
from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.factories import assert_export_generates, tiny_batch, tiny_train_argv
from tpuft.api.constants import LORA_DEFAULT_TARGET_MODULES
from tpuft.api.spec import DEFAULTS, LORA_DEFAULTS
from tpuft_workload import __main__ as cli
from tpuft_workload import checkpoint, lora, model as modellib, tiny, train
from tpuft_workload.platform import PLATFORMS

CPU = PLATFORMS["cpu"]
LINEARS = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


@pytest.fixture(scope="module")
def meta():
    return modellib.meta_model(tiny.BUILTIN_MODEL)


# ---- the driver's checks -----------------------------------------------------------------------------

def test_targets_default_to_the_model_types_and_may_be_named(meta):
    assert lora.resolve(meta, 16, 32, 0.05).target_modules == LORA_DEFAULT_TARGET_MODULES["llama"]
    named = lora.resolve(meta, 8, 16, 0.0, ("q_proj", "self_attn.v_proj"))   # PEFT's suffix match
    assert named == lora.LoraSettings(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "self_attn.v_proj"))


REFUSALS = [   # (id, resolve's arguments, model_type, the message)
    ("not-a-layer", dict(targets=("x",)), None,
     f"spec.training.lora.targetModules: 'x' is not a linear layer of LlamaForCausalLM (its linear layers: {LINEARS})"),
    ("a-norm-is-not-linear", dict(targets=("q_proj", "input_layernorm")), None,
     "spec.training.lora.targetModules: 'input_layernorm' is not a linear layer of LlamaForCausalLM"),
    ("no-default-for-the-model-type", {}, "mystery",
     "spec.training.lora.targetModules: model_type 'mystery' of LlamaForCausalLM has no default target modules; "
     f"list the linear layers to adapt (its linear layers: {LINEARS})"),
    # the tiny model's k_proj: 64 in, 32 out (2 key/value heads of 16)
    ("rank-above-a-default-target", dict(rank=512), None,
     "spec.training.lora.rank: 512 is larger than the smallest dimension (32) of model.layers.0.self_attn.k_proj "
     "(64 in, 32 out) in LlamaForCausalLM; give at most 32"),
    ("rank-above-a-named-target", dict(rank=33, targets=("k_proj",)), None,
     "spec.training.lora.rank: 33 is larger than the smallest dimension (32)"),
]


@pytest.mark.parametrize("kwargs,model_type,message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_the_driver_refuses_settings_the_model_cannot_take(meta, monkeypatch, kwargs, model_type, message):
    if model_type:
        monkeypatch.setattr(meta.config, "model_type", model_type)
    args = {"rank": 16, "alpha": 32, "dropout": 0.05, "targets": (), **kwargs}
    with pytest.raises(lora.LoraError) as err:
        lora.resolve(meta, **args)
    assert str(err.value).startswith(message)


R16 = lora.LoraSettings(rank=16, alpha=32, dropout=0.05, target_modules=("q_proj", "v_proj"))
RESUMES = [   # (id, the checkpoint's run manifest "training", this run's settings, refused naming)
    ("lora-into-full", lora.training_manifest(R16), None, "spec.training.method: "),
    ("full-into-lora", None, R16, "spec.training.method: "),   # a manifest from before LoRA: full
    ("another-rank", lora.training_manifest(R16), lora.LoraSettings(8, 32, 0.05, ("q_proj", "v_proj")),
     "spec.training.lora: "),
    ("other-targets", lora.training_manifest(R16), lora.LoraSettings(16, 32, 0.05, ("q_proj",)),
     "spec.training.lora: "),
    ("another-alpha-and-dropout", lora.training_manifest(R16), lora.LoraSettings(16, 64, 0.1, ("q_proj", "v_proj")),
     None),
    ("full-into-full", None, None, None),
]


@pytest.mark.parametrize("training,ours,refused", [r[1:] for r in RESUMES], ids=[r[0] for r in RESUMES])
def test_a_resume_point_must_hold_the_weights_this_run_trains(training, ours, refused):
    manifest = {"format": checkpoint.RUN_FORMAT, **({"training": training} if training else {})}
    if refused is None:
        lora.check_resume("/ck/run/checkpoint_step_0000003", manifest, ours)
        return
    with pytest.raises(checkpoint.ResumeError) as err:
        lora.check_resume("/ck/run/checkpoint_step_0000003", manifest, ours)
    assert str(err.value).startswith(refused + "/ck/run/checkpoint_step_0000003 holds")


def test_the_lora_flags_default_to_the_specs_defaults(tmp_path):
    run = cli.parse_args(tiny_train_argv("torch", tmp_path, "r"))[0].run
    assert (run.training.method, run.training.lora, run.export.merge) == (
        DEFAULTS["training.method"], None, DEFAULTS["export.merge"])
    run = cli.parse_args(tiny_train_argv("torch", tmp_path, "r", method="lora"))[0].run
    adapters = run.training.lora
    assert (adapters.rank, adapters.alpha, adapters.dropout, adapters.target_modules) == (
        LORA_DEFAULTS["training.lora.rank"], LORA_DEFAULTS["training.lora.alpha"],
        LORA_DEFAULTS["training.lora.dropout"], ())
    run = cli.parse_args(tiny_train_argv("torch", tmp_path, "r", method="lora", lora_rank=4, lora_alpha=8,
                                         lora_dropout=0, lora_target_modules=["q_proj", "v_proj"],
                                         merge_export=True))[0].run
    adapters = run.training.lora
    assert (run.training.method, adapters.rank, adapters.alpha, adapters.dropout, adapters.target_modules,
            run.export.merge) == ("lora", 4, 8, 0.0, ("q_proj", "v_proj"), True)


@pytest.mark.parametrize("flag,value", [("lora_dropout", 1), ("lora_dropout", -0.1), ("lora_rank", 0),
                                        ("method", "qlora")])
def test_bad_lora_flags_are_usage_errors(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(tiny_train_argv("torch", tmp_path, "r", **{"method": "lora", flag: value}))
    assert exit_.value.code == cli.EXIT_USAGE
    assert f"--{flag.replace('_', '-')}" in capsys.readouterr().err


def test_lora_on_jax_resolves_the_torch_paths_adapters_on_the_driver(tmp_path):
    """The driver resolves the adapters for both frameworks alike (the model_type's default targets)."""
    command, _ = cli.parse_args(tiny_train_argv("jax", tmp_path, "r", method="lora"))
    assert (command.run.training.framework, command.run.training.method) == ("jax", "lora")
    settings = train._model_checks(command.run, "", {})
    assert settings == lora.LoraSettings(16, 32, 0.05, LORA_DEFAULT_TARGET_MODULES["llama"])


# ---- one worker's LoRA run, in process -----------------------------------------------------------------
STEPS = 8
SETTINGS = lora.LoraSettings(rank=8, alpha=16, dropout=0.0, target_modules=LORA_DEFAULT_TARGET_MODULES["llama"])


@dataclass
class Trained:
    model: torch.nn.Module   # the PEFT model, sharded with FSDP2
    opt: torch.optim.Optimizer
    batch: dict
    losses: list[float]
    with_grad: set[str]      # the parameters that had a gradient after the first backward
    counts: tuple[int, int]
    ckpt: Path               # a checkpoint of the trained state
    logits: torch.Tensor     # the trained model's on `batch` (eval): what every reload must give
    run_dir: Path            # lora.export's: base/, export/, export-merged/


@pytest.fixture(scope="module")
def trained(world_of_one, tmp_path_factory) -> Trained:
    """The tiny model with rank-8 adapters (dropout 0: reloads compare exactly) sharded over the
    world of one, STEPS steps on one batch, a checkpoint, the export with the merged weights."""
    tok = tiny.build_tokenizer()
    m = lora.wrap(tiny.build_model(len(tok), seed=0), SETTINGS)
    params = modellib.shard(m, world_of_one, CPU, torch.device("cpu"))
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = tiny_batch(tok)
    losses, with_grad = [], set()
    for i in range(STEPS):
        loss = m(**batch).loss
        loss.backward()
        if i == 0:
            with_grad = {n for n, p in m.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    run_dir = tmp_path_factory.mktemp("run")
    ckpt = run_dir / "checkpoint_step_0000008"
    ckpt.mkdir()
    checkpoint.save(m, opt, {"step": STEPS}, str(ckpt), rank=0, trainable_only=True)
    m.eval()
    with torch.no_grad():
        logits = m(**batch).logits
    assert lora.export(m, tok, SETTINGS, tiny.BUILTIN_MODEL, str(run_dir), rank=0, merge=True) == \
        str(run_dir / "export")
    return Trained(m, opt, batch, losses, with_grad, lora.parameter_counts(m), ckpt, logits, run_dir)


def test_the_adapters_train_and_only_they_get_gradients(trained):
    assert trained.losses[-1] < trained.losses[0] - 0.5, trained.losses
    assert trained.with_grad and all(".lora_A." in n or ".lora_B." in n for n in trained.with_grad)
    # every adapter of every targeted layer: 2 layers x 7 projections x (A, B)
    assert len(trained.with_grad) == 2 * 7 * 2
    trainable, total = trained.counts
    assert 0 < trainable < total / 5   # the tiny model's rank 8 is a seventh of it; a real model's, under 1%


def test_the_checkpoint_holds_the_adapters_only_and_restores_exactly(trained):
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(str(trained.ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys[:5]
    # the adapters and AdamW's two moments of each: a full checkpoint holds that of every weight
    elements = sum(math.prod(m.size) for m in saved.values() if isinstance(m, TensorStorageMetadata) and m.size)
    trainable, total = trained.counts
    assert elements == 3 * trainable and elements < 3 * total / 5

    m, opt = trained.model, trained.opt
    m.train()
    m(**trained.batch).loss.backward()   # move away from the checkpoint
    opt.step()
    opt.zero_grad()
    m.eval()
    with torch.no_grad():
        assert not torch.allclose(m(**trained.batch).logits, trained.logits)
    assert checkpoint.load(m, opt, str(trained.ckpt), trainable_only=True) == {"step": STEPS}
    with torch.no_grad():
        assert torch.equal(m(**trained.batch).logits, trained.logits)


def test_the_export_is_an_adapter_folder_peft_loads_on_the_base_it_names(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export, base = trained.run_dir / "export", trained.run_dir / lora.BASE_DIR
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(export))
    assert not (export / "config.json").exists() and not (export / "model.safetensors").exists()
    config = json.loads((export / "adapter_config.json").read_text())
    # builtin:tiny-llama's weights exist only in code: the frozen base is written beside the export
    assert (config["base_model_name_or_path"], config["r"], config["lora_alpha"]) == (str(base), 8, 16)
    assert sorted(config["target_modules"]) == sorted(SETTINGS.target_modules)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(export)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**trained.batch).logits, trained.logits, rtol=1e-4, atol=1e-5)
    assert_export_generates(str(export))


def test_a_folder_models_export_names_it_and_gathers_the_adapters_only(tmp_path):
    """spec.model a path (or hub name, gs:// URI): adapter_config.json points at it; no base/ is
    written, and without spec.export.merge no export-merged/ either."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok = tiny.build_tokenizer()
    source = tmp_path / "hub-model"
    tiny.build_model(len(tok), seed=3).save_pretrained(source)
    tok.save_pretrained(source)
    m = lora.wrap(modellib.load_model(str(source), tok, CPU, seed=0), SETTINGS).eval()
    with torch.no_grad():   # adapters that change the output (lora_B starts at zero)
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    run = tmp_path / "run"
    assert lora.export(m, tok, SETTINGS, str(source), str(run), rank=0) == str(run / "export")
    assert sorted(os.listdir(run)) == ["export"]
    config = json.loads((run / "export" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(source)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(source)), str(run / "export"))
    batch = tiny_batch(tok)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batch).logits, m(**batch).logits, rtol=1e-4, atol=1e-5)


def test_the_merged_export_equals_base_plus_adapters(trained):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(trained.run_dir / lora.MERGED_DIR)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**trained.batch).logits, trained.logits, rtol=1e-4, atol=1e-4)


def test_the_serving_engine_answers_with_the_adapter_folder(trained):
    """tpuft_workload.serve's transformers engine (what spec.serve runs on cpu) takes the LoRA export
    as its model_source: the base from adapter_config.json, the adapters merged in."""
    from tpuft_workload import chat_api
    from tpuft_workload import serve as serveapp

    engine = serveapp.Engine(serveapp.parse_args({"model_source": str(trained.run_dir / "export"),
                                                  "model_id": "lora-tiny"}))
    request = chat_api.parse_request({"model": "lora-tiny", "messages": [{"role": "user", "content": "What is a dog?"}],
                                      "max_tokens": 8, "temperature": 0})
    try:
        reply = asyncio.run(engine.answer(request))
    finally:
        engine.close()
    assert 0 < reply.completion_tokens <= 8 and reply.text.strip()


def test_serving_refuses_an_adapter_folder_without_its_base(tmp_path):
    from tpuft_workload import serve as serveapp

    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/nowhere/base"}))
    with pytest.raises(serveapp.ServeArgsError, match="is a LoRA adapter folder on base /nowhere/base, which is not "
                                                      "a folder here"):
        serveapp.parse_args({"model_source": str(tmp_path), "model_id": "m"})
