"""Sharded checkpoints (torch.distributed.checkpoint) and the final Hugging Face export.

A checkpoint is one directory per save: every rank writes its own DCP shard files
(`__<rank>_0.distcp`), rank 0 adds `.metadata` and `train_state.json` (step, epoch and the
metrics last reported, so a run resumed with nothing left to do still reports them). Each
rank hands its local directory to `ray.train.report(checkpoint=...)`; Ray Train merges them
into one directory under storage_path/run_name, so no shared filesystem is needed between
hosts. Rank 0 also writes `tpuft-run.json` into the run directory: what wrote it and for
which model architecture, checked before `spec.checkpoint.resumeFrom` is loaded.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from tpuft.api.constants import EXPORT_DIR  # noqa: F401  (one source: the operator's RayService serves it)
from tpuft_workload import storage

TRAIN_STATE = "train_state.json"

log = logging.getLogger(__name__)


def _options(trainable_only: bool):
    """LoRA (trainable_only): the frozen base is left out, saved and loaded alike: it is the model
    source's and never changes, so a checkpoint holds the adapters and their optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def _state(model, optimizer, trainable_only: bool = False):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    return {"model": msd, "optim": osd}


def save(model, optimizer, train_state: dict, directory: str, rank: int, trainable_only: bool = False) -> None:
    """Collective: every rank must call it with its own (local) directory."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer, trainable_only), checkpoint_id=directory)
    if rank == 0:
        with open(os.path.join(directory, TRAIN_STATE), "w") as f:
            json.dump(train_state, f)


def load(model, optimizer, directory: str, trainable_only: bool = False) -> dict:
    """Collective: restore model + optimizer shards in place; returns train_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.join(directory, TRAIN_STATE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} has no {TRAIN_STATE}: not a checkpoint written by tpuft_workload")
    state = _state(model, optimizer, trainable_only)
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(trainable_only))
    with open(path) as f:
        return json.load(f)


# ---- storage (local path or any pyarrow filesystem URI such as gs://) ----------------------

def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def _fs(uri: str, retry_limit_s: float = storage.RETRY_LIMIT_S):
    return storage.filesystem(uri, retry_limit_s)


def ray_checkpoint(uri: str):
    """A ray.train.Checkpoint of the directory `uri` on the workload's filesystem: Ray wants the path
    without its scheme beside the filesystem (a gs:// URI as the path is refused by pyarrow's GCS one)."""
    from ray.train import Checkpoint

    fs, path = _fs(uri)
    return Checkpoint(path, filesystem=fs)


class StorageError(RuntimeError):
    """The checkpoint storage path cannot be written: found before any worker starts."""


def check_writable(uri: str) -> None:
    """Create `uri` and write, read back and delete a probe file, so a wrong, read-only or full
    storage path, a missing bucket or missing credentials fail in seconds (the probe's retries are
    bounded: storage.PROBE_RETRY_LIMIT_S) with its name, the pod's identity and what to grant."""
    fs, path = _fs(uri, storage.PROBE_RETRY_LIMIT_S)
    probe = f"{path.rstrip('/')}/.tpuft-write-probe"
    try:
        storage.make_dirs(fs, path)
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowException, PermissionError...
        # an object write that is "not found" has no bucket to go to
        raise StorageError(f"checkpoint storage path {uri} is not writable: "
                           f"{storage.failure(uri, 'writing a probe file under', e, not_found='bucket not found')}; "
                           "fix spec.checkpoint.storagePath or the workload's access to it") from None


def write_json(uri: str, obj) -> None:
    fs, path = _fs(uri)
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(obj, sort_keys=True).encode())


def write_bytes(uri: str, data: bytes, retry_limit_s: float = storage.RETRY_LIMIT_S) -> None:
    """`data` as the file `uri`, its folder created first."""
    fs, path = _fs(uri, retry_limit_s)
    storage.make_dirs(fs, path.rpartition("/")[0])
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(uri: str, retry_limit_s: float = storage.RETRY_LIMIT_S) -> bytes:
    """The file `uri`; storage.NotFound (naming it) when there is none."""
    fs, path = _fs(uri, retry_limit_s)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        raise storage.NotFound(f"{uri} not found") from None


def read_json(uri: str):
    return json.loads(read_bytes(uri).decode())


def upload_dir(local_dir: str, uri: str) -> None:
    """Every file under `local_dir` to the same relative path under `uri`."""
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    if not storage.is_remote(uri):
        fs.create_dir(path, recursive=True)
        pafs.copy_files(local_dir, path, destination_filesystem=fs)
        return
    storage.upload_files(fs, local_dir, path)


def download_dir(uri: str, local_dir: str) -> None:
    """Every file under `uri` into `local_dir`; storage.NotFound (naming it) when `uri` does not exist."""
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    if fs.get_file_info(path.rstrip("/")).type == pafs.FileType.NotFound:
        raise storage.NotFound(f"{uri} not found")
    Path(local_dir).mkdir(parents=True, exist_ok=True)
    if storage.is_remote(uri):
        storage.download_files(fs, path, local_dir)
    else:
        pafs.copy_files(path, local_dir, source_filesystem=fs)


def export_hf(model, tokenizer, dest_uri: str, rank: int, dtype=None) -> str | None:
    """Collective: gather the full weights to rank 0's CPU and save a from_pretrained() folder
    (`save_hf`). Returns dest_uri on rank 0, None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    save_hf(model.config, full, tokenizer, dest_uri, dtype, generation=getattr(model, "generation_config", None))
    return dest_uri


def serving_generation(generation, tokenizer):
    """The base model's generation config (its stop ids, its recommended sampling), with the chat
    template's turn end among the stop ids: the model was trained to end an answer with it, and both
    serving engines stop at the generation config's eos_token_id."""
    import copy

    from tpuft_workload import render

    generation = copy.deepcopy(generation)
    eos = generation.eos_token_id
    stops = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    try:
        ends = render.turn_end_ids(tokenizer)
    except Exception as e:  # noqa: BLE001 - a template that refuses the probe turn (its own error) adds none
        log.warning("export: no turn end found in the chat template (%s); stop ids stay %s", e, stops)
        ends = []
    for token in ends or ([tokenizer.eos_token_id] if not stops and tokenizer.eos_token_id is not None else []):
        if token not in stops:
            stops.append(token)
    generation.eos_token_id = stops[0] if len(stops) == 1 else stops
    return generation


def save_hf(config, state: dict, tokenizer, dest_uri: str, dtype=None, generation=None) -> None:
    """`state` (full tensors on the CPU) as a from_pretrained() folder at dest_uri: the architecture
    rebuilt on the meta device (no second copy of random weights), the tensors assigned, then
    safetensors + config + generation config (`generation`, the base's: `serving_generation`) +
    tokenizer (its chat template the one trained with) written."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    fresh.tie_weights()
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(f"export: weights do not match {type(fresh).__name__}: "
                           f"missing {still_meta[:5]}, unexpected {list(unexpected)[:5]}")
    fresh.generation_config = serving_generation(generation or fresh.generation_config, tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        upload_dir(tmp, dest_uri)


# ---- commit markers and fallback discovery -------------------------------------------------
# Ray Train registers a reported checkpoint only when its controller next polls the workers;
# a worker that dies in between leaves a complete checkpoint on storage that
# ray.train.get_checkpoint() does not know about. After every rank's upload returned, rank 0
# writes COMMITTED into it; on restart we fall back to the newest committed checkpoint.
COMMITTED = "COMMITTED"


def mark_committed(checkpoint_uri: str) -> None:
    fs, path = _fs(checkpoint_uri)
    with fs.open_output_stream(f"{path}/{COMMITTED}") as f:
        f.write(b"ok\n")


def find_latest_committed(run_uri: str, prefix: str = "checkpoint_step_") -> str | None:
    """Newest checkpoint directory under run_uri with a COMMITTED marker (by step in its name).
    One recursive listing: on object storage a folder is only a name prefix, which pyarrow's
    non-recursive listing of GCS does not return."""
    import pyarrow.fs as pafs

    fs, path = _fs(run_uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=True))
    except (FileNotFoundError, OSError):
        return None
    base = path.rstrip("/") + "/"
    committed = {rel.split("/")[0] for rel in (i.path[len(base):] for i in infos if i.path.startswith(base))
                 if rel.startswith(prefix) and rel.count("/") == 1 and rel.endswith("/" + COMMITTED)}
    return join(run_uri, max(committed)) if committed else None


# ---- the run manifest and spec.checkpoint.resumeFrom ---------------------------------------
RUN_MANIFEST = "tpuft-run.json"
RUN_FORMAT = "tpuft-run/v1"
RESUME_FIELD = "spec.checkpoint.resumeFrom"


class ResumeError(RuntimeError):
    """spec.checkpoint.resumeFrom cannot be used; the message names the field and the path."""


def _is_file(fs, path: str) -> bool:
    import pyarrow.fs as pafs

    return fs.get_file_info(path).type == pafs.FileType.File


def architecture(model) -> dict:
    """What a checkpoint's shards must match: the class, parameter count and a digest of every
    parameter's name and full shape (taken before sharding)."""
    import hashlib

    shapes = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    digest = hashlib.sha256(";".join(f"{n}:{list(s)}" for n, s in shapes).encode()).hexdigest()[:16]
    return {"class": type(model).__name__, "parameters": int(sum(p.numel() for p in model.parameters())),
            "shapes": digest}


def write_run_manifest(run_uri: str, manifest: dict) -> None:
    """Rank 0, once per run directory: the first attempt's manifest stays."""
    fs, path = _fs(run_uri)
    storage.make_dirs(fs, path)
    if not _is_file(fs, f"{path}/{RUN_MANIFEST}"):
        write_json(join(run_uri, RUN_MANIFEST), {"format": RUN_FORMAT, **manifest})


def resolve_resume(uri: str) -> tuple[str, dict]:
    """(committed checkpoint directory, its run's manifest) for spec.checkpoint.resumeFrom: `uri`
    itself when it is a checkpoint_step_* directory, else the newest committed one of the run
    directory it names. Raises ResumeError unless it exists and tpuft_workload wrote it."""
    import pyarrow.fs as pafs

    fs, path = _fs(uri)
    path = path.rstrip("/")
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.NotFound:
        raise ResumeError(f"{RESUME_FIELD}: {uri} does not exist")
    if kind != pafs.FileType.Directory:
        raise ResumeError(f"{RESUME_FIELD}: {uri} is a file; give a checkpoint_step_* directory or a run directory")
    if _is_file(fs, f"{path}/{RUN_MANIFEST}"):  # a run directory
        run_uri, ckpt = uri.rstrip("/"), find_latest_committed(uri.rstrip("/"))
        if ckpt is None:
            raise ResumeError(f"{RESUME_FIELD}: run directory {uri} holds no committed checkpoint "
                              f"(checkpoint_step_* with {COMMITTED})")
    else:
        run_uri, ckpt = uri.rstrip("/").rpartition("/")[0], uri.rstrip("/")
        run_path = path.rpartition("/")[0]
        missing = [f for f, p in ((RUN_MANIFEST, run_path), (TRAIN_STATE, path)) if not _is_file(fs, f"{p}/{f}")]
        if missing:
            raise ResumeError(f"{RESUME_FIELD}: {uri} was not written by a TPUFinetune (no {' and no '.join(missing)} "
                              "where tpuft_workload writes them); give a checkpoint_step_* directory or a run "
                              "directory under an earlier TPUFinetune's spec.checkpoint.storagePath")
        if not _is_file(fs, f"{path}/{COMMITTED}"):
            raise ResumeError(f"{RESUME_FIELD}: checkpoint {uri} is incomplete (no {COMMITTED} marker: "
                              "its save never finished); pick an earlier one or the run directory")
    try:
        manifest = read_json(join(run_uri, RUN_MANIFEST))
    except (OSError, ValueError) as e:
        raise ResumeError(f"{RESUME_FIELD}: {join(run_uri, RUN_MANIFEST)} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT:
        raise ResumeError(f"{RESUME_FIELD}: {uri} was not written by a TPUFinetune ({join(run_uri, RUN_MANIFEST)} "
                          f"is not a {RUN_FORMAT} manifest)")
    return ckpt, manifest


def check_architecture(resume_uri: str, manifest: dict, arch: dict, model_ref: str) -> None:
    """Raises ResumeError when the checkpoint was written for another architecture than spec.model's."""
    theirs = manifest.get("architecture") or {}
    if theirs != arch:
        raise ResumeError(
            f"{RESUME_FIELD}: {resume_uri} was written for a different model architecture: "
            f"{theirs.get('class')} with {theirs.get('parameters')} parameters (model {manifest.get('model')}, "
            f"shapes {theirs.get('shapes')}), while spec.model {model_ref} is {arch['class']} with "
            f"{arch['parameters']} parameters (shapes {arch['shapes']}); its weights and optimizer state cannot "
            "be loaded")

