"""tpuft plot, pure parts and the command against a stubbed kubectl: a Series from
status.training.history or from TensorBoard event files (read without tensorboard: TFRecord framing
and the scalar's protobuf fields, an attempt's purge_step hiding what earlier ones logged past it),
a figure with labelled axes, the run's name and phase, and every refusal saying what to do. The
workload tier checks read_events against tensorboardX's own files (tests/workload/test_train.py),
and a bucket's event files against a real GCS API (tests/workload/test_object_store.py): here
pyarrow is hidden, as on a laptop without it."""
from __future__ import annotations

import argparse
import copy
import io
import struct
import sys

import pytest

from tests.factories import MINIMUM
from tpuft.controller import builders
from tpuft.cli import plot_cli
from tpuft.cli.plot_cli import NoPlot, Source
from tpuft.api.spec import parse
from tpuft_workload import metrics_log


# --- a minimal TensorBoard event writer (protobuf by hand; the reader must not be its own oracle
# for field numbers: the workload tier compares it with tensorboardX's files) ------------------------
def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _len_field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _scalar_event(step: int, tag: str, value: float) -> bytes:
    val = _len_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)
    return _varint(1 << 3 | 1) + struct.pack("<d", 1.7e9) + _varint(2 << 3) + _varint(step) + _len_field(5, _len_field(1, val))


def _start_event(step: int) -> bytes:
    return _varint(2 << 3) + _varint(step) + _len_field(7, _varint(1 << 3) + _varint(1))


def _record(event: bytes) -> bytes:
    return struct.pack("<Q", len(event)) + b"\0" * 4 + event + b"\0" * 4   # CRCs are not checked


def _write(path, *events: bytes, truncate: int = 0) -> None:
    data = b"".join(_record(e) for e in events)
    path.write_bytes(data[:len(data) - truncate] if truncate else data)


def test_event_files_read_as_tensorboard_shows_them(tmp_path):
    _write(tmp_path / "events.out.tfevents.1700000000.host.1.s0000000",
           _len_field(3, b"brain.Event:2"), b"\x07garbage",   # file_version; a record that is not an Event
           _scalar_event(3, "train/loss", 2.0), _scalar_event(3, "train/tokens_per_second", 100.0),
           _scalar_event(6, "train/loss", 1.5), _scalar_event(7, "train/loss", 1.375))
    # the restarted attempt resumed at step 6: purge_step 7 hides the first attempt's step 7
    _write(tmp_path / "events.out.tfevents.1700000100.host.2.s0000006", _start_event(7),
           _scalar_event(9, "train/loss", 1.25), _scalar_event(12, "train/loss", 1.0), truncate=5)
    files, scalars = plot_cli.read_events(tmp_path)
    assert files == 2
    # the truncated step 12 is not there; the garbage ended nothing but itself
    assert scalars == {"train/loss": [(3, 2.0), (6, 1.5), (9, 1.25)],
                       "train/tokens_per_second": [(3, 100.0)]}


def test_no_event_files_no_scalars(tmp_path):
    assert plot_cli.read_events(tmp_path) == (0, {})


@pytest.mark.parametrize("history,steps,loss,tokens_steps", [
    ([], (), (), ()),
    ([{"step": 5, "loss": 2.0, "tokensPerSecond": 10.0}, {"step": 10, "loss": 1.5, "tokensPerSecond": 12.0}],
     (5, 10), (2.0, 1.5), (5, 10)),
    ([{"step": 5, "loss": 2.0}, {"step": 10, "loss": None, "tokensPerSecond": 12.0}],   # a missing number is left out
     (5,), (2.0,), (10,)),
])
def test_a_series_from_the_history(history, steps, loss, tokens_steps):
    s = plot_cli.from_history(history)
    assert (s.steps, s.loss, s.tokens_steps) == (steps, loss, tokens_steps)
    assert "status.training.history" in s.source


def test_a_series_from_the_history_with_evaluations():
    history = [{"step": 5, "loss": 2.0, "tokensPerSecond": 10.0}, {"step": 8, "loss": 1.8, "evalLoss": 2.5},
               {"step": 10, "loss": 1.5, "tokensPerSecond": 12.0, "evalLoss": 2.25}]
    s = plot_cli.from_history(history)
    assert (s.steps, s.eval_steps, s.eval_loss) == ((5, 8, 10), (8, 10), (2.5, 2.25))


def test_the_tags_are_the_workloads():
    assert {plot_cli.LOSS_TAG: "loss", plot_cli.TOKENS_TAG: "tokens_per_s",
            plot_cli.EVAL_LOSS_TAG: "eval_loss"}.items() <= metrics_log.SCALARS.items()


def _obj(storage: str, history: list[dict] | None = None, phase: str = "Training") -> dict:
    obj = copy.deepcopy(MINIMUM)
    obj["metadata"] = {"name": "ft", "namespace": "ns", "uid": "u-1"}
    obj["spec"]["checkpoint"] = {"storagePath": storage}
    obj["status"] = {"phase": phase, "appliedSpec": copy.deepcopy(obj["spec"]),
                     **({"training": {"history": history}} if history is not None else {})}
    return obj


@pytest.fixture(autouse=True)
def _no_pyarrow(monkeypatch):
    for module in ("pyarrow", "pyarrow.fs"):
        monkeypatch.setitem(sys.modules, module, None)


HISTORY = [{"step": s, "loss": 3.0 / s, "tokensPerSecond": 100.0 + s} for s in (5, 10, 15)]


def _tensorboard_dir(obj: dict):
    from pathlib import Path

    d = Path(builders.run_dir(parse(obj)), "tensorboard")
    d.mkdir(parents=True)
    _write(d / "events.out.tfevents.1700000000.host.1.s0000000", *(_scalar_event(s, "train/loss", 1.0 / s)
                                                                     for s in range(1, 21)))
    return d


def test_auto_prefers_the_event_files_when_readable_here(tmp_path):
    obj = _obj(str(tmp_path), HISTORY)
    where = _tensorboard_dir(obj)
    s = plot_cli.series_for(obj, Source.AUTO)
    assert s.steps == tuple(range(1, 21)) and str(where) in s.source
    assert plot_cli.series_for(obj, Source.STATUS).steps == (5, 10, 15)   # asked for: the history


@pytest.mark.parametrize("storage,warned", [
    ("gs://bucket/ck", ["cannot read gs://bucket/ck/ns-ft-u-1/tensorboard", "install pyarrow",
                        "plotting status.training.history instead"]),
    ("/nonexistent/ck", None),
])
def test_auto_falls_back_to_the_history(storage, warned):
    warnings: list[str] = []
    assert plot_cli.series_for(_obj(storage, HISTORY), Source.AUTO, warn=warnings.append).steps == (5, 10, 15)
    assert (warnings == []) if warned is None else (len(warnings) == 1 and all(w in warnings[0] for w in warned)), warnings


@pytest.mark.parametrize("obj,source,words", [
    (_obj("gs://bucket/ck", HISTORY), Source.TENSORBOARD, ["gs://bucket/ck/", "/tensorboard", "install pyarrow",
                                                           "--source status"]),
    (_obj("/nonexistent/ck", HISTORY), Source.TENSORBOARD, ["/nonexistent/ck/ns-ft-u-1/tensorboard",
                                                            "no training loss in 0 event files", "--source status"]),
    (_obj("gs://bucket/ck", None, phase="Provisioning"), Source.AUTO,
     ["no status.training.history yet", "phase Provisioning", "reportEverySteps"]),
])
def test_nothing_to_plot_says_why_and_what_to_do(obj, source, words):
    with pytest.raises(NoPlot) as e:
        plot_cli.series_for(obj, source)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_figure_has_axes_units_the_run_and_its_phase():
    obj = _obj("gs://bucket/ck", HISTORY, phase="Succeeded")
    fig = plot_cli.figure(plot_cli.series_for(obj, Source.STATUS), plot_cli.title(obj))
    loss_ax, tps_ax = fig.axes
    assert fig._suptitle.get_text() == "ns/ft: phase Succeeded"
    assert loss_ax.get_ylabel() == "loss (cross-entropy, nats per token)"
    assert tps_ax.get_ylabel() == "throughput (real tokens/s, whole slice)" and tps_ax.get_xlabel() == "optimizer step"
    assert list(loss_ax.lines[0].get_xdata()) == [5, 10, 15]
    assert list(tps_ax.lines[0].get_ydata()) == [105.0, 110.0, 115.0]


def _run(monkeypatch, tmp_path, obj: dict | None, **kw) -> tuple[int, str]:
    monkeypatch.setattr(plot_cli.kubectl, "get", lambda *a, **k: obj)
    err = io.StringIO()
    args = argparse.Namespace(name="ft", namespace="ns", output=str(tmp_path / "loss.png"), source="auto",
                              kubectl="kubectl", **kw)
    return plot_cli.run(args, err=err), err.getvalue()


def test_the_command_writes_a_png(monkeypatch, tmp_path):
    rc, err = _run(monkeypatch, tmp_path, _obj("gs://bucket/ck", HISTORY))
    assert rc == 0 and "3 points from status.training.history" in err
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_without_the_object_exits_1(monkeypatch, tmp_path):
    rc, err = _run(monkeypatch, tmp_path, None)
    assert rc == 1 and err == "tpuft plot: TPUFinetune ns/ft not found\n" and not (tmp_path / "loss.png").exists()


EVALUATED = [{**p, "evalLoss": loss} for p, loss in zip(HISTORY, (2.0, 1.5, 1.75))]


def test_the_eval_loss_is_drawn_beside_the_training_loss_its_lowest_marked():
    obj = _obj("gs://bucket/ck", EVALUATED)
    loss_ax, _ = plot_cli.figure(plot_cli.series_for(obj, Source.STATUS), plot_cli.title(obj)).axes
    train, evaluated, lowest = loss_ax.lines
    assert list(evaluated.get_xdata()) == [5, 10, 15] and list(evaluated.get_ydata()) == [2.0, 1.5, 1.75]
    assert (list(lowest.get_xdata()), list(lowest.get_ydata())) == ([10], [1.5])
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == [
        "training loss (report interval)", "eval loss", "lowest eval loss 1.5000 (step 10)"]
    assert plot_cli.figure(plot_cli.from_history(HISTORY), "t").axes[0].get_legend() is None   # no evaluation


def test_a_logdir_is_plotted_without_a_cluster(monkeypatch, tmp_path):
    def no_kubectl(*a, **k):
        raise AssertionError("kubectl called")

    monkeypatch.setattr(plot_cli.kubectl, "get", no_kubectl)
    logdir = tmp_path / "run" / "tensorboard"
    logdir.mkdir(parents=True)
    _write(logdir / "events.out.tfevents.1700000000.host.1.s0000000", _scalar_event(4, "train/loss", 2.0),
           _scalar_event(8, "train/loss", 1.5), _scalar_event(8, "eval/loss", 1.75))
    err = io.StringIO()
    args = argparse.Namespace(name=None, namespace="ns", output=str(tmp_path / "loss.svg"), source="auto",
                              kubectl="kubectl", logdir=str(logdir))
    assert plot_cli.run(args, err=err) == 0, err.getvalue()
    assert "2 points from TensorBoard events in" in err.getvalue()
    assert (tmp_path / "loss.svg").read_text().lstrip().startswith("<?xml")
    args.logdir, args.output = None, str(tmp_path / "none.png")
    assert plot_cli.run(args, err=err) == 1 and "give a TPUFinetune's name, or --logdir DIR" in err.getvalue()
