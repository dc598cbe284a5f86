"""What a rollout's responses look like, per iteration, beyond their mean reward: how many run in a
loop, how far the farthest row strayed from the reference, and what the stop token costs in KL.

Why these: a policy that learns to repeat a rewarded word can tip, within one update, into repeating it
until the length budget (no stop token, many unlikely tokens). Averages such as `objective/kl` show it
only once most rows have tipped; the row maximum and the repeat share show the first rows that do, and
the stop token's KL shows whether the policy is moving away from stopping where the reference would.

Shapes: B rows, L response positions; `mask [B, L]` is 1 on real response tokens (the stop token
included), `stopped [B]` True where the row ends with a stop token, `kl [B, L]` the per-token KL
estimate (0 on padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.ppo.stats import last_token_index, masked_mean

Array = jax.Array


def repeated_token_share(tokens: Array, mask: Array) -> Array:
    """Share of real response tokens, from the second on, equal to the token just before them. [] float32.

    A word repeated back to back ("very very very") is what a degenerate loop looks like in this
    tokenisation; a natural response holds almost none."""
    mask = jnp.asarray(mask) != 0
    follows = mask[:, 1:] & mask[:, :-1]  # real tokens with a real token before them
    same = tokens[:, 1:] == tokens[:, :-1]
    return masked_mean(same.astype(jnp.float32), follows)


def at_stop_token(x: Array, mask: Array, stopped: Array) -> Array:
    """Mean of a per-token quantity x [B, L] at the stop token of the rows that stopped ([] float32;
    0 when none did). The stop token is the last real token of a stopped row."""
    last = last_token_index(mask)
    at_stop = jnp.take_along_axis(x, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]
    counted = jnp.asarray(stopped).astype(bool) & (last >= 0)
    return masked_mean(at_stop, counted)


def stop_token_kl(kl: Array, mask: Array, stopped: Array) -> Array:
    """Mean per-token KL at the stop token of the rows that stopped ([] float32; 0 when none did)."""
    return at_stop_token(kl, mask, stopped)


def response_diagnostics(tokens: Array, mask: Array, stopped: Array, kl: Array, logprobs: Array) -> dict[str, Array]:
    """The rollout's health metrics ([B, L], [B, L], [B], [B, L], [B, L] -> scalars); docs/metrics.md.

    logprobs: the policy's log-probs of the sampled tokens. Their mean at the stop token is how surely
    the policy stops where it stops: a stop the reference takes with p ~ 1 hides its eroding logit
    margin from the ratio and approxkl (p = 0.9999 -> 0.99 is a log-ratio of 0.01), but not from this."""
    sequence_kl = jnp.where(jnp.asarray(mask) != 0, kl, 0).sum(-1)
    return {
        "objective/stop_token_logprob": at_stop_token(logprobs, mask, stopped),
        "response/repeated_token_share": repeated_token_share(tokens, mask),
        "objective/kl_max": sequence_kl.max(),
        "objective/kl_at_stop_token": stop_token_kl(kl, mask, stopped),
    }
