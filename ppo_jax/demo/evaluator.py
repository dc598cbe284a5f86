"""The gold evaluation during PPO: the current policy answers fixed held-out prompts and the hidden
gold reward (which PPO never sees) judges the answers, beside the reward model's score and the KL to
the SFT reference.

The sampling is `ppo_jax.rl.held_out.HeldOutSampler`'s (the trainer's public API only); this module
judges what it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ppo_jax.demo.world import World
from ppo_jax.rl.held_out import HeldOutSampler
from ppo_jax.rl.trainer import PPOTrainer


@dataclasses.dataclass
class EvalPoint:
    """The policy on the held-out prompts at one PPO iteration."""

    step: int
    gold: float  # mean gold reward
    rm_score: float  # mean reward-model score (normalised: the SFT policy's samples average 0)
    kl: float  # mean KL(policy || SFT reference) per response, nats (k1, as PPO logs it)
    eos_rate: float  # share of responses that stopped within the budget
    length: float  # mean response length in tokens (EOS included)


class PolicyEvaluator:
    """The current policy on fixed held-out prompts (`HeldOutSampler`: fixed keys, so successive
    evaluations differ only because the policy did), judged by gold reward, RM score and KL to the
    reference: means over every sample (rollout.num_samples per prompt)."""

    def __init__(self, trainer: PPOTrainer, world: World, prompts: Sequence[str], seed: int):
        self.trainer, self.world = trainer, world
        self.sampler = HeldOutSampler(trainer, prompts, seed)

    def __call__(self, step: int) -> tuple[EvalPoint, list[dict[str, Any]]]:
        stop_ids = tuple(self.trainer.stop_ids)
        rows: list[dict[str, Any]] = []
        for sample in self.sampler():
            text, stopped = self.world.decode_response(sample.tokens, stop_ids)
            rows.append({"prompt": sample.prompt, "response": text, "stopped": bool(stopped),
                         "gold": self.world.gold(sample.prompt, text, stopped), "rm_score": sample.rm_score,
                         "kl": sample.kl, "length": sample.length})
        point = EvalPoint(step=step, gold=float(np.mean([r["gold"] for r in rows])),
                          rm_score=float(np.mean([r["rm_score"] for r in rows])),
                          kl=float(np.mean([r["kl"] for r in rows])),
                          eos_rate=float(np.mean([r["stopped"] for r in rows])),
                          length=float(np.mean([r["length"] for r in rows])))
        return point, rows
