"""LoRA on the JAX path against PEFT on the torch path (no Ray): the same adapters on the same tiny
family model give the same first-step loss and adapter gradients, and the JAX export is a PEFT
adapter folder that PEFT loads with the same logits.

Tolerance: loss 1e-5 relative, gradients 1e-4 of their largest magnitude (float32, summation order).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.workload import jax_families  # noqa: E402
from tpuft.api.constants import LORA_DEFAULT_TARGET_MODULES  # noqa: E402
from tpuft_workload import jax_lora, jax_model  # noqa: E402
from tpuft_workload.lora import LoraSettings  # noqa: E402

SETTINGS = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=LORA_DEFAULT_TARGET_MODULES["qwen3"])


def _peft(model, settings: LoraSettings, seed: int = 3):
    """PEFT's model over `model`, B drawn at random too (at zero it would hide A's gradient)."""
    import torch
    from peft import get_peft_model

    peft_model = get_peft_model(model, settings.peft_config())
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft_model


def _jax_adapters(peft_model) -> dict:
    """PEFT's adapters under jax_lora's names."""
    return {n.removeprefix("base_model.model.").replace(".default", ""): p.detach().numpy().copy()
            for n, p in peft_model.named_parameters() if "lora_" in n}


def _batch():
    ids, positions = jax_families.packed_inputs()
    labels = ids.copy()
    labels[0, :3] = jax_model.IGNORE
    return ids, positions, labels


@pytest.mark.parametrize("family", ["qwen3", "gemma3-text"])
def test_first_step_loss_and_adapter_gradients_match_peft(family, tmp_path):
    import jax
    import torch

    model = jax_families.save(family, str(tmp_path))
    _, cfg, base = jax_model.load_hf_dir(str(tmp_path))
    peft_model = _peft(model, SETTINGS).train()
    ids, positions, labels = _batch()
    out = peft_model(input_ids=torch.as_tensor(ids).long(), position_ids=torch.as_tensor(positions).long(),
                     labels=torch.as_tensor(labels).long(), use_cache=False)
    out.loss.backward()
    want_grads = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad.numpy()
                  for n, p in peft_model.named_parameters() if "lora_" in n}

    trained = _jax_adapters(peft_model)
    assert set(trained) == {name for w in jax_lora.targeted(cfg, SETTINGS) for name in jax_lora.adapter_names(w)}
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions, "key_mask": np.ones_like(ids)}
    adapters = jax_lora.adapters(SETTINGS)
    loss, grads = jax.value_and_grad(lambda a: jax_model.loss({**base, **a}, cfg, batch, adapters=adapters))(trained)
    assert float(loss) == pytest.approx(float(out.loss), rel=1e-5)
    for name, want in want_grads.items():
        got = np.asarray(grads[name])
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), name
    assert max(np.abs(g).max() for g in want_grads.values()) > 1e-3   # gradients that can differ


def test_dropout_drops_the_adapters_input_only_with_a_key(tmp_path):
    """With a dropout key the loss moves (training); without one (evaluation) it is the no-dropout loss."""
    import dataclasses

    import jax

    model = jax_families.save("qwen3", str(tmp_path))
    _, cfg, base = jax_model.load_hf_dir(str(tmp_path))
    trained = _jax_adapters(_peft(model, SETTINGS))
    ids, positions, labels = _batch()
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions, "key_mask": np.ones_like(ids)}
    plain = float(jax_model.loss({**base, **trained}, cfg, batch, adapters=jax_lora.adapters(SETTINGS)))
    dropping = jax_lora.adapters(dataclasses.replace(SETTINGS, dropout=0.5))
    assert float(jax_model.loss({**base, **trained}, cfg, batch, adapters=dropping)) == pytest.approx(plain, rel=1e-6)
    keyed = float(jax_model.loss({**base, **trained}, cfg, batch, adapters=dropping, rng=jax.random.key(0)))
    assert abs(keyed - plain) > 1e-4


def test_fresh_adapters_start_from_the_bases_outputs(tmp_path):
    jax_families.save("gemma3-text", str(tmp_path))
    _, cfg, base = jax_model.load_hf_dir(str(tmp_path))
    fresh = jax_lora.init(cfg, SETTINGS, {n: base[n].shape for n in jax_lora.targeted(cfg, SETTINGS)}, seed=0)
    a_name, b_name = jax_lora.adapter_names(jax_lora.targeted(cfg, SETTINGS)[0])
    assert fresh[a_name].shape == (4, 32) and not fresh[b_name].any() and fresh[a_name].std() > 0
    ids, positions = jax_families.packed_inputs()
    ones = np.ones_like(ids)
    adapted = jax_model.forward({**base, **fresh}, cfg, ids, positions, ones, adapters=jax_lora.adapters(SETTINGS))
    assert np.array_equal(np.asarray(adapted), np.asarray(jax_model.forward(base, cfg, ids, positions, ones)))


def test_the_export_is_a_peft_folder_that_peft_loads_with_the_same_logits(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tpuft_workload import lora, tiny

    source = tmp_path / "base"
    model = jax_families.save("qwen3", str(source))
    tokenizer = tiny.build_tokenizer()
    hf, cfg, base = jax_model.load_hf_dir(str(source))
    peft_model = _peft(model, SETTINGS).eval()
    trained = _jax_adapters(peft_model)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source))
    dest = lora.write_export(config, jax_lora.peft_state({}, trained, SETTINGS, cfg), tokenizer, SETTINGS,
                             str(source), str(tmp_path / "run"))
    assert (tmp_path / "run" / "export" / "adapter_config.json").is_file() and dest.endswith("export")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(source)), dest).eval()
    ids, positions = jax_families.packed_inputs()
    with torch.no_grad():
        want = loaded(input_ids=torch.as_tensor(ids).long(), position_ids=torch.as_tensor(positions).long(),
                      use_cache=False).logits.numpy()
    got = np.asarray(jax_model.forward({**base, **trained}, cfg, ids, positions, np.ones_like(ids),
                                       adapters=jax_lora.adapters(SETTINGS)))
    assert np.abs(got - want).max() <= 1e-4
