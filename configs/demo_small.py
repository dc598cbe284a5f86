"""A reduced demo for the test suite and the notebook: the same pipeline, smaller corpus and fewer steps.

    python -m ppo_jax.demo --config=configs/demo_small.py --workdir=runs/demo_small

It shows the direction (the reward model beats chance, PPO raises the gold reward, KL stays bounded),
not the full demo's numbers: its 20 PPO iterations of 32 prompts close about a third of the gold-reward
gap, so its summary table checks that against a target of a quarter (`targets.gap_closed = 0.25`; the
full demo's is a half). The sizes are set in `ppo_jax.demo.settings.small_config` (importable where
the configs/ directory is not, e.g. an installed package in Colab). Every field and its meaning:
`ppo_jax.demo.settings.DemoSettings`; its sft, reward_model and ppo sections are documented in
`ppo_jax.supervised.settings.SFTSettings`, `ppo_jax.supervised.settings.RewardModelSettings` and
`ppo_jax.rl.settings.Settings`.
"""

from ppo_jax.demo.settings import small_config


def get_config():
    return small_config()
