"""Orbax checkpoints for the JAX path, in the torch path's run layout.

A checkpoint is `run_dir/checkpoint_step_NNNNNNN/` (tpuft_workload.checkpoint's names): Orbax
writes the sharded parameters and optimizer state under `state/` (every process writes its own
shards straight to the shared storage path, Orbax finalizes once all are written), rank 0 adds
`train_state.json` and, once every process has returned from the save, `COMMITTED`. Ray Train
registers the directory where it lies (`CheckpointUploadMode.NO_UPLOAD`), so restarts,
`--resume-from` and `find_latest_committed` treat it as they treat a torch checkpoint. A JAX
checkpoint is never loaded by the torch path nor the reverse: the run manifest's architecture
names the framework, and `checkpoint.check_architecture` refuses the other one.
"""
from __future__ import annotations

import hashlib
import os

from tpuft_workload.checkpoint import TRAIN_STATE

STATE_DIR = "state"
FRAMEWORK = "jax"
# Orbax reaches object stores through fsspec (etils.epath): these are not in the workload image.
FSSPEC_BACKENDS = {"gs": "gcsfs", "s3": "s3fs"}


def check_storage(uri: str) -> None:
    """Refuse, before Ray starts, a storage URI that Orbax cannot write from this image."""
    import importlib.util

    from tpuft_workload.checkpoint import StorageError

    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    module = FSSPEC_BACKENDS.get(scheme)
    if scheme and (module is None or importlib.util.find_spec(module) is None):
        raise StorageError(
            f"checkpoint storage path {uri}: training.framework jax writes Orbax checkpoints through fsspec, and "
            f"{module or 'no fsspec backend for ' + scheme + '://'} is not installed in this image; use a path on a "
            "mounted volume for spec.checkpoint.storagePath (a Filestore PVC, the GCS FUSE CSI driver) or add "
            f"{module or 'the backend'} to the workload image")


def architecture(cfg_class: str, params: dict) -> dict:
    """The manifest's architecture of a JAX run: the torch path's fields plus the framework."""
    shapes = sorted((n, list(p.shape)) for n, p in params.items())
    digest = hashlib.sha256(";".join(f"{n}:{s}" for n, s in shapes).encode()).hexdigest()[:16]
    return {"class": cfg_class, "framework": FRAMEWORK, "parameters": int(sum(p.size for p in params.values())),
            "shapes": digest}


def _path(directory: str) -> str:
    return directory if "://" in directory else os.path.abspath(directory)


def save(state, train_state: dict, directory: str, rank: int) -> None:
    """Collective: every process calls it with the same `directory` (on storage every host sees)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        # force: a step saved by an attempt that died before committing it is written again
        ckptr.save(_path(f"{directory}/{STATE_DIR}"), state, force=True)
        ckptr.wait_until_finished()
    if rank == 0:
        from tpuft_workload.checkpoint import write_json

        write_json(f"{directory}/{TRAIN_STATE}", train_state)


def load(abstract_state, directory: str):
    """Collective: (state restored onto `abstract_state`'s shardings, train_state dict)."""
    import orbax.checkpoint as ocp

    from tpuft_workload.checkpoint import read_json

    if "://" not in directory and not os.path.exists(os.path.join(directory, STATE_DIR)):
        raise FileNotFoundError(f"{directory} has no {STATE_DIR}/: not a checkpoint written by the JAX path "
                                "(a torch checkpoint cannot be resumed with training.framework jax)")
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(_path(f"{directory}/{STATE_DIR}"), abstract_state)
    return state, read_json(f"{directory}/{TRAIN_STATE}")


def abstract(state):
    """ShapeDtypeStructs with the live state's shardings: what Orbax restores onto."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
