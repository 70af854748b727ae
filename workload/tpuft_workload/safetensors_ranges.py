"""Safetensors checkpoints read by byte range through a pyarrow filesystem: a local folder and a
gs:// folder take the same path, so a rank reads only the bytes of the rows it holds, straight
from the bucket, and no host ever needs room for the whole model.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and data_offsets, relative to the end of the header) and the data. Rows [a, b) of dim 0 of a
row-major tensor are one contiguous byte range, so a rank's shard is one ranged read per tensor.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
import warnings
from typing import Any

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class ShardedLoadError(RuntimeError):
    """The checkpoint cannot fill the model: which tensors, which files, what to do."""


@dataclasses.dataclass(frozen=True)
class Folder:
    """A checkpoint folder: the pyarrow filesystem that holds it, its path there, and how to name
    it to a user (the gs:// URI or the local path)."""
    filesystem: Any
    path: str
    name: str

    @classmethod
    def at(cls, location: str, filesystem=None) -> Folder:
        """`location` a local path or a URI (gs://bucket/folder); with `filesystem`, a path inside it."""
        import pyarrow.fs as pafs

        if filesystem is not None:
            return cls(filesystem, location.rstrip("/"), location)
        if "://" not in location:
            return cls(pafs.LocalFileSystem(), os.path.abspath(location), location)
        fs, path = pafs.FileSystem.from_uri(location)
        return cls(fs, path.rstrip("/"), location.rstrip("/"))

    def file(self, name: str) -> str:
        return f"{self.path}/{name}"

    def label(self, path: str) -> str:
        """A file of this folder as the user wrote the folder (gs://bucket/folder/file)."""
        return f"{self.name.rstrip('/')}/{path.removeprefix(self.path).lstrip('/')}"

    def is_file(self, name: str) -> bool:
        import pyarrow.fs as pafs

        return self.filesystem.get_file_info(self.file(name)).type == pafs.FileType.File

    def read_text(self, name: str) -> str:
        try:
            with self.filesystem.open_input_stream(self.file(name)) as stream:
                return stream.read().decode()
        except FileNotFoundError as e:
            raise ShardedLoadError(f"{self.label(self.file(name))} not found") from e


def loadable(folder: Folder) -> bool:
    """Whether `folder` holds a safetensors checkpoint (one file or an index)."""
    return folder.is_file(INDEX) or folder.is_file(SINGLE)


def weight_files(folder: Folder) -> dict[str, str]:
    """{tensor name: the path of its file in folder.filesystem}: the index's weight map, or the
    single file's header (read by range)."""
    if folder.is_file(INDEX):
        weight_map = json.loads(folder.read_text(INDEX))["weight_map"]
        return {name: folder.file(file) for name, file in weight_map.items()}
    with SafetensorsFile(folder, folder.file(SINGLE)) as single:
        return {name: single.path for name in single.header if name != "__metadata__"}


class _LocalFile:
    """A local file read with pread, as pyarrow's file is read here (`read_at`), plus `read_into`:
    a range read straight into a tensor's memory, its pages then dropped from the page cache
    (posix_fadvise DONTNEED). A rank reads each byte once: the cache would only hold the pages,
    charged to the pod's cgroup, where they count in its usage until the kernel reclaims them."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)
        # no readahead: pages past a rank's rows are another rank's, and nobody here reads them
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def seek(self, offset: int) -> None:   # pyarrow's GCS file wants one; pread has no position
        pass

    def read_at(self, count: int, offset: int) -> bytes:
        data = os.pread(self.fd, count, offset)
        self._forget(offset, len(data))
        return data

    def read_into(self, memory: memoryview, offset: int) -> int:
        """`memory` filled from `offset` on (pread may return less than asked: loop to the end of
        the file); the bytes read."""
        done = 0
        while done < len(memory):
            got = os.preadv(self.fd, [memory[done:]], offset + done)
            if got == 0:
                break
            done += got
        self._forget(offset, done)
        return done

    def _forget(self, offset: int, count: int) -> None:
        if count:
            os.posix_fadvise(self.fd, offset, count, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)


class SafetensorsFile:
    """One safetensors file, its header parsed through two ranged reads; `read_into` reads one
    tensor's rows, one range. Not memory-mapped: mapped pages a rank touched would count in its
    resident memory until the file is closed, and a bucket cannot be mapped. A local file is read
    with pread (`_LocalFile`): into the tensor itself when the dtypes match, its page cache
    dropped; pyarrow's local file gives a buffer of its own allocator, then copied."""

    def __init__(self, folder: Folder, path: str):
        import pyarrow.fs as pafs

        self.path = path
        self.label = folder.label(path)
        try:
            local = type(folder.filesystem) is pafs.LocalFileSystem
            self.handle = _LocalFile(path) if local else folder.filesystem.open_input_file(path)
        except FileNotFoundError as e:
            raise ShardedLoadError(f"{self.label} not found: the checkpoint folder lacks a weight file "
                                   f"(upload it, or point spec.model at a complete folder)") from e
        try:
            # pyarrow's GCS file starts a download of the whole object at open, for sequential
            # reads we never make; it pulls bytes until a TCP window fills (tens of MB on a
            # connection a large read widened). Seeking to the last byte replaces it with a
            # 1-byte one; every read here is a bounded read_at of its own.
            size = self.handle.size()
            if size:
                self.handle.seek(size - 1)
            length = struct.unpack("<Q", self._read(0, 8, "the header length"))[0]
            self.header = json.loads(self._read(8, length, "the header"))
        except Exception:
            self.handle.close()
            raise
        self.base = 8 + length

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.handle.close()

    def _read(self, offset: int, count: int, what: str):
        """Bytes [offset, offset + count) of the file, one bounded ranged read (read_at: a seek then
        a read would open a stream to the end of a GCS object and pull bytes nobody reads)."""
        buffer = self.handle.read_at(count, offset)
        if len(buffer) != count:
            raise ShardedLoadError(f"{self.label} ends inside {what} (byte {offset + len(buffer)} of the "
                                   f"{offset + count} needed): the file is truncated; upload it again")
        return buffer

    def read_into(self, name: str, target, start: int | None) -> int:
        """Rows [start, start + len(target)) of tensor `name` (all of it when start is None) copied
        into `target`; the bytes read."""
        import torch

        entry = self.header[name]
        dtype = _dtypes().get(entry["dtype"])
        if dtype is None:
            raise ShardedLoadError(f"{name} in {self.label} is {entry['dtype']}, a dtype this loader does not read")
        shape = tuple(entry["shape"])
        rows = shape[0] if shape else 1
        first, count = (0, rows) if start is None else (start, target.shape[0])
        wanted = shape if start is None else (count, *shape[1:])
        if tuple(target.shape) != wanted or first + count > rows:
            raise ShardedLoadError(f"{name} in {self.label} has shape {shape}, not the {tuple(target.shape)} this "
                                   "rank holds: the checkpoint is not of this architecture")
        row = math.prod(shape[1:]) * dtype.itemsize
        size = count * row
        offset = self.base + entry["data_offsets"][0] + first * row
        if size and isinstance(self.handle, _LocalFile) and target.dtype == dtype and target.is_contiguous():
            memory = memoryview(target.detach().view(torch.uint8).numpy()).cast("B")
            got = self.handle.read_into(memory, offset)
            if got != size:
                raise ShardedLoadError(f"{self.label} ends inside {name} (byte {offset + got} of the {offset + size} "
                                       "needed): the file is truncated; upload it again")
        elif size:
            buffer = self._read(offset, size, name)
            with warnings.catch_warnings():   # read_at gives bytes (read-only); they are only copied from
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                target.copy_(torch.frombuffer(buffer, dtype=dtype).view(target.shape))
        return size


@functools.cache
def _dtypes() -> dict:
    """safetensors' dtype names as torch's."""
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}
