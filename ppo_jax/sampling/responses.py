"""The continuous engine's output buffers (`Responses`, by output row) and how a step's choices are
written into them (`sample_continuous`, `continuous.py`)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.models import moe
from ppo_jax.models.config import ModelConfig
from ppo_jax.sampling.config import SamplingConfig
from ppo_jax.sampling.loop import is_stop_token
from ppo_jax.sampling.token_choice import TokenChoice

Array = jax.Array


@flax.struct.dataclass
class Responses:
    """The output buffers, by output row: tokens, logprobs, sampling_logprobs, mask [R, N] (filled at
    (row, step) as slots choose), stopped [R] bool, slot_steps_at_finish [R] int32; version [R, N]
    int32: the policy version whose weights chose each token (-1: none), segmented runs only
    (`segments.py`; else None: the unsegmented program records nothing more). With
    `record_experts` (routing replay), the experts each token went to in the Lm MoE layers, -1 where
    none was recorded: experts [R, N, Lm, k] by response column, written when the token is fed back;
    prompt_experts [B, Lq, Lm, k] by prompt, written at its prefill."""

    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array
    stopped: Array
    slot_steps_at_finish: Array
    version: Array | None = None
    experts: Array | None = None
    prompt_experts: Array | None = None


def record_choices(out: Responses, clock: Array, rows: Array, steps: Array, choice: TokenChoice, limits: Array,
            config: SamplingConfig, version: Array | None = None) -> tuple[Responses, Array]:
    """Writes the choices of the `rows` [M] (-1: none) at response position `steps` [M] into the
    Responses, at slot-step `clock` (and, when the Responses keep versions, `version` []); returns
    (the updated Responses, which of the M rows finished [M] bool)."""
    live = rows >= 0
    total = out.tokens.shape[0]
    at = jnp.where(live, rows, total)  # an index past the end: the write is dropped
    tokens = jnp.where(live, choice.tokens, config.pad_token_id)
    is_stop = is_stop_token(tokens, config) & live
    finished = live & (is_stop | (steps + 1 >= limits[jnp.maximum(rows, 0)]))

    def put(buffer, values):
        return buffer.at[at, steps].set(values.astype(buffer.dtype), mode="drop")

    out = out.replace(
        tokens=put(out.tokens, tokens), logprobs=put(out.logprobs, choice.logprobs),
        sampling_logprobs=put(out.sampling_logprobs, choice.sampling_logprobs),
        mask=put(out.mask, jnp.ones_like(tokens)),
        stopped=out.stopped.at[at].set(is_stop, mode="drop"),
        slot_steps_at_finish=out.slot_steps_at_finish.at[at].set(clock, mode="drop"))
    if out.version is not None:
        out = out.replace(version=put(out.version, jnp.broadcast_to(version, tokens.shape)))
    return out, finished



def expert_buffers(mc: ModelConfig, rows: int, new: int, batch: int, prompt_len: int) -> dict[str, Array]:
    """Responses.experts [R, N, Lm, k] and prompt_experts [B, Lq, Lm, k] of a model `mc`, -1 (nothing
    recorded)."""
    per_token = (sum(mc.layer_moe), mc.experts_per_token)
    dtype = moe.index_dtype(mc.num_experts)
    return dict(experts=jnp.full((rows, new) + per_token, -1, dtype),
                prompt_experts=jnp.full((batch, prompt_len) + per_token, -1, dtype))
