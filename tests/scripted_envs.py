"""Scripted environments for the multi-turn trainer tests, importable by name in a config
("scripted_envs:Scripted", or the registered "scripted_test_env") from the test process and from
the workers of a real multi-process run (tests/multihost_worker.py)."""

import dataclasses
import time

from ppo_jax.agentic import environment
from ppo_jax.agentic.environment import StepResult


@environment.register("scripted_test_env")
class Scripted:
    """Each turn ends at "w3" or "w4"; answers 1-4 "w9" words by the turn's length, pays 0, 0.25 or
    0.5 a turn and ends the episode after 3 steps. Deterministic: what it answers depends on the
    tokens only."""

    stop_strings = ("w3", "w4")

    def reset(self, record):
        self.steps = 0
        return record["prompt"]

    def step(self, turn_text, turn_token_ids):
        self.steps += 1
        n = len(turn_token_ids)
        return StepResult(observation=" ".join(["w9"] * (1 + n % 4)), reward=0.25 * (n % 3),
                          done=self.steps >= 3, info={"tool_calls": 1.0, "tool_errors": float(n % 2)})


@environment.register("slow_scripted_test_env")
class SlowScripted(Scripted):
    """Scripted, 0.2 s a step: a batch of episodes takes at least that long after its first turn."""

    def step(self, turn_text, turn_token_ids):
        time.sleep(0.2)
        return super().step(turn_text, turn_token_ids)


SEGMENT_CLOCKS = []  # the slot rollouts' clocks, filed by conftest's `segment_clocks` fixture


@environment.register("slower_scripted_test_env")
class SlowerScripted(Scripted):
    """Scripted, stepping 1, 3 or 5 times (by the turn's length) the larger of 0.2 s and 5 decode
    segments as the slot rollout measures them (SEGMENT_CLOCKS; 0.2 s without one): far slower than a
    segment and far apart at any machine load, so episodes whose turns ended together do not answer
    together, and a slot schedule finds some still waiting and gives their slots up."""

    def step(self, turn_text, turn_token_ids):
        segment = SEGMENT_CLOCKS[-1].patience if SEGMENT_CLOCKS else 0.0
        time.sleep((1 + 2 * (len(turn_token_ids) % 3)) * max(0.2, 5 * segment))
        return super().step(turn_text, turn_token_ids)


@environment.register("failing_scripted_test_env")
class FailingScripted(Scripted):
    """Scripted, until 40 steps in all were taken (about two batches of episodes): then every step
    raises KeyError, a bug in the environment."""

    steps_taken = 0

    def step(self, turn_text, turn_token_ids):
        FailingScripted.steps_taken += 1
        if FailingScripted.steps_taken > 40:
            raise KeyError("no such tool")
        return super().step(turn_text, turn_token_ids)


@environment.register("stateful_scripted_test_env")
class StatefulScripted(Scripted):
    """Scripted whose answers also follow from the steps it took before: 1-4 "w9" words by the turn's
    length plus its step count, and 0.1 more reward a step. An environment restored mid-episode must
    be replayed through its turns to answer the next one alike."""

    def step(self, turn_text, turn_token_ids):
        result = super().step(turn_text, turn_token_ids)
        words = 1 + (len(turn_token_ids) + self.steps) % 4
        return dataclasses.replace(result, observation=" ".join(["w9"] * words), reward=result.reward + 0.1 * self.steps)

