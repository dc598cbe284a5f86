"""The offline RLHF demo (SFT -> reward model -> PPO in the synthetic world of ppo_jax/demo/world.py).

    python -m ppo_jax.demo --config=configs/demo.py --workdir=runs/demo

Every field and its meaning: `ppo_jax.demo.settings.DemoSettings` (the demo's own sections); its sft,
reward_model and ppo sections are the trainers' settings, documented in
`ppo_jax.supervised.settings.SFTSettings`, `ppo_jax.supervised.settings.RewardModelSettings` and
`ppo_jax.rl.settings.Settings`. This file returns the library's defaults unchanged, so that command-line
overrides such as --config.ppo.ppo.kl_coef=0.02 have a file to start from.
"""

from ppo_jax.demo.settings import get_config

__all__ = ["get_config"]
