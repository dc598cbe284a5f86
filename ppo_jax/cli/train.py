"""`python -m ppo_jax.cli.train --config=configs/ppo_toy.py --workdir=DIR [--config.x=y ...]` (also the
console script `ppo-jax-train`): a PPO run; the same command on the same workdir resumes it."""

from __future__ import annotations

from ppo_jax import distributed
from ppo_jax.cli.common import config_command
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.trainer import PPOTrainer


def train(config, workdir: str) -> str:
    settings = Settings.from_config(config, reward_in_code=False)
    distributed.initialize(settings.distributed)  # before anything touches a device
    trainer = PPOTrainer(settings, workdir)
    history = trainer.train()
    last = history[-1]
    return (f"done: {len(history)} iterations, score {last['objective/scores']:.4f}, "
            f"KL {last['objective/kl']:.4f}; metrics in {trainer.writer.path}")


def main(argv=None) -> None:
    config_command(train, what="PPO", argv=argv)


if __name__ == "__main__":
    main()
