"""Decoder models (GPT-2, Llama, Mistral, Qwen2) with logical axis names and a KV cache."""

from ppo_jax.models.config import ModelConfig, to_dtype
from ppo_jax.models.transformer import (
    KV_CACHE_AXES,
    CausalLM,
    KVCache,
    ScalarModel,
    init_cache,
    last_token_index,
    positions_from_mask,
    score_at_last_token,
)

__all__ = [
    "KV_CACHE_AXES", "CausalLM", "KVCache", "ModelConfig", "ScalarModel", "init_cache", "last_token_index",
    "positions_from_mask", "score_at_last_token", "to_dtype", "init_params",
]


def init_params(model, key, mesh, rules=None, seq_len: int = 8):
    """Randomly initialised params of `model` placed straight onto their mesh shardings.

    Returns (params, shardings) as plain trees. `seq_len` only shapes the dummy init input.
    """
    import jax
    import jax.numpy as jnp

    from ppo_jax import sharding

    tokens = jnp.zeros((1, seq_len), jnp.int32)
    mask = jnp.ones((1, seq_len), jnp.int32)

    def init():
        return model.init(key, tokens, positions_from_mask(mask), mask)["params"]

    return sharding.sharded_init(init, mesh, rules or sharding.DEFAULT_RULES)
