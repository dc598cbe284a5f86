"""Memory planner (ppo_jax.plan).

Parameter, optimizer and batch bytes in a plan are shape arithmetic on the shardings (per-device shard
shape x itemsize); phase bytes come from `compiled.memory_analysis()`. The tests check the first
against the second, the parameter counts against ModelConfig.num_params, that 8-way fsdp divides
parameter + optimizer memory, that the verdict flips exactly at the peak, that the CLI plans a
mesh bigger than this process's 8 devices, and each role's bytes when the sampler has its own mesh
(colocated or on devices of its own) against arithmetic on the shapes.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import make_test_mesh

from ppo_jax import accelerators
from ppo_jax.cli import plan as plan_cli
from ppo_jax import plan as plan_lib
from ppo_jax.plan import format_plan
from ppo_jax.config import ConfigError, model_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "configs" / "plan_tiny.py"
# step [] int32, the KL controller state and the PRNG key: replicated scalars in PPOState.
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


def role_config(**roles):
    config = tiny_config()
    for name, value in roles.items():
        setattr(config.roles, name, value)
    return config


def sample_bytes(rows: int, config) -> int:
    """One SampleOutput's bytes for `rows` rows: prompt tokens and mask [R, Lq] int32; tokens, mask,
    log-probs and sampling log-probs [R, Lr] 4 bytes; lengths and slot steps [R] int32, stopped [R] bool."""
    return rows * (2 * config.data.prompt_length * 4 + 4 * config.rollout.response_length * 4 + 4 + 4 + 1)


def kv_cache_bytes(config, rows: int, kv_heads: int) -> int:
    """k and v [L, rows, K, Lq + Lr - 1, Dh] float32 on one device."""
    m = config.policy.model
    width = config.data.prompt_length + config.rollout.response_length - 1
    return 2 * m.num_layers * rows * kv_heads * width * (m.hidden_size // m.num_heads) * 4


def test_colocated_sampler_holds_its_copy_beside_the_trainers_trees(plans):
    """roles.sampler_mesh=(8,1,1) beside FSDP training (1,8,1) on the same 8 devices: every device holds
    the trainer's shards and a whole data-parallel copy of the policy, both in every phase's live
    bytes; both roles report the devices' one peak."""
    config = role_config(sampler_mesh=(8, 1, 1))
    config.mesh.shape = (1, 8, 1)
    plan = plan_lib.plan_memory(config, phases=("sampler", "experience"))
    roles, shared = plan.roles, plans[(1, 8, 1)]
    assert roles.layout == "colocated" and "on the same devices" in roles.description
    policy = model_config_from_dict(config.policy.model)
    assert roles.sampler.policy_copy_bytes == 4 * policy.num_params() == roles.sync_bytes
    assert roles.trainer.policy_copy_bytes == roles.sampler.train_state_bytes == roles.sampler.frozen_bytes == 0
    trainer_trees = roles.trainer.train_state_bytes + roles.trainer.frozen_bytes
    assert 0 <= trainer_trees - params_and_optimizer(shared) <= SMALL_STATE_BYTES  # roles move no trainer tree
    # The trainer's devices before its experience step, as on one mesh, plus the sampler's copy and the
    # sample it scores (kept on the sampler's mesh, 2 of the 16 rows a device); the sampler starts
    # beside the trainer's trees and its previous batch, with its prompts (2 rows of tokens + mask).
    (one_mesh,) = shared.phases
    sampler, experience = plan.phases
    copy = roles.sampler.policy_copy_bytes
    assert experience.live_bytes == one_mesh.live_bytes + copy + sample_bytes(2, config)
    trainer_between_phases = one_mesh.live_bytes - plan.batch_arrays["rollout"]
    assert sampler.live_bytes == trainer_between_phases + copy + 2 * 2 * config.data.prompt_length * 4
    assert roles.trainer.temp_bytes == experience.temp_bytes
    assert roles.sampler.temp_bytes == sampler.temp_bytes >= plan.kv_cache_bytes
    assert plan.kv_cache_bytes == roles.sampler.kv_cache_bytes == kv_cache_bytes(config, rows=2, kv_heads=2)
    assert roles.trainer.peak_bytes == roles.sampler.peak_bytes == plan.peak_bytes
    assert "Roles (colocated)" in format_plan(plan)


def test_disaggregated_sampler_devices_hold_only_the_samplers_copy():
    """roles.sampler_devices=4: FSDP training (1,4,1) on 4 devices, a tensor-parallel sampler (1,1,4) on
    the other 4. The sampler's devices hold its copy (every matrix split 4 ways, the norm scales
    whole), prompts and KV cache, and no optimizer state; the trainer's no copy."""
    config = role_config(sampler_devices=4, sampler_mesh=(1, 1, 4))
    config.mesh.shape = (1, 4, 1)
    config.policy.model.num_kv_heads = 4  # so the tensor axis splits k and v too
    plan = plan_lib.plan_memory(config, phases=("sampler", "experience"), devices=jax.devices())
    roles = plan.roles
    assert roles.layout == "disaggregated" and "its own 4 devices" in roles.description
    assert (roles.trainer.num_devices, roles.sampler.num_devices) == (4, 4)
    policy = model_config_from_dict(config.policy.model)
    full = 4 * policy.num_params()
    norms = 4 * (2 * policy.num_layers + 1) * policy.hidden_size
    assert roles.sync_bytes == full
    assert roles.sampler.policy_copy_bytes == (full - norms) // 4 + norms
    sampler, experience = plan.phases
    # Batch divisor 1 on the sampler's mesh: all 16 prompt rows (tokens + mask) on every device.
    prompts = 2 * 16 * config.data.prompt_length * 4
    assert sampler.live_bytes == roles.sampler.policy_copy_bytes + prompts
    assert 0 <= sampler.argument_bytes - sampler.live_bytes <= SMALL_STATE_BYTES  # the compiler agrees (+ key)
    assert roles.sampler.train_state_bytes == roles.sampler.frozen_bytes == 0
    assert plan.kv_cache_bytes == roles.sampler.kv_cache_bytes == kv_cache_bytes(config, rows=16, kv_heads=1)
    assert roles.sampler.temp_bytes == sampler.temp_bytes >= plan.kv_cache_bytes
    assert (roles.sampler.peak_bytes, roles.sampler.peak_phase) == (sampler.peak_bytes, "sampler")
    # The trainer's devices: its trees, the previous iteration's batch and this rollout; no copy.
    batch = plan.batch_arrays
    trainer_trees = roles.trainer.train_state_bytes + roles.trainer.frozen_bytes
    assert 0 <= trainer_trees - params_and_optimizer(plan) <= SMALL_STATE_BYTES
    assert experience.live_bytes == trainer_trees + 2 * batch["rollout"] + batch["experience"]
    assert (roles.trainer.peak_bytes, roles.trainer.peak_phase) == (experience.peak_bytes, "experience")
    assert plan.peak_bytes == max(sampler.peak_bytes, experience.peak_bytes)
    assert "Roles (disaggregated)" in format_plan(plan)
    assert plan.to_dict()["roles"]["sampler"]["policy_copy_bytes"] == roles.sampler.policy_copy_bytes


def test_lora_sampler_copy_is_the_base_and_its_adapters():
    """With LoRA the sampler decodes its own copy of the frozen base (synced once) with a copy of the
    adapters (synced every step): a data-parallel sampler holds both whole on every device."""
    config = role_config(sampler_mesh=(8, 1, 1))
    config.mesh.shape = (1, 8, 1)
    config.policy.lora.rank = 4
    config.policy.lora.targets = "q,v"
    plan = plan_lib.plan_memory(config, phases=("sampler",))
    m = config.policy.model
    base = 4 * model_config_from_dict(m).num_params()
    head_dim = m.hidden_size // m.num_heads
    # q: A [D, r], B [r, H * Dh]; v: A [D, r], B [r, K * Dh]; float32, every layer.
    adapters = 4 * m.num_layers * 4 * (2 * m.hidden_size + (m.num_heads + m.num_kv_heads) * head_dim)
    assert (plan.roles.base_sync_bytes, plan.roles.sync_bytes) == (base, adapters)
    assert plan.roles.sampler.policy_copy_bytes == base + adapters
    # roles.lora_sync="merged": the adapters are folded into a decoding copy beside the base copy; on
    # the trainer's own mesh the merged copy (on the base's shardings) is the only one.
    config.roles.lora_sync = "merged"
    merged = plan_lib.plan_memory(config, phases=("sampler",))
    assert merged.roles.sampler.policy_copy_bytes == 2 * base
    config.roles.sampler_mesh = ()
    shared = plan_lib.plan_memory(config, phases=("sampler",))
    base_shard = shared.roles.trainer.frozen_bytes - shared.params["reward"]  # the base is the reference
    assert shared.roles.layout == "shared" and shared.roles.sampler.policy_copy_bytes == base_shard
    assert base / 8 <= base_shard <= 1.15 * base / 8  # on the trainer's 8-way FSDP shardings


def tensor_split_bytes(params: int, norms: int, ways: int) -> int:
    """float32 bytes of a tree on a tensor-parallel mesh: every matrix split `ways` ways, norm scales whole."""
    return 4 * ((params - norms) // ways + norms)


def scoring_config(scoring: str):
    """Disaggregated: FSDP training (1,4,1) on 4 devices, a tensor-parallel sampler (1,1,4) on the other 4."""
    config = role_config(sampler_devices=4, sampler_mesh=(1, 1, 4), scoring=scoring)
    config.mesh.shape = (1, 4, 1)
    config.policy.model.num_kv_heads = 4  # so the tensor axis splits k and v too
    return config


def test_disaggregated_sampler_scoring_holds_the_reference_and_reward_model():
    """roles.scoring=sampler: the reference and reward model live on the sampler's 4 devices (split 4
    ways like its copy), where a scoring program of their own scores each sample; the trainer's devices
    hold no frozen tree, and its experience step reads neither (its arguments drop by both trees, less
    the reference log-probs [R, Lr] and model scores [R] that now come with the rollout)."""
    config = scoring_config("sampler")
    plan = plan_lib.plan_memory(config, phases=("sampler", "scoring", "experience"), devices=jax.devices())
    roles = plan.roles
    assert roles.scoring == "sampler" and roles.sampler.phases == ("sampler", "scoring")
    policy = model_config_from_dict(config.policy.model)
    norms = (2 * policy.num_layers + 1) * policy.hidden_size
    reference = tensor_split_bytes(policy.num_params(), norms, 4)
    # The reward model: the policy's transformer (no LM head) split like it, its scalar head whole.
    reward = tensor_split_bytes(policy.num_params(with_lm_head=False), norms, 4) + 4 * (policy.hidden_size + 1)
    assert roles.sampler.frozen_bytes == reference + reward
    assert roles.trainer.frozen_bytes == plan.params["reference"] == plan.params["reward"] == 0
    assert roles.sampler.policy_copy_bytes == reference  # the copy it decodes, beside the reference
    sampler, scoring, experience = plan.phases
    prompts = 2 * 16 * config.data.prompt_length * 4  # all 16 rows on every device (batch divisor 1)
    assert sampler.live_bytes == roles.sampler.policy_copy_bytes + roles.sampler.frozen_bytes + prompts
    assert scoring.live_bytes == sampler.live_bytes + sample_bytes(16, config)
    # The compiler agrees: the scoring program reads both trees, prompts and responses (tokens + masks).
    responses = 2 * 16 * config.rollout.response_length * 4
    assert scoring.argument_bytes == roles.sampler.frozen_bytes + prompts + responses
    assert roles.sampler.peak_bytes == max(sampler.peak_bytes, scoring.peak_bytes)
    assert roles.sampler.temp_bytes == max(sampler.temp_bytes, scoring.temp_bytes)

    trainer_scored = plan_lib.plan_memory(scoring_config("trainer"), phases=("experience",), devices=jax.devices())
    (trainer_experience,) = trainer_scored.phases
    frozen = trainer_scored.params["reference"] + trainer_scored.params["reward"]
    assert trainer_scored.roles.trainer.frozen_bytes == frozen > 0
    # 16 rows over 4 data-parallel trainer devices: 4 rows of log-probs [Lr] and a score each, float32.
    scores = 4 * (config.rollout.response_length + 1) * 4
    assert plan.batch_arrays["rollout"] - trainer_scored.batch_arrays["rollout"] == scores
    assert trainer_experience.argument_bytes - experience.argument_bytes == frozen - scores
    assert trainer_experience.live_bytes - experience.live_bytes == frozen - 2 * scores  # this + last rollout
    assert plan.to_dict()["roles"]["scoring"] == "sampler" and "scoring" not in trainer_scored.to_dict()["roles"]
    report = format_plan(plan)
    assert "Scoring (roles.scoring=sampler)" in report and "the trainer keeps no frozen tree" in report


def test_lora_sampler_scoring_reads_the_samplers_base_copy():
    """LoRA with roles.scoring=sampler, colocated: the reference is the base, and the scorer reads the
    sampler's own base copy, so the sampler's frozen trees are the reward model alone (data-parallel:
    whole on every device); the trainer keeps its FSDP base shard to train on."""
    config = role_config(sampler_mesh=(8, 1, 1), scoring="sampler")
    config.mesh.shape = (1, 8, 1)
    config.policy.lora.rank = 4
    config.policy.lora.targets = "q,v"
    plan = plan_lib.plan_memory(config, phases=("scoring",))
    roles = plan.roles
    policy = model_config_from_dict(config.policy.model)
    base = 4 * policy.num_params()
    reward = 4 * (policy.num_params(with_lm_head=False) + policy.hidden_size + 1)
    assert roles.sampler.frozen_bytes == reward and plan.params["reward"] == 0
    assert base / 8 <= roles.trainer.frozen_bytes <= 1.15 * base / 8  # the LoRA base, on the trainer's FSDP
    assert roles.sampler.policy_copy_bytes - base == roles.sync_bytes  # base + adapters, as without scoring
    (scoring,) = plan.phases
    # It reads the base copy and the reward model, prompts and responses of 2 rows a device; no more.
    inputs = 2 * 2 * (config.data.prompt_length + config.rollout.response_length) * 4
    assert scoring.argument_bytes == base + reward + inputs
    assert roles.layout == "colocated" and roles.trainer.peak_bytes == roles.sampler.peak_bytes == scoring.peak_bytes


@pytest.mark.skipif(not accelerators.libtpu_installed(), reason="compiling for a TPU slice needs libtpu")
def test_disaggregated_plan_on_a_multi_host_tpu_slice():
    """v5p:2x4x1 (8 chips, 2 hosts of 2x2): each host gives its last 2 chips to the sampler (as a run
    splits them), leaving the trainer rows y=0 and y=2 of the torus, a set jax's TPU mesh builder
    rejects (it wants the devices to fill their bounding box): the roles' meshes keep the split order
    (`roles._role_mesh`). The sampler's bytes are as on CPU."""
    from ppo_jax import accelerators

    config = role_config(sampler_devices=4, sampler_mesh=(4, 1, 1))
    config.mesh.shape = (1, 4, 1)
    plan = plan_lib.plan_memory(config, phases=("sampler",), devices=accelerators.tpu_devices("v5p:2x4x1"))
    roles = plan.roles
    assert roles.layout == "disaggregated" and plan.platform == "tpu"
    assert roles.sampler.policy_copy_bytes == 4 * model_config_from_dict(config.policy.model).num_params()
    (sampler,) = plan.phases
    assert sampler.live_bytes == roles.sampler.policy_copy_bytes + 2 * 4 * config.data.prompt_length * 4


def test_one_mesh_plans_report_no_roles(plans):
    plan = plans[(1, 8, 1)]
    assert plan.roles is None and "roles" not in plan.to_dict() and "Roles" not in format_plan(plan)


@pytest.mark.parametrize("roles, mesh_shape, batch_size, match", [
    (dict(sampler_devices=8), (1, 8, 1), 16, "leaves no devices for training"),
    (dict(sampler_mesh=(1, 1, 3)), (1, 8, 1), 16, r"roles.sampler_mesh=\(1, 1, 3\) does not fit the sampler's 8"),
    (dict(sampler_mesh=(8, 1, 1)), (1, 4, 2), 12, "not a multiple of the sampler's 8 data-parallel devices"),
    (dict(sampler_devices=4, sampler_mesh=(1, 1, 3)), (1, 4, 1), 16, "does not fit the sampler's 4 devices"),
    (dict(sampler_devices=4, scoring="sampler", phases=("value",)), (1, 4, 1), 16, "name one or more of sampler"),
    (dict(sampler_devices=4, phases=("scoring",)), (1, 4, 1), 16, r"no such program \(roles.scoring=trainer\)"),
])
def test_bad_roles_fail_in_one_line_before_compiling(roles, mesh_shape, batch_size, match):
    roles = dict(roles)
    phases = roles.pop("phases", plan_lib.PHASES)
    config = role_config(**roles)
    config.mesh.shape = mesh_shape
    config.rollout.batch_size = batch_size
    compiled = []
    with pytest.raises(ConfigError, match=match) as err:
        plan_lib.plan_memory(config, phases=phases, devices=jax.devices(), inspect=lambda *a: compiled.append(a))
    assert "\n" not in str(err.value) and not compiled


def test_cli_counts_the_samplers_own_devices():
    assert plan_cli.planned_devices((1, 4, 1), 4, None) == 8
    assert plan_cli.planned_devices((1, -1, 1), 4, 8) == 8  # -1: the trainer takes what the sampler leaves
    assert plan_cli.planned_devices((1, 8, 1), 0, None) == 8
    with pytest.raises(ConfigError, match="need 8 devices, but --num_devices=6"):
        plan_cli.planned_devices((1, 4, 1), 4, 6)
    with pytest.raises(ConfigError, match="leaves none of --num_devices=4"):
        plan_cli.planned_devices((1, -1, 1), 4, 4)


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
