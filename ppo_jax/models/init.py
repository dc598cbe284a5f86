"""Parameters of a module without a checkpoint: abstract (shapes, dtypes and logical axis names, nothing
allocated) and random ones placed straight onto their mesh shardings."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.checkpoint import layout
from ppo_jax.models import lora
from ppo_jax.models.transformer import positions_from_mask


def _dummy_inputs(seq_len: int):
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    mask = jnp.ones((1, seq_len), jnp.int32)
    return tokens, positions_from_mask(mask), mask


def boxed_params(module, seq_len: int = 2, collection: str = "params") -> Any:
    """Abstract params of `module` (ShapeDtypeStructs) still boxed with their logical axis names;
    collection "lora": the abstract LoRA adapters of a model whose config has `lora`."""
    inputs = _dummy_inputs(seq_len)
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs)[collection])


def init_params(model, key, mesh, rules=None, seq_len: int = 8):
    """Randomly initialised params of `model` placed straight onto their mesh shardings.

    Returns (params, shardings) as plain trees. `seq_len` only shapes the dummy init input. The
    params are those of the same model without LoRA: the adapters' A draws from the "params" random
    stream, so initialising with them would give a LoRA run another base than the same seed's
    LoRA-free run (and its reference).
    """
    if getattr(model.config, "lora", None) is not None:
        model = model.clone(config=model.config.replace(lora=None))
    return _sharded_collection(model, key, mesh, rules, seq_len, "params")


def init_adapters(model, key, mesh, rules=None, seq_len: int = 8):
    """Fresh LoRA adapters (the "lora" collection: A kaiming-uniform, B zero) of a model whose config
    has `lora`, placed straight onto their mesh shardings. Returns (adapters, shardings).

    Only the adapters are materialised: the base params' init is dead code in the compiled init."""
    return _sharded_collection(model, key, mesh, rules, seq_len, lora.COLLECTION)


def _sharded_collection(model, key, mesh, rules, seq_len: int, collection: str):
    inputs = _dummy_inputs(seq_len)
    rules = rules or sharding.DEFAULT_RULES
    if model.config.scan_layers or model.config.moe_layers is not None:  # (mixed layers have no scanned form)
        return sharding.sharded_init(lambda: model.init(key, *inputs)[collection], mesh, rules)
    # The same random values whichever layer loop runs: `nn.scan` splits the init key per layer
    # differently from L separate blocks, so per-layer params are drawn as the scanned model draws
    # them and sliced (inside the one init program). A run trained with one loop then resumes with
    # the other on a random init (a LoRA base rebuilt from the seed, a reference) that verifies.
    scanned = model.clone(config=model.config.replace(scan_layers=True))
    shardings = sharding.tree_shardings(jax.eval_shape(lambda: model.init(key, *inputs)[collection]), mesh, rules)
    init = lambda: layout.to_layout(nn.unbox(scanned.init(key, *inputs)[collection]), layout.PER_LAYER)  # noqa: E731
    return jax.jit(init, out_shardings=shardings)(), shardings
