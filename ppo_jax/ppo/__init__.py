"""PPO math as pure jax.numpy functions over padded [B, L] arrays (no model or mesh imports)."""

from ppo_jax.ppo.advantages import (
    ESTIMATORS,
    estimate_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_rewards,
)
from ppo_jax.ppo.aggregation import AGGREGATIONS, minibatch_normaliser, token_denominators
from ppo_jax.ppo.entropy_control import (
    CovarianceSelection,
    EntropyControllerState,
    covariance_selection,
    entropy_coef,
    init_entropy_controller,
    kl_cov_loss,
    update_entropy_controller,
)
from ppo_jax.ppo.gae import AdvantageEstimate, discounted_returns, gae
from ppo_jax.ppo.kl import (
    KLControllerState,
    init_kl_controller,
    kl_penalty,
    update_kl_controller,
)
from ppo_jax.ppo.losses import dense_kl_loss, entropy_from_logits, entropy_loss, kl_loss, policy_loss, value_loss
from ppo_jax.ppo.policy_objectives import OBJECTIVES, cispo_loss, gspo_loss
from ppo_jax.ppo.sequences import sequence_mean, sequence_sum
from ppo_jax.ppo.shaping import overlong_penalty, process_scores, shape_rewards, whiten_rewards
from ppo_jax.ppo.stats import (
    Moments,
    SumCount,
    add_metrics,
    finalize_metrics,
    last_token_index,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "AGGREGATIONS", "OBJECTIVES", "CovarianceSelection", "EntropyControllerState", "cispo_loss",
    "covariance_selection", "entropy_coef", "gspo_loss", "init_entropy_controller", "kl_cov_loss",
    "minibatch_normaliser", "sequence_mean", "sequence_sum", "token_denominators", "update_entropy_controller",
    "ESTIMATORS", "AdvantageEstimate", "KLControllerState", "Moments", "SumCount", "add_metrics",
    "dense_kl_loss", "discounted_returns", "entropy_from_logits", "entropy_loss", "estimate_advantages",
    "finalize_metrics", "gae", "grpo_advantages", "init_kl_controller", "kl_loss", "kl_penalty",
    "last_token_index", "masked_count", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "overlong_penalty",
    "policy_loss", "process_scores", "rloo_advantages", "sequence_rewards", "shape_rewards",
    "update_kl_controller", "value_loss", "whiten_rewards",
]
