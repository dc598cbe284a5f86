"""The dynamic_sampling config section (DAPO's dynamic sampling: rl/dynamic_sampling.py)."""

from __future__ import annotations

import dataclasses

from ppo_jax.config import check


@dataclasses.dataclass(frozen=True)
class DynamicSamplingSettings:
    """DAPO's dynamic sampling (rl/dynamic_sampling.py)."""

    enabled: bool = False  # drop the groups whose rewards are all equal (zero group-relative advantage) and refill the batch with more prompts' groups, sampled with the current weights (DAPO, Yu et al. 2025, §3.2); needs rollout.num_samples >= 2
    max_extra_batches: int = 3  # at most this many extra batches of rollout.batch_size prompts an iteration; a batch still short is filled with dropped groups (logged)

    def validate(self, *, num_samples: int, multi_turn: bool, reward_model: bool, scoring: str) -> None:
        if not self.enabled:
            return
        check(self.max_extra_batches >= 1,
              f"dynamic_sampling.max_extra_batches must be >= 1, got {self.max_extra_batches}")
        check(num_samples >= 2, f"dynamic_sampling.enabled needs groups: rollout.num_samples >= 2, got {num_samples}")
        check(not multi_turn, "dynamic_sampling.enabled with environment.name: multi-turn episodes are not refilled "
                              "yet; turn dynamic_sampling off")
        check(not reward_model or scoring == "sampler",
              "dynamic_sampling.enabled with a reward model (reward.path) scored in the trainer's experience step: "
              "the groups are chosen when sampled, so set roles.scoring=sampler (with a sampler mesh of its own) "
              "or use reward.functions")
