"""One training objective on torch and JAX: the global batch's mean loss per labelled token (no Ray).

Two gloo ranks (torch.multiprocessing, spawned) take the torch step's loss and backward
(tpuft_workload.model.token_mean_loss) under FSDP2 over one slice and HSDP over two, each rank on
one row of the same global batch: rows of very unequal labelled tokens, or rank 1's of prompt only.
Their gradient is the one-process gradient of the whole batch's mean loss per labelled token (and
JAX's), and the loss they report (a loop.Window summed over the ranks) is that mean, as JAX's step
reports it on the same batch.

Gradient accumulation: the torch backend's whole step (train._Torch.step: the rate set, the
objective over every micro-batch of every rank, clipping) on a 4-row global batch, each rank's 2
rows as one batch or as 2 micro-batches of 1, lands on the parameters of one process stepping on
all 4 rows, and reports its loss and gradient norm.

Tolerance: float32, the same sums in another order. Measured (2026-12-06; rows of 52 and 4 labelled
tokens, gradients up to 0.24): both layouts' gradients within 3.8e-8 of the one-process one, JAX's
within 4.5e-8, the reported losses within 9e-8 relative; the ranks' own means averaged differ by
0.35 (a loss of 5.364 against the token mean's 5.333). Accumulated (2026-12-06, an SGD step of 0.1 on
a gradient of norm 1.82 clipped to 1): parameters within 7.5e-9, gradient norms within 7e-8 relative.
"""
from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.ranks import file_rendezvous
from tests.workload.inprocess_data import build_blocks, collate, load_records  # noqa: E402
from tpuft_workload import loop, tiny  # noqa: E402
from tpuft_workload import model as modellib  # noqa: E402
from tpuft_workload.platform import PLATFORMS  # noqa: E402

CPU = PLATFORMS["cpu"]
WORLD, SEED, MAX_LEN = 2, 0, 64
GRAD_ATOL, LOSS_REL = 1e-6, 1e-5
CASES = ("unequal", "prompt only")
ACCUMULATED = "four rows"   # the accumulation tests' global batch
INPUTS = ("input_ids", "labels", "position_ids")
ACCUMULATION, LR, WEIGHT_DECAY, MAX_GRAD_NORM = 2, 0.1, 0.1, 1.0
PARAM_ATOL = 5e-8   # an SGD step of the same clipped gradient, float32 sums in another order


def _global_batches() -> dict[str, dict]:
    """Two packed rows each, rank r's is row r. unequal: the rows with the most and the fewest
    labelled tokens; prompt only: the same, rank 1's labels all -100."""
    blocks = build_blocks(tiny.build_tokenizer(), load_records(tiny.BUILTIN_DATASET, "train[:96]"),
                               MAX_LEN, packing=True)
    counts = [sum(label != -100 for label in b.labels[1:]) for b in blocks]
    most = max(range(len(blocks)), key=counts.__getitem__)
    fewest = min((i for i in range(len(blocks)) if counts[i]), key=counts.__getitem__)
    assert counts[most] >= 10 * counts[fewest]
    unequal = {**collate(blocks, [most, fewest]),
               "n_real": torch.tensor([blocks[i].n_real for i in (most, fewest)])}
    prompt_only = {k: v.clone() for k, v in unequal.items()}
    prompt_only["labels"][1] = -100
    by_count = sorted((i for i in range(len(blocks)) if counts[i]), key=counts.__getitem__)
    four = [by_count[-1], by_count[0], by_count[len(by_count) // 2], by_count[-2]]   # unequal again
    four_rows = {**collate(blocks, four), "n_real": torch.tensor([blocks[i].n_real for i in four])}
    return {"unequal": unequal, "prompt only": prompt_only, ACCUMULATED: four_rows}


def _inputs(rows: dict) -> dict:
    return {k: rows[k] for k in INPUTS}


def _sum_over_ranks(values: list) -> list[float]:
    """What the torch backend's totals does: each value summed over the ranks."""
    t = torch.tensor([float(v) for v in values])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _rank(rank: int, rendezvous: str, vocab: int, batches: dict, out: str) -> None:
    """One of two gloo ranks: for each global batch and each layout, the torch step's backward from
    fresh weights on row `rank`; rank 0 saves the full gradients and the reported loss."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    result = {}
    for case in CASES:
        rows = batches[case]
        mine = {k: v[rank:rank + 1] for k, v in _inputs(rows).items()}
        for slices in (1, 2):
            model = tiny.build_model(vocab, seed=SEED)
            modellib.shard(model, modellib.device_mesh(CPU, WORLD, slices), CPU, torch.device("cpu"))
            loss_sum, labelled = modellib.token_mean_loss(model, [mine])
            window = loop.Window(_sum_over_ranks)
            window.add(loop.Step(loss_sum=loss_sum, labelled=labelled, real=0, padded=1, grad_norm=0.0))
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}   # collective
            result[case, slices] = {"loss": window.reduce()["loss"], "grads": grads,
                                    "mesh": list(model.model.embed_tokens.weight.device_mesh.shape)}
    result |= _accumulated(rank, vocab, batches[ACCUMULATED])
    result["evaluated"] = _evaluated(rank, vocab, _eval_rows(batches))
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def _torch_backend(model, mesh, rows_per_micro_batch: int, accumulated: bool):
    """The torch backend's step (train._Torch.step) over `model`, without Ray: only what step reads."""
    from types import SimpleNamespace

    from tpuft.api.spec import Training
    from tpuft_workload import train

    backend = object.__new__(train._Torch)
    backend.cfg = SimpleNamespace(training=Training(packing=True, max_grad_norm=MAX_GRAD_NORM,
                                                    batch_size_per_device=rows_per_micro_batch, max_seq_length=MAX_LEN))
    backend.model, backend.device = model, torch.device("cpu")
    backend.params = modellib.shard(model, mesh, CPU, backend.device)
    backend.opt = torch.optim.SGD(backend.params, lr=1.0)   # step() sets the rate
    backend.defer_all_reduce = accumulated and mesh.ndim > 1
    return backend


def _eval_rows(batches: dict) -> dict:
    """Five rows as the pipeline shares them (numpy): a global batch of 2 ranks x 2 rows, and one
    with a single row (the rest filled by rows without a label)."""
    rows = {k: torch.cat([batches[ACCUMULATED][k], batches["unequal"][k][:1]]) for k in (*INPUTS, "n_real")}
    return {k: v.numpy().astype(np.int32) for k, v in rows.items()}


def _evaluated(rank: int, vocab: int, rows: dict) -> tuple[float, float]:
    """The torch backend's evaluate over `rows` (batches of 2 a rank), from fresh weights."""
    model = tiny.build_model(vocab, seed=SEED)
    backend = _torch_backend(model, modellib.device_mesh(CPU, WORLD, 1), 2, False)
    backend.eval_rows, backend.rank, backend.world = rows, rank, WORLD
    return backend.evaluate()


def _accumulated(rank: int, vocab: int, rows: dict) -> dict:
    """One optimizer step of the 4-row global batch, rank r on rows 2r and 2r+1: as one batch of 2,
    and as 2 micro-batches of 1 (`ACCUMULATION`), under FSDP and HSDP: (the reported loss, the
    parameters after the step, the gradient norm before clipping)."""
    mine = {k: v[2 * rank:2 * rank + 2] for k, v in rows.items()}
    out = {}
    for slices in (1, 2):
        for k in (1, ACCUMULATION):
            model = tiny.build_model(vocab, seed=SEED)
            backend = _torch_backend(model, modellib.device_mesh(CPU, WORLD, slices), 2 // k, k > 1)
            micro = [{key: v[i * (2 // k):(i + 1) * (2 // k)] for key, v in mine.items()} for i in range(k)]
            window = loop.Window(_sum_over_ranks)
            step = backend.step(micro, LR)
            window.add(step)
            out["accumulated", slices, k] = {"loss": window.reduce()["loss"], "grad_norm": step.grad_norm.item(),
                                             "params": {n: p.full_tensor() for n, p in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def vocab() -> int:
    return len(tiny.build_tokenizer())


@pytest.fixture(scope="module")
def batches() -> dict[str, dict]:
    return _global_batches()


@pytest.fixture(scope="module")
def two_ranks(vocab, batches, tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("objective") / "result.pt")
    rendezvous = file_rendezvous(tmp_path_factory.mktemp("rendezvous"))
    mp.start_processes(_rank, args=(rendezvous, vocab, batches, out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


def _one_process(vocab: int, rows: dict) -> tuple[float, dict]:
    """(loss, gradients) of the whole batch in one process: transformers' mean over its labelled tokens."""
    model = tiny.build_model(vocab, seed=SEED)
    loss = model(**rows).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("slices", [1, 2], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_gradient_is_the_global_token_means(two_ranks, vocab, batches, case, slices):
    got = two_ranks[case, slices]
    assert got["mesh"] == ([2] if slices == 1 else [2, 1])
    _, want = _one_process(vocab, _inputs(batches[case]))
    assert _max_diff(got["grads"], want) <= GRAD_ATOL


def test_the_ranks_own_means_would_be_another_objective(two_ranks, vocab, batches):
    """Each rank's mean over its own tokens, averaged over the ranks (what FSDP2 makes of transformers'
    default loss): a gradient far outside the tolerance, so the test above can fail."""
    rows = _inputs(batches["unequal"])
    per_rank = [_one_process(vocab, {k: v[r:r + 1] for k, v in rows.items()})[1] for r in range(WORLD)]
    averaged = {n: sum(g[n] for g in per_rank) / WORLD for n in per_rank[0]}
    assert _max_diff(averaged, two_ranks["unequal", 1]["grads"]) > 100 * GRAD_ATOL


@pytest.mark.parametrize("case", CASES)
def test_torch_and_jax_report_the_same_first_step_loss(two_ranks, vocab, batches, case):
    """The report of the first step (a loop.Window of one step) from the two torch ranks under each
    layout, from JAX's step on the same global batch, and the one-process mean: one number. JAX's
    gradient is the one-process torch gradient too."""
    import jax

    from tpuft_workload import jax_model as jm
    from tpuft_workload import jax_train as jt

    rows = batches[case]
    want, torch_grads = _one_process(vocab, _inputs(rows))
    for slices in (1, 2):
        assert two_ranks[case, slices]["loss"] == pytest.approx(want, rel=LOSS_REL)
    _, mcfg, params = jm.from_torch(tiny.build_model(vocab, seed=SEED))
    batch = {**jm.inputs_from_rows({k: v.numpy() for k, v in rows.items()}, packing=True),
             "n_real": rows["n_real"].numpy().astype(np.int32)}
    tx = jt.optimizer(params, WEIGHT_DECAY, MAX_GRAD_NORM)
    one_micro_batch = {k: v[None] for k, v in batch.items()}
    _, _, sums, _ = jax.jit(partial(jt.train_step, tx, mcfg, None, False))(params, tx.init(params), one_micro_batch, LR)
    window = loop.Window(lambda values: [float(v) for v in values])   # the JAX backend's totals
    window.add(loop.Step(loss_sum=sums["loss_sum"], labelled=sums["labelled"], real=sums["real"], padded=1,
                         grad_norm=0.0))
    assert window.reduce()["loss"] == pytest.approx(want, rel=LOSS_REL)
    jax_grads = jax.jit(jax.grad(lambda p: jm.loss(p, mcfg, batch)))(params)
    assert _max_diff({n: torch.tensor(np.asarray(g)) for n, g in jax_grads.items()}, torch_grads) <= GRAD_ATOL


def _one_process_step(vocab: int, rows: dict) -> tuple[float, float, dict]:
    """(loss, gradient norm before clipping, parameters after the step) of the whole batch in one
    process: transformers' mean over its labelled tokens, clipped, an SGD step (its update is the
    clipped gradient: Adam's first step is about its sign, blind to a wrong scale)."""
    model = tiny.build_model(vocab, seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = model(**rows).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    opt.step()
    return loss.item(), norm.item(), {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("slices", [1, 2], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("k", [1, ACCUMULATION], ids=["one batch of 2", "2 micro-batches of 1"])
def test_k_micro_batches_step_as_one_batch_k_times_larger(two_ranks, vocab, batches, slices, k):
    """The torch backend's step on two ranks, each with 2 rows of unequal labelled tokens, as one batch
    or as 2 accumulated micro-batches (HSDP: the all-reduce across slices deferred to the last): the
    loss it reports is the whole batch's token mean, its gradient norm and the parameters after the
    step are those of one process stepping on all 4 rows at once."""
    got = two_ranks["accumulated", slices, k]
    want_loss, want_norm, want_params = _one_process_step(vocab, _inputs(batches[ACCUMULATED]))
    assert got["loss"] == pytest.approx(want_loss, rel=LOSS_REL)
    assert got["grad_norm"] == pytest.approx(want_norm, rel=LOSS_REL) and want_norm > MAX_GRAD_NORM   # clipped
    assert _max_diff(got["params"], want_params) <= PARAM_ATOL


def test_the_one_process_step_moves_the_parameters(vocab, batches):
    """So the test above could fail: one step moves the parameters by far more than its tolerance."""
    _, _, stepped = _one_process_step(vocab, _inputs(batches[ACCUMULATED]))
    fresh = dict(tiny.build_model(vocab, seed=SEED).named_parameters())
    assert _max_diff({n: p.detach() for n, p in fresh.items()}, stepped) > 100 * PARAM_ATOL


def test_evaluate_scores_every_eval_row_once_over_the_ranks(two_ranks, vocab, batches):
    """Five rows on 2 ranks x 2 a batch: the second batch's three rows past the end score nothing;
    the sum over the ranks is one process's summed loss and labelled tokens of the five."""
    rows = {k: torch.from_numpy(v.astype("int64")) for k, v in _eval_rows(batches).items()}
    model = tiny.build_model(vocab, seed=SEED)
    with torch.no_grad():
        loss = model(**_inputs(rows)).loss.item()
    labelled = modellib.labelled_tokens(rows["labels"]).item()
    got_sum, got_labelled = two_ranks["evaluated"]
    assert got_labelled == labelled and got_sum / got_labelled == pytest.approx(loss, rel=LOSS_REL)
