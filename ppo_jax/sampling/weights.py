"""The policy's weights as a sampler reads them: in the compute dtype when it is narrower than the
stored one (fp32 master weights, bf16 matmuls), cast once, not in every decode step.

One rule for both places a sampler gets its weights: the weight sync to a sampler with a mesh of its
own (`rl/roles.py`, which moves and holds the narrower tree) and the jitted sampler itself on a shared
mesh (`weights_in_compute_dtype`, at the top of the program, outside the decode loop).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig, to_dtype
from ppo_jax.models.transformer import CausalLM


def sampler_dtype(cfg: ModelConfig) -> str | None:
    """The dtype the policy travels in to a sampler of its own and is held in there: the compute dtype
    when it is narrower than the parameter dtype (bf16 matmuls on fp32 master weights: half the bytes
    moved and held), else None (as the trainer holds it)."""
    narrower = jnp.dtype(to_dtype(cfg.dtype)).itemsize < jnp.dtype(to_dtype(cfg.param_dtype)).itemsize
    return cfg.dtype if narrower else None


# Leaves a forward may read in float32 whatever the compute dtype (LayerNorm's and Gemma's / GPT-OSS's
# RMSNorm scales and biases, attention sinks) stay as held, a few vectors per layer; every other weight
# is cast to the compute dtype where it is used, so the cast copy computes the very same numbers.
KEPT_AS_HELD = ("scale", "bias", "sinks")


def cast_for_sampler(tree: Any, dtype: str | None) -> Any:
    """`tree` (arrays or ShapeDtypeStructs) with its floating leaves in `dtype`, but those named in
    KEPT_AS_HELD; None: unchanged."""
    if dtype is None or tree is None:
        return tree

    def cast(path, x):
        if getattr(path[-1], "key", None) in KEPT_AS_HELD or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, to_dtype(dtype), sharding=x.sharding)
        return x.astype(to_dtype(dtype))

    return jax.tree_util.tree_map_with_path(cast, tree)


def weights_in_compute_dtype(params: Any, model: CausalLM) -> Any:
    """`params` as `model`'s layers use them (`cast_for_sampler` in `sampler_dtype`); `params` itself
    when the compute dtype is not narrower.

    Called inside a jitted sampler, it casts once per rollout instead of once per decode step: every
    step reads half the bytes (H200, TinyLlama 4-layer slice, fp32 master weights: 0.83 ms/step,
    against 0.48 with bf16 weights; docs/benchmarks.md) and multiplies the very same bf16 operands,
    so the samples and their log-probs do not change. Costs a compute-dtype copy of the weights while
    sampling (the update, which holds fp32 weights, gradients and Adam's moments, peaks higher).
    """
    return cast_for_sampler(params, sampler_dtype(model.config))
