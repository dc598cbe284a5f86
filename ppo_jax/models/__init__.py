"""Decoder models (GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3 text) with
logical axis names and a KV cache."""

from ppo_jax.models.config import LoraConfig, ModelConfig, to_dtype
from ppo_jax.models.cache import KV_CACHE_AXES, KVCache, init_cache
from ppo_jax.models.transformer import (
    CausalLM,
    ScalarModel,
    positions_from_mask,
    score_at_last_token,
)
from ppo_jax.models.init import boxed_params, init_adapters, init_params
from ppo_jax.models.lora import merge_lora

__all__ = [
    "KV_CACHE_AXES", "CausalLM", "KVCache", "LoraConfig", "ModelConfig", "ScalarModel", "init_cache",
    "positions_from_mask", "score_at_last_token", "to_dtype", "init_params", "boxed_params",
    "init_adapters", "merge_lora",
]
