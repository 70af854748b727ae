"""`builtin:tiny-chat`: a tiny Llama that already speaks simple English in a chat format of its own,
and `builtin:made-up-facts`, facts it cannot know: what `tpuft demo` fine-tunes, to show what a
fine-tune changes.

The base is tpuft_workload.tiny's 2-layer Llama pretrained here, deterministically (fixed seed, one
thread, a fixed number of steps), on data/tiny-chat-corpus.jsonl: short questions about general
things and their answers, in its chat template (`<|user|> ... <|end|> <|assistant|> ... <|end|>`,
carried by its tokenizer). It is a from_pretrained() folder, built once per machine under a file
lock and kept under a name that hashes everything it is made from (TPUFT_BUILTIN_CACHE, default
~/.cache/tpuft/builtin); the workload image builds it at image build (`python -m
tpuft_workload.tiny_chat`), so every rank and host of a run loads the same file.

The word-level vocabulary counts the corpus and the made-up facts (a word-level tokenizer cannot
learn a word later); the facts' own words are never seen in pretraining.
made-up-facts.jsonl holds TRAIN_RECORDS questions with their answers, then as many paraphrases of
the same questions with the same answers: the held-out eval split (EVAL_SPLIT).
"""
from __future__ import annotations

import argparse
import collections
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path

BUILTIN_CHAT_MODEL = "builtin:tiny-chat"
BUILTIN_FACTS = "builtin:made-up-facts"
TRAIN_RECORDS = 24
TRAIN_SPLIT, EVAL_SPLIT = f"train[:{TRAIN_RECORDS}]", f"train[{TRAIN_RECORDS}:]"
CACHE_ENV = "TPUFT_BUILTIN_CACHE"

PAD, UNK, BOS, END = "<pad>", "<unk>", "<s>", "<|end|>"
ROLES = ("system", "user", "assistant")
TURN_MARKERS = tuple(f"<|{role}|>" for role in ROLES)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# The pretraining recipe: part of the cache key, so a change builds a new base.
RECIPE = {"seed": 0, "hidden": 64, "layers": 2, "steps": 400, "batch": 8, "lr": 3e-3, "max_len": 64}
_WORD = re.compile(r"\w+|[^\w\s]+")  # tokenizers' Whitespace pre-tokenizer's split


def data_path(name: str) -> Path:
    return Path(str(resources.files("tpuft_workload") / "data" / name))


def corpus_path() -> Path:
    return data_path("tiny-chat-corpus.jsonl")


def facts_path() -> Path:
    return data_path("made-up-facts.jsonl")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@lru_cache(maxsize=1)
def _vocab() -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for path in (corpus_path(), facts_path()):
        for record in _records(path):
            for m in record["messages"]:
                counts.update(_WORD.findall(m["content"]))
    vocab = {PAD: 0, UNK: 1, BOS: 2, END: 3, **{marker: 4 + i for i, marker in enumerate(TURN_MARKERS)}}
    for word in sorted(counts, key=lambda w: (-counts[w], w)):
        vocab.setdefault(word, len(vocab))
    return vocab


def build_tokenizer():
    """Word-level over the corpus and the facts; the turn markers and <|end|> are special tokens, and
    <|end|> is EOS (an answer ends there; serving stops there). Decoding joins words with spaces,
    then puts punctuation back against its word."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (PAD, UNK, BOS, END, *TURN_MARKERS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD, unk_token=UNK,
                                   model_max_length=1 << 20, chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=True)


def content_hash() -> str:
    """What the base is made from: the corpus, the facts (the vocabulary), the template, the recipe and
    the libraries that train and save it."""
    import torch
    import transformers

    h = hashlib.sha256()
    for part in (corpus_path().read_bytes(), facts_path().read_bytes(), CHAT_TEMPLATE.encode(),
                 json.dumps(RECIPE, sort_keys=True).encode(), torch.__version__.encode(),
                 transformers.__version__.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def pretrain(tokenizer=None, steps: int | None = None):
    """The base: tiny.build_model's Llama trained on the corpus' chats (their answers) for RECIPE's
    steps, each batch drawn with the recipe's seed, on one thread (the same sums in the same order
    every time). Returns the model in eval mode."""
    import torch

    from tpuft_workload import data as datalib
    from tpuft_workload import tiny
    from tpuft.api.records import detect

    tok = tokenizer or build_tokenizer()
    r = RECIPE
    model = tiny.build_model(len(tok), seed=r["seed"], hidden=r["hidden"], layers=r["layers"])
    model.config.pad_token_id, model.config.bos_token_id = tok.pad_token_id, tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id, model.generation_config.bos_token_id = tok.pad_token_id, tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    records = _records(corpus_path())
    layout = detect(records[0].keys())
    examples = [datalib.example_of(tok, rec, layout, n) for n, rec in enumerate(records, start=1)]
    blocks = datalib.blocks_of(examples, r["max_len"], False, tok.pad_token_id, "truncate")[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], weight_decay=0.0)
        gen = torch.Generator().manual_seed(r["seed"])
        model.train()
        for _ in range(r["steps"] if steps is None else steps):
            rows = torch.randint(len(blocks), (r["batch"],), generator=gen).tolist()
            model(**_collate([blocks[i] for i in rows])).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _collate(rows) -> dict:
    import torch

    return {"input_ids": torch.tensor([b.input_ids for b in rows]), "labels": torch.tensor([b.labels for b in rows]),
            "attention_mask": torch.tensor([b.attention_mask for b in rows])}


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tpuft" / "builtin")


def folder() -> str:
    """The base's from_pretrained() folder on this machine: built once (under a file lock, into a
    temporary folder moved into place), then read by every process."""
    root = _cache_root()
    dest = root / f"tiny-chat-{content_hash()}"
    if (dest / "config.json").is_file():
        return str(dest)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "config.json").is_file():
            _save(dest)
    return str(dest)


def _save(dest: Path) -> None:
    from tpuft_workload.checkpoint import serving_generation

    tok = build_tokenizer()
    model = pretrain(tok)
    model.generation_config = serving_generation(model.generation_config, tok)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def answer(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    """The greedy answer the endpoint gives to one user message: rendered by chat_api.prompt_ids,
    generated to the model's stop ids, decoded without special tokens."""
    import torch

    from tpuft_workload import chat_api

    ids = chat_api.prompt_ids(tokenizer, [chat_api.Message(role="user", content=question)])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    """Build the base into this machine's cache and print its folder (the image's build step); with
    `ask`, print the base's answers to the questions as JSON (`tpuft demo`'s "before")."""
    p = argparse.ArgumentParser(prog="python -m tpuft_workload.tiny_chat")
    p.add_argument("ask", nargs="*", help="questions for the base (none: only build it)")
    args = p.parse_args(argv)
    path = folder()
    if not args.ask:
        print(path)
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    print(json.dumps({q: answer(model, tok, q) for q in args.ask}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
