"""A loopback HTTP server for the tests' stand-ins (the served model's OpenAI API, a Ray head's Jobs
API): one handler class in, the port out, shut down when the block ends."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing (pytest's output stays the test's) and answers bytes in one call."""

    def answer(self, status: int, raw: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler], poll_interval: float = 0.5) -> Iterator[int]:
    """The port of a ThreadingHTTPServer on 127.0.0.1 running `handler`, for as long as the block runs."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": poll_interval}, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)
