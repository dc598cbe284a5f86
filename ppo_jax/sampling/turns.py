"""Multi-turn decoding on the device: the three compiled pieces a host loop over turns strings
together (`TurnDecoder`). Pure and jittable; the environment lives on the host
(`ppo_jax.agentic.rollout`).

    state = start(prompts)                 # prefill the prompts, choose each row's first token
    state = decode(state)                  # every active row decodes until its turn ends
    state = append(state, observations)    # resumed rows: prefill [last token, observation] only

Conventions: R rows (one episode each; for several samples per prompt repeat the prompt, every row
needs its own environment), Lq prompt length (left-padded), T = `sampling.max_new_tokens` the whole
response (actions and observations together), O = `max_observation_tokens` per turn, C = Lq + T + O
cache slots per row, W the longest turn-stop sequence.

Row layout. Response column c of row r is cache slot Lq + c and position prompt_length[r] + c,
whatever the other rows do: every row writes its own cache slot (`KVCache.index` [R]), so a row
that waits for its environment while others decode leaves no gap, and its cache holds exactly its
tokens, in order. That is why the teacher-forced forward over prompt + response reproduces the
rollout's log-probs: same tokens, same positions, same visible keys.

Randomness. The token at response column t of row r is drawn with the uniform (r, t) of
`response_uniforms`, as in the one-turn engines: a first turn that the environment ends at once
draws exactly what `loop.sample` draws (its stop tokens including the single-token turn stops).
Observation columns leave their uniforms unused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.models import forward
from ppo_jax.models.cache import KVCache, init_cache, split_cache
from ppo_jax.models.transformer import CausalLM, positions_from_mask
from ppo_jax.ppo.stats import last_token_index
from ppo_jax.sampling.config import SamplingConfig, validate_inputs
from ppo_jax.sampling.loop import apply_last, constrain, constrain_cache, decode_layers, is_stop_token, unrecorded
from ppo_jax.sampling.token_choice import TokenChoice, choose_tokens, response_uniforms
from ppo_jax.sampling.weights import weights_in_compute_dtype

Array = jax.Array

# Why a row's current turn ended (`TurnState.reason`).
RUNNING, TURN_STOP, FINAL_STOP, LENGTH = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class TurnConfig:
    """How to decode turns (static: hashable, part of the compiled programs).

    sampling: token choice and sizes; `max_new_tokens` is T, the whole response; `stop_token_ids`
        (EOS) end the episode; `num_samples` must be 1 and `engine` "static".
    turn_stops: token-id sequences that end a turn (e.g. the ids of `</tool_call>`); a sequence
        matches only inside the current turn's own tokens.
    max_observation_tokens: O, the observation tokens one turn may append (longer ones are cut).
    """

    sampling: SamplingConfig
    turn_stops: tuple[tuple[int, ...], ...]
    max_observation_tokens: int

    def __post_init__(self):
        object.__setattr__(self, "turn_stops", tuple(tuple(int(t) for t in s) for s in self.turn_stops))
        if not self.turn_stops or any(not s for s in self.turn_stops):
            raise ValueError(f"turn_stops must be non-empty token sequences, got {self.turn_stops}")
        if self.sampling.num_samples != 1:
            raise ValueError("multi-turn decoding takes one row per episode (num_samples=1): repeat the "
                             "prompts, each row gets its own environment")
        if self.sampling.engine != "static":
            raise ValueError("multi-turn decoding is built on the static engine only (engine='static')")
        if self.max_observation_tokens < 1:
            raise ValueError(f"max_observation_tokens must be >= 1, got {self.max_observation_tokens}")

    @property
    def window(self) -> int:
        """W: the longest turn-stop sequence."""
        return max(len(s) for s in self.turn_stops)


@flax.struct.dataclass
class TurnState:
    """Carry of every piece (R rows, T response columns, C cache slots, W).

    cache: KV cache with a per-row index (or one per layer, unrolled); kv_mask [R, C]: written real
    slots; prompt_length [R]; column [R]: response tokens recorded (the next one goes there);
    active [R] bool: decoding in this segment; reason [R]: why the row's last turn ended (RUNNING
    while active); recent [R, W]: the current turn's last W tokens (-1 before its start);
    tokens, logprobs, sampling_logprobs, mask, action_mask [R, T]; uniforms [R, T]; decode_steps []:
    decode steps run (every one pays for all R rows, active or not); experts [R, Lq + T, Lm, k]
    (`sampling.record_experts`, else None): the experts each prompt and response token went to in the
    Lm MoE layers when it was fed (routing replay), -1 where none was.
    """

    cache: KVCache | tuple[KVCache, ...]
    kv_mask: Array
    prompt_length: Array
    column: Array
    active: Array
    reason: Array
    recent: Array
    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array
    action_mask: Array
    uniforms: Array
    decode_steps: Array
    experts: Array | None = None


def turn_stop_hit(recent: Array, turn_stops: tuple[tuple[int, ...], ...]) -> Array:
    """recent [R, W] (a turn's last W tokens, newest last, -1 before the turn) -> [R] bool: they end
    with one of the `turn_stops` sequences."""
    width = recent.shape[1]
    hit = jnp.zeros(recent.shape[:1], bool)
    for stop in turn_stops:
        hit |= jnp.all(recent[:, width - len(stop):] == jnp.asarray(stop, recent.dtype), axis=1)
    return hit


def _with_index(cache, index: Array):
    """The cache (stacked or per layer) writing row r's next tokens from slot index[r] on."""
    if isinstance(cache, tuple):
        return tuple(c.replace(index=index) for c in cache)
    return cache.replace(index=index)


def _record(state: TurnState, choice: TokenChoice, config: TurnConfig) -> TurnState:
    """Writes the active rows' choices at their columns and ends the turns that stop: a final stop
    token, a turn-stop sequence, or the last column (in that order of precedence)."""
    sampling, new = config.sampling, state.tokens.shape[1]
    active = state.active
    rows = jnp.arange(active.shape[0])
    at = jnp.where(active, state.column, new)  # past the end: the write is dropped

    def put(buffer, values):
        return buffer.at[rows, at].set(values.astype(buffer.dtype), mode="drop")

    tokens = choice.tokens
    recent = jnp.where(active[:, None], jnp.concatenate([state.recent[:, 1:], tokens[:, None]], axis=1),
                       state.recent)
    column = state.column + active
    reason = jnp.where(is_stop_token(tokens, sampling), FINAL_STOP,
                       jnp.where(turn_stop_hit(recent, config.turn_stops), TURN_STOP,
                                 jnp.where(column >= new, LENGTH, RUNNING)))
    reason = jnp.where(active, reason, state.reason)
    one = jnp.ones_like(tokens)
    return state.replace(
        tokens=put(state.tokens, tokens), logprobs=put(state.logprobs, choice.logprobs),
        sampling_logprobs=put(state.sampling_logprobs, choice.sampling_logprobs),
        mask=put(state.mask, one), action_mask=put(state.action_mask, one),
        column=column, recent=recent, reason=reason, active=active & (reason == RUNNING))


def _choose(state: TurnState, logits: Array, config: TurnConfig) -> TokenChoice:
    """Each row's token at its own column, with that column's uniform."""
    column = jnp.minimum(state.column, state.tokens.shape[1] - 1)
    draws = jnp.take_along_axis(state.uniforms, column[:, None], axis=1)[:, 0]
    return choose_tokens(logits, column, draws, config.sampling)


def _by_rows(x: Array) -> Array:
    return constrain(x, ("batch",) + ("length",) * (x.ndim > 1) + (None,) * max(x.ndim - 2, 0))


def start(params: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *, model: CausalLM,
          config: TurnConfig, adapters: Any = None) -> TurnState:
    """Prefills the left-padded prompts [R, Lq] into a C-slot cache and chooses each row's first
    token (column 0) from the uniforms of `key`."""
    sampling = config.sampling
    validate_inputs(model, sampling, prompt_tokens.shape, prompt_mask.shape)
    rows, prompt_len = prompt_tokens.shape
    new, extra = sampling.max_new_tokens, config.max_observation_tokens
    prompt_mask = prompt_mask.astype(jnp.int32)
    cache = constrain_cache(init_cache(model.config, rows, prompt_len + new + extra, sampling.cache_dtype))
    kv_mask = _by_rows(jnp.concatenate([prompt_mask, jnp.zeros((rows, new + extra), jnp.int32)], axis=1))
    (logits, cache), prompt_experts = apply_last(
        model, forward.variables(params, adapters), prompt_tokens.astype(jnp.int32), positions_from_mask(prompt_mask),
        kv_mask, cache, jnp.maximum(last_token_index(prompt_mask), 0), record=sampling.record_experts)
    cache = cache.replace(index=jnp.zeros((rows,), jnp.int32))
    if decode_layers(params, adapters, sampling).unroll:
        cache = tuple(constrain_cache(layer) for layer in split_cache(cache))

    def zeros(dtype, fill=0):
        return _by_rows(jnp.full((rows, new), fill, dtype))

    state = TurnState(
        cache=cache, kv_mask=kv_mask, prompt_length=prompt_mask.sum(-1), column=jnp.zeros((rows,), jnp.int32),
        active=jnp.ones((rows,), bool), reason=jnp.zeros((rows,), jnp.int32),
        recent=jnp.full((rows, config.window), -1, jnp.int32), tokens=zeros(jnp.int32, sampling.pad_token_id),
        logprobs=zeros(jnp.float32), sampling_logprobs=zeros(jnp.float32), mask=zeros(jnp.int32),
        action_mask=zeros(jnp.int32), uniforms=_by_rows(response_uniforms(key, rows, new)),
        decode_steps=jnp.int32(0), experts=_expert_buffer(prompt_experts, prompt_mask, new))
    return _record(state, _choose(state, logits, config), config)


def _expert_buffer(prompt_experts: Array | None, prompt_mask: Array, new: int) -> Array | None:
    """[R, Lq + T, Lm, k]: the prompts' routing (-1 on their padding), -1 over the response."""
    if prompt_experts is None:
        return None
    prompt = unrecorded(prompt_experts, prompt_mask)
    response = jnp.full((prompt.shape[0], new) + prompt.shape[2:], -1, prompt.dtype)
    return jnp.concatenate([prompt, response], axis=1)


def _record_fed(state: TurnState, experts: Array | None, fed: Array, first_column: Array, prompt_len: int) -> TurnState:
    """The routing of the tokens just fed: experts [R, t, Lm, k] of each row's response columns
    first_column [R] .. + t - 1, written where fed [R, t] (routing replay; a no-op without a record)."""
    if experts is None:
        return state
    rows, width = state.experts.shape[:2]
    at = jnp.where(fed, prompt_len + first_column[:, None] + jnp.arange(fed.shape[1])[None, :], width)
    written = state.experts.at[jnp.arange(rows)[:, None], at].set(experts.astype(state.experts.dtype), mode="drop")
    return state.replace(experts=written)


def _prompt_len(state: TurnState, config: TurnConfig) -> int:
    """Lq, read off the static shapes (C = Lq + T + O)."""
    return state.kv_mask.shape[1] - state.tokens.shape[1] - config.max_observation_tokens


def _last_tokens(state: TurnState) -> Array:
    """[R]: each row's last recorded token (its column - 1), the one not yet in the cache."""
    return jnp.take_along_axis(state.tokens, jnp.maximum(state.column - 1, 0)[:, None], axis=1)[:, 0]


def decode(params: Any, state: TurnState, max_steps: Array | None = None, *, model: CausalLM, config: TurnConfig,
           adapters: Any = None) -> TurnState:
    """Decodes one token per step for every active row until none is: each row stops at its turn's
    end (`reason`), the others' stops do not hold it. `max_steps` ([] int32, traced: one program for
    any value; None: no bound) ends the call sooner, after that many steps rounded up to
    `steps_per_sync`; the rows still active then go on at the next call, as if never stopped (the
    continuous multi-turn schedule, `agentic/continuous_rollout.py`)."""
    sampling, prompt_len = config.sampling, _prompt_len(state, config)
    variables = forward.variables(params, adapters)
    layers = decode_layers(params, adapters, sampling)
    rows = jnp.arange(state.column.shape[0])
    per_sync = max(1, min(sampling.steps_per_sync, sampling.max_new_tokens - 1))

    def decode_one(state: TurnState) -> TurnState:
        # Feed the last token at slot Lq + column - 1. An inactive row writes there too (static
        # shapes), at position 0 and masked: a waiting row's slot is rewritten by `append`.
        slot = prompt_len + state.column - 1
        kv_mask = state.kv_mask.at[rows, slot].max(state.active.astype(jnp.int32))
        positions = jnp.where(state.active, state.prompt_length + state.column - 1, 0)[:, None]
        (logits, cache), experts = apply_last(model, variables, _last_tokens(state)[:, None], positions, kv_mask,
                                              _with_index(state.cache, slot), jnp.zeros_like(slot), layers.params,
                                              layers.adapters, record=sampling.record_experts)
        state = _record_fed(state, experts, state.active[:, None], state.column - 1, prompt_len)
        state = state.replace(cache=cache, kv_mask=kv_mask, decode_steps=state.decode_steps + 1)
        return _record(state, _choose(state, logits, config), config)

    def decode_group(state: TurnState) -> TurnState:
        if per_sync == 1:
            return decode_one(state)
        # Steps past every row's turn end change nothing: no row is active.
        return jax.lax.fori_loop(0, per_sync, lambda _, s: decode_one(s), state)

    budget = jnp.iinfo(jnp.int32).max if max_steps is None else jnp.asarray(max_steps, jnp.int32)

    def go_on(carry):
        state, taken = carry
        return jnp.any(state.active) & (taken < budget)

    def step(carry):
        state, taken = carry
        return decode_group(state), taken + per_sync

    return jax.lax.while_loop(go_on, step, (state, jnp.int32(0)))[0]


def append(params: Any, state: TurnState, observations: Array, observation_lengths: Array, resume: Array, *,
           model: CausalLM, config: TurnConfig, adapters: Any = None) -> TurnState:
    """Appends each resumed row's observation and chooses the first token of its next turn; the rows
    still decoding their turn (active, not resumed) go on untouched.

    observations [R, O] int32 (padded with anything: masked); observation_lengths [R] (k, with
    column + k < T for a resumed row); resume [R] bool. One forward of [last token, observation]
    [R, 1 + O] per row from its own slot Lq + column - 1 on, not a re-prefill of the row. The slots
    past a row's k + 1 real ones stay out of the kv mask; causality by slot hides them from this
    forward's real queries anyway, and the row's next tokens overwrite them before any query sits
    past them. Rows not resumed keep their state (their forward is padding at position 0; what it
    writes to a decoding row's cache lies past its last token, out of the kv mask, and its next
    decode steps overwrite it before any query reads that far).
    """
    sampling, new = config.sampling, state.tokens.shape[1]
    width, prompt_len = config.max_observation_tokens, _prompt_len(state, config)
    decoding = state.active & ~resume
    lengths = jnp.where(resume, observation_lengths.astype(jnp.int32), 0)
    start_slot = prompt_len + state.column - 1
    offsets = jnp.arange(1 + width)
    real = resume[:, None] & (offsets[None, :] <= lengths[:, None])  # [R, 1 + O]
    chunk = jnp.concatenate([_last_tokens(state)[:, None], observations.astype(jnp.int32)], axis=1)
    chunk = jnp.where(real, chunk, sampling.pad_token_id)
    positions = jnp.where(real, (state.prompt_length + state.column - 1)[:, None] + offsets[None, :], 0)
    slots = jnp.arange(state.kv_mask.shape[1])[None, :]
    written = resume[:, None] & (slots >= start_slot[:, None]) & (slots <= (start_slot + lengths)[:, None])
    kv_mask = state.kv_mask | written.astype(jnp.int32)
    layers = decode_layers(params, adapters, sampling)
    (logits, cache), experts = apply_last(model, forward.variables(params, adapters), chunk, positions, kv_mask,
                                          _with_index(state.cache, start_slot), lengths, layers.params,
                                          layers.adapters, record=sampling.record_experts)
    state = _record_fed(state, experts, real, state.column - 1, prompt_len)
    # The observation into the response buffers: context, not actions (action_mask 0, log-prob 0).
    rows = jnp.arange(new)[None, :]
    into = resume[:, None] & (rows >= state.column[:, None]) & (rows < (state.column + lengths)[:, None])
    gathered = jnp.take_along_axis(observations.astype(jnp.int32),
                                   jnp.clip(rows - state.column[:, None], 0, width - 1), axis=1)
    state = state.replace(
        cache=cache, kv_mask=kv_mask, tokens=jnp.where(into, gathered, state.tokens),
        mask=state.mask | into.astype(jnp.int32), column=state.column + lengths, active=resume,
        reason=jnp.where(resume, RUNNING, state.reason), recent=jnp.where(resume[:, None], -1, state.recent))
    recorded = _record(state, _choose(state, logits, config), config)  # the resumed rows' first tokens only
    return recorded.replace(active=recorded.active | decoding)


class TurnDecoder:
    """`start`, `decode` and `append` jitted for one model and TurnConfig (one program each per
    shape; `decode` and `append` donate the state, so the cache is updated in place). With a mesh
    they run under it (batch-major arrays split over its batch axes by the constraints inside)."""

    def __init__(self, model: CausalLM, config: TurnConfig, mesh: jax.sharding.Mesh | None = None):
        self.model, self.config, self.mesh = model, config, mesh
        static = dict(model=model, config=config)
        self._start = jax.jit(lambda p, t, m, k, a: start(p, t, m, k, adapters=a, **static))
        # decode's loop reads the weights every step: cast once per call (sampling/weights.py)
        self._decode = jax.jit(lambda p, s, a, n: decode(weights_in_compute_dtype(p, model), s, n, adapters=a,
                                                         **static), donate_argnums=1)
        self._append = jax.jit(lambda p, s, o, n, r, a: append(p, s, o, n, r, adapters=a, **static),
                               donate_argnums=1)

    def _run(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        from ppo_jax import sharding

        with sharding.mesh_context(self.mesh):
            return fn(*args)

    def start(self, params, prompt_tokens, prompt_mask, key, adapters=None) -> TurnState:
        return self._run(self._start, params, prompt_tokens, prompt_mask, key, adapters)

    def abstract_state(self, params, prompt_tokens, prompt_mask, key, adapters=None) -> TurnState:
        """`start`'s state as shapes and dtypes (to rebuild one saved as host arrays)."""
        return self._run(lambda *args: jax.eval_shape(self._start, *args), params, prompt_tokens, prompt_mask, key,
                         adapters)

    def decode(self, params, state: TurnState, adapters=None, max_steps: int | None = None) -> TurnState:
        """Every active row to its turn's end, or `max_steps` decode steps (one program for both)."""
        budget = np.int32(np.iinfo(np.int32).max if max_steps is None else max_steps)
        return self._run(self._decode, params, state, adapters, budget)

    def append(self, params, state: TurnState, observations, observation_lengths, resume,
               adapters=None) -> TurnState:
        return self._run(self._append, params, state, observations, observation_lengths, resume, adapters)
