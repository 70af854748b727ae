"""Built-ins that need no model hub: `builtin:tiny-llama` and `builtin:dolly-mini`.

The tokenizer is a word-level `tokenizers` model whose vocabulary is counted from the
shipped dolly-mini data plus the prompt template, sorted deterministically (count, then
word), so every Ray worker builds the identical tokenizer without talking to the others.
The model is a 2-layer Llama built from a config with a fixed seed (identical on all ranks). The
tokenizer carries tpuft_workload.render's DOLLY_TEMPLATE, as any tokenizer without a template is
given at load.
"""
from __future__ import annotations

import collections
import json
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tpuft_workload.render import DOLLY_TEMPLATE

BUILTIN_MODEL = "builtin:tiny-llama"
BUILTIN_DATASET = "builtin:dolly-mini"

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
_WORD = re.compile(r"\w+|[^\w\s]+")  # same split as tokenizers' Whitespace pre-tokenizer

def dolly_mini_path() -> Path:
    return Path(str(resources.files("tpuft_workload") / "data" / "dolly-mini.jsonl"))


def _corpus_texts():
    from tpuft_workload.render import TEMPLATE_WORDS

    yield TEMPLATE_WORDS
    with open(dolly_mini_path()) as f:
        for line in f:
            r = json.loads(line)
            yield " ".join(str(r.get(k) or "") for k in ("instruction", "context", "response", "category"))


@lru_cache(maxsize=1)
def _vocab() -> dict[str, int]:
    counts = collections.Counter()
    for text in _corpus_texts():
        counts.update(_WORD.findall(text))
    words = sorted(counts, key=lambda w: (-counts[w], w))
    vocab = {PAD: 0, UNK: 1, BOS: 2, EOS: 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    return vocab


def build_tokenizer():
    """PreTrainedTokenizerFast over a deterministic word-level vocabulary (adds BOS like Llama)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # no decoder: decode() joins words with single spaces, good enough for a demo model
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, model_max_length=1 << 20, chat_template=DOLLY_TEMPLATE)


def build_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        tie_word_embeddings=False, use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(g)
    return model
