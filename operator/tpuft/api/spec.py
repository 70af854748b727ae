"""Parse a TPUFinetune object once, at the edge, into frozen dataclasses.

Everything after this module (builders, phases, handlers) works on these types. Each field is
declared once, on its dataclass (tpuft.api.fields.declare): the CRD's schema (tpuft.api.crd), the defaults
(`DEFAULTS`), the single-field checks below (worded as the API server words them), the workload's
document and its CLI flags all come from that declaration. So a manifest rendered offline with
`tpuft render` and one defaulted by the API server give the same children. Every problem is
collected with its field path; `SpecError` carries them all.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from tpuft.api import catalog, fields, splits
from tpuft.api.constants import API_VERSION, CPU_ACCELERATOR, DATASET_COLUMN_KEYS, KIND, LORA_DEFAULT_TARGET_MODULES, RAY_VERSION_PIN, RESERVED_ANNOTATIONS, RESERVED_ENV, RESERVED_LABELS, SERVE_API_KEY_ENV, SERVE_API_KEY_SECRET_KEY, DatasetFormat, DatasetType, ImagePullPolicy, Overlong, Reserved, LearningRateSchedule, Provisioning, PublishWhen, ServeEngine, TrainingFramework, TrainingMethod
from tpuft.api.gke import GKE_MAX_RUN_DURATION_SECONDS, TPU_RESOURCE
from tpuft.api.fields import declare

# Children are named "{name}-{suffix}" (longest suffix "-workload", plus "-train-r99" for
# retries and resubmissions, "-verify-r3"); KubeRay derives pod and service names from those and
# labels them with the cluster name, so 40 keeps every derived name inside the 63-character label limit.
MAX_NAME_LENGTH = 40
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CHECKPOINT_VOLUME_SOURCES = ("persistentVolumeClaim", "csi", "nfs", "hostPath")
# gs:// or a mounted path only: TPUs run on Google Cloud, and no other object store was ever run end
# to end here (docs/checkpoints.md).
STORAGE_PATH = re.compile(r"^(gs://[a-z0-9][-a-z0-9_.]{1,221}[a-z0-9](/.*)?|/[^\s]*)$")
# A gs:// URI with a query or a fragment: pyarrow reads a query as client options (endpoint_override,
# scheme), and a run's directory appended to such a URI lands inside the query, so two runs share
# one prefix. Refused in every field that takes a gs:// URI (URI_FIELD).
GS_URI_EXTRAS = re.compile(r"^gs://[^?#]*[?#]")
MAX_QUANTITY_LENGTH = 32
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P|E|Ei)?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# What Kubernetes requires of the values that reach children and pods (labels, node selectors,
# secret references): checked here and in the CRD, so an accepted TPUFinetune never yields a child
# or pod the API server rejects. The patterns are RE2-compatible (the CRD uses them as is).
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                            r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
MAX_LABEL_LENGTH = 63             # a label value, a qualified name's name part, a DNS label
MAX_DNS_SUBDOMAIN_LENGTH = 253    # object names, a qualified name's prefix
MAX_PATH_LENGTH = 1024            # storagePath, resumeFrom
MAX_QUALIFIED_NAME_LENGTH = MAX_DNS_SUBDOMAIN_LENGTH + 1 + MAX_LABEL_LENGTH   # prefix "/" name
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
COLUMN_NAME = re.compile(r"^[A-Za-z0-9_][-._A-Za-z0-9]{0,127}$")   # spec.dataset.columns' values (reach an entrypoint)
COLUMN_NAME_WORDS = "at most 128 of [-._A-Za-z0-9], not starting with - or ."
MAX_MAP_ENTRIES = 64
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")
# Characters that only ever appear in an attempt to smuggle shell into an entrypoint: refused in
# the values that reach one (images, model, dataset); SHELL_SAFE is the CRD's pattern for them.
_SHELL_CHARS = r"\s;&|`$<>\\'\""
UNSAFE = re.compile(f"[{_SHELL_CHARS}]")
SHELL_SAFE = re.compile(f"^[^{_SHELL_CHARS}]+$")
SHELL_SAFE_MATCHES = (SHELL_SAFE.pattern, "must not contain spaces or shell characters")
MAX_STRING_LENGTH = 512        # image, model, dataset name: the CRD's maxLength and the parser's
MAX_SPLIT_LENGTH = 128

RANK_LIMITS = (1, 1024)
LORA_RANKS = tuple(1 << i for i in range(RANK_LIMITS[1].bit_length()) if RANK_LIMITS[0] <= 1 << i <= RANK_LIMITS[1])
LORA_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LORA_MAX_TARGET_MODULES = 32
LEARNING_RATE_MAX = 1.0
# spec.training.learningRate when left out: LoRA's few parameters take steps ten times larger.
LEARNING_RATE_BY_METHOD = {TrainingMethod.FULL.value: 2.0e-5, TrainingMethod.LORA.value: 2.0e-4}
# Context lengths of the models the workload builds itself (tpuft_workload.tiny, tiny_chat), so
# spec.serve.maxModelLength is checked offline too; a test ties them to the workload's configs.
BUILTIN_MODEL_MAX_POSITIONS = {"builtin:tiny-llama": 4096, "builtin:tiny-chat": 4096}
RAY_MINOR = ".".join(RAY_VERSION_PIN.split(".")[:2])   # "2.60": the image needs this Ray line


def either(words: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c": a closed set in messages and the CRD's descriptions."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def _values(kind: type[enum.Enum]) -> tuple[str, ...]:
    return tuple(str(member.value) for member in kind)


def _shell_safe(max_length: int = MAX_STRING_LENGTH) -> dict[str, Any]:
    """A string that reaches an entrypoint: no spaces or shell characters (UNSAFE)."""
    return {"max_length": max_length, "matches": SHELL_SAFE_MATCHES}


def _columns_schema() -> dict:
    return {"type": "object", "additionalProperties": {"type": "string", "pattern": COLUMN_NAME.pattern},
            "maxProperties": len(DATASET_COLUMN_KEYS),
            "x-kubernetes-validations": [{"rule": "self.all(k, k in " + json.dumps(list(DATASET_COLUMN_KEYS)) + ")",
                                          "message": f"keys must be among {', '.join(DATASET_COLUMN_KEYS)}"}]}


def _target_modules_schema() -> dict:
    return {"type": "array", "minItems": 1, "maxItems": LORA_MAX_TARGET_MODULES, "x-kubernetes-list-type": "set",
            "items": {"type": "string", "pattern": LORA_MODULE.pattern, "maxLength": 128}}


def _checkpoint_volume_schema() -> dict:
    return {"type": "object", "minProperties": 1, "maxProperties": 1,
            "properties": {src: {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                 "description": f"A Kubernetes {src} volume source (core/v1 Volume)."}
                           for src in CHECKPOINT_VOLUME_SOURCES}}


def qualified_keys_rule() -> dict[str, str]:
    """CEL rule: every map key is a Kubernetes qualified name (label, annotation or resource name)."""
    return {"rule": f"self.all(k, k.size() <= {MAX_QUALIFIED_NAME_LENGTH} && k.matches(r'{QUALIFIED_NAME.pattern}') "
                    f"&& (!k.contains('/') || k.indexOf('/') <= {MAX_DNS_SUBDOMAIN_LENGTH}))",
            "message": "keys must be Kubernetes qualified names: an optional DNS subdomain prefix and '/', then at "
                       f"most {MAX_LABEL_LENGTH} of [-A-Za-z0-9_.], starting and ending alphanumeric"}


def reserved_keys_rule(reserved: Reserved) -> dict[str, str]:
    """CEL rule: no key the operator, KubeRay or the TPU webhook sets or relies on (the parser refuses
    the same ones, naming each)."""
    keys = [k for k, _ in reserved.keys]
    prefixes = [p for p, _ in reserved.prefixes]
    rule = " && ".join([f"!(k in [{', '.join(repr(k) for k in keys)}])", *(f"!k.startsWith({p!r})" for p in prefixes)])
    return {"rule": f"self.all(k, {rule})",
            "message": f"keys under {', '.join(p + '*' for p in prefixes)} and {', '.join(keys)} are reserved: the "
                       "operator, KubeRay or the TPU webhook set or rely on them; remove them"}


def string_map_schema(label_values: bool = False, reserved: Reserved | None = None) -> dict:
    """A map that ends up as labels/annotations/node selector of children and pods: keys are qualified
    names (and none of `reserved`); with label_values, values are label values."""
    values: dict = {"type": "string"}
    if label_values:
        values.update(maxLength=MAX_LABEL_LENGTH, pattern=LABEL_VALUE.pattern)
    rules = [qualified_keys_rule()] + ([reserved_keys_rule(reserved)] if reserved is not None else [])
    return {"type": "object", "additionalProperties": values, "maxProperties": MAX_MAP_ENTRIES,
            "x-kubernetes-validations": rules}


def _quantities_schema() -> dict:
    """requests or limits: a Kubernetes quantity per resource name; google.com/tpu is the topology's."""
    no_tpu = [{"rule": f"!('{TPU_RESOURCE}' in self)",
               "message": f"{TPU_RESOURCE} is derived from spec.topology and cannot be overridden"}]
    # int-or-string cannot carry a CEL rule within the cost budget; pattern/minimum check the
    # string and the integer form (the parser applies the same QUANTITY pattern).
    quantity = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
                "pattern": QUANTITY.pattern, "maxLength": MAX_QUANTITY_LENGTH, "minimum": 0}
    return {"type": "object", "additionalProperties": quantity, "maxProperties": MAX_MAP_ENTRIES,
            "x-kubernetes-validations": [*no_tpu, qualified_keys_rule()]}


def spellings(gen: catalog.Generation) -> list[str]:
    """Every name a generation goes by (ours, Ray's, GKE's, aliases): each resolves to it."""
    s = {gen.name, gen.ray_accelerator_type, gen.ray_version, gen.gke_accelerator, *gen.aliases}
    return sorted(s | {x.upper() for x in s if x.lower().startswith("tpu-v")})


def accelerator_enum() -> list[str]:
    """Every spelling of a TPU generation the catalog resolves, and cpu: spec.accelerator's enum."""
    out = {CPU_ACCELERATOR}
    for g in catalog.GENERATIONS:
        out.update(spellings(g))
    return sorted(out)


# The generation the descriptions take their examples from (its Ray and GKE spellings, a shape).
EXAMPLE_GENERATION = catalog.generation("v6e")


# spec.serviceAccountName and spec.serviceAccountAnnotations: the CRD's CEL on spec and the parser's message.
SERVICE_ACCOUNT_RULE = {
    "rule": "!(has(self.serviceAccountName) && has(self.serviceAccountAnnotations))",
    "message": "serviceAccountAnnotations annotate the ServiceAccount the operator creates; with serviceAccountName "
               "the run uses yours, which the operator never changes: annotate it yourself, or remove one of the two",
    "fieldPath": ".serviceAccountAnnotations", "reason": "FieldValueInvalid"}


STORAGE_PATH_MATCHES = (STORAGE_PATH.pattern, "must be gs://BUCKET/PATH or an absolute path on a mounted volume "
                        "(spec.checkpoint.volume)")
S3_REFUSED = (r"^s3://", "s3:// is not supported (TPUs run on Google Cloud, and no other object store was run end to "
              "end): copy the data to a gs:// bucket, or mount the store with a CSI driver at an absolute path")
GS_URI_EXTRAS_REFUSED = (GS_URI_EXTRAS.pattern, "a gs:// URI takes no query (?...) or fragment (#...): give "
                         "gs://BUCKET/PATH only (a query would be read as storage client options, and the run's "
                         "directory appended after it)")
# What every field that takes a gs:// URI declares besides its own checks.
URI_FIELD: dict[str, Any] = {"refuses": (GS_URI_EXTRAS_REFUSED, S3_REFUSED)}


# --- the API: one declaration per field ----------------------------------------------------------
# Each section's fields carry what the API says about them (tpuft.api.fields.declare): the CRD's schema,
# the defaults, the parser's single-field checks and the workload's flags all come from here.

@dataclass(frozen=True)
class Dataset:
    """spec.dataset."""
    name: str = declare("Hugging Face dataset id, local path or gs:// URI (builtin:dolly-mini ships with the "
                        "workload).", python_default="", required=True, min_length=1, workload=True,
                        flag="dataset", **_shell_safe(), **URI_FIELD)
    split: str = declare("Split in datasets' slicing syntax, e.g. train[:1024].", default="train", workload=True,
                         flag="dataset-split", **_shell_safe(MAX_SPLIT_LENGTH))
    format: str | None = declare("How to read a file whose name does not end in .jsonl, .json or .parquet "
                                 "(json: JSON lines; parquet). Leave out for a Hugging Face dataset id.",
                                 enum=_values(DatasetFormat), workload=True, flag="dataset-format")
    type: str | None = declare("What a record holds: messages (OpenAI chat fine-tuning: role/content turns), "
                               "promptCompletion, instruction (dolly instruction/context/response or alpaca "
                               "instruction/input/output) or text (every token trained). Left out, the columns say.",
                               enum=_values(DatasetType), workload=True, flag="dataset-type")
    # (key a record type reads, the dataset's column), sorted
    columns: tuple[tuple[str, str], ...] = declare(
        "The dataset's own column for a name a record type reads (keys: "
        f"{', '.join(DATASET_COLUMN_KEYS)}), e.g. {{prompt: question, completion: answer}}.",
        python_default=(), schema=_columns_schema, workload=True, flag="dataset-column")
    overlong: str = declare("An example longer than training.maxSeqLength: truncate (its first maxSeqLength "
                            "tokens; dropped when no answer token is left) or drop. Counted in the driver's log.",
                            default=Overlong.TRUNCATE, enum=_values(Overlong), workload=True)


@dataclass(frozen=True)
class Lora:
    """spec.training.lora: the adapters PEFT adds beside each targeted linear layer."""
    rank: int = declare("The adapters' rank r: a power of two, at most the smallest dimension of a targeted layer.",
                        default=16, enum=LORA_RANKS, workload=True, flag="lora-rank")
    alpha: int = declare("The adapters' scale is alpha / rank.", default=32, minimum=1, maximum=8192,
                         workload=True, flag="lora-alpha")
    dropout: float = declare("Dropout on the adapters' input.", default=0.05, minimum=0, maximum=1,
                             exclusive_maximum=True, workload=True, flag="lora-dropout")
    # Module names (the last part of a path, as PEFT matches them); empty: the default for the
    # model's model_type (constants.LORA_DEFAULT_TARGET_MODULES), resolved by the workload's driver.
    target_modules: tuple[str, ...] = declare(
        "Linear layers to adapt, by name (the last part of the module path). Default per model_type: the "
        f"attention and MLP projections ({', '.join(LORA_DEFAULT_TARGET_MODULES['llama'])}).",
        python_default=(), schema=_target_modules_schema, workload=True, flag="lora-target-modules")


LORA_RULES = (
    {"rule": "!has(self.lora) || (has(self.method) && self.method == 'lora')",
     "message": "training.lora is set but training.method is not lora: set method: lora, or remove it",
     "fieldPath": ".lora", "reason": "FieldValueInvalid"},)


@dataclass(frozen=True)
class Training:
    """spec.training."""
    epochs: int = declare("Passes over the dataset.", default=3, minimum=1, maximum=1000, workload=True)
    batch_size_per_device: int = declare("Sequences per device per step.", default=4, minimum=1, maximum=4096,
                                         workload=True)
    max_seq_length: int = declare("Tokens per sequence (packed block length).", default=512, minimum=16,
                                  maximum=131072, workload=True)
    # Left out: the method's (LEARNING_RATE_BY_METHOD), filled in by the parser, not the API server.
    learning_rate: float = declare(
        "AdamW's peak learning rate. Left out: "
        f"{', '.join(f'{rate:g} for {method}' for method, rate in LEARNING_RATE_BY_METHOD.items())}, the usual "
        "rates of each method.", python_default=LEARNING_RATE_BY_METHOD["full"], minimum=0, exclusive_minimum=True,
        maximum=LEARNING_RATE_MAX, exclusive_maximum=True, workload=True)
    packing: bool = declare("Pack examples into fixed-length blocks (true) or pad each example to maxSeqLength as "
                            "the GKE tutorial does (false).", default=True, workload=True)
    report_every_steps: int = declare("Report metrics into status every K steps.", default=10, minimum=1,
                                      maximum=100000, workload=True)
    # Ray Train FailureConfig: worker restarts inside one job
    max_failures: int = declare("Ray Train worker-group restarts inside one job (FailureConfig).", default=1,
                                minimum=0, maximum=100, workload=True)
    # operator resubmissions of a failed training RayJob (preemption)
    max_job_retries: int = declare("Times the operator resubmits a failed training RayJob (e.g. Spot preemption); "
                                   "each resumes from the latest checkpoint.", default=0, minimum=0, maximum=20)
    framework: str = declare("torch: TorchTrainer + FSDP2, one worker per device. jax: JaxTrainer, one worker per "
                             "host, parameters and optimizer state sharded over the slice's devices; Orbax "
                             "checkpoints, the same Hugging Face export.", default=TrainingFramework.TORCH,
                             enum=_values(TrainingFramework), workload=True)
    method: str = declare("full: every weight is trained. lora: low-rank adapters (PEFT) beside the frozen, sharded "
                          "base; gradients, optimizer state and checkpoints hold the adapters only, and the export "
                          "is a PEFT adapter folder, on either framework. none: nothing is trained; spec.model is served as "
                          "it is (spec.serve enabled, no dataset, no training cluster), e.g. a base for adapters "
                          "(spec.serve.adapters).",
                          default=TrainingMethod.FULL, enum=_values(TrainingMethod), workload=True)
    lora: Lora | None = declare("LoRA's adapters (with method: lora).")   # set exactly when method is lora
    seed: int = declare("Seeds the model's new weights, the data order and dropout: the same seed and data give "
                        "the same run.", default=42, minimum=0, maximum=2**31 - 1, workload=True)
    learning_rate_schedule: str = declare(
        "After the warmup: constant (the peak rate to the end), linear or cosine (from the peak down to "
        "minLearningRateRatio x the peak at the last step).", default=LearningRateSchedule.CONSTANT,
        enum=_values(LearningRateSchedule), workload=True)
    warmup_steps: int | None = declare("Optimizer steps over which the rate rises linearly from 0 to the peak "
                                       "(or warmupRatio; neither: no warmup).", minimum=0, maximum=10_000_000,
                                       workload=True)
    warmup_ratio: float | None = declare("The warmup as a fraction of the run's optimizer steps (or warmupSteps).",
                                         minimum=0, maximum=1, exclusive_maximum=True, workload=True)
    min_learning_rate_ratio: float = declare("Where linear and cosine decay end, as a fraction of the peak rate.",
                                             default=0.0, minimum=0, maximum=1, workload=True)
    weight_decay: float = declare("AdamW's decoupled weight decay, on weight matrices only: never on biases, norms "
                                  "or embeddings.", default=0.01, minimum=0, maximum=1, workload=True)
    max_grad_norm: float = declare("Gradients are clipped to this global norm before each optimizer step.",
                                   default=1.0, minimum=0, exclusive_minimum=True, maximum=1000, workload=True)
    gradient_accumulation_steps: int = declare(
        "Micro-batches summed into one optimizer step: the global batch is devices x batchSizePerDevice x this "
        "(x slices), printed by the driver and in status.training.globalBatchSize.", default=1, minimum=1,
        maximum=1024, workload=True)
    max_steps: int | None = declare("Stop after this many optimizer steps, instead of after epochs (the data is "
                                    "passed over as often as it takes).", minimum=1, maximum=100_000_000,
                                    workload=True)
    # None in the spec: on for TPUs (the parser); on cpu it stays None and the workers decide.
    activation_checkpointing: bool | None = declare(
        "Recompute each decoder layer's activations in the backward pass instead of keeping them: less memory "
        "at long maxSeqLength for about a third more compute. Left out: on for TPUs (HBM, not compute, caps the "
        "sequence length there); on cpu, on only when a worker's step would not fit its pod's memory without it "
        "(reckoned from the model's config.json and the pod's memory limit).", workload=True)


@dataclass(frozen=True)
class Evaluation:
    """spec.evaluation: an eval set, rendered and packed as training's, and its loss during the run."""
    fraction: float | None = declare("Hold out this fraction of spec.dataset's records (chosen with the seed) as "
                                     "the eval set; or give split (and name).", minimum=0, exclusive_minimum=True,
                                     maximum=0.5, workload=True, flag="eval-fraction")
    name: str | None = declare("The eval set's dataset, as spec.dataset.name (default: spec.dataset.name).",
                               min_length=1, workload=True, flag="eval-dataset", **_shell_safe(), **URI_FIELD)
    split: str | None = declare("The eval set's split, e.g. test, or train[-200:] with spec.dataset.split "
                                "train[:-200]: records the run trains on are refused (eval loss would measure "
                                "memorisation).", min_length=1, workload=True, flag="eval-split",
                                **_shell_safe(MAX_SPLIT_LENGTH))
    every_steps: int | None = declare("Evaluate every N optimizer steps (left out: at each epoch end); always at "
                                      "the end.", minimum=1, maximum=10_000_000, workload=True,
                                      flag="eval-every-steps")
    early_stopping_patience: int | None = declare("Stop when the eval loss has not improved for this many "
                                                  "evaluations in a row.", minimum=1, maximum=1000, workload=True)
    keep_best: bool = declare("Export the checkpoint with the lowest eval loss instead of the last one.",
                              python_default=False, workload=True)


EVALUATION_RULES = (
    {"rule": "has(self.fraction) != (has(self.split) || has(self.name))",
     "message": "give the eval set as fraction (held out of spec.dataset) or as split (and name), one of the two",
     "fieldPath": ".fraction", "reason": "FieldValueInvalid"},)


def eval_overlap(dataset: Dataset, evaluation: Evaluation) -> tuple[splits.Overlap, str, str]:
    """Whether the eval set reads records spec.dataset trains on, as far as the spec says: (the
    answer, the eval split's field path, a sentence naming both splits and what to do). Held out
    (fraction) or another dataset: never. Not in CEL: the API server's CEL cannot parse a slice."""
    field_path = "spec.evaluation.split" if evaluation.split is not None else "spec.evaluation.name"
    if evaluation.fraction is not None or evaluation.name not in (None, dataset.name):
        return splits.Overlap.NONE, field_path, ""
    split = evaluation.split or dataset.split
    found = splits.overlap(dataset.split, split)
    if found == splits.Overlap.NONE:
        return found, field_path, ""
    other = splits.complement(split)
    parts = splits.parse(split) or splits.parse(dataset.split)
    name = parts[0].split if parts else "train"
    fix = (f"use spec.dataset.split {other} and spec.evaluation.split {split}" if other else
           f"use slices from opposite ends, e.g. spec.dataset.split {name}[:-200] and spec.evaluation.split "
           f"{name}[-200:]")
    reads = f"{evaluation.split!r}" if evaluation.split is not None else "the same dataset with no split"
    trained = f"records spec.dataset.split {dataset.split!r} trains on (both of {dataset.name}"
    if found == splits.Overlap.ALWAYS:
        return found, field_path, (f"{reads} reads {trained}): the eval loss, keepBest and early stopping would "
                                   f"measure memorisation; {fix}, or hold records out with spec.evaluation.fraction")
    return found, field_path, (f"{reads} may read {trained}; it depends on the split's size, which the spec does "
                               f"not say): {fix}, or hold records out with spec.evaluation.fraction")


def spec_warnings(spec: Spec) -> list[str]:
    """What the spec may get wrong but cannot be refused for: told by `tpuft validate` and in a
    Warning event when the run's children are created."""
    if spec.evaluation is None:
        return []
    found, field_path, message = eval_overlap(spec.dataset, spec.evaluation)
    return [f"warning: {field_path}: {message}"] if found == splits.Overlap.UNKNOWN else []


WARMUP_RULE = {"rule": "!(has(self.warmupSteps) && has(self.warmupRatio))",
               "message": "warmupSteps and warmupRatio both set: give one", "fieldPath": ".warmupRatio",
               "reason": "FieldValueInvalid"}


# vLLM's max_lora_rank accepts these (vllm.config.LoRAConfig); a smaller training rank fits under any of them.
SERVE_LORA_RANKS = (8, 16, 32, 64, 128, 256, 512)
MAX_ADAPTER_NAME_LENGTH = 63   # a DNS label: a folder under the adapters root and the model id's suffix


@dataclass(frozen=True)
class ServeAdapters:
    """spec.serve.adapters: room for LoRA adapters beside the served model (a base for spec.publish)."""
    max_per_replica: int = declare(
        "Adapters loaded at once on each replica; the least recently used is evicted for a new one (Ray Serve "
        "LLM's max_num_adapters_per_replica).", default=8, minimum=1, maximum=64)
    max_rank: int = declare(
        "The largest LoRA rank served (vLLM's max_lora_rank); a fine-tune whose training.lora.rank is larger is "
        "refused before training.", default=64, enum=SERVE_LORA_RANKS)


@dataclass(frozen=True)
class Publish:
    """spec.publish: where a LoRA fine-tune's adapter is served once training succeeds."""
    to: str = declare("The TPUFinetune (same namespace) that serves the base with spec.serve.adapters; it must "
                      "serve the same spec.model.", python_default="", required=True, min_length=1,
                      max_length=MAX_NAME_LENGTH, pattern=DNS_LABEL.pattern)
    adapter: str | None = declare("The adapter's name: clients call it as <base>:<name> (default metadata.name).",
                                  name="as", min_length=1, max_length=MAX_ADAPTER_NAME_LENGTH,
                                  pattern=DNS_LABEL.pattern)
    when: str = declare("always: this fine-tune replaces the adapter served under that name. ifBetter: only when "
                        "its eval loss, on the same eval set, is below the served one's minus margin; else it is "
                        "kept unpublished (reason NotPromoted, both losses in status.serving).",
                        default=PublishWhen.IF_BETTER, enum=_values(PublishWhen))
    margin: float = declare("With ifBetter: how much lower the eval loss must be than the served one's.",
                            default=0.0, minimum=0, maximum=100)


# spec's rules across sections for adapters: the CRD's CEL (tpuft.api.crd) and the parser give these messages.
_METHOD = "(has(self.training) && has(self.training.method) ? self.training.method : 'full')"
ADAPTER_RULES = (
    {"rule": f"!has(self.publish) || {_METHOD} == 'lora'",
     "message": "publish serves a LoRA adapter on a base: it needs training.method lora",
     "fieldPath": ".publish", "reason": "FieldValueInvalid"},
    {"rule": f"!(has(self.serve) && has(self.serve.adapters)) || {_METHOD} != 'lora'",
     "message": "serve.adapters makes this object a base for LoRA adapters: it needs training.method none (serve "
                "spec.model as it is) or full; a LoRA fine-tune publishes to a base with spec.publish instead",
     "fieldPath": ".serve.adapters", "reason": "FieldValueInvalid"},
    {"rule": f"{_METHOD} != 'none' || (has(self.serve) && has(self.serve.enabled) && self.serve.enabled)",
     "message": "training.method none trains nothing and serves spec.model as it is: set serve.enabled true (delete "
                "the object to stop serving it)", "fieldPath": ".serve", "reason": "FieldValueInvalid"},
    {"rule": f"has(self.dataset) || {_METHOD} == 'none'",
     "message": "dataset is required (only training.method none, which trains nothing, goes without)",
     "fieldPath": ".dataset", "reason": "FieldValueRequired"},
    {"rule": f"!has(self.evaluation) || {_METHOD} != 'none'",
     "message": "evaluation needs a run that trains: training.method none serves spec.model as it is",
     "fieldPath": ".evaluation", "reason": "FieldValueInvalid"},
)


@dataclass(frozen=True)
class Export:
    """spec.export: what the run writes besides its checkpoints."""
    merge: bool = declare("With training.method lora: also write the base with the adapters merged in, as full "
                          "Hugging Face weights (export-merged beside the adapter).", default=False, workload=True,
                          flag="merge-export")   # LoRA: also merged full weights beside the adapter export


@dataclass(frozen=True)
class Checkpoint:
    """spec.checkpoint."""
    storage_path: str = declare("gs://BUCKET/PATH (no query or fragment) or an absolute path on a mounted volume "
                                "(spec.checkpoint.volume).", python_default="", required=True, min_length=1,
                                max_length=MAX_PATH_LENGTH, matches=STORAGE_PATH_MATCHES, workload=True, **URI_FIELD)
    every_steps: int = declare("Checkpoint every N steps; 0 checkpoints at the end of each epoch only.", default=0,
                               minimum=0, maximum=10_000_000, workload=True, flag="checkpoint-every-steps")
    keep: int = declare("Checkpoints to keep.", default=1, minimum=1, maximum=100, workload=True,
                        flag="keep-checkpoints")
    # An earlier run's checkpoint (or run directory) to continue from on purpose; a run's own
    # directory is keyed by the object's UID, so nothing else is ever resumed implicitly.
    resume_from: str | None = declare(
        "Continue from an earlier run on purpose: a checkpoint_step_* directory or a run directory (its newest "
        "committed checkpoint) written by an earlier TPUFinetune, as gs://BUCKET/PATH or an absolute path. Model, "
        "optimizer and step are restored; the model architecture must match. Without it a TPUFinetune never reads "
        "checkpoints of another object, even one of the same name.",
        min_length=1, max_length=MAX_PATH_LENGTH, matches=STORAGE_PATH_MATCHES, workload=True, **URI_FIELD)
    # A Kubernetes volume source ({kind: fields}) mounted at storage_path in every Ray pod:
    # the shared filesystem (Filestore PVC, GCS FUSE CSI, NFS, a node's hostPath) that Ray
    # Train needs when storage_path is a path rather than gs://.
    volume: dict | None = declare(
        "A volume mounted at storagePath in every Ray pod, for a storagePath that is a path: exactly one Kubernetes "
        "volume source (a Filestore persistentVolumeClaim, the GCS FUSE csi driver, nfs, or a hostPath).",
        schema=_checkpoint_volume_schema)


@dataclass(frozen=True)
class Recovery:
    """spec.recovery."""
    # A host lost while verifying or training: the slice is replaced (KubeRay recreates the lost
    # pods), verified again and training resumes from its checkpoint, at most this many times.
    max_slice_replacements: int = declare(
        "Times the slice is replaced (KubeRay recreates the lost pods), verified again and training resumed from "
        "its checkpoint; one more loss fails with SliceLost.", default=2, minimum=0, maximum=20)
    # With slices > 1 a lost slice need not stop the run: the others train on (HSDP's replicate dimension
    # shrinks, the global batch kept by gradient accumulation) until it is back.
    elastic: bool = declare(
        "With spec.slices > 1: when a lost slice is not back within elasticWaitSeconds, training resumes from its "
        "checkpoint on the slices that are whole (the global batch kept by gradient accumulation where the slice "
        "counts divide), and returns to every slice from the next checkpoint once they are all whole again.",
        default=False)
    elastic_wait_seconds: int = declare(
        "How long a replacement slice may take before training goes on without it (spec.recovery.elastic).",
        default=120, minimum=0, maximum=86400)


@dataclass(frozen=True)
class Verification:
    """spec.verification."""
    enabled: bool = declare("Run verification before training.", default=True)
    timeout_seconds: int = declare("Fail with CollectiveTimeout when verification has not finished by then.",
                                   default=600, minimum=10, maximum=86400, workload=True, flag="timeout-seconds")


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """The object is not a valid TPUFinetune. `problems` lists each fault by field path."""

    def __init__(self, problems: list[Problem], where: str = ""):
        self.problems = problems
        self.where = where
        head = f"{where}: " if where else ""
        super().__init__(head + "; ".join(str(p) for p in problems))


@dataclass(frozen=True)
class ObjectMeta:
    name: str
    namespace: str
    uid: str = ""
    generation: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the TPUFinetune's namespace (spec.hfTokenSecret, spec.serve.apiKeySecret):
    passed to pods only by secretKeyRef, never read by the operator."""
    name: str = declare("Secret name in the TPUFinetune's namespace.", python_default="", required=True, min_length=1,
                        max_length=MAX_DNS_SUBDOMAIN_LENGTH, pattern=DNS_SUBDOMAIN.pattern)
    key: str = declare("Key within the Secret.", python_default="", required=True, min_length=1,
                       max_length=MAX_DNS_SUBDOMAIN_LENGTH, pattern=CONFIG_KEY.pattern)


@dataclass(frozen=True)
class ApiKeySecretRef(SecretKeyRef):
    """spec.serve.apiKeySecret as written: its key may be left out. The default is the parser's, not
    the CRD's: the API server defaults nothing inside an optional object, and DEFAULTS lists only
    what it does default."""
    key: str = declare(f"Key within the Secret (default {SERVE_API_KEY_SECRET_KEY}).",
                       python_default=SERVE_API_KEY_SECRET_KEY, min_length=1, max_length=MAX_DNS_SUBDOMAIN_LENGTH,
                       pattern=CONFIG_KEY.pattern)


@dataclass(frozen=True)
class ResourceBlock:
    """One container's overrides (spec.resources.head, .worker) as written; the parser keeps them as
    {requests|limits: {resource: quantity}} for the builders."""
    requests: Mapping[str, str] = declare("Resource requests, e.g. {cpu: \"32\", memory: 128Gi}.", factory=dict,
                                          schema=_quantities_schema)
    limits: Mapping[str, str] = declare("Resource limits; google.com/tpu is always set from the topology.",
                                        factory=dict, schema=_quantities_schema)


def _overrides(who: str) -> str:
    return f"Overrides for the {who} container's cpu/memory (Kubernetes quantities)."


def _resource_block_schema() -> dict:
    return fields.schema_of(ResourceBlock)


def _reference_shm_sizes() -> str:
    """'100Gi v6e, 128Gi tpu7x': the /dev/shm defaults the catalog takes from reference manifests."""
    return ", ".join(f"{g.worker.shm} {g.name}" for g in catalog.GENERATIONS if g.worker.from_reference)


@dataclass(frozen=True)
class Resources:
    """spec.resources: user overrides for container resources; google.com/tpu is never overridable."""
    head: Mapping[str, Mapping[str, str]] = declare(_overrides("Ray head"), factory=dict,
                                                    schema=_resource_block_schema)
    worker: Mapping[str, Mapping[str, str]] = declare(_overrides("TPU worker"), factory=dict,
                                                      schema=_resource_block_schema)
    shm_size: str | None = declare(f"Size of the in-memory /dev/shm on workers (default per generation: "
                                   f"{_reference_shm_sizes()}).", max_length=MAX_QUANTITY_LENGTH,
                                   pattern=QUANTITY.pattern)


@dataclass(frozen=True)
class ServeResources(Resources):
    """spec.serve.resources as written: spec.resources' fields, for the serving pods (parsed into a Resources)."""
    worker: Mapping[str, Mapping[str, str]] = declare(_overrides("serving worker"), factory=dict,
                                                      schema=_resource_block_schema)
    shm_size: str | None = declare("Size of the in-memory /dev/shm on serving workers.",
                                   max_length=MAX_QUANTITY_LENGTH, pattern=QUANTITY.pattern)


# spec.scheduling's rules across fields: the CRD's CEL (on Spec.scheduling) and the parser give these messages.
FLEX_START_EXCLUSIVE = "provisioning flexStart excludes spot and reservation: flex-start is its own capacity type"
MAX_RUN_DURATION_NEEDS_FLEX_START = "maxRunDurationSeconds applies to provisioning flexStart only"
SCHEDULING_RULES = (
    {"rule": "!(has(self.spot) && self.spot && has(self.reservation))",
     "message": "spot and reservation are mutually exclusive"},
    {"rule": f"!(has(self.provisioning) && self.provisioning == '{Provisioning.FLEX_START.value}' && "
             "((has(self.spot) && self.spot) || has(self.reservation)))",
     "message": FLEX_START_EXCLUSIVE},
    {"rule": f"!has(self.maxRunDurationSeconds) || (has(self.provisioning) && "
             f"self.provisioning == '{Provisioning.FLEX_START.value}')",
     "message": MAX_RUN_DURATION_NEEDS_FLEX_START})


@dataclass(frozen=True)
class Toleration:
    """One of spec.scheduling.tolerations as written (kept as a dict, for the pods)."""
    key: str | None = declare("Taint key (empty with operator Exists: every taint).")
    operator: str | None = declare("Exists or Equal (default).", enum=TOLERATION_OPERATORS)
    value: str | None = declare("Taint value (operator Equal).")
    effect: str | None = declare("Taint effect to match (empty: all).", enum=TOLERATION_EFFECTS)
    toleration_seconds: int | None = declare("For NoExecute: seconds to stay bound.")


def _tolerations_schema() -> dict:
    return {"type": "array", "items": fields.schema_of(Toleration, "A Kubernetes toleration.")}


@dataclass(frozen=True)
class Scheduling:
    """spec.scheduling: capacity and placement."""
    spot: bool = declare("Run workers on Spot VMs (node selector cloud.google.com/gke-spot).", python_default=False)
    reservation: str | None = declare("Consume this specific GKE reservation (becomes a node selector value).",
                                      max_length=MAX_LABEL_LENGTH, pattern=LABEL_VALUE.pattern)
    node_selector: Mapping[str, str] = declare("Extra node selector for workers; the TPU selectors always win.",
                                               factory=dict, schema=functools.partial(string_map_schema, True))
    tolerations: tuple[Mapping[str, Any], ...] = declare("Extra tolerations for worker pods.", python_default=(),
                                                         schema=_tolerations_schema)
    priority_class_name: str | None = declare("PriorityClass for the Ray pods.", max_length=MAX_DNS_SUBDOMAIN_LENGTH,
                                              pattern=DNS_SUBDOMAIN.pattern)
    provisioning: str = declare(
        "How the slice's capacity is obtained. standard: nodes already in the pool or made by the autoscaler "
        "(on-demand, or as spot and reservation say). flexStart: GKE flex-start with queued provisioning (Dynamic "
        "Workload Scheduler): the workers select and tolerate flex-start nodes, and Kueue's ProvisioningRequest "
        "admission check (the ClusterQueue of the kueue.x-k8s.io/queue-name label) gets the whole slice at once; "
        "the run waits Queued (WaitingForCapacity) until it is provisioned. Left out: standard.",
        python_default=Provisioning.STANDARD.value, enum=_values(Provisioning))
    max_run_duration_seconds: int | None = declare(
        "flexStart only: the longest the flex-start nodes run (the ProvisioningRequest's maxRunDurationSeconds "
        "parameter, through Kueue; GKE's default and limit: 7 days). Checkpoint more often than this.",
        minimum=600, maximum=GKE_MAX_RUN_DURATION_SECONDS)

    topology_aware: bool = declare(
        "Multi-host TPU only, with a kueue.x-k8s.io/queue-name label: ask Kueue's Topology Aware Scheduling to keep "
        "each slice's hosts on one slice of nodes (GKE: one node pool, label cloud.google.com/gke-nodepool). The "
        "ClusterQueue's TPU ResourceFlavor needs a topologyName (a Kueue Topology whose levels include "
        "cloud.google.com/gke-nodepool), or Kueue does not admit it. With slices above 1 each slice is a worker "
        "group of its own (`<group>-s<i>`), which Kueue places as one pod set.",
        python_default=False)

    @property
    def flex_start(self) -> bool:
        return self.provisioning == Provisioning.FLEX_START.value


@dataclass(frozen=True)
class ServeReplicas:
    """spec.serve.replicas: a number (that many, fixed) or {min, max} (Ray Serve autoscales between
    them). One replica is one serve slice, so max is also how many slices the RayService may hold."""
    min: int
    max: int

    @property
    def fixed(self) -> bool:
        return self.min == self.max

    def __str__(self) -> str:
        return str(self.min) if self.fixed else f"{self.min}-{self.max}"


@dataclass(frozen=True)
class Serve:
    """spec.serve, when enabled: the model training exported, behind an OpenAI-compatible API on
    its own slice (a KubeRay RayService built by the same builders as the training cluster)."""
    slice: catalog.SliceShape
    replicas: ServeReplicas   # Serve replicas, one slice each
    engine: ServeEngine
    image: str                # serve.image, else (transformers only) the training image
    image_pull_policy: str | None
    max_model_length: int | None
    timeout_seconds: int      # for the app to become RUNNING
    resources: Resources
    # The API key the serving app requires of clients: the serving pods get it by secretKeyRef only
    # (constants.SERVE_API_KEY_ENV); a client such as `tpuft chat` reads the Secret with its user's credentials.
    api_key_secret: SecretKeyRef | None = None
    adapters: ServeAdapters | None = None   # a base for LoRA adapters (spec.publish of other objects)


# spec.serve.replicas' bounds and default (a number or {min, max}: _serve_replicas_schema).
SERVE_REPLICAS_LIMITS = (1, 64)
SERVE_REPLICAS_DEFAULT = 1


def _serve_replicas_schema() -> dict:
    """Irregular, so by hand: a structural schema cannot type a number-or-object union, so the node
    keeps what it is sent (x-kubernetes-preserve-unknown-fields, no type) and constrains each form
    with validations that apply only to their own kind: minimum/maximum to a number, properties,
    required and maxProperties to an object. CEL cannot read an untyped node, so min <= max (and
    anything else the schema lets through, such as a string) is refused by the parser, which names
    spec.serve.replicas in the status and in `tpuft validate`."""
    lo, hi = SERVE_REPLICAS_LIMITS
    bound = {"type": "integer", "minimum": lo, "maximum": hi}
    return {"x-kubernetes-preserve-unknown-fields": True, "default": SERVE_REPLICAS_DEFAULT,
            "minimum": lo, "maximum": hi,
            "properties": {"min": {**bound, "description": "Replicas (slices) always up."},
                           "max": {**bound, "description": "Replicas (slices) at most."}},
            "required": ["min", "max"], "maxProperties": 2}


@dataclass(frozen=True)
class ServeSection:
    """spec.serve as written. `Serve` is what it resolves to: the slice through the catalog (as
    spec's), replicas as ServeReplicas, resources and the API key's Secret by their parsers below."""
    enabled: bool = declare("Serve after training. Setting it to false while Serving deletes the RayService and ends "
                            "in Succeeded.", default=False)
    accelerator: str | None = declare("Serving TPU generation (default: spec.accelerator).",
                                      enum=tuple(accelerator_enum()))
    topology: str | None = declare("Serving slice shape (default: spec.topology); validated like spec.topology.",
                                   max_length=catalog.MAX_TOPOLOGY_LENGTH)
    replicas: int | Mapping[str, int] = declare(
        "Serve replicas, one serve slice each: a number (that many, fixed) or {min, max} (Ray Serve autoscales "
        "between them, and the RayService's worker group between min and max slices; min <= max).",
        default=SERVE_REPLICAS_DEFAULT, schema=_serve_replicas_schema)
    engine: str | None = declare("vllm (Ray Serve LLM on vLLM; the default on TPU) or transformers (the workload's own "
                                 "deployment; the default on cpu).", enum=_values(ServeEngine))
    image: str | None = declare("Serving image; required for vllm (the training image has no vLLM). Default for "
                                "transformers: spec.image.", min_length=1, **_shell_safe())
    max_model_length: int | None = declare("Prompt plus completion tokens per request (vLLM max_model_len).",
                                           minimum=16, maximum=1_048_576)
    timeout_seconds: int = declare("Fail with ServeFailed when the Serve app is not RUNNING this long after deploying "
                                   "(or after it stops being RUNNING).", default=1800, minimum=10, maximum=86400)
    adapters: ServeAdapters | None = declare(
        "Serve LoRA adapters beside the model: fine-tunes with spec.publish naming this object are served as "
        "<this name>:<adapter>, loaded on first use from <storagePath>/<run>/adapters (with training.method none "
        "or full).")
    resources: ServeResources = declare("Resource overrides for the serving Ray pods.", factory=ServeResources)
    api_key_secret: ApiKeySecretRef | None = declare(
        f"Secret holding the API key the serving app requires of its clients. The serving pods get it as "
        f"{SERVE_API_KEY_ENV} by secretKeyRef only; the operator never reads it.")


def _serve_section_schema() -> dict:
    return fields.schema_of(ServeSection)


def _topology_description() -> str:
    by_dims = {d: "/".join(g.name for g in catalog.GENERATIONS if g.dims == d) for d in catalog.EXAMPLE_TOPOLOGY}
    two, three = catalog.EXAMPLE_TOPOLOGY[2], catalog.EXAMPLE_TOPOLOGY[3]
    shape = catalog.resolve_slice(EXAMPLE_GENERATION.name, two)
    return (f"Slice shape, e.g. {two} ({by_dims[2]}: 2D) or {three} ({by_dims[3]}: 3D). A shape, not a chip count: "
            f"{two} is {shape.chips} chips on {shape.hosts} hosts. With accelerator {CPU_ACCELERATOR}: the worker "
            "count.")


@dataclass(frozen=True)
class SliceSection:
    """spec.accelerator and spec.topology as written. The catalog resolves them (Spec.slice) and is the
    parser's check of both; the CRD's enum and its topology rules (tpuft.api.crd) come from it too."""
    accelerator: str = declare(
        f"TPU generation: {either([g.name for g in catalog.GENERATIONS])} (Ray spellings such as "
        f"{EXAMPLE_GENERATION.ray_accelerator_type} and GKE ones such as {EXAMPLE_GENERATION.gke_accelerator} are "
        f"accepted), or {CPU_ACCELERATOR} to rehearse the whole flow on plain CPU pods.", python_default="",
        required=True, enum=tuple(accelerator_enum()))
    topology: str = declare(_topology_description(), python_default="", required=True,
                            max_length=catalog.MAX_TOPOLOGY_LENGTH)


ENV_VALUE_RULE = {"rule": "!(has(self.value) && has(self.valueFrom))", "message": "set value or valueFrom, not both"}


def _env_source_schema() -> dict:
    return {"type": "object", "minProperties": 1, "maxProperties": 1,
            "properties": {src: {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                 "description": f"As in a Pod's env {src}."} for src in ENV_SOURCES}}


@dataclass(frozen=True)
class EnvVar:
    """One of spec.env as written (kept as a dict, for the containers)."""
    name: str = declare("Variable name.", python_default="", required=True, min_length=1, max_length=256,
                        pattern=ENV_NAME.pattern)
    value: str | None = declare("Literal value.")
    value_from: dict | None = declare(f"A Kubernetes EnvVarSource: exactly one of {', '.join(ENV_SOURCES)}.",
                                      schema=_env_source_schema)


def _env_schema() -> dict:
    return {"type": "array", "items": fields.schema_of(EnvVar, None, **{
        "x-kubernetes-preserve-unknown-fields": True, "x-kubernetes-validations": [ENV_VALUE_RULE]})}


@dataclass(frozen=True)
class Spec:
    """spec, parsed. Every field is declared here except the slice (SliceSection as written, resolved by
    the catalog); the sections, maps and lists that are not scalars have their parser below."""
    slice: catalog.SliceShape           # spec.accelerator and spec.topology, resolved by the catalog
    slices: int = declare("Number of identical slices (data parallel across slices).", default=1, minimum=1,
                          maximum=64, workload=True)
    image: str = declare(f"Workload image with Ray {RAY_MINOR}, torch (+ torch_tpu on TPU) and the tpuft_workload "
                         "package (see Dockerfile.workload).", python_default="", required=True, min_length=1,
                         **_shell_safe())
    image_pull_policy: str | None = declare("Image pull policy for the Ray pods.", enum=_values(ImagePullPolicy))
    model: str = declare("Hugging Face model id, local path or gs:// URI (builtin:tiny-llama builds a tiny model "
                         "locally).", python_default="", required=True, min_length=1, workload=True, **_shell_safe(),
                         **URI_FIELD)
    dataset: Dataset = declare("Training data: records of chat messages, prompt/completion pairs, instructions "
                               "(dolly, alpaca) or plain text, rendered through the model's chat template as serving "
                               "renders them. Required unless training.method is none.", factory=Dataset)
    training: Training = declare("Fine-tuning hyperparameters (FSDP2 with Ray Train).", default={}, factory=Training,
                                 rules=(*LORA_RULES, WARMUP_RULE))
    # None: no eval set
    evaluation: Evaluation | None = declare("Evaluate on data the run does not train on: eval loss and perplexity "
                                            "in status, TensorBoard and tpuft plot.", rules=EVALUATION_RULES)
    checkpoint: Checkpoint = declare("Where sharded checkpoints and the exported model go. Deleting the TPUFinetune "
                                     "never deletes them.", required=True, factory=Checkpoint)
    export: Export = declare("What the run exports besides its checkpoints (status.training.exportedModel).",
                             default={}, factory=Export)
    publish: Publish | None = declare("With training.method lora: serve the adapter on a base TPUFinetune "
                                      "(spec.serve.adapters) once training succeeds (status.serving).")
    verification: Verification = declare("Collective verification (all-reduce and tensor-parallel parity on every "
                                         "device) before training.", default={}, factory=Verification)
    provisioning_timeout_seconds: int = declare(
        "Fail with ProvisioningTimeout when the slice is not ready by then, instead of waiting forever. Time Queued "
        "(waiting for Kueue's admission) does not count.", default=1800, minimum=5, maximum=604800)
    # None: wait for Kueue's admission as long as it takes
    queue_timeout_seconds: int | None = declare(
        "Optional: fail with QueueTimeout when Kueue has not admitted the run (metadata.labels "
        "kueue.x-k8s.io/queue-name) by then; unset, a queued run waits as long as it takes.", minimum=5,
        maximum=2_592_000)
    recovery: Recovery = declare("What happens when a host of the slice is lost while verifying or training.",
                                 default={}, factory=Recovery)
    suspend: bool = declare("Suspend: the RayCluster is suspended (pods deleted) until set back to false. Works with "
                            "Kueue's queue-name label.", default=False)
    ttl_seconds_after_finished: int = declare("Seconds after Succeeded/Failed before the RayCluster is deleted "
                                              "(status and checkpoints stay).", default=300, minimum=0,
                                              maximum=2_592_000)
    # None: the operator creates {name}-workload (builders.build_workload_identity)
    service_account_name: str | None = declare(
        "An existing Kubernetes ServiceAccount in the TPUFinetune's namespace for the Ray pods, e.g. one a platform "
        "team bound to Google Cloud (Workload Identity Federation for GKE). The operator never creates, changes or "
        "deletes it: it binds it (a RoleBinding of the run's own) to the run's Role, which may get and patch this "
        "object's status only. Left out: the operator creates the ServiceAccount {name}-workload.",
        min_length=1, max_length=MAX_DNS_SUBDOMAIN_LENGTH, pattern=DNS_SUBDOMAIN.pattern)
    service_account_annotations: Mapping[str, str] = declare(
        "Annotations on the ServiceAccount the operator creates ({name}-workload) only, not on the other children, "
        "e.g. iam.gke.io/gcp-service-account: NAME@PROJECT_ID.iam.gserviceaccount.com (Workload Identity through a "
        "Google service account). Not with serviceAccountName.", factory=dict,
        schema=string_map_schema)
    hf_token_secret: SecretKeyRef | None = declare(
        "Secret holding a Hugging Face token. Passed to pods only by secretKeyRef; the operator never reads it.")
    resources: Resources = declare("Resource overrides for the Ray pods.", factory=Resources)
    scheduling: Scheduling = declare("Capacity and placement.", factory=Scheduling, rules=SCHEDULING_RULES)
    # None: spec.serve absent or not enabled
    serve: Serve | None = declare(
        "Serve the fine-tuned model once training succeeds: a KubeRay RayService (Ray Serve) behind an "
        "OpenAI-compatible API (/v1/chat/completions, /v1/models). Its slice is built like training's.",
        default={}, python_default=None, schema=_serve_section_schema)
    labels: Mapping[str, str] = declare(
        "Labels added to every child object and Ray pod. Keys the operator, KubeRay or the TPU webhook set or rely "
        "on are refused.", factory=dict, schema=functools.partial(string_map_schema, True, RESERVED_LABELS))
    annotations: Mapping[str, str] = declare(
        "Annotations added to every child object and Ray pod. Keys the operator, KubeRay or the TPU webhook set or "
        "rely on are refused.", factory=dict, schema=functools.partial(string_map_schema, False, RESERVED_ANNOTATIONS))
    env: tuple[Mapping[str, Any], ...] = declare(
        "Extra environment for the Ray containers (value or valueFrom; use secretKeyRef for secrets).",
        python_default=(), schema=_env_schema)

    @property
    def accelerator(self) -> str:
        return self.slice.generation

    @property
    def num_workers(self) -> int:
        """Training workers: one per logical device across all slices."""
        return self.slice.devices * self.slices

    @property
    def trains(self) -> bool:
        """False for training.method none: spec.model is served as it is, with no training cluster."""
        return self.training.method != TrainingMethod.NONE.value

    @property
    def eval_set(self) -> str | None:
        """The eval set's fingerprint (splits.eval_set_fingerprint); None without spec.evaluation."""
        ev = self.evaluation
        if ev is None:
            return None
        return splits.eval_set_fingerprint(self.dataset.name, self.dataset.split, ev.fraction, ev.name, ev.split,
                                           self.training.seed)


@dataclass(frozen=True)
class TPUFinetune:
    meta: ObjectMeta
    spec: Spec

    @property
    def adapter_name(self) -> str | None:
        """The name its adapter is published under (spec.publish.as, default metadata.name); None: no spec.publish."""
        publish = self.spec.publish
        return None if publish is None else publish.adapter or self.meta.name


# The API server's defaults on a bare object, by dotted spec key (what the declarations say; spec.serve's
# come from its section as written).
SERVE_DEFAULTS: dict[str, Any] = fields.defaults(ServeSection, "serve.")
# spec.dataset is required unless training.method is none (ADAPTER_RULES): its defaults are a bare object's.
DEFAULTS: dict[str, Any] = {**fields.defaults(Spec), **fields.defaults(Dataset, "dataset."), **SERVE_DEFAULTS}
# Defaults inside spec.training.lora, an object the API server defaults only when it is there (its
# presence asks for LoRA's settings): DEFAULTS stays exactly what a bare object is given.
LORA_DEFAULTS: dict[str, Any] = fields.defaults(Lora, "training.lora.")
# The same for the other optional objects with defaults inside (spec.publish, spec.serve.adapters).
PRESENT_DEFAULTS: dict[str, Any] = {**LORA_DEFAULTS, **fields.defaults(Publish, "publish."),
                                    **fields.defaults(ServeAdapters, "serve.adapters.")}
# spec.serve.replicas' bounds (a number or {min, max}: _serve_replicas_schema).
LIMITS: dict[str, tuple[float, float]] = {"serve.replicas": SERVE_REPLICAS_LIMITS}


def default_of(key: str) -> Any:
    """The API server's default for a dotted spec key: DEFAULTS', else PRESENT_DEFAULTS' (None: no default)."""
    return DEFAULTS.get(key, PRESENT_DEFAULTS.get(key))



# What a required section that is missing, or not an object, reads as: its fields are not
# reported again (the API server names only the section).
ABSENT: Mapping[str, Any] = types.MappingProxyType({})


class _Reader:
    """Reads typed values out of nested dicts, recording problems instead of raising."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def section(self, obj: Mapping, key: str, path: str, required: bool = False) -> Mapping:
        value = obj.get(key)
        if value is None:
            if required:
                self.fail(path, "is required")
                return ABSENT
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, f"must be an object (got {type(value).__name__})")
            return ABSENT
        return value

    def string(self, obj: Mapping, key: str, path: str, required: bool = False,
               default: str | None = None, max_len: int = MAX_STRING_LENGTH) -> str | None:
        value = obj.get(key, default)
        if value is None:
            if required:
                self.fail(path, "is required")
            return None
        if not isinstance(value, str):
            self.fail(path, f"must be a string (got {type(value).__name__})")
            return None
        if required and not value.strip():
            self.fail(path, "must not be empty")
            return None
        if len(value) > max_len:
            self.fail(path, f"is {len(value)} characters long; at most {max_len}")
            return None
        return value

    def declared(self, section: type, obj: Mapping, path: str, workload_only: bool = False,
                 skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every declared scalar field of a section, by attribute: the value given (or the API server's
        default), checked as the server checks it. A field that fails keeps its default.
        workload_only: only the fields the workload reads; skip: attributes left out."""
        out: dict[str, Any] = {}
        for d in fields.declared(section):
            if not fields.is_scalar(d) or (workload_only and not d.api.workload) or d.attribute in skip:
                continue
            where, value = f"{path}.{d.name}", obj.get(d.name)
            if value is None:   # left out or null: the server prunes a null and defaults it
                if d.api.required and obj is not ABSENT:   # the section's own problem says it all
                    self.fail(where, "Required value")
                if d.api.default is not None:
                    out[d.attribute] = d.api.default
                continue
            problem = fields.check(d, value, where)
            if problem:
                self.fail(where, problem)
                if d.api.default is not None:
                    out[d.attribute] = d.api.default
                continue
            out[d.attribute] = float(value) if fields.scalar_type(d) == "number" else value
        return out

    def integer(self, obj: Mapping, key: str, path: str, dkey: str) -> int:
        default = default_of(dkey)   # None: optional, read only when set
        value = obj[key] if key in obj else default
        lo, hi = LIMITS[dkey]
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer (got {value!r})")
            return int(default if default is not None else lo)
        if not lo <= value <= hi:
            self.fail(path, f"must be between {int(lo)} and {int(hi)} (got {value})")
        return value

    def str_map(self, obj: Mapping, key: str, path: str, keys: re.Pattern | None = None,
                values: re.Pattern | None = None, reserved: Reserved | None = None) -> dict[str, str]:
        value = obj.get(key) or {}
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            self.fail(path, "must be a map of strings to strings")
            return {}
        if keys is not None or values is not None:
            if len(value) > MAX_MAP_ENTRIES:
                self.fail(path, f"has {len(value)} entries; at most {MAX_MAP_ENTRIES}")
            bad = [k for k in value if keys is not None and (
                len(k) > MAX_QUALIFIED_NAME_LENGTH or not keys.fullmatch(k)
                or len(k.rpartition("/")[0]) > MAX_DNS_SUBDOMAIN_LENGTH)]
            if bad:
                self.fail(path, f"keys must be Kubernetes qualified names (optional DNS prefix/, then at most {MAX_LABEL_LENGTH} "
                          f"of [-A-Za-z0-9_.]); got {bad[0]!r}")
            for k, v in value.items():
                if values is not None and not values.fullmatch(v):
                    self.fail(f"{path}.{k}", f"{v!r} is not a valid label value (at most {MAX_LABEL_LENGTH} of [-A-Za-z0-9_.], "
                              "starting and ending alphanumeric)")
        for k in value:
            why = reserved.why(k) if reserved is not None else None
            if why:
                self.fail(f"{path}.{k}", f"is reserved: {why}; remove it")
        return dict(value)


def _resource_block(r: _Reader, obj: Mapping, key: str, path: str) -> dict[str, dict[str, str]]:
    block = r.section(obj, key, path)
    out: dict[str, dict[str, str]] = {}
    for kind in ("requests", "limits"):
        raw = block.get(kind) or {}
        # Quantities are int-or-string, as in Kubernetes (`cpu: 8`); kept as strings from here on.
        if isinstance(raw, Mapping):
            raw = {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in raw.items()}
        values = r.str_map({kind: raw}, kind, f"{path}.{kind}", keys=QUALIFIED_NAME)
        for res, qty in values.items():
            if res == TPU_RESOURCE:
                r.fail(f"{path}.{kind}.{res}", "is derived from spec.topology and cannot be overridden")
            elif len(qty) > MAX_QUANTITY_LENGTH or not QUANTITY.fullmatch(qty):
                r.fail(f"{path}.{kind}.{res}", f"{qty!r} is not a Kubernetes quantity (e.g. \"8\", \"500m\", \"16Gi\")")
        if values:
            out[kind] = values
    return out


def _checkpoint_volume(r: _Reader, ck: Mapping, storage: str | None) -> dict | None:
    raw = ck.get("volume")
    if raw is None:
        return None
    path = "spec.checkpoint.volume"
    if not isinstance(raw, Mapping) or len(raw) != 1 or next(iter(raw)) not in CHECKPOINT_VOLUME_SOURCES:
        kinds = list(raw) if isinstance(raw, Mapping) else raw
        r.fail(path, f"must name exactly one volume source of {', '.join(CHECKPOINT_VOLUME_SOURCES)} (got {kinds!r})")
        return None
    kind, source = next(iter(raw.items()))
    if not isinstance(source, Mapping):
        r.fail(f"{path}.{kind}", f"must be an object (a Kubernetes {kind} volume source), got {source!r}")
        return None
    if storage and not storage.startswith("/"):
        r.fail(path, f"is mounted at spec.checkpoint.storagePath, which must then be an absolute path (got {storage!r})")
    return {kind: dict(source)}


def parse(obj: Mapping[str, Any]) -> TPUFinetune:
    """Parse and validate a TPUFinetune object (as from the API or a YAML file).

    One small parser per section, each recording its problems on the shared reader, so every
    problem is reported in one pass (in field order); the Spec is built once, at the end."""
    if not isinstance(obj, Mapping):
        raise SpecError([Problem("<root>", "must be a YAML/JSON object")])
    r = _Reader()
    meta, where = _metadata(r, obj)
    spec = r.section(obj, "spec", "spec", required=True)
    slice_shape = _slice(r, spec)
    top = r.declared(Spec, spec, "spec")   # slices, image, model, the timeouts, suspend: checked as declared
    training = _training(r, spec, slice_shape is not None and slice_shape.is_tpu)
    trains = training.method != TrainingMethod.NONE.value
    dataset = _dataset(r, spec) if trains or spec.get("dataset") is not None else Dataset()
    if not trains and spec.get("evaluation") is not None:
        r.fail("spec.evaluation", ADAPTER_RULES[4]["message"])
    evaluation = _evaluation(r, spec, dataset)
    checkpoint = _checkpoint(r, spec)
    export = _export(r, spec, training)
    hf = _secret_ref(r, spec, "hfTokenSecret", "spec.hfTokenSecret")
    verification = Verification(**r.declared(Verification, r.section(spec, "verification", "spec.verification"),
                                             "spec.verification"))
    recovery = Recovery(**r.declared(Recovery, r.section(spec, "recovery", "spec.recovery"), "spec.recovery"))
    resources = _resources(r, spec)
    scheduling = _scheduling(r, spec)
    env = _env(r, spec)
    serve = _serve(r, spec, slice_shape, top.get("image"), top.get("image_pull_policy"), top.get("model"))
    _serve_adapters_fit(r, spec, training, serve, checkpoint)
    publish = _publish(r, spec, training, evaluation, meta)
    labels = r.str_map(spec, "labels", "spec.labels", QUALIFIED_NAME, LABEL_VALUE, RESERVED_LABELS)
    annotations = r.str_map(spec, "annotations", "spec.annotations", QUALIFIED_NAME, reserved=RESERVED_ANNOTATIONS)
    account_annotations = r.str_map(spec, "serviceAccountAnnotations", "spec.serviceAccountAnnotations",
                                    QUALIFIED_NAME)
    if spec.get("serviceAccountName") is not None and spec.get("serviceAccountAnnotations") is not None:
        r.fail("spec.serviceAccountAnnotations", SERVICE_ACCOUNT_RULE["message"])   # as the CRD's rule
    if r.problems or slice_shape is None:
        raise SpecError(r.problems or [Problem("spec", "is invalid")], where)
    return TPUFinetune(meta=meta, spec=Spec(
        slice=slice_shape, dataset=dataset, training=training, checkpoint=checkpoint, hf_token_secret=hf,
        verification=verification, recovery=recovery, resources=resources, scheduling=scheduling, labels=labels,
        annotations=annotations, env=env, serve=serve, export=export, evaluation=evaluation, publish=publish,
        service_account_annotations=account_annotations, **top))


def _metadata(r: _Reader, obj: Mapping) -> tuple[ObjectMeta, str]:
    """(metadata, "namespace/name" for messages); apiVersion and kind are checked here too."""
    meta_raw = obj.get("metadata") or {}
    if not isinstance(meta_raw, Mapping):
        r.fail("metadata", f"must be an object (got {type(meta_raw).__name__})")
        meta_raw = {}
    name = meta_raw.get("name")
    namespace = meta_raw.get("namespace") or "default"
    if not isinstance(namespace, str):
        r.fail("metadata.namespace", f"must be a string (got {type(namespace).__name__})")
        namespace = "default"
    where = f"{namespace}/{name}" if name else namespace
    if obj.get("apiVersion") not in (None, API_VERSION):
        r.fail("apiVersion", f"must be {API_VERSION} (got {obj.get('apiVersion')!r})")
    if obj.get("kind") not in (None, KIND):
        r.fail("kind", f"must be {KIND} (got {obj.get('kind')!r})")
    if not isinstance(name, str) or not name:
        r.fail("metadata.name", "is required")
        name = ""
    elif len(name) > MAX_NAME_LENGTH or not DNS_LABEL.fullmatch(name):
        r.fail("metadata.name", f"must be a DNS label of at most {MAX_NAME_LENGTH} characters "
               f"(lowercase letters, digits, '-'), because child names add suffixes (got {name!r})")
    labels = meta_raw.get("labels") or {}
    generation = meta_raw.get("generation") or 0
    meta = ObjectMeta(name=name, namespace=namespace, uid=str(meta_raw.get("uid") or ""),
                      generation=generation if isinstance(generation, int) and not isinstance(generation, bool) else 0,
                      labels=dict(labels) if isinstance(labels, Mapping) else {})
    return meta, where


def _slice(r: _Reader, spec: Mapping) -> catalog.SliceShape | None:
    try:
        return catalog.resolve_slice(spec.get("accelerator"), spec.get("topology"))
    except catalog.CatalogError as e:
        r.fail(e.field, e.message)
        return None


def _dataset(r: _Reader, spec: Mapping) -> Dataset:
    ds = r.section(spec, "dataset", "spec.dataset", required=True)
    values = r.declared(Dataset, ds, "spec.dataset")
    columns = r.str_map(ds, "columns", "spec.dataset.columns")
    for key, column in columns.items():
        if key not in DATASET_COLUMN_KEYS:
            r.fail(f"spec.dataset.columns.{key}", f"is not a key a record type reads; the keys are "
                   f"{', '.join(DATASET_COLUMN_KEYS)}")
        elif not COLUMN_NAME.fullmatch(column):
            r.fail(f"spec.dataset.columns.{key}", f"{column!r} is not a column name ({COLUMN_NAME_WORDS})")
    return Dataset(**values, columns=tuple(sorted(columns.items())))


def _training(r: _Reader, spec: Mapping, on_tpu: bool) -> Training:
    tr = r.section(spec, "training", "spec.training")
    before = len(r.problems)
    values = r.declared(Training, tr, "spec.training")
    method = values.get("method")
    # A rule across fields is checked once the fields themselves are right (so is the server's CEL).
    if len(r.problems) == before and values.get("warmup_steps") is not None and values.get("warmup_ratio") is not None:
        r.fail("spec.training.warmupRatio", WARMUP_RULE["message"])
    values.setdefault("learning_rate", LEARNING_RATE_BY_METHOD.get(method or "", LEARNING_RATE_BY_METHOD["full"]))
    if values.get("activation_checkpointing") is None and on_tpu:
        values["activation_checkpointing"] = True   # cpu: None, each worker decides (tpuft_workload.train)
    return Training(**values, lora=_lora(r, tr, method))


def _evaluation(r: _Reader, spec: Mapping, dataset: Dataset) -> Evaluation | None:
    if spec.get("evaluation") is None:
        return None
    raw = r.section(spec, "evaluation", "spec.evaluation")
    before = len(r.problems)
    evaluation = Evaluation(**r.declared(Evaluation, raw, "spec.evaluation"))
    if len(r.problems) == before and (evaluation.fraction is not None) == (
            evaluation.split is not None or evaluation.name is not None):
        r.fail("spec.evaluation.fraction", EVALUATION_RULES[0]["message"])
    elif len(r.problems) == before and not any(p.field.startswith("spec.dataset") for p in r.problems):
        found, field_path, message = eval_overlap(dataset, evaluation)
        if found == splits.Overlap.ALWAYS:
            r.fail(field_path, message)
    return evaluation


def _lora(r: _Reader, tr: Mapping, method: str | None) -> Lora | None:
    """spec.training.lora: read only with method lora (and refused without it, not ignored)."""
    if method != TrainingMethod.LORA.value:
        if tr.get("lora") is not None:
            r.fail("spec.training.lora", f"is set but spec.training.method is {method}: set method: lora, or remove it")
        return None
    lora = r.section(tr, "lora", "spec.training.lora")
    return Lora(**r.declared(Lora, lora, "spec.training.lora"), target_modules=_target_modules(r, lora))


def _target_modules(r: _Reader, lo: Mapping) -> tuple[str, ...]:
    path, value = "spec.training.lora.targetModules", lo.get("targetModules")
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        r.fail(path, "must be a non-empty list of module names such as [q_proj, v_proj] (leave it out for the "
               "model's attention and MLP projections)")
        return ()
    bad = [v for v in value if not LORA_MODULE.fullmatch(v)]
    if bad:
        r.fail(path, f"{bad[0]!r} is not a module name (letters, digits and _, as in q_proj)")
    if len(set(value)) != len(value):
        r.fail(path, f"names {sorted({v for v in value if value.count(v) > 1})[0]!r} more than once")
    if len(value) > LORA_MAX_TARGET_MODULES:
        r.fail(path, f"has {len(value)} names; at most {LORA_MAX_TARGET_MODULES}")
    return tuple(value)


def _export(r: _Reader, spec: Mapping, training: Training) -> Export:
    export = Export(**r.declared(Export, r.section(spec, "export", "spec.export"), "spec.export"))
    if export.merge and training.method != TrainingMethod.LORA.value:
        r.fail("spec.export.merge", f"merges LoRA adapters into the base; a {training.method} fine-tune already "
               "exports full weights: remove it, or set spec.training.method: lora")
    return export


def _checkpoint(r: _Reader, spec: Mapping) -> Checkpoint:
    checkpoint = r.section(spec, "checkpoint", "spec.checkpoint", required=True)
    values = r.declared(Checkpoint, checkpoint, "spec.checkpoint")
    return Checkpoint(**values, volume=_checkpoint_volume(r, checkpoint, values.get("storage_path")))


def _secret_ref(r: _Reader, obj: Mapping, field_name: str, path: str,
                declaration: type[SecretKeyRef] = SecretKeyRef) -> SecretKeyRef | None:
    """A {name, key} Secret reference (spec.hfTokenSecret; spec.serve.apiKeySecret, whose declaration
    ApiKeySecretRef gives the key a default), checked as declared."""
    if obj.get(field_name) is None:
        return None
    before = len(r.problems)
    ref = declaration(**r.declared(declaration, r.section(obj, field_name, path), path))
    return SecretKeyRef(ref.name, ref.key) if len(r.problems) == before else None


def _resources(r: _Reader, spec: Mapping, path: str = "spec.resources",
               declaration: type[Resources] = Resources) -> Resources:
    """spec.resources or (declaration ServeResources) spec.serve.resources."""
    res = r.section(spec, "resources", path)
    return Resources(
        head=_resource_block(r, res, "head", f"{path}.head"),
        worker=_resource_block(r, res, "worker", f"{path}.worker"),
        **r.declared(declaration, res, path),   # shmSize
    )


def _serve(r: _Reader, spec: Mapping, training: catalog.SliceShape | None, image: str | None,
           pull: str | None, model: str | None) -> Serve | None:
    """spec.serve: validated whenever present (a disabled section still has to be right), kept only
    when enabled. The serve slice defaults to the training one and goes through the same catalog."""
    if spec.get("serve") is None:
        return None
    serve = r.section(spec, "serve", "spec.serve")
    # The slice is checked by the catalog below (its enum is the catalog's), as spec's is.
    section = ServeSection(**r.declared(ServeSection, serve, "spec.serve", skip=("accelerator", "topology")))
    shape = training
    if serve.get("accelerator") is not None or serve.get("topology") is not None:
        try:
            shape = catalog.resolve_slice(serve.get("accelerator", spec.get("accelerator")),
                                          serve.get("topology", spec.get("topology")),
                                          "spec.serve.accelerator", "spec.serve.topology")
        except catalog.CatalogError as e:
            r.fail(e.field, e.message)
            shape = None
    engine = ServeEngine(section.engine) if section.engine else (
        ServeEngine.VLLM if shape is not None and shape.is_tpu else ServeEngine.TRANSFORMERS)
    if section.enabled and engine == ServeEngine.VLLM and not section.image and serve.get("image") is None:
        r.fail("spec.serve.image", "is required with engine vllm: the training image has no vLLM (use a vLLM TPU "
               "image, or engine transformers to serve with the training image)")
    known = BUILTIN_MODEL_MAX_POSITIONS.get(model or "")
    if section.max_model_length is not None and known is not None and section.max_model_length > known:
        r.fail("spec.serve.maxModelLength", f"{section.max_model_length} is longer than {model}'s context ({known} "
               "positions)")
    replicas = _serve_replicas(r, serve)
    resources = _resources(r, serve, "spec.serve.resources", ServeResources)
    api_key = _secret_ref(r, serve, "apiKeySecret", "spec.serve.apiKeySecret", ApiKeySecretRef)
    adapters = None
    if serve.get("adapters") is not None:
        adapters = ServeAdapters(**r.declared(ServeAdapters, r.section(serve, "adapters", "spec.serve.adapters"),
                                              "spec.serve.adapters"))
    if not section.enabled or shape is None:
        return None
    return Serve(slice=shape, replicas=replicas, engine=engine, image=section.image or image or "",
                 image_pull_policy=pull if not section.image else None, max_model_length=section.max_model_length,
                 timeout_seconds=section.timeout_seconds, resources=resources, api_key_secret=api_key,
                 adapters=adapters)


def _serve_adapters_fit(r: _Reader, spec: Mapping, training: Training, serve: Serve | None,
                        checkpoint: Checkpoint) -> None:
    """The rules across sections of a base (training.method none, spec.serve.adapters): ADAPTER_RULES'
    words, and the storage Ray Serve LLM can load adapters from."""
    raw_serve = spec.get("serve")
    method = training.method
    if method == TrainingMethod.NONE.value and serve is None:
        r.fail("spec.serve", ADAPTER_RULES[2]["message"])
    if isinstance(raw_serve, Mapping) and raw_serve.get("adapters") is not None and method == TrainingMethod.LORA.value:
        r.fail("spec.serve.adapters", ADAPTER_RULES[1]["message"])
    storage = checkpoint.storage_path
    if (serve is not None and serve.adapters is not None and serve.engine == ServeEngine.VLLM and storage
            and not storage.startswith("gs://")):
        r.fail("spec.serve.adapters", f"engine vllm loads adapters from cloud storage only (Ray Serve LLM's "
               f"dynamic_lora_loading_path), and spec.checkpoint.storagePath is {storage!r}: give a gs:// "
               "storagePath, or serve with engine transformers")


def _publish(r: _Reader, spec: Mapping, training: Training, evaluation: Evaluation | None,
             meta: ObjectMeta) -> Publish | None:
    """spec.publish: a LoRA fine-tune's adapter, served by its base. What the base must be (the same
    model, with spec.serve.adapters) is checked against the base itself, by the reconciler."""
    if spec.get("publish") is None:
        return None
    raw = r.section(spec, "publish", "spec.publish")
    before = len(r.problems)
    publish = Publish(**r.declared(Publish, raw, "spec.publish"))
    if len(r.problems) > before:
        return publish
    if training.method != TrainingMethod.LORA.value:
        r.fail("spec.publish", f"{ADAPTER_RULES[0]['message']} (got {training.method})")
    if publish.to == meta.name:
        r.fail("spec.publish.to", f"names this object itself ({meta.name}): name the TPUFinetune that serves the base "
               "with spec.serve.adapters")
    if publish.when == PublishWhen.IF_BETTER.value and evaluation is None:
        r.fail("spec.publish.when", "ifBetter compares eval losses: give spec.evaluation, or set when: always")
    return publish


def _serve_replicas(r: _Reader, serve: Mapping) -> ServeReplicas:
    """A number n is {min: n, max: n}; the object form needs both bounds, min <= max."""
    path, value = "spec.serve.replicas", serve.get("replicas", DEFAULTS["serve.replicas"])
    if not isinstance(value, Mapping):
        n = r.integer(serve, "replicas", path, "serve.replicas")
        return ServeReplicas(n, n)
    unknown = sorted(set(value) - {"min", "max"})
    if unknown:
        r.fail(path, f"unknown key(s) {', '.join(map(str, unknown))}: give a number, or {{min, max}}")
    missing = [k for k in ("min", "max") if k not in value]
    if missing:
        r.fail(path, f"{' and '.join(missing)} missing: give both bounds (e.g. {{min: 1, max: 4}}), or a number "
               "for a fixed count")
        return ServeReplicas(1, 1)
    lo = r.integer(value, "min", f"{path}.min", "serve.replicas")
    hi = r.integer(value, "max", f"{path}.max", "serve.replicas")
    if lo > hi:
        r.fail(path, f"min ({lo}) is above max ({hi}): give min <= max")
    return ServeReplicas(lo, max(lo, hi))


def _scheduling(r: _Reader, spec: Mapping) -> Scheduling:
    sc = r.section(spec, "scheduling", "spec.scheduling")
    before = len(r.problems)
    declared = r.declared(Scheduling, sc, "spec.scheduling")   # spot, reservation, priorityClassName, provisioning, ...
    spot, reservation = declared.get("spot", False), declared.get("reservation")
    flex = declared.get("provisioning") == Provisioning.FLEX_START.value
    if len(r.problems) == before:   # the rules across fields, as the CRD's (SCHEDULING_RULES)
        if spot and reservation is not None:   # has(reservation), even when empty
            r.fail("spec.scheduling", "spot and reservation are mutually exclusive: pick one capacity type")
        if flex and (spot or reservation is not None):
            r.fail("spec.scheduling", FLEX_START_EXCLUSIVE)
        if declared.get("max_run_duration_seconds") is not None and not flex:
            r.fail("spec.scheduling", MAX_RUN_DURATION_NEEDS_FLEX_START)
    tolerations = sc.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        r.fail("spec.scheduling.tolerations", "must be a list of Kubernetes tolerations")
        tolerations = []
    for i, t in enumerate(tolerations):
        r.declared(Toleration, t, f"spec.scheduling.tolerations[{i}]")
    node_selector = r.str_map(sc, "nodeSelector", "spec.scheduling.nodeSelector", QUALIFIED_NAME, LABEL_VALUE)
    return Scheduling(node_selector=node_selector, tolerations=tuple(dict(t) for t in tolerations), **declared)


def _env(r: _Reader, spec: Mapping) -> tuple[Mapping[str, Any], ...]:
    env = spec.get("env") or []
    if not isinstance(env, list):
        r.fail("spec.env", "must be a list of {name, value} or {name, valueFrom}")
        return ()
    for i, item in enumerate(env):
        path = f"spec.env[{i}]"
        if not isinstance(item, Mapping):
            r.fail(path, "must be an object: {name, value} or {name, valueFrom}")
            continue
        before = len(r.problems)
        r.declared(EnvVar, item, path)   # name, value
        if len(r.problems) > before:
            continue
        if item["name"] in dict(RESERVED_ENV):
            r.fail(f"{path}.name", f"{item['name']} is reserved: {dict(RESERVED_ENV)[item['name']]}; remove it")
        elif "value" in item and "valueFrom" in item:
            r.fail(path, ENV_VALUE_RULE["message"])
        elif "valueFrom" in item and (not isinstance(item["valueFrom"], Mapping) or len(item["valueFrom"]) != 1
                                      or next(iter(item["valueFrom"])) not in ENV_SOURCES):
            r.fail(f"{path}.valueFrom", f"must hold exactly one of {', '.join(ENV_SOURCES)}")
    # Items that failed a check above never reach a Spec (parse raises), so dict() is safe here.
    return tuple(dict(e) for e in env if isinstance(e, Mapping))


# --- the workload's document ---------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """What the workload reads of a TPUFinetune: the fields declared `workload=True`, as one JSON
    document the operator writes (`workload_document`) and the workload parses with the same
    checks (`parse_run`). The slice stays as spelled: the workload's platform resolves it (it also
    runs by hand on GPUs, which the catalog does not list)."""
    accelerator: str
    topology: str
    slices: int = fields.field_of(Spec, "slices").api.default
    model: str = ""
    dataset: Dataset = field(default_factory=Dataset)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    export: Export = field(default_factory=Export)
    verification: Verification = field(default_factory=Verification)
    evaluation: Evaluation | None = None


# The sections of the document each command reads, besides the slice.
TRAINING_SECTIONS = ("dataset", "training", "checkpoint", "export", "evaluation")
VERIFICATION_SECTIONS = ("verification",)


def workload_document(spec: Spec) -> dict[str, Any]:
    """The workload's fields of a parsed spec as JSON (what the RayJobs' entrypoints carry)."""
    return {"accelerator": spec.slice.generation, "topology": spec.slice.topology, **_workload_json(spec)}


def _workload_json(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in fields.declared(type(section)):
        value = getattr(section, d.attribute)
        if value is None or value == ():
            continue
        if dataclasses.is_dataclass(value):
            inner = _workload_json(value)
            if inner:
                out[d.name] = inner
        elif d.api.workload:
            # A map held as sorted pairs (dataset.columns) goes back to the map the API has.
            is_map = d.api.schema is not None and d.api.schema().get("type") == "object"
            out[d.name] = dict(value) if is_map else fields.to_json(value)
    return out


def parse_run(doc: Any, sections: tuple[str, ...] = TRAINING_SECTIONS) -> Run:
    """The workload's document, checked as the API server and `parse` check a TPUFinetune.
    `sections`: which to read (TRAINING_SECTIONS, VERIFICATION_SECTIONS); the others keep their defaults."""
    if not isinstance(doc, Mapping):
        raise SpecError([Problem("<root>", "must be a JSON object")], "the run document")
    r = _Reader()
    accelerator = r.string(doc, "accelerator", "spec.accelerator", required=True)
    topology = r.string(doc, "topology", "spec.topology", required=True)
    top = r.declared(Spec, doc, "spec", workload_only=True, skip=() if "dataset" in sections else ("model",))
    parts: dict[str, Any] = {}
    if "dataset" in sections:
        parts["dataset"] = _dataset(r, doc)
    if "training" in sections:
        parts["training"] = _training(r, doc, accelerator is not None and accelerator.lower() not in ("cpu", "gpu"))
    if "evaluation" in sections:
        parts["evaluation"] = _evaluation(r, doc, parts.get("dataset", Dataset()))
    if "checkpoint" in sections:
        parts["checkpoint"] = _checkpoint(r, doc)
    if "export" in sections:
        parts["export"] = _export(r, doc, parts.get("training", Training()))
    if "verification" in sections:
        parts["verification"] = Verification(**r.declared(
            Verification, r.section(doc, "verification", "spec.verification"), "spec.verification"))
    if r.problems:
        raise SpecError(r.problems, "the run document")
    return Run(accelerator=accelerator or "", topology=topology or "", **top, **parts)
