"""Per-token KL estimators between the policy and the reference, and KL-coefficient controllers.

Estimators of KL(pi || pi_ref) from a token sampled from pi, with d = logp - ref_logp
(Schulman, "Approximating KL divergence", 2020):
  k1 = d                                 unbiased, can be negative per token
  k2 = d^2 / 2                           biased, low variance, >= 0
  k3 = exp(-d) - 1 + d = (r - 1) - log r with r = pi_ref/pi   unbiased, >= 0

Controllers keep their state in arrays (`KLControllerState`), so it lives inside jit and inside
checkpoints. The adaptive controller is Ziegler et al. 2019:
  err  = clip(KL / target - 1, -0.2, 0.2)
  beta = beta * (1 + err * n_steps / horizon)
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array

KL_KINDS = ("k1", "k2", "k3")
CONTROLLER_KINDS = ("fixed", "adaptive")


def check_kl_kind(kind: str) -> str:
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator kind {kind!r}; use one of {', '.join(KL_KINDS)}")
    return kind


def kl_penalty(logp: Array, ref_logp: Array, kind: str = "k1") -> Array:
    """Per-token KL estimate, same shape as logp (e.g. [B, L]), float32 or wider.

    logp: log pi(a_t | s_t) of the sampled tokens under the policy; ref_logp: same under the reference.
    """
    check_kl_kind(kind)
    logp, ref_logp = jnp.asarray(logp), jnp.asarray(ref_logp)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp has shape {logp.shape} but ref_logp has shape {ref_logp.shape}; "
                         "they must match")
    dtype = jnp.promote_types(jnp.result_type(logp, ref_logp), jnp.float32)
    log_ratio = logp.astype(dtype) - ref_logp.astype(dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * jnp.square(log_ratio)
    # k3 = exp(-d) - 1 + d: expm1 keeps the small-d regime accurate (no 1 + tiny - 1 cancellation).
    # It is >= 0 exactly in real arithmetic; `where` removes any rounding below 0 without touching
    # the gradient elsewhere.
    k3 = jnp.expm1(-log_ratio) + log_ratio
    return jnp.where(k3 > 0, k3, 0)


@flax.struct.dataclass
class KLControllerState:
    """State of a KL coefficient controller; every field is a float32 scalar array.

    coef:    current beta.
    target:  KL the adaptive controller aims for (per sequence, the quantity passed as observed_kl);
             0 for a fixed controller.
    horizon: adaptive time constant in steps (episodes); 1 for a fixed controller.
    kind:    "fixed" or "adaptive" (static, not an array: it selects code, not values).
    """

    coef: Array
    target: Array
    horizon: Array
    kind: str = flax.struct.field(pytree_node=False, default="fixed")


def init_kl_controller(kind: str, init_coef: float, target: float | None = None,
                       horizon: float | None = None) -> KLControllerState:
    """A fixed or adaptive KL controller starting at beta = init_coef."""
    if kind not in CONTROLLER_KINDS:
        raise ValueError(f"unknown KL controller kind {kind!r}; use 'fixed' or 'adaptive'")
    if not init_coef >= 0:
        raise ValueError(f"init_coef (the initial KL coefficient) must be >= 0, got {init_coef}")
    if kind == "adaptive":
        if target is None or not target > 0:
            raise ValueError(f"the adaptive KL controller needs target > 0 (the KL to aim for), "
                             f"got target={target}")
        if horizon is None or not horizon > 0:
            raise ValueError(f"the adaptive KL controller needs horizon > 0 (its time constant in "
                             f"episodes, e.g. 10000), got horizon={horizon}")
    else:
        target, horizon = 0.0, 1.0
    scalar = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return KLControllerState(coef=scalar(init_coef), target=scalar(target), horizon=scalar(horizon),
                             kind=kind)


def update_kl_controller(state: KLControllerState, observed_kl: Array,
                         n_steps: Array | int) -> KLControllerState:
    """One controller update after `n_steps` episodes (the batch size) with mean KL `observed_kl`.

    Fixed controllers return the state unchanged. jit-able (observed_kl and n_steps may be traced).
    """
    if state.kind == "fixed":
        return state
    observed_kl = jnp.asarray(observed_kl, jnp.float32)
    proportional_error = jnp.clip(observed_kl / state.target - 1.0, -0.2, 0.2)
    multiplier = 1.0 + proportional_error * jnp.asarray(n_steps, jnp.float32) / state.horizon
    return state.replace(coef=state.coef * multiplier)
