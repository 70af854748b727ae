"""Polling helpers shared by the tests that watch a real API server or a process."""
import time


def wait_until(check, timeout=30.0, what="condition", interval=0.2):
    """Call `check` until it returns something truthy (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)
