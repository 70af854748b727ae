"""What a model needs of a slice, by arithmetic: HBM per chip and memory per worker pod.

One table of the models whose shapes we know, by Hugging Face id (each one's published config.json;
the text model only: the workload drops a multimodal checkpoint's vision tower), and the bytes a
run keeps per parameter, as tpuft_workload trains. Read by bench/lora_fit.py (the fit table in
docs/lora.md) and by `tpuft validate` (its warning). Pure: no I/O.

Bytes per parameter (P the model's, A the adapters'), sharded over one slice's devices: FSDP2
shards inside a slice, and more slices are replicas (HSDP), so they do not lower any figure.
  HBM per chip (TPU):
    full  16: fp32 weights, fp32 gradients, AdamW's two fp32 moments (the bf16 copy of one layer,
          gathered for its forward and backward, is in the reserve);
    lora   2 per frozen base weight (bf16 on accelerators: model.shard) + 16 per adapter weight.
  A worker pod's memory (torch: one rank per device of its host; JAX: one process per host), each
  rank or process adding RANK_OVERHEAD_GIB on a TPU, CPU_WORKER_RUNTIME_GIB on cpu (the runtime,
  not the model), against what Ray's memory monitor lets the pod use (RAY_MEMORY_USAGE_THRESHOLD of
  its limit: past it Ray kills a worker):
    at load      each rank's shard of the weights as the sharded load fills it: 4 per full weight,
                 2 per frozen one, 4 per adapter (on a TPU the shard is read through host memory
                 into HBM, so this is an upper bound). JAX reads each of its host's devices' shards
                 of the files the same way (jax_model.open_hf_dir): the host's share too.
    in training  the overhead only: weights, gradients and AdamW's moments are in HBM.
                 On CPU the pod holds them, and a step's working memory (`StepMemory`) too.
    at export    rank 0's pod, where the whole model is gathered: full 4 (fp32) + 2 (its bf16
                 copy); lora merged 2 (the bf16 base) + 2 (the copies the adapters are merged
                 into); lora not merged: the adapters only.
  On CPU there is no HBM: the HBM figure (in fp32, 4 per frozen weight) is held by the pod while
  training, and nothing is converted to bf16 at export.
HBM_RESERVE of each chip is left to activations, the gathered layer and XLA's workspace (batch 4 x
512 tokens a device, the CRD's defaults; a long maxSeqLength needs more). Ray's object store in
/dev/shm (counted in the pod's memory) holds data blocks only: small next to a model, left out.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import math

from tpuft.api import catalog
from tpuft.api.constants import CPU_ACCELERATOR, LORA_DEFAULT_TARGET_MODULES
from tpuft.api.kuberay import RAY_MEMORY_USAGE_THRESHOLD

GB = 1e9          # HBM, as the catalog gives it
GIB = 2 ** 30     # pod memory, as Kubernetes quantities give it (200Gi)
HBM_RESERVE = 0.3
# Peak RSS of one CPU rank beyond its FSDP2 shard of weights, gradients and AdamW's moments, up to
# the first optimizer step (the worse of 2 ranks): 1.10 GiB with `.venv/bin/python bench/sharded_load.py
# --workers 2 --hidden 512 --layers 4 --paths sharded` (43.8M parameters, peak 1.42 GiB) and 1.12 at
# --hidden 1024 (109.6M, peak 1.94 GiB): about the same, so it is the runtime's (torch, transformers,
# gloo), not the model's. libtpu's own host memory on a TPU VM is not in it (UNVERIFIED on hardware).
RANK_OVERHEAD_GIB = 1.1
# A cpu worker pod (one rank) beyond its shard of the state and the step's terms (StepMemory), in
# Ray's used at the pod's peak: Ray's processes in the pod (`ray start`, the raylet, the dashboard and
# runtime-env agents, the log monitor: 300 MiB of RssAnon), the training worker's runtime (torch,
# Ray's core worker, the data iterator) and what the load leaves in its heap. Measured in pods, the
# held-out 1.1B LoRA run (2 workers of 4Gi, 4 x 128 tokens, activations recomputed;
# `.venv/bin/python bench/sharded_load_pods.py --memory 4Gi`, bench/results/sharded_load_pods.json):
# the worse worker pod's peak, 3789 MiB, less its state (2146) and the step's terms (982): 661 MiB.
CPU_WORKER_RUNTIME_GIB = 0.65

FULL, LORA = "full", "lora"
# A CPU step's working memory (StepMemory), in fp32 (4 bytes a value):
# Values a token keeps per decoder layer for the backward pass, as (x hidden, x intermediate, x the
# k/v projections' width): counted with torch's saved-tensor hooks (parameters left out) on Llama
# layers of 5 shapes (hidden 512 to 2048), within 0.2%; lora: tpuft_workload.lora's adapters, with
# dropout, on the 7 default projections (each dropout keeps its own copy of the input).
SAVED_PER_TOKEN = {FULL: (8, 4, 2), LORA: (16, 5, 2)}
# A decoder layer gathered: FSDP2's all-gather output and the unsharded parameters it is copied into.
GATHERED_LAYER_COPIES = 2
# fp32 logits over the vocabulary per token at the loss: the logits, cross-entropy's log-softmax
# kept for the backward pass and the logits' gradient.
LOGITS_COPIES = 3
TPU_BYTES = {"state": {FULL: 16, "frozen": 2, "adapter": 16}, "weights": {FULL: 4, "frozen": 2, "adapter": 4}}
CPU_BYTES = {"state": {FULL: 16, "frozen": 4, "adapter": 16}, "weights": {FULL: 4, "frozen": 4, "adapter": 4}}
# Bytes per parameter on rank 0's pod at export (the whole model gathered there), (TPU, CPU).
EXPORT_BYTES = {FULL: (6, 4), "merged": (4, 8), "adapter": (4, 4)}


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool   # input and output embeddings share one matrix

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer that LoRA may target."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.projections().values()) + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = ()) -> int:
        """Adapter parameters of rank `rank` on `targets` (a module path's last part counts; empty:
        the default projections, the same for Llama and Gemma)."""
        wanted = {t.rsplit(".", 1)[-1] for t in targets or LORA_DEFAULT_TARGET_MODULES["llama"]}
        return self.layers * sum(rank * (a + b) for name, (a, b) in self.projections().items() if name in wanted)


LLAMA_3_2_1B = ModelShape("Llama 3.2 1B", 128256, 2048, 8192, 16, 32, 8, 64, True)
LLAMA_3_2_3B = ModelShape("Llama 3.2 3B", 128256, 3072, 8192, 28, 24, 8, 128, True)
LLAMA_3_1_8B = ModelShape("Llama 3.1 8B", 128256, 4096, 14336, 32, 32, 8, 128, False)
LLAMA_3_1_70B = ModelShape("Llama 3.1 70B", 128256, 8192, 28672, 80, 64, 8, 128, False)
GEMMA_3_1B = ModelShape("Gemma 3 1B", 262144, 1152, 6912, 26, 4, 1, 256, True)
GEMMA_3_4B = ModelShape("Gemma 3 4B", 262208, 2560, 10240, 34, 8, 4, 256, True)
GEMMA_3_12B = ModelShape("Gemma 3 12B", 262208, 3840, 15360, 48, 16, 8, 256, True)
GEMMA_3_27B = ModelShape("Gemma 3 27B", 262208, 5376, 21504, 62, 32, 16, 128, True)
MODELS = (LLAMA_3_2_1B, LLAMA_3_2_3B, LLAMA_3_1_8B, LLAMA_3_1_70B, GEMMA_3_1B, GEMMA_3_4B, GEMMA_3_12B, GEMMA_3_27B)


def _ids(shape: ModelShape, *ids: str) -> dict[str, ModelShape]:
    return {i.lower(): shape for i in ids}


# spec.model values (Hugging Face ids, compared case-insensitively) whose shape is known.
BY_HF_ID: dict[str, ModelShape] = {
    **_ids(LLAMA_3_2_1B, "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    **_ids(LLAMA_3_2_3B, "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
    **_ids(LLAMA_3_1_8B, "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
           "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    **_ids(LLAMA_3_1_70B, "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
           "meta-llama/Meta-Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct",
           "meta-llama/Llama-3.3-70B-Instruct"),
    **_ids(GEMMA_3_1B, "google/gemma-3-1b-pt", "google/gemma-3-1b-it"),
    **_ids(GEMMA_3_4B, "google/gemma-3-4b-pt", "google/gemma-3-4b-it"),
    **_ids(GEMMA_3_12B, "google/gemma-3-12b-pt", "google/gemma-3-12b-it"),
    **_ids(GEMMA_3_27B, "google/gemma-3-27b-pt", "google/gemma-3-27b-it"),
}


def known(model_ref: str) -> ModelShape | None:
    """The shape of spec.model when it is a Hugging Face id in BY_HF_ID; None for anything else."""
    return BY_HF_ID.get(model_ref.strip().lower())


_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes memory quantity ("200Gi", "96G", "1e9" is not one) in bytes."""
    number = quantity.rstrip("mkMGTPEi")
    suffix = quantity[len(number):]
    if suffix not in _SUFFIX:
        raise ValueError(f"{quantity!r} is not a memory quantity")
    return float(number) * _SUFFIX[suffix]


@dataclass(frozen=True)
class Figure:
    """One need against what the slice has, e.g. HBM per chip, or a worker pod's memory at load."""
    name: str   # HBM, load, training, export
    what: str
    need: float
    have: float
    unit: str   # GB (HBM) or GiB (pod memory)

    @property
    def fits(self) -> bool:
        return self.need <= self.have


@dataclass(frozen=True)
class Run:
    """How the model is trained, as far as memory goes."""
    method: str = FULL
    rank: int = 16                       # LoRA's
    targets: tuple[str, ...] = ()        # LoRA's; empty: the default projections
    framework: str = "torch"
    merged: bool = False                 # LoRA: the merged weights exported too
    pod_memory: str | None = None        # the worker pod's memory (a quantity); None: the catalog's
    tokens: int = 0                      # a micro-batch's tokens per device (batch x sequence); 0: not counted
    activation_checkpointing: bool = False
    reserve: float = HBM_RESERVE
    rank_overhead_gib: float | None = None   # None: RANK_OVERHEAD_GIB on a TPU, CPU_WORKER_RUNTIME_GIB on cpu


@dataclass(frozen=True)
class StepMemory:
    """What one torch rank holds on CPU for a training step beyond its shard of the state and the
    runtime, in bytes, at the step's peak (the loss, with every layer's activations kept):
      output   the output layer gathered whole for the loss and its backward (beside this rank's
               shard, which stays: a gathered unit is a copy of its own; model.embedding_units
               makes it a unit of its own, so the input embedding is not gathered with it);
      layer    one decoder layer gathered (GATHERED_LAYER_COPIES);
      kept     every layer's activations (SAVED_PER_TOKEN per token), or with activation
               checkpointing each layer's input plus one layer's activations, recomputed;
      logits   LOGITS_COPIES of the fp32 logits."""
    output: float
    layer: float
    kept: float
    logits: float

    @property
    def total(self) -> float:
        return self.output + self.layer + self.kept + self.logits


def step_memory(model: ModelShape, run: Run) -> StepMemory:
    """A CPU rank's StepMemory for `run.tokens` tokens a micro-batch (whatever the ranks: gathered
    weights are whole, activations and logits are this rank's tokens')."""
    h, i = model.hidden, model.intermediate
    kv = model.kv_heads * model.head_dim
    per_hidden, per_intermediate, per_kv = SAVED_PER_TOKEN[run.method]
    layer_values = run.tokens * (per_hidden * h + per_intermediate * i + per_kv * kv)
    kept = (model.layers * run.tokens * h + layer_values if run.activation_checkpointing
            else model.layers * layer_values)
    layer_parameters = sum(a * b for a, b in model.projections().values()) + 2 * h
    return StepMemory(output=4 * model.vocab * h, layer=4 * GATHERED_LAYER_COPIES * layer_parameters,
                      kept=4 * kept, logits=4 * LOGITS_COPIES * run.tokens * model.vocab)


@dataclass(frozen=True)
class Fit:
    model: ModelShape
    shape: catalog.SliceShape
    run: Run
    hbm: Figure | None   # None on CPU: the pod holds it
    step: StepMemory | None   # None on a TPU: a step's working memory is in HBM
    load: Figure
    training: Figure
    export: Figure

    @property
    def figures(self) -> tuple[Figure, ...]:
        return tuple(f for f in (self.hbm, self.load, self.training, self.export) if f is not None)

    @property
    def fits(self) -> bool:
        return all(f.fits for f in self.figures)


def fit(model: ModelShape, shape: catalog.SliceShape, run: Run = Run()) -> Fit:
    """What `model` needs of one slice of `shape`, trained as `run` says, against HBM less the
    reserve and the worker pod's memory."""
    p = model.parameters()
    a = model.lora_parameters(run.rank, run.targets) if run.method == LORA else 0
    table = TPU_BYTES if shape.is_tpu else CPU_BYTES

    def total(kind: str) -> float:
        b = table[kind]
        return b[FULL] * p if run.method == FULL else b["frozen"] * p + b["adapter"] * a

    jax = run.framework == "jax"
    ranks = 1 if jax else shape.devices_per_host
    runtime = run.rank_overhead_gib
    if runtime is None:
        runtime = RANK_OVERHEAD_GIB if shape.is_tpu else CPU_WORKER_RUNTIME_GIB
    overhead = ranks * runtime * GIB
    pod = usable_gib(run.pod_memory or shape.worker_pod.memory)
    weights = total("weights") * shape.devices_per_host / shape.devices   # the host's share, either framework
    kept = 0 if shape.is_tpu else ranks * total("state") / shape.devices   # the pod holds the state on CPU
    step = None if shape.is_tpu else step_memory(model, run)
    export_kind = FULL if run.method == FULL else "merged" if run.merged else "adapter"
    exported = EXPORT_BYTES[export_kind][0 if shape.is_tpu else 1] * (a if export_kind == "adapter" else p)
    hbm = None
    if shape.is_tpu:
        budget = catalog.generation(shape.generation).hbm_gb * (1 - run.reserve)
        hbm = Figure("HBM", "HBM per chip", total("state") / shape.chips / GB, budget, "GB")
    working = ranks * step.total if step else 0
    return Fit(model, shape, run, hbm, step,
               load=Figure("load", "memory per worker pod at load", (weights + overhead) / GIB, pod, "GiB"),
               training=Figure("training", "memory per worker pod in training", (kept + working + overhead) / GIB,
                               pod, "GiB"),
               export=Figure("export", "memory in worker pod 0 at export", (exported + kept + overhead) / GIB, pod,
                             "GiB"))


def usable_gib(pod_memory: str) -> float:
    """What a pod of this memory limit may hold before Ray's memory monitor kills a worker, in GiB."""
    return quantity_bytes(pod_memory) * RAY_MEMORY_USAGE_THRESHOLD / GIB


def limit_for(need_gib: float) -> str:
    """The smallest whole-Gi memory limit under which `need_gib` is below Ray's memory monitor's threshold."""
    return f"{math.ceil(need_gib / RAY_MEMORY_USAGE_THRESHOLD)}Gi"


def shape_of(config: Mapping[str, Any], name: str = "the model") -> ModelShape | None:
    """A Hugging Face config.json's decoder shape (a multimodal one's text_config); None when it
    leaves out one of the sizes the table needs."""
    text = config.get("text_config") or config
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        return ModelShape(name, int(text["vocab_size"]), hidden, int(text["intermediate_size"]),
                          int(text["num_hidden_layers"]), heads, int(text.get("num_key_value_heads") or heads),
                          int(text.get("head_dim") or hidden // heads),
                          bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def recompute_needed(model: ModelShape, workers: int, pod_memory: str, run: Run) -> bool:
    """spec.training.activationCheckpointing left out on cpu: on when a worker's training step,
    every layer's activations kept, needs more than its pod's memory (the training figure)."""
    shape = catalog.resolve_slice(CPU_ACCELERATOR, str(workers))
    kept = fit(model, shape, replace(run, pod_memory=pod_memory, activation_checkpointing=False))
    return not kept.training.fits


def smallest_topology(f: Fit, name: str) -> str | None:
    """The smallest topology of the same generation, larger than f's, where figure `name` fits."""
    gen = catalog.generation(f.shape.generation)
    for topology in gen.topologies:
        shape = catalog.resolve_slice(gen.name, topology)
        if shape.chips > f.shape.chips:
            figure = next(x for x in fit(f.model, shape, f.run).figures if x.name == name)
            if figure.fits:
                return topology
    return None


def _advice(f: Fit, figure: Figure) -> str:
    memory = f"raise spec.resources.worker.limits.memory to at least {limit_for(figure.need)}"
    if figure.name == "export":
        gathered = "the merged model" if f.run.method == LORA else "the whole model"
        advice = f"{memory} ({gathered} is gathered there to be exported)"
        if f.run.method == LORA:
            advice += (", or export the adapters only: no spec.export.merge, and spec.serve.engine transformers "
                       "(vllm serves the merged weights)")
        return advice
    if figure.name == "training" and f.step is not None:
        return _step_advice(f, memory)
    bigger = smallest_topology(f, figure.name) if f.shape.is_tpu else None
    larger = f"a topology of at least {bigger}" if bigger else "a larger topology"
    if figure.name == "HBM":
        return f"use method lora or {larger}" if f.run.method == FULL else f"use {larger}"
    return f"{memory} or use {larger} (more hosts, each holding a smaller share)"


def _step_advice(f: Fit, memory: str) -> str:
    """A CPU step that does not fit: activation checkpointing first where it is off (it keeps one
    layer's activations instead of every layer's), with what the pod then needs."""
    step = f.step
    assert step is not None
    held = (f"of which the step's working memory {step.total / GIB:.3g} GiB: activations {step.kept / GIB:.3g}, "
            f"logits {step.logits / GIB:.3g}, gathered weights {(step.output + step.layer) / GIB:.3g}")
    ways = [memory]
    if not f.run.activation_checkpointing:
        recomputed = fit(f.model, f.shape, replace(f.run, activation_checkpointing=True)).training
        ways.insert(0, f"set spec.training.activationCheckpointing: true (then about {recomputed.need:.3g} GiB)")
    ways.append("a smaller spec.training.batchSizePerDevice or maxSeqLength")
    return f"{held}; {', '.join(ways[:-1])} or {ways[-1]}"


def warnings(model_ref: str, f: Fit) -> list[str]:
    """One line per figure of `f` that does not fit, naming it, what it needs and what to change."""
    lines = []
    for figure in f.figures:
        if figure.fits:
            continue
        if figure.name == "HBM":
            hbm = catalog.generation(f.shape.generation).hbm_gb
            have = f"the {figure.have:.3g} GB a chip holds beside activations ({figure.have / hbm:.0%} of its {hbm:g} GB)"
        else:
            limit = quantity_bytes(f.run.pod_memory or f.shape.worker_pod.memory) / GIB
            have = (f"the {figure.have:.3g} GiB a pod of {limit:.3g} GiB may use ({RAY_MEMORY_USAGE_THRESHOLD:.0%}: "
                    "past it Ray's memory monitor kills a worker)")
        lines.append(f"warning: spec.model {model_ref} ({f.model.parameters() / 1e9:.1f}B parameters) needs about "
                     f"{figure.need:.3g} {figure.unit} of {figure.what} with method {f.run.method} on "
                     f"{f.shape.generation} {f.shape.topology}, more than {have}: {_advice(f, figure)}")
    return lines
