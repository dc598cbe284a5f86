"""Command line: `python -m ppo_jax.train --config=configs/ppo_toy.py --workdir=DIR [--config.x=y ...]`.

The config is locked, so a misspelled override fails instead of being silently ignored.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file (get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, samples and checkpoints.")


def main(argv):
    del argv
    from ppo_jax import config as config_lib, distributed

    config = _CONFIG.value
    distributed.initialize(config)  # before anything touches a device
    from ppo_jax.trainer import PPOTrainer

    try:
        trainer = PPOTrainer(config, _WORKDIR.value)
    except (config_lib.ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    history = trainer.train()
    last = history[-1]
    print(f"done: {len(history)} iterations, score {last['objective/scores']:.4f}, "
          f"KL {last['objective/kl']:.4f}; metrics in {trainer.writer.path}")


def run():
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)


if __name__ == "__main__":
    run()
