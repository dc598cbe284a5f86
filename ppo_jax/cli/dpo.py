"""`python -m ppo_jax.cli.dpo --config=configs/dpo.py --workdir=DIR [--config.x=y ...]` (also the console
script `ppo-jax-dpo`): direct preference optimisation (DPO, conservative DPO, IPO) of a causal LM on
preference pairs, against the frozen initial model."""

from __future__ import annotations

from ppo_jax.cli.common import config_command
from ppo_jax.supervised.base import summary_line
from ppo_jax.supervised.dpo import DPOTrainer
from ppo_jax.supervised.settings import DPOSettings


def dpo(config, workdir: str) -> str:
    trainer = DPOTrainer(config, workdir)
    return summary_line(trainer, trainer.train())


def main(argv=None) -> None:
    config_command(dpo, schema=DPOSettings, what="DPO", example_config="configs/dpo.py", argv=argv)


if __name__ == "__main__":
    main()
