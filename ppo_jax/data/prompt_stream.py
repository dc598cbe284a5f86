"""Prompt batches for the PPO trainer: a config-named source through `ppo_jax.data`.

Prompts are padded to exactly `data.prompt_length` (one static shape, so the rollout compiles once)
and each process reads its own disjoint rows of every global batch.

Bad prompts fail when the stream is built, before the trainer writes anything, naming the record
(file:line, or the index of a prompt given in code) and the config field that fixes it: a missing
data.field, an empty prompt, a prompt whose words the tokenizer does not know (`prompt_checks`), and
with data.truncation=error a prompt longer than data.prompt_length.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ppo_jax.config import ConfigError
from ppo_jax import metrics as metrics_lib
from ppo_jax.data import files, loader as loader_lib, prompt_checks, sources, tokenization, toy


@dataclasses.dataclass(frozen=True)
class PromptDataSettings:
    """Prompts for rollouts and evaluation (the PPO config's data section)."""

    prompts: str = "toy"  # prompt source: "toy" (built-in task), a .jsonl file (field data.field) or a .txt file
    field: str = "prompt"  # JSONL field holding the prompt
    eval_prompts: str = ""  # held-out prompt source for evaluation ("" = a held-out split of the toy task)
    prompt_length: int = 16  # static prompt length (tokens, left-padded)
    truncation: str = "left"  # over-long prompts: "left" (drop the oldest tokens) or "error" (refuse the run at start-up, naming the prompt)
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template (with the generation prompt)


def prompt_source(spec: str, *, field: str, vocab_size: int, seed: int, split: str = "train"):
    """"toy" | path.jsonl | path.txt -> a data Source of {"prompt": ...} records."""
    if spec == "toy":
        # Disjoint seeds for train and eval prompts.
        texts = toy.prompts(2048 if split == "train" else 256, vocab_size, seed + (0 if split == "train" else 10_000))
        return sources.from_list([{"prompt": t} for t in texts], name=f"toy[{split}]")
    ext = os.path.splitext(spec)[1].lower()
    if ext in (".jsonl", ".json"):
        try:
            return files.from_jsonl(spec, fields={"prompt": field})
        except sources.MissingFieldError as e:
            # The field name came from the config: say how to fix it there, not with fields={...}.
            raise ConfigError(f"{e.where}: the record has no field {field!r} (data.field={field!r}); "
                              f"it has fields {e.available}. Set --config.data.field=<name in your "
                              f"data>") from None
    if ext == ".txt":
        return files.from_text(spec)
    raise ValueError(f"data.prompts={spec!r}: use 'toy', a .jsonl file or a .txt file")


class PromptStream:
    """Endless, resumable batches of left-padded prompts `[b, Lq]` for this process."""

    def __init__(self, d: PromptDataSettings, tokenizer, *, batch_size: int, seed: int,
                 prompts: Sequence[str] | None = None, split: str = "train", vocab_size: int | None = None):
        """batch_size: prompts per global batch (all processes); prompts: texts given in code instead of
        d.prompts."""
        if prompts is not None:
            if not prompts:
                raise ValueError("the prompt list is empty")
            source = sources.from_list([{"prompt": p} for p in prompts], name="prompts")
        else:
            spec = d.prompts if split == "train" else (d.eval_prompts or d.prompts)
            if split != "train" and d.eval_prompts == "" and d.prompts != "toy":
                raise ValueError("train.eval_every > 0 needs data.eval_prompts (held-out prompts)")
            source = prompt_source(spec, field=d.field, vocab_size=vocab_size or len(tokenizer),
                                   seed=seed, split=split)
        if len(source) == 0:
            raise ValueError(f"no prompts in {d.prompts!r}")
        texts = [source[i]["prompt"] for i in range(len(source))]
        _check_not_empty(source, texts)
        self.tokenizer = tokenization.PromptTokenizer(
            tokenizer, max_prompt_length=d.prompt_length, truncation=d.truncation,
            chat_template=d.chat_template or None)
        # Prompts the tokenizer reads as nothing (or only its specials): refused now, not trained on.
        prompt_checks.check_source(self.tokenizer.tokenizer, source, texts,
                                   warn=metrics_lib.warn if split == "train" else None)
        if d.truncation == "error":
            _check_lengths(source, texts, self.tokenizer)
        self.loader = loader_lib.PromptLoader(
            source, self.tokenizer, global_batch_size=batch_size, kind="prompt",
            seed=seed, shuffle=split == "train",
            agree_length=lambda _: d.prompt_length)

        self.truncated = 0  # prompts truncated so far, summed over all processes

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of the next global batch: tokens, mask [b, Lq]."""
        before = self.tokenizer.num_truncated_prompts
        batch = next(self.loader)
        self.truncated += _sum_over_processes(self.tokenizer.num_truncated_prompts - before)
        return batch.tokens, batch.mask

    def state(self) -> dict:
        """Data position and the global truncation count (JSON, for checkpoints)."""
        return {"loader": self.loader.state(), "truncated": self.truncated}

    def restore(self, state: dict) -> None:
        self.loader.restore(state["loader"])
        self.truncated = int(state["truncated"])


def _empty(prompt) -> str | None:
    """Why a prompt is empty, or None when it is not."""
    if isinstance(prompt, str):
        if not prompt:
            return "prompt is empty"
        return None if prompt.strip() else "prompt is empty (only whitespace)"
    return None if prompt else "prompt is empty (no chat messages)"


def _check_not_empty(source, texts: Sequence) -> None:
    """An empty prompt tokenizes to nothing (or to specials only) and would stop the run at the batch
    that draws it, long after start-up; refuse it now, naming the record."""
    for i, prompt in enumerate(texts):
        reason = _empty(prompt)
        if reason:
            raise ValueError(f"{sources.where(source, i)}: {reason}; remove the record or give it text")


def _check_lengths(source, texts: Sequence, tokenizer: tokenization.PromptTokenizer) -> None:
    """data.truncation=error promises no over-long prompt is ever used; the per-batch check alone
    would find one only when its batch is drawn (iterations into a run), so every prompt is measured
    now: one pass of the tokenizer over the set, at start-up."""
    found = tokenizer.first_overlong_prompt(texts)
    if found is None:
        return
    i, count = found
    limit = tokenizer.max_prompt_length
    raise ValueError(f"{sources.where(source, i)}: prompt {tokenization.preview(texts[i])} has {count} "
                     f"tokens, more than max_prompt_length={limit} (data.prompt_length) with "
                     f"data.truncation=error; shorten it, raise --config.data.prompt_length, or set "
                     f"--config.data.truncation=left")


def _sum_over_processes(value: int) -> int:
    if jax.process_count() == 1:
        return int(value)
    return int(np.sum(multihost_utils.process_allgather(np.asarray(value, np.int32))))
