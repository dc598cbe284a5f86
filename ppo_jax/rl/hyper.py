"""What the compiled PPO steps close over, read from the settings once: the sizes a run has on its
mesh (`DerivedSizes`, made by `rl/sizes.derive_sizes`) and the static hyper-parameters (`PPOHyper`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ppo_jax.rl.corrections import off_policy_ratio

if TYPE_CHECKING:
    from ppo_jax.rl.settings import Settings


def loss_aggregation(setting: str, policy_objective: str) -> str:
    """ppo.loss_aggregation -> the mode: "auto" is each objective's paper's (GSPO's objective is a
    mean over responses; DAPO's token mean, the library's default, for the others)."""
    if setting != "auto":
        return setting
    return "sequence_mean" if policy_objective.startswith("gspo") else "token_mean"


@dataclasses.dataclass(frozen=True)
class DerivedSizes:
    """Sizes that follow from the settings and the mesh (`rl/sizes.derive_sizes` makes them)."""

    rollout_rows: int  # prompts * samples per prompt
    minibatch_rows: int
    microbatch_rows: int
    forward_rows: int
    packed_rows: int = 0  # packed rows per microbatch (M); 0 = packing off
    packed_length: int = 0  # slots per packed row (T = the padded row length)
    decode_slots: int = 0  # the continuous engine's decode rows; 0 = the static engine
    dense_kl_stored: bool = False  # the dense KL's reference log-probs come with the experience (rl/sizes.py)


@dataclasses.dataclass(frozen=True)
class PPOHyper:
    """Static hyper-parameters the steps close over (hashable, read from the settings once)."""

    temperature: float
    estimator: str
    gamma: float
    lam: float
    whiten_advantages: bool
    whiten_rewards: bool
    kl_estimator: str
    kl_in_reward: bool
    model_weight: float
    missing_stop: str
    missing_stop_value: float
    score_gain: float
    score_bias: float
    score_clip: float
    group_size: int
    epochs: int
    num_minibatches: int
    num_microbatches: int
    forward_microbatches: int
    clip_eps: float
    clip_eps_high: float | None
    dual_clip: float | None
    value_clip: float
    vf_coef: float
    ent_coef: float
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0
    packed_rows: int = 0  # packed rows per microbatch (M); 0 = padded rows
    packed_length: int = 0  # slots per packed row (T)
    teacher_coef: float = 0.0  # on-policy distillation: the per-token reverse-KL reward's weight (distill.coef)
    off_policy_ratio: str = ""  # "" = no correction; else one of rl/corrections.CORRECTIONS (ppo.off_policy_ratio)
    is_cap: float = 2.0
    scored_outside: bool = False  # roles.scoring="sampler": reference log-probs and model scores come with the rollout
    overlong_buffer: int = 0  # reward.overlong_buffer (0 = no overlong penalty)
    overlong_penalty: float = 0.0
    dense_kl_coef: float = 0.0  # ppo.dense_kl_coef (0 = no whole-vocabulary KL term, no reference forward in the update)
    # The dense KL's reference log-probs [B, Lr, V] kept by the experience step (Experience.ref_vocab_logprobs):
    # no reference forward in the update. False: recomputed per update microbatch.
    dense_kl_stored: bool = False
    policy_objective: str = "ppo"  # ppo.policy_objective (ppo/policy_objectives.OBJECTIVES)
    loss_aggregation: str = "token_mean"  # ppo.loss_aggregation, "auto" resolved (ppo/aggregation.py)
    grpo_divide_by_std: bool = True
    kl_cov_fraction: float = 0.002
    kl_cov_coef: float = 1.0
    fixed_minibatches: bool = False  # ppo.minibatch_order="fixed": every epoch visits one split of the rows
    entropy_target: float = 0.0  # > 0: the adaptive entropy coefficient (PPOState.entropy) replaces ent_coef

    @property
    def packed(self) -> bool:
        return self.packed_rows > 0

    def packed_shape(self, rows: int) -> tuple[int, int, int]:
        """(K, M, T) of `rows` padded rows packed: enough packed rows for the worst case (one each)."""
        return (-(-rows // self.packed_rows), self.packed_rows, self.packed_length)

    @classmethod
    def from_settings(cls, s: "Settings", sizes: DerivedSizes) -> "PPOHyper":
        p, r = s.ppo, s.reward
        return cls(
            temperature=s.rollout.temperature, estimator=p.advantage_estimator, gamma=p.gamma, lam=p.lam,
            whiten_advantages=p.whiten_advantages, whiten_rewards=p.whiten_rewards,
            kl_estimator=p.kl_estimator, kl_in_reward=p.kl_in_reward, model_weight=r.model_weight,
            missing_stop=r.missing_stop, missing_stop_value=r.missing_stop_value,
            overlong_buffer=r.overlong_buffer, overlong_penalty=r.overlong_penalty, score_gain=r.gain,
            score_bias=r.bias, score_clip=r.clip, group_size=s.rollout.num_samples, epochs=p.epochs,
            num_minibatches=p.num_minibatches, num_microbatches=p.num_microbatches,
            fixed_minibatches=p.minibatch_order == "fixed",
            forward_microbatches=sizes.rollout_rows // sizes.forward_rows, clip_eps=p.clip_eps,
            clip_eps_high=p.clip_eps_high or None, dual_clip=p.dual_clip or None, value_clip=p.value_clip,
            vf_coef=p.vf_coef, ent_coef=p.ent_coef, dense_kl_coef=p.dense_kl_coef,
            dense_kl_stored=sizes.dense_kl_stored, router_aux_coef=p.router_aux_coef,
            router_z_coef=p.router_z_coef, packed_rows=sizes.packed_rows,
            packed_length=sizes.packed_length,
            off_policy_ratio=off_policy_ratio(p.off_policy_ratio, s.rollout.off_policy_steps, p.policy_objective),
            is_cap=p.is_cap,
            scored_outside=s.roles.scoring == "sampler", policy_objective=p.policy_objective,
            loss_aggregation=loss_aggregation(p.loss_aggregation, p.policy_objective),
            grpo_divide_by_std=p.grpo_divide_by_std, kl_cov_fraction=p.kl_cov_fraction, kl_cov_coef=p.kl_cov_coef,
            entropy_target=p.entropy_target, teacher_coef=s.distill.coef if s.distill.enabled else 0.0)

    @property
    def recomputes_reference(self) -> bool:
        """The update runs the reference forward: the dense KL's reference, when the experience does
        not keep its log-probs."""
        return bool(self.dense_kl_coef) and not self.dense_kl_stored

    @property
    def uses_critic(self) -> bool:
        return self.estimator == "gae"
