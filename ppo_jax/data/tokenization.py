"""Records -> left-padded int32 arrays with a Hugging Face tokenizer, in a few static lengths.

Layout (all batches): rows are LEFT-padded, so every row's last real token sits in the last column
(right-aligned). Positions are `cumsum(mask) - mask` (models.transformer.positions_from_mask) and
a scalar head reads its score at the last real token (column L-1 here). Pad ids differ from EOS.

Lengths come from a short list of buckets: a batch is padded to the smallest bucket that holds its
longest row, so XLA compiles at most one program per bucket. The largest bucket is the maximum.

  prompts      tokens [B, Lq], mask [B, Lq]
  SFT          tokens [B, L], mask [B, L], loss_mask [B, L] (1 on response tokens incl. the EOS)
  preferences  chosen_* and rejected_* [B, L] each, both padded to the same L so they can be
               concatenated into one [2B, L] forward; *_response_mask marks response tokens.

Sequence = prompt tokens (chat template applied when configured) + response tokens + EOS.
Over-long prompts are left-truncated (the end of a prompt matters most for what comes next) or
rejected with an error; over-long responses are cut at the end and then get no EOS (they did not
end). Counts of truncations are kept for metrics.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import numpy as np

TRUNCATION_POLICIES = ("left", "error")

Prompt = str | list[dict[str, Any]]


@flax.struct.dataclass
class PromptBatch:
    """Left-padded prompts. tokens [B, Lq] int32; mask [B, Lq] int32 (1 = real token)."""

    tokens: np.ndarray
    mask: np.ndarray


@flax.struct.dataclass
class SFTBatch:
    """Prompt + response + EOS, left-padded; arrays [B, L] int32.

    loss_mask[b, t] = 1 where tokens[b, t] is a response token (or its EOS): the targets of a
    next-token loss (predicted from position t - 1).
    """

    tokens: np.ndarray
    mask: np.ndarray
    loss_mask: np.ndarray


@flax.struct.dataclass
class PreferenceBatch:
    """Chosen and rejected sequences, each [B, L] int32, left-padded to the same length L."""

    chosen_tokens: np.ndarray
    chosen_mask: np.ndarray
    chosen_response_mask: np.ndarray
    rejected_tokens: np.ndarray
    rejected_mask: np.ndarray
    rejected_response_mask: np.ndarray


# --------------------------------------------------------------------------------------------
# Pure helpers.


def normalise_buckets(buckets: Sequence[int] | None, max_length: int, what: str) -> tuple[int, ...]:
    """Sorted distinct bucket lengths ending with `max_length` (added when missing)."""
    if not isinstance(max_length, int | np.integer) or max_length <= 0:
        raise ValueError(f"{what} maximum length must be a positive integer, got {max_length!r}")
    if buckets is None:
        return (int(max_length),)
    values = sorted({int(b) for b in buckets})
    if not values or values[0] <= 0:
        raise ValueError(f"{what} buckets must be positive lengths, got {list(buckets)}")
    if values[-1] > max_length:
        raise ValueError(f"{what} bucket {values[-1]} exceeds the maximum length {max_length}; "
                         f"drop it or raise the maximum")
    if values[-1] != max_length:
        values.append(int(max_length))
    return tuple(values)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length (buckets sorted ascending)."""
    for b in buckets:
        if length <= b:
            return int(b)
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def left_pad(rows: Sequence[Sequence[int]], length: int, pad_value: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids -> (values [B, length] int32, mask [B, length] int32), right-aligned."""
    values = np.full((len(rows), length), pad_value, dtype=np.int32)
    mask = np.zeros((len(rows), length), dtype=np.int32)
    for i, row in enumerate(rows):
        n = len(row)
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than the padded length {length}")
        if n:
            values[i, length - n:] = row
            mask[i, length - n:] = 1
    return values, mask


def preview(text: Any) -> str:
    """A prompt or response shortened for an error message."""
    s = text if isinstance(text, str) else str(text)
    return repr(s[:60] + ("..." if len(s) > 60 else ""))


def _response_text(value: Any, where: str) -> str:
    """A response is a string, or a list holding one assistant message (conversational datasets)."""
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and len(value) == 1 and isinstance(value[0], Mapping)
            and isinstance(value[0].get("content"), str)):
        return value[0]["content"]
    raise ValueError(f"{where}: a response must be a string or a list with one assistant message, "
                     f"got {preview(value)}")


def _field(record: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise KeyError(f"{where}: record has no {name!r} field (it has {sorted(record)}); build the "
                       f"source with fields={{{name!r}: '<name in your data>'}} to map it")
    return record[name]


# --------------------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str):
    """A local directory's tokenizer as saved (`models.hf.load_tokenizer`), else
    `AutoTokenizer.from_pretrained` (a hub name where a cache or the network has it)."""
    if os.path.isdir(name_or_path):
        from ppo_jax.models.hf.tokenizers import load_tokenizer as load_saved
        return load_saved(name_or_path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(name_or_path)


class PromptTokenizer:
    """Encodes prompts, SFT pairs and preference triples into bucketed, left-padded batches.

    tokenizer: a Hugging Face tokenizer (or a path for `AutoTokenizer.from_pretrained`). It must
      have a pad token different from its EOS token.
    max_prompt_length: longest prompt kept, in tokens (after the chat template).
    prompt_buckets: padded prompt lengths to choose from (the maximum is always added); None pads
      every prompt batch to max_prompt_length.
    truncation: "left" (drop the start of over-long prompts / the end of over-long responses, and
      count it) or "error" (raise, naming the example). Left truncation also drops whatever the
      template put first (BOS, system prompt); use "error" where that matters.
    chat_template: None/False = plain text; True = the tokenizer's own chat template; a string = this
      Jinja template. Templates are applied with `add_generation_prompt=True`; a string prompt
      becomes one user message (after `system_prompt`, when given).
    add_special_tokens: for plain text, let the tokenizer add its specials (e.g. BOS).
    max_response_length: longest response in tokens including its EOS (SFT, preferences).
    sequence_buckets: padded lengths for SFT / preference sequences; the maximum
      (max_prompt_length + max_response_length) is always added.
    """

    def __init__(self, tokenizer: Any, max_prompt_length: int,
                 prompt_buckets: Sequence[int] | None = None, truncation: str = "left",
                 chat_template: bool | str | None = None, system_prompt: str | None = None,
                 add_special_tokens: bool = True, max_response_length: int | None = None,
                 sequence_buckets: Sequence[int] | None = None):
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; set one that is not EOS, e.g. "
                "tokenizer.pad_token = '<|finetune_right_pad_id|>' (an unused token it already has) "
                "or tokenizer.add_special_tokens({'pad_token': '<pad>'}) and grow the embeddings")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; set tokenizer.eos_token to the token "
                             "that ends a response")
        if tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError(
                f"the tokenizer's pad token equals its EOS token ({tokenizer.eos_token!r}, id "
                f"{tokenizer.eos_token_id}); padding must be distinguishable from a real EOS. Set "
                f"tokenizer.pad_token to another token (an unused special token, or add '<pad>')")
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
        self.truncation = truncation
        self.max_prompt_length = int(max_prompt_length)
        self.prompt_buckets = normalise_buckets(prompt_buckets, max_prompt_length, "prompt")
        if max_response_length is not None and max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1 (it includes the EOS), got "
                             f"{max_response_length}")
        self.max_response_length = max_response_length
        self.sequence_buckets = (
            None if max_response_length is None else
            normalise_buckets(sequence_buckets, self.max_prompt_length + max_response_length,
                              "sequence"))
        if sequence_buckets is not None and max_response_length is None:
            raise ValueError("sequence_buckets needs max_response_length")

        if chat_template is True:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat_template=True but the tokenizer has no chat template; pass "
                                 "the Jinja template string as chat_template=...")
            self._template = None  # the tokenizer's own
        elif isinstance(chat_template, str):
            self._template = chat_template
        elif chat_template in (None, False):
            self._template = None
        else:
            raise TypeError(f"chat_template must be None, a bool or a Jinja string, got "
                            f"{type(chat_template).__name__}")
        self.use_chat_template = bool(chat_template)
        if system_prompt is not None and not self.use_chat_template:
            raise ValueError("system_prompt needs a chat template (set chat_template)")
        self.system_prompt = system_prompt
        self.add_special_tokens = add_special_tokens

        self.pad_id = int(tokenizer.pad_token_id)
        self.eos_id = int(tokenizer.eos_token_id)
        self.num_prompts = 0
        self.num_truncated_prompts = 0
        self.num_responses = 0
        self.num_truncated_responses = 0

    # ---- single examples ------------------------------------------------------------------

    def messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """Chat messages for a prompt: a message list as is, a string as one user turn."""
        if isinstance(prompt, str):
            turns = [] if self.system_prompt is None else [
                {"role": "system", "content": self.system_prompt}]
            return turns + [{"role": "user", "content": prompt}]
        return list(prompt)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt, before truncation."""
        if self.use_chat_template:
            ids = self.tokenizer.apply_chat_template(
                self.messages(prompt), chat_template=self._template, add_generation_prompt=True,
                tokenize=True, return_dict=False)
            if isinstance(ids, Mapping):  # some versions return a BatchEncoding regardless
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {preview(prompt)} is a list of chat messages but no chat "
                             f"template is configured; set chat_template")
        return list(self.tokenizer(prompt, add_special_tokens=self.add_special_tokens)["input_ids"])

    def _truncate_prompt(self, ids: list[int], prompt: Prompt, where: str) -> list[int]:
        self.num_prompts += 1
        if not ids:
            raise ValueError(f"{where}: prompt {preview(prompt)} has no tokens")
        if len(ids) <= self.max_prompt_length:
            return ids
        if self.truncation == "error":
            raise ValueError(f"{where}: prompt {preview(prompt)} has {len(ids)} tokens, more than "
                             f"max_prompt_length={self.max_prompt_length}; shorten it, raise "
                             f"max_prompt_length, or set truncation='left'")
        self.num_truncated_prompts += 1
        return ids[len(ids) - self.max_prompt_length:]

    def _encode_response(self, response: Any, where: str) -> tuple[list[int], int]:
        """(response ids + EOS, or cut without EOS when too long) and how many of them are real."""
        if self.max_response_length is None:
            raise ValueError("SFT and preference data need max_response_length on the PromptTokenizer")
        text = _response_text(response, where)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.num_responses += 1
        if len(ids) + 1 <= self.max_response_length:
            return ids + [self.eos_id]
        if self.truncation == "error":
            raise ValueError(f"{where}: response {preview(text)} has {len(ids)} tokens + EOS, more "
                             f"than max_response_length={self.max_response_length}; shorten it, "
                             f"raise max_response_length, or set truncation='left'")
        self.num_truncated_responses += 1
        return ids[:self.max_response_length]

    # ---- batches --------------------------------------------------------------------------

    @staticmethod
    def _where(labels: Sequence[Any] | None, i: int) -> str:
        return f"example {labels[i]}" if labels is not None else f"batch row {i}"

    def _encode_raw(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids per prompt, before truncation."""
        if self.use_chat_template or not all(isinstance(p, str) for p in prompts):
            return [self.encode_prompt(p) for p in prompts]
        # One batched call into the fast tokenizer.
        return [list(ids) for ids in self.tokenizer(
            list(prompts), add_special_tokens=self.add_special_tokens)["input_ids"]] if prompts else []

    def encode_prompts(self, prompts: Sequence[Prompt],
                       labels: Sequence[Any] | None = None) -> list[list[int]]:
        """Truncated token ids per prompt. labels name the examples in error messages."""
        raw = self._encode_raw(prompts)
        return [self._truncate_prompt(ids, p, self._where(labels, i))
                for i, (ids, p) in enumerate(zip(raw, prompts))]

    def first_overlong_prompt(self, prompts: Sequence[Prompt],
                              chunk_size: int = 1024) -> tuple[int, int] | None:
        """(index, token count) of the first prompt longer than max_prompt_length, or None.

        Only measures: nothing is truncated or counted, so checking a whole data set up front leaves
        the truncation metrics to the batches. Chunked, so a large set is never held tokenized.
        """
        for start in range(0, len(prompts), chunk_size):
            for offset, ids in enumerate(self._encode_raw(prompts[start:start + chunk_size])):
                if len(ids) > self.max_prompt_length:
                    return start + offset, len(ids)
        return None

    def prompt_length(self, rows: Sequence[Sequence[int]]) -> int:
        """Bucketed padded length for these prompt rows."""
        return bucket_length(max((len(r) for r in rows), default=1), self.prompt_buckets)

    def pad_prompts(self, rows: Sequence[Sequence[int]], length: int | None = None) -> PromptBatch:
        """Left-pads encoded prompts to `length` (default: their bucket)."""
        length = self.prompt_length(rows) if length is None else length
        tokens, mask = left_pad(rows, length, self.pad_id)
        return PromptBatch(tokens=tokens, mask=mask)

    def prompts(self, prompts: Sequence[Prompt], length: int | None = None,
                labels: Sequence[Any] | None = None) -> PromptBatch:
        """Prompts (strings or message lists) -> PromptBatch [B, Lq]."""
        return self.pad_prompts(self.encode_prompts(prompts, labels), length)

    def __call__(self, prompts: Sequence[Prompt], length: int | None = None) -> PromptBatch:
        return self.prompts(prompts, length)

    def _prompt_ids(self, prompt: Prompt, where: str) -> list[int]:
        return self._truncate_prompt(self.encode_prompt(prompt), prompt, where)

    def _sequence(self, prompt_ids: list[int], response: Any,
                  where: str) -> tuple[list[int], list[int]]:
        response_ids = self._encode_response(response, where)
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def encode_sft(self, records: Sequence[Mapping[str, Any]],
                   labels: Sequence[Any] | None = None) -> list[tuple[list[int], list[int]]]:
        """(ids, response flags) per {"prompt", "response"} record."""
        out = []
        for i, record in enumerate(records):
            where = self._where(labels, i)
            prompt_ids = self._prompt_ids(_field(record, "prompt", where), where)
            out.append(self._sequence(prompt_ids, _field(record, "response", where), where))
        return out

    def sequence_length(self, rows: Sequence[Sequence[int]]) -> int:
        if self.sequence_buckets is None:
            raise ValueError("SFT and preference data need max_response_length on the PromptTokenizer")
        return bucket_length(max((len(r) for r in rows), default=1), self.sequence_buckets)

    def pad_sft(self, encoded: Sequence[tuple[list[int], list[int]]],
                length: int | None = None) -> SFTBatch:
        rows = [ids for ids, _ in encoded]
        length = self.sequence_length(rows) if length is None else length
        tokens, mask = left_pad(rows, length, self.pad_id)
        loss_mask, _ = left_pad([flags for _, flags in encoded], length, 0)
        return SFTBatch(tokens=tokens, mask=mask, loss_mask=loss_mask)

    def sft(self, records: Sequence[Mapping[str, Any]], length: int | None = None,
            labels: Sequence[Any] | None = None) -> SFTBatch:
        """{"prompt", "response"} records -> SFTBatch [B, L]."""
        return self.pad_sft(self.encode_sft(records, labels), length)

    def encode_preferences(self, records: Sequence[Mapping[str, Any]],
                           labels: Sequence[Any] | None = None):
        """((chosen ids, flags), (rejected ids, flags)) per {"prompt", "chosen", "rejected"} record."""
        out = []
        for i, record in enumerate(records):
            where = self._where(labels, i)
            prompt_ids = self._prompt_ids(_field(record, "prompt", where), where)
            out.append((self._sequence(prompt_ids, _field(record, "chosen", where), where),
                        self._sequence(prompt_ids, _field(record, "rejected", where), where)))
        return out

    def pad_preferences(self, encoded, length: int | None = None) -> PreferenceBatch:
        chosen = [c for c, _ in encoded]
        rejected = [r for _, r in encoded]
        if length is None:
            length = self.sequence_length([ids for ids, _ in chosen + rejected])
        c_tokens, c_mask = left_pad([ids for ids, _ in chosen], length, self.pad_id)
        c_resp, _ = left_pad([flags for _, flags in chosen], length, 0)
        r_tokens, r_mask = left_pad([ids for ids, _ in rejected], length, self.pad_id)
        r_resp, _ = left_pad([flags for _, flags in rejected], length, 0)
        return PreferenceBatch(chosen_tokens=c_tokens, chosen_mask=c_mask,
                               chosen_response_mask=c_resp, rejected_tokens=r_tokens,
                               rejected_mask=r_mask, rejected_response_mask=r_resp)

    def preferences(self, records: Sequence[Mapping[str, Any]], length: int | None = None,
                    labels: Sequence[Any] | None = None) -> PreferenceBatch:
        """{"prompt", "chosen", "rejected"} records -> PreferenceBatch, both sides [B, L]."""
        return self.pad_preferences(self.encode_preferences(records, labels), length)

    # ---- metrics --------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Cumulative truncation counts on this process (left-truncated prompts, cut responses)."""
        out = {"data/num_prompts": float(self.num_prompts),
               "data/num_truncated_prompts": float(self.num_truncated_prompts),
               "data/truncated_prompt_frac": self.num_truncated_prompts / max(self.num_prompts, 1)}
        if self.num_responses:
            out["data/num_truncated_responses"] = float(self.num_truncated_responses)
            out["data/truncated_response_frac"] = (self.num_truncated_responses /
                                                   self.num_responses)
        return out
