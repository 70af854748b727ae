"""A small HTTP fault-injecting proxy between the operator and the real API server (tests only).

The operator talks plain HTTP to 127.0.0.1:PORT (a kubeconfig with `server: http://...` and no
credentials, see `write_kubeconfig`); the proxy forwards each request over HTTPS to the real
kube-apiserver with the admin client certificate, and on a seeded schedule answers instead:

  error500   500 InternalError. Half of them BEFORE forwarding, half AFTER forwarding (the
             write happened, its response is lost: the caller cannot tell).
  throttle   429 TooManyRequests with `Retry-After: 1`, not forwarded.
  conflict   409 Conflict on a write (POST/PUT/PATCH/DELETE), not forwarded.
  drop       a watch stream cut mid-way (connection closed without the chunked terminator)
             after 0.5-4 s.
  slow       a response held back 0.5-2.5 s (still forwarded).
  gone       (only with FaultPlan.p_gone, on watches whose path contains one of the '|'-separated
             `gone_only`) the watch is
             held `gone_hold` s, then answered with a 410 Expired ERROR event, as after an etcd
             compaction: the client must re-list, and never sees what was deleted meanwhile.

Bounded: each fault type has a cap (`FaultPlan.max_per_type`) and faults are only injected while
`active` is set, so the operator always gets a clean run in the end. Loopback only. The decision
for the n-th request comes from `random.Random(seed)` drawn once per request, so the schedule
(the sequence of decisions) is reproducible; which request gets which decision depends on the
operator's timing. `seen` lists the requests made (method, path), e.g. to show a path was never asked for.
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding"}
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
TYPES = ("error500", "throttle", "conflict", "drop", "slow")
MAX_SEEN = 20000


@dataclass(frozen=True)
class FaultPlan:
    p_error500: float = 0.04
    p_throttle: float = 0.04
    p_conflict: float = 0.08   # of writes
    p_drop: float = 0.9        # of watch requests
    p_slow: float = 0.05
    max_per_type: int = 40
    p_gone: float = 0.0        # of watch requests whose path contains one of gone_only.split("|")
    gone_only: str = ""
    gone_hold: float = 3.0


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FaultProxy:
    def __init__(self, upstream: str, pki: Path, seed: int, plan: FaultPlan = FaultPlan()):
        self.upstream = upstream.rstrip("/")
        self.pki = Path(pki)
        self.rng = random.Random(seed)
        self.plan = plan
        self.active = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.seen: list[tuple[str, str]] = []   # (method, path and query) of the first MAX_SEEN requests
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"fault proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "proxy", "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}]}))
        return path

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported through start()
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx, limit=64), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    # --- the schedule ----------------------------------------------------------------------------
    def _decide(self, method: str, watch: bool, path: str = "") -> tuple[str | None, float]:
        """(fault type or None, a parameter), drawn from the seeded RNG once per request."""
        with self._lock:
            self.requests += 1
            r, param, half = self.rng.random(), self.rng.random(), self.rng.random()
            if not self.active.is_set():
                return None, 0.0
            p = self.plan
            gone = watch and any(g in path for g in p.gone_only.split("|"))
            bands = [("gone", p.p_gone if gone else 0.0),
                     ("drop", p.p_drop if watch else 0.0),
                     ("conflict", p.p_conflict if method in WRITES and not watch else 0.0),
                     ("error500", 0.0 if watch else p.p_error500),
                     ("throttle", p.p_throttle),
                     ("slow", 0.0 if watch else p.p_slow)]
            acc = 0.0
            for kind, prob in bands:
                acc += prob
                if r < acc:
                    if self.counts[kind] >= p.max_per_type:
                        return None, 0.0
                    self.counts[kind] += 1
                    if kind == "error500":
                        self.counts["error500-after-write" if half < 0.5 and method in WRITES else "error500-before"] += 1
                        return ("error500-after" if half < 0.5 and method in WRITES else "error500"), param
                    return kind, param
            return None, 0.0

    # --- the handler -----------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch") in ("true", "1")
        if len(self.seen) < MAX_SEEN:
            self.seen.append((request.method, request.rel_url.path_qs))
        fault, param = self._decide(request.method, watch, request.path)
        if fault == "gone":
            await asyncio.sleep(self.plan.gone_hold)
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            try:
                await resp.prepare(request)
                await resp.write((json.dumps({"type": "ERROR", "object": _status(
                    410, "Expired", "faultproxy: injected 410: too old resource version")}) + "\n").encode())
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientError):
                pass
            return resp
        if fault == "error500":
            return web.json_response(_status(500, "InternalError", "faultproxy: injected 500"), status=500)
        if fault == "throttle":
            return web.json_response(_status(429, "TooManyRequests", "faultproxy: injected 429"), status=429,
                                     headers={"Retry-After": "1"})
        if fault == "conflict":
            return web.json_response(_status(409, "Conflict", "faultproxy: injected 409: the object has been "
                                             "modified; please apply your changes to the latest version"),
                                     status=409)
        if fault == "slow":
            await asyncio.sleep(0.5 + 2.0 * param)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Accept-Encoding"] = "identity"   # bodies pass through unchanged
        body = await request.read()
        url = self.upstream + request.rel_url.path_qs
        try:
            upstream = await self._session.request(request.method, url, headers=headers, data=body or None,
                                                   allow_redirects=False, skip_auto_headers=("Content-Type",))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return web.json_response(_status(502, "BadGateway", f"faultproxy: upstream: {e}"), status=502)
        async with upstream:
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            if not watch:
                data = await upstream.read()
                if fault == "error500-after":
                    return web.json_response(_status(500, "InternalError", "faultproxy: injected 500 after the "
                                                     "request was forwarded"), status=500)
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            resp = web.StreamResponse(status=upstream.status, headers=out_headers)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            cut_at = asyncio.get_running_loop().time() + 0.5 + 3.5 * param if fault == "drop" else None
            try:
                while True:
                    timeout = None if cut_at is None else max(cut_at - asyncio.get_running_loop().time(), 0)
                    try:
                        chunk = await asyncio.wait_for(upstream.content.readany(), timeout)
                    except asyncio.TimeoutError:
                        chunk = None
                    if chunk is None:   # cut: close the socket without the terminating chunk
                        if request.transport is not None:
                            request.transport.close()
                        return resp
                    if not chunk:
                        break
                    await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientError):  # the client went away first
                if request.transport is not None:
                    request.transport.close()
            return resp
