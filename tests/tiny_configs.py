"""Tiny PPO configs shared by the trainer tests and the multi-process worker (no JAX set-up here, so
a worker process can choose its own device count)."""

from ppo_jax.rl.settings import ppo_config


def tiny_config(**overrides):
    """A tiny GPT-2-shaped policy on the toy task; overrides as {"section.field": value}."""
    c = ppo_config()
    c.policy.model.vocab_size = 32
    c.policy.model.hidden_size = 32
    c.policy.model.num_heads = 2
    c.policy.model.num_layers = 2
    c.policy.model.max_position_embeddings = 32
    c.reward.functions = "toy_target_count"
    c.data.prompt_length = 8
    c.rollout.batch_size = 32
    c.rollout.response_length = 8
    c.rollout.forward_microbatch = 16  # experience forwards in two slices
    c.ppo.epochs = 2
    c.ppo.num_minibatches = 2
    c.ppo.num_microbatches = 2
    c.train.progress = False
    c.train.sample_every = 0
    return apply_overrides(c, overrides)


def apply_overrides(c, overrides):
    """`c` with {"section.field": value} (or {"seed": value}) set; returns `c`."""
    for key, value in overrides.items():
        *sections, field = key.split(".")
        target = c
        for section in sections:
            target = target[section]
        target[field] = value
    return c
