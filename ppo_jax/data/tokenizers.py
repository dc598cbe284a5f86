"""A small word-level Hugging Face tokenizer built in memory (demos, tests; no network, no files).

Ids are fixed and easy to reason about: the special tokens come first, in the order
pad, bos, eos, unk (ids 0, 1, 2, 3 with the defaults), then the words in the order given.
Text is split on whitespace only, so punctuation must be written as separate words
("hello , world") or listed as part of a word.
"""

from __future__ import annotations

from collections.abc import Iterable


def build_word_tokenizer(words: Iterable[str], *, pad_token: str = "<pad>",
                         bos_token: str = "<bos>", eos_token: str = "<eos>",
                         unk_token: str = "<unk>", extra_special_tokens: Iterable[str] = (),
                         add_bos: bool = False, chat_template: str | None = None):
    """Word-level `transformers.PreTrainedTokenizerFast` with pad, bos, eos, unk (pad != eos).

    words: vocabulary words after the special tokens; duplicates are dropped (first one kept).
    extra_special_tokens: more special tokens (e.g. "<|user|>"), placed after unk, before the words;
      they are never split and `decode(..., skip_special_tokens=True)` drops them.
    add_bos: prepend bos when encoding with `add_special_tokens=True` (as Llama tokenizers do).
    chat_template: a Jinja chat template string stored on the tokenizer (`apply_chat_template`).

    Returns a tokenizer whose `len()` is the vocabulary size; `save_pretrained` / `AutoTokenizer.
    from_pretrained` round-trip it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [pad_token, bos_token, eos_token, unk_token, *extra_special_tokens]
    if len(set(specials)) != len(specials):
        raise ValueError(f"special tokens must be distinct (pad must differ from eos), got {specials}")
    vocab: dict[str, int] = {}
    for token in specials:
        vocab[token] = len(vocab)
    for word in words:
        if not isinstance(word, str) or not word or any(c.isspace() for c in word):
            raise ValueError(f"vocabulary words must be non-empty strings without whitespace, "
                             f"got {word!r}")
        if word not in vocab:
            vocab[word] = len(vocab)

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A $B",
            special_tokens=[(bos_token, vocab[bos_token])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad_token, bos_token=bos_token, eos_token=eos_token,
        unk_token=unk_token,
        additional_special_tokens=list(extra_special_tokens) or None)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
