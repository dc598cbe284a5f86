"""Direct preference optimisation losses: pure array math on per-sequence log-probs, no model or mesh.

Inputs are log pi(y | x) summed over each response's tokens (prompt and padding excluded), for the
policy (differentiated) and the frozen reference (constants), chosen and rejected, and each response's
token count: `Pair`s, each field [B]. With h = (pi_c - ref_c) - (pi_r - ref_r), the log-ratio margin:

  sigmoid  (DPO, Rafailov et al. 2023):   -log sigmoid(beta h)
  sigmoid with label_smoothing = eps     -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
           (conservative DPO, Mitchell 2023: each label flipped with probability eps)
  ipo      (Azar et al. 2023, eq. 17):   (h_bar - 1 / (2 beta))^2, h_bar the same margin of per-token
           mean log-ratios (each side divided by its response length, as TRL does and as the IPO
           authors' reported results were computed; summed log-ratios would scale with length)

and optionally `sft_coef` times the chosen responses' token-mean negative log-likelihood (RPO, Pang et
al. 2024; TRL's rpo_alpha).

Reduction: the pair loss is summed over this call's pairs and divided by `num_pairs`, the NLL term by
`num_tokens` (defaults: this call's own counts). Pass the whole batch's counts when gradients are
accumulated over microbatches: the microbatch losses (and gradients) then add up to the full-batch
ones exactly. Metrics are `SumCount`s over pairs (pool them with `+`, read with
`ppo_jax.ppo.stats.finalize_metrics`); names are TRL's: rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, and nll_loss with an SFT term.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.ppo.stats import SumCount

Array = jax.Array

LOSS_TYPES = ("sigmoid", "ipo")


@flax.struct.dataclass
class Pair:
    """One value per answer of each pair (summed log-probs, or response token counts): chosen [B],
    rejected [B]."""

    chosen: Array
    rejected: Array


def pair_losses(policy: Pair, reference: Pair, tokens: Pair, *, loss_type: str, beta: float,
                label_smoothing: float = 0.0) -> Array:
    """Per-pair loss [B] (module docstring); log-probs and token counts as `Pair`s of [B]."""
    chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    if loss_type == "sigmoid":
        margin = beta * (chosen_ratio - rejected_ratio)
        # softplus(-x) = -log sigmoid(x), stable for large |x|.
        return (1.0 - label_smoothing) * jax.nn.softplus(-margin) + label_smoothing * jax.nn.softplus(margin)
    if loss_type == "ipo":
        margin = (chosen_ratio / jnp.maximum(tokens.chosen, 1.0)
                  - rejected_ratio / jnp.maximum(tokens.rejected, 1.0))
        return jnp.square(margin - 1.0 / (2.0 * beta))
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def dpo_loss(policy: Pair, reference: Pair, tokens: Pair, *, loss_type: str = "sigmoid", beta: float = 0.1,
             label_smoothing: float = 0.0, sft_coef: float = 0.0, weight: Array | None = None,
             num_pairs: Array | float | None = None,
             num_tokens: Array | float | None = None) -> tuple[Array, dict[str, SumCount]]:
    """(loss [], metrics) for a batch of pairs.

    policy: summed response log-probs, Pair [B] (differentiated); reference: the same under the
    frozen reference (treated as constants); tokens: response token counts, Pair [B].
    weight [B]: 1 for real pairs, 0 for filler rows (default all 1).
    num_pairs / num_tokens: normalisers of the pair loss / the NLL term (module docstring).
    """
    reference = jax.tree.map(jax.lax.stop_gradient, reference)
    weight = jnp.ones_like(policy.chosen) if weight is None else weight.astype(jnp.float32)
    chosen_reward = beta * (policy.chosen - reference.chosen)  # the implicit reward, as TRL logs it
    rejected_reward = beta * (policy.rejected - reference.rejected)
    per_pair = pair_losses(policy, reference, tokens, loss_type=loss_type, beta=beta,
                           label_smoothing=label_smoothing)

    pairs = weight.sum() if num_pairs is None else jnp.asarray(num_pairs, jnp.float32)
    loss = (per_pair * weight).sum() / jnp.maximum(pairs, 1.0)
    metrics = {
        "rewards/chosen": SumCount.of(chosen_reward, weight),
        "rewards/rejected": SumCount.of(rejected_reward, weight),
        "rewards/accuracies": SumCount.of(chosen_reward > rejected_reward, weight),  # a tie counts as wrong
        "rewards/margins": SumCount.of(chosen_reward - rejected_reward, weight),
        "logps/chosen": SumCount.of(policy.chosen, weight),
        "logps/rejected": SumCount.of(policy.rejected, weight),
        "pair_loss": SumCount.of(per_pair, weight),
    }
    if sft_coef:
        real_tokens = (tokens.chosen * weight).astype(jnp.float32)
        tokens = real_tokens.sum() if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
        nll = -(policy.chosen * weight).sum()
        loss = loss + sft_coef * nll / jnp.maximum(tokens, 1.0)
        metrics["nll_loss"] = SumCount(total=nll, count=real_tokens.sum())  # token mean over chosen answers
    return loss, metrics
