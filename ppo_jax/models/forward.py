"""Forwards over a left-padded prompt + right-padded response, shared by every trainer and phase.

Shapes: B rows, Lq prompt length, Lr response length, L = Lq + Lr, V vocabulary. Padding on either
side is masked, so every model sees exactly the real tokens.

Each takes `adapters`: the model's LoRA adapter tree (models/lora.py) to run with adapters on, or
None for the base model (with LoRA, the frozen reference is the same params with adapters=None).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models import lora, moe
from ppo_jax.models.transformer import (CausalLM, ScalarModel, chosen_experts, positions_from_mask,
                                        score_at_last_token)

Array = jax.Array
Params = Any


def variables(params: Params, adapters: Params | None = None) -> dict[str, Params]:
    """The variables to `apply` a model with: its params, and its LoRA adapters when given."""
    return {"params": params} if adapters is None else {"params": params, lora.COLLECTION: adapters}


def sequence_inputs(prompt_tokens, prompt_mask, tokens, mask):
    """Concatenates a left-padded prompt and a right-padded response.

    Returns tokens, positions, mask, each [B, Lq + Lr]. Padding on either side is masked, so every
    model sees exactly the real tokens.
    """
    seq = jnp.concatenate([prompt_tokens, tokens], axis=1)
    seq_mask = jnp.concatenate([prompt_mask, mask], axis=1).astype(jnp.int32)
    return seq, positions_from_mask(seq_mask), seq_mask


@flax.struct.dataclass
class HiddenStates:
    """A forward's final hidden states [B, T, D]; an MoE model's RouterLosses (with `router`); under
    routing replay the tokens whose own top k differs from the replayed experts, [B, T] float32
    (`moe.routing_flips`)."""

    hidden: Array
    router: moe.RouterLosses | None = None
    flips: Array | None = None


def forward_hidden(model: CausalLM, variables_: dict[str, Params], tokens, positions, kv_mask, segment_ids=None,
                   router: bool = False, experts=None) -> HiddenStates:
    """CausalLM.hidden with what an MoE forward reports: its RouterLosses over its real tokens with
    `router`; with experts [B, T, Lm, k] (routing replay, -1: a token's own top k) the flips."""
    mutable = [moe.ROUTER] * router + [moe.CHOSEN] * (experts is not None)
    if not mutable:
        return HiddenStates(model.apply(variables_, tokens, positions, kv_mask, segment_ids, method=CausalLM.hidden))
    hidden, sown = model.apply(variables_, tokens, positions, kv_mask, segment_ids, experts, method=CausalLM.hidden,
                               mutable=mutable)
    losses = moe.router_losses(sown[moe.ROUTER], model.config.experts_per_token) if router else None
    flips = None if experts is None else moe.routing_flips(chosen_experts(sown[moe.CHOSEN], "own"), experts)
    return HiddenStates(hidden, losses, flips)


def hidden_states(model: CausalLM, variables_: dict[str, Params], tokens, positions, kv_mask, segment_ids=None,
                  router: bool = False):
    """(CausalLM.hidden [B, T, D], the forward's RouterLosses over its real tokens with `router` (an
    MoE model), else None)."""
    out = forward_hidden(model, variables_, tokens, positions, kv_mask, segment_ids, router)
    return out.hidden, out.router


def response_outputs(model: CausalLM, params, prompt_tokens, prompt_mask, tokens, mask, temperature,
                     adapters=None, router: bool = False, experts=None) -> HiddenStates:
    """`response_logits` as a HiddenStates whose `hidden` is the tempered logits [B, Lr, V] and `flips`
    (with experts [B, Lq + Lr, Lm, k]: routing replay over the prompt + response) those of the
    response tokens [B, Lr]."""
    seq, pos, seq_mask = sequence_inputs(prompt_tokens, prompt_mask, tokens, mask)
    out = forward_hidden(model, variables(params, adapters), seq, pos, seq_mask, router=router, experts=experts)
    lq, lr = prompt_tokens.shape[1], tokens.shape[1]
    # Position t predicts token t + 1: the response tokens are predicted from positions Lq-1 .. Lq+Lr-2.
    hidden = out.hidden[:, lq - 1: lq + lr - 1]
    logits = model.apply(variables(params, adapters), hidden, method=CausalLM.project) / temperature
    if sharding.context_axis_size() > 1:  # the response's logits stay split along the sequence like its rows
        logits = nn.with_logical_constraint(logits, ("batch", "act_length", "vocab"))
    return out.replace(hidden=logits, flips=None if out.flips is None else out.flips[:, lq:])


def response_logits(model: CausalLM, params, prompt_tokens, prompt_mask, tokens, mask, temperature,
                    adapters=None, router: bool = False, experts=None):
    """Tempered logits that predicted each response token: [B, Lr, V] float32; with `router` (an MoE
    policy) also the RouterLosses of the prompt + response forward: (logits, RouterLosses).
    experts [B, Lq + Lr, Lm, k]: routing replay (`Transformer.__call__`)."""
    out = response_outputs(model, params, prompt_tokens, prompt_mask, tokens, mask, temperature, adapters, router,
                           experts)
    return (out.hidden, out.router) if router else out.hidden


def token_logprobs(logits, tokens, mask):
    """log p(token) [B, Lr] from logits [B, Lr, V]; 0 where masked."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(mask.astype(bool), picked, 0.0)


def response_values(model: ScalarModel, params, prompt_tokens, prompt_mask, tokens, mask, adapters=None):
    """Value of the state before each response token: [B, Lr] float32."""
    seq, pos, seq_mask = sequence_inputs(prompt_tokens, prompt_mask, tokens, mask)
    values, _ = model.apply(variables(params, adapters), seq, pos, seq_mask)
    lq, lr = prompt_tokens.shape[1], tokens.shape[1]
    return values[:, lq - 1: lq + lr - 1] * mask


def sequence_scores(model: ScalarModel, params, tokens, mask, adapters=None):
    """Score at the last real token of each row: tokens, mask [B, L] -> [B] float32."""
    values, _ = model.apply(variables(params, adapters), tokens, positions_from_mask(mask), mask)
    return score_at_last_token(values, mask)


def response_scores(model: ScalarModel, params, prompt_tokens, prompt_mask, tokens, mask, adapters=None):
    """Reward-model score of prompt + response at its last real token: [B] float32."""
    seq, _, seq_mask = sequence_inputs(prompt_tokens, prompt_mask, tokens, mask)
    return sequence_scores(model, params, seq, seq_mask, adapters)
