"""The weight sync sends the sampler's dtype (issue 44 item 7, `rl/roles.py`): a policy that computes
in bf16 on fp32 master weights travels to a sampler of its own cast to bf16 on the trainer's side
(half the bytes moved and held), except the few vectors a forward reads in float32 (norm scales and
biases, attention sinks). The cast copy samples exactly what the fp32 weights sample; the planner
counts the copy and the sync at that dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax import sharding
from ppo_jax import plan as plan_lib
from ppo_jax.models import ModelConfig, init_params
from ppo_jax.config import model_config_from_dict
from ppo_jax.models.transformer import CausalLM
from ppo_jax.rl import roles
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.sampling.config import SamplingConfig
from ppo_jax.sampling.loop import sample
from ppo_jax.sampling import weights

BF16 = {"policy.dtype": "bfloat16"}
DISAGGREGATED = {"mesh.shape": (4, 1, 1), "roles.sampler_devices": 4, "roles.sampler_mesh": (1, 2, 2)}


def leaf_dtypes(tree) -> dict[str, set]:
    """{leaf name: its dtypes}"""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.setdefault(path[-1].key, set()).add(jnp.dtype(x.dtype).name)
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_cast_copy_samples_exactly_what_the_fp32_weights_sample(arch):
    """gpt2's LayerNorm reads its scale and bias in float32 (kept as held); Llama's RMSNorm casts its
    scale to the compute dtype, so there every leaf cast by hand samples the same too."""
    cfg = ModelConfig(arch=arch, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                      dtype="bfloat16")
    model = CausalLM(cfg)
    params, _ = init_params(model, jax.random.key(0), make_test_mesh((1, 1, 1)))
    # Norm scales and biases off their init (1 and 0 are exact in bf16), as a trained model's are.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.1 * jax.random.normal(jax.random.key(len(path)), x.shape)
        if path[-1].key in ("scale", "bias") else x, params)
    assert weights.sampler_dtype(cfg) == "bfloat16" and weights.sampler_dtype(cfg.replace(dtype="float32")) is None
    cast = weights.cast_for_sampler(params, weights.sampler_dtype(cfg))
    dtypes = leaf_dtypes(cast)
    assert dtypes["kernel"] == dtypes["embedding"] == {"bfloat16"} and dtypes["scale"] == {"float32"}
    assert roles.tree_bytes(cast) < 0.55 * roles.tree_bytes(params)
    config = SamplingConfig(max_new_tokens=12, pad_token_id=0, num_samples=2)
    run = jax.jit(functools.partial(sample, model=model, config=config))
    prompts = jnp.asarray(np.random.default_rng(0).integers(1, 64, (4, 5)), jnp.int32)
    mask = jnp.ones((4, 5), jnp.int32).at[1, :2].set(0)
    want = run(params, prompts, mask, jax.random.key(3))
    every_leaf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    for tree in (cast, every_leaf):
        got = run(tree, prompts, mask, jax.random.key(3))
        same = (np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
                and np.array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs)))
        # Every leaf cast by hand: the same on Llama (RMSNorm casts its scale), not on gpt2 (LayerNorm
        # reads scale and bias in float32): why those stay as held.
        assert same == (tree is cast or arch == "llama")


def test_a_sampler_of_its_own_gets_a_bf16_copy_and_the_sync_moves_half_the_bytes(tmp_path):
    trainer = PPOTrainer(tiny_config(**{"train.iterations": 1, **BF16, **DISAGGREGATED}), str(tmp_path))
    synced = trainer.sampler_weights()
    assert leaf_dtypes(synced.params)["kernel"] == {"bfloat16"}
    assert leaf_dtypes(synced.params)["scale"] == {"float32"}
    (_, nbytes), = trainer.rollouts.sync.log
    assert nbytes == roles.tree_bytes(synced.params) < 0.55 * roles.tree_bytes(trainer.state.policy)
    # The tokens the run samples are those of a sampler given the weights cast here, by hand.
    by_hand = jax.device_put(jax.tree.map(lambda x: np.asarray(x, jnp.bfloat16) if x.ndim > 1 else np.asarray(x),
                                          jax.device_get(trainer.state.policy)), trainer.steps.sampler_shardings.params)
    prompts = sharding.put_batch({"t": np.arange(16 * 8).reshape(16, 8) % 31 + 1, "m": np.ones((16, 8), np.int32)},
                                 trainer.meshes.sampler)
    key = sharding.replicate(jax.random.key(7), trainer.meshes.sampler)
    ours = trainer.sample(prompts["t"], prompts["m"], key)
    theirs = trainer.steps.sampler(by_hand, prompts["t"], prompts["m"], key)
    np.testing.assert_array_equal(np.asarray(ours.tokens), np.asarray(theirs.tokens))
    trainer.close()


def test_the_planner_counts_the_samplers_copy_and_the_sync_at_bf16():
    """In float32 the sync is 4 bytes a parameter and the sampler's (1, 2, 2) mesh holds at least a
    quarter of them on each device (tests/test_plan.py): at least P bytes."""
    config = tiny_config(**{**BF16, **DISAGGREGATED})
    plan = plan_lib.plan_memory(config, phases=("sampler",), devices=jax.devices())
    params = model_config_from_dict(config.policy.model).num_params()
    # the matrices at 2 bytes, the norm scales and biases (a few vectors) at 4
    assert 2 * params < plan.roles.sync_bytes < 2.2 * params
    assert plan.roles.sampler.policy_copy_bytes < 0.6 * params
