"""The driver's log, kept beside the run: everything the verify or train driver writes to stdout
and stderr (its own lines, and the workers' lines Ray forwards to it) also goes to --log-file,
{storagePath}/{run}/logs/{verify,train}.log (tpuft.builders.log_path), so `tpuft logs` can still
show it once the head is gone.

A local path is appended to line by line (a retried job's attempts follow each other in one
file); on object storage (gs://) the lines go to a local copy of the file that replaces it, whole,
when the driver exits. A log that cannot be written is said once on stderr and never fails the job.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from typing import Iterator, TextIO

from tpuft_workload import checkpoint as ckptlib
from tpuft_workload.report import now_rfc3339


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


@contextlib.contextmanager
def tee(path: str | None, what: str) -> Iterator[str | None]:
    """stdout and stderr also written to `path` (None: no log file) for the block; `what` heads
    the attempt's first line. Yields the path written, or None."""
    if not path:
        yield None
        return
    remote = "://" in path
    try:
        if remote:   # what earlier attempts uploaded comes first: the file is replaced, not appended to
            with tempfile.NamedTemporaryFile("wb", prefix="tpuft-driver-", suffix=".log", delete=False) as f:
                local = f.name
                with contextlib.suppress(Exception):
                    f.write(ckptlib.read_bytes(path))
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
        if remote:
            try:
                with open(local, "rb") as f:
                    ckptlib.write_bytes(path, f.read())
            except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowException, ...
                err.write(f"[tpuft] could not upload the driver log to {path} ({type(e).__name__}: {e})\n")
            finally:
                os.unlink(local)
