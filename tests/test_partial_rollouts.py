"""Partial (interruptible) rollouts (issue 44 item 2): the continuous engine in segments
(sampling/segments.py) with a weight sync between them, each token stamped with the version of the
weights that chose it. Segments under one set of weights give exactly the unsegmented engine's
samples; after a sync the later tokens are drawn and logged under the new weights; the policy lag is
per token; a SIGTERM with partial rollouts in flight resumes bit for bit; bad settings fail in one line."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from test_off_policy_pipeline import TOY, trainer_at
from test_reliability import _toy_reward_then_sigterm_at
from test_roles import comparable
from test_sampling import STOP_CONFIG, _gather, _log_softmax, _model_and_params, _prompts, _training_logits
from tiny_configs import tiny_config

from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.plan import role_memory
from ppo_jax.rl.corrections import policy_lag_metrics
from ppo_jax.rl.errors import RunFailedError
from ppo_jax.rl.settings import Settings
from ppo_jax.sampling import sample_continuous, segments
from ppo_jax.sampling.token_choice import choose_tokens, response_uniforms

# 16 rows (8 prompts x 2 samples) on 6 slots, 2 prompts per prefill: rows wait in the queue, so some
# are prefilled only after a sync; the scanned decode with one tail halving, so `finish` runs a tail stage.
CONFIG = dataclasses.replace(STOP_CONFIG, engine="continuous", slots=6, prefill_prompts=2, unroll_layers=False,
                             tail_halvings=1)
KEY = 1


@pytest.fixture(scope="module")
def engine():
    """The tiny Llama, its params, and the jitted unsegmented engine and segments."""
    model, params, _ = _model_and_params("llama")
    static = dict(model=model, config=CONFIG)
    return dict(
        model=model, params=params,
        whole=jax.jit(lambda p, t, m, k: sample_continuous(p, t, m, k, **static)),
        begin=jax.jit(lambda p, t, m, k, v, b: segments.begin(p, t, m, k, v, b, **static)),
        advance=jax.jit(lambda p, s, v, b: segments.advance(p, s, v, b, **static)),
        finish=jax.jit(lambda p, s, v: segments.finish(p, s, v, **static)))


def _segmented(engine, params_by_segment, budget):
    """The engine run in len(params_by_segment) segments, segment i under params_by_segment[i] with
    version i; budget decode steps each but the last."""
    tokens, mask = _prompts()
    first, *middle, last = params_by_segment
    state = engine["begin"](first, tokens, mask, jax.random.key(KEY), 0, budget)
    for version, params in enumerate(middle, start=1):
        state = engine["advance"](params, state, version, budget)
    return jax.device_get(engine["finish"](last, state, len(params_by_segment) - 1))


def test_segments_under_one_set_of_weights_give_the_unsegmented_samples(engine):
    params = engine["params"]
    whole = jax.device_get(engine["whole"](params, *_prompts(), jax.random.key(KEY)))
    out = _segmented(engine, [params] * 4, budget=3)
    for field in ("tokens", "logprobs", "sampling_logprobs", "mask", "lengths", "stopped", "slot_steps_at_finish"):
        np.testing.assert_array_equal(getattr(out, field), getattr(whole, field), err_msg=field)  # bitwise
    assert whole.token_policy_version is None
    versions, mask = out.token_policy_version, out.mask.astype(bool)
    assert np.all(versions[~mask] == -1) and set(np.unique(versions[mask])) == {0, 1, 2, 3}
    assert np.all(np.diff(np.where(mask, versions, 99), axis=1) >= 0)  # a row's versions only grow


def _reference_logprobs(model, params, out):
    """[R, N] log_softmax(logits / T) of the sampled tokens from one plain forward of `params` over
    prompt + response (each token's prefix), and the tempered logits [R, N, V]."""
    scaled = _training_logits(model, params, out) / CONFIG.temperature
    return _gather(_log_softmax(scaled), out.tokens), scaled


def test_after_a_sync_the_later_tokens_are_drawn_and_logged_under_the_new_weights(engine):
    """The sync changes only the final norm's scale: every KV cache is the same under both weights,
    so each token's recorded log-prob must be that of a plain forward of the weights of its version
    over its prefix, and its token the one those logits and its uniform choose."""
    model, old = engine["model"], engine["params"]
    new = jax.tree.map(lambda x: x, old)
    new["transformer"]["ln_f"]["scale"] = old["transformer"]["ln_f"]["scale"] * 1.7
    out = _segmented(engine, [old, new], budget=4)
    versions, mask = out.token_policy_version, out.mask.astype(bool)
    first, later = mask & (versions == 0), mask & (versions == 1)
    mixed_rows = (first.any(1) & later.any(1))
    assert first.sum() and later.sum() and mixed_rows.any()  # rows in progress went on under the new weights
    old_lp, _ = _reference_logprobs(model, old, out)
    new_lp, new_logits = _reference_logprobs(model, new, out)
    np.testing.assert_allclose(out.logprobs[first], old_lp[first], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.logprobs[later], new_lp[later], atol=1e-5, rtol=0)
    assert np.abs(old_lp[later] - new_lp[later]).max() > 1e-2  # the two weights tell them apart
    # Drawn under the new weights: the new logits and the token's uniform choose it.
    rows, steps = np.nonzero(later)
    draws = response_uniforms(jax.random.key(KEY), out.tokens.shape[0], CONFIG.max_new_tokens)[rows, steps]
    chosen = choose_tokens(jnp.asarray(new_logits[rows, steps] * CONFIG.temperature, jnp.float32),
                           jnp.asarray(steps, jnp.int32), draws, CONFIG)
    np.testing.assert_array_equal(np.asarray(chosen.tokens), out.tokens[rows, steps])


def test_rows_begun_after_the_sync_are_the_new_weights_own_samples(engine):
    """Every weight changed: a row prefilled after the sync is decoded by the new weights alone, so it
    is the row the unsegmented engine gives under them (its uniforms depend on (row, step) only)."""
    old = engine["params"]
    new = jax.tree.map(lambda x: x * 1.05, old)
    out = _segmented(engine, [old, new], budget=4)
    whole_new = jax.device_get(engine["whole"](new, *_prompts(), jax.random.key(KEY)))
    mask = out.mask.astype(bool)
    new_rows = np.all(~mask | (out.token_policy_version == 1), axis=1)
    assert 0 < new_rows.sum() < len(new_rows)
    for field in ("tokens", "mask", "logprobs"):
        np.testing.assert_allclose(getattr(out, field)[new_rows], getattr(whole_new, field)[new_rows], atol=1e-6,
                                   rtol=0, err_msg=field)


def test_the_policy_lag_is_per_token_over_the_action_tokens():
    rng = np.random.default_rng(0)
    versions = rng.integers(3, 7, (6, 9)).astype(np.int32)
    mask = (rng.random((6, 9)) < 0.6).astype(np.float32)
    versions = np.where(mask > 0, versions, -1)  # nothing chosen off the mask
    step = 7
    lag = (step - versions)[mask > 0]
    got = jax.device_get(policy_lag_metrics(jnp.int32(step), jnp.full((6,), 3), jnp.asarray(versions),
                                            jnp.asarray(mask)))
    np.testing.assert_allclose(got["rollout/policy_lag_mean"], lag.mean(), rtol=1e-6)
    assert got["rollout/policy_lag_max"] == lag.max()
    # Without token versions, the rows' (unchanged).
    rows = jax.device_get(policy_lag_metrics(jnp.int32(step), jnp.asarray([5, 6, 7])))
    assert rows == {"rollout/policy_lag_mean": 1.0, "rollout/policy_lag_max": 2.0}


PARTIAL = {"rollout.off_policy_steps": 2, "rollout.engine": "continuous", "rollout.partial_rollouts": True,
           "train.iterations": 3}
# A Qwen3-MoE policy with routing replay: each token's record is that of the weights that fed it
# (tests/test_router_replay.py); the records travel in the engine state, so the checkpoint holds them.
MOE_REPLAY = {"policy.model.arch": "qwen3_moe", "policy.model.qk_norm": True, "policy.model.num_heads": 4,
              "policy.model.num_experts": 4, "policy.model.experts_per_token": 2,
              "policy.model.moe_intermediate_size": 16, "moe.router_replay": True}


@dataclasses.dataclass
class StraightRun:
    """The uninterrupted k = 2 run with partial rollouts: its overrides, history, final policy, and
    each iteration's (step, token versions [B, Lr], mask [B, Lr], routing record or None) as the
    experience step saw them."""

    overrides: dict
    history: list
    policy: dict
    seen: list


@pytest.fixture(scope="module", params=["dense", "moe_replay"])
def straight(request, tmp_path_factory):
    overrides = {**PARTIAL, **(MOE_REPLAY if request.param == "moe_replay" else {})}
    trainer = trainer_at(tmp_path_factory.mktemp("straight"), **overrides)
    seen, finish = [], trainer.rollouts.finish

    def recording_finish(sampled):
        rollout = finish(sampled)
        seen.append((int(trainer.state.step),
                     *jax.device_get((rollout.token_policy_version, rollout.mask, rollout.routed_experts))))
        return rollout

    trainer.rollouts.finish = recording_finish
    history = trainer.train()
    policy = jax.device_get(trainer.state.policy)
    trainer.close()
    return StraightRun(overrides, history, policy, seen)


def test_the_trainer_logs_each_tokens_lag(straight):
    history, seen = straight.history, straight.seen
    for row, (step, versions, mask, _) in zip(history, seen):
        lag = (step - versions)[mask > 0]
        assert np.all(versions[mask == 0] == -1)
        np.testing.assert_allclose(row["rollout/policy_lag_mean"], lag.mean(), rtol=1e-6)
        assert row["rollout/policy_lag_max"] == lag.max()
        assert "rollout/mismatch_kl" in row
    # Batch 0 all θ_0; batch 2 begun under θ_0, advanced under θ_1, finished under θ_2.
    assert history[0]["rollout/policy_lag_max"] == 0
    assert set(np.unique(seen[2][1][seen[2][2] > 0])) == {0, 1, 2}
    assert 0 < history[2]["rollout/policy_lag_mean"] < 2  # below k: later tokens came from newer weights


@pytest.mark.parametrize("straight", ["moe_replay"], indirect=True)
def test_routing_replay_carries_each_tokens_record_through_partial_rollouts(straight):
    """The experience step gets every fed response token's record, and batch 0 (all θ_0, trained
    under θ_0 in float32) has not one token whose own routing differs from it."""
    for row, (_, _, mask, record) in zip(straight.history, straight.seen):
        lr = mask.shape[1]
        fed = (mask[:, 1:] > 0)  # response token j is fed when token j + 1 is chosen
        assert (record[:, -lr:-1][fed] >= 0).all() and (record[:, -lr:][mask == 0] == -1).all()
        assert "rollout/routing_mismatch" in row
    assert straight.history[0]["rollout/routing_mismatch"] == 0.0


@pytest.mark.parametrize("straight", ["dense"], indirect=True)
def test_evaluation_during_partial_rollouts_is_a_whole_rollout_and_leaves_training_alone(straight, tmp_path):
    """Evaluation samples whole responses of the current weights, whatever the training source (it
    crashed on the segmented source's empty first sample, issue 60), and takes nothing from the batches
    in flight: the training metrics equal the run's without evaluation, bit for bit."""
    trainer = trainer_at(tmp_path, **{**straight.overrides, "train.eval_every": 2})
    history = trainer.train()
    trainer.close()
    evaluated = [row for row in history if "eval/scores" in row]
    assert evaluated and all(np.isfinite(row["eval/scores"]) for row in evaluated)
    for row, plain in zip(history, straight.history):
        assert {k: v for k, v in row.items() if k.startswith(("objective/", "loss/", "rollout/"))} == \
            {k: v for k, v in plain.items() if k.startswith(("objective/", "loss/", "rollout/"))}


def test_sigterm_with_partial_rollouts_in_flight_resumes_bit_for_bit(straight, tmp_path):
    """Stopped after iteration 1: batch 2 (begun under θ_0, advanced under θ_1) is in flight
    mid-rollout; its engine state (KV cache, and with routing replay its records) is saved whole and
    the resumed run finishes it under θ_2."""
    first = trainer_at(tmp_path, [(_toy_reward_then_sigterm_at(2), 1.0)], **straight.overrides)
    assert len(first.train()) == 2 and first.stopped_by == "SIGTERM"
    first.close()
    resumed = trainer_at(tmp_path, TOY, **straight.overrides)
    assert resumed.resumed_from == 2
    (pending,) = resumed.rollouts.in_flight
    assert hasattr(pending, "arrays") and pending.version == 0  # mid-rollout: its engine state, saved
    rest = resumed.train()
    assert [comparable(row) for row in rest] == [comparable(row) for row in straight.history[2:]]  # bitwise
    for a, b in zip(jax.tree.leaves(straight.policy), jax.tree.leaves(jax.device_get(resumed.state.policy))):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_the_planner_holds_each_partial_rollouts_kv_cache():
    held = role_memory.Holdings(trainer_resident=1000, held=100, rollout=50, experience=70, prompts=5,
                                policy_copy=300, sample=40, scorer_frozen=200, scores=8)
    for where in ("shared", "colocated", "disaggregated"):
        for k in (1, 2, 4):
            whole, partial = (role_memory.phase_live(held, where, k, engine_state=e) for e in (0, 64))
            assert partial["sampler"] - whole["sampler"] == k * 64, (where, k)
            assert partial["update"] - whole["update"] == (0 if where == "disaggregated" else k * 64), (where, k)


def test_bytes_one_device_holds_are_its_shards():
    """[16, 4] float32 rows split over 8 devices (2 rows, 32 bytes each), a replicated [3] float32 on
    every device (12), a [5] int32 on the first only (20): 64 bytes on the first device, 44 elsewhere."""
    mesh = make_test_mesh((1, 8, 1))
    rows = jax.device_put(np.zeros((16, 4), np.float32), NamedSharding(mesh, P("fsdp")))
    everywhere = jax.device_put(np.zeros(3, np.float32), NamedSharding(mesh, P()))
    first = jax.device_put(np.zeros(5, np.int32), mesh.devices.flat[0])
    assert sharding.device_bytes((rows, everywhere, first, None)) == 64
    assert sharding.device_bytes((rows, everywhere)) == 44
    assert sharding.free_device_bytes(mesh.devices.flat) is None  # a CPU reports no memory


@pytest.mark.parametrize("overrides,held,advice", [
    (PARTIAL, "its engine state and KV cache", " or fewer rollout.slots"),
    ({"rollout.off_policy_steps": 2, "train.iterations": 3}, "its sample and scores", ""),
], ids=["partial", "whole"])
def test_batches_in_flight_that_do_not_fit_the_devices_are_refused_in_one_line(monkeypatch, tmp_path, overrides,
                                                                              held, advice):
    """Where the devices report their free memory (a GPU or TPU), the first batch in flight is measured
    before the others are dispatched: here 1 byte is free, so k = 2 is refused."""
    monkeypatch.setattr(sharding, "free_device_bytes", lambda devices: 1)
    trainer = trainer_at(tmp_path, **overrides)
    size = r"(\d+\.\d\d [KMG]iB)"
    with pytest.raises(RunFailedError, match=r"ConfigError: rollout.off_policy_steps=2: a batch in flight holds "
                       rf"{size} per sampler device \({held}, measured on the first\), so the 2 that join it need "
                       rf"{size}, but 0.00 KiB are free there; use rollout.off_policy_steps=0 or less{advice}; "
                       r"no iteration completed") as err:
        trainer.train()
    scale = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
    each, need = (float(n) * scale[u] for n, u in re.findall(r"(?:holds|need) ([\d.]+) ([KMG]iB)", str(err.value)))
    assert each > 0 and need == pytest.approx(2 * each, rel=0.01)
    assert len(trainer.rollouts.in_flight) == 1  # the others were never dispatched
    trainer.close()


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.partial_rollouts": True, "rollout.off_policy_steps": 1},
     "partial rollouts need rollout.engine=continuous"),
    ({"rollout.partial_rollouts": True, "rollout.engine": "continuous"},
     "rollout.partial_rollouts needs rollout.off_policy_steps >= 1"),
    ({"rollout.partial_rollouts": True, "rollout.engine": "continuous", "rollout.off_policy_steps": 1,
      "environment.name": "scripted_envs:Scripted", "rollout.slots": 8},
     "rollout.partial_rollouts with environment.name and rollout.slots=8: partial multi-turn rollouts keep a "
     "decode row per episode"),
], ids=["static-engine", "on-policy", "multi-turn-slots"])
def test_bad_partial_rollout_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        Settings.from_config(tiny_config(**overrides), reward_in_code=False)
    assert "\n" not in str(err.value)
