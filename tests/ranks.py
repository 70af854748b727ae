"""Spawned ranks and free ports: one helper for the tests and bench/.

A gloo group's ranks meet at a fresh empty file, not a TCP port: a port picked free in the parent and
bound by rank 0 seconds later can be taken in between by any other process on the machine (CI's lanes
run side by side), and torch then fails with EADDRINUSE. A file cannot be taken, and gloo binds its own
connections to ports the kernel hands it. `free_port` is for a server the caller starts at once on it."""
from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Callable


def file_rendezvous(folder: str | os.PathLike) -> str:
    """An `init_method` for one process group: a new empty file in `folder` (torch's FileStore wants
    one that is empty or absent, used by one group only)."""
    handle, path = tempfile.mkstemp(prefix="rendezvous-", dir=folder)
    os.close(handle)
    return f"file://{path}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable[..., Any], world: int, *args: Any) -> None:
    """worker(rank, init_method, *args) in `world` spawned processes of one gloo group; raises when one fails."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tpuft-ranks-") as folder:
        mp.start_processes(worker, args=(file_rendezvous(folder), *args), nprocs=world, start_method="spawn")
