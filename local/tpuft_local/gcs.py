"""Stand-ins for Google Cloud Storage and for the GKE metadata server's token endpoint, on loopback
or on an address the local cluster creates, so everything a run keeps in gs:// is rehearsed
against a real GCS API.

- `FakeGcs`: the stand-in for GCS: fake-gcs-server (github.com/fsouza/fake-gcs-server, built once
  per machine by tpuft_local.toolchain), speaking GCS's JSON and XML APIs over plain HTTP. A
  subfolder of its data dir is a bucket (`FakeGcs.bucket`).
- `MetadataServer`: the stand-in for the GKE metadata server (what a pod under Workload Identity
  Federation for GKE asks for its Google access token): the token, project and service-account
  email paths, `Metadata-Flavor: Google` required and answered, as the real one. `grant=False`
  refuses tokens as a Kubernetes service account without a Workload Identity binding sees.

The env a pod (or a test process) needs so that pyarrow's GCS client (the workload's only gs://
client) talks to them, from `workload_env`:

    CLOUD_STORAGE_EMULATOR_ENDPOINT=http://HOST:GCS_PORT   GCS's endpoint (the Google C++ client)
    GCE_METADATA_ROOT=HOST:METADATA_PORT                   where the token comes from (not
                                                           GCE_METADATA_HOST: ignored by that client)
    STORAGE_EMULATOR_HOST=http://HOST:GCS_PORT             the same for Python clients (gcsfs,
                                                           google-cloud-storage), if any

`python -m tpuft_local.gcs metadata --host H --port P [--refuse]` serves the metadata stand-in
until it is killed; `start_fake_gcs(...)` / `FakeGcs.stop()` start and stop the GCS one (by PID).
Stdlib only.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tpuft_local import procs, toolchain

TOOL = "fake-gcs-server"
TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
EMAIL_PATH = "/computeMetadata/v1/instance/service-accounts/default/email"
PROJECT_ID_PATH = "/computeMetadata/v1/project/project-id"
PROJECT_NUMBER_PATH = "/computeMetadata/v1/project/numeric-project-id"
FLAVOR = ("Metadata-Flavor", "Google")
DEFAULT_PROJECT_ID = "tpuft-local"
DEFAULT_PROJECT_NUMBER = "123456789012"
TOKEN_LIFETIME_S = 3599   # what the real endpoint answers for a fresh token


def build() -> str:
    """fake-gcs-server's binary, built from the Go module proxy the first time on a machine."""
    return toolchain.tool_path(TOOL)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class FakeGcs:
    """A running fake-gcs-server (its process started by `start_fake_gcs`)."""
    host: str
    port: int
    data_dir: Path
    proc: subprocess.Popen
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def bucket(self, name: str) -> str:
        """A bucket named `name` (a folder under the data dir, read by the filesystem backend at
        start; later ones through the JSON API); its gs:// URI."""
        return create_bucket(self.endpoint, name)

    def stop(self) -> None:
        procs.terminate(self.proc.pid, TOOL, timeout=5, quiet=True)


def create_bucket(endpoint: str, name: str) -> str:
    """The bucket `name` on the GCS stand-in at `endpoint` (kept if it exists); its gs:// URI."""
    import urllib.request

    request = urllib.request.Request(f"{endpoint}/storage/v1/b", method="POST", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except OSError as e:
        if getattr(e, "code", None) != 409:   # 409: it exists already
            raise
    return f"gs://{name}"


def fake_gcs_argv(binary: str, host: str, port: int, data_dir: Path, backend: str = "filesystem") -> list[str]:
    """fake-gcs-server's command line: plain HTTP on host:port, buckets under data_dir."""
    return [binary, "-scheme", "http", "-host", host, "-port", str(port), "-backend", backend,
            "-data", str(data_dir), "-filesystem-root", str(data_dir),
            # resumable uploads answer with this URL: the one clients reach it at
            "-external-url", f"http://{host}:{port}", "-log-level", "warn"]


def start_fake_gcs(data_dir: Path, host: str = "127.0.0.1", port: int | None = None,
                   backend: str = "filesystem", log: Path | None = None, timeout: float = 30.0) -> FakeGcs:
    """fake-gcs-server on host:port (a free port when None), its buckets under `data_dir`, ready
    when this returns. The filesystem backend: the memory one holds every object in RAM (1.55 GB
    during a 256 MiB upload)."""
    binary = build()
    port = port or free_port(host)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = log or data_dir.parent / f"{TOOL}-{port}.log"
    proc = procs.spawn(fake_gcs_argv(binary, host, port, data_dir, backend), log, cwd=data_dir, die_with_parent=True)
    server = FakeGcs(host, port, data_dir, proc, log)
    try:
        procs.wait_for(lambda: procs.http_ok(f"{server.endpoint}/storage/v1/b"), TOOL, timeout, log, proc)
    except RuntimeError:
        server.stop()
        raise
    return server


@dataclass
class Identity:
    """Who the metadata stand-in says the pod is."""
    project_id: str = DEFAULT_PROJECT_ID
    project_number: str = DEFAULT_PROJECT_NUMBER
    email: str = f"{DEFAULT_PROJECT_ID}.svc.id.goog"   # what GKE answers for a KSA without a GSA
    grant: bool = True            # False: no token (a KSA without a Workload Identity binding)
    tokens_served: list[str] = field(default_factory=list)


def _handler(identity: Identity) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: bytes, content_type: str = "application/text") -> None:
            self.send_response(status)
            self.send_header(*FLAVOR)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if self.headers.get(FLAVOR[0]) != FLAVOR[1]:   # the real server's SSRF guard
                self._answer(403, b"Missing required header \"Metadata-Flavor\": \"Google\"\n", "text/html")
                return
            if path == TOKEN_PATH:
                if not identity.grant:
                    self._answer(403, b"Unable to generate access token; IAM returned 403 Forbidden: "
                                      b"Permission 'iam.serviceAccounts.getAccessToken' denied\n")
                    return
                token = "ya29.local-" + secrets.token_urlsafe(24)
                identity.tokens_served.append(token)
                body = {"access_token": token, "expires_in": TOKEN_LIFETIME_S, "token_type": "Bearer"}
                self._answer(200, json.dumps(body).encode(), "application/json")
                return
            values = {EMAIL_PATH: identity.email, PROJECT_ID_PATH: identity.project_id,
                      PROJECT_NUMBER_PATH: identity.project_number}
            if path in values:
                self._answer(200, values[path].encode())
            else:
                self._answer(404, b"Not Found\n", "text/html")

        def log_message(self, *args) -> None:
            pass

    return Handler


class MetadataServer:
    """The metadata stand-in on host:port (a free port when 0), served from a thread of this process."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, identity: Identity | None = None):
        self.identity = identity or Identity()
        self._httpd = ThreadingHTTPServer((host, port), _handler(self.identity))
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)

    @property
    def root(self) -> str:
        """GCE_METADATA_ROOT's value: host:port, no scheme."""
        return f"{self.host}:{self.port}"

    def start(self) -> MetadataServer:
        """Serve from a thread of this process (tests); `serve_forever` serves from this one."""
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever(poll_interval=0.5)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


def metadata_ready(root: str) -> bool:
    """The metadata stand-in at `root` (host:port) answers, as a client asks it (with the header)."""
    import urllib.request
    request = urllib.request.Request(f"http://{root}{PROJECT_ID_PATH}", headers=dict([FLAVOR]))
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def workload_env(gcs_endpoint: str, metadata_root: str) -> dict[str, str]:
    """What a pod or process sets so the workload's GCS client uses the stand-ins."""
    return {"CLOUD_STORAGE_EMULATOR_ENDPOINT": gcs_endpoint, "GCE_METADATA_ROOT": metadata_root,
            "STORAGE_EMULATOR_HOST": gcs_endpoint}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpuft_local.gcs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    meta = sub.add_parser("metadata", help="serve the metadata stand-in until killed")
    meta.add_argument("--host", default="127.0.0.1")
    meta.add_argument("--port", type=int, default=0)
    meta.add_argument("--project-id", default=DEFAULT_PROJECT_ID)
    meta.add_argument("--project-number", default=DEFAULT_PROJECT_NUMBER)
    meta.add_argument("--refuse", action="store_true", help="answer no token (a KSA without a binding)")
    meta.add_argument("--state-dir", help="the local cluster's state dir: marks this process as the cluster's own "
                                          "(`tpuft cluster down` stops it by PID)")
    args = parser.parse_args(argv)
    server = MetadataServer(args.host, args.port, Identity(args.project_id, args.project_number,
                                                           grant=not args.refuse))
    print(f"metadata stand-in on {server.root} (pid {os.getpid()})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
