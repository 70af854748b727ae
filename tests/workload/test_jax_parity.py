"""The parity table of docs/jax.md: each family's JAX logits against transformers' torch forward
pass on the same saved weights, float32, packed rows (block-diagonal attention from position_ids
that restart per example) and padded rows. A family passes at max |difference| <= 1e-4, or the
JAX path refuses it by name. `pytest -s` prints one `parity:` line per family.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.workload import jax_families  # noqa: E402
from tpuft_workload import jax_model  # noqa: E402

TOLERANCE = 1e-4
PASSING = ["llama-3.x", "mistral", "qwen2.5", "qwen3", "gemma", "gemma2", "gemma3-text"]


def _torch_logits(model, ids, positions=None, mask=None):
    import torch

    # use_cache False as the torch path trains (tpuft_workload.model): with a cache transformers
    # does not read packing from position_ids
    args = {"input_ids": torch.as_tensor(ids, dtype=torch.long), "use_cache": False}
    if positions is not None:
        args["position_ids"] = torch.as_tensor(positions, dtype=torch.long)
    if mask is not None:
        args["attention_mask"] = torch.as_tensor(mask, dtype=torch.long)
    with torch.no_grad():
        return model(**args).logits.float().numpy()


@pytest.fixture(scope="module", params=PASSING)
def family(request, tmp_path_factory):
    """(family, its transformers model, (hf, cfg, params) loaded back from the saved folder)."""
    directory = tmp_path_factory.mktemp(request.param)
    model = jax_families.save(request.param, str(directory))
    return request.param, model, jax_model.load_hf_dir(str(directory))


def test_packed_logits_match_transformers(family):
    name, model, (_, cfg, params) = family
    ids, positions = jax_families.packed_inputs()
    want = _torch_logits(model, ids, positions)
    got = np.asarray(jax_model.forward(params, cfg, ids, positions, np.ones_like(ids)))
    diff = float(np.abs(got - want).max())
    print(f"\nparity: {name} | tpuft jax_model | packed | {diff:.1e}")
    assert diff <= TOLERANCE, (name, diff)


def test_padded_logits_match_transformers_where_tokens_are_real(family):
    name, model, (_, cfg, params) = family
    ids, _ = jax_families.packed_inputs()
    mask = np.ones_like(ids)
    mask[0, 17:] = 0
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    want = _torch_logits(model, ids, mask=mask)
    got = np.asarray(jax_model.forward(params, cfg, ids, positions, mask))
    diff = float(np.abs(got - want)[mask.astype(bool)].max())
    print(f"\nparity: {name} | tpuft jax_model | padded | {diff:.1e}")
    assert diff <= TOLERANCE, (name, diff)


# What each family's distinctive piece is, removed: the logits must move past the tolerance, so
# the parity above rests on that piece being implemented, not on it vanishing at these sizes.
WITHOUT = {
    "llama-3.x": lambda c: dataclasses.replace(c, ropes=tuple(jax_model.Rope(r.theta) for r in c.ropes)),
    "mistral": lambda c: dataclasses.replace(c, windows=(None,) * c.num_layers),
    "qwen2.5": lambda c: dataclasses.replace(c, biased=()),
    "gemma2": lambda c: dataclasses.replace(c, attention_softcap=None, final_softcap=None),
    "gemma3-text": lambda c: dataclasses.replace(c, windows=(None,) * c.num_layers),
}


@pytest.mark.parametrize("name", sorted(WITHOUT))
def test_each_familys_distinctive_piece_changes_the_logits(name, tmp_path):
    jax_families.save(name, str(tmp_path))
    _, cfg, params = jax_model.load_hf_dir(str(tmp_path))
    reduced = WITHOUT[name](cfg)
    kept = {k: v for k, v in params.items() if k in set(jax_model.param_names(reduced))}
    ids, positions = jax_families.packed_inputs()
    ones = np.ones_like(ids)
    full = np.asarray(jax_model.forward(params, cfg, ids, positions, ones))
    without = np.asarray(jax_model.forward(kept, reduced, ids, positions, ones))
    assert np.abs(full - without).max() > 10 * TOLERANCE


def test_gemma4_is_refused_by_name(tmp_path):
    """No candidate passes Gemma 4 (docs/jax.md): the refusal names it and says what to do."""
    jax_families.save("gemma4-text", str(tmp_path))
    with pytest.raises(jax_model.ModelError) as err:
        jax_model.load_hf_dir(str(tmp_path))
    message = str(err.value)
    assert "Gemma 4" in message and "training.framework torch" in message, message
    print(f"\nparity: gemma4-text | tpuft jax_model | refused | {message}")


def test_the_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    """save_hf writes what the family's transformers class loads back (the torch path, the server)."""
    from transformers import AutoModelForCausalLM

    name, model, (hf, cfg, params) = family
    jax_model.save_hf(params, hf, str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert type(again).__name__ == jax_model.hf_class(hf)
    ids, positions = jax_families.packed_inputs()
    # the same float32 weights; the reloaded model attends by sdpa, the original eagerly: 1e-6
    assert np.abs(_torch_logits(again, ids, positions) - _torch_logits(model, ids, positions)).max() < 1e-6, name


@pytest.mark.parametrize("name", ["gemma3-text", "qwen3"])
def test_a_saved_family_model_trains_through_the_jax_step(name, tmp_path):
    """The JAX path's own step (jax_train.train_step, its optimizer) on a model read as a worker reads
    it (open_hf_dir, shard by shard): 20 steps on two packed rows, the loss falls by half."""
    import jax

    from tpuft_workload import jax_train

    jax_families.save(name, str(tmp_path))
    _, cfg, tensors = jax_model.open_hf_dir(str(tmp_path))
    params = {n: jax.numpy.asarray(np.asarray(t)) for n, t in tensors.items()}
    tensors.close()
    ids, positions = jax_families.packed_inputs()
    batch = {"input_ids": ids[None], "labels": ids[None], "position_ids": positions[None],
             "key_mask": np.ones_like(ids)[None], "n_real": np.full((1, 2), 24, np.int32)}
    tx = jax_train.optimizer(params, weight_decay=0.0, max_grad_norm=1.0)
    state = tx.init(params)
    step = jax.jit(lambda p, s, b: jax_train.train_step(tx, cfg, None, False, p, s, b, np.float32(1e-2)))
    losses = []
    for _ in range(20):
        params, state, sums, _ = step(params, state, batch)
        losses.append(float(sums["loss_sum"]) / int(sums["labelled"]))
    print(f"\n{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in 20 steps")
    assert losses[-1] < 0.5 * losses[0], losses
