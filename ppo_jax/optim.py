"""The optimizer every trainer uses: AdamW behind global-norm clipping, with a learning-rate schedule."""

from __future__ import annotations

import optax

from ppo_jax.config import AdamWSettings


def make_optimizer(o: AdamWSettings, lr: float, total_steps: int) -> optax.GradientTransformation:
    """AdamW behind global-norm clipping, with linear warmup then constant / linear / cosine."""
    warmup = o.warmup_steps
    decay_steps = max(total_steps - warmup, 1)
    if o.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif o.schedule == "linear":
        after = optax.linear_schedule(lr, 0.0, decay_steps)
    else:
        after = optax.cosine_decay_schedule(lr, decay_steps)
    schedule = (optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])
                if warmup else after)
    adam = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, eps_root=o.eps_root,
                       weight_decay=o.weight_decay, mu_dtype=o.mu_dtype or None)
    return optax.chain(optax.clip_by_global_norm(o.max_grad_norm), adam) if o.max_grad_norm else adam

