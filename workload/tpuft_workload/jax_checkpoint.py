"""Orbax checkpoints for the JAX path, in the torch path's run layout.

A checkpoint is `run_dir/checkpoint_step_NNNNNNN/` (tpuft_workload.checkpoint's names): Orbax
writes the sharded parameters and optimizer state under `state/`, rank 0 adds `train_state.json`
and, once every process has returned from the save, `COMMITTED`. On a path every host sees (a
local or mounted volume) every process writes its own shards straight there and Orbax finalizes
once all are written. On object storage (gs://) Orbax writes to a staging folder on the host
(STAGING_ROOT) and rank 0 uploads it through tpuft_workload.storage (the one gs:// client), so the
processes of the run must share one host (a single-host slice; several hosts need a mounted
volume: `check_hosts` refuses them before the first step); a resume downloads `state/` first. Ray Train registers the directory
where it lies (`CheckpointUploadMode.NO_UPLOAD`), so restarts, `--resume-from` and
`find_latest_committed` treat it as they treat a torch checkpoint. A JAX checkpoint is never
loaded by the torch path nor the reverse: the run manifest's architecture names the framework,
and `checkpoint.check_architecture` refuses the other one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from tpuft_workload import storage
from tpuft_workload.checkpoint import TRAIN_STATE, StorageError, download_dir, read_json, upload_dir, write_json

STATE_DIR = "state"
FRAMEWORK = "jax"
STAGING_ROOT = Path(os.environ.get("TPUFT_ORBAX_STAGING", "/tmp/tpuft-orbax-staging"))
SUPPORTED_SCHEMES = ("gs",)


def check_storage(uri: str) -> None:
    """Refuse, before Ray starts, a storage URI the JAX path cannot write (only gs:// is staged)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme and scheme not in SUPPORTED_SCHEMES:
        raise StorageError(
            f"checkpoint storage path {uri}: training.framework jax writes Orbax checkpoints to a local or "
            f"mounted path or to gs://, not {scheme}://; use gs:// or a path on a mounted volume for "
            "spec.checkpoint.storagePath")


def check_hosts(directory: str, hosts: list[str]) -> None:
    """Refuse, before the first step, a gs:// run whose JAX processes span several hosts: its
    checkpoints are staged on one host (`save`), so the first one would fail after the steps before
    it were spent. `hosts`: each process's host name, in process order."""
    if not storage.is_remote(directory) or len(set(hosts)) < 2:
        return
    raise StorageError(
        f"checkpoint storage path {directory}: training.framework jax stages gs:// checkpoints on one host, "
        f"and this run's {len(hosts)} JAX processes are on {len(set(hosts))} hosts; set "
        "spec.checkpoint.storagePath to a volume every host mounts (the GCS FUSE CSI driver, a Filestore PVC), "
        "or train with framework torch, which writes gs:// from every host")


def architecture(cfg_class: str, params: dict) -> dict:
    """The manifest's architecture of a JAX run: the torch path's fields plus the framework."""
    shapes = sorted((n, list(p.shape)) for n, p in params.items())
    digest = hashlib.sha256(";".join(f"{n}:{s}" for n, s in shapes).encode()).hexdigest()[:16]
    return {"class": cfg_class, "framework": FRAMEWORK, "parameters": int(sum(p.size for p in params.values())),
            "shapes": digest}


def _staging(directory: str) -> Path:
    """The host's staging folder for the checkpoint `directory`: one name for every process on the host."""
    return STAGING_ROOT / hashlib.sha256(directory.encode()).hexdigest()[:16]


def save(state, train_state: dict, directory: str, rank: int) -> None:
    """Collective: every process calls it with the same `directory`."""
    import orbax.checkpoint as ocp

    remote = storage.is_remote(directory)
    local = _staging(directory) if remote else Path(os.path.abspath(directory))
    if remote and rank == 0 and STAGING_ROOT.is_dir():   # earlier checkpoints' folders: all uploaded by now
        for old in STAGING_ROOT.iterdir():
            if old != local:
                shutil.rmtree(old, ignore_errors=True)
    with ocp.StandardCheckpointer() as ckptr:
        # force: a step saved by an attempt that died before committing it is written again
        ckptr.save(local / STATE_DIR, state, force=True)
        ckptr.wait_until_finished()
    if remote:
        if not (local / STATE_DIR).is_dir():
            raise StorageError(
                f"checkpoint {directory}: Orbax finalized the checkpoint on another host, and the JAX path "
                "stages gs:// checkpoints on one host; with several hosts, use a mounted volume every host "
                "sees for spec.checkpoint.storagePath (the GCS FUSE CSI driver, a Filestore PVC)")
        if rank == 0:
            upload_dir(str(local / STATE_DIR), f"{directory}/{STATE_DIR}")
    if rank == 0:
        write_json(f"{directory}/{TRAIN_STATE}", train_state)


def load(abstract_state, directory: str):
    """Collective: (state restored onto `abstract_state`'s shardings, train_state dict)."""
    import orbax.checkpoint as ocp

    if not storage.is_remote(directory):
        if not os.path.exists(os.path.join(directory, STATE_DIR)):
            raise FileNotFoundError(f"{directory} has no {STATE_DIR}/: not a checkpoint written by the JAX path "
                                    "(a torch checkpoint cannot be resumed with training.framework jax)")
        with ocp.StandardCheckpointer() as ckptr:
            state = ckptr.restore(os.path.abspath(os.path.join(directory, STATE_DIR)), abstract_state)
        return state, read_json(f"{directory}/{TRAIN_STATE}")
    STAGING_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="restore-", dir=STAGING_ROOT) as tmp:
        try:
            download_dir(f"{directory}/{STATE_DIR}", tmp)
        except storage.NotFound:
            raise FileNotFoundError(f"{directory} has no {STATE_DIR}/: not a checkpoint written by the JAX path "
                                    "(a torch checkpoint cannot be resumed with training.framework jax)") from None
        with ocp.StandardCheckpointer() as ckptr:
            state = ckptr.restore(tmp, abstract_state)
    return state, read_json(f"{directory}/{TRAIN_STATE}")


def abstract(state):
    """ShapeDtypeStructs with the live state's shardings: what Orbax restores onto."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
