"""Parse a TPUFinetune object once, at the edge, into frozen dataclasses.

Everything after this module (builders, phases, handlers) works on these types. The parser
applies the same defaults as the CRD (both read `DEFAULTS`), so a manifest rendered
offline with `tpuft render` and one defaulted by the API server give the same children.
Every problem is collected with its field path; `SpecError` carries them all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from tpuft import catalog
from tpuft.constants import (API_VERSION, DATASET_COLUMN_KEYS, KIND, RESERVED_ANNOTATIONS, RESERVED_ENV,
                             RESERVED_LABELS, SERVE_API_KEY_SECRET_KEY, TPU_RESOURCE, DatasetFormat, DatasetType,
                             ImagePullPolicy, Overlong, Reserved, ServeEngine, TrainingFramework, TrainingMethod)

# Children are named "{name}-{suffix}" (longest suffix "-workload", plus "-train-r99" for
# retries and resubmissions, "-verify-r3"); KubeRay derives pod and service names from those and
# labels them with the cluster name, so 40 keeps every derived name inside the 63-character label limit.
MAX_NAME_LENGTH = 40
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CHECKPOINT_VOLUME_SOURCES = ("persistentVolumeClaim", "csi", "nfs", "hostPath")
STORAGE_PATH = re.compile(r"^(gs://[a-z0-9][-a-z0-9_.]{1,221}[a-z0-9](/.*)?|s3://[^/\s]+(/.*)?|/[^\s]*)$")
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
MAX_STRING_LENGTH = 512        # image, model, dataset name: the CRD's maxLength and the parser's
MAX_SPLIT_LENGTH = 128

DEFAULTS: dict[str, Any] = {
    "slices": 1,
    "dataset.split": "train",
    "dataset.overlong": "truncate",
    "training.epochs": 3,
    "training.batchSizePerDevice": 4,
    "training.maxSeqLength": 512,
    "training.learningRate": 2.0e-5,
    "training.packing": True,
    "training.reportEverySteps": 10,
    "training.maxFailures": 1,
    "training.maxJobRetries": 0,
    "training.framework": TrainingFramework.TORCH.value,
    "training.method": TrainingMethod.FULL.value,
    "export.merge": False,
    "checkpoint.everySteps": 0,
    "checkpoint.keep": 1,
    "verification.enabled": True,
    "verification.timeoutSeconds": 600,
    "provisioningTimeoutSeconds": 1800,
    "recovery.maxSliceReplacements": 2,
    "suspend": False,
    "ttlSecondsAfterFinished": 300,
    "serve.enabled": False,
    "serve.replicas": 1,
    "serve.timeoutSeconds": 1800,
}

# Defaults inside spec.training.lora, an object the API server defaults only when it is there (its
# presence asks for LoRA's settings): DEFAULTS stays exactly what a bare object is given.
LORA_DEFAULTS: dict[str, Any] = {
    "training.lora.rank": 16,
    "training.lora.alpha": 32,
    "training.lora.dropout": 0.05,
}



def default_of(key: str) -> Any:
    """The API server's default for a dotted spec key: DEFAULTS', else LORA_DEFAULTS' (None: no default)."""
    return DEFAULTS.get(key, LORA_DEFAULTS.get(key))


LIMITS: dict[str, tuple[float, float]] = {
    "slices": (1, 64),
    "training.epochs": (1, 1000),
    "training.batchSizePerDevice": (1, 4096),
    "training.maxSeqLength": (16, 131072),
    "training.reportEverySteps": (1, 100000),
    "training.maxFailures": (0, 100),
    "training.maxJobRetries": (0, 20),
    "training.lora.rank": (1, 1024),     # and a power of two
    "training.lora.alpha": (1, 8192),
    "checkpoint.everySteps": (0, 10_000_000),
    "checkpoint.keep": (1, 100),
    "verification.timeoutSeconds": (10, 86400),
    "provisioningTimeoutSeconds": (5, 604800),
    "queueTimeoutSeconds": (5, 2_592_000),   # optional, no default: a queued run waits as long as it takes
    "recovery.maxSliceReplacements": (0, 20),
    "ttlSecondsAfterFinished": (0, 2_592_000),
    "serve.replicas": (1, 64),
    "serve.timeoutSeconds": (10, 86400),
    "serve.maxModelLength": (16, 1_048_576),
}
# Context lengths of the models the workload builds itself (tpuft_workload.tiny), so
# spec.serve.maxModelLength is checked offline too; a test ties them to the workload's configs.
BUILTIN_MODEL_MAX_POSITIONS = {"builtin:tiny-llama": 4096}
LEARNING_RATE_MAX = 1.0


def either(words: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c": a closed set in messages and the CRD's descriptions."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


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
class Dataset:
    name: str
    split: str
    format: str | None = None   # constants.DatasetFormat value; None: the suffix (or a hub name) says
    type: str | None = None     # constants.DatasetType value; None: the columns say
    columns: tuple[tuple[str, str], ...] = ()   # (key a record type reads, the dataset's column), sorted
    overlong: str = "truncate"  # constants.Overlong value


@dataclass(frozen=True)
class Training:
    epochs: int
    batch_size_per_device: int
    max_seq_length: int
    learning_rate: float
    packing: bool
    report_every_steps: int
    max_failures: int       # Ray Train FailureConfig: worker restarts inside one job
    max_job_retries: int    # operator resubmissions of a failed training RayJob (preemption)
    framework: str = DEFAULTS["training.framework"]   # constants.TrainingFramework value
    method: str = DEFAULTS["training.method"]          # constants.TrainingMethod value
    lora: Lora | None = None                           # set exactly when method is lora


@dataclass(frozen=True)
class Lora:
    """spec.training.lora: the adapters PEFT adds beside each targeted linear layer."""
    rank: int
    alpha: int
    dropout: float
    # Module names (the last part of a path, as PEFT matches them); empty: the default for the
    # model's model_type (constants.LORA_DEFAULT_TARGET_MODULES), resolved by the workload's driver.
    target_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Export:
    """spec.export: what the run writes besides its checkpoints."""
    merge: bool = DEFAULTS["export.merge"]   # LoRA: also merged full weights beside the adapter


@dataclass(frozen=True)
class Checkpoint:
    storage_path: str
    every_steps: int        # 0: at the end of each epoch only
    keep: int
    # An earlier run's checkpoint (or run directory) to continue from on purpose; a run's own
    # directory is keyed by the object's UID, so nothing else is ever resumed implicitly.
    resume_from: str | None = None
    # A Kubernetes volume source ({kind: fields}) mounted at storage_path in every Ray pod:
    # the shared filesystem (Filestore PVC, GCS FUSE CSI, NFS, a node's hostPath) that Ray
    # Train needs when storage_path is a path rather than gs:// or s3://.
    volume: dict | None = None


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class Recovery:
    # A host lost while verifying or training: the slice is replaced (KubeRay recreates the lost
    # pods), verified again and training resumes from its checkpoint, at most this many times.
    max_slice_replacements: int


@dataclass(frozen=True)
class Verification:
    enabled: bool
    timeout_seconds: int


@dataclass(frozen=True)
class Resources:
    """User overrides for container resources; google.com/tpu is never overridable."""
    head: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    worker: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    shm_size: str | None = None


@dataclass(frozen=True)
class Scheduling:
    spot: bool = False
    reservation: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None


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


@dataclass(frozen=True)
class Spec:
    slice: catalog.SliceShape
    slices: int
    image: str
    image_pull_policy: str | None
    model: str
    dataset: Dataset
    training: Training
    checkpoint: Checkpoint
    hf_token_secret: SecretKeyRef | None
    verification: Verification
    recovery: Recovery
    provisioning_timeout_seconds: int
    suspend: bool
    ttl_seconds_after_finished: int
    resources: Resources
    scheduling: Scheduling
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    env: tuple[Mapping[str, Any], ...]
    serve: Serve | None = None   # None: spec.serve absent or not enabled
    export: Export = Export()
    queue_timeout_seconds: int | None = None   # None: wait for Kueue's admission as long as it takes

    @property
    def accelerator(self) -> str:
        return self.slice.generation

    @property
    def num_workers(self) -> int:
        """Training workers: one per logical device across all slices."""
        return self.slice.devices * self.slices


@dataclass(frozen=True)
class TPUFinetune:
    meta: ObjectMeta
    spec: Spec


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
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, f"must be an object (got {type(value).__name__})")
            return {}
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

    def boolean(self, obj: Mapping, key: str, path: str, dkey: str) -> bool:
        value = obj.get(key, DEFAULTS[dkey])
        if not isinstance(value, bool):
            self.fail(path, f"must be true or false (got {value!r})")
            return bool(DEFAULTS[dkey])
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
    slices = r.integer(spec, "slices", "spec.slices", "slices")
    image, pull, model = _image_and_model(r, spec)
    dataset = _dataset(r, spec)
    training = _training(r, spec)
    checkpoint = _checkpoint(r, spec)
    export = _export(r, spec, training)
    hf = _secret_ref(r, spec, "hfTokenSecret", "spec.hfTokenSecret")
    verification = _verification(r, spec)
    recovery = _recovery(r, spec)
    resources = _resources(r, spec)
    scheduling = _scheduling(r, spec)
    env = _env(r, spec)
    serve = _serve(r, spec, slice_shape, image, pull, model)
    provisioning_timeout = r.integer(spec, "provisioningTimeoutSeconds", "spec.provisioningTimeoutSeconds",
                                     "provisioningTimeoutSeconds")
    queue_timeout = None
    if spec.get("queueTimeoutSeconds") is not None:
        queue_timeout = r.integer(spec, "queueTimeoutSeconds", "spec.queueTimeoutSeconds", "queueTimeoutSeconds")
    suspend = r.boolean(spec, "suspend", "spec.suspend", "suspend")
    ttl = r.integer(spec, "ttlSecondsAfterFinished", "spec.ttlSecondsAfterFinished", "ttlSecondsAfterFinished")
    labels = r.str_map(spec, "labels", "spec.labels", QUALIFIED_NAME, LABEL_VALUE, RESERVED_LABELS)
    annotations = r.str_map(spec, "annotations", "spec.annotations", QUALIFIED_NAME, reserved=RESERVED_ANNOTATIONS)
    if r.problems or slice_shape is None:
        raise SpecError(r.problems or [Problem("spec", "is invalid")], where)
    return TPUFinetune(meta=meta, spec=Spec(
        slice=slice_shape, slices=slices, image=image or "", image_pull_policy=pull, model=model or "",
        dataset=dataset, training=training, checkpoint=checkpoint, hf_token_secret=hf, verification=verification,
        recovery=recovery,
        provisioning_timeout_seconds=provisioning_timeout, suspend=suspend, ttl_seconds_after_finished=ttl,
        resources=resources, scheduling=scheduling, labels=labels, annotations=annotations, env=env, serve=serve,
        export=export, queue_timeout_seconds=queue_timeout))


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


def _image_and_model(r: _Reader, spec: Mapping) -> tuple[str | None, str | None, str | None]:
    """(image, imagePullPolicy, model)."""
    image = r.string(spec, "image", "spec.image", required=True)
    if image and UNSAFE.search(image):
        r.fail("spec.image", f"{image!r} is not an image reference (no spaces or shell characters)")
    pull = r.string(spec, "imagePullPolicy", "spec.imagePullPolicy")
    policies = [p.value for p in ImagePullPolicy]
    if pull is not None and pull not in policies:
        r.fail("spec.imagePullPolicy", f"must be {either(policies)} (got {pull!r})")
    model = r.string(spec, "model", "spec.model", required=True)
    if model and UNSAFE.search(model):
        r.fail("spec.model", f"{model!r} must be a model id, local path or URI without spaces or shell characters")
    return image, pull, model


def _dataset(r: _Reader, spec: Mapping) -> Dataset:
    ds = r.section(spec, "dataset", "spec.dataset", required=True)
    name = r.string(ds, "name", "spec.dataset.name", required=True)
    split = r.string(ds, "split", "spec.dataset.split", default=DEFAULTS["dataset.split"], max_len=MAX_SPLIT_LENGTH)
    for p, v in (("spec.dataset.name", name), ("spec.dataset.split", split)):
        if v and UNSAFE.search(v):
            r.fail(p, f"{v!r} must not contain spaces or shell characters")
    fmt = r.string(ds, "format", "spec.dataset.format")
    formats = [f.value for f in DatasetFormat]
    if fmt is not None and fmt not in formats:
        r.fail("spec.dataset.format", f"must be one of {', '.join(formats)} (got {fmt!r}); leave it out when the "
               "file name ends in .jsonl, .json or .parquet, or for a Hugging Face dataset id")
        fmt = None
    kind = _choice(r, ds, "type", "spec.dataset.type", [t.value for t in DatasetType],
                   "leave it out to have the columns say")
    overlong = _choice(r, ds, "overlong", "spec.dataset.overlong", [o.value for o in Overlong], "",
                       DEFAULTS["dataset.overlong"])
    columns = r.str_map(ds, "columns", "spec.dataset.columns")
    for key, column in columns.items():
        if key not in DATASET_COLUMN_KEYS:
            r.fail(f"spec.dataset.columns.{key}", f"is not a key a record type reads; the keys are "
                   f"{', '.join(DATASET_COLUMN_KEYS)}")
        elif not COLUMN_NAME.fullmatch(column):
            r.fail(f"spec.dataset.columns.{key}", f"{column!r} is not a column name ({COLUMN_NAME_WORDS})")
    return Dataset(name or "", split or DEFAULTS["dataset.split"], fmt, kind,
                   tuple(sorted(columns.items())), overlong or DEFAULTS["dataset.overlong"])


def _choice(r: _Reader, obj: Mapping, key: str, path: str, allowed: list[str], hint: str,
            default: str | None = None) -> str | None:
    value = r.string(obj, key, path, default=default)
    if value is not None and value not in allowed:
        r.fail(path, f"must be one of {', '.join(allowed)} (got {value!r})" + (f"; {hint}" if hint else ""))
        return default
    return value


def _training(r: _Reader, spec: Mapping) -> Training:
    tr = r.section(spec, "training", "spec.training")
    lr = tr.get("learningRate", DEFAULTS["training.learningRate"])
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < LEARNING_RATE_MAX:
        r.fail("spec.training.learningRate", f"must be a number in (0, {LEARNING_RATE_MAX}) (got {lr!r})")
        lr = DEFAULTS["training.learningRate"]

    def integer(key: str) -> int:
        return r.integer(tr, key, f"spec.training.{key}", f"training.{key}")

    return Training(
        epochs=integer("epochs"),
        batch_size_per_device=integer("batchSizePerDevice"),
        max_seq_length=integer("maxSeqLength"),
        learning_rate=float(lr),
        packing=r.boolean(tr, "packing", "spec.training.packing", "training.packing"),
        report_every_steps=integer("reportEverySteps"),
        max_failures=integer("maxFailures"),
        max_job_retries=integer("maxJobRetries"),
        framework=(framework := _framework(r, tr)),
        method=(method := _method(r, tr, framework)),
        lora=_lora(r, tr, method),
    )


def _framework(r: _Reader, tr: Mapping) -> str:
    fw = r.string(tr, "framework", "spec.training.framework", default=DEFAULTS["training.framework"])
    names = [f.value for f in TrainingFramework]
    if fw is not None and fw not in names:
        r.fail("spec.training.framework", f"must be one of {', '.join(names)} (got {fw!r})")
    return fw if fw in names else DEFAULTS["training.framework"]


def _method(r: _Reader, tr: Mapping, framework: str) -> str:
    method = r.string(tr, "method", "spec.training.method", default=DEFAULTS["training.method"])
    names = [m.value for m in TrainingMethod]
    if method is not None and method not in names:
        r.fail("spec.training.method", f"must be one of {', '.join(names)} (got {method!r})")
        return DEFAULTS["training.method"]
    if method == TrainingMethod.LORA.value and framework != TrainingFramework.TORCH.value:
        r.fail("spec.training.method", f"lora runs on framework torch only (got framework {framework}): JAX LoRA is "
               "not implemented; set spec.training.framework: torch, or method: full")
    return method or DEFAULTS["training.method"]


LORA_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LORA_MAX_TARGET_MODULES = 32


def _lora(r: _Reader, tr: Mapping, method: str) -> Lora | None:
    """spec.training.lora: read only with method lora (and refused without it, not ignored)."""
    if method != TrainingMethod.LORA.value:
        if tr.get("lora") is not None:
            r.fail("spec.training.lora", f"is set but spec.training.method is {method}: set method: lora, or remove it")
        return None
    lo = r.section(tr, "lora", "spec.training.lora")
    rank = r.integer(lo, "rank", "spec.training.lora.rank", "training.lora.rank")
    if rank > 0 and rank & (rank - 1):
        r.fail("spec.training.lora.rank", f"must be a power of two (1, 2, 4, ... 1024; got {rank})")
    dropout = lo.get("dropout", LORA_DEFAULTS["training.lora.dropout"])
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        r.fail("spec.training.lora.dropout", f"must be a number in [0, 1) (got {dropout!r})")
        dropout = LORA_DEFAULTS["training.lora.dropout"]
    return Lora(rank=rank, alpha=r.integer(lo, "alpha", "spec.training.lora.alpha", "training.lora.alpha"),
                dropout=float(dropout), target_modules=_target_modules(r, lo))


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
    ex = r.section(spec, "export", "spec.export")
    merge = r.boolean(ex, "merge", "spec.export.merge", "export.merge")
    if merge and training.method != TrainingMethod.LORA.value:
        r.fail("spec.export.merge", f"merges LoRA adapters into the base; a {training.method} fine-tune already "
               "exports full weights: remove it, or set spec.training.method: lora")
    return Export(merge=merge)


def _checkpoint(r: _Reader, spec: Mapping) -> Checkpoint:
    ck = r.section(spec, "checkpoint", "spec.checkpoint", required=True)
    storage = r.string(ck, "storagePath", "spec.checkpoint.storagePath", required=True, max_len=MAX_PATH_LENGTH)
    if storage and not STORAGE_PATH.fullmatch(storage):
        r.fail("spec.checkpoint.storagePath",
               f"{storage!r} must be gs://BUCKET/PATH, s3://BUCKET/PATH or an absolute path on a mounted volume")
    resume_from = r.string(ck, "resumeFrom", "spec.checkpoint.resumeFrom", max_len=MAX_PATH_LENGTH)
    if resume_from is not None and not STORAGE_PATH.fullmatch(resume_from):
        r.fail("spec.checkpoint.resumeFrom",
               f"{resume_from!r} must be gs://BUCKET/PATH, s3://BUCKET/PATH or an absolute path on a mounted volume "
               "(a checkpoint_step_* directory or a run directory of an earlier TPUFinetune)")
    return Checkpoint(
        storage_path=storage or "",
        every_steps=r.integer(ck, "everySteps", "spec.checkpoint.everySteps", "checkpoint.everySteps"),
        keep=r.integer(ck, "keep", "spec.checkpoint.keep", "checkpoint.keep"),
        resume_from=resume_from,
        volume=_checkpoint_volume(r, ck, storage),
    )


def _secret_ref(r: _Reader, obj: Mapping, field_name: str, path: str,
                default_key: str | None = None) -> SecretKeyRef | None:
    """A {name, key} Secret reference (spec.hfTokenSecret, spec.serve.apiKeySecret); the key is
    required unless it has a default. A default is the parser's, not the CRD's: the API server
    defaults nothing inside an optional object, and DEFAULTS lists only what it does default."""
    if obj.get(field_name) is None:
        return None
    hs = r.section(obj, field_name, path)
    name = r.string(hs, "name", f"{path}.name", required=True, max_len=MAX_DNS_SUBDOMAIN_LENGTH)
    key = r.string(hs, "key", f"{path}.key", required=default_key is None, max_len=MAX_DNS_SUBDOMAIN_LENGTH)
    if key is None:   # left out or null: the default (a wrong type is already a problem)
        key = default_key
    if name and not DNS_SUBDOMAIN.fullmatch(name):
        r.fail(f"{path}.name", f"{name!r} is not a Secret name (lowercase DNS subdomain)")
        name = None
    if key is not None and not CONFIG_KEY.fullmatch(key):
        r.fail(f"{path}.key", f"{key!r} is not a Secret key (letters, digits, '-', '_', '.')")
        key = None
    return SecretKeyRef(name, key) if name and key else None


def _recovery(r: _Reader, spec: Mapping) -> Recovery:
    rec = r.section(spec, "recovery", "spec.recovery")
    return Recovery(max_slice_replacements=r.integer(rec, "maxSliceReplacements", "spec.recovery.maxSliceReplacements",
                                                     "recovery.maxSliceReplacements"))


def _verification(r: _Reader, spec: Mapping) -> Verification:
    ve = r.section(spec, "verification", "spec.verification")
    return Verification(
        enabled=r.boolean(ve, "enabled", "spec.verification.enabled", "verification.enabled"),
        timeout_seconds=r.integer(ve, "timeoutSeconds", "spec.verification.timeoutSeconds",
                                  "verification.timeoutSeconds"),
    )


def _resources(r: _Reader, spec: Mapping, path: str = "spec.resources") -> Resources:
    res = r.section(spec, "resources", path)
    shm = r.string(res, "shmSize", f"{path}.shmSize", max_len=MAX_QUANTITY_LENGTH)
    if shm and not QUANTITY.fullmatch(shm):
        r.fail(f"{path}.shmSize", f"{shm!r} is not a Kubernetes quantity (e.g. 100Gi)")
    return Resources(
        head=_resource_block(r, res, "head", f"{path}.head"),
        worker=_resource_block(r, res, "worker", f"{path}.worker"),
        shm_size=shm,
    )


def _serve(r: _Reader, spec: Mapping, training: catalog.SliceShape | None, image: str | None,
           pull: str | None, model: str | None) -> Serve | None:
    """spec.serve: validated whenever present (a disabled section still has to be right), kept only
    when enabled. The serve slice defaults to the training one and goes through the same catalog."""
    if spec.get("serve") is None:
        return None
    sv = r.section(spec, "serve", "spec.serve")
    enabled = r.boolean(sv, "enabled", "spec.serve.enabled", "serve.enabled")
    shape = training
    if sv.get("accelerator") is not None or sv.get("topology") is not None:
        try:
            shape = catalog.resolve_slice(sv.get("accelerator", spec.get("accelerator")),
                                          sv.get("topology", spec.get("topology")),
                                          "spec.serve.accelerator", "spec.serve.topology")
        except catalog.CatalogError as e:
            r.fail(e.field, e.message)
            shape = None
    engines = [e.value for e in ServeEngine]
    engine_raw = r.string(sv, "engine", "spec.serve.engine")
    if engine_raw is not None and engine_raw not in engines:
        r.fail("spec.serve.engine", f"must be one of {', '.join(engines)} (got {engine_raw!r})")
        engine_raw = None
    engine = ServeEngine(engine_raw) if engine_raw else (
        ServeEngine.VLLM if shape is not None and shape.is_tpu else ServeEngine.TRANSFORMERS)
    serve_image = r.string(sv, "image", "spec.serve.image")
    if serve_image and UNSAFE.search(serve_image):
        r.fail("spec.serve.image", f"{serve_image!r} is not an image reference (no spaces or shell characters)")
    if enabled and engine == ServeEngine.VLLM and not serve_image:
        r.fail("spec.serve.image", "is required with engine vllm: the training image has no vLLM (use a vLLM TPU "
               "image, or engine transformers to serve with the training image)")
    max_len = _serve_max_length(r, sv, model)
    replicas = _serve_replicas(r, sv)
    timeout = r.integer(sv, "timeoutSeconds", "spec.serve.timeoutSeconds", "serve.timeoutSeconds")
    resources = _resources(r, sv, "spec.serve.resources")
    api_key = _secret_ref(r, sv, "apiKeySecret", "spec.serve.apiKeySecret", SERVE_API_KEY_SECRET_KEY)
    if not enabled or shape is None:
        return None
    return Serve(slice=shape, replicas=replicas, engine=engine, image=serve_image or image or "",
                 image_pull_policy=pull if not serve_image else None, max_model_length=max_len,
                 timeout_seconds=timeout, resources=resources, api_key_secret=api_key)


def _serve_replicas(r: _Reader, sv: Mapping) -> ServeReplicas:
    """A number n is {min: n, max: n}; the object form needs both bounds, min <= max."""
    path, value = "spec.serve.replicas", sv.get("replicas", DEFAULTS["serve.replicas"])
    if not isinstance(value, Mapping):
        n = r.integer(sv, "replicas", path, "serve.replicas")
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


def _serve_max_length(r: _Reader, sv: Mapping, model: str | None) -> int | None:
    value = sv.get("maxModelLength")
    if value is None:
        return None
    lo, hi = LIMITS["serve.maxModelLength"]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        r.fail("spec.serve.maxModelLength", f"must be an integer between {int(lo)} and {int(hi)} (got {value!r})")
        return None
    known = BUILTIN_MODEL_MAX_POSITIONS.get(model or "")
    if known is not None and value > known:
        r.fail("spec.serve.maxModelLength", f"{value} is longer than {model}'s context ({known} positions)")
    return value


def _scheduling(r: _Reader, spec: Mapping) -> Scheduling:
    sc = r.section(spec, "scheduling", "spec.scheduling")
    spot = sc.get("spot", False)
    if not isinstance(spot, bool):
        r.fail("spec.scheduling.spot", f"must be true or false (got {spot!r})")
        spot = False
    reservation = r.string(sc, "reservation", "spec.scheduling.reservation", max_len=MAX_LABEL_LENGTH)
    if reservation and not LABEL_VALUE.fullmatch(reservation):  # it becomes a node selector value
        r.fail("spec.scheduling.reservation", f"{reservation!r} is not a GKE reservation name")
    if spot and reservation is not None:  # as the CRD's rule: has(reservation), even when empty
        r.fail("spec.scheduling", "spot and reservation are mutually exclusive: pick one capacity type")
    tolerations = sc.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        r.fail("spec.scheduling.tolerations", "must be a list of Kubernetes tolerations")
        tolerations = []
    for i, t in enumerate(tolerations):
        for k, allowed in (("operator", TOLERATION_OPERATORS), ("effect", TOLERATION_EFFECTS)):
            if t.get(k) is not None and t.get(k) not in allowed:
                r.fail(f"spec.scheduling.tolerations[{i}].{k}", f"must be one of {', '.join(allowed)} (got {t.get(k)!r})")
    node_selector = r.str_map(sc, "nodeSelector", "spec.scheduling.nodeSelector", QUALIFIED_NAME, LABEL_VALUE)
    priority = r.string(sc, "priorityClassName", "spec.scheduling.priorityClassName", max_len=MAX_DNS_SUBDOMAIN_LENGTH)
    if priority and not DNS_SUBDOMAIN.fullmatch(priority):
        r.fail("spec.scheduling.priorityClassName", f"{priority!r} is not a PriorityClass name")
    return Scheduling(spot=spot, reservation=reservation, node_selector=node_selector,
                      tolerations=tuple(dict(t) for t in tolerations), priority_class_name=priority)


def _env(r: _Reader, spec: Mapping) -> tuple[Mapping[str, Any], ...]:
    env = spec.get("env") or []
    if not isinstance(env, list):
        r.fail("spec.env", "must be a list of {name, value} or {name, valueFrom}")
        return ()
    for i, item in enumerate(env):
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not ENV_NAME.fullmatch(item["name"]):
            r.fail(f"spec.env[{i}].name", "must be a valid environment variable name")
        elif item["name"] in dict(RESERVED_ENV):
            r.fail(f"spec.env[{i}].name", f"{item['name']} is reserved: {dict(RESERVED_ENV)[item['name']]}; remove it")
        elif "value" in item and "valueFrom" in item:
            r.fail(f"spec.env[{i}]", "set value or valueFrom, not both")
        elif "value" in item and not isinstance(item["value"], str):
            r.fail(f"spec.env[{i}].value", f"must be a string (got {type(item['value']).__name__}); quote numbers")
        elif "valueFrom" in item and (not isinstance(item["valueFrom"], Mapping) or len(item["valueFrom"]) != 1
                                      or next(iter(item["valueFrom"])) not in ENV_SOURCES):
            r.fail(f"spec.env[{i}].valueFrom", f"must hold exactly one of {', '.join(ENV_SOURCES)}")
    # Items that failed a check above never reach a Spec (parse raises), so dict() is safe here.
    return tuple(dict(e) for e in env if isinstance(e, Mapping))
