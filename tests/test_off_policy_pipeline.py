"""k-step off-policy rollouts (issue 44 item 1): the sampler keeps rollout.off_policy_steps = k batches in
flight ahead of the trainer, each stamped with the policy version that sampled it. On the tiny config
with k = 2: the pipelined run equals a plain loop written here (batch j sampled with the weights before
update j - k), the policy lag is k once the pipeline is full, a SIGTERM with two batches in flight
resumes bit for bit, the one-step checkpoint format still reads, and the planner counts k samples."""

import base64

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from test_reliability import _toy_reward_then_sigterm_at
from test_roles import assert_same_metrics, comparable, layout_trainer, reward_dir  # noqa: F401 (a fixture)
from tiny_configs import tiny_config

from ppo_jax import reward_functions as reward_fns
from ppo_jax import sharding
from ppo_jax.models.forward import response_logits
from ppo_jax.plan import role_memory
from ppo_jax.rl.rollout_source import resolve_arrays
from ppo_jax.rl.state import Rollout, policy_variables
from ppo_jax.rl.trainer import PPOTrainer

K = 2
ITERATIONS = 4
OVERRIDES = {"rollout.off_policy_steps": K, "train.iterations": ITERATIONS, "ppo.off_policy_ratio": "truncated_is",
             "ppo.is_cap": 1.5, "rollout.batch_size": 16, "rollout.forward_microbatch": 0}
TOY = [(reward_fns.toy_target_count, 1.0)]


def trainer_at(workdir, reward_functions=TOY, **overrides) -> PPOTrainer:
    return PPOTrainer(tiny_config(**{**OVERRIDES, **overrides}), str(workdir), reward_functions=reward_functions,
                      mesh=make_test_mesh((1, 1, 1)))


def plain_k_step_loop(trainer: PPOTrainer, iterations: int, k: int) -> list[dict]:
    """k-step off-policy written out plainly: batch j sampled with θ_{max(0, j - k)} (the weights before
    update j - k), prompts and keys in the order an on-policy run draws them; the experience and update
    steps are the trainer's."""
    before_update = []  # θ_j: the policy before update j
    history = []
    for j in range(iterations):
        before_update.append(sharding.copy_tree(trainer.state.policy, trainer.state_shardings.policy))
        behaviour = before_update[max(0, j - k)]
        prompt_tokens, prompt_mask = trainer.prompts.next_batch()
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), trainer.mesh)
        params, adapters = policy_variables(behaviour, trainer.frozen.policy)
        out = trainer.steps.sampler(params, toks, mask, sharding.replicate(trainer.iteration_key(j), trainer.mesh),
                                    adapters=adapters)
        host = jax.device_get({"pt": out.prompt_tokens, "pm": out.prompt_mask, "t": out.tokens, "m": out.mask})
        scores = np.asarray(reward_fns.toy_target_count(*trainer.decode(host["pt"], host["pm"], host["t"], host["m"])),
                            np.float32)
        rollout = Rollout(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens,
                          mask=out.mask, sampler_logprobs=out.logprobs, behaviour_logprobs=out.sampling_logprobs,
                          stopped=out.stopped, host_scores=sharding.put_batch(scores, trainer.mesh))
        with sharding.mesh_context(trainer.mesh):
            exp, exp_metrics = trainer.steps.experience_jit(trainer.state, trainer.frozen, rollout)
            trainer.state, upd_metrics = trainer.steps.update_jit(trainer.state, trainer.frozen, exp)
        history.append({k: float(v) for k, v in {**jax.device_get(exp_metrics), **jax.device_get(upd_metrics)}.items()})
    return history


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted k = 2 run: (its history, its final policy on the host)."""
    trainer = trainer_at(tmp_path_factory.mktemp("straight"))
    sync, synced_steps = trainer.rollouts.sync, []
    weights = sync.weights
    sync.weights = lambda state: synced_steps.append(int(state.step)) or weights(state)
    history = trainer.train()
    assert not trainer.rollouts.in_flight  # the last k iterations started none
    assert synced_steps == [0, 1]  # ... nor copied the weights to the sampler: they only collect
    assert trainer.trace_counts == {"experience": 1, "update": 1} and trainer.sampler.trace_count == 1
    policy = jax.device_get(trainer.state.policy)
    trainer.close()
    return history, policy


def test_k_step_pipeline_equals_the_plain_loop_and_its_lag_reaches_k(straight, tmp_path):
    history, _ = straight
    reference = trainer_at(tmp_path / "plain")
    expected = plain_k_step_loop(reference, ITERATIONS, K)
    reference.close()
    assert_same_metrics(expected, [{k: v for k, v in row.items() if k in expected[0]} for row in history])
    # Batches 0 .. k all come from θ_0, so batch j's lag is j until the pipeline is full, then k.
    lags = [row["rollout/policy_lag_mean"] for row in history]
    assert lags == [0.0, 1.0, 2.0, 2.0] and [row["rollout/policy_lag_max"] for row in history] == lags
    assert history[0]["rollout/mismatch_kl"] < 1e-6  # batch 0: the very weights being updated
    assert history[2]["rollout/mismatch_kl"] > history[1]["rollout/mismatch_kl"] > 1e-8  # staler, further


def test_sigterm_with_two_batches_in_flight_resumes_bit_for_bit(straight, tmp_path):
    """Stopped after iteration 1, batches 1 and 2 (both sampled by θ_0) are in flight: both are saved
    with their versions, and the resumed run continues with them: identical metrics and parameters."""
    expected, expected_policy = straight
    first = trainer_at(tmp_path, [(_toy_reward_then_sigterm_at(1), 1.0)])
    partial = first.train()
    assert first.stopped_by == "SIGTERM" and len(partial) == 1
    first.close()
    step = tmp_path / "checkpoints" / "1"  # the samples' arrays in Orbax's binary item, not the JSON
    assert (step / "host_arrays").is_dir() and "in_flight_0" in (step / "extra" / "metadata").read_text()
    resumed = trainer_at(tmp_path)
    assert resumed.resumed_from == 1
    assert [r.version for r in resumed.rollouts.in_flight] == [0, 0]
    rest = resumed.train()
    assert len(rest) == ITERATIONS - 1
    for want, got in zip(expected[1:], rest):
        assert comparable(got) == comparable(want)  # bitwise
    for a, b in zip(jax.tree.leaves(expected_policy), jax.tree.leaves(jax.device_get(resumed.state.policy))):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_disaggregated_sampler_scoring_two_batches_in_flight_resumes_bit_for_bit(reward_dir, tmp_path):
    """The sampler on devices of its own, the reference and reward model scoring there: both samples in
    flight are restored onto the sampler's mesh and scored again there, bit for bit."""
    overrides = {**OVERRIDES, "train.iterations": 3, "roles.scoring": "sampler", "reward.path": reward_dir}
    straight = layout_trainer("disaggregated", tmp_path / "straight", TOY, **overrides)
    expected = straight.train()
    expected_policy = jax.device_get(straight.state.policy)
    straight.close()
    first = layout_trainer("disaggregated", tmp_path / "run", [(_toy_reward_then_sigterm_at(1), 1.0)], **overrides)
    assert len(first.train()) == 1 and first.stopped_by == "SIGTERM"
    first.close()
    resumed = layout_trainer("disaggregated", tmp_path / "run", TOY, **overrides)
    assert len(resumed.rollouts.in_flight) == 2 and all(r.frozen_outputs is not None for r in resumed.rollouts.in_flight)
    rest = resumed.train()
    assert [comparable(row) for row in rest] == [comparable(row) for row in expected[1:]]  # bitwise
    for a, b in zip(jax.tree.leaves(expected_policy), jax.tree.leaves(jax.device_get(resumed.state.policy))):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_the_older_checkpoint_formats_still_read(tmp_path):
    """Before k-step rollouts a checkpoint held one sample's arrays (or None), as base64 JSON: it is the
    sample the weights before the saved step's update drew, so its version is step - 1. Today's
    records name their arrays, which the checkpoint holds in Orbax's binary item."""
    trainer = trainer_at(tmp_path, **{"rollout.off_policy_steps": 1})
    trainer.rollouts.next(trainer.state)  # iteration 0 starts batch 1 ahead
    record = trainer.rollouts.in_flight_record()
    (entry,) = record.records
    assert all(set(ref) == {"array"} for ref in entry["sample"].values())  # no array bytes in the JSON
    arrays = resolve_arrays(entry["sample"], record.arrays)
    one_step = {name: {"dtype": str(a.dtype), "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
                for name, a in arrays.items()}
    trainer.rollouts.restore_in_flight(one_step, step=3)  # the one-step format: the arrays alone
    (restored,) = trainer.rollouts.in_flight
    assert restored.version == 2
    again = trainer.rollouts.in_flight_record()
    for name, a in resolve_arrays(again.records[0]["sample"], again.arrays).items():  # bit for bit
        assert a.dtype == arrays[name].dtype
        np.testing.assert_array_equal(a, arrays[name])
    trainer.rollouts.restore_in_flight(None, step=3)
    assert not trainer.rollouts.in_flight
    trainer.close()


def test_the_planner_holds_k_samples_in_flight():
    held = role_memory.Holdings(trainer_resident=1000, held=100, rollout=50, experience=70, prompts=5,
                                policy_copy=300, sample=40, scorer_frozen=200, scores=8)
    for where in ("shared", "colocated", "disaggregated"):
        on_policy = role_memory.phase_live(held, where, 0)
        for k in (1, 2, 4):
            live = role_memory.phase_live(held, where, k)
            # k samples with their scores, and the older policy copy while the new one syncs.
            assert live["sampler"] - on_policy["sampler"] == k * (40 + 8) + 300, (where, k)
            extra = 0 if where == "disaggregated" else k * (40 + 8)  # held beside the trainer's phases
            assert live["update"] - on_policy["update"] == extra, (where, k)


def truncated_log_probs(logits: np.ndarray, tokens: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Float64 NumPy, from the definitions: each token's log-prob under the distribution of logits
    [B, Lr, V] (tempered) kept to its top_k tokens, renormalised,
    then to the smallest set of most likely tokens whose mass reaches top_p, renormalised -> [B, Lr]."""
    z = logits.astype(np.float64)
    kth = -np.sort(-z, axis=-1)[..., top_k - 1: top_k]
    z = np.where(z >= kth, z, -np.inf)
    ordered = -np.sort(-z, axis=-1)
    p = np.exp(ordered - ordered.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = (np.cumsum(p, -1) - p < top_p).sum(-1, keepdims=True)  # mass strictly before each < top_p
    z = np.where(z >= np.take_along_axis(ordered, keep - 1, -1), z, -np.inf)
    log_z = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return np.take_along_axis(z, tokens[..., None], -1)[..., 0] - log_z


def test_truncated_sampling_records_and_corrects_by_the_sampled_distribution(tmp_path):
    """rollout.top_k = 8 and top_p = 0.9, k = 1 with ppo.off_policy_ratio=auto (truncated_is; the
    experience and update programs are those of this module's k = 2 run): batch 0, sampled and
    trained by the initial weights. The rollout's behaviour
    log-probs are those of the truncated, renormalised distribution the tokens were drawn from
    (float64 NumPy from a plain forward's logits), the full ones are the trainer's, and the logged
    kept mass and importance weight are their ratio (< 1), while the first minibatch's ratio is 1.
    Red when the rollout's behaviour log-probs are the full distribution's (`rl/rollouts.py`
    passing `behaviour_logprobs=out.logprobs`): the log-probs differ, kept mass and weight read 1."""
    top_k, top_p = 8, 0.9
    trainer = trainer_at(tmp_path, **{"rollout.off_policy_steps": 1, "ppo.off_policy_ratio": "auto",
                                      "rollout.top_k": top_k, "rollout.top_p": top_p})
    assert trainer.hp.off_policy_ratio == "truncated_is"
    initial = jax.device_get(trainer.state.policy)
    row = trainer.run_iteration()
    rollout, _ = trainer._last_rollout
    r = jax.device_get({"pt": rollout.prompt_tokens, "pm": rollout.prompt_mask, "t": rollout.tokens,
                        "m": rollout.mask, "full": rollout.sampler_logprobs, "behaviour": rollout.behaviour_logprobs})
    params, adapters = policy_variables(initial, jax.device_get(trainer.frozen.policy))
    logits = np.asarray(jax.jit(response_logits, static_argnums=0)(
        trainer.modules.policy, params, *(jnp.asarray(r[k]) for k in ("pt", "pm", "t", "m")), 1.0, adapters))
    trainer.close()
    real = r["m"] > 0
    full = jax.nn.log_softmax(logits.astype(np.float64), axis=-1)
    np.testing.assert_allclose(r["full"][real], np.take_along_axis(full, r["t"][..., None], -1)[..., 0][real],
                               atol=2e-5)
    expected = truncated_log_probs(logits, r["t"], top_k, top_p)
    np.testing.assert_allclose(r["behaviour"][real], expected[real], atol=2e-5)
    kept = np.exp(r["full"] - expected)[real]  # pi_train / pi_behaviour per token: the kept mass
    assert kept.mean() < 0.95  # the truncation bites
    np.testing.assert_allclose(row["sampling/kept_mass"], kept.mean(), rtol=1e-4)
    np.testing.assert_allclose(row["off_policy/is_weight_mean"], kept.mean(), rtol=1e-4)
    assert row["rollout/truncated_frac"] == 0.0  # every weight below the cap: scaled, none capped
    assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6  # the ratio to the recomputed policy

