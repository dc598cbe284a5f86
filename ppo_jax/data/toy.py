"""The built-in toy task: random word prompts, reward = how often a target word appears.

Small enough for a CPU test or a first run, and its reward is legible: a policy that learns says
the target word more often. (The full synthetic world with a learned reward model lives in the demo.)
"""

from __future__ import annotations

import numpy as np

from ppo_jax.data.tokenizers import build_word_tokenizer

NUM_SPECIAL = 4  # pad, bos, eos, unk come first in build_word_tokenizer
TARGET_WORD = "w7"


def words(vocab_size: int) -> list[str]:
    if vocab_size < NUM_SPECIAL + 8:
        raise ValueError(f"the toy task needs a vocabulary of at least {NUM_SPECIAL + 8} tokens, got {vocab_size}")
    return [f"w{i}" for i in range(vocab_size - NUM_SPECIAL)]


def tokenizer(vocab_size: int):
    """Word-level tokenizer whose length is exactly `vocab_size` (pad 0, bos 1, eos 2, unk 3)."""
    return build_word_tokenizer(words(vocab_size))


def prompts(n: int, vocab_size: int, seed: int, min_words: int = 3, max_words: int = 10) -> list[str]:
    """`n` random prompts of `min_words`..`max_words` words, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    vocab = words(vocab_size)
    return [" ".join(rng.choice(vocab, size=rng.integers(min_words, max_words + 1)))
            for _ in range(n)]
