"""The laptop CLI reads a gs:// run's files (tpuft.cli.object_store) against a real GCS API
(fake-gcs-server) with the token from the GKE metadata server's path (tests/gcs_fixtures.py):
`tpuft logs` prints the driver's log from the bucket once the head is gone, `tpuft plot` draws the
event files the workload's own TensorBoard writer uploaded, and a laptop without credentials is
told so in seconds, with the URI and what to do."""
from __future__ import annotations

import argparse
import copy
import io
import time

import pytest

from tests.factories import MINIMUM
from tests.ranks import free_port
from tpuft.controller import builders
from tpuft.cli import logs_cli, object_store, plot_cli
from tpuft.api import constants as c
from tpuft.cli.plot_cli import Source
from tpuft.api.spec import parse
from tpuft_workload import driver_log, metrics_log


def _put(uri: str, data: bytes) -> None:
    """Write an object as the workload does (its storage module: pyarrow's GCS client)."""
    from tpuft_workload import storage

    fs, path = storage.filesystem(uri)
    with fs.open_output_stream(path) as f:
        f.write(data)


def _tft(storage: str, history: list[dict] | None = None) -> dict:
    obj = copy.deepcopy(MINIMUM)
    obj["metadata"] = {"name": "ft", "namespace": "ns", "uid": "u-1"}
    obj["spec"]["checkpoint"] = {"storagePath": storage}
    obj["status"] = {"phase": "Succeeded", "message": "done", "appliedSpec": copy.deepcopy(obj["spec"]),
                     "children": {"rayCluster": "ft-ray", "verifyJob": "ft-verify", "trainJob": "ft-train"},
                     **({"training": {"history": history}} if history is not None else {})}
    return obj


def _kubectl_knows_only(monkeypatch, obj: dict) -> None:
    """kubectl finds the TPUFinetune; its RayJob and RayCluster are gone (the run ended)."""
    for module in (logs_cli, plot_cli):
        monkeypatch.setattr(module.kubectl, "get", lambda _bin, kind, *a, **k: obj if kind == c.PLURAL else None)


def _logs(obj: dict, monkeypatch) -> tuple[int, str, str]:
    _kubectl_knows_only(monkeypatch, obj)
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(name="ft", namespace="ns", follow=False, job=None, interval=0.01, kubectl="kubectl")
    return logs_cli.run(args, out, err), out.getvalue(), err.getvalue()


def test_read_and_list_a_bucket(gcs):
    _put(gcs.path("run", "logs", "train.log"), b"a\n")
    _put(gcs.path("run", "tensorboard", "events.out.tfevents.1"), b"\x00")
    assert object_store.read_bytes(gcs.path("run", "logs", "train.log")) == b"a\n"
    assert object_store.list_files(gcs.path("run")) == [gcs.path("run", "logs", "train.log"),
                                                        gcs.path("run", "tensorboard", "events.out.tfevents.1")]
    assert object_store.list_files(gcs.path("run", "tensorboard") + "/") == [
        gcs.path("run", "tensorboard", "events.out.tfevents.1")]
    assert object_store.list_files(gcs.path("nothing-here")) == []
    with pytest.raises(object_store.NotFound, match=f"^{gcs.path('run', 'logs', 'verify.log')} not found$"):
        object_store.read_bytes(gcs.path("run", "logs", "verify.log"))


def test_logs_falls_back_to_the_drivers_log_in_the_bucket(gcs, monkeypatch):
    obj = _tft(gcs.path("ckpt"))
    log = builders.log_path(parse(obj), c.Component.TRAIN)
    assert log.startswith(gcs.path("ckpt") + "/")
    _put(log, "step 1 loss 2.5\nstep 2 loss 2.25 \u2713\n".encode())
    rc, out, err = _logs(obj, monkeypatch)
    assert (rc, out) == (0, "step 1 loss 2.5\nstep 2 loss 2.25 \u2713\n"), err
    assert err == f"tpuft logs: RayJob ns/ft-train is gone; the train driver's log from {log}:\n"


def test_logs_says_when_the_bucket_holds_no_log_yet(gcs, monkeypatch):
    obj = _tft(gcs.path("ckpt"))
    rc, out, err = _logs(obj, monkeypatch)
    assert (rc, out) == (1, "")
    assert f"the train driver's log {builders.log_path(parse(obj), c.Component.TRAIN)} is not there" in err, err
    assert f"every {driver_log.UPLOAD_EVERY_S:.0f} s while it runs" in err, err


def test_the_upload_interval_named_is_the_drivers():
    assert logs_cli.DRIVER_LOG_UPLOAD_EVERY_S == driver_log.UPLOAD_EVERY_S


def _train_events(run_dir: str) -> None:
    """Two attempts' event files, as rank 0 uploads them: the second resumed at step 2, so its
    steps 3-4 replace the first's."""
    first = metrics_log.TensorBoard(run_dir, enabled=True)
    for step in (1, 2, 3, 4):
        first.add(step, {"loss": 4.0 / step, "tokens_per_s": 100.0 * step}, learning_rate=1e-3)
    first.close()
    time.sleep(1.1)   # tensorboardX names a file by its second: the resumed attempt's sorts after
    second = metrics_log.TensorBoard(run_dir, enabled=True, resumed_at=2)
    for step in (3, 4):
        second.add(step, {"loss": 1.0 / step, "tokens_per_s": 50.0, "eval_loss": 0.5}, learning_rate=1e-3)
    second.close()


def test_plot_reads_the_event_files_the_workload_uploaded(gcs, monkeypatch, tmp_path):
    obj = _tft(gcs.path("ckpt"), history=[{"step": 4, "loss": 9.0, "tokensPerSecond": 1.0}])
    run_dir = builders.run_dir(parse(obj))
    _train_events(run_dir)
    where = f"{run_dir}/{c.TENSORBOARD_DIR}"
    assert len(object_store.list_files(where)) == 2

    for source in (Source.AUTO, Source.TENSORBOARD):
        series = plot_cli.series_for(obj, source)
        assert series.steps == (1, 2, 3, 4) and series.source == f"TensorBoard events in {where}"
        assert series.loss == pytest.approx((4.0, 2.0, 1.0 / 3, 0.25))
        assert series.tokens_per_second == pytest.approx((100.0, 200.0, 50.0, 50.0))
        assert (series.eval_steps, series.eval_loss) == ((3, 4), (0.5, 0.5))
    assert plot_cli.series_for(obj, Source.STATUS).steps == (4,)   # asked for: the history

    _kubectl_knows_only(monkeypatch, obj)
    err = io.StringIO()
    args = argparse.Namespace(name="ft", namespace="ns", output=str(tmp_path / "loss.png"), source="tensorboard",
                              kubectl="kubectl")
    assert plot_cli.run(args, err=err) == 0, err.getvalue()
    assert err.getvalue() == f"tpuft plot: wrote {tmp_path / 'loss.png'} (4 points from TensorBoard events in {where})\n"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    args.logdir, args.output = where, str(tmp_path / "logdir.svg")   # --logdir gs://...: no cluster needed
    assert plot_cli.run(args, err=err) == 0, err.getvalue()
    assert (tmp_path / "logdir.svg").read_text().lstrip().startswith("<?xml")


# unbounded, the client retries a missing token for about 15 minutes; bounded (RETRY_LIMIT_S), a
# read gave up after about 11 s on this 2-core machine under load
GIVES_UP_WITHIN_S = 60


def test_without_credentials_logs_and_plot_fail_in_seconds_naming_the_uri(gcs, monkeypatch, tmp_path):
    """A laptop where no token can be had (nothing answers the metadata server's address): the
    client's retries are bounded, and the message says what to run."""
    obj = _tft(gcs.path("ckpt"), history=[{"step": 4, "loss": 9.0, "tokensPerSecond": 1.0}])
    _put(builders.log_path(parse(obj), c.Component.TRAIN), b"a line\n")
    monkeypatch.setenv("GCE_METADATA_ROOT", f"127.0.0.1:{free_port()}")

    start = time.monotonic()
    rc, out, err = _logs(obj, monkeypatch)
    took = time.monotonic() - start
    assert (rc, out) == (1, ""), err
    assert took < GIVES_UP_WITHIN_S, took
    assert f"reading {builders.log_path(parse(obj), c.Component.TRAIN)} failed: no credentials" in err, err
    assert "gcloud auth application-default login" in err, err

    warnings: list[str] = []
    start = time.monotonic()
    series = plot_cli.series_for(obj, Source.AUTO, warn=warnings.append)   # auto: the history, saying why
    assert time.monotonic() - start < GIVES_UP_WITHIN_S
    assert series.steps == (4,) and len(warnings) == 1, warnings
    assert f"listing {builders.run_dir(parse(obj))}/{c.TENSORBOARD_DIR} failed: no credentials" in warnings[0]
    assert warnings[0].endswith("plotting status.training.history instead")
