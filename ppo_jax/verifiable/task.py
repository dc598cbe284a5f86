"""A task with a verifiable answer: sort the prompt's number words by their value.

    prompt:   "sort : seven two eleven"
    answer:   "two seven eleven"

The checker is exact (`is_correct`): a response scores 1 when its words are the prompt's words in
increasing value, else 0 (`sort_exact`, a registered reward function). Alphabetical order is not the
answer ("eleven" < "seven" < "two"), so the policy has to learn the words' values.

The SFT demonstrations are imperfect on purpose (`SortTask.demonstration`): a share of them swap two
neighbouring words, so the SFT policy imitates the mistakes and RL on the 1/0 reward has something
to correct. Train and eval prompts are disjoint: a prompt's split is a fixed hash of its word set.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence

import numpy as np

from ppo_jax import reward_functions
from ppo_jax.data.tokenizers import build_word_tokenizer

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
                "nineteen")
VALUE = {word: i for i, word in enumerate(NUMBER_WORDS)}
COMMAND = ("sort", ":")


@functools.cache
def tokenizer():
    """Word-level: pad 0, bos 1, eos 2, unk 3, then "sort", ":" and the number words."""
    return build_word_tokenizer(COMMAND + NUMBER_WORDS)


def words_of(prompt: str) -> list[str]:
    """The number words a prompt asks to sort ("sort : a b c" -> [a, b, c])."""
    parts = prompt.split()
    if parts[:2] != list(COMMAND) or not all(w in VALUE for w in parts[2:]):
        raise ValueError(f"not a sort prompt: {prompt!r}")
    return parts[2:]


def answer(prompt: str) -> str:
    return " ".join(sorted(words_of(prompt), key=VALUE.__getitem__))


def is_correct(prompt: str, response: str) -> bool:
    """Exact match: the response's words are the sorted prompt words (whitespace aside)."""
    return response.split() == answer(prompt).split()


@reward_functions.register("sort_exact")
def sort_exact(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """1.0 for an exactly sorted answer, else 0.0."""
    return [float(is_correct(p, r)) for p, r in zip(prompts, responses)]


@dataclasses.dataclass(frozen=True)
class SortTask:
    """Prompts of `min_words`..`max_words` distinct number words below `num_values`; demonstrations
    wrong with probability `demo_error_rate`."""

    num_values: int = 20  # number words in play: zero .. (num_values - 1); at most 20
    min_words: int = 3  # words per prompt, at least
    max_words: int = 6  # words per prompt, at most
    demo_error_rate: float = 0.3  # share of SFT demonstrations with two neighbouring words swapped
    eval_fraction: float = 0.2  # share of word sets reserved for held-out prompts

    def validate(self) -> None:
        if not 2 <= self.num_values <= len(NUMBER_WORDS):
            raise ValueError(f"task.num_values={self.num_values} must be between 2 and {len(NUMBER_WORDS)}")
        if not 2 <= self.min_words <= self.max_words <= self.num_values:
            raise ValueError(f"task: need 2 <= min_words ({self.min_words}) <= max_words ({self.max_words}) "
                             f"<= num_values ({self.num_values})")
        if not 0.0 <= self.demo_error_rate <= 1.0:
            raise ValueError(f"task.demo_error_rate={self.demo_error_rate} must be in [0, 1]")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"task.eval_fraction={self.eval_fraction} must be in (0, 1)")

    @property
    def prompt_length(self) -> int:
        return len(COMMAND) + self.max_words

    @property
    def response_length(self) -> int:
        return self.max_words + 1  # the answer and its EOS

    def split_of(self, words: Sequence[str]) -> str:
        """"eval" for a fixed share of word sets (order-free), "train" for the rest."""
        key = " ".join(sorted(words, key=VALUE.__getitem__)).encode()
        return "eval" if zlib.crc32(key) % 1000 < self.eval_fraction * 1000 else "train"

    def prompts(self, n: int, split: str = "train", seed: int = 0) -> list[str]:
        """`n` prompts of `split`, reproducible from `seed` (words in random order)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = np.random.default_rng((seed, 1 if split == "train" else 2))
        out = []
        while len(out) < n:
            count = int(rng.integers(self.min_words, self.max_words + 1))
            words = [NUMBER_WORDS[i] for i in rng.choice(self.num_values, size=count, replace=False)]
            if self.split_of(words) == split:
                out.append(" ".join(COMMAND + tuple(words)))
        return out

    def demonstration(self, prompt: str, rng: np.random.Generator) -> str:
        """The answer, or with probability demo_error_rate the answer with two neighbours swapped."""
        words = answer(prompt).split()
        if rng.random() < self.demo_error_rate:
            i = int(rng.integers(len(words) - 1))
            words[i], words[i + 1] = words[i + 1], words[i]
        return " ".join(words)

    def sft_corpus(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """`n` {"prompt", "response"} demonstrations on train prompts."""
        rng = np.random.default_rng((seed, 3))
        return [{"prompt": p, "response": self.demonstration(p, rng)} for p in self.prompts(n, "train", seed)]
