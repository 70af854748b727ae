"""spec.training.method: lora: low-rank adapters (PEFT) beside the frozen base, both sharded by FSDP2.

The driver resolves and checks the adapters' settings on the meta model (no weight read) before
any worker starts: the target modules (spec.training.lora.targetModules, else the default for the
model's Hugging Face model_type, tpuft.api.constants.LORA_DEFAULT_TARGET_MODULES) must be linear layers
of the model, and the rank must fit each of them. A worker wraps the base with peft.get_peft_model
before tpuft_workload.model.shard, so FSDP2 shards the frozen base and the adapters alike and
AdamW holds state for the adapters only. Checkpoints hold the adapters and their optimizer state
(tpuft_workload.checkpoint, trainable_only); the export is a PEFT adapter folder (`export`).

Importable without torch or peft (tpuft_workload.loop's TrainConfig holds a LoraSettings): both are
imported where they are used.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass

from tpuft.api.constants import EXPORT_MERGED_DIR, LORA_DEFAULT_TARGET_MODULES, TrainingMethod
from tpuft_workload import checkpoint as ckptlib
from tpuft_workload.tiny import BUILTIN_MODEL

TARGETS_FIELD = "spec.training.lora.targetModules"
RANK_FIELD = "spec.training.lora.rank"
METHOD_FIELD = "spec.training.method"
LORA_FIELD = "spec.training.lora"
# Beside {run}/export (tpuft.api.constants.EXPORT_DIR, the adapter folder): the frozen base of a model
# built in code (builtin:tiny-llama has no folder to point adapter_config.json at), and the merged
# full weights (spec.export.merge).
BASE_DIR = "base"
MERGED_DIR = EXPORT_MERGED_DIR   # one source: the operator's vLLM RayService serves it
ADAPTER_CONFIG = "adapter_config.json"   # what marks a PEFT adapter folder (peft.utils.CONFIG_NAME)
PEFT_PREFIX = "base_model.model."        # PeftModelForCausalLM's path to the base model's modules


class LoraError(ValueError):
    """spec.training.lora cannot be used with spec.model; the message names the field."""


@dataclass(frozen=True)
class LoraSettings:
    """The adapters as the driver resolved them (target_modules never empty)."""
    rank: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]

    def manifest(self) -> dict:
        """The run manifest's spec.training.lora (tpuft-run.json): what a resume must match."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targetModules": list(self.target_modules)}

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM")


def training_manifest(settings: LoraSettings | None) -> dict:
    """The run manifest's "training" entry: which weights the checkpoints hold."""
    if settings is None:
        return {"method": TrainingMethod.FULL.value}
    return {"method": TrainingMethod.LORA.value, "lora": settings.manifest()}


# ---- the driver: resolve and check on the meta model ---------------------------------------------------

def linear_layers(model) -> dict[str, tuple[int, int]]:
    """Every nn.Linear of `model` (a meta model will do): its module path -> (in, out) features."""
    import torch

    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def matches(path: str, target: str) -> bool:
    """PEFT's rule for a target_modules list entry: the whole path or its last dotted parts."""
    return path == target or path.endswith("." + target)


def resolve(model, rank: int, alpha: int, dropout: float, targets: tuple[str, ...] = ()) -> LoraSettings:
    """The adapters for `model` (built on the meta device): `targets`, else its model_type's default.
    LoraError, naming the field, for a target that is not a linear layer, a model_type without a
    default and no targets, or a rank above a targeted layer's smaller dimension."""
    cls = type(model).__name__
    layers = linear_layers(model)
    names = ", ".join(sorted({p.rsplit(".", 1)[-1] for p in layers})) or "none"
    if not targets:
        model_type = getattr(model.config, "model_type", None)
        if model_type not in LORA_DEFAULT_TARGET_MODULES:
            raise LoraError(f"{TARGETS_FIELD}: model_type {model_type!r} of {cls} has no default target modules; "
                            f"list the linear layers to adapt (its linear layers: {names})")
        targets = LORA_DEFAULT_TARGET_MODULES[model_type]
    for target in targets:
        if not any(matches(p, target) for p in layers):
            raise LoraError(f"{TARGETS_FIELD}: {target!r} is not a linear layer of {cls} (its linear layers: {names})")
    targeted = {p: dims for p, dims in layers.items() if any(matches(p, t) for t in targets)}
    path, (n_in, n_out) = min(targeted.items(), key=lambda kv: min(kv[1]))
    if rank > min(n_in, n_out):
        raise LoraError(f"{RANK_FIELD}: {rank} is larger than the smallest dimension ({min(n_in, n_out)}) of "
                        f"{path} ({n_in} in, {n_out} out) in {cls}; give at most {min(n_in, n_out)} or target "
                        "other layers")
    return LoraSettings(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(targets))


def check_resume(resume_uri: str, manifest: dict, settings: LoraSettings | None) -> None:
    """ResumeError when the checkpoint holds other weights than this run trains: a LoRA checkpoint
    into a full run (or the other way round), or adapters of another rank or targets. A manifest
    older than LoRA recorded no method: full."""
    theirs = manifest.get("training") or training_manifest(None)
    ours = training_manifest(settings)
    if theirs["method"] != ours["method"]:
        raise ckptlib.ResumeError(
            f"{METHOD_FIELD}: {resume_uri} holds a {theirs['method']} fine-tuning checkpoint, this run is "
            f"{ours['method']}; set {METHOD_FIELD}: {theirs['method']} to continue it, or start without "
            f"{ckptlib.RESUME_FIELD}")
    if settings is None:
        return
    shape = ("rank", "targetModules")   # what decides the adapters' tensors (alpha and dropout do not)
    if any(theirs["lora"][k] != ours["lora"][k] for k in shape):
        raise ckptlib.ResumeError(
            f"{LORA_FIELD}: {resume_uri} holds adapters of rank {theirs['lora']['rank']} on "
            f"{','.join(theirs['lora']['targetModules'])}, this run's are rank {settings.rank} on "
            f"{','.join(settings.target_modules)}; give the same rank and targetModules to continue it")


# ---- the workers ---------------------------------------------------------------------------------------

def wrap(model, settings: LoraSettings):
    """The base frozen, adapters added (trainable): before tpuft_workload.model.shard."""
    from peft import get_peft_model

    return get_peft_model(model, settings.peft_config())


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameters; a DTensor (FSDP2) counts its full shape."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


# ---- the export -------------------------------------------------------------------------------------------

def export(model, tokenizer, settings: LoraSettings, model_ref: str, run_dir: str, rank: int,
           merge: bool = False, dtype=None) -> str | None:
    """Collective: the adapters (and, when rank 0 must write the base or the merged model, the frozen
    base) gathered to rank 0's CPU; rank 0 writes {run_dir}/export as a PEFT adapter folder whose
    base_model_name_or_path is `model_ref` (with the base's generation config, the chat template's
turn end among its stop ids), or {run_dir}/base for the built-in model (written here,
    once: its weights exist only in code), and with `merge` {run_dir}/export-merged, the merged
    full weights. Returns the adapter folder's URI on rank 0, None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=not (merge or model_ref == BUILTIN_MODEL)))
    if rank != 0:
        return None
    if dtype is not None:
        full = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in full.items()}
    return write_export(model.config, full, tokenizer, settings, model_ref, run_dir, merge,
                        getattr(model, "generation_config", None))


def write_export(config, full: dict, tokenizer, settings: LoraSettings, model_ref: str, run_dir: str,
                 merge: bool = False, generation=None) -> str:
    """export's writing, on the process that holds `full` (the PEFT model's state dict, torch
    tensors: the adapters, and the frozen base when the built-in model or `merge` needs it); the
    JAX path's export writes through it too (tpuft_workload.jax_lora.peft_state). `generation`:
    the base's generation config (None: the config's default)."""
    builtin = model_ref == BUILTIN_MODEL
    fresh = _rebuild(config, settings, full)
    # the base's (tpuft_workload.model.as_served) with the turn end among its stop ids: an adapter
    # folder carries its own, which the engine reads before the base's
    generation = ckptlib.serving_generation(generation or fresh.generation_config, tokenizer)
    base_ref = ckptlib.join(run_dir, BASE_DIR) if builtin else model_ref
    if builtin:
        ckptlib.save_hf(config, base_state(full), tokenizer, base_ref, generation=generation)
    dest = ckptlib.join(run_dir, ckptlib.EXPORT_DIR)
    fresh.peft_config["default"].base_model_name_or_path = base_ref
    with tempfile.TemporaryDirectory() as tmp:
        fresh.save_pretrained(tmp)   # adapter_config.json + adapter_model.safetensors only
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        ckptlib.upload_dir(tmp, dest)
    if merge:
        # merge_and_unload adds the adapters into the base layers' weights in place: copies of those
        # (a gathered tensor can be the training model's own storage, e.g. on one CPU worker)
        for name, p in fresh.named_parameters():
            if ".base_layer." in name:
                p.data = p.data.clone()
        merged = fresh.merge_and_unload()
        merged.generation_config = generation
        _save_folder(merged, tokenizer, ckptlib.join(run_dir, MERGED_DIR))
    return dest


def _rebuild(config, settings: LoraSettings, state: dict):
    """The PEFT model on the meta device with the gathered tensors assigned (no second copy of
    random weights); base weights not in `state` stay on meta (only the adapters are saved then)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        fresh = get_peft_model(AutoModelForCausalLM.from_config(config), settings.peft_config())
    _, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    lora_meta = [n for n, p in fresh.named_parameters() if "lora_" in n and p.is_meta]
    if lora_meta or unexpected:
        raise RuntimeError(f"export: adapters do not match {type(fresh.get_base_model()).__name__}: "
                           f"missing {lora_meta[:5]}, unexpected {list(unexpected)[:5]}")
    return fresh


def base_state(state: dict) -> dict:
    """The frozen base's tensors of a PEFT model's state dict, under the base model's own names."""
    return {k.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}


def _save_folder(model, tokenizer, dest_uri: str) -> None:
    """A from_pretrained() folder of `model` (a transformers model with real weights) and the tokenizer."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        ckptlib.upload_dir(tmp, dest_uri)


def is_adapter_folder(path: str) -> bool:
    from pathlib import Path

    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_of(path: str) -> str:
    """The base model an adapter folder names (adapter_config.json's base_model_name_or_path)."""
    from pathlib import Path

    return json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
