"""Starting, finding and stopping the local cluster's processes, by PID.

A process belongs to a cluster when its argv names the cluster's state dir (every component
gets a config or socket path under it), so `down` finds them after a restart of `tpuft`
itself and never touches a process it did not start.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tpuft_local.console import say
from tpuft_local.toolchain import set_pdeathsig


def http_ok(url: str) -> bool:
    """A plain-HTTP health endpoint answers 200 (loopback probes; 2 s per try)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def cmdline(pid: int) -> list[str] | None:
    """argv of a live, non-zombie process, or None."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, IndexError):
        return None


def find(marker: str, match) -> list[int]:
    """PIDs whose argv (the program's path included: a component may run from a link under the
    state dir) mentions `marker` and for which `match(argv)` is true."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            argv = cmdline(int(entry.name))
            if argv and any(marker in a for a in argv) and match(argv):
                found.append(int(entry.name))
    return sorted(found)


def by_program(name: str):
    """match(): argv[0] is `name`, or a Python running module `name` (python -m name)."""
    def match(argv: list[str]) -> bool:
        if os.path.basename(argv[0]) == name:
            return True
        return "-m" in argv and argv.index("-m") + 1 < len(argv) and argv[argv.index("-m") + 1] == name
    return match


def spawn(argv: list[str], log: Path, *, cwd: Path, env: dict | None = None, die_with_parent: bool = False
          ) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        fh.write(("\n==== " + time.strftime("%Y-%m-%dT%H:%M:%S ") + " ".join(argv) + "\n").encode())
        fh.flush()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True, preexec_fn=set_pdeathsig if die_with_parent else None)


def terminate(pid: int, what: str, timeout: float = 15.0, quiet: bool = False) -> None:
    """SIGTERM, then SIGKILL after `timeout`; returns once the process is gone (or 5 s after SIGKILL)."""
    if not quiet:
        say(f"stopping {what} (pid {pid})")
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            if cmdline(pid) is None:
                return
            time.sleep(0.1)


def wait_for(check, what: str, timeout: float, log: Path | None = None, proc: subprocess.Popen | None = None,
             interval: float = 0.3) -> None:
    """Poll `check()` until true; raise RuntimeError naming `what` and the log's tail on timeout or exit."""
    end = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting; {tail(log)}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001  (a probe that errors is a probe that says "not yet")
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s; {tail(log)}")
        time.sleep(interval)


def tail(log: Path | None, lines: int = 20) -> str:
    if log is None:
        return ""
    try:
        text = "".join(log.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        text = "(no log)"
    return f"last lines of {log}:\n{text}"
