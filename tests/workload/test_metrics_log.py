"""tpuft_workload.metrics_log, no Ray: rank 0's scalars land in {run}/tensorboard, an attempt resumed
at step S hides what earlier attempts logged past S, an attempt with nothing to report writes no
file, and other ranks write nothing."""
from __future__ import annotations

from tests.factories import tensorboard_scalars
from tpuft_workload.metrics_log import TensorBoard

M = {"loss": 2.0, "grad_norm": 1.5, "tokens_per_s": 100.0, "padded_tokens_per_s": 110.0, "step_time_s": 0.2,
     "mfu": None}


def test_an_attempt_resumed_at_s_hides_what_earlier_ones_logged_past_s(tmp_path):
    first = TensorBoard(str(tmp_path), enabled=True)
    for step, loss in ((3, 2.0), (6, 1.5), (7, 1.375)):   # killed after step 7; the checkpoint is step 6
        first.add(step, {**M, "loss": loss}, 3e-3)
    again = TensorBoard(str(tmp_path), enabled=True, resumed_at=6)
    again.add(9, {**M, "loss": 1.25}, 3e-3)
    again.close()
    files, scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert files == 2 and scalars["train/loss"] == [(3, 2.0), (6, 1.5), (9, 1.25)]   # exact in float32
    assert {"train/grad_norm", "train/tokens_per_second", "train/padded_tokens_per_second",
            "train/step_time_seconds", "train/learning_rate"} <= set(scalars)
    assert "train/mfu" not in scalars   # None: not written


def test_nothing_reported_or_another_rank_writes_no_file(tmp_path):
    TensorBoard(str(tmp_path), enabled=True, resumed_at=12).close()   # resumed at the last step
    other = TensorBoard(str(tmp_path), enabled=False)
    other.add(3, M, 3e-3)
    other.close()
    assert not (tmp_path / "tensorboard").exists()
