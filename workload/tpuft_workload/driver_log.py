"""The driver's log, kept beside the run: everything the verify or train driver writes to stdout
and stderr (its own lines, and the workers' lines Ray forwards to it) also goes to --log-file,
{storagePath}/{run}/logs/{verify,train}.log (tpuft.controller.builders.log_path), so `tpuft logs` can still
show it once the head is gone.

A local path is appended to line by line (a retried job's attempts follow each other in one
file); on object storage (gs://) the lines go to a local copy of the file that replaces it, whole,
every UPLOAD_EVERY_S seconds while the driver runs (when it grew) and when it exits: a driver
killed outright (SIGKILL, a lost head pod) loses at most its last UPLOAD_EVERY_S seconds of lines.
A log that cannot be written is said once on stderr and never fails the job.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from typing import Iterator, TextIO

from tpuft_workload import checkpoint as ckptlib
from tpuft_workload import storage
from tpuft_workload.report import now_rfc3339

UPLOAD_EVERY_S = 30.0
LOG_RETRY_LIMIT_S = storage.PROBE_RETRY_LIMIT_S   # a log is not worth holding a driver for: the probe's bound


class _Tee:
    """A text stream that writes to `stream` and to `log`: the stream first, and the log only
    while it is open (it is closed before the streams are given back)."""

    def __init__(self, stream: TextIO, log: TextIO, lock: threading.Lock):
        self._stream, self._log, self._lock = stream, log, lock

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        with self._lock:
            if not self._log.closed:
                self._log.write(text)
        return n

    def flush(self) -> None:
        self._stream.flush()
        with self._lock:
            if not self._log.closed:
                self._log.flush()

    def __getattr__(self, name: str):   # isatty, fileno, encoding ...: the stream's own
        return getattr(self._stream, name)


class _Uploader:
    """The local copy of a remote log, uploaded whole every `every_s` seconds while it grows (a
    thread), and once more by `close`."""

    def __init__(self, local: str, uri: str, lock: threading.Lock, every_s: float, reachable: bool = True):
        self.local, self.uri, self._lock, self._every_s = local, uri, lock, every_s
        self._sent = -1
        self._failed = False
        # False: the log's first read found no credentials or no bucket; nothing is uploaded then (each try
        # would wait out the client's retries, keeping a failed driver from ending)
        self.reachable = reachable
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpuft-driver-log-upload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.upload()

    def upload(self, err: TextIO | None = None) -> None:
        if not self.reachable:
            return
        with self._lock:   # a whole line at a time: writers hold the lock while they write
            with open(self.local, "rb") as f:
                data = f.read()
        if len(data) == self._sent:
            return
        try:
            ckptlib.write_bytes(self.uri, data, LOG_RETRY_LIMIT_S)
            self._sent = len(data)
        except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowException, ...
            if not self._failed or err is not None:   # said once while running, and at the end
                self._failed = True
                (err or sys.__stderr__).write(
                    f"[tpuft] could not upload the driver log to {self.uri} ({type(e).__name__}: {e})\n")

    def close(self, err: TextIO) -> None:
        self._stop.set()
        self._thread.join(timeout=self._every_s + 60)
        self.upload(err)


@contextlib.contextmanager
def tee(path: str | None, what: str, upload_every_s: float = UPLOAD_EVERY_S) -> Iterator[str | None]:
    """stdout and stderr also written to `path` (None: no log file) for the block; `what` heads
    the attempt's first line. Yields the path written, or None."""
    if not path:
        yield None
        return
    remote = "://" in path
    reachable = True
    try:
        if remote:   # what earlier attempts uploaded comes first: the file is replaced, not appended to
            with tempfile.NamedTemporaryFile("wb", prefix="tpuft-driver-", suffix=".log", delete=False) as f:
                local = f.name
                try:
                    f.write(ckptlib.read_bytes(path, LOG_RETRY_LIMIT_S))
                except storage.NotFound:
                    pass   # the run's first attempt
                except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowException, ...
                    reachable = False
                    sys.stderr.write(f"[tpuft] the driver log stays on this host: {path} cannot be read "
                                     f"({type(e).__name__}: {str(e)[:300]})\n")
        else:
            local = path
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        log = open(local, "a", buffering=1, encoding="utf-8", errors="replace")   # line-buffered: readable live
    except OSError as e:
        sys.stderr.write(f"[tpuft] cannot write the driver log to {path} ({e}); continuing without it\n")
        yield None
        return
    lock = threading.Lock()
    out, err = sys.stdout, sys.stderr
    log.write(f"[tpuft] {what} driver started {now_rfc3339()} (pid {os.getpid()})\n")
    uploader = _Uploader(local, path, lock, upload_every_s, reachable) if remote else None
    if uploader is not None:
        uploader.start()
    sys.stdout, sys.stderr = _Tee(out, log, lock), _Tee(err, log, lock)
    try:
        yield path
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = out, err
        with lock:
            log.close()
        if uploader is not None:
            try:
                uploader.close(err)
            finally:
                os.unlink(local)
