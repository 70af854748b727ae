"""Collective verification with Ray Core: does every device of the slice talk to every other?

One actor per logical device, placed by a placement group that reserves the whole slice
(on TPU: ray.util.tpu.slice_placement_group). Each actor joins the process group, runs a
tensor-parallel feed-forward block with DTensor against a single-device reference built
from the same seed, and an all_reduce of rank+1 (expected N(N+1)/2). With several slices, the
same all_reduce inside each slice and across the slices too: a failure names its slice.

Every wait has a deadline derived from --timeout-seconds: a dead host, a missing
TORCH_TPU_* variable or a hung collective ends as a failed result with a reason, never a
hang. The driver-side deadline is the hard guarantee; the process-group timeout inside the
actors only makes the error clearer when it fires first.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpuft_workload import faults as faultlib
from tpuft_workload.verify_result import (  # noqa: F401  (re-exported: the CLI and tests use them)
    EXIT_FAILED, EXIT_PASSED, EXIT_TIMEOUT, RESULT_PREFIX, VerifyResult, print_result, storage_refused)
from tpuft_workload.platform import Target, missing_tpu_env, tpu_env_error

log = logging.getLogger(__name__)

SEED = 42
HIDDEN = 128
BATCH = 64
PARITY_TOLERANCE = 1e-2   # atol: TPU matmuls run at reduced precision (~2.5e-3 seen), never bit-exact


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _feed_forward(hidden: int):
    import torch.nn as nn

    class FeedForward(nn.Module):
        """x + W2·silu(W1·x): W1 column-sharded, W2 row-sharded (Megatron-style TP)."""

        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(hidden, 4 * hidden, bias=False)
            self.act = nn.SiLU()
            self.w2 = nn.Linear(4 * hidden, hidden, bias=False)

        def forward(self, x):
            return x + self.w2(self.act(self.w1(x)))

    return FeedForward()


@ray.remote(max_concurrency=2)  # second thread answers phase() while run() blocks
class CollectiveWorker:
    """One logical device. Rank comes from the TPU env on TPU, from the bundle index elsewhere."""

    def __init__(self, target: Target, bundle_index: int, fault_spec: str):
        self.target = target
        self.bundle_index = bundle_index
        self.faults = faultlib.parse_faults(fault_spec)
        self._phase = "created"

    def phase(self) -> str:
        return self._phase

    def describe(self) -> dict:
        # Import torch (and the TPU backend) now, under the start-up deadline, so run() reaches
        # the process group quickly and a stuck rank's phase says where it really is.
        import torch.distributed  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        from tpuft_workload.platform import load_backend

        load_backend(self.target.platform)
        t = self.target
        info = {"bundle": self.bundle_index, "node_ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "missing_env": []}
        if t.platform.is_tpu:
            info["missing_env"] = missing_tpu_env(t.shape)
            local = int(ray.get_runtime_context().get_accelerator_ids().get("TPU", ["0"])[0])
            worker_id = int(os.environ.get("TPU_WORKER_ID") or 0)
            slice_idx = _slice_index(self.bundle_index, t.shape.devices) if t.slices > 1 else 0
            info.update(local_rank=local, worker_id=worker_id,
                        rank=tpu_rank(t.shape, slice_idx, worker_id, local))
        else:
            gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU") or []
            info.update(local_rank=int(gpus[0]) if gpus else 0, worker_id=self.bundle_index,
                        rank=self.bundle_index)
        self.rank, self.local_rank = info["rank"], info["local_rank"]
        if self.rank == 0:
            info["port"] = _free_port()
        return info

    def run(self, master_addr: str, master_port: int, world_size: int, timeout_s: float) -> dict:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from tpuft_workload.platform import device as device_for, load_backend

        t0 = time.monotonic()
        self._phase = "starting (not joined)"
        if faultlib.find(self.faults, "hang", self.rank):
            time.sleep(10**7)  # injected: behave like a dead host that never joins
        if faultlib.find(self.faults, "fail", self.rank):
            raise RuntimeError(f"injected failure on rank {self.rank} ({faultlib.ENV_FAULT})")
        plat = self.target.platform
        load_backend(plat)
        os.environ.update({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(world_size), "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.target.shape.devices_per_host),
        })
        dev = device_for(plat, self.local_rank)
        if plat.kind == "gpu":
            torch.cuda.set_device(dev)
        self._phase = "joining the process group"
        dist.init_process_group(backend=plat.backend, init_method="env://", rank=self.rank,
                                world_size=world_size, timeout=timedelta(seconds=max(1.0, timeout_s)))
        try:
            self._phase = "DTensor tensor-parallel check"
            # 1. single-device reference on CPU, same seed
            torch.manual_seed(SEED)
            ref = _feed_forward(HIDDEN).eval()
            x = torch.randn(BATCH, HIDDEN)
            with torch.no_grad():
                ref_out = ref(x)
            # 2. the same block, tensor-parallel over every device of the slice
            torch.manual_seed(SEED)
            tp = _feed_forward(HIDDEN).to(dev).eval()
            mesh = init_device_mesh(plat.device_type, (world_size,))
            tp = parallelize_module(tp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            with torch.no_grad():
                tp_out = tp(x.to(dev))
            tp_out = tp_out.full_tensor() if hasattr(tp_out, "full_tensor") else tp_out
            max_abs_diff = float((tp_out.cpu().float() - ref_out).abs().max().item())
            self._phase = "all_reduce"
            # 3. a plain all_reduce: sum of rank+1 over the world
            t = torch.full((4,), float(self.rank + 1), dtype=torch.float32, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            sums = t.cpu().tolist()
            inside, across = self._slice_collectives(dist, torch, dev, world_size)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        self._phase = "done"
        out = {"rank": self.rank, "all_reduce_sum": sums, "max_abs_diff": max_abs_diff,
               "seconds": time.monotonic() - t0}
        if inside is not None:
            out.update(slice_sum=inside, cross_slice_sum=across)
        return out

    def _slice_collectives(self, dist, torch, dev, world_size: int) -> tuple[list | None, list | None]:
        """Several slices: an all_reduce of rank+1 inside this rank's slice (ICI), then one across the
        slices among the ranks at the same place in each (DCN), each over its own subgroup."""
        slices = self.target.slices
        if slices <= 1:
            return None, None
        per = world_size // slices
        sums = []
        for phase, groups in (("all_reduce inside its slice", [[s * per + i for i in range(per)] for s in range(slices)]),
                              ("all_reduce across slices", [[s * per + i for s in range(slices)] for i in range(per)])):
            self._phase = phase
            group, _ = dist.new_subgroups_by_enumeration(groups)
            t = torch.full((4,), float(self.rank + 1), dtype=torch.float32, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            sums.append(t.cpu().tolist())
        return sums[0], sums[1]


def tpu_rank(shape, slice_index: int, worker_id: int, local_device: int) -> int:
    """Global rank of a TPU device: slices, then hosts (TPU_WORKER_ID), then local device id."""
    return slice_index * shape.devices + worker_id * shape.devices_per_host + local_device


def _who(target: Target, rank: int) -> str:
    """'rank 3', or 'rank 3 (slice 1)' when there are several slices (ranks are slice-major)."""
    return f"rank {rank} (slice {rank // target.shape.devices})" if target.slices > 1 else f"rank {rank}"


def slice_mismatch(target: Target, results: dict[int, dict]) -> str | None:
    """Which slice's (or which cross-slice group's) all_reduce came out wrong, or None."""
    if target.slices <= 1:
        return None
    per, slices = target.shape.devices, target.slices
    checks = [(f"inside slice {s}", "slice_sum", [s * per + i for i in range(per)]) for s in range(slices)]
    checks += [(f"across slices (device {i} of each slice)", "cross_slice_sum", [s * per + i for s in range(slices)])
               for i in range(per)]
    for where, key, ranks in checks:
        want = float(sum(r + 1 for r in ranks))
        bad = [r for r in ranks if any(v != want for v in results[r][key])]
        if bad:
            return (f"all_reduce mismatch {where}: {_who(target, bad[0])} got {results[bad[0]][key]}, "
                    f"expected {want}")
    return None


def _slice_index(bundle_index: int, devices_per_slice: int) -> int:
    """Which slice this worker belongs to. MEGASCALE_SLICE_ID when multislice sets it; else the
    replica index at the end of TPU_NAME ({group}-{replica}, set by the webhook); else bundle order."""
    sid = os.environ.get("MEGASCALE_SLICE_ID")
    if sid and sid.isdigit():
        return int(sid)
    name = os.environ.get("TPU_NAME", "")
    tail = name.rsplit("-", 1)[-1]
    if name and tail.isdigit():
        return int(tail)
    return bundle_index // max(1, devices_per_slice)


class _Deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def _reserve(target: Target, deadline: _Deadline):
    """Placement group for the whole world; returns (pg, release_fn). TimeoutError on deadline."""
    shape = target.shape
    if target.platform.is_tpu:
        from ray.util.tpu import slice_placement_group

        handle = slice_placement_group(
            topology=shape.topology, accelerator_version=shape.ray_version,
            resources_per_bundle={"TPU": 1}, num_slices=target.slices,
            tpu_resource_per_chip=shape.tpu_resource_per_chip,
            head_reservation_timeout_s=max(1.0, deadline.left()),
        )
        pg, release = handle.placement_group, handle.shutdown
        if handle.num_bundles != target.world_size:
            release()
            raise RuntimeError(f"Ray reserved {handle.num_bundles} TPU bundles but the catalog expects "
                               f"{target.world_size} devices for {shape.generation} {shape.topology} "
                               f"x{target.slices}: check RAY_TPU_RESOURCE_PER_CHIP on the cluster")
    else:
        bundle = {"CPU": 1} if target.platform.kind == "cpu" else {"CPU": 1, "GPU": 1}
        pg = placement_group([dict(bundle) for _ in range(target.world_size)], strategy="SPREAD")
        release = lambda: remove_placement_group(pg)  # noqa: E731
    try:
        ray.get(pg.ready(), timeout=max(0.1, deadline.left()))
    except ray.exceptions.GetTimeoutError:
        release()
        raise TimeoutError from None
    return pg, release


def _wait_all(refs: list, deadline: _Deadline) -> tuple[dict, list[int]]:
    """Wait until all refs finish, one fails, or the deadline passes.

    Returns ({index: value | Exception}, [indices still pending]). Stops at the first failure:
    the other ranks would only sit in a collective waiting for the failed one.
    """
    index = {r: i for i, r in enumerate(refs)}
    out, pending = {}, list(refs)
    while pending and deadline.left() > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=deadline.left())
        for r in ready:
            try:
                out[index[r]] = ray.get(r, timeout=max(0.1, deadline.left()))
            except Exception as e:  # noqa: BLE001 - every actor failure becomes a reason
                out[index[r]] = e
        if any(isinstance(v, Exception) for v in out.values()):
            break
    return out, sorted(index[r] for r in pending)


def _phases(workers: list, indices: list[int]) -> dict[int, str]:
    """Ask stuck actors where they are (threaded actors answer while run() blocks)."""
    refs = {i: workers[i].phase.remote() for i in indices}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=3)
    out = {}
    for i, r in refs.items():
        try:
            out[i] = ray.get(r, timeout=0.1) if r in ready else "unresponsive"
        except Exception:  # noqa: BLE001
            out[i] = "dead"
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    tail = [ln for ln in text if ln.strip()]
    return f"{type(e).__name__}: {tail[-1] if tail else ''}"[:400]


def run_verification(target: Target, timeout_s: float, fault_spec: str = "",
                     collective_timeout_s: float | None = None) -> VerifyResult:
    """Run the whole check against the connected Ray cluster. Never raises; never hangs.

    `timeout_s` bounds the whole check. `collective_timeout_s`, when given, bounds the collectives
    once every worker has started: start-up waits on pods, images and imports, a collective only on
    the slice itself, so a hung rank is named in seconds even where starting took minutes.
    """
    start = time.monotonic()
    deadline = _Deadline(timeout_s)
    n = target.world_size
    expected = n * (n + 1) / 2
    res = VerifyResult(passed=False, ranks=n, expected_sum=expected)
    workers, release = [], None

    def done(message: str, timed_out: bool = False) -> VerifyResult:
        res.message, res.timed_out = message, timed_out
        res.seconds = time.monotonic() - start
        return res

    try:
        faultlib.parse_faults(fault_spec)  # reject a bad spec before reserving anything
        where = (f"{target.shape.generation} {target.shape.topology} x{target.slices} "
                 f"({n} devices, {target.shape.hosts * target.slices} hosts)")
        try:
            pg, release = _reserve(target, deadline)
        except TimeoutError:
            return done(f"timeout: the placement group for {where} was not ready within {timeout_s:.0f}s; "
                        "check that every worker pod of the slice is Running and joined the Ray cluster "
                        "(ray status) and that its nodeSelector matches the node pool", timed_out=True)
        workers = [
            CollectiveWorker.options(
                num_cpus=0 if target.platform.is_tpu else 1,
                resources={"TPU": 1} if target.platform.is_tpu else None,
                num_gpus=1 if target.platform.kind == "gpu" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i),
            ).remote(target, i, fault_spec)
            for i in range(n)
        ]
        got, pending = _wait_all([w.describe.remote() for w in workers], deadline)
        if pending:
            return done(f"timeout: {len(pending)} of {n} workers (bundles {pending[:16]}) did not start "
                        f"within {timeout_s:.0f}s", timed_out=True)
        errors = {i: v for i, v in got.items() if isinstance(v, Exception)}
        if errors:
            i, e = next(iter(errors.items()))
            return done(f"{len(errors)} workers failed to start; bundle {i}: {_first_line(e)}")
        infos = [got[i] for i in range(n)]
        res.hosts = len({d["node_ip"] for d in infos})
        for d in infos:
            if d["missing_env"]:
                return done(tpu_env_error(d["missing_env"], f"{d['hostname']} ({d['node_ip']})"))
        ranks = sorted(d["rank"] for d in infos)
        if ranks != list(range(n)):
            return done(f"workers computed ranks {ranks}, expected 0..{n - 1}: TPU_WORKER_ID/TPU_NAME "
                        "disagree with the slice layout; check the TPU webhook injected them per host")
        by_rank = {d["rank"]: (i, d) for i, d in enumerate(infos)}
        master = by_rank[0][1]
        bound = timeout_s
        if collective_timeout_s is not None and collective_timeout_s < deadline.left():
            deadline, bound = _Deadline(collective_timeout_s), collective_timeout_s
        # +5 s: the driver deadline fires first and can still ask each stuck rank where it is.
        refs = [workers[i].run.remote(master["node_ip"], master["port"], n, deadline.left() + 5)
                for i in range(n)]
        got, pending = _wait_all(refs, deadline)
        rank_of = {i: d["rank"] for i, d in enumerate(infos)}
        results = {rank_of[i]: v for i, v in got.items() if not isinstance(v, Exception)}
        failed = {rank_of[i]: v for i, v in got.items() if isinstance(v, Exception)}
        res.per_rank = [results[r] for r in sorted(results)]
        res.all_reduce_sums = [results.get(r, {}).get("all_reduce_sum") for r in range(n)]
        diffs = [r["max_abs_diff"] for r in results.values()]
        res.max_abs_diff = max(diffs) if diffs else None
        if failed:
            r, e = sorted(failed.items())[0]
            kind = "timeout: " if "timed out" in str(e).lower() else ""
            return done(f"{kind}{len(failed)} of {n} ranks failed; {_who(target, r)}: {_first_line(e)}",
                        timed_out=bool(kind))
        if pending:
            where_ = _phases(workers, pending)
            stuck = ", ".join(f"{_who(target, rank_of[i])} on {infos[i]['hostname']}: {where_[i]}" for i in pending[:16])
            return done(f"timeout: {len(pending)} of {n} ranks did not finish the collectives within "
                        f"{bound:.0f}s ({stuck})", timed_out=True)
        bad_sum = [r for r in range(n) if any(v != expected for v in res.all_reduce_sums[r])]
        if bad_sum:
            return done(f"all_reduce mismatch: ranks {bad_sum[:16]} got {res.all_reduce_sums[bad_sum[0]]}, "
                        f"expected {expected}")
        wrong = slice_mismatch(target, results)
        if wrong:
            return done(wrong)
        if res.max_abs_diff is None or res.max_abs_diff > PARITY_TOLERANCE:
            return done(f"tensor-parallel parity failed: max abs diff {res.max_abs_diff} > {PARITY_TOLERANCE}")
        res.passed = True
        slices = f"; inside each of {target.slices} slices and across them" if target.slices > 1 else ""
        return done(f"all {n} ranks on {res.hosts} hosts verified DTensor TP parity "
                    f"(max_abs_diff={res.max_abs_diff:.3g}) and all_reduce sum = {expected}{slices}")
    except Exception as e:  # noqa: BLE001 - the result, not a traceback, is the contract
        log.exception("verification crashed")
        return done(f"verification error: {_first_line(e)}")
    finally:
        for w in workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001
                pass
        if release is not None:
            try:
                release()
            except Exception:  # noqa: BLE001
                pass
