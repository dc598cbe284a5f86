"""Text in, text out: prompts (strings) -> tokenised, left-padded batches the mesh can split -> a
`Sampler` -> responses, with the filler rows that made the batch splittable dropped again.

    texts = sampling.generate_texts(sampler, params, tokenizer, prompts, key, prompt_length=64)
    # len(texts) == len(prompts) * num_samples; the samples of prompt i at [i * n, (i + 1) * n)

`sample_prompts` is the same without the decoding (a host `SampleOutput`, e.g. to score the
responses or read `stopped`); `decode_responses` is the decoding alone.

Filler rows are copies of the last real prompt of the call. They cannot change the real rows: a row's
tokens depend only on the key, its row index and its own logits (see `token_choice`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ppo_jax import sharding
from ppo_jax.data import PromptTokenizer
from ppo_jax.sampling.config import SampleOutput
from ppo_jax.sampling.sampler import Sampler


def _prompt_tokenizer(tokenizer: Any, prompt_length: int) -> PromptTokenizer:
    """`tokenizer` itself when it is a PromptTokenizer, else a plain-text one that keeps the last
    `prompt_length` tokens of an over-long prompt."""
    if isinstance(tokenizer, PromptTokenizer):
        return tokenizer
    return PromptTokenizer(tokenizer, max_prompt_length=prompt_length)


def _fill(x: np.ndarray, rows: int) -> np.ndarray:
    """x [b, ...] -> [rows, ...] (rows >= b): the last row repeated as filler."""
    return np.concatenate([x, np.repeat(x[-1:], rows - x.shape[0], axis=0)])


def _empty_output(prompt_length: int, max_new_tokens: int) -> SampleOutput:
    def zeros(width, dtype):
        return np.zeros((0, *width), dtype)

    return SampleOutput(
        prompt_tokens=zeros((prompt_length,), np.int32), prompt_mask=zeros((prompt_length,), np.int32),
        tokens=zeros((max_new_tokens,), np.int32), logprobs=zeros((max_new_tokens,), np.float32),
        sampling_logprobs=zeros((max_new_tokens,), np.float32), mask=zeros((max_new_tokens,), np.int32),
        lengths=zeros((), np.int32), stopped=zeros((), bool), slot_steps_at_finish=zeros((), np.int32))


def sample_prompts(sampler: Sampler, params: Any, tokenizer: Any, prompts: Sequence[str],
                   key: jax.Array, *, prompt_length: int, mesh: Mesh | None = None,
                   batch_size: int | None = None,
                   on_fetched: Callable[[int], None] | None = None) -> SampleOutput:
    """`sampler.config.num_samples` (n) responses per prompt, as a host (NumPy) SampleOutput of
    R = len(prompts) * n rows, the rows of prompt i at [i * n, (i + 1) * n); no filler row in it.

    tokenizer: a `ppo_jax.data.PromptTokenizer` (its chat template, truncation policy and counters
      apply) or a Hugging Face tokenizer (plain text, over-long prompts left-truncated).
    prompts: strings (or chat message lists, with a PromptTokenizer that has a chat template).
    prompt_length: Lq; every prompt is left-padded to it (one compiled shape).
    mesh: the sampler's mesh (the default); any other mesh is an error.
    batch_size: prompts per sampler call (None: all in one call). Every call gets the same
      [rows, Lq] shape, rows = batch_size rounded up to a multiple of `sampler.batch_multiple`, made
      up with filler rows. The call over prompts[start:start + batch_size] uses the key
      `jax.random.fold_in(key, start)`.
    on_fetched: called with each call's number of prompts once its result is on the host (a
      progress bar); the calls still run back to back, every one dispatched before the first fetch.
    """
    if mesh is not None and mesh != sampler.mesh:
        raise ValueError(f"mesh {dict(mesh.shape)} is not the sampler's mesh {dict(sampler.mesh.shape)}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (or None: all prompts in one call), got {batch_size}")
    prompts = list(prompts)
    if not prompts:
        return _empty_output(prompt_length, sampler.config.max_new_tokens)
    encoder = _prompt_tokenizer(tokenizer, prompt_length)
    chunk = len(prompts) if batch_size is None else int(batch_size)
    multiple = sampler.batch_multiple
    rows = -(-chunk // multiple) * multiple
    n = sampler.config.num_samples

    calls = []  # every call is dispatched before the first result is fetched
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        batch = encoder.prompts(part, length=prompt_length, labels=range(start, start + len(part)))
        tokens, mask = sharding.put_batch((_fill(batch.tokens, rows), _fill(batch.mask, rows)), sampler.mesh)
        calls.append((len(part) * n, sampler(params, tokens, mask, jax.random.fold_in(key, start))))
    kept = []
    for real, out in calls:
        kept.append(jax.tree.map(lambda x, real=real: np.asarray(x)[:real], sharding.to_host(out)))
        if on_fetched is not None:
            on_fetched(real // n)
    return jax.tree.map(lambda *parts: np.concatenate(parts), *kept)


def decode_responses(tokenizer: Any, output: SampleOutput) -> list[str]:
    """Response texts of `output`'s R rows: tokens up to the row's stop token (excluded) or its end,
    decoded with skip_special_tokens=True. tokenizer: Hugging Face or `ppo_jax.data.PromptTokenizer`."""
    hf_tokenizer = tokenizer.tokenizer if isinstance(tokenizer, PromptTokenizer) else tokenizer
    tokens, lengths, stopped = (np.asarray(x) for x in (output.tokens, output.lengths, output.stopped))
    ids = [row[:length - int(stop)].tolist() for row, length, stop in zip(tokens, lengths, stopped)]
    return list(hf_tokenizer.batch_decode(ids, skip_special_tokens=True)) if ids else []


def generate_texts(sampler: Sampler, params: Any, tokenizer: Any, prompts: Sequence[str],
                   key: jax.Array, *, prompt_length: int, mesh: Mesh | None = None,
                   batch_size: int | None = None) -> list[str]:
    """len(prompts) * num_samples response texts, the samples of prompt i at [i * n, (i + 1) * n):
    `sample_prompts` (same arguments) then `decode_responses`."""
    output = sample_prompts(sampler, params, tokenizer, prompts, key, prompt_length=prompt_length, mesh=mesh,
                            batch_size=batch_size)
    return decode_responses(tokenizer, output)
