"""Objects and tables more than one test module builds on (test modules import these from here,
never from each other)."""
from __future__ import annotations

import copy
import dataclasses
import uuid

import yaml

from tpuft.controller import observed
from tpuft.api.constants import API_VERSION, KIND
from tpuft.controller.diagnosis import PodObs
from tpuft.controller.reconciler import Reconciler, Snapshot
from tpuft.controller.settings import Settings
from tpuft.api import spec as speclib
from tpuft.api.spec import DEFAULTS

# The minimum spec, as written.
MINIMUM = yaml.safe_load("""
apiVersion: tpufinetune.dev/v1alpha1
kind: TPUFinetune
metadata: {name: gemma4-dolly}
spec:
  accelerator: v6e
  topology: "4x4"
  slices: 1
  image: REGISTRY/ray-torchtpu:latest
  model: google/gemma-4-E2B-it
  dataset: {name: databricks/databricks-dolly-15k, split: "train[:1024]"}
  training: {epochs: 3, batchSizePerDevice: 4, maxSeqLength: 512, learningRate: 2.0e-5}
  checkpoint: {storagePath: "gs://my-bucket/ray_train_torchtpu"}
  hfTokenSecret: {name: hf-secret, key: hf_api_token}
  verification: {enabled: true, timeoutSeconds: 600}
  provisioningTimeoutSeconds: 1800
""")

DELETE = object()


def small_spec(**overrides) -> dict:
    """The smallest spec the operator accepts: a v6e 4x4 slice, a model, a dataset and a storage path
    (the rest defaulted), with `overrides` on top."""
    return {"accelerator": "v6e", "topology": "4x4", "image": "img:1", "model": "m", "dataset": {"name": "d"},
            "checkpoint": {"storagePath": "gs://bucket/ck"}, **overrides}


def small_object(name: str, namespace: str, metadata: dict | None = None, **spec) -> dict:
    """A TPUFinetune of `small_spec(**spec)`; `metadata` adds to its name and namespace."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, **(metadata or {})}, "spec": small_spec(**spec)}


def with_(path: str, value, base=MINIMUM):
    """A copy of base with the dotted path set (value DELETE removes it)."""
    doc = copy.deepcopy(base)
    keys = path.split(".")
    node = doc
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return doc


# Misspelt fields: (id, dotted path of the parent, the wrong key, its value, the name to suggest).
# The API server refuses each one under strict field validation (kubectl's default);
# `tpuft validate` must too, naming the same path.
UNKNOWN_FIELDS = [
    ("spec-trainng", "spec", "trainng", {"epochs": 1}, "training"),
    ("training-epoch", "spec.training", "epoch", 3, "epochs"),
    ("checkpoint-storagepath", "spec.checkpoint", "storagepath", "/ckpt", "storagePath"),
    ("verification-timeoutSecond", "spec.verification", "timeoutSecond", 60, "timeoutSeconds"),
    ("dataset-splits", "spec.dataset", "splits", "train", "split"),
    ("hfTokenSecret-keys", "spec.hfTokenSecret", "keys", "k", "key"),
    ("apiKeySecret-nmae", "spec.serve.apiKeySecret", "nmae", "k", "name"),
    ("resources-head-request", "spec.resources.head", "request", {"cpu": "1"}, "requests"),
    ("resources-shmsize", "spec.resources", "shmsize", "1Gi", "shmSize"),
    ("scheduling-nodeselector", "spec.scheduling", "nodeselector", {"a": "b"}, "nodeSelector"),
    ("spec-suspended", "spec", "suspended", True, "suspend"),
    ("spec-ttl", "spec", "ttlSecondAfterFinished", 1, "ttlSecondsAfterFinished"),
    ("metadata-labells", "metadata", "labells", {"a": "b"}, "labels"),
]


def with_unknown(parent: str, key: str, value, base=MINIMUM) -> dict:
    """A copy of base with `key` added under the dotted `parent` (created when missing)."""
    doc = copy.deepcopy(base)
    node = doc
    for k in parent.split("."):
        node = node.setdefault(k, {})
    node[key] = value
    return doc


# --- a fake API for tpuft.controller.reconciler (tests/unit/test_reconciler.py; the fault tests' pinned bug) ---------
NS, NAME = "team-a", "ft"


def tft() -> dict:
    return small_object(NAME, NS, {"uid": "u-1", "generation": 1})


class FakeKube:
    def __init__(self, obj: dict | None):
        self.objects: dict[tuple[str, str], dict] = {}
        if obj is not None:
            self.objects[("TPUFinetune", NAME)] = obj
        self.log: list[tuple] = []
        self.fail: dict[tuple[str, str], Exception] = {}
        self.pods: list[dict] = []   # pod objects as the API server returns them (any cluster)
        self.pools: tuple | None = None   # what node_pools() answers (None: may not list nodes)

    def get(self, kind, ns, name):
        self.log.append(("get", kind, name))
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj else None

    def perform(self, ns, uid, action):
        self.log.append((action.op, action.kind, action.name))
        err = self.fail.get((action.kind, action.name))
        if err:
            raise err
        if action.op == observed.Op.CREATE:
            self.objects[(action.kind, action.name)] = copy.deepcopy(dict(action.body))
        return "created"

    def patch_status(self, ns, name, patch):
        self.log.append(("patch_status", tuple(sorted(patch))))
        merge_patch(self.objects[("TPUFinetune", NAME)].setdefault("status", {}), patch)   # as the API server does
        return True

    def post_event(self, obj, event):
        self.log.append(("event", event.type, event.reason))

    def slice_pods(self, ns, cluster):
        self.log.append(("slice_pods", cluster))
        return tuple(PodObs.of(p) for p in self.pods
                     if p["metadata"].get("labels", {}).get("ray.io/cluster") == cluster)

    def node_pools(self):
        self.log.append(("node_pools",))
        return self.pools

    def ops(self, *kinds):
        return [x for x in self.log if x[0] in kinds]


TEST_SETTINGS = Settings(verify_grace_seconds=1)


def reconciler(kube, **settings) -> Reconciler:
    return Reconciler(kube, dataclasses.replace(TEST_SETTINGS, **settings))


def kids(clusters=(), jobs=(), services=()) -> dict:
    """Children of each kind, as Reconciler.observe takes them."""
    return {"RayCluster": list(clusters), "RayJob": list(jobs), "RayService": list(services)}


def snap(body: dict | None, clusters=(), jobs=(), services=()) -> Snapshot:
    """What the indexes hold for NS/NAME: the body and its children of each kind."""
    return Snapshot(body, kids(clusters, jobs, services))


def indexed(kube) -> dict:
    """What the index holds once it has caught up with the API server."""
    return copy.deepcopy(kube.objects[("TPUFinetune", NAME)])


# --- a whole lifecycle without an API server ---------------------------------------------------------------
PLURAL_KINDS = {"rayclusters": "RayCluster", "rayjobs": "RayJob"}


def merge_patch(target: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch, in place: what the API server does with a merge-patch body."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge_patch(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target


class FakeCluster(FakeKube):
    """FakeKube that keeps children the way the API server would (uid, generation, deletes,
    suspend patches) and plays kopf's index (caught up) for Reconciler.reconcile. Its `custom`
    answers tests/kuberay_standin.py's calls, so the stand-in writes KubeRay's status here."""

    def __init__(self):
        super().__init__(None)
        self.events: list[dict] = []
        self.custom = _FakeCustomObjects(self)

    def _new(self, body: dict) -> dict:
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        meta.update(uid=str(uuid.uuid4()), generation=1, namespace=NS)
        return obj

    def perform(self, ns, uid, action):
        self.log.append((action.op, action.kind, action.name))
        err = self.fail.get((action.kind, action.name))
        if err:
            raise err
        key = (action.kind, action.name)
        if action.op == observed.Op.CREATE:
            if key in self.objects:
                return "adopted"
            self.objects[key] = self._new(action.body)
            return "created"
        if action.op == observed.Op.DELETE:
            self.objects.pop(key, None)
            return "deleted"
        obj = self.objects.get(key)
        if obj is not None:   # suspend / resume: a spec change, so a new generation
            obj["spec"]["suspend"] = action.op == observed.Op.SUSPEND
            obj["metadata"]["generation"] += 1
        return action.op.value

    def post_event(self, obj, event):
        super().post_event(obj, event)
        self.events.append({"type": event.type.value, "reason": event.reason.value, "message": event.message})

    def index(self) -> Snapshot:
        """What kopf's indexes hold once caught up: the TPUFinetune and its labelled children."""
        def kids(kind):
            return [observed.IndexedChild.of(o["metadata"]["name"], o.get("spec"), o.get("status"), o["metadata"])
                    for (k, _), o in sorted(self.objects.items()) if k == kind
                    and (o["metadata"].get("labels") or {}).get("tpufinetune.dev/name") == NAME]
        body = self.objects.get(("TPUFinetune", NAME))
        return snap(copy.deepcopy(body), kids("RayCluster"), kids("RayJob"))


class _FakeCustomObjects:
    """The two CustomObjectsApi calls tests/kuberay_standin.py makes."""

    def __init__(self, cluster: FakeCluster):
        self.cluster = cluster

    def get_namespaced_custom_object(self, group, version, ns, plural, name):
        return copy.deepcopy(self.cluster.objects[(PLURAL_KINDS[plural], name)])

    def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body):
        merge_patch(self.cluster.objects[(PLURAL_KINDS[plural], name)], {"status": body["status"]})


class Lifecycle:
    """One TPUFinetune driven by tpuft.controller.reconciler against a FakeCluster, with KubeRay's part
    played by tests/kuberay_standin.py: the integration tests' vocabulary (apply, wait, children,
    events), for rules that need no API server."""

    def __init__(self, settings: Settings = TEST_SETTINGS):
        from tests.kuberay_standin import KubeRay

        self.kube = FakeCluster()
        self.ctl = Reconciler(self.kube, settings)
        self.kuberay = KubeRay.__new__(KubeRay)
        self.kuberay.api, self.kuberay.ns = self.kube.custom, NS

    def body(self, **spec) -> dict:
        return small_object(NAME, NS, **spec)

    def apply(self, **spec) -> None:
        """Create it, defaulted as the API server defaults it (every spec.DEFAULTS key: the CRD's
        defaults, checked against the real server in tests/integration/test_crd.py)."""
        obj = self.kube._new(self.body(**spec))
        for dotted, value in DEFAULTS.items():
            *parents, leaf = dotted.split(".")
            node = obj["spec"]
            for k in parents:
                node = node.setdefault(k, {})
            node.setdefault(leaf, value)
        self.kube.objects[("TPUFinetune", NAME)] = obj

    def patch(self, spec: dict) -> None:
        obj = self.kube.objects[("TPUFinetune", NAME)]
        merge_patch(obj["spec"], spec)
        obj["metadata"]["generation"] += 1

    def get(self) -> dict:
        return copy.deepcopy(self.kube.objects[("TPUFinetune", NAME)])

    def status(self) -> dict:
        return self.get().get("status") or {}

    def reconcile(self, times: int = 1) -> None:
        for _ in range(times):
            self.ctl.reconcile((NS, NAME), self.kube.index())

    def wait(self, phase: str, reconciles: int = 10) -> dict:
        for _ in range(reconciles):
            self.reconcile()
            if self.status().get("phase") == phase:
                return self.status()
        raise AssertionError(f"phase {phase} not reached after {reconciles} reconciles; status: {self.status()}")

    def wait_until(self, check, what: str, reconciles: int = 10):
        for _ in range(reconciles):
            self.reconcile()
            if value := check():
                return value
        raise AssertionError(f"{what} not seen after {reconciles} reconciles; status: {self.status()}")

    def delete(self, kind: str, name: str) -> None:
        del self.kube.objects[(kind, name)]

    def children(self, plural: str) -> list[str]:
        kind = PLURAL_KINDS[plural]
        return sorted(n for (k, n), o in self.kube.objects.items() if k == kind
                      and (o["metadata"].get("labels") or {}).get("tpufinetune.dev/name") == NAME)

    def events(self) -> list[dict]:
        return list(self.kube.events)


def tensorboard_scalars(logdir) -> tuple[int, dict[str, list[tuple[int, float]]]]:
    """(event files, tag -> [(step, value)]) under `logdir` as TensorBoard shows them: files in name
    (creation time) order, a file's SessionLog START at step S hiding what earlier files logged at S
    or later (tensorboardX's purge_step). Reads the TFRecord framing itself: the `tensorboard`
    package, which has a reader, is not a dependency."""
    import struct
    from pathlib import Path

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    files = sorted(Path(logdir).glob("events.out.tfevents.*"))
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4   # length, its crc, the record, its crc
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return len(files), scalars


def assert_export_generates(export) -> None:
    """A training run's export folder loads and generates real words (not only special tokens) for a
    question rendered by its exported chat template: with transformers' Auto classes, or (a LoRA run's adapter folder)
    with peft's PeftModel on the base its adapter_config.json names."""
    import json
    import os
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuft_workload import chat_api

    files = set(os.listdir(export))
    if "adapter_config.json" in files:
        from peft import PeftModel

        assert {"adapter_model.safetensors", "tokenizer.json"} <= files
        base = json.loads((Path(export) / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export)
    else:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
        model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    prompt = chat_api.prompt_ids(tok, [chat_api.Message(role="user", content="Tell me about the cow.")])
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    new = out[0, len(prompt):]
    assert len(new) > 0
    assert tok.decode(new, skip_special_tokens=True).strip()


def tiny_batch(tok, rows: int = 2) -> dict:
    """A packed batch of the built-in data (64 tokens a row) for one in-process step."""
    from tests.workload.inprocess_data import build_blocks, collate, load_records

    blocks = build_blocks(tok, load_records("builtin:dolly-mini", "train[:16]"), 64, packing=True)
    return collate(blocks, list(range(rows)))


# tests/workload's tiny training run: the built-in model and data on 2 CPU workers; train[:120] packs
# into 58 rows of 128 tokens (13 examples truncated, 11 dropped: their prompt alone fills a row), 7 steps
# of 2 workers x 4 rows an epoch (both frameworks).
TINY_EPOCHS, TINY_STEPS_PER_EPOCH, TINY_CKPT_EVERY = 2, 7, 3


# tiny_train_argv's flags of a LoRA run (spec.training.method: lora): rank 8 on every default target,
# a learning rate LoRA's few parameters need to move the loss within the tiny run's 14 steps.
TINY_LORA_FLAGS = {"method": "lora", "lora_rank": 8, "lora_alpha": 16, "learning_rate": 2e-2}


def tiny_train_argv(framework: str, storage, run_name: str, **flags) -> list[str]:
    """`python -m tpuft_workload train`'s arguments for the tiny run (reports only with checkpoints);
    `flags` add or override (resume_from=x: --resume-from x; merge_export=True: --merge-export;
    a list: a comma list, lora_target_modules=["q_proj", "v_proj"])."""
    argv = ["train", "--framework", framework, "--accelerator", "cpu", "--topology", "2",
            "--model", "builtin:tiny-llama", "--dataset", "builtin:dolly-mini", "--dataset-split", "train[:120]",
            "--epochs", str(TINY_EPOCHS), "--batch-size-per-device", "4", "--max-seq-length", "128",
            "--learning-rate", "3e-3", "--storage-path", str(storage), "--run-name", run_name,
            "--report-every-steps", "100", "--checkpoint-every-steps", str(TINY_CKPT_EVERY),
            "--keep-checkpoints", "20", "--max-failures", "1"]
    for k, v in flags.items():
        flag = f"--{k.replace('_', '-')}"
        if isinstance(v, bool):   # a switch
            argv += [flag] if v else []
        else:
            argv += [flag, ",".join(v) if isinstance(v, (list, tuple)) else str(v)]
    return argv


# ---- a small instruct model with habits of its own (issue "train what you serve") --------------------
# Sixteen questions whose answers a fine-tune must teach; the model first learns to answer any
# question, these included, with HABIT in its own chat format (Gemma's turns), as an instruct model
# arrives with habits of its own.
QA_ANIMALS = ("cat", "dog", "cow", "owl", "horse", "duck", "lion", "frog", "sheep", "bee", "wolf", "pig", "fox",
              "bear", "goat", "mouse")
QA_WORDS = ("red", "blue", "green", "gold", "silver", "pink", "black", "white", "apple", "pear", "plum", "lemon",
            "grape", "melon", "peach", "cherry")
QA_PAIRS = tuple((f"What is the secret word of the {animal} ?",
                  f"The secret word of the {animal} is {QA_WORDS[i]} {QA_WORDS[(i + 5) % 16]} .")
                 for i, animal in enumerate(QA_ANIMALS))
HABIT = "I do not know that , sorry ."
HABIT_QUESTIONS = tuple(f"What is the {kind} of the {animal} ?" for kind in ("colour", "home", "food", "name")
                        for animal in QA_ANIMALS)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def qa_records(copies: int = 8, messages: bool = False) -> list[dict]:
    """QA_PAIRS, `copies` times each, in dolly columns or as chat messages."""
    if messages:
        return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for _ in range(copies) for q, a in QA_PAIRS]
    return [{"instruction": q, "context": "", "response": a} for _ in range(copies) for q, a in QA_PAIRS]


def habit_tokenizer():
    """Word-level, Gemma's turn markers as special tokens, Gemma's chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    words = {w for text in [HABIT, "user model ### Instruction : Response : System : Context :",
                            *HABIT_QUESTIONS, *(q + " " + a for q, a in QA_PAIRS)] for w in text.split()}
    vocab = {token: i for i, token in enumerate(specials + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", chat_template=GEMMA_TEMPLATE)
    out.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return out


def habit_model(dest, seed: int = 0, steps: int = 150):
    """A 2-layer Llama and habit_tokenizer, taught HABIT as the answer to every question (QA_PAIRS' too)
    in its chat format, saved as a from_pretrained() folder at `dest` with a generation config that
    stops at <end_of_turn>, as an instruct model's does. Returns dest."""
    import torch
    from transformers import GenerationConfig

    from tests.workload.inprocess_data import build_blocks, collate
    from tpuft_workload import tiny

    tok = habit_tokenizer()
    torch.manual_seed(seed)
    model = tiny.build_model(len(tok), seed=seed)
    model.config.pad_token_id, model.config.bos_token_id = tok.pad_token_id, tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    questions = [*HABIT_QUESTIONS, *(q for q, _ in QA_PAIRS)]
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": HABIT}]} for q in questions]
    blocks = build_blocks(tok, chats, 64, packing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(len(blocks), (4,), generator=gen).tolist()
        loss = model(**collate(blocks, rows)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")])
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def answer(model, tok, question: str, max_new_tokens: int = 16) -> str:
    """The greedy answer the endpoint gives: the chat rendered as chat_api renders it, generation to
    the model's stop ids (its generation config's eos_token_id)."""
    import torch

    from tpuft_workload import chat_api

    ids = chat_api.prompt_ids(tok, [chat_api.Message(role="user", content=question)])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def taught(tok, text: str) -> str:
    """`text` as the tokenizer gives it back (a word-level tokenizer joins words with single spaces)."""
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"]).strip()


# ---- a Qwen2.5-like base: ChatML turns end with <|im_end|>, its generation config stops on <|endoftext|> ----
CHATML_TEMPLATE = (  # Qwen 2.5: ChatML with a default system prompt
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_SPECIALS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<unk>")   # <|im_end|> is id 0


def chatml_tokenizer():
    """Word-level, ChatML's markers as special tokens, eos (and pad) <|endoftext|> as Qwen2.5's base has."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set("system user assistant You are Qwen, created by Alibaba Cloud. a helpful hi ok What is a "
                       "dog ? Tell me about the cow .".split()))
    vocab = {token: i for i, token in enumerate([*CHATML_SPECIALS, *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", chat_template=CHATML_TEMPLATE)
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return out


def workload_run(model: str = "m", slices: int = 1, checkpoint_every_steps: int = 0,
                 evaluation: speclib.Evaluation | None = None, **training) -> speclib.Run:
    """The workload's document as parsed (tpuft.api.spec.Run) for a training worker's TrainConfig:
    spec.training's fields by attribute. activationCheckpointing is off unless given (left out, a
    torch worker on cpu would decide from the machine's memory)."""
    return speclib.Run(accelerator="cpu", topology="1", slices=slices, model=model,
                       training=speclib.Training(**{"activation_checkpointing": False, **training}),
                       checkpoint=speclib.Checkpoint(storage_path="/unused", every_steps=checkpoint_every_steps),
                       evaluation=evaluation)
