"""The distill config section: on-policy distillation from a frozen teacher (rl/forwards.py runs its
forward in the experience step; rl/experience.py turns its log-probs into per-token rewards)."""

from __future__ import annotations

import dataclasses

from ppo_jax.config import check


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025, "On-policy
    distillation"): a frozen teacher scores the student's own samples, and each response token's
    reward is minus the reverse KL estimate log pi_student(y_t) - log pi_teacher(y_t), times `coef`;
    alone, or beside the task reward (reward.path / reward.functions / an environment)."""

    teacher_path: str = ""  # the teacher: a Hugging Face causal LM directory with the policy's tokenizer (e.g. a larger SFT run's <workdir>/hf); "" = no distillation
    coef: float = 1.0  # weight of the per-token reverse-KL reward (the recipe: ppo.advantage_estimator=reinforce_pp with ppo.gamma=0, each token's advantage its own term)
    param_dtype: str = ""  # dtype the teacher is held in ("" = the policy's parameter dtype)
    dtype: str = ""  # the teacher's compute dtype ("" = the policy's)

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_path)

    def validate(self, *, scoring: str, dtypes: tuple[str, ...]) -> None:
        check(self.coef >= 0, f"distill.coef must be >= 0, got {self.coef}")
        for field in ("param_dtype", "dtype"):
            value = getattr(self, field)
            check(value in dtypes, f"distill.{field}={value!r}: use one of {dtypes} (\"\" = the policy's)")
        check(not self.enabled or scoring == "trainer",
              "distill.teacher_path with roles.scoring=sampler: the teacher's forward runs in the trainer's "
              "experience step; set roles.scoring=trainer")
