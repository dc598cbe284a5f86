"""A decode step's shared-input projections (q/k/v, gate/up) as one GEMM (layers.project_shared_input).

On a GPU `compute.decode_projections=auto` merges them where a kernel is past XLA's 32 MiB dot-merger
limit (tests/test_accelerators.py checks what XLA:GPU compiles of it); here "merged" (any size) runs
the same code on the CPU, where each merged decode step must give the full forward's logits, LoRA
adapters must still count, and a mesh that splits the projections' outputs must keep them apart.
"""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.config import ComputeSettings
from ppo_jax.models import CausalLM, ModelConfig, init_cache, positions_from_mask
from ppo_jax.models.config import LoraConfig

VOCAB, ROWS, PROMPT, GENERATED = 96, 4, 5, 3
TOTAL = PROMPT + GENERATED
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
            max_position_embeddings=32, tie_word_embeddings=False)
CONFIGS = {
    "llama": ModelConfig(arch="llama", **BASE),
    "qwen2": ModelConfig(arch="qwen2", **BASE, attention_bias=True),  # biases on q, k and v
    "qwen3": ModelConfig(arch="qwen3", **BASE, head_dim=32),  # q/k norms after the projections
}
MERGED = 0  # ModelConfig.merge_decode_projections_above: any kernel size


def random_variables(config: ModelConfig, seed: int = 0) -> dict:
    """Every weight, bias, norm scale and LoRA factor random (init leaves biases 0 and LoRA's B 0,
    which would hide a projection's bias or adapter being dropped)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    abstract = jax.eval_shape(lambda: CausalLM(config).init(jax.random.key(0), tokens, tokens, jnp.ones_like(tokens)))
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        offset = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(offset + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, nn.unbox(abstract))


def sequence():
    """tokens, mask, positions [ROWS, TOTAL]: left-padded prompts, then GENERATED tokens."""
    rng = np.random.default_rng(1)
    mask = np.ones((ROWS, TOTAL), np.int32)
    for row, n in enumerate((5, 3, 1, 4)):
        mask[row, :PROMPT - n] = 0
    tokens = jnp.asarray(rng.integers(1, VOCAB, mask.shape) * mask, jnp.int32)
    return tokens, jnp.asarray(mask), positions_from_mask(jnp.asarray(mask))


def decode(config: ModelConfig, variables: dict, mesh_shape=(1, 1, 1)):
    """(full forward logits [B, TOTAL, V], each decode step's logits [B, GENERATED, V], the dot count of a
    decode step's jaxpr, that of the prefill's)."""
    tokens, mask, positions = sequence()
    model = CausalLM(config)
    forward = jax.jit(model.apply)
    with jax.set_mesh(make_test_mesh(mesh_shape)), sharding.activation_rules():
        full, _ = forward(variables, tokens, positions, mask, None)
        cache = init_cache(config, ROWS, TOTAL)
        prefill_args = (tokens[:, :PROMPT], positions[:, :PROMPT], mask, cache)
        prefill_dots = dot_count(model, variables, *prefill_args)
        _, cache = forward(variables, *prefill_args)
        steps = []
        for t in range(PROMPT, TOTAL):
            args = (tokens[:, t:t + 1], positions[:, t:t + 1], mask, cache)
            step_dots = dot_count(model, variables, *args)
            logits, cache = forward(variables, *args)
            steps.append(logits[:, 0])
    return np.asarray(full), np.stack(steps, 1), step_dots, prefill_dots


def dot_count(model: CausalLM, variables: dict, *args) -> int:
    """dot_general equations in the jaxpr of one forward (nested jaxprs included)."""
    def count(jaxpr) -> int:
        return sum(1 if eqn.primitive.name == "dot_general" else
                   sum(count(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)

    return count(jax.make_jaxpr(model.apply)(variables, *args).jaxpr)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_merged_decode_steps_give_the_full_forwards_logits(name):
    """Each decode step merged (one GEMM for q/k/v, one for gate/up: 3 dots fewer in each layer's body,
    which the scanned layers trace once) gives the logits of the full forward, whose many-token
    projections stay apart."""
    apart = CONFIGS[name]
    merged = apart.replace(merge_decode_projections_above=MERGED)
    variables = random_variables(apart)
    full, steps, step_dots, prefill_dots = decode(merged, variables)
    _, _, apart_step_dots, apart_prefill_dots = decode(apart, variables)
    assert apart.scan_layers and step_dots == apart_step_dots - 3
    assert prefill_dots == apart_prefill_dots
    assert np.abs(full).max() > 1.0
    err = np.abs(steps - full[:, PROMPT:]).max()
    assert err <= 1e-5, f"{name}: a merged decode step differs from the full forward by {err}"


def test_lora_adapters_keep_their_projections_apart():
    """Under a "lora" collection the adapted projections stay apart, so their low-rank terms count."""
    config = CONFIGS["llama"].replace(lora=LoraConfig(rank=2, targets=("q", "v", "gate")))
    variables = random_variables(config)
    base = {"params": variables["params"]}
    _, merged_steps, dots, _ = decode(config.replace(merge_decode_projections_above=MERGED), variables)
    _, apart_steps, apart_dots, _ = decode(config, variables)
    _, base_steps, _, _ = decode(config, base)
    assert dots == apart_dots
    np.testing.assert_array_equal(merged_steps, apart_steps)
    assert np.abs(merged_steps - base_steps).max() > 1e-3  # the adapters change the logits


def test_a_mesh_that_splits_the_projections_keeps_them_apart():
    """The tensor axis splits heads and MLP features: joining split kernels would move weights."""
    config = CONFIGS["llama"].replace(merge_decode_projections_above=MERGED)
    variables = random_variables(config)
    _, _, dots, _ = decode(config, variables, mesh_shape=(1, 1, 2))
    _, _, apart_dots, _ = decode(CONFIGS["llama"], variables, mesh_shape=(1, 1, 2))
    assert dots == apart_dots


def test_merged_and_apart_hold_on_every_platform():
    """("auto" by platform: tests/test_compute.py.)"""
    cfg = CONFIGS["llama"]
    for platform in ("cpu", "gpu", "tpu"):
        assert ComputeSettings(decode_projections="merged").execution(cfg, platform)["merge_decode_projections_above"] == 0
        assert ComputeSettings(decode_projections="apart").execution(cfg, platform)["merge_decode_projections_above"] is None
