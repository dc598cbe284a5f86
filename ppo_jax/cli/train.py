"""`python -m ppo_jax.cli.train --config=configs/ppo_toy.py --workdir=DIR [--config.x=y ...]` (also the
console script `ppo-jax-train`): a PPO run; the same command on the same workdir resumes it."""

from __future__ import annotations

import functools
import os

from ppo_jax import distributed
from ppo_jax.arithmetic import task as _arithmetic_task  # noqa: F401 (registers environment.name="arithmetic")
from ppo_jax.checkpoint import committed_steps
from ppo_jax.cli.common import config_command, fail
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.errors import NonFiniteError, RunFailedError, RunStopped
from ppo_jax.rl.trainer import PPOTrainer


def train(config, workdir: str) -> str:
    settings = Settings.from_config(config, reward_in_code=False)
    distributed.initialize(settings.distributed)  # before anything touches a device
    distributed.set_resume_hint(functools.partial(resume_hint, workdir))
    trainer = PPOTrainer(settings, workdir)
    try:
        history = trainer.train()
    except NonFiniteError as err:  # one line and a non-zero exit, never "done"
        fail(str(err))
    except RunFailedError as err:  # the last good state is saved; the traceback is in the workdir's error.log
        fail(str(err), code=1, cause=err.__cause__)
    if not history:  # a finished run relaunched (e.g. by a preemption script): nothing left to do
        return (f"already complete: checkpoint step {trainer.checkpoints.latest_step()} of "
                f"train.iterations={settings.train.iterations} in {trainer.checkpoints.directory}; "
                "raise train.iterations to continue it")
    if trainer.stopped_by:  # it said where it stopped and how to resume; the status says it stopped early
        raise RunStopped(trainer.stopped_by)
    first, last = history[0], history[-1]
    return (f"done: {len(history)} iterations, score {first['objective/scores']:.4f} -> "
            f"{last['objective/scores']:.4f}, KL {last['objective/kl']:.4f}; metrics in {trainer.writer.path}")


def resume_hint(workdir: str) -> str:
    """What a lost process's error line ends with: the newest complete checkpoint, and how to resume."""
    directory = os.path.join(workdir, "checkpoints")  # the trainer's (rl/checkpointing.py)
    steps = committed_steps(directory)
    if not steps:
        return (f"No checkpoint was saved yet in {directory}; run the same command again on every process "
                "to start the run over.")
    return (f"The last complete checkpoint is step {steps[-1]} in {directory}; run the same command again on "
            "every process to resume from it.")


def main(argv=None) -> None:
    config_command(train, schema=Settings, what="PPO", argv=argv)


if __name__ == "__main__":
    main()
