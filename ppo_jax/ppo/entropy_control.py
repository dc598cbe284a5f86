"""Entropy control: an entropy coefficient steered toward a target entropy, and KL-Cov's penalty on
the tokens whose log-probability covaries most with their advantage.

Adaptive coefficient (Skywork-OR1, He et al. 2025, "Skywork Open Reasoner 1 Technical Report",
adaptive entropy control). With e_k the mean token entropy of iteration k's rollout under the policy
about to be updated, tgt the target and D the step:
    alpha_k   = c_k * 1[e_k <= tgt]                    the coefficient of the entropy bonus this update
    c_{k+1}   = max(c_k + D * sign(tgt - e_k), 0)      up while below the target, down while above
so the bonus acts only when the entropy has fallen to the target, and grows until it holds there.
The state lives in arrays (`EntropyControllerState`): inside jit and in checkpoints.

KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", the KL-Cov loss). Per token of the batch, the centred cross-product
    Cov_t = (log pi(y_t) - mean_j log pi(y_j)) * (A_t - mean_j A_j)
drives the entropy change; the top k = max(1, floor(fraction * N)) tokens by Cov (N real tokens) get
a KL penalty, and no token is clipped:
    l_t = -A_t r_t + coef * |log pi(y_t) - log pi_old(y_t)| * 1[t in top k]
Here the batch is the minibatch and the selection reads the rollout's log-probs (old_logp), so it is
fixed before any microbatch runs and the microbatches add up to the minibatch (the paper's
implementation selects per microbatch under the current weights; on the first minibatch the two
agree). Tokens tied with the k-th covariance are all selected.

Shapes: R rows of a minibatch, B rows of a microbatch (or packed rows), L positions.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.ppo.losses import ratio_metrics, token_normalised
from ppo_jax.ppo.stats import SumCount, check_same_shape, masked_mean

Array = jax.Array


@flax.struct.dataclass
class EntropyControllerState:
    """The adaptive entropy coefficient's state; float32 scalars."""

    coef: Array  # c_k
    target: Array  # the target mean token entropy (nats)
    step: Array  # D, the change of c per iteration


def init_entropy_controller(init_coef: float, target: float, step: float) -> EntropyControllerState:
    if not (init_coef >= 0 and target > 0 and step > 0):
        raise ValueError(f"the adaptive entropy coefficient needs init_coef >= 0, target > 0 and step > 0, got "
                         f"{init_coef}, {target} and {step}")
    scalar = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return EntropyControllerState(coef=scalar(init_coef), target=scalar(target), step=scalar(step))


def entropy_coef(state: EntropyControllerState, entropy: Array) -> Array:
    """alpha_k [] for the observed mean token entropy e_k []."""
    return jnp.where(jnp.asarray(entropy, jnp.float32) <= state.target, state.coef, 0.0)


def update_entropy_controller(state: EntropyControllerState, entropy: Array) -> EntropyControllerState:
    """c_{k+1} from c_k and e_k (unchanged when e_k is exactly the target)."""
    direction = jnp.sign(state.target - jnp.asarray(entropy, jnp.float32))
    return state.replace(coef=jnp.maximum(state.coef + state.step * direction, 0.0))


@flax.struct.dataclass
class CovarianceSelection:
    """KL-Cov's selection over a minibatch: the means Cov_t is centred by and the k-th largest Cov."""

    mean_logp: Array  # []
    mean_advantage: Array  # []
    threshold: Array  # [] tokens with Cov_t >= threshold are penalised


def _covariance(selection: CovarianceSelection, old_logp: Array, advantages: Array) -> Array:
    return (old_logp - selection.mean_logp) * (advantages - selection.mean_advantage)


def covariance_selection(old_logp: Array, advantages: Array, mask: Array, fraction: float) -> CovarianceSelection:
    """KL-Cov's top-k selection over the whole minibatch: old_logp, advantages, mask [R, L]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"KL-Cov's fraction of tokens must be in (0, 1], got {fraction}")
    check_same_shape(old_logp=old_logp, advantages=advantages, mask=mask)
    old_logp, advantages = jnp.asarray(old_logp, jnp.float32), jnp.asarray(advantages, jnp.float32)
    real = jnp.asarray(mask) != 0
    means = CovarianceSelection(masked_mean(old_logp, real), masked_mean(advantages, real), jnp.float32(0))
    cov = jnp.where(real, _covariance(means, old_logp, advantages), -jnp.inf).reshape(-1)
    count = real.sum()
    k = jnp.maximum(jnp.floor(fraction * count.astype(jnp.float32)).astype(jnp.int32), 1)
    return means.replace(threshold=jnp.sort(cov)[::-1][jnp.minimum(k, cov.size) - 1])


def kl_cov_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, selection: CovarianceSelection, *,
                coef: float, num_tokens: Array | float | None = None) -> tuple[Array, dict]:
    """KL-Cov's per-token loss (module docstring) of a microbatch [B, L], with the minibatch's
    `selection`. Returns (loss [], metrics): `ratio_metrics` (clipfrac 0: nothing is clipped) and
    kl_cov_frac, the share of tokens penalised."""
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    logp = jnp.asarray(logp, jnp.float32)
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    selected = (jnp.asarray(mask) != 0) & (_covariance(selection, old_logp, advantages) >= selection.threshold)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    # |d| with the gradient sign(d), 0 at d = 0 (jnp.abs's is 1 there: the first minibatch, where
    # every ratio is 1, would push the selected tokens' log-probs down).
    abs_log_ratio = log_ratio * jax.lax.stop_gradient(jnp.sign(log_ratio))
    per_token = -advantages * ratio + jnp.where(selected, coef * abs_log_ratio, 0.0)
    metrics = ratio_metrics(per_token, jnp.zeros(per_token.shape, bool), log_ratio, ratio, mask)
    metrics["kl_cov_frac"] = SumCount.of(selected, mask)
    return token_normalised(per_token, mask, num_tokens), metrics
