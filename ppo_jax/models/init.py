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
from ppo_jax.program_cache import PROGRAMS, value_key


def _dummy_inputs(seq_len: int):
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    mask = jnp.ones((1, seq_len), jnp.int32)
    return tokens, positions_from_mask(mask), mask


def boxed_params(module, seq_len: int = 2, collection: str = "params") -> Any:
    """Abstract params of `module` (ShapeDtypeStructs) still boxed with their logical axis names;
    collection "lora": the abstract LoRA adapters of a model whose config has `lora`. Traced once per
    equal module in a process (`program_cache`): callers must not change the tree they get."""
    def trace():
        inputs = _dummy_inputs(seq_len)
        return jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs)[collection])

    return PROGRAMS.get(value_key("boxed_params", module, seq_len, collection), trace)


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
    rules = rules or sharding.DEFAULT_RULES
    init, shardings = PROGRAMS.get(value_key("init", model, mesh, rules, seq_len, collection),
                                   lambda: _init_program(model, mesh, rules, seq_len, collection))
    return init(key), shardings


def _init_program(model, mesh, rules, seq_len: int, collection: str):
    """(jitted init: random key -> the collection's plain params on `shardings`, shardings). The key
    is an argument, so one program serves every seed (`program_cache`)."""
    inputs = _dummy_inputs(seq_len)
    shardings = sharding.tree_shardings(boxed_params(model, seq_len, collection), mesh, rules)
    if model.config.scan_layers or model.config.moe_layers is not None:  # (mixed layers have no scanned form)
        init = lambda k: nn.unbox(model.init(k, *inputs)[collection])  # noqa: E731
        return jax.jit(init, out_shardings=shardings), shardings
    # The same random values whichever layer loop runs: `nn.scan` splits the init key per layer
    # differently from L separate blocks, so per-layer params are drawn as the scanned model draws
    # them and sliced (inside the one init program). A run trained with one loop then resumes with
    # the other on a random init (a LoRA base rebuilt from the seed, a reference) that verifies.
    scanned = model.clone(config=model.config.replace(scan_layers=True))
    init = lambda k: layout.to_layout(nn.unbox(scanned.init(k, *inputs)[collection]), layout.PER_LAYER)  # noqa: E731
    return jax.jit(init, out_shardings=shardings), shardings
