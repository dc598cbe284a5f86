"""Multi-turn decoding with fewer decode slots than episodes: the device side of the slot schedule
(`agentic/slot_rollout.py`). Pure and jittable, like `turns.py`, whose `decode` it reuses.

S slots (the rows of a `TurnState`) decode E episodes. An episode that waits for its environment can
give its slot up (`store`: the slot's buffers into the episode's row of the `EpisodeStore`) and take
one again when the answer comes, with a re-prefill of its whole row (`insert`: prompt, every response
token so far, the new observation). A new episode takes its first slot the same way, its row being
its prompt alone. The cache holds S rows, not E, and a decode step pays for S rows.

    slots = SlotDecoder(model, turn_config, slots=S, insert_rows=P)
    state, store = slots.empty(params, prompt_tokens, prompt_mask, key)  # S free slots, E episodes
    state = slots.insert(params, state, store, slot_ids, episode_ids, observations, lengths)
    state = slots.decode(params, state, max_steps=8)                     # TurnDecoder.decode
    store = slots.store(state, store, slot_ids, episode_ids)             # their buffers written back

Same tokens as one row per episode (`turns.py`): episode e's token at response column t is drawn with
the uniform (e, t) whatever slot it decodes in, and a re-prefilled row holds the same tokens at the same
cache slots and positions as a row that kept its slot (log-probs to float round-off: a prefill's and
the decode steps' arithmetic differ).

Cost: a resumed episode's insert runs a forward over its whole row of C = Lq + T + O positions (the
rows of a call padded to a power of two), the recompute that buys the slot; `agentic/slot_rollout.py`
decides when it pays. A new episode's insert prefills its prompt alone.

Shapes: S slots, E episodes, P = `insert_rows`, Lq prompt length, T response columns, O observation
tokens per turn, C = Lq + T + O.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.models import forward
from ppo_jax.models.cache import init_cache, split_cache
from ppo_jax.models.transformer import CausalLM, positions_from_mask
from ppo_jax.sampling.loop import constrain_cache, decode_layers, forward_last
from ppo_jax.sampling.token_choice import response_uniforms
from ppo_jax.sampling.turns import (FINAL_STOP, RUNNING, TurnConfig, TurnDecoder, TurnState, _by_rows, _choose,
                                    _record)
from ppo_jax.sampling.weights import weights_in_compute_dtype

Array = jax.Array


@flax.struct.dataclass
class EpisodeStore:
    """Every episode's buffers (E rows), the authority for an episode while no slot holds it.

    prompt_tokens, prompt_mask [E, Lq]; column [E]: response tokens recorded; tokens, logprobs,
    sampling_logprobs, mask, action_mask [E, T] as `TurnState`'s; uniforms [E, T]: episode e's draws.
    """

    prompt_tokens: Array
    prompt_mask: Array
    column: Array
    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array
    action_mask: Array
    uniforms: Array


_BUFFERS = ("tokens", "logprobs", "sampling_logprobs", "mask", "action_mask")  # a slot's episode buffers


def empty(params: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *, model: CausalLM,
          config: TurnConfig, slots: int, adapters: Any = None) -> tuple[TurnState, EpisodeStore]:
    """S free slots (inactive, nothing in their cache) and the store of the E left-padded prompts
    [E, Lq], no response yet, with the uniforms of `key` (episode e drawing `turns.start`'s row e)."""
    sampling = config.sampling
    episodes, prompt_len = prompt_tokens.shape
    new, width = sampling.max_new_tokens, prompt_len + sampling.max_new_tokens + config.max_observation_tokens
    cache = constrain_cache(init_cache(model.config, slots, width, sampling.cache_dtype))
    cache = cache.replace(index=jnp.zeros((slots,), jnp.int32))  # a per-row index, as `turns.start`'s
    if decode_layers(params, adapters, sampling).unroll:
        cache = tuple(constrain_cache(layer) for layer in split_cache(cache))

    def full(rows, cols, dtype, fill=0):
        return _by_rows(jnp.full((rows, cols), fill, dtype))

    state = TurnState(
        cache=cache, kv_mask=full(slots, width, jnp.int32), prompt_length=jnp.zeros((slots,), jnp.int32),
        column=jnp.zeros((slots,), jnp.int32), active=jnp.zeros((slots,), bool),
        reason=jnp.full((slots,), FINAL_STOP, jnp.int32), recent=jnp.full((slots, config.window), -1, jnp.int32),
        tokens=full(slots, new, jnp.int32, sampling.pad_token_id), logprobs=full(slots, new, jnp.float32),
        sampling_logprobs=full(slots, new, jnp.float32), mask=full(slots, new, jnp.int32),
        action_mask=full(slots, new, jnp.int32), uniforms=full(slots, new, jnp.float32),
        decode_steps=jnp.int32(0))
    store = EpisodeStore(
        prompt_tokens=_by_rows(prompt_tokens.astype(jnp.int32)), prompt_mask=_by_rows(prompt_mask.astype(jnp.int32)),
        column=jnp.zeros((episodes,), jnp.int32), tokens=full(episodes, new, jnp.int32, sampling.pad_token_id),
        logprobs=full(episodes, new, jnp.float32), sampling_logprobs=full(episodes, new, jnp.float32),
        mask=full(episodes, new, jnp.int32), action_mask=full(episodes, new, jnp.int32),
        uniforms=_by_rows(response_uniforms(key, episodes, new)))
    return state, store


def store(state: TurnState, episodes: EpisodeStore, slot_ids: Array, episode_ids: Array) -> EpisodeStore:
    """The buffers and column of the episodes in slots `slot_ids` [P] written to their rows
    `episode_ids` [P] (E: a padding pair, dropped)."""
    def put(buffer, values):
        return buffer.at[episode_ids].set(values[slot_ids].astype(buffer.dtype), mode="drop")

    return episodes.replace(column=put(episodes.column, state.column),
                            **{name: put(getattr(episodes, name), getattr(state, name)) for name in _BUFFERS})


def _rows_with_observations(episodes: EpisodeStore, at: Array, observations: Array, lengths: Array
                            ) -> tuple[Array, Array]:
    """The response tokens and mask [P, T] of episodes `at` [P] with their observations [P, O] of
    `lengths` [P] written from their columns on (context: `insert` leaves their action mask 0)."""
    column, width = episodes.column[at], observations.shape[1]
    cols = jnp.arange(episodes.tokens.shape[1])[None, :]
    into = (cols >= column[:, None]) & (cols < (column + lengths)[:, None])
    gathered = jnp.take_along_axis(observations.astype(jnp.int32), jnp.clip(cols - column[:, None], 0, width - 1),
                                   axis=1)
    return jnp.where(into, gathered, episodes.tokens[at]), episodes.mask[at] | into.astype(jnp.int32)


def insert(params: Any, state: TurnState, episodes: EpisodeStore, slot_ids: Array, episode_ids: Array,
           observations: Array, lengths: Array, *, model: CausalLM, config: TurnConfig, fresh: bool = False,
           adapters: Any = None) -> TurnState:
    """Episodes `episode_ids` [P] into the free slots `slot_ids` [P] (S: a padding pair, dropped),
    each with the observation [P, O] of `lengths` [P] that its next turn follows, and the first
    token of that turn chosen.

    One forward over each episode's whole row [P, C]: the left-padded prompt, the response so far and
    the observation, at the positions a kept slot would have given them; its cache rows replace the
    slots'. `fresh` (static): every episode is new, its row is its prompt [P, Lq] (observations and
    lengths unused). The slots still decoding go on untouched.
    """
    sampling = config.sampling
    num_slots, new = state.tokens.shape
    prompt_len = episodes.prompt_tokens.shape[1]
    at = jnp.minimum(episode_ids, episodes.column.shape[0] - 1)  # a padding pair reads any row: dropped
    lengths = lengths.astype(jnp.int32)
    column = episodes.column[at] + lengths
    tokens, mask = _rows_with_observations(episodes, at, observations, lengths)
    prompt_mask = episodes.prompt_mask[at]
    rows, tail = slot_ids.shape[0], config.max_observation_tokens
    if fresh:  # the prompt is the whole row: [P, Lq] only
        row_tokens, kv_mask = episodes.prompt_tokens[at], prompt_mask
    else:
        row_tokens = jnp.concatenate([episodes.prompt_tokens[at], tokens,
                                      jnp.full((rows, tail), sampling.pad_token_id, jnp.int32)], axis=1)
        kv_mask = jnp.concatenate([prompt_mask, mask, jnp.zeros((rows, tail), jnp.int32)], axis=1)  # [P, C]
    cache = init_cache(model.config, rows, kv_mask.shape[1], sampling.cache_dtype)
    logits, cache = model.apply(forward.variables(params, adapters), row_tokens, positions_from_mask(kv_mask),
                                kv_mask, cache, prompt_len + column - 1, method=forward_last)
    written = kv_mask.shape[1]  # the slots' cache positions replaced (the rest is out of their kv mask)
    kv_mask = jnp.pad(kv_mask, ((0, 0), (0, state.kv_mask.shape[1] - written)))

    def put(buffer, values):
        return buffer.at[slot_ids].set(values.astype(buffer.dtype), mode="drop")

    def put_cache(buffer, values, stacked):  # [(L,) S, K, C, Dh] <- [(L,) P, K, written, Dh]
        at_slots = (slice(None),) * stacked + (slot_ids, slice(None), slice(0, written))
        return buffer.at[at_slots].set(values.astype(buffer.dtype), mode="drop")

    if isinstance(state.cache, tuple):
        slots_cache = tuple(c.replace(k=put_cache(c.k, cache.k[i], 0), v=put_cache(c.v, cache.v[i], 0))
                            for i, c in enumerate(state.cache))
    else:
        slots_cache = state.cache.replace(k=put_cache(state.cache.k, cache.k, 1), v=put_cache(state.cache.v, cache.v, 1))
    inserted = jnp.zeros((num_slots,), bool).at[slot_ids].set(True, mode="drop")
    decoding = state.active
    state = state.replace(
        cache=slots_cache, kv_mask=put(state.kv_mask, kv_mask), prompt_length=put(state.prompt_length,
                                                                                  prompt_mask.sum(-1)),
        column=put(state.column, column), active=inserted, reason=jnp.where(inserted, RUNNING, state.reason),
        recent=jnp.where(inserted[:, None], -1, state.recent), tokens=put(state.tokens, tokens),
        mask=put(state.mask, mask), uniforms=put(state.uniforms, episodes.uniforms[at]),
        **{name: put(getattr(state, name), getattr(episodes, name)[at])
           for name in ("logprobs", "sampling_logprobs", "action_mask")})
    logits = jnp.zeros((num_slots, logits.shape[-1]), logits.dtype).at[slot_ids].set(logits, mode="drop")
    recorded = _record(state, _choose(state, logits, config), config)  # the inserted slots' first tokens only
    return recorded.replace(active=recorded.active | decoding)


class SlotDecoder(TurnDecoder):
    """A TurnDecoder for S slots shared by more episodes: `decode` and `append` as the TurnDecoder's
    (over the slots), plus `empty`, `insert` (P rows each call; `insert_rows`) and `store`, jitted;
    `insert` and `store` donate what they update."""

    def __init__(self, model: CausalLM, config: TurnConfig, slots: int, insert_rows: int,
                 mesh: jax.sharding.Mesh | None = None):
        super().__init__(model, config, mesh)
        if not 1 <= insert_rows <= slots:
            raise ValueError(f"insert_rows={insert_rows}: use 1 to the {slots} slots")
        self.slots, self.insert_rows = slots, insert_rows
        static = dict(model=model, config=config)
        self._empty = jax.jit(lambda p, t, m, k, a: empty(p, t, m, k, slots=slots, adapters=a, **static))
        self._insert = jax.jit(lambda p, s, e, i, j, o, n, a, fresh: insert(
            weights_in_compute_dtype(p, model), s, e, i, j, o, n, adapters=a, fresh=fresh, **static),
            donate_argnums=1, static_argnums=8)
        self._store = jax.jit(store, donate_argnums=1)

    def empty(self, params, prompt_tokens, prompt_mask, key, adapters=None) -> tuple[TurnState, EpisodeStore]:
        return self._run(self._empty, params, prompt_tokens, prompt_mask, key, adapters)

    def insert(self, params, state: TurnState, episodes: EpisodeStore, slot_ids, episode_ids, observations=None,
               lengths=None, adapters=None) -> TurnState:
        """Host arrays [n] (n <= P; padded to a power of two) of slots, episodes and (resumed episodes) their
        observations [n, O] and lengths; without observations the episodes are new, their prompts
        prefilled alone (a program of its own)."""
        n, width = len(slot_ids), self.config.max_observation_tokens
        if not 1 <= n <= self.insert_rows:
            raise ValueError(f"insert: {n} episodes, 1 to insert_rows={self.insert_rows} a call")
        rows = min(self.insert_rows, 1 << (n - 1).bit_length())  # a program per power of two: little padding
        fresh = observations is None
        if fresh:
            observations, lengths = np.zeros((n, width), np.int32), np.zeros(n, np.int32)

        def padded(values, fill, shape=()):
            values = np.asarray(values, np.int32).reshape((n,) + shape)
            return np.concatenate([values, np.full((rows - n,) + shape, fill, np.int32)])

        return self._run(self._insert, params, state, episodes, padded(slot_ids, self.slots),
                         padded(episode_ids, episodes.column.shape[0]), padded(observations, 0, (width,)),
                         padded(lengths, 0), adapters, fresh)

    def store(self, state: TurnState, episodes: EpisodeStore, slot_ids, episode_ids) -> EpisodeStore:
        """Host arrays [n] (n <= S; padded here: one program) of slots and their episodes."""
        pad = self.slots - len(slot_ids)
        slot_ids = np.concatenate([np.asarray(slot_ids, np.int32), np.zeros(pad, np.int32)])
        episode_ids = np.concatenate([np.asarray(episode_ids, np.int32),
                                      np.full(pad, episodes.column.shape[0], np.int32)])
        return self._run(self._store, state, episodes, slot_ids, episode_ids)
