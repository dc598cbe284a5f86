"""LoRA: low-rank adapters on the decoder's projections, and merging them into the base weights.

A targeted projection computes `x @ W + scale * (x @ A) @ B` with A [*in, r], B [r, *out] (W [*in, *out]
the base kernel). The adapters live in their own Flax variable collection, "lora", beside "params":
  - the base tree is untouched (same paths, shapes, Hugging Face table), so it loads, shards and
    stays frozen exactly as today;
  - the same params run with adapters off by applying the model without the "lora" collection
    (`{"params": params}`), which is the future PPO reference: no second base tree;
  - a gradient over `variables["lora"]` alone trains only the adapters.
The adapter tree mirrors the base tree's module paths ({"transformer": {"layers": {"attn": {"q":
{"a", "b"}}}}}, stacked [L, ...] under scanned layers) and carries logical axis names: A shares its
kernel's input axes, B its output axes, the rank axis ("lora_rank") is replicated.

A is initialised as PEFT does (kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)))
and B at zero, so at init the adapted model computes exactly the base model.

No dropout: RLHF needs the log-probs of the rollout and of the update to come from the same function,
and dropout on the adapter input would make the training forward differ from the sampler's.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.models.lora_config import LoraConfig

# The collection the adapters live in, beside "params".
COLLECTION = "lora"


def kaiming_uniform_a_sqrt5(key, shape, dtype, n_in: int) -> jax.Array:
    """PEFT's (torch nn.Linear's) init of lora_A: U(-b, b), b = 1/sqrt(fan_in), fan_in the product
    of the first `n_in` axes of `shape` [*in, r]."""
    bound = 1.0 / math.sqrt(math.prod(shape[:n_in]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _delta(a: jax.Array, b: jax.Array, lead: int) -> jax.Array:
    """A [*lead, *in, r] @ B [*lead, r, *out] -> [*lead, *in, *out], in float32."""
    fn = lambda a, b: jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn(a, b)


def trained_variables(trainable: Any, frozen: Any | None) -> tuple[Any, Any]:
    """(params, adapters) a model applies when `trainable` is what an optimizer trains:
    the whole params and None when nothing is frozen (`frozen` None); else `trainable` =
    {COLLECTION: adapters, **heads} (heads: new top-level params that must train, e.g. a scalar
    head) on the frozen params `frozen`, giving ({**frozen, **heads}, adapters)."""
    if frozen is None:
        return trainable, None
    heads = {k: v for k, v in trainable.items() if k != COLLECTION}
    return {**frozen, **heads}, trainable[COLLECTION]


def merge_lora(params: Any, adapters: Any, config: LoraConfig) -> Any:
    """Base params with every adapter folded into its kernel: W + scale * A @ B, in W's dtype
    (the product in float32). The result computes what `{"params": params, "lora": adapters}`
    computes, as one plain param tree (to export, or to sample without the low-rank matmuls)."""
    def merge(base: dict, lora: dict) -> dict:
        out = dict(base)
        for name, sub in lora.items():
            if set(sub) == {"a", "b"}:
                kernel = base[name]["kernel"]
                # Scanned layers add a leading [L] axis to all three: A.ndim + B.ndim = W.ndim + 2 + lead.
                lead = sub["a"].ndim + sub["b"].ndim - kernel.ndim - 2
                merged = kernel.astype(jnp.float32) + config.scale * _delta(sub["a"], sub["b"], lead)
                out[name] = {**base[name], "kernel": merged.astype(kernel.dtype)}
            else:
                out[name] = merge(base[name], sub)
        return out

    return merge(params, adapters)
