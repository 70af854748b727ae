"""A model read in place from object storage (tpuft_workload.safetensors_ranges, through sharded_load
and model.py's gs:// resolution): each rank reads only the byte ranges of its own rows, the weights
equal a full load's, and no host downloads more than the model's small files.

The source of bytes is a pyarrow filesystem, local or gs:// alike; here a PyFileSystem over the
local one records every read (file, offset, length), so "only its own ranges" is checked byte for
byte: per file, the two ranks' data reads are disjoint and together cover the data exactly once,
and nothing else is read but the headers. A `file://` URI takes the URI path gs:// takes (pyarrow's
FileSystem.from_uri); a test against a GCS API server is separate."""
from __future__ import annotations

import json
import os
import struct
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from tests.ranks import file_rendezvous
from tpuft_workload import model as modellib
from tpuft_workload import safetensors_ranges, sharded_load
from tpuft_workload.platform import PLATFORMS

WORLD = 2
CPU = PLATFORMS["cpu"]


class _RecordedFile:
    """A local file whose reads are appended to `reads` as (offset, bytes returned)."""

    def __init__(self, path: str, reads: list):
        self.file = open(path, "rb")
        self.reads = reads

    def read(self, count: int = -1) -> bytes:
        offset = self.file.tell()
        data = self.file.read(count)
        self.reads.append((offset, len(data)))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        self.file.close()

    @property
    def closed(self) -> bool:
        return self.file.closed


class RecordingHandler(pafs.FileSystemHandler):
    """The local filesystem, each file's reads recorded in `reads[path]`."""

    def __init__(self):
        self.local = pafs.LocalFileSystem()
        self.reads: dict[str, list] = defaultdict(list)

    def open_input_file(self, path):
        return pa.PythonFile(_RecordedFile(path, self.reads[path]), mode="r")

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def get_type_name(self):
        return "recording"

    def equals(self, other):
        return other is self

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def _read_only(self, *args):
        raise OSError("read-only in this test")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _read_only
    move = copy_file = open_output_stream = open_append_stream = _read_only


def _header_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False, use_cache=False)


def _save(folder: Path, max_shard_size: str) -> None:
    from transformers import LlamaForCausalLM

    from tpuft_workload import tiny

    torch.manual_seed(11)
    LlamaForCausalLM(_config()).save_pretrained(folder, max_shard_size=max_shard_size)
    tiny.build_tokenizer().save_pretrained(folder)
    (folder / "original").mkdir()   # a subfolder of other weights (as Llama's repos have): never downloaded
    (folder / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1024)


def _gathered(model) -> dict:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank: int, rendezvous: str, folders: dict, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    mesh = modellib.device_mesh(CPU, WORLD)
    result = {}
    for case, folder in folders.items():
        full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        modellib.shard(full, mesh, CPU, torch.device("cpu"))
        # this rank's "host": its own cache of the model's small files
        os.environ["TPUFT_MODEL_CACHE"] = str(Path(out).parent / f"cache-{case}-{rank}")
        handler = RecordingHandler()
        if case == "uri":   # through spec.model's resolution, as a gs:// model goes
            location = modellib.weights_location(Path(folder).as_uri())
            empty = modellib.empty_model(location, CPU)
            modellib.shard(empty, mesh, CPU, torch.device("cpu"))
            stats = sharded_load.fill(empty, location)
        else:
            empty = modellib.empty_model(folder, CPU)
            modellib.shard(empty, mesh, CPU, torch.device("cpu"))
            stats = sharded_load.fill(empty, folder, filesystem=pafs.PyFileSystem(handler))
        cached = sorted(str(p.relative_to(os.environ["TPUFT_MODEL_CACHE"]))
                        for p in Path(os.environ["TPUFT_MODEL_CACHE"]).rglob("*") if p.is_file())
        result[case] = {"full": _gathered(full), "sharded": _gathered(empty), "bytes": stats["bytes"],
                        "reads": dict(handler.reads), "cached": cached}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {case: {k: r[k] for k in ("bytes", "reads", "cached")}
                                      for case, r in result.items()})
    if rank == 0:
        for case in result:
            result[case]["per_rank"] = [g[case] for g in gathered]
        torch.save(result, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("ranges")
    folders = {"single": root / "single", "index": root / "index"}
    _save(folders["single"], "10MB")
    _save(folders["index"], "40KB")
    assert (folders["index"] / safetensors_ranges.INDEX).is_file() and not (folders["single"] / safetensors_ranges.INDEX).exists()
    folders = {case: str(folder) for case, folder in folders.items()} | {"uri": str(folders["index"])}
    out = str(root / "result.pt")
    mp.start_processes(_rank, args=(file_rendezvous(root), folders, out), nprocs=WORLD, start_method="spawn")
    result = torch.load(out)
    for case, folder in folders.items():
        files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
        result[case]["files"] = {f: (_header_bytes(f), os.path.getsize(f)) for f in files}
    return result


@pytest.mark.parametrize("case", ["single", "index", "uri"])
def test_the_weights_read_by_range_are_the_full_loads(loaded, case):
    got = loaded[case]
    assert got["full"].keys() == got["sharded"].keys()
    for name, tensor in got["full"].items():
        assert torch.equal(tensor, got["sharded"][name]), name


@pytest.mark.parametrize("case", ["single", "index"])
def test_each_rank_reads_only_its_own_ranges_and_together_every_byte_once(loaded, case):
    got = loaded[case]
    assert (len(got["files"]) == 1) == (case == "single")
    data_total = sum(size - header for header, size in got["files"].values())
    for path, (header, size) in got["files"].items():
        data_ranges = []
        for rank in got["per_rank"]:
            # outside the data section only the header: its length, then the JSON (a single file's
            # header is read twice: for its tensor names, then to read them)
            data = [read for read in rank["reads"][path] if read not in ((0, 8), (8, header - 8))]
            assert all(offset >= header and offset + count <= size for offset, count in data), path
            data_ranges.append(data)
        covered = sorted(r for ranges in data_ranges for r in ranges)
        position = header
        for offset, count in covered:   # disjoint across ranks and gap-free: every data byte read exactly once
            assert offset == position, (path, offset, position)
            position += count
        assert position == size, path
    for rank in got["per_rank"]:
        assert {Path(path).name for path in rank["reads"]} - {Path(f).name for f in got["files"]} <= {
            safetensors_ranges.INDEX}
        data = sum(count for path, (header, _) in got["files"].items() for offset, count in rank["reads"][path]
                   if offset >= header)
        assert data == rank["bytes"]
        assert 0.4 * data_total <= data <= 0.6 * data_total, (data, data_total)   # about its half


def test_a_host_caches_the_small_files_only(loaded):
    for rank in loaded["uri"]["per_rank"]:
        cached = rank["cached"]
        assert any(name.endswith("config.json") for name in cached) and any("tokenizer" in n for n in cached)
        assert safetensors_ranges.INDEX in " ".join(cached)
        assert not [name for name in cached if name.endswith(".safetensors") or name.startswith("original")], cached


def test_rows_of_every_dtype_are_their_byte_range(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    tensors = {"f32": torch.randn(7, 3), "bf16": torch.randn(5, 4).to(torch.bfloat16),
               "f16": torch.randn(6).to(torch.float16), "i64": torch.arange(12).view(4, 3),
               "scalar": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    handler = RecordingHandler()
    folder = safetensors_ranges.Folder.at(str(tmp_path), pafs.PyFileSystem(handler))
    path = str(tmp_path / "model.safetensors")
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8:_header_bytes(path)])
    with safetensors_ranges.SafetensorsFile(folder, path) as f:
        for name, tensor in tensors.items():
            handler.reads[path].clear()
            if tensor.ndim == 0:
                target, start, rows = torch.empty(()), None, tensor
            else:
                start, stop = 1, tensor.shape[0] - 1
                target, rows = torch.empty((stop - start, *tensor.shape[1:]), dtype=tensor.dtype), tensor[start:stop]
            read = f.read_into(name, target, start)
            assert torch.equal(target.to(tensor.dtype), rows), name
            row = tensor[0].numel() * tensor.element_size() if tensor.ndim else tensor.element_size()
            offset = _header_bytes(path) + header[name]["data_offsets"][0] + (start or 0) * row
            assert handler.reads[path] == [(offset, read)] and read == rows.numel() * tensor.element_size(), name
        with pytest.raises(sharded_load.ShardedLoadError, match="has shape"):
            f.read_into("f32", torch.empty(2, 4), 0)


def test_a_truncated_file_and_a_missing_weight_file_say_which(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(8, 8)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-16])
    folder = safetensors_ranges.Folder.at(str(tmp_path))
    with safetensors_ranges.SafetensorsFile(folder, folder.file("model.safetensors")) as f:
        with pytest.raises(sharded_load.ShardedLoadError, match=r"model.safetensors ends inside w .*truncated"):
            f.read_into("w", torch.empty(8, 8), None)
    (tmp_path / safetensors_ranges.INDEX).write_text(json.dumps({"weight_map": {"weight": "model-00002.safetensors"}}))
    uri = tmp_path.as_uri()
    with pytest.raises(sharded_load.ShardedLoadError, match=f"{uri}/model-00002.safetensors not found"):
        sharded_load.fill(torch.nn.Linear(8, 8), uri)


def test_a_missing_model_folder_says_not_found_with_its_uri(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUFT_MODEL_CACHE", str(tmp_path / "cache"))
    missing = (tmp_path / "no-such-model").as_uri()
    for resolve in (modellib.load_tokenizer, modellib.meta_model, modellib._local_copy):
        with pytest.raises(modellib.ModelNotFound, match=f"spec.model {missing} not found"):
            resolve(missing)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(modellib.ModelNotFound, match="is an object, not a folder"):
        modellib._small_files((tmp_path / "model.safetensors").as_uri())
    assert modellib.weights_location("gs://bucket/model") == "gs://bucket/model"   # read in place, not copied


def test_a_whole_copy_still_holds_every_file_for_the_readers_that_want_one(tmp_path, monkeypatch):
    """Serving, the JAX path and a checkpoint without safetensors read a local folder: _local_copy
    downloads the whole of it, subfolders included, once per host."""
    monkeypatch.setenv("TPUFT_MODEL_CACHE", str(tmp_path / "cache"))
    _save(tmp_path / "model", "10MB")
    uri = (tmp_path / "model").as_uri()
    source = sorted(str(p.relative_to(tmp_path / "model")) for p in (tmp_path / "model").rglob("*") if p.is_file())
    whole = Path(modellib._local_copy(uri))
    assert sorted(str(p.relative_to(whole)) for p in whole.rglob("*") if p.is_file() and p.name != ".complete") == source
    small = Path(modellib._small_files(uri))
    assert sorted(p.name for p in small.iterdir() if p.name != ".complete") == [
        name for name in source if "/" not in name and not name.endswith(".safetensors")]


def _resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vector = ctypes.create_string_buffer(pages)
        assert libc.mincore(address, size, vector) == 0, ctypes.get_errno()
        libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vector.raw)


def test_a_local_file_is_read_into_the_tensor_and_leaves_no_page_cache_behind(tmp_path):
    """A rank reads each byte of its rows once: the pages a local read brought into the page cache
    (charged to the pod's cgroup) are dropped; the values are the file's, whatever the dtypes."""
    from safetensors.torch import save_file

    torch.manual_seed(5)
    tensors = {"f32": torch.randn(512, 1024), "bf16": torch.randn(256, 512).to(torch.bfloat16)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)   # written pages are dirty: only clean ones can be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert _resident_pages(path) == 0
    folder = safetensors_ranges.Folder.at(str(tmp_path))
    with safetensors_ranges.SafetensorsFile(folder, path) as f:
        same = torch.empty(200, 1024)              # the file's dtype: read straight into the tensor
        wider = torch.empty(100, 512)              # bf16 in the file, fp32 here: read, then converted
        assert f.read_into("f32", same, 300) == 200 * 1024 * 4 and f.read_into("bf16", wider, 56) == 100 * 512 * 2
    assert torch.equal(same, tensors["f32"][300:500]) and torch.equal(wider, tensors["bf16"][56:156].float())
    # 4 reads (the header's length, the header, 2 tensors' rows): the kernel drops whole pages
    # only, so a page a range covers in part may stay, at most 2 a read; the ranges span 225 pages
    assert _resident_pages(path) <= 2 * 4
