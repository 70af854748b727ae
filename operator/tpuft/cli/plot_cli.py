"""`tpuft plot NAME [-n NS] -o loss.png [--source auto|status|tensorboard]`: a run's loss (and, with
spec.evaluation, its eval loss) and throughput per optimizer step, as a PNG or SVG (by the output's
suffix; matplotlib, imported only here: the `local` extra). `tpuft plot --logdir DIR -o loss.png`
draws a run's TensorBoard folder without a cluster (a run of `python -m tpuft_workload train`).

Two sources, both written by the workload's rank 0:
  * status.training.history: at most HISTORY_MAX_POINTS (step, loss, tokensPerSecond, evalLoss
    when evaluated there) points, downsampled (tpuft_workload.report.add_point); read with the
    user's own kubectl;
  * the TensorBoard event files under {storagePath}/{run}/tensorboard (tpuft_workload.metrics_log):
    every report and evaluation, read from the bucket for a gs:// storagePath (tpuft.cli.object_store:
    pyarrow and the user's Google credentials) or from the disk when that folder is readable here
    (the local cluster's hostPath).
auto (the default) takes the event files when they can be read, else the history (saying why on
stderr when the bucket could not be read).

The event files are read by `read_events`, standard library only: TFRecord framing and the few
protobuf fields of tensorboard's Event and Summary a scalar uses, so neither tensorboard nor
protobuf is needed on the laptop.
"""
from __future__ import annotations

import argparse
import enum
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tpuft.controller import builders
from tpuft.cli import kubectl, object_store
from tpuft.api import constants as c
from tpuft.cli.logs_cli import built_from

# tpuft_workload.metrics_log's tags (that module needs the workload's dependencies; one test ties them)
LOSS_TAG = "train/loss"
TOKENS_TAG = "train/tokens_per_second"
EVAL_LOSS_TAG = "eval/loss"
LOSS_LABEL = "loss (cross-entropy, nats per token)"
TOKENS_LABEL = "throughput (real tokens/s, whole slice)"
STEP_LABEL = "optimizer step"
EVENT_FILE_PREFIX = "events.out.tfevents."   # tensorboardX's file names


class Source(str, enum.Enum):
    AUTO = "auto"
    STATUS = "status"
    TENSORBOARD = "tensorboard"


class NoPlot(RuntimeError):
    """Nothing to plot: the message says why and what to do."""


@dataclass(frozen=True)
class Series:
    """Loss, eval loss (none without spec.evaluation) and throughput per step, as plotted; `source`
    says where they came from."""
    steps: tuple[int, ...]
    loss: tuple[float, ...]
    tokens_steps: tuple[int, ...]
    tokens_per_second: tuple[float, ...]
    source: str
    eval_steps: tuple[int, ...] = ()
    eval_loss: tuple[float, ...] = ()


def from_history(history: list[dict]) -> Series:
    """Pure: status.training.history as a Series (points without a number are left out)."""
    s = c.HistoryPoint.STEP.value

    def points(key: c.HistoryPoint) -> list[tuple[int, float]]:
        return [(p[s], float(p[key.value])) for p in history
                if isinstance(p.get(s), int) and isinstance(p.get(key.value), (int, float))]

    loss, tps, ev = (points(k) for k in (c.HistoryPoint.LOSS, c.HistoryPoint.TOKENS_PER_SECOND, c.HistoryPoint.EVAL_LOSS))
    return Series(*_columns(loss), *_columns(tps), f"status.training.history ({len(history)} points, downsampled)",
                  *_columns(ev))


def from_events(scalars: dict[str, list[tuple[int, float]]], where: str) -> Series:
    """Pure: read_events' scalars as a Series."""
    return Series(*_columns(scalars.get(LOSS_TAG, [])), *_columns(scalars.get(TOKENS_TAG, [])),
                  f"TensorBoard events in {where}", *_columns(scalars.get(EVAL_LOSS_TAG, [])))


def _columns(points: list[tuple[int, float]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return tuple(s for s, _ in points), tuple(v for _, v in points)


# --- TensorBoard event files ---------------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes for
    length-delimited fields and the fixed 32/64-bit ones."""
    i = 0
    while i < len(buf):
        val: int | bytes
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not read here")
        yield num, wire, val


# tensorboard/compat/proto: Event.step = 2, .summary = 5, .session_log = 7; Summary.value = 1;
# Summary.Value.tag = 1, .simple_value = 2 (float); SessionLog.status = 1, START = 1.
def _event(record: bytes) -> tuple[int, list[tuple[str, float]], bool]:
    """(step, [(tag, simple_value)], whether it is a SessionLog START)."""
    step, values, start = 0, [], False
    for num, wire, val in _fields(record):
        if num == 2 and wire == 0:
            step = val - (1 << 64) if val >= 1 << 63 else val
        elif num == 5 and wire == 2:
            for vnum, vwire, value in _fields(val):
                if vnum != 1 or vwire != 2:
                    continue
                tag, simple = None, None
                for fnum, fwire, f in _fields(value):
                    if fnum == 1 and fwire == 2:
                        tag = f.decode("utf-8", "replace")
                    elif fnum == 2 and fwire == 5:
                        simple = struct.unpack("<f", f)[0]
                if tag is not None and simple is not None:
                    values.append((tag, simple))
        elif num == 7 and wire == 2:
            start = any(n == 1 and w == 0 and v == 1 for n, w, v in _fields(val))
    return step, values, start


def read_events(logdir: str | os.PathLike) -> tuple[int, dict[str, list[tuple[int, float]]]]:
    """(event files, tag -> [(step, value)]) in the folder `logdir` (`scalars_of`)."""
    files = sorted(Path(logdir).glob(EVENT_FILE_PREFIX + "*"))
    return len(files), scalars_of(path.read_bytes() for path in files)


def read_bucket_events(uri: str) -> tuple[int, dict[str, list[tuple[int, float]]]]:
    """(event files, tag -> [(step, value)]) directly under the gs:// prefix `uri` (`scalars_of`);
    object_store.StoreError when the bucket cannot be read here."""
    prefix = uri.rstrip("/") + "/"
    files = [u for u in object_store.list_files(uri)
             if u.startswith(prefix + EVENT_FILE_PREFIX) and "/" not in u[len(prefix):]]
    return len(files), scalars_of(object_store.read_bytes(u) for u in files)


def events_at(where: str) -> tuple[int, dict[str, list[tuple[int, float]]]]:
    """`read_bucket_events` for a gs:// prefix, else `read_events`."""
    return read_bucket_events(where) if object_store.is_remote(where) else read_events(where)


def scalars_of(files: Iterable[bytes]) -> dict[str, list[tuple[int, float]]]:
    """Pure: tag -> [(step, value)] of event files as TensorBoard shows them: `files` in name order
    (their names start with the creation time), a SessionLog START at step S (an attempt resumed at
    S-1: tensorboardX's purge_step) hiding what earlier files logged at S or later. A truncated last
    record (a writer killed mid-write) ends that file; a record that is not an Event is skipped."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for data in files:
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            if i + 12 + n + 4 > len(data):
                break
            try:
                step, values, start = _event(data[i + 12:i + 12 + n])
            except (ValueError, IndexError, struct.error):   # not an Event (another writer's record): skipped
                step, values, start = 0, [], False
            i += 12 + n + 4   # length, its CRC, the record, its CRC
            if start:
                scalars = {tag: [(s, v) for s, v in points if s < step] for tag, points in scalars.items()}
            for tag, value in values:
                scalars.setdefault(tag, []).append((step, value))
    return scalars


# --- the figure ----------------------------------------------------------------------------------------
def title(obj: dict) -> str:
    meta, st = obj.get("metadata") or {}, obj.get("status") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}: phase {st.get('phase') or '-'}"


def figure(series: Series, heading: str):
    """A matplotlib Figure: loss over steps above (the eval loss beside it, its lowest marked, when
    the run evaluated), throughput over steps below, a shared step axis."""
    from matplotlib.figure import Figure   # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(8, 6), layout="constrained")
    loss_ax, tps_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot(series.steps, series.loss, marker=".", color="tab:blue", label="training loss (report interval)")
    if series.eval_steps:
        loss_ax.plot(series.eval_steps, series.eval_loss, marker="o", color="tab:orange", label="eval loss")
        lowest = min(range(len(series.eval_loss)), key=series.eval_loss.__getitem__)
        loss_ax.plot([series.eval_steps[lowest]], [series.eval_loss[lowest]], marker="*", markersize=14,
                     color="tab:red", linestyle="none",
                     label=f"lowest eval loss {series.eval_loss[lowest]:.4f} (step {series.eval_steps[lowest]})")
        loss_ax.legend()
    loss_ax.set_ylabel(LOSS_LABEL)
    loss_ax.grid(alpha=0.3)
    tps_ax.plot(series.tokens_steps, series.tokens_per_second, marker=".", color="tab:green")
    tps_ax.set_ylabel(TOKENS_LABEL)
    tps_ax.set_xlabel(STEP_LABEL)
    tps_ax.grid(alpha=0.3)
    fig.suptitle(heading)
    loss_ax.set_title(f"from {series.source}", fontsize="small")
    return fig


# --- the command ---------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="the TPUFinetune (or --logdir)")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("--output", "-o", required=True, help="the image to write, e.g. loss.png or loss.svg")
    p.add_argument("--logdir", default=None, metavar="DIR",
                   help="plot this TensorBoard folder or gs:// prefix ({storagePath}/{run}/tensorboard) instead "
                        "of a TPUFinetune: no cluster needed")
    p.add_argument("--source", choices=[s.value for s in Source], default=Source.AUTO.value,
                   help="status: status.training.history (downsampled); tensorboard: the event files under "
                        "storagePath (every report; a gs:// bucket, or a folder readable here); auto: those "
                        "when they can be read, else status")
    kubectl.add_argument(p)


def series_for(obj: dict, source: Source, warn: Callable[[str], object] = lambda message: None) -> Series:
    """The Series to plot from `obj` and its event files; NoPlot saying why there is none. With
    auto, `warn` is told why a bucket's event files could not be read before the history is used."""
    name = f"{c.KIND} {(obj.get('metadata') or {}).get('namespace')}/{(obj.get('metadata') or {}).get('name')}"
    if source is not Source.STATUS:
        tft = built_from(obj)
        where = None if tft is None else "/".join([builders.run_dir(tft), c.TENSORBOARD_DIR])
        unread = "the spec does not parse, so where the event files are is not known"
        if where is not None:
            try:
                files, scalars = events_at(where)
            except object_store.StoreError as e:
                unread = str(e)
                if source is Source.AUTO:
                    warn(f"{e}; plotting status.training.history instead")
            else:
                if scalars.get(LOSS_TAG):
                    return from_events(scalars, where)
                unread = f"no training loss in {files} event files there"
        if source is Source.TENSORBOARD:
            raise NoPlot(f"no TensorBoard loss events read at {where or 'an unknown path'} ({unread}): use --source "
                         "status, or `tensorboard --logdir` where that storage is mounted")
    history = ((obj.get("status") or {}).get("training") or {}).get(c.TrainingStatus.HISTORY.value) or []
    series = from_history(history)
    if not series.steps:
        raise NoPlot(f"{name} has no status.training.history yet (phase "
                     f"{(obj.get('status') or {}).get('phase') or '-'}): the first point comes with training's "
                     "first report (spec.training.reportEverySteps)")
    return series


def series_of_logdir(logdir: str) -> Series:
    """The Series of a TensorBoard folder read here, or of a gs:// prefix; NoPlot when it holds no loss."""
    try:
        files, scalars = events_at(logdir)
    except object_store.StoreError as e:
        raise NoPlot(str(e)) from None
    if not scalars.get(LOSS_TAG):
        raise NoPlot(f"no training loss in {logdir} ({files} event files): give a run's {c.TENSORBOARD_DIR} folder")
    return from_events(scalars, logdir)


def _run_name(logdir: str) -> str:
    """The run folder's name: the TensorBoard folder's parent."""
    if object_store.is_remote(logdir):
        return logdir.rstrip("/").rsplit("/", 2)[-2]
    return Path(logdir).resolve().parent.name


def run(args: argparse.Namespace, err: TextIO | None = None) -> int:
    err = err or sys.stderr
    try:
        if getattr(args, "logdir", None):
            series, heading = series_of_logdir(args.logdir), _run_name(args.logdir)
        elif not args.name:
            raise NoPlot("give a TPUFinetune's name, or --logdir DIR")
        else:
            obj = kubectl.get(args.kubectl, c.PLURAL, args.name, args.namespace,
                              what=f"{c.KIND} {args.namespace}/{args.name}")
            if obj is None:
                raise NoPlot(f"{c.KIND} {args.namespace}/{args.name} not found")
            series = series_for(obj, Source(args.source), warn=lambda message: err.write(f"tpuft plot: {message}\n"))
            heading = title(obj)
        try:
            fig = figure(series, heading)
        except ImportError:
            raise NoPlot("matplotlib is not installed: pip install 'tpufinetune-operator[local]'") from None
        fig.savefig(args.output, dpi=120)
    except (NoPlot, kubectl.KubectlError, subprocess.TimeoutExpired, OSError) as e:
        err.write(f"tpuft plot: {e}\n")
        return 1
    err.write(f"tpuft plot: wrote {args.output} ({len(series.steps)} points from {series.source})\n")
    return 0
