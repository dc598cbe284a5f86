"""The `ppo` section of a PPO config (`PPOLossSettings`): advantages, the batch split, the policy
objective and its losses, the KL leash; every field with its default and a one-line comment, and its
validation. `rl/settings.py` holds it as `Settings.ppo`; what the steps close over is `rl/hyper.py`.
"""

from __future__ import annotations

import dataclasses
import math

from ppo_jax.config import check
from ppo_jax.ppo.advantages import ESTIMATORS
from ppo_jax.ppo.aggregation import AGGREGATIONS
from ppo_jax.ppo.policy_objectives import OBJECTIVES
from ppo_jax.rl.corrections import OFF_POLICY_RATIOS, off_policy_ratio

PACKING = ("auto", "on", "off")
DENSE_KL_REFERENCES = ("auto", "experience", "recompute")
MINIBATCH_ORDERS = ("reshuffle", "fixed")


@dataclasses.dataclass(frozen=True)
class PPOLossSettings:
    """Advantages, KL leash and the clipped losses."""

    advantage_estimator: str = "gae"  # "gae", "grpo", "rloo" or "reinforce_pp"
    epochs: int = 4  # PPO epochs over each rollout batch
    num_minibatches: int = 1  # optimizer steps per epoch
    minibatch_order: str = "reshuffle"  # "reshuffle": a new random split into minibatches every epoch (PPO as Schulman et al. 2017, OpenAI baselines, TRL's PPOTrainer); "fixed": one random split, the same minibatches in the same order every epoch (TRL's GRPOTrainer with num_iterations > 1)
    num_microbatches: int = 1  # gradient-accumulation slices per minibatch (padded rows; packed: see max_tokens_per_microbatch)
    packing: str = "auto"  # "on": experience forwards and update on packed rows, only the real tokens computed (models/packing.py); "off": padded rows; "auto": on a CPU only (measured faster there whenever the rows hold padding; on an H200 the default granularity made a no-padding iteration 1.5x slower, long-tailed lengths unmeasured: docs/benchmarks.md). rollout.forward_microbatch applies to padded rows only
    gemm: str = "auto"  # GPU only, the experience and update programs (and roles.scoring=sampler's scoring), never the sampler's (rollout.gemm): "auto" (XLA's choice: autotuned Triton GEMMs), "cublas" (xla_gpu_enable_triton_gemm off: no Triton GEMM autotuning, a shorter compile), "triton_exhaustive" (every Triton tiling autotuned; compiles slower); bench_accel.py --train-gemm measures it (docs/benchmarks.md)
    max_tokens_per_microbatch: int = 0  # packed: token slots per update microbatch and per experience forward chunk, a multiple of data.prompt_length + rollout.response_length (one row); 0 = an eighth of a padded microbatch's (bench/bench_packing.py: 0.90 token efficiency, 1.57x on CPU at uniform lengths)
    off_policy_ratio: str = "auto"  # the rollout correction for a sampler whose weights (rollout.off_policy_steps) or numerics differ from the trainer's, w = pi_trainer / pi_sampler (docs/off_policy.md): "none"; "behaviour": the ratio's denominator is the sampler's log-probs; "truncated_is" / "sequence_truncated_is": the ratio to the trainer's recomputed log-probs, each token's advantage weighted by min(w, ppo.is_cap), w per token or the row's product; "masked_is" / "sequence_masked_is": weighted by w, 0 (dropped) outside [1/is_cap, is_cap]; "auto": none on-policy, off-policy truncated_is (sequence_truncated_is with policy_objective=gspo)
    is_cap: float = 2.0  # the truncated_is cap of the importance weight, and the masked_is bounds [1/is_cap, is_cap] (>= 1; > 1 for masked_is)
    clip_eps: float = 0.2  # policy ratio clip (lower side, and upper side unless clip_eps_high is set)
    clip_eps_high: float = 0.0  # upper ratio clip for asymmetric clipping; 0 = same as clip_eps
    dual_clip: float = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    policy_objective: str = "ppo"  # the policy loss (docs/ablations.md, "Objectives"): "ppo": the clipped token ratio (Schulman et al. 2017); "gspo": the clipped length-normalised sequence ratio, one per response (GSPO, Zheng et al. 2025; with grpo or rloo; its clip_eps ~3e-4); "gspo_token": GSPO-token, the same ratio with per-token advantages (same paper); "cispo": the clipped importance weight, stopped, times the log-prob: every token keeps a gradient (CISPO, MiniMax-M1 2025; ppo.clip_eps >= 1: no lower bound, as the paper); "kl_cov": the unclipped ratio plus a KL penalty on the tokens whose log-prob covaries most with their advantage (KL-Cov, Cui et al. 2025)
    loss_aggregation: str = "auto"  # how token losses make the minibatch loss: "token_mean": sum / tokens (DAPO, Yu et al. 2025); "sequence_mean": the mean over responses of their token means (GRPO, Shao et al. 2024); "constant": sum / (rows x rollout.response_length) (Dr. GRPO, Liu et al. 2025); "auto": sequence_mean for gspo and gspo_token (GSPO's objective), token_mean otherwise
    grpo_divide_by_std: bool = True  # grpo advantages: the group-centred reward divided by the group's std (DeepSeekMath); False: centred only (Dr. GRPO, Liu et al. 2025)
    kl_cov_fraction: float = 0.002  # kl_cov: the share of a minibatch's tokens penalised, those with the largest Cov(log-prob, advantage) (the paper's k: 2e-3; 2e-4 for 32B models)
    kl_cov_coef: float = 1.0  # kl_cov: the coefficient of |log pi - log pi_old| on the selected tokens (the paper's beta)
    entropy_target: float = 0.0  # adaptive entropy coefficient (Skywork-OR1, He et al. 2025): the target mean token entropy in nats; the bonus's coefficient starts at ppo.ent_coef, rises by ppo.entropy_coef_step each iteration whose rollout's entropy is below the target, falls above it, and acts only at or below it; 0 = off (ppo.ent_coef fixed)
    entropy_coef_step: float = 0.005  # the adaptive entropy coefficient's change per iteration (with ppo.entropy_target)
    value_clip: float = 0.2  # value prediction clip range
    vf_coef: float = 0.1  # value loss coefficient
    ent_coef: float = 0.0  # entropy bonus coefficient
    router_aux_coef: float = 0.0  # MoE policies: load-balancing loss coefficient (transformers' router_aux_loss_coef, e.g. 0.001); 0 = off, as the families fine-tune
    router_z_coef: float = 0.0  # MoE policies: router z-loss coefficient (ST-MoE, e.g. 0.001); 0 = off
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # masked whitening of advantages
    whiten_rewards: bool = False  # masked whitening of per-token rewards before GAE
    kl_estimator: str = "k1"  # per-token KL estimator: "k1", "k2" or "k3"
    kl_in_reward: bool = True  # KL as a per-token reward penalty (True) or as a loss term (False)
    kl_controller: str = "fixed"  # "fixed" or "adaptive" (Ziegler et al. 2019)
    kl_coef: float = 0.05  # initial KL coefficient beta
    kl_target: float = 6.0  # adaptive controller target KL (per sequence)
    kl_horizon: int = 10000  # adaptive controller horizon (samples)
    dense_kl_coef: float = 0.0  # coefficient of the exact whole-vocabulary KL(pi || pi_ref) at every visited response position, a loss term beside kl_coef's sampled-token KL (ppo/losses.dense_kl_loss; docs/demo.md "The spike"); 0 = off
    dense_kl_reference: str = "auto"  # where the dense KL's reference distribution comes from: "experience": the experience step's reference forward keeps its log-probs over the vocabulary, [rows, response_length, V] float32 held through the update (no reference forward in the update); "recompute": one reference forward per update microbatch; "auto": experience when that array is at most 256 MiB per data-parallel device (rl/sizes.py), else recompute

    @property
    def uses_critic(self) -> bool:
        """GAE needs the value model; the group and REINFORCE estimators do without."""
        return self.advantage_estimator == "gae"

    def validate(self, *, num_samples: int, off_policy_steps: int, scoring: str) -> None:
        """ppo.*: the rollout correction, the estimator, the batch split, the losses and the KL leash.
        num_samples: rollout.num_samples; off_policy_steps: rollout.off_policy_steps; scoring:
        roles.scoring (ppo.gemm is checked with rollout.gemm, `Settings`)."""
        p = self
        check(p.off_policy_ratio in OFF_POLICY_RATIOS,
              f"ppo.off_policy_ratio={p.off_policy_ratio!r}: use one of {', '.join(OFF_POLICY_RATIOS)}")
        check(p.is_cap >= 1 and math.isfinite(p.is_cap), f"ppo.is_cap must be a finite number >= 1, got {p.is_cap}")
        check(not (p.off_policy_ratio.endswith("masked_is") and p.is_cap == 1),
              f"ppo.is_cap=1 with ppo.off_policy_ratio={p.off_policy_ratio}: the kept band [1/is_cap, is_cap] is the "
              "single ratio 1, so nearly every token is dropped; use ppo.is_cap > 1 (e.g. 2), or truncated_is")
        check(p.advantage_estimator in ESTIMATORS,
              f"ppo.advantage_estimator={p.advantage_estimator!r}: use one of {', '.join(ESTIMATORS)}")
        if p.advantage_estimator in ("grpo", "rloo"):
            check(num_samples >= 2, f"ppo.advantage_estimator={p.advantage_estimator!r} compares "
                  f"samples of the same prompt: set rollout.num_samples >= 2 (got {num_samples})")
        check(p.epochs >= 1, f"ppo.epochs must be >= 1, got {p.epochs}")
        check(p.minibatch_order in MINIBATCH_ORDERS,
              f"ppo.minibatch_order must be one of {', '.join(MINIBATCH_ORDERS)}, got {p.minibatch_order!r}")
        check(p.num_minibatches >= 1, f"ppo.num_minibatches must be >= 1, got {p.num_minibatches}")
        check(p.num_microbatches >= 1, f"ppo.num_microbatches must be >= 1, got {p.num_microbatches}")
        check(p.packing in PACKING, f"ppo.packing={p.packing!r}: use one of {', '.join(PACKING)}")
        check(p.max_tokens_per_microbatch >= 0,
              f"ppo.max_tokens_per_microbatch must be >= 0 (0 = an eighth of a padded microbatch), got "
              f"{p.max_tokens_per_microbatch}")
        check(p.clip_eps > 0, f"ppo.clip_eps must be > 0, got {p.clip_eps}")
        check(p.clip_eps_high >= 0, f"ppo.clip_eps_high must be >= 0 (0 = same as clip_eps), got {p.clip_eps_high}")
        check(p.dual_clip == 0 or p.dual_clip > 1, f"ppo.dual_clip must be 0 (off) or > 1, got {p.dual_clip}")
        check(p.value_clip > 0, f"ppo.value_clip must be > 0, got {p.value_clip}")
        self._validate_objective(off_policy_steps)
        check(p.router_aux_coef >= 0 and p.router_z_coef >= 0,
              f"ppo.router_aux_coef and ppo.router_z_coef must be >= 0, got {p.router_aux_coef} and {p.router_z_coef}")
        check(0 <= p.gamma <= 1, f"ppo.gamma must be in [0, 1], got {p.gamma}")  # 0: each token its own reward (the distillation recipe)
        check(0 <= p.lam <= 1, f"ppo.lam must be in [0, 1], got {p.lam}")
        check(p.kl_estimator in ("k1", "k2", "k3"), f"ppo.kl_estimator={p.kl_estimator!r}: use k1, k2 or k3")
        check(p.kl_controller in ("fixed", "adaptive"), f"ppo.kl_controller={p.kl_controller!r}: use fixed or adaptive")
        check(p.kl_coef >= 0, f"ppo.kl_coef must be >= 0, got {p.kl_coef}")
        check(p.dense_kl_coef >= 0, f"ppo.dense_kl_coef must be >= 0 (0 = off), got {p.dense_kl_coef}")
        check(p.dense_kl_coef == 0 or scoring == "trainer",
              "ppo.dense_kl_coef needs the reference on the trainer's mesh (its logits enter the update), but "
              "roles.scoring=sampler moves it to the sampler's; use roles.scoring=trainer or ppo.dense_kl_coef=0")
        check(p.dense_kl_reference in DENSE_KL_REFERENCES,
              f"ppo.dense_kl_reference={p.dense_kl_reference!r}: use one of {', '.join(DENSE_KL_REFERENCES)}")
        if p.kl_controller == "adaptive":
            check(p.kl_target > 0 and p.kl_horizon > 0,
                  "ppo.kl_target and ppo.kl_horizon must be > 0 for the adaptive controller")

    def _validate_objective(self, off_policy_steps: int) -> None:
        """ppo.policy_objective, ppo.loss_aggregation and entropy control: each value, and the
        combinations that do not compose (docs/ablations.md, "Objectives")."""
        p = self
        objective = p.policy_objective
        correction = off_policy_ratio(p.off_policy_ratio, off_policy_steps, objective)
        check(objective in OBJECTIVES, f"ppo.policy_objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
        check(p.loss_aggregation in ("auto",) + AGGREGATIONS,
              f"ppo.loss_aggregation={p.loss_aggregation!r}: use auto or one of {', '.join(AGGREGATIONS)}")
        check(objective != "gspo" or p.advantage_estimator in ("grpo", "rloo"),
              f"ppo.policy_objective=gspo clips one ratio per response against one advantage per response, but "
              f"ppo.advantage_estimator={p.advantage_estimator} gives one per token: use grpo or rloo, or gspo_token")
        check(objective != "gspo" or correction in ("", "behaviour") or correction.startswith("sequence_"),
              f"ppo.policy_objective=gspo with ppo.off_policy_ratio={correction}: a per-token weight varies the "
              "advantage inside a response GSPO clips as one; use sequence_truncated_is, sequence_masked_is, "
              "behaviour, or gspo_token")
        check(objective == "ppo" or not p.dual_clip,
              f"ppo.dual_clip bounds PPO's clipped token ratio; ppo.policy_objective={objective} has none: set "
              "ppo.dual_clip=0")
        check(objective != "kl_cov" or not p.clip_eps_high,
              "ppo.policy_objective=kl_cov clips nothing (KL-Cov replaces the clip): set ppo.clip_eps_high=0")
        check(objective == "cispo" or p.clip_eps < 1,
              f"ppo.clip_eps={p.clip_eps}: the ratio is clipped to [1 - clip_eps, ...], so it must be < 1 (only "
              "cispo takes >= 1, as no lower bound)")
        check(0 < p.kl_cov_fraction <= 1 and p.kl_cov_coef >= 0,
              f"ppo.kl_cov_fraction must be in (0, 1] and ppo.kl_cov_coef >= 0, got {p.kl_cov_fraction} and "
              f"{p.kl_cov_coef}")
        check(p.grpo_divide_by_std or p.advantage_estimator == "grpo",
              f"ppo.grpo_divide_by_std=False (Dr. GRPO) changes grpo's advantages; ppo.advantage_estimator="
              f"{p.advantage_estimator}: set it to grpo, or leave grpo_divide_by_std True")
        check(p.entropy_target >= 0 and p.entropy_coef_step > 0,
              f"ppo.entropy_target must be >= 0 (0 = off) and ppo.entropy_coef_step > 0, got {p.entropy_target} "
              f"and {p.entropy_coef_step}")
        check(not p.entropy_target or p.ent_coef >= 0,
              f"ppo.entropy_target: the adaptive coefficient starts at ppo.ent_coef, which must be >= 0, got {p.ent_coef}")
