"""`python -m ppo_jax.cli.reward_model --config=configs/reward_model.py --workdir=DIR [--config.x=y ...]`
(also the console script `ppo-jax-reward-model`): a Bradley–Terry reward model from preference pairs."""

from __future__ import annotations

from ppo_jax.cli.common import config_command
from ppo_jax.supervised.settings import RewardModelSettings
from ppo_jax.supervised.base import summary_line
from ppo_jax.supervised.reward_model import RewardModelTrainer


def reward_model(config, workdir: str) -> str:
    trainer = RewardModelTrainer(config, workdir)
    return summary_line(trainer, trainer.train())


def main(argv=None) -> None:
    config_command(reward_model, schema=RewardModelSettings, what="reward-model",
                   example_config="configs/reward_model.py", argv=argv)


if __name__ == "__main__":
    main()
