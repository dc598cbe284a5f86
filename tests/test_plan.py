"""Memory planner (ppo_jax.rl.plan).

Parameter, optimizer and batch bytes in a plan are shape arithmetic on the shardings (per-device shard
shape x itemsize); phase bytes come from `compiled.memory_analysis()`. The tests check the first
against the second, the parameter counts against ModelConfig.num_params, that 8-way fsdp divides
parameter + optimizer memory, that the verdict flips exactly at the peak, and that the CLI plans a
mesh bigger than this process's 8 devices.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_test_mesh

from ppo_jax.cli import plan as plan_cli
from ppo_jax.rl import plan as plan_lib
from ppo_jax.rl.plan_report import format_plan
from ppo_jax.config import ConfigError, model_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "configs" / "plan_tiny.py"
# step [] int32, the KL controller state and the PRNG key: replicated scalars in TrainState.
SMALL_STATE_BYTES = 64


def tiny_config():
    spec = importlib.util.spec_from_file_location("plan_tiny_config", TINY_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def plans():
    """Plans on 1 device and on 8-way fsdp. Only the experience step is compiled: its arguments hold
    every tree (trainable state and frozen params), and it compiles in seconds."""
    config = tiny_config()
    return {shape: plan_lib.plan_memory(config, make_test_mesh(shape), phases=("experience",))
            for shape in [(1, 1, 1), (1, 8, 1)]}


def params_and_optimizer(plan):
    return sum(plan.params.values()) + sum(plan.optimizer.values())


def test_one_device_bytes_are_the_parameter_counts(plans):
    """float32 trees on one device: 4 bytes per parameter; Adam keeps two moments per parameter."""
    one = plans[(1, 1, 1)]
    policy = model_config_from_dict(tiny_config().policy.model)
    assert one.params["policy"] == one.params["reference"] == 4 * policy.num_params()
    # Reward and value: the policy's transformer (no LM head) and a scalar head (kernel [D, 1], bias [1]).
    scalar = policy.num_params(with_lm_head=False) + policy.hidden_size + 1
    assert one.params["reward"] == one.params["value"] == 4 * scalar
    for name in ("policy", "value"):
        assert 0 <= one.optimizer[name] - 2 * one.params[name] <= SMALL_STATE_BYTES  # + step counters


def test_bfloat16_first_moment_is_planned_at_six_bytes_per_parameter():
    """optim.mu_dtype=bfloat16 with float32 params: Adam keeps 2 + 4 bytes per parameter, not 8."""
    config = tiny_config()
    config.optim.mu_dtype = "bfloat16"
    plan = plan_lib.plan_memory(config, make_test_mesh((1, 1, 1)), phases=("experience",))
    for name in ("policy", "value"):
        assert 0 <= plan.optimizer[name] - 1.5 * plan.params[name] <= SMALL_STATE_BYTES


def test_fsdp_divides_parameter_and_optimizer_bytes(plans):
    one, eight = plans[(1, 1, 1)], plans[(1, 8, 1)]
    assert params_and_optimizer(eight) <= 1.15 / 8 * params_and_optimizer(one)
    for name in ("policy", "reference", "reward", "value"):
        assert eight.params[name] <= 1.15 / 8 * one.params[name]


def test_shape_arithmetic_agrees_with_memory_analysis(plans):
    """The experience step reads the four parameter trees and the rollout (jit prunes the optimizer
    states it never reads): the compiler's per-device argument bytes must equal the planner's
    arithmetic, up to the few replicated scalars. Live bytes also count the pruned optimizer states."""
    for plan in plans.values():
        (experience,) = plan.phases
        expected = sum(plan.params.values()) + plan.batch_arrays["rollout"]
        assert 0 <= experience.argument_bytes - expected <= SMALL_STATE_BYTES
        assert experience.live_bytes >= params_and_optimizer(plan) + plan.batch_arrays["rollout"]
        assert experience.live_bytes - experience.argument_bytes >= sum(plan.optimizer.values())


def test_value_lora_plans_adapters_and_head_on_the_shared_base(plans):
    """value.lora: the value model is adapters + head (+ their Adam state) on the reference's frozen
    transformer, which is held once: the trainable bytes drop by about the full value tree x 3."""
    full = plans[(1, 1, 1)]
    config = tiny_config()
    config.value.lora.rank = 4
    config.value.lora.targets = "q,v"
    lora = plan_lib.plan_memory(config, make_test_mesh((1, 1, 1)), phases=("experience",))
    assert lora.value_lora and not full.value_lora
    assert "LoRA: adapters + head on its frozen base" in format_plan(lora)
    for name in ("policy", "reference", "reward"):
        assert lora.params[name] == full.params[name]
    policy = model_config_from_dict(config.policy.model)
    head = 4 * (policy.hidden_size + 1)
    assert head < lora.params["value"] < full.params["value"] / 10
    assert 0 <= lora.optimizer["value"] - 2 * lora.params["value"] <= SMALL_STATE_BYTES

    def trainable(plan):
        return plan.params["policy"] + plan.params["value"] + sum(plan.optimizer.values())

    assert trainable(full) - trainable(lora) > 2.9 * (full.params["value"] - lora.params["value"])
    # The experience step takes the shared base as its own argument (the compiler counts it again),
    # but it is the reference's transformer: in memory once, so the plan's params count it once.
    (experience,) = lora.phases
    base = full.params["value"] - head
    expected = sum(lora.params.values()) + lora.batch_arrays["rollout"] + base
    assert 0 <= experience.argument_bytes - expected <= SMALL_STATE_BYTES


def test_verdict_flips_at_the_peak(plans):
    plan = plans[(1, 8, 1)]
    (phase,) = plan.phases
    assert plan.peak_bytes == phase.live_bytes + phase.output_bytes - phase.alias_bytes + phase.temp_bytes
    assert plan.fits(plan.peak_bytes)
    assert not plan.fits(plan.peak_bytes - 1)
    assert ": FITS (spare 0.000 GiB)" in format_plan(plan, plan.peak_bytes)
    assert ": DOES NOT FIT (short by 0.000 GiB)" in format_plan(plan, plan.peak_bytes - 1)
    assert plan.to_dict(plan.peak_bytes - 1)["fits"] is False


def test_cli_plans_a_mesh_larger_than_this_process(plans):
    """16-way fsdp in a fresh process (16 fake CPU devices there; this process has 8), all three phases."""
    memory_gb = 0.01
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "ppo_jax.cli.plan", f"--config={TINY_CONFIG}", "--config.mesh.shape=1,16,1",
         f"--device_memory_gb={memory_gb}", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["num_devices"] == 16 and out["platform"] == "cpu"
    assert [p["name"] for p in out["phases"]] == ["sampler", "experience", "update"]
    one = plans[(1, 1, 1)]
    per_device = sum(out["params"].values()) + sum(out["optimizer"].values())
    assert per_device <= 1.15 / 16 * params_and_optimizer(one)
    assert out["fits"] == (out["peak_bytes"] <= memory_gb * 1e9)
    # The update reads the trainable state and the experience, and donates the state: its new state
    # is written into exactly those bytes.
    update = out["phases"][2]
    trainable = out["params"]["policy"] + out["params"]["value"] + sum(out["optimizer"].values())
    assert 0 <= update["argument_bytes"] - trainable - out["batch_arrays"]["experience"] <= SMALL_STATE_BYTES
    assert 0 <= update["alias_bytes"] - trainable <= SMALL_STATE_BYTES
    # The sampler's temps hold at least its KV cache.
    assert out["phases"][0]["temp_bytes"] >= out["kv_cache_bytes"] > 0


def test_bad_input_fails_before_compiling():
    with pytest.raises(ConfigError, match="--num_devices"):
        plan_cli.mesh_size((1, -1, 1), None)
    with pytest.raises(ConfigError, match="needs 8 devices, but --num_devices=4"):
        plan_cli.mesh_size((2, 4, 1), 4)
    config = tiny_config()
    config.rollout.batch_size = 12
    with pytest.raises(ConfigError, match="does not split over the 8 data-parallel devices"):
        plan_lib.plan_memory(config, make_test_mesh((1, 8, 1)))
    with pytest.raises(ConfigError, match="phases"):
        plan_lib.plan_memory(tiny_config(), make_test_mesh((1, 1, 1)), phases=("rollout",))
    with pytest.raises(ConfigError, match="unknown model shape"):
        plan_lib.model_shape("llama9-1t")


@pytest.mark.parametrize("name, hf_config", [
    ("gemma3-4b", dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, num_hidden_layers=34,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, intermediate_size=10240)),
    ("qwen3-8b", dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                      tie_word_embeddings=False)),
    ("qwen3-30b-a3b", dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           tie_word_embeddings=False)),
    ("gpt-oss-20b", dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                         num_local_experts=32, num_experts_per_tok=4)),
    ("mixtral-8x7b", dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                          num_local_experts=8, num_experts_per_tok=2)),
])
def test_published_shapes_have_the_transformers_models_parameter_count(name, hf_config):
    """The planner's presets count what `transformers` builds from the same published shape (on the meta
    device: nothing allocated), to the parameter."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    ours = model_config_from_dict(plan_lib.model_shape(name))
    assert ours.num_params() == sum(p.numel() for p in model.parameters())
