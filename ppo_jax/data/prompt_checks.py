"""Start-up checks that a prompt set and its tokenizer agree, before anything compiles.

A tokenizer that does not know a data set's words does not fail: it encodes them to nothing (or to
`<unk>`), and a chat template still wraps that nothing in its special tokens, so a run would train
on templates alone and say "done". Two checks catch it:

- every prompt's *content* (the string, or its messages' contents) must encode to at least one token
  that is not a special token: an error naming the record otherwise;
- the first prompts must survive `decode(encode(text))` with their words: one `warning:` line
  otherwise (a lowercasing or accent-stripping tokenizer may change words legitimately).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ppo_jax.data import sources
from ppo_jax.data.tokenization import preview

ROUND_TRIP_PROMPTS = 8  # prompts whose words are checked to survive a round trip


def content_text(prompt: Any) -> str:
    """What the user wrote: a string prompt, or its chat messages' contents joined by spaces."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return " ".join(m["content"] for m in prompt
                        if isinstance(m, Mapping) and isinstance(m.get("content"), str))
    return str(prompt)


def first_contentless_prompt(tokenizer, prompts: Sequence[Any], chunk_size: int = 1024) -> tuple[int, list[int]] | None:
    """(index, token ids) of the first prompt whose content encodes to no token but special ones
    (pad, bos, eos, unk, the template's markers), or None. Chunked batched calls: one pass, at start-up."""
    specials = set(tokenizer.all_special_ids)
    for start in range(0, len(prompts), chunk_size):
        texts = [content_text(p) for p in prompts[start:start + chunk_size]]
        for offset, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
            if all(int(i) in specials for i in ids):
                return start + offset, [int(i) for i in ids]
    return None


def check_prompt_content(tokenizer, prompts: Sequence[Any], where: Callable[[int], str]) -> None:
    """Raises ValueError naming the first prompt (`where(index)`) whose content has no tokens of its own."""
    found = first_contentless_prompt(tokenizer, prompts)
    if found is None:
        return
    i, ids = found
    got = (f"only special tokens {tokenizer.convert_ids_to_tokens(ids)}" if ids else "no tokens")
    raise ValueError(
        f"{where(i)}: prompt {preview(prompts[i])} tokenizes to {got}: the tokenizer "
        f"({type(tokenizer).__name__}) does not know its words. Check that the data field holds the text and "
        f"that the tokenizer is the model's (decode(encode(text)) should give the text back)")


def lost_words(tokenizer, prompts: Sequence[Any], count: int = ROUND_TRIP_PROMPTS) -> tuple[Any, list[str]] | None:
    """(prompt, its words missing after decode(encode(text))) for the first of `count` prompts that
    loses any, or None. Case-insensitive, and a word only has to reappear somewhere in the decoded
    text (tokenizers differ in how they restore spaces)."""
    for prompt in prompts[:count]:
        text = content_text(prompt)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        decoded = tokenizer.decode(ids, skip_special_tokens=True).lower()
        missing = [w for w in text.lower().split() if w not in decoded]
        if missing:
            return prompt, missing
    return None


def round_trip_warning(tokenizer, prompts: Sequence[Any]) -> str | None:
    """The one-line warning for a tokenizer that loses the first prompts' words, or None."""
    found = lost_words(tokenizer, prompts)
    if found is None:
        return None
    prompt, missing = found
    shown = ", ".join(repr(w) for w in missing[:5]) + (", ..." if len(missing) > 5 else "")
    return (f"the tokenizer ({type(tokenizer).__name__}) loses words of prompt {preview(prompt)} in "
            f"decode(encode(text)): {shown}; is it the model's tokenizer?")


def check_source(tokenizer, source, prompts: Sequence[Any] | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
    """Both checks on a source's prompts (its records' "prompt" fields unless `prompts` are given):
    the content error names the record (file:line); the round-trip warning goes to `warn`."""
    if prompts is None:
        prompts = [source[i]["prompt"] for i in range(len(source))]
    check_prompt_content(tokenizer, prompts, lambda i: sources.where(source, i))
    message = round_trip_warning(tokenizer, prompts) if warn is not None else None
    if message:
        warn(message)
