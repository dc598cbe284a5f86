"""Tokenizers: the tokenizer saved in a checkpoint directory, loaded and saved (locally or gs://).

transformers is imported inside `load_tokenizer`, not at the top: importing it takes seconds, and
this package is imported by runs that never load a tokenizer (see config_map's docstring).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from etils import epath

from ppo_jax.models.hf.errors import HFModelError


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a checkpoint directory (local files only, never remote code), as saved.

    `AutoTokenizer` picks its class from config.json's model type, and transformers 5's class for a
    BPE family (Qwen2, Llama 3, ...) rebuilds a BPE model from the vocabulary: a word-level or
    unigram tokenizer.json saved beside such a config would then encode its words to nothing. When
    the class changed the tokenizer.json's model, the file is loaded as saved instead (one line says so).
    """
    from transformers import AutoTokenizer  # lazy: see the module docstring

    path = Path(path)
    if not path.is_dir():
        raise HFModelError(f"tokenizer directory {path} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        saved, loaded = _model_type(path / "tokenizer.json"), _backend_model_type(tokenizer)
        if saved is None or loaded is None or saved == loaded:
            return tokenizer
        from transformers import PreTrainedTokenizerFast
        as_saved = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise HFModelError(f"cannot load a tokenizer from {path}: {err}") from err
    print(f"note: AutoTokenizer loads {path} as {type(tokenizer).__name__}, which rebuilds its {saved} "
          f"tokenizer.json as {loaded}; using tokenizer.json as saved", file=sys.stderr)
    return as_saved


def _model_type(tokenizer_json: Path) -> str | None:
    """The tokenizer model ("BPE", "WordLevel", "Unigram", ...) a tokenizer.json holds."""
    try:
        return json.loads(tokenizer_json.read_text())["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _backend_model_type(tokenizer) -> str | None:
    """The model type of a loaded fast tokenizer's backend (None for a slow / sentencepiece one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else type(backend.model).__name__  # tokenizers.models.BPE -> "BPE"


def save_tokenizer(tokenizer, directory: str) -> None:
    """`save_pretrained` into a local or remote (gs://) directory."""
    if "://" not in directory:
        tokenizer.save_pretrained(directory)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        target = epath.Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(tmp):
            (target / f).write_bytes(Path(tmp, f).read_bytes())
