"""What a PPO run knows about non-finite numbers, and when it stops for them.

`NonFiniteGuard` holds the streak of consecutive iterations whose updates were skipped for non-finite
losses, gradients or rewards (`streak`) and the newest step whose parameters passed the finiteness
check (`checked_step`): the only state an emergency save may write. It reads the update's
`nonfinite/*` scalars, writes the offending samples, and raises `NonFiniteError` naming the last
good checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.checkpoint import CheckpointManager
from ppo_jax.rl.errors import NonFiniteError
from ppo_jax.rl.state import Experience, Rollout

NONFINITE_SAMPLES_FILE = "nonfinite_samples.jsonl"


class NonFiniteGuard:
    """The finiteness record of a run (see the module docstring)."""

    def __init__(self, workdir: str, checkpoints: CheckpointManager, limit: int, checked_step: int | None):
        """limit: train.max_consecutive_nonfinite; checked_step: the step resumed from (None: fresh)."""
        self.workdir, self.checkpoints, self.limit = workdir, checkpoints, limit
        self.streak = 0
        self.checked_step = checked_step

    @property
    def healthy(self) -> bool:
        """No skipped update since the last good one."""
        return self.streak == 0

    @property
    def samples_path(self) -> str:
        return os.path.join(self.workdir, NONFINITE_SAMPLES_FILE)

    def _last_good(self, intact: bool = False) -> str:
        self.checkpoints.wait()
        last = self.checkpoints.latest_step()
        if last is None:
            return "no checkpoint was saved"
        if intact:
            return f"the last good checkpoint, step {last} in {self.checkpoints.directory}, is intact"
        return f"the last good checkpoint is step {last} in {self.checkpoints.directory}"

    def check_state(self, step: int, scalars: dict[str, float]) -> None:
        """Stops (saving nothing) when the update produced non-finite parameters; else step `step`'s
        parameters are the newest checked ones."""
        if scalars.get("nonfinite/state", 0.0) != 0.0:
            raise NonFiniteError(
                f"iteration {step}'s update produced non-finite parameters from finite gradients (check "
                f"optim.policy_lr / optim.value_lr and the Adam settings); the state was not saved; "
                f"{self._last_good()}")
        self.checked_step = step

    def count_skipped(self, step: int, scalars: dict[str, float], rollout: Rollout, exp: Experience,
                      decode: Callable) -> None:
        """Counts skipped updates, writes the offending samples (decode: host arrays -> prompt and
        response texts), stops after `limit` in a row."""
        if scalars.get("nonfinite/skipped_minibatches", 0.0) == 0.0:
            self.streak = 0
            return
        self.streak += 1
        host = sharding.to_host({"s": exp.scores, "a": exp.advantages, "old": exp.old_logprobs,
                                 "pt": rollout.prompt_tokens, "pm": rollout.prompt_mask,
                                 "t": rollout.tokens, "m": rollout.mask})
        # The source first: a bad score or log-prob; advantages are whitened over the whole batch,
        # so one bad row makes them all non-finite.
        rows = np.arange(min(8, len(host["s"])))
        for bad in (~np.isfinite(host["s"]), ~np.isfinite(host["old"]).all(-1), ~np.isfinite(host["a"]).all(-1)):
            if bad.any():
                rows = np.nonzero(bad)[0]
                break
        prompts, responses = decode(host["pt"][rows], host["pm"][rows], host["t"][rows], host["m"][rows])
        metrics_lib.write_samples(self.workdir, step, [
            {"row": int(r), "prompt": p, "response": t, "score": float(host["s"][r])}
            for r, p, t in zip(rows, prompts, responses)], filename=NONFINITE_SAMPLES_FILE)
        if self.streak >= self.limit:
            raise NonFiniteError(
                f"{self.streak} consecutive iterations had non-finite losses, gradients or "
                f"rewards (their updates were skipped; the samples are in {self.samples_path}); "
                f"{self._last_good(intact=True)}")

    def may_save(self, step: int) -> bool:
        """Whether step `step`'s state may be saved in an emergency: it passed the finiteness check and
        no streak of skipped updates is in flight (a streak is never saved mid-run)."""
        return step == self.checked_step and self.healthy

    def ended_unhealthy(self, step: int) -> NonFiniteError:
        """The error of a run whose last iterations' updates were all skipped (their final save kept
        the parameters from before them)."""
        return NonFiniteError(
            f"the run ended on {self.streak} iteration(s) whose updates were skipped "
            f"for non-finite losses, gradients or rewards (samples in {self.samples_path}); checkpoint step "
            f"{step} in {self.checkpoints.directory} holds the parameters from before them")
