"""policy.reference_dtype: the frozen reference held in a narrower dtype than the policy's fp32 master
weights (issue 28). The reference is then exactly the initial policy rounded to that dtype: its
log-probs are those of the rounded weights, resumes restore it bit for bit, and the planner counts it
at its own width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from test_lora_ppo import assert_same_run
from tiny_configs import tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.models.forward import response_logits, token_logprobs
from ppo_jax import plan as plan_lib
from ppo_jax.rl.trainer import PPOTrainer


def config(iterations, **overrides):
    c = tiny_config(**{"policy.param_dtype": "float32", "policy.reference_dtype": "bfloat16",
                       **overrides})
    c.train.iterations = iterations
    return c


def trainer_for(workdir, iterations, **overrides):
    return PPOTrainer(config(iterations, **overrides), str(workdir), mesh=make_test_mesh((1, 1, 1)))


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    trainer = trainer_for(tmp_path_factory.mktemp("ref_bf16"), 2)
    initial = jax.device_get(trainer.state.policy)
    return trainer, trainer.train(), initial


def test_the_reference_is_the_initial_policy_rounded_to_bfloat16(run2):
    trainer, history, initial = run2
    reference = jax.device_get(trainer.frozen.reference)
    for got, start in zip(jax.tree.leaves(reference), jax.tree.leaves(initial)):
        assert start.dtype == np.float32 and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, start.astype(jnp.bfloat16))
    # Its log-probs are those of the rounded weights (computed here by the same forward).
    r, exp = trainer._last_rollout
    logits = response_logits(trainer.modules.policy, reference, r.prompt_tokens, r.prompt_mask, r.tokens, r.mask,
                             trainer.hp.temperature)
    np.testing.assert_allclose(np.asarray(token_logprobs(logits, r.tokens, r.mask)), np.asarray(exp.ref_logprobs),
                               atol=1e-6, rtol=0)
    # The invariants that do not involve the reference still hold exactly.
    assert abs(history[0]["first_minibatch/ratio"] - 1.0) < 1e-6
    assert history[0]["policy/rollout_logprob_diff_max"] < 1e-5


def test_resume_restores_the_bfloat16_reference_exactly(run2, tmp_path):
    trainer2, history2, _ = run2
    first = trainer_for(tmp_path, 1)
    first.train()
    first.close()
    resumed = trainer_for(tmp_path, 2)
    assert resumed.resumed_from == 1
    assert jax.tree.leaves(resumed.frozen.reference)[0].dtype == jnp.bfloat16
    assert_same_run(trainer2, history2, resumed, resumed.train())


def test_the_planner_holds_the_reference_at_half_the_fp32_policy():
    c = config(1)
    plan = plan_lib.plan_memory(c, make_test_mesh((1, 1, 1)), phases=("experience",))
    assert plan.params["reference"] * 2 == plan.params["policy"]
    assert plan.reference == "bfloat16 copy"


@pytest.mark.parametrize("overrides, message", [
    ({"policy.reference_dtype": "int8"}, "policy.reference_dtype='int8'"),
    ({"policy.lora.rank": 4}, "the frozen base is the reference"),
])
def test_bad_reference_dtype_settings_are_refused_before_anything_runs(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        trainer_for(tmp_path, 1, **overrides)
