"""Rank 0's metrics: as TensorBoard event files, {storagePath}/{run}/tensorboard
(tpuft.api.constants.TENSORBOARD_DIR), one point per metric per report, for `tensorboard --logdir`;
and as Prometheus gauges (`Prometheus`, below) while the run lives.

Written with tensorboardX (Ray Train's own dependency; torch.utils.tensorboard would need the
`tensorboard` package). Each attempt writes its own event file; one that starts at step S (0, or
the checkpoint it resumed from) purges what earlier attempts logged past S (TensorBoard hides those
points: they are trained again), so the curve has no doubled steps. On object storage (gs://) the
files are written to a local folder and copied up at every checkpoint, at the first report at least
SYNC_EVERY_S seconds after the last copy, and at the end: a worker killed outright loses at most
that window's points. Anything that goes wrong here is logged once and turns the writer off:
metrics never kill a run.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time

from tpuft.api.constants import TENSORBOARD_DIR, TRAIN_METRIC_TAG, TrainMetric

log = logging.getLogger(__name__)
SYNC_EVERY_S = 60.0

# TensorBoard tag -> the report's key (a loop.Window.reduce() result plus mfu when known; an epoch's
# end adds its mean loss, an evaluation its loss and perplexity)
SCALARS = {
    "train/loss": "loss",   # each report interval's mean: never an epoch's
    "train/epoch_loss": "epoch_loss",
    "eval/loss": "eval_loss",
    "eval/perplexity": "eval_perplexity",
    "train/grad_norm": "grad_norm",
    "train/tokens_per_second": "tokens_per_s",
    "train/padded_tokens_per_second": "padded_tokens_per_s",
    "train/step_time_seconds": "step_time_s",
    "train/mfu": "mfu",
}


def logdir(run_dir: str) -> str:
    return f"{run_dir.rstrip('/')}/{TENSORBOARD_DIR}"


class TensorBoard:
    """The event file of one attempt, created at its first report (an attempt with nothing left to
    train writes none); a no-op unless `enabled` (rank 0)."""

    def __init__(self, run_dir: str, enabled: bool, resumed_at: int = 0, sync_every_s: float = SYNC_EVERY_S,
                 clock=time.monotonic):
        self.dest = logdir(run_dir)
        self.remote = "://" in self.dest
        self.enabled, self.resumed_at = enabled, resumed_at
        self._sync_every_s, self._clock = sync_every_s, clock
        self._synced_at = clock()
        self._tmp = None
        self._writer = None

    def _open(self):
        from tensorboardX import SummaryWriter

        if self.remote:
            self._tmp = tempfile.TemporaryDirectory(prefix="tpuft-tensorboard-")
        # the file's name is its second and host; the pid and the start step tell attempts within one apart
        return SummaryWriter(self._tmp.name if self.remote else self.dest, purge_step=self.resumed_at + 1,
                             filename_suffix=f".{os.getpid()}.s{self.resumed_at:07d}")

    def _off(self, e: Exception) -> None:
        log.warning("TensorBoard events for %s are off: %s: %s", self.dest, type(e).__name__, e)
        self.enabled, self._writer = False, None

    def add(self, step: int, metrics: dict, learning_rate: float) -> None:
        """One report's scalars at `step` (flushed: a worker killed later keeps them)."""
        if not self.enabled:
            return
        try:
            self._writer = self._writer or self._open()
            for tag, key in SCALARS.items():
                if metrics.get(key) is not None:
                    self._writer.add_scalar(tag, float(metrics[key]), step)
            self._writer.add_scalar("train/learning_rate", learning_rate, step)   # the latest step's
            self._writer.flush()
        except Exception as e:  # noqa: BLE001
            self._off(e)
            return
        if self.remote and self._clock() - self._synced_at >= self._sync_every_s:
            self.sync()

    def sync(self) -> None:
        """On object storage: copy the event files up (at checkpoints and every SYNC_EVERY_S; whole at
        `close`). tensorboardX writes from a thread of its own, so a flushed file may still lack the
        last records: the next sync, or the close, carries them."""
        if self._writer is None or not self.remote:
            return
        try:
            self._writer.flush()
        except Exception as e:  # noqa: BLE001
            self._off(e)
            return
        self._upload()

    def _upload(self) -> None:
        from tpuft_workload import checkpoint as ckptlib

        try:
            ckptlib.upload_dir(self._tmp.name, self.dest)
            self._synced_at = self._clock()
        except Exception as e:  # noqa: BLE001
            self._off(e)

    def close(self) -> None:
        """The writer closed first (its thread joined: every record is in the file), then, on object
        storage, the whole file uploaded."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            if self.remote and self.enabled:
                self._upload()
        if self._tmp is not None:
            self._tmp.cleanup()


# gauge -> the report's key (a loop.Window.reduce() result plus mfu when known, and the step)
GAUGES = {
    TrainMetric.TOKENS_PER_SECOND: "tokens_per_s",
    TrainMetric.STEP_TIME_SECONDS: "step_time_s",
    TrainMetric.LOSS: "loss",
    TrainMetric.MFU: "mfu",
    TrainMetric.STEP: "step",
}
DESCRIPTIONS = {
    TrainMetric.TOKENS_PER_SECOND: "Real (unpadded) tokens per second over the whole slice, last report interval.",
    TrainMetric.STEP_TIME_SECONDS: "Seconds per optimizer step, last report interval (reports and checkpoints excluded).",
    TrainMetric.LOSS: "Mean training loss (cross-entropy, nats per token), last report interval.",
    TrainMetric.MFU: "Model FLOPs utilisation, 0 to 1 (status.training.mfu; absent without a catalog peak).",
    TrainMetric.STEP: "Optimizer steps done.",
}


class Prometheus:
    """Rank 0's gauges through ray.util.metrics: Ray's metrics agent on the worker's node exports
    them (as ray_<name>, tpuft.api.constants.TrainMetric.exported) on the pod's metrics port, where the
    chart's PodMonitor scrapes them. A no-op unless `enabled`; a failure logs once and turns it off.
    `gauge` makes one (tests pass a stand-in)."""

    def __init__(self, enabled: bool, tag: str = "", gauge=None):
        self.enabled, self.tags = enabled, {TRAIN_METRIC_TAG: tag}
        self._gauge, self._gauges = gauge, None

    def _open(self) -> dict:
        make = self._gauge
        if make is None:
            from ray.util.metrics import Gauge

            make = Gauge
        return {m: make(m.value, description=DESCRIPTIONS[m], tag_keys=(TRAIN_METRIC_TAG,)) for m in GAUGES}

    def add(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        try:
            self._gauges = self._gauges or self._open()
            values = {**metrics, "step": step}
            for m, key in GAUGES.items():
                if values.get(key) is not None:
                    self._gauges[m].set(float(values[key]), tags=self.tags)
        except Exception as e:  # noqa: BLE001 - metrics never kill a run
            log.warning("Prometheus gauges are off: %s: %s", type(e).__name__, e)
            self.enabled = False
