"""tpuft_workload.report's pure parts: status.training.history stays bounded, evenly spaced and ends
at the latest report (and its largest JSON is the budget tpuft.api.constants states); MFU from the
model's FLOPs per token (PaLM's formula), the throughput and the slice's (or GPUs') catalog peak;
and a merge patch replaces the history wholly (RFC 7386), so each one sent is the whole curve."""
from __future__ import annotations

import json

import pytest

from tests.factories import merge_patch
from tpuft.api import catalog
from tpuft.api.constants import HISTORY_MAX_POINTS
from tpuft_workload.report import add_point, flops_per_token, gpu_slice_peak, mfu


def _point(step: int, loss: float = 1.0, tps: float = 100.0) -> dict:
    return {"step": step, "loss": loss, "tokensPerSecond": tps}


def _curve(steps) -> list[dict]:
    history: list[dict] = []
    for s in steps:
        history = add_point(history, _point(s))
    return history


def _steps(history: list[dict]) -> list[int]:
    return [p["step"] for p in history]


@pytest.mark.parametrize("steps,max_points,expected", [
    ([5, 10, 15], 4, [5, 10, 15]),                       # room left: every report
    ([5, 10, 15, 20, 25], 4, [5, 15, 25]),               # full: every other dropped, first and latest kept
    ([5, 10, 15, 20, 25, 30], 4, [5, 15, 25, 30]),       # the latest stands in (gap 5 < spacing 10) ...
    ([5, 10, 15, 20, 25, 30, 35], 4, [5, 15, 25, 35]),   # ... until it is a spacing past the one before
    ([5, 10, 15, 20, 25, 30, 35, 40, 45], 4, [5, 25, 45]),
    ([3, 6, 7, 9, 6, 9], 8, [3, 6, 9]),                  # a restarted attempt reports steps 6 and 9 again
])
def test_history_is_bounded_evenly_spaced_and_ends_at_the_latest(steps, max_points, expected):
    history: list[dict] = []
    for s in steps:
        history = add_point(history, _point(s), max_points)
    assert _steps(history) == expected


def test_a_long_run_keeps_the_first_the_latest_and_one_spacing():
    history = _curve(range(5, 100_001, 5))   # 20000 reports
    steps = _steps(history)
    assert len(history) <= HISTORY_MAX_POINTS and (steps[0], steps[-1]) == (5, 100_000)
    gaps = {b - a for a, b in zip(steps, steps[1:-1])}
    assert len(gaps) == 1 and steps[-1] - steps[-2] <= gaps.pop()   # even spacing, then the latest


def test_the_largest_history_is_the_stated_budget_far_below_etcds_limit():
    """tpuft.api.constants.HISTORY_MAX_POINTS' comment states this size: 7-digit steps, 8-digit tokens/s."""
    history = [_point(9_999_000 + i, 12.34567, 12_345_678.9) for i in range(HISTORY_MAX_POINTS)]
    assert len(json.dumps(history)) == 4352 < 1.5 * 2**20 / 100


def test_a_merge_patch_replaces_the_history_wholly():
    status = {"training": {"loss": 2.0, "history": [_point(1), _point(2), _point(3)]}}
    merge_patch(status, {"training": {"loss": 1.5, "history": [_point(1), _point(3)]}})
    assert status["training"] == {"loss": 1.5, "history": [_point(1), _point(3)]}


LLAMA = {"num_hidden_layers": 16, "num_attention_heads": 32, "hidden_size": 2048}   # head dim 64 from hidden_size
GEMMA3N = {"text_config": {"num_hidden_layers": 30, "num_attention_heads": 8, "head_dim": 256, "hidden_size": 2048}}


@pytest.mark.parametrize("parameters,config,seq_len,expected", [
    (1_000, {}, 512, 6_000),                                                  # no attention shape: 6N alone
    (1_000_000_000, LLAMA, 1024, 6e9 + 12 * 16 * 32 * 64 * 1024),            # 6N + 12·L·H·Q·T
    (1_000_000_000, LLAMA, 2048, 6e9 + 12 * 16 * 2048 * 2048),               # attention grows with T
    (5_000_000_000, GEMMA3N, 512, 3e10 + 12 * 30 * 8 * 256 * 512),           # head_dim given; text_config is the decoder
])
def test_flops_per_token_is_palms_formula(parameters, config, seq_len, expected):
    assert flops_per_token(parameters, config, seq_len) == expected


def test_mfu_is_model_flops_per_second_over_the_slice_peak():
    v6e = catalog.resolve_slice("v6e", "4x4")
    assert v6e.peak_flops == 16 * 918e12
    # 12e9 FLOPs per token at 400k tokens/s on 16 v6e chips: 4.8e15 / 1.4688e16
    assert mfu(12e9, 400_000.0, v6e.peak_flops) == 0.3268
    assert mfu(60, 1.0, catalog.resolve_slice("tpu7x", "2x2x1").peak_flops) == pytest.approx(60 / (4 * 2307e12), rel=1e-3)


@pytest.mark.parametrize("peak", [None, 0.0])
def test_without_a_peak_there_is_no_mfu(peak):
    assert catalog.resolve_slice("cpu", "2").peak_flops is None   # CPU: no peak in the catalog
    assert mfu(6e6, 5_000.0, peak) is None


@pytest.mark.parametrize("device,devices,peak", [
    ("NVIDIA H100 80GB HBM3", 8, 8 * 989e12),   # one GPU per worker: the run's peak is theirs summed
    ("NVIDIA L4", 2, 2 * 121e12),
    ("Tesla T4", 4, None),                       # a GPU the catalog does not list: no peak, no MFU
])
def test_a_gpu_runs_peak_is_its_devices_times_the_catalogs(device, devices, peak):
    assert gpu_slice_peak(device, devices) == peak
