"""`python -m ppo_jax.cli.sft --config=configs/sft.py --workdir=DIR [--config.x=y ...]` (also the console
script `ppo-jax-sft`): supervised fine-tuning from the config's data files and model."""

from __future__ import annotations

from ppo_jax.cli.common import config_command
from ppo_jax.supervised.settings import SFTSettings
from ppo_jax.supervised.base import summary_line
from ppo_jax.supervised.sft import SFTTrainer


def sft(config, workdir: str) -> str:
    trainer = SFTTrainer(config, workdir)
    return summary_line(trainer, trainer.train())


def main(argv=None) -> None:
    config_command(sft, schema=SFTSettings, what="SFT", example_config="configs/sft.py", argv=argv)


if __name__ == "__main__":
    main()
