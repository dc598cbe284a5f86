"""PPO with a LoRA policy (policy.lora.rank > 0): the trainable policy is the adapters, the base is
frozen and, with the adapters off, is the reference (no reference tree exists). DESIGN.md §5
invariants on real steps, exact resume, export (PEFT adapter and merged weights), bad configs."""

import os
import subprocess
import sys

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.checkpoint import CheckpointError
from ppo_jax.config import ConfigError
from ppo_jax.models import CausalLM, hf
from ppo_jax.models.forward import response_logits, token_logprobs
from ppo_jax import plan as plan_lib
from ppo_jax.plan import format_plan
from ppo_jax.rl.export import export_checkpoint
from ppo_jax.rl.trainer import PPOTrainer

# GPT-2's o / fc / proj are one HF module each, so the adapters are PEFT-representable (q/k/v share c_attn).
LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "policy.lora.targets": "o,fc,proj",
        "optim.policy_lr": 3e-3}


def lora_config(iterations, **overrides):
    return tiny_config(**{**LORA, "train.iterations": iterations, **overrides})


def trainer_for(workdir, iterations):
    return PPOTrainer(lora_config(iterations), str(workdir), mesh=make_test_mesh((1, 1, 1)))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Three iterations from scratch: (trainer, history, (base, adapters) before training, workdir)."""
    workdir = tmp_path_factory.mktemp("lora")
    trainer = trainer_for(workdir, 3)
    before = jax.device_get((trainer.frozen.policy, trainer.state.policy))
    history = trainer.train()
    trainer.checkpoints.wait()
    return trainer, history, before, workdir


def test_first_iteration_kl_is_zero_and_ratio_one_and_rollout_logprobs_match(lora_run):
    _, history, _, _ = lora_run
    # B starts at zero, so the first policy IS the base: its KL to the reference is exactly 0.
    assert history[0]["objective/kl"] == 0.0
    assert history[0]["first_minibatch/ratio"] == 1.0
    for row in history:  # the same tolerances as the full-policy invariants (tests/test_trainer.py)
        assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
        assert row["first_minibatch/approxkl"] < 1e-12
        # The sampler decodes with the adapters; its log-probs are the training forward's.
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
    assert history[-1]["objective/kl"] != 0.0  # the adapters did move the policy


def test_update_changes_only_the_adapters_and_no_reference_exists(lora_run):
    trainer, _, (base_before, adapters_before), workdir = lora_run
    assert trainer.frozen.reference is None
    base_after, adapters_after = jax.device_get((trainer.frozen.policy, trainer.state.policy))
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after)):
        np.testing.assert_array_equal(a, b)
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters_before),
                                                        jax.tree.leaves(adapters_after))]
    assert all(changed), changed
    # The trainable tree and the optimizer state are the adapters' (no base-sized leaf anywhere).
    adapter_shapes = {x.shape for x in jax.tree.leaves(adapters_after)}
    assert {x.shape for x in jax.tree.leaves(trainer.state.policy_opt)} <= adapter_shapes | {()}
    assert sum(x.size for x in jax.tree.leaves(adapters_after)) < sum(x.size for x in jax.tree.leaves(base_after)) / 4
    # Nothing frozen is checkpointed: the base is identified by its checksums only.
    checkpoints = workdir / "checkpoints"
    assert not trainer.checkpoints.has_frozen("reference")
    assert "reference" not in str(sorted(p.name for p in checkpoints.rglob("*")))
    extra = trainer.checkpoints.read_extra(None)[1]
    assert set(extra["frozen_checksums"]) == {"policy_base"}


def test_no_recompilation_after_first_iteration(lora_run):
    trainer, _, _, _ = lora_run
    assert trainer.trace_counts == {"experience": 1, "update": 1}
    assert trainer.sampler.trace_count == 1


def test_planner_counts_no_reference_and_adapter_optimizer_state():
    mesh = make_test_mesh((1, 1, 1))
    full = plan_lib.plan_memory(tiny_config(), mesh, phases=("experience",))
    lora = plan_lib.plan_memory(lora_config(1), mesh, phases=("update",))
    assert lora.params["reference"] == 0 and full.params["reference"] == full.params["policy"]
    assert lora.params["policy"] > full.params["policy"]  # the base plus the adapters
    assert 0 < lora.optimizer["policy"] < full.optimizer["policy"] / 4
    assert "the base is the reference" in format_plan(lora)


def test_reference_logprobs_are_the_initial_base_without_adapters(lora_run):
    trainer, _, (base_before, _), _ = lora_run
    r, exp = trainer._last_rollout
    # The untrained base (snapshot before iteration 1), adapters off, gives the last iteration's reference.
    logits = response_logits(trainer.modules.policy, base_before, r.prompt_tokens, r.prompt_mask, r.tokens, r.mask,
                             trainer.hp.temperature)
    np.testing.assert_allclose(np.asarray(token_logprobs(logits, r.tokens, r.mask)), np.asarray(exp.ref_logprobs),
                               atol=1e-6, rtol=0)
    ref_logp, _ = trainer.score_responses(r.prompt_tokens, r.prompt_mask, r.tokens, r.mask)
    np.testing.assert_array_equal(np.asarray(ref_logp), np.asarray(exp.ref_logprobs))


def test_resume_is_exact(lora_run, tmp_path):
    trainer3, history3, _, _ = lora_run
    first = trainer_for(tmp_path, 2)
    first.train()
    first.close()
    resumed = trainer_for(tmp_path, 3)
    assert resumed.resumed_from == 2
    history = resumed.train()
    assert_same_run(trainer3, history3, resumed, history)


def _tokens():
    """Left-padded [2, 12] tokens, positions, mask."""
    mask = np.ones((2, 12), np.int32)
    mask[1, :4] = 0
    tokens = np.random.default_rng(0).integers(1, 32, (2, 12)) * mask
    return tokens, np.maximum(np.cumsum(mask, -1) - 1, 0), mask


def _torch_logits(model):
    tokens, positions, mask = _tokens()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.numpy()[mask.astype(bool)]


def test_export_as_peft_adapter_and_merged_match_our_logits(lora_run, tmp_path):
    trainer, _, _, workdir = lora_run
    cfg = trainer.policy_config
    tokens, positions, mask = _tokens()
    ours = np.asarray(CausalLM(cfg).apply({"params": trainer.frozen.policy, "lora": trainer.state.policy},
                                          tokens, positions, mask)[0])[mask.astype(bool)]
    merged = export_checkpoint(str(workdir), str(tmp_path / "merged"), lora_format="merged")
    np.testing.assert_allclose(_torch_logits(transformers.AutoModelForCausalLM.from_pretrained(merged)), ours,
                               atol=1e-5, rtol=0)
    adapter = str(tmp_path / "adapter")  # through the command line, as users export
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.export", f"--checkpoint={workdir}", f"--out={adapter}",
                          "--lora=adapter"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    # The run's base was a random init (no policy.path): export it to give PEFT something to load onto.
    base_dir = hf.export_model(tmp_path / "base", cfg.replace(lora=None), trainer.frozen.policy)
    torch_model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                                 adapter).eval()
    np.testing.assert_allclose(_torch_logits(torch_model), ours, atol=1e-5, rtol=0)


INVALID = [
    ({"policy.lora.rank": -1}, "policy.lora.rank must be >= 0"),
    ({"policy.lora.targets": "q,zz"}, "policy.lora.targets has unknown projections ['zz']"),
    ({"policy.lora.targets": "q,gate"}, "policy.lora.targets ['gate'] name projections a gpt2 model does not have"),
    ({"policy.lora.targets": ""}, "policy.lora.targets is empty"),
    ({"policy.lora.alpha": 0.0}, "policy.lora.alpha must be positive"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=[m for _, m in INVALID])
def test_bad_lora_config_fails_before_compiling_with_its_message(overrides, message, tmp_path):
    config = tiny_config(**{**LORA, **overrides})
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PPOTrainer(config, str(tmp_path / "run"), mesh=make_test_mesh((1, 1, 1)))
    assert not (tmp_path / "run").exists()  # nothing written


def test_bf16_base_with_fp32_adapters_trains(tmp_path):
    """The frozen base in any dtype: a bf16 base, fp32 adapters (the trainable master weights)."""
    config = lora_config(1, **{"policy.param_dtype": "bfloat16"})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    history = trainer.train()
    assert {x.dtype for x in jax.tree.leaves(trainer.frozen.policy)} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(trainer.state.policy)} == {np.dtype("float32")}
    assert history[0]["objective/kl"] == 0.0 and history[0]["first_minibatch/ratio"] == 1.0


def test_resume_against_another_base_is_refused(tmp_path):
    trainer = trainer_for(tmp_path, 1)
    trainer.train()
    trainer.close()
    # Another seed inits another base: the checkpoint's base checksums no longer match.
    with pytest.raises(CheckpointError, match="were trained on another base policy than the one seed=1"):
        PPOTrainer(lora_config(2, seed=1), str(tmp_path), mesh=make_test_mesh((1, 1, 1)))


def test_learning_rate_zero_keeps_the_policy_the_base_exactly(tmp_path):
    config = lora_config(2, **{"optim.policy_lr": 0.0, "optim.value_lr": 0.0})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    before = jax.device_get(trainer.state.policy)
    history = trainer.train()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(trainer.state.policy))):
        np.testing.assert_array_equal(a, b)
    for row in history:  # B stays 0: the policy is the reference bit for bit
        assert row["objective/kl"] == 0.0


def test_sampler_refuses_a_call_without_its_adapters(lora_run):
    trainer, _, _, _ = lora_run
    tokens, _, mask = _tokens()
    with pytest.raises(ValueError, match="must be given adapters"):
        trainer.sampler(trainer.frozen.policy, tokens[:, :8], mask[:, :8], jax.random.key(0))


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2)], ids=lambda s: "mesh" + "x".join(map(str, s)))
def test_sharded_meshes_give_the_same_metrics(lora_run, mesh_shape, tmp_path):
    """Adapters and the frozen base sharded over data / fsdp / tensor axes: the same run."""
    _, expected, _, _ = lora_run
    history = PPOTrainer(lora_config(2), str(tmp_path), mesh=make_test_mesh(mesh_shape)).train()  # 2 of the 3
    for want, got in zip(expected, history):
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):  # the tolerances of tests/test_trainer.py
                np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)


def assert_same_run(expected, expected_history, got, got_history):
    """Two PPO trainers ended in the same state bit for bit (keys by their data) with the same last
    metrics (timings aside)."""
    for a, b in zip(jax.tree.leaves(jax.device_get(expected.state)), jax.tree.leaves(jax.device_get(got.state))):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    for key, value in expected_history[-1].items():
        if not key.startswith(("time/", "perf/")):
            assert got_history[-1][key] == value, key
