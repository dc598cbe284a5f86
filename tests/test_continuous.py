"""The continuous-batching engine (sampling/continuous.py) against the static one and against plain
references: the same tokens and log-probs for the same key whatever the slots and prefill chunk
(scheduling-invariant randomness), the training forward's log-probs, per-row limits, a scheduler
simulated in plain Python for its decode steps, meshes, and the slot occupancy both report.
"""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import make_test_mesh
from test_sampling import (BATCH, MIN_CONFIG, NEW, STOP_CONFIG, TOP_P_CONFIG, _gather, _log_softmax,
                           _model_and_params, _prompts, _shardings_on, _training_logits)

from ppo_jax.sampling import make_sampler, sample, sample_continuous, slot_occupancy

_static = jax.jit(sample, static_argnames=("model", "config"))
_continuous = jax.jit(sample_continuous, static_argnames=("model", "config"))


@pytest.fixture(scope="module")
def llama():
    return _model_and_params("llama")


def _both(model, params, config, limits=None, key=1, **engine):
    """(static output, continuous output) of the same key, on host."""
    tokens, mask = _prompts()
    continuous = dataclasses.replace(config, engine="continuous", **engine)
    return tuple(jax.device_get(run(params, tokens, mask, jax.random.key(key), model=model, config=c,
                                    response_limits=limits))
                 for run, c in ((_static, config), (_continuous, continuous)))


def _assert_same_samples(static, continuous):
    for field in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "stopped"):
        np.testing.assert_array_equal(getattr(continuous, field), getattr(static, field), err_msg=field)
    np.testing.assert_allclose(continuous.logprobs, static.logprobs, atol=1e-6, rtol=0)
    np.testing.assert_allclose(continuous.sampling_logprobs, static.sampling_logprobs, atol=1e-6, rtol=0)


# Each case: a sampling config (stop tokens and 2 samples per prompt, min_new_tokens, top-p), slots,
# prompts per prefill (0: the default), and the decode loop; 8 prompts of lengths 8 down to 1.
CASES = [
    (STOP_CONFIG, 2, 0, True),  # one prompt's two samples at a time: a queue of 8 prefills
    (STOP_CONFIG, 5, 2, True),  # a chunk of 2 prompts' 4 rows into 5 slots: samples of one prompt split
    (MIN_CONFIG, 4, 1, False),  # the scanned decode (no halvings), per-row writes in the stacked cache
    (TOP_P_CONFIG, 16, 0, True),  # every row in a slot at once: the static schedule
    (dataclasses.replace(MIN_CONFIG, tail_halvings=2), 8, 0, False),  # halvings of the stacked cache
]


@pytest.mark.parametrize("config, slots, prefill, unroll", CASES,
                         ids=[f"{i}-slots{c[1]}-prefill{c[2]}-unroll{c[3]}" for i, c in enumerate(CASES)])
def test_continuous_engine_gives_the_static_engines_samples(llama, config, slots, prefill, unroll):
    """A row's draws depend only on (row, step) and the key, never on its slot or when it ran."""
    model, params, _ = llama
    config = dataclasses.replace(config, unroll_layers=unroll)
    static, continuous = _both(model, params, config, slots=slots, prefill_prompts=prefill)
    _assert_same_samples(static, continuous)
    assert continuous.lengths.min() < continuous.lengths.max()  # rows of different lengths shared the slots


def test_continuous_logprobs_equal_the_training_forward(llama):
    model, params, _ = llama
    _, out = _both(model, params, STOP_CONFIG, slots=6, prefill_prompts=2)
    scaled = _training_logits(model, params, out) / STOP_CONFIG.temperature
    mask = out.mask.astype(bool)
    expected = np.where(mask, _gather(_log_softmax(scaled), out.tokens), 0.0)
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
    assert np.all(out.logprobs[~mask] == 0) and np.all(out.sampling_logprobs[~mask] == 0)


def test_response_limits_end_rows_unstopped_in_both_engines(llama):
    model, params, _ = llama
    config = dataclasses.replace(STOP_CONFIG, stop_token_ids=())  # only the limits end rows
    rows = BATCH * config.num_samples
    limits = np.random.default_rng(0).integers(1, NEW + 1, rows).astype(np.int32)
    static, continuous = _both(model, params, config, limits=limits, slots=4)
    _assert_same_samples(static, continuous)
    np.testing.assert_array_equal(continuous.lengths, limits)
    assert not continuous.stopped.any()
    free, _ = _both(model, params, config, slots=4)
    np.testing.assert_array_equal(continuous.tokens[continuous.mask == 1], free.tokens[continuous.mask == 1])


def _simulated_slot_steps(lengths, num_samples, slots, chunk, halvings):
    """The continuous engine's schedule, written plainly: prompts are prefilled in order, `chunk` at a
    time, when a slot is free and no prefilled row waits; waiting rows take free slots in order; a
    row's first token comes with its prefill, then one token per decode step; a finished row frees
    its slot at once. Once the queue is empty and at most half the
    slots are busy, decoding goes on in half as many slots (at most `halvings` times). Returns the
    slot-steps decoded when each row finished."""
    sizes = [slots]
    while len(sizes) <= halvings and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    prompts = len(lengths) // num_samples
    remaining, finish, waiting = {}, {}, []
    next_prompt, work, stage = 0, 0, 0
    while True:
        following = sizes[stage + 1] if stage + 1 < len(sizes) else 0
        if not (stage == 0 and (waiting or next_prompt < prompts)) and len(remaining) <= following:
            if not following:
                break
            stage += 1
            continue
        if stage == 0:
            while len(remaining) < slots and (waiting or next_prompt < prompts):
                if not waiting:  # prefill the next chunk; a row whose first token ends it takes no slot
                    for row in range(next_prompt * num_samples, min(next_prompt + chunk, prompts) * num_samples):
                        if lengths[row] == 1:
                            finish[row] = work
                        else:
                            waiting.append(row)
                    next_prompt += chunk
                while waiting and len(remaining) < slots:
                    row = waiting.pop(0)
                    remaining[row] = lengths[row] - 1
        work += sizes[stage]
        for row in list(remaining):
            remaining[row] -= 1
            if remaining[row] == 0:
                finish[row] = work
                del remaining[row]
    return np.array([finish[r] for r in range(len(lengths))])


@pytest.mark.parametrize("slots, prefill, halvings", [(1, 1, 0), (3, 2, 0), (6, 2, 2), (8, 0, 2), (16, 0, 3)])
def test_the_engine_runs_the_simulated_schedule_and_reports_its_occupancy(llama, slots, prefill, halvings):
    model, params, _ = llama
    config = dataclasses.replace(STOP_CONFIG, engine="continuous", slots=slots, prefill_prompts=prefill,
                                 tail_halvings=halvings)
    static, continuous = _both(model, params, STOP_CONFIG, slots=slots, prefill_prompts=prefill,
                               tail_halvings=halvings)
    chunk = config.prefill_batch(BATCH)
    expected = _simulated_slot_steps(static.lengths, config.num_samples, slots, chunk, halvings)
    np.testing.assert_array_equal(continuous.slot_steps_at_finish, expected)
    # Occupancy: tokens over token choices computed (first tokens from prefills + every slot-step).
    rows = BATCH * config.num_samples
    prefilled = -(-BATCH // chunk) * chunk * config.num_samples
    want = static.lengths.sum() / (prefilled + expected.max())
    np.testing.assert_allclose(float(slot_occupancy(continuous, config, BATCH)), want, rtol=1e-6)
    np.testing.assert_array_equal(static.slot_steps_at_finish, (static.lengths - 1) * rows)
    static_occupancy = static.lengths.sum() / (rows * static.lengths.max())
    np.testing.assert_allclose(float(slot_occupancy(static, STOP_CONFIG, BATCH)), static_occupancy, rtol=1e-6)


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)], ids=lambda s: "mesh" + "x".join(map(str, s)))
def test_sharded_continuous_engine_gives_the_one_device_static_samples(llama, mesh_shape):
    model, params, _ = llama
    static, _ = _both(model, params, TOP_P_CONFIG, slots=8)
    mesh = make_test_mesh(mesh_shape)
    shardings = _shardings_on(model, mesh)
    config = dataclasses.replace(TOP_P_CONFIG, engine="continuous", slots=8)
    sampler = make_sampler(model, config, mesh, shardings)
    tokens, mask = _prompts()
    out = jax.device_get(sampler(jax.device_put(params, shardings), tokens, mask, jax.random.key(1)))
    _assert_same_samples(static, out)
    assert sampler.trace_count == 1


def test_slots_the_mesh_cannot_split_are_refused_before_compiling(llama):
    model, _, _ = llama
    mesh = make_test_mesh((8, 1, 1))
    config = dataclasses.replace(TOP_P_CONFIG, engine="continuous", slots=12)
    sampler = make_sampler(model, config, mesh, _shardings_on(model, mesh))
    tokens, mask = _prompts()
    with pytest.raises(ValueError, match="sampling.slots=12 is not a multiple of 8"):
        sampler.lower(None, tokens, mask, jax.random.key(0))
    assert sampler.trace_count == 0


@pytest.mark.parametrize("fields, message", [
    ({"engine": "paged"}, "sampling.engine='paged': use one of static, continuous"),
    ({"engine": "continuous", "slots": 0}, "slots must be >= 1 with the continuous engine"),
    ({"slots": 4}, "is for the continuous engine"),
    ({"engine": "continuous", "slots": 4, "prefill_prompts": -1}, "prefill_prompts must be >= 0"),
    ({"engine": "continuous", "slots": 4, "tail_halvings": -1}, "tail_halvings must be >= 0"),
])
def test_bad_engine_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(STOP_CONFIG, **fields)
