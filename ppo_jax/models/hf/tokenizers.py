"""Tokenizers: the tokenizer saved in a checkpoint directory, loaded and saved (locally or gs://).

transformers is imported inside `load_tokenizer`, not at the top: importing it takes seconds, and
this package is imported by runs that never load a tokenizer (see config_map's docstring).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from etils import epath

from ppo_jax.models.hf.errors import CheckpointError


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a checkpoint directory (local files only, never remote code)."""
    from transformers import AutoTokenizer  # lazy: see the module docstring

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"tokenizer directory {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=False)
    except Exception as err:
        raise CheckpointError(f"cannot load a tokenizer from {path}: {err}") from err


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
