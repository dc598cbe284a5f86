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
from test_lora_value import reward_dir  # noqa: F401  (a fixture)
from tiny_configs import tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.models.forward import response_logits, token_logprobs
from ppo_jax import plan as plan_lib
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.rl.settings import Settings


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
    # The stand-in reward model is held as the trainer holds a checkpoint: reward.param_dtype, "" = the policy's.
    half = plan_lib.plan_memory(config(1, **{"reward.param_dtype": "bfloat16"}), make_test_mesh((1, 1, 1)),
                                phases=("experience",))
    assert half.params["reward"] * 2 == plan.params["reward"] and half.reward_source.endswith("held in bfloat16")


@pytest.mark.parametrize("overrides, message", [
    ({"policy.reference_dtype": "int8"}, "policy.reference_dtype='int8'"),
    ({"policy.lora.rank": 4}, "the frozen base is the reference"),
])
def test_bad_reference_dtype_settings_are_refused_before_anything_runs(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        trainer_for(tmp_path, 1, **overrides)


# ------------------------------------------------------------------ the value and reward models' dtypes

BF16_RUN = {"policy.param_dtype": "bfloat16", "policy.dtype": "bfloat16"}
MIXED_RUN = {"policy.param_dtype": "float32", "policy.dtype": "bfloat16", "reward.param_dtype": "bfloat16"}


def floating_dtypes(tree) -> set[str]:
    return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("overrides, want", [
    (BF16_RUN, {"policy": ("bfloat16", "bfloat16"), "value": ("bfloat16", "bfloat16"), "reward": ("bfloat16", "bfloat16")}),
    (MIXED_RUN, {"policy": ("float32", "bfloat16"), "value": ("float32", "bfloat16"), "reward": ("bfloat16", "bfloat16")}),
], ids=["bf16", "mixed"])
def test_the_value_and_reward_models_follow_the_policys_dtypes(reward_dir, tmp_path, overrides, want):
    """The reward model (an fp32 checkpoint) is held and run in the policy's dtypes unless reward.* names
    its own, and the value model started from it is trained like the policy. Before, both stayed fp32
    whatever the policy's settings: on the 2026-11-27 H200 run every GEMM of experience and update
    was an fp32 (TF32) kernel, at half the bf16 rate."""
    c = config(1, **{"reward.path": str(reward_dir), "value.init": "reward", "policy.reference_dtype": "",
                     **overrides})
    trainer = PPOTrainer(c, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    trees = {"policy": (trainer.state.policy, trainer.modules.policy), "value": (trainer.state.value, trainer.modules.value),
             "reward": (trainer.frozen.reward, trainer.modules.reward)}
    for name, (params, module) in trees.items():
        param_dtype, dtype = want[name]
        assert floating_dtypes(params) == {param_dtype}, name
        assert (module.config.param_dtype, module.config.dtype) == (param_dtype, dtype), name
    # The value model starts as the reward model, as held, in its own dtype.
    value, reward = jax.device_get(trainer.state.value), jax.device_get(trainer.frozen.reward)
    for v, r in zip(jax.tree.leaves(value), jax.tree.leaves(reward)):
        np.testing.assert_array_equal(v, r.astype(v.dtype))
    trainer.close()


def test_a_reward_dtype_that_does_not_exist_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.dtype='bf16': use one of"):
        PPOTrainer(config(1, **{"reward.dtype": "bf16"}), str(tmp_path), mesh=make_test_mesh((1, 1, 1)))


def test_an_fp32_policy_on_an_accelerator_is_warned_about():
    from ppo_jax.rl import build

    cfg = build.policy_model_config(Settings.from_config(config(1, **{"policy.reference_dtype": ""})))
    assert cfg.dtype == "float32"
    assert "policy.dtype=bfloat16" in build.fp32_compute_warning(cfg, "gpu")
    assert "TF32" in build.fp32_compute_warning(cfg, "gpu") and build.fp32_compute_warning(cfg, "tpu")
    assert build.fp32_compute_warning(cfg, "cpu") is None
    assert build.fp32_compute_warning(cfg.replace(dtype="bfloat16"), "gpu") is None
