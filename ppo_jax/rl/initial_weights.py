"""A fresh run's weights before its first iteration: the policy from policy.path or a random init, a
LoRA policy's adapters (fresh or imported), the value model from the policy or the reward model, the
frozen reference, and the optimizer states, each built straight onto its shardings. A resumed run
rebuilds a LoRA base here too (`rebuild_lora_base`), checked against the checkpoint's checksums.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.checkpoint import verify
from ppo_jax.config import ConfigError
from ppo_jax.models import boxed_params, hf, init_adapters, init_params
from ppo_jax.rl import roles
from ppo_jax.rl.build import RunKeys, cast_floating, init_entropy, init_kl, reference_copy, trainable_value, value_lora
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Modules, PPOState


def initial_policy(s: Settings, modules: Modules, param_shardings, mesh, key):
    """The policy's starting params (also the frozen reference; with LoRA, the frozen base):
    policy.path (Hugging Face) or a random init from `key`; the same tree every time it is built."""
    if s.policy.path:
        loaded = hf.load_model(s.policy.path, mesh, kind="causal_lm", param_dtype=s.policy.param_dtype or None,
                               dtype=s.policy.dtype or None, execution=modules.policy.config.execution())
        return jax.device_put(loaded.params, param_shardings)
    policy, _ = init_params(modules.policy, key, mesh)
    return policy


def rebuild_lora_base(s: Settings, modules: Modules, mesh, init_key, recorded: dict | None, where: str):
    """The frozen base a LoRA run's adapters were trained on. Checkpoints hold its checksums, not a
    copy (it is policy.path or the seed's init, unchanged): rebuilt from that source and adopted only
    if the checksums match. recorded: `frozen_checksums["policy_base"]` of a checkpoint in `where`."""
    base = initial_policy(s, modules, roles.policy_shardings(modules, mesh), mesh, init_key)
    source = f"policy.path={s.policy.path}" if s.policy.path else f"seed={s.seed}"
    verify.check_rebuilt(base, recorded, where, "a LoRA base", "base policy", source, "use the original policy and seed")
    return base


def initial_adapters(s: Settings, modules: Modules, adapter_shardings, mesh, key):
    """The LoRA policy's starting adapters: fresh (B = 0, so the first policy is exactly the base;
    `key` is the run's init key folded, so they never share random bits with a random base init) or
    those of the PEFT directory policy.lora.init_from (its config already checked by
    `imported_lora_config`)."""
    if s.policy.lora.init_from:
        base_cfg = dataclasses.replace(modules.policy.config, lora=None)
        cfg, adapters = hf.load_adapter(s.policy.lora.init_from, base_cfg, mesh)
        if cfg.lora != modules.policy.config.lora:  # the file changed since the config was read
            raise ConfigError(f"policy.lora.init_from={s.policy.lora.init_from!r} describes {cfg.lora}, not "
                              f"{modules.policy.config.lora} as when the run was configured")
        return jax.device_put(adapters, adapter_shardings)
    adapters, _ = init_adapters(modules.policy, jax.random.fold_in(key, 1), mesh)
    return adapters


def initial_params(s: Settings, modules: Modules, shardings: PPOState, mesh, key, reward_params):
    """Fresh policy and value params: from policy.path (Hugging Face) or a random init. With LoRA
    the policy returned is the base (frozen); the trainable adapters come from `initial_adapters`."""
    lora = modules.policy.config.lora is not None
    policy = initial_policy(s, modules, roles.policy_shardings(modules, mesh) if lora else shardings.policy, mesh, key)
    value = None
    if value_lora(modules):  # adapters (B = 0) + head; the frozen transformer is shared, not copied
        adapters, _ = init_adapters(modules.value, jax.random.fold_in(key, 2), mesh)
        head = (reward_params["score"] if s.value.init == "reward"
                else jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nn.unbox(boxed_params(modules.value))["score"]))
        # A copy: the trainable state is donated, the reward model's head must survive it.
        value = sharding.copy_tree(trainable_value(adapters, head), shardings.value)
    elif modules.value is not None:
        if s.value.init == "reward":  # in the value model's dtype (the policy's), which may not be the reward's
            value = sharding.copy_tree(cast_floating(reward_params, modules.value.config.param_dtype), shardings.value)
        else:
            head = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                nn.unbox(boxed_params(modules.value))["score"])
            value = jax.jit(lambda t: {"transformer": jax.tree.map(jnp.copy, t), "score": head},
                            out_shardings=shardings.value)(policy["transformer"])
    return policy, value


def fresh_state(s: Settings, policy, value, key, policy_tx, value_tx, shardings: PPOState, mesh) -> PPOState:
    """Optimizer states, KL controller, step and key built straight onto their shardings."""

    def build(policy, value, key):
        return PPOState(
            step=jnp.zeros((), jnp.int32), policy=policy, policy_opt=policy_tx.init(policy),
            value=value, value_opt=value_tx.init(value) if value is not None else None,
            kl=init_kl(s.ppo), key=key, entropy=init_entropy(s.ppo))

    return jax.jit(build, out_shardings=shardings)(policy, value, sharding.replicate(key, mesh))


@dataclasses.dataclass
class StartWeights:
    """A run's weights before its first iteration (fresh, or restored from a checkpoint)."""

    state: PPOState
    reference: Any  # the frozen reference; None with LoRA (the base, adapters off), imported adapters' copy
    base: Any  # a LoRA policy's frozen base; None for full fine-tuning


def fresh_weights(s: Settings, modules: Modules, shardings: PPOState, mesh, keys: RunKeys, reward_params,
                  policy_tx, value_tx) -> StartWeights:
    """A fresh run's train state and frozen policy trees, built onto their shardings."""
    policy, value = initial_params(s, modules, shardings, mesh, keys.init, reward_params)
    base = reference = None
    if modules.policy.config.lora is not None:  # no reference copy: the base with the adapters off is the reference
        base, policy = policy, initial_adapters(s, modules, shardings.policy, mesh, keys.init)
        if s.policy.lora.init_from:  # the reference is base + the imported adapters: a frozen copy (undonated)
            reference = sharding.copy_tree(policy, shardings.policy)
    else:
        reference = reference_copy(s.policy, policy, shardings.policy)
    return StartWeights(fresh_state(s, policy, value, keys.state, policy_tx, value_tx, shardings, mesh), reference, base)
