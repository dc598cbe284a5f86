"""The offline RLHF demo (SFT -> reward model -> PPO in the synthetic world of ppo_jax/demo/world.py).

    python -m ppo_jax.demo --config=configs/demo.py --workdir=runs/demo

Every field and its meaning: `ppo_jax.demo.get_config` (this file returns it unchanged, so that
command-line overrides such as --config.ppo.ppo.kl_coef=0.02 have a file to start from).
"""

from ppo_jax.demo.pipeline import get_config as demo_config


def get_config():
    return demo_config()
