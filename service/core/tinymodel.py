"""The bundled tiny model: a 2-layer Llama config and a word-level tokenizer.

Written as plain JSON on first use so a run works with no network and no
weights: workers serve it with ``--load-format dummy``. Nothing here imports
torch or transformers; the files are what Hugging Face loaders expect.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

TINY_MODEL_NAME = "decodebench-tiny"
VOCAB_SIZE = 8192
# Ids 0..2 are special; prompts draw from the rest.
FIRST_ORDINARY_ID = 3
MAX_MODEL_LEN = 131072

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def tiny_config() -> dict[str, object]:
    """The tiny model's config.json."""
    return dict(_CONFIG)


def tokenizer_json(vocab_size: int = VOCAB_SIZE) -> dict[str, object]:
    """A word-level tokenizer of ``vocab_size`` ids: three specials, then ``w<id>`` words."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(FIRST_ORDINARY_ID, vocab_size):
        vocab[f"w{i}"] = i
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(specials)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "model_max_length": MAX_MODEL_LEN,
    "clean_up_tokenization_spaces": False,
}


def ensure_tiny_model(models_dir: Path) -> Path:
    """Write the tiny model's files under ``models_dir`` unless present; return its path."""
    path = models_dir / TINY_MODEL_NAME
    marker = path / "config.json"
    if marker.exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": TOKENIZER_CONFIG,
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2},
        # config.json last: its presence marks a complete model directory.
        "config.json": _CONFIG,
    }
    for name, content in files.items():
        write_atomically(path / name, json.dumps(content, indent=1))
    return path


def write_atomically(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` so that no reader sees part of it: to a temporary file of
    its own beside it (a name no other thread or process writing the same target gets),
    then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
