"""Benchmark: a gs:// model read in place by byte range vs copied whole to every host first.

A synthetic Llama (default about 0.29B parameters, fp32: 1.1 GB of safetensors in 3 files, random
weights) is written once straight into the data folder of a GCS API server on loopback
(fake-gcs-server, filesystem backend: a subfolder is a bucket), then loaded by 2 gloo CPU ranks,
each standing for a host (its own model cache folder, its own connection to the bucket):
  copy    the path before: model._local_copy downloads the whole folder to the host's disk, then
          the sharded load reads the rank's rows from the local files
  ranges  model.weights_location leaves the gs:// URI as it is: the host downloads only the small
          files (config, tokenizer, index) and the rank reads its rows' byte ranges from the bucket
Per rank: bytes received from the bucket (a counting TCP relay in front of the server, one per
rank: HTTP headers and bodies as they cross the wire), peak local disk used under the rank's cache
folder (sampled every 50 ms, and the final size), seconds to load, peak RSS, and a checksum of
its loaded shards (both paths must load the same weights). Medians over --repeats.

    .venv/bin/python bench/gcs_model_load.py [--repeats 3] [--hidden 1024 --layers 20]

fake-gcs-server is the local cluster's (built once per machine by tpuft_local.toolchain, as
`tpuft cluster tools` builds it; --server names another binary). pyarrow's GCS client finds it through
CLOUD_STORAGE_EMULATOR_ENDPOINT and takes its token from a fake metadata server (GCE_METADATA_ROOT),
both on 127.0.0.1. Writes bench/results/gcs_model_load.json (and the table as .txt) by default.
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # tests.ranks
OUT = REPO / "bench" / "results" / "gcs_model_load.json"
BUCKET = "models"
WORLD = 2


def _config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                       num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                       num_key_value_heads=max(1, hidden // 512), max_position_embeddings=2048,
                       tie_word_embeddings=False, use_cache=False)


def save_model(folder: Path, hidden: int, layers: int) -> int:
    """The synthetic model (fp32 safetensors, the tiny tokenizer) under `folder`, written once;
    its safetensors bytes."""
    import torch
    from transformers import LlamaForCausalLM

    from tpuft_workload import tiny

    marker = folder / ".written"
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        LlamaForCausalLM(_config(hidden, layers)).save_pretrained(folder, max_shard_size="500MB")
        tiny.build_tokenizer().save_pretrained(folder)
        marker.touch()
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


class _Metadata(http.server.BaseHTTPRequestHandler):
    """GCE's metadata server as far as Google's auth clients ask it: a token for the default account."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.headers.get("Metadata-Flavor") != "Google":
            self.send_error(403)
            return
        body = (json.dumps({"access_token": "bench", "expires_in": 3600, "token_type": "Bearer"})
                if self.path.split("?")[0].endswith("/token") else "default")
        self.send_response(200)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


class Relay:
    """A TCP relay to `upstream` on a port of its own, counting the bytes it passes back to the
    client: what one rank receives from the bucket."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.received = 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source, sink, counted: bool):
        try:
            while data := source.recv(1 << 20):
                sink.sendall(data)
                if counted:
                    with self.lock:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def take(self) -> int:
        with self.lock:
            count, self.received = self.received, 0
        return count


def _disk_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _worker(rank: int, rendezvous: str, uri: str, path: str, ports: list, metadata: str, cache_root: str,
            out: str) -> None:
    os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = f"http://127.0.0.1:{ports[rank]}"
    os.environ["GCE_METADATA_ROOT"] = metadata
    cache = Path(cache_root) / f"host-{rank}"
    cache.mkdir(parents=True)
    os.environ["TPUFT_MODEL_CACHE"] = str(cache)
    peak_disk, done = [0], threading.Event()

    def sample():
        while not done.wait(0.05):
            peak_disk[0] = max(peak_disk[0], _disk_bytes(cache))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist

    from tpuft_workload import model as modellib
    from tpuft_workload import sharded_load
    from tpuft_workload.platform import PLATFORMS

    cpu = PLATFORMS["cpu"]
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    mesh = modellib.device_mesh(cpu, WORLD)
    modellib.load_tokenizer(uri)   # as a training worker does first
    location = modellib._local_copy(uri) if path == "copy" else modellib.weights_location(uri)
    model = modellib.empty_model(location, cpu)
    modellib.shard(model, mesh, cpu, torch.device("cpu"))
    read = sharded_load.fill(model, location)["bytes"]
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    checksum = sum(float((p.to_local() if hasattr(p, "to_local") else p).double().sum()) for p in model.parameters())
    result = {"rank": rank, "seconds_to_load": round(seconds, 2), "tensor_bytes_read": read,
              "peak_disk_bytes": max(peak_disk[0], _disk_bytes(cache)), "final_disk_bytes": _disk_bytes(cache),
              "peak_rss_bytes": sharded_load.peak_rss_bytes(), "checksum": checksum}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    # pyarrow's GCS client sometimes aborts in interpreter teardown ("terminate called without an
    # active exception", either path, once the work is done: apache/arrow#34314's kind); the
    # results are written, so leave without the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(uri: str, path: str, relays: list, metadata: str) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tpuft-bench-gcs-") as scratch:
        handle, rendezvous = tempfile.mkstemp(dir=scratch)
        os.close(handle)
        out = os.path.join(scratch, "out.json")
        for relay in relays:
            relay.take()
        mp.start_processes(_worker, args=(f"file://{rendezvous}", uri, path, [r.port for r in relays], metadata,
                                          os.path.join(scratch, "cache"), out), nprocs=WORLD, start_method="spawn")
        workers = json.loads(Path(out).read_text())
    for worker, relay in zip(workers, relays):
        worker["bucket_bytes_received"] = relay.take()
    return workers


def _wait_for_port(port: int, process, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"fake-gcs-server did not listen on {port} within {seconds} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="loads per path, alternating the order (default 3)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024: 1.1 GB fp32 with 20 layers)")
    p.add_argument("--layers", type=int, default=20, help="decoder layers (default 20)")
    p.add_argument("--server", default=None, help="the fake-gcs-server binary (default: the toolchain's)")
    p.add_argument("--data", type=Path, default=Path("/tmp/tpuft-bench-gcs-data"),
                   help="the server's data folder; the model is written once under it (default /tmp/tpuft-bench-gcs-data)")
    p.add_argument("--out", type=Path, default=OUT, help=f"results JSON (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    name = f"llama-h{args.hidden}-l{args.layers}-fp32"
    model_bytes = save_model(args.data / BUCKET / name, args.hidden, args.layers)
    uri = f"gs://{BUCKET}/{name}"
    print(f"model: {model_bytes / 2**30:.2f} GiB of safetensors at {uri}", flush=True)
    from tests.ranks import free_port

    port = free_port()
    log = open(args.data.parent / "tpuft-bench-gcs-server.log", "w")
    if args.server is None:
        from tpuft_local import gcs
        args.server = gcs.build()
    server = subprocess.Popen([args.server, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                               "-backend", "filesystem", "-data", str(args.data),
                               "-external-url", f"http://127.0.0.1:{port}"], stdout=log, stderr=log)
    metadata = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    threading.Thread(target=metadata.serve_forever, daemon=True).start()
    rows = []
    try:
        _wait_for_port(port, server)
        relays = [Relay(port) for _ in range(WORLD)]
        runs: dict[str, list] = {"copy": [], "ranges": []}
        for repeat in range(args.repeats):
            for path in (("copy", "ranges") if repeat % 2 == 0 else ("ranges", "copy")):
                workers = run(uri, path, relays, f"127.0.0.1:{metadata.server_address[1]}")
                runs[path].append(workers)
                print(f"{path:6s} repeat {repeat + 1}: " + "; ".join(
                    f"rank {w['rank']} {w['bucket_bytes_received'] / 2**20:.1f} MiB from the bucket, peak disk "
                    f"{w['peak_disk_bytes'] / 2**10:.1f} KiB, {w['seconds_to_load']:.1f} s" for w in workers), flush=True)
        checksums = {path: [w["checksum"] for w in runs[path][0]] for path in runs}
        for path, repeats in runs.items():
            assert all([w["checksum"] for w in workers] == checksums["copy"] for workers in repeats), \
                f"{path} loaded other weights than copy"

            def median(key: str, repeats=repeats) -> float:
                return statistics.median(w[key] for workers in repeats for w in workers)

            rows.append({"path": path, "ranks": WORLD, "repeats": len(repeats),
                         "bucket_mib_received_per_rank_median": round(median("bucket_bytes_received") / 2**20, 1),
                         "peak_disk_kib_per_rank_median": round(median("peak_disk_bytes") / 2**10, 1),
                         "final_disk_kib_per_rank_median": round(median("final_disk_bytes") / 2**10, 1),
                         "tensor_mib_read_per_rank_median": round(median("tensor_bytes_read") / 2**20, 1),
                         "seconds_to_load_median": median("seconds_to_load"),
                         "peak_rss_gib_per_rank_median": round(median("peak_rss_bytes") / 2**30, 2),
                         "per_repeat": repeats})
    finally:
        metadata.shutdown()
        server.terminate()
        server.wait(timeout=30)
        log.close()
    table = [f"{'path':6s} {'MiB from bucket/rank':>21s} {'peak disk KiB/rank':>19s} {'tensor MiB/rank':>16s} "
             f"{'load s':>7s} {'peak RSS GiB':>13s}"]
    for row in rows:
        table.append(f"{row['path']:6s} {row['bucket_mib_received_per_rank_median']:21.1f} "
                     f"{row['peak_disk_kib_per_rank_median']:19.1f} {row['tensor_mib_read_per_rank_median']:16.1f} "
                     f"{row['seconds_to_load_median']:7.1f} {row['peak_rss_gib_per_rank_median']:13.2f}")
    print("\n".join(table))
    args.out.with_suffix(".txt").write_text(f"{uri}: {model_bytes} bytes of safetensors, {WORLD} ranks, medians of "
                                            f"{args.repeats} repeats\n" + "\n".join(table) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": uri, "safetensors_bytes": model_bytes, "ranks": WORLD,
                                    "command": "python bench/gcs_model_load.py " + " ".join(argv or sys.argv[1:]),
                                    "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
