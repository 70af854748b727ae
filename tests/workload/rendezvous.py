"""Where the spawned gloo ranks of the workload tests meet: a fresh empty file, not a TCP port.

A port picked free in the parent and bound by rank 0 seconds later can be taken in between by any
other process on the machine (CI's lanes run side by side): torch then fails with EADDRINUSE. A file
cannot be taken, and gloo binds its own connections to ports the kernel hands it."""
from __future__ import annotations

import os
import tempfile


def file_rendezvous(folder: str | os.PathLike) -> str:
    """An `init_method` for one process group: a new empty file in `folder` (torch's FileStore wants
    one that is empty or absent, used by one group only)."""
    handle, path = tempfile.mkstemp(prefix="rendezvous-", dir=folder)
    os.close(handle)
    return f"file://{path}"
