"""Prompt, SFT and preference data: sources, tokenisation into bucketed left-padded batches, and a
deterministic, resumable, per-process loader.

    source = data.from_jsonl("prompts.jsonl", fields=data.PROMPT_FIELDS)
    tok = data.PromptTokenizer(hf_tokenizer, max_prompt_length=128, prompt_buckets=(32, 64))
    loader = data.PromptLoader(source, tok, global_batch_size=64, seed=0)
    batch = next(loader)              # PromptBatch: tokens, mask [64 // process_count, Lq] int32
    checkpoint["data"] = loader.state()   # ... later: loader.restore(checkpoint["data"])

TFDS and Hugging Face `datasets` are optional extras, imported only by `from_tfds` /
`from_hf_datasets`.
"""

from ppo_jax.data.loader import (
    KINDS,
    BatchIterator,
    PromptLoader,
    RecordBatch,
    epoch_order,
    iterate_once,
    max_across_processes,
)
from ppo_jax.data.files import from_jsonl, from_text
from ppo_jax.data.hf_source import HfDatasetSource, from_hf_datasets
from ppo_jax.data.sources import (
    PREFERENCE_FIELDS,
    PROMPT_FIELDS,
    SFT_FIELDS,
    ListSource,
    MissingFieldError,
    Source,
    from_list,
)
from ppo_jax.data.tfds_source import TfdsSource, from_tfds
from ppo_jax.data.tokenization import (
    TRUNCATION_POLICIES,
    PreferenceBatch,
    PromptBatch,
    PromptTokenizer,
    SFTBatch,
    bucket_length,
    left_pad,
    load_tokenizer,
    normalise_buckets,
)
from ppo_jax.data.tokenizers import build_word_tokenizer

__all__ = [
    "KINDS", "BatchIterator", "PromptLoader", "RecordBatch", "epoch_order", "iterate_once",
    "max_across_processes", "PREFERENCE_FIELDS", "PROMPT_FIELDS", "SFT_FIELDS", "HfDatasetSource",
    "ListSource", "MissingFieldError", "Source", "TfdsSource", "from_hf_datasets", "from_jsonl", "from_list", "from_text",
    "from_tfds", "TRUNCATION_POLICIES", "PreferenceBatch", "PromptBatch", "PromptTokenizer",
    "SFTBatch", "bucket_length", "left_pad", "load_tokenizer", "normalise_buckets",
    "build_word_tokenizer",
]
