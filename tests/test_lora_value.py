"""PPO with a LoRA value model (value.lora.*) and with policy adapters imported from a PEFT directory
(policy.lora.init_from).

Value LoRA: the trainable value is {"lora": adapters, "score": head}; its transformer is a frozen tree
the run holds anyway (the policy's base, the reference, the reward model), the same arrays, never a
copy. Imported adapters: the trainable adapters start from them and base + a frozen copy of them is
the reference, so iteration 1 has KL 0 and the export stays relative to the original base.

The runs use a lighter loop than tests/test_lora_ppo.py (one epoch, one minibatch, one forward
slice): the point is which trees change and which are shared, not the loop.
"""

import shutil

import jax
import numpy as np
import peft
import pytest
import transformers
from conftest import make_test_mesh
from test_lora_ppo import _tokens, _torch_logits, assert_same_run
from tiny_configs import tiny_config

from ppo_jax.checkpoint import CheckpointError
from ppo_jax.config import ConfigError
from ppo_jax.data import toy
from ppo_jax.models import CausalLM, ScalarModel, hf, init_adapters, init_params
from ppo_jax.models.forward import response_values
from ppo_jax.rl import build
from ppo_jax.rl.export import export_checkpoint
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import value_variables
from ppo_jax.rl.trainer import PPOTrainer

LIGHT = {"rollout.batch_size": 16, "rollout.forward_microbatch": 0, "ppo.epochs": 1, "ppo.num_minibatches": 1,
         "ppo.num_microbatches": 1}
POLICY_LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "policy.lora.targets": "o,fc,proj",
               "optim.policy_lr": 3e-3}
VALUE_LORA = {"value.lora.rank": 4, "value.lora.alpha": 8.0, "value.lora.targets": "q,v,fc", "optim.value_lr": 3e-3}


def config(iterations, **overrides):
    return tiny_config(**{**LIGHT, "train.iterations": iterations, **overrides})


def trainer_for(workdir, iterations, **overrides):
    return PPOTrainer(config(iterations, **overrides), str(workdir), mesh=make_test_mesh((1, 1, 1)))


def leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def buffers(tree) -> set[int]:
    """The device buffers (pointers) a tree's arrays live in."""
    return {x.addressable_data(0).unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}


def unique_bytes(*trees) -> int:
    """Bytes of the distinct device buffers of `trees` (a buffer two trees share counts once)."""
    seen = {}
    for x in jax.tree.leaves(trees):
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            seen[x.addressable_data(0).unsafe_buffer_pointer()] = x.nbytes
    return sum(seen.values())


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree)
               if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


# ------------------------------------------------------------------ value LoRA on a LoRA policy


@pytest.fixture(scope="module")
def value_run(tmp_path_factory):
    """LoRA policy + LoRA value model, three iterations (three optimizer steps: the zero head moves
    first, then B, then A): (trainer, history, snapshot before, workdir)."""
    workdir = tmp_path_factory.mktemp("value_lora")
    trainer = trainer_for(workdir, 3, **POLICY_LORA, **VALUE_LORA)
    before = jax.device_get((trainer.frozen.policy, trainer.state.policy, trainer.state.value))
    history = trainer.train()
    trainer.checkpoints.wait()
    return trainer, history, before, workdir


def test_value_base_is_the_policy_base_held_once(value_run):
    trainer, _, _, _ = value_run
    base = trainer.frozen.policy["transformer"]
    assert trainer.frozen.value is base  # the subtree itself, not a copy
    assert all(a is b for a, b in zip(jax.tree.leaves(trainer.frozen.value), jax.tree.leaves(base)))
    assert buffers(trainer.frozen.value) <= buffers(trainer.frozen.policy)
    # Every byte the run holds: the frozen policy base once, plus adapter-sized trainable trees.
    held = unique_bytes(trainer.state, trainer.frozen)
    trainable = nbytes((trainer.state.policy, trainer.state.policy_opt, trainer.state.value, trainer.state.value_opt))
    small = nbytes((trainer.state.step, trainer.state.kl))
    assert held == nbytes(trainer.frozen.policy) + trainable + small
    assert trainable < nbytes(trainer.frozen.policy)  # no full-size trainable tree anywhere
    assert set(trainer.state.value) == {"lora", "score"}
    shapes = {x.shape for x in jax.tree.leaves(trainer.state.value)}
    assert {x.shape for x in jax.tree.leaves(trainer.state.value_opt)} <= shapes | {()}


def test_update_changes_only_adapters_and_head_and_the_shared_base_is_bit_identical(value_run):
    trainer, history, (base, policy, value), _ = value_run
    assert leaves_equal(base, jax.device_get(trainer.frozen.policy))
    after_policy, after_value = jax.device_get((trainer.state.policy, trainer.state.value))
    for before, after in ((policy, after_policy), (value["lora"], after_value["lora"]),
                          (value["score"], after_value["score"])):
        changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
        assert all(changed), changed
    assert history[0]["objective/kl"] == 0.0 and history[0]["first_minibatch/ratio"] == 1.0
    assert history[0]["values/mean"] == 0.0  # zero head: the value model starts at 0, as a full one does
    assert all(np.isfinite(row["loss/value_avg"]) for row in history)
    assert trainer.trace_counts == {"experience": 1, "update": 1}
    recorded = trainer.checkpoints.read_extra(None)[1]["frozen_checksums"]
    assert set(recorded) == {"policy_base", "value_base"}


def test_resume_is_exact(value_run, tmp_path):
    trainer3, history3, _, _ = value_run
    first = trainer_for(tmp_path, 2, **POLICY_LORA, **VALUE_LORA)
    first.train()
    first.close()
    resumed = trainer_for(tmp_path, 3, **POLICY_LORA, **VALUE_LORA)
    assert resumed.resumed_from == 2
    assert resumed.frozen.value is resumed.frozen.policy["transformer"]
    history = resumed.train()
    assert_same_run(trainer3, history3, resumed, history)


def test_export_writes_the_policy_adapter_and_the_merged_value_model(value_run, tmp_path):
    trainer, _, _, workdir = value_run
    mesh = make_test_mesh((1, 1, 1))
    adapter = export_checkpoint(str(workdir), str(tmp_path / "adapter"), lora_format="adapter")
    _, loaded = hf.load_adapter(adapter, trainer.policy_config.replace(lora=None), mesh)
    assert leaves_equal(jax.device_get(loaded), jax.device_get(trainer.state.policy))
    # The value model: adapters merged into a rebuilt, checksum-checked copy of the policy's base, + head.
    value_dir = export_checkpoint(str(workdir), str(tmp_path / "value"), which="value")
    exported = hf.load_model(value_dir, mesh, kind="reward")
    tokens, _, mask = _tokens()
    pt, pm, rt, rm = tokens[:, :8], mask[:, :8], tokens[:, 8:], np.ones_like(mask[:, 8:])
    params, adapters = value_variables(trainer.state.value, trainer.frozen.value)
    want = response_values(trainer.modules.value, params, pt, pm, rt, rm, adapters=adapters)
    got = response_values(ScalarModel(exported.config, head_init="reward"), exported.params, pt, pm, rt, rm)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(want)).max() > 0


# ------------------------------------------------------------------ value LoRA on other bases (no training)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A random tiny GPT-2 reward model (ForSequenceClassification) with the toy tokenizer."""
    s = Settings.from_config(config(1))
    cfg = build.policy_model_config(s)
    params, _ = init_params(ScalarModel(cfg, head_init="reward"), jax.random.key(7), make_test_mesh((1, 1, 1)))
    return hf.export_model(tmp_path_factory.mktemp("rm") / "rm", cfg, params, kind="reward",
                           tokenizer=toy.tokenizer(cfg.vocab_size))


def test_value_lora_from_the_reward_model_starts_as_the_full_value_model(reward_dir, tmp_path):
    trainer = trainer_for(tmp_path, 1, **VALUE_LORA, **{"value.init": "reward", "reward.path": str(reward_dir)})
    frozen = trainer.frozen
    assert frozen.value is frozen.reward["transformer"]  # shared with the reward model, not copied
    assert buffers(trainer.state.value["score"]).isdisjoint(buffers(frozen.reward))  # the head is a copy (donated)
    assert leaves_equal(jax.device_get(trainer.state.value["score"]), jax.device_get(frozen.reward["score"]))
    tokens, _, mask = _tokens()
    pt, pm, rt, rm = tokens[:, :8], mask[:, :8], tokens[:, 8:], np.ones_like(mask[:, 8:])
    full = ScalarModel(trainer.reward_config, head_init="reward")  # the full value model value.init="reward" trains
    want = response_values(full, frozen.reward, pt, pm, rt, rm)
    params, adapters = value_variables(trainer.state.value, frozen.value)
    got = response_values(trainer.modules.value, params, pt, pm, rt, rm, adapters=adapters)
    assert np.abs(np.asarray(want)).max() > 0
    # B = 0: x @ W + scale * (x @ A) @ 0 is x @ W exactly.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    trainer.close()


def test_resume_refuses_another_value_base(reward_dir, tmp_path):
    """The reward model rewritten in place with other weights of the same shapes: its files' fingerprint
    (config and safetensors header) is unchanged, the value base's checksums are not."""
    rm = tmp_path / "rm"
    shutil.copytree(reward_dir, rm)
    overrides = {**VALUE_LORA, "value.init": "reward", "reward.path": str(rm)}
    trainer = trainer_for(tmp_path / "run", 2, **overrides)
    trainer.save_checkpoint(force=True)  # step 0 is enough: no compile
    trainer.close()
    export_checkpoint(str(tmp_path / "run"), str(tmp_path / "value"), which="value")  # on the reward model's base
    params = jax.tree.map(lambda x: x + 0.5, jax.device_get(trainer.frozen.reward))
    hf.export_model(rm, trainer.reward_config, params, kind="reward", tokenizer=toy.tokenizer(32))
    message = "were trained on another value base than the one value.init=reward"
    with pytest.raises(CheckpointError, match=message):
        trainer_for(tmp_path / "run", 2, **overrides)
    with pytest.raises(CheckpointError, match=message):  # nor exported merged into another base
        export_checkpoint(str(tmp_path / "run"), str(tmp_path / "value2"), which="value")


def test_value_lora_on_a_fully_trained_policy_shares_the_reference(tmp_path):
    trainer = trainer_for(tmp_path, 1, **VALUE_LORA)
    assert trainer.frozen.policy is None
    assert trainer.frozen.value is trainer.frozen.reference["transformer"]
    # Never the trainable policy: it is donated to every update.
    assert buffers(trainer.frozen.value).isdisjoint(buffers(trainer.state.policy))
    trainer.save_checkpoint(force=True)  # saves the reference (frozen/), which the value export reads back
    trainer.close()
    out = export_checkpoint(str(tmp_path), str(tmp_path / "value"), which="value")
    exported = hf.load_model(out, make_test_mesh((1, 1, 1)), kind="reward")
    assert leaves_equal(jax.device_get(exported.params["transformer"]),  # B = 0: the merged base is the base
                        jax.device_get(trainer.frozen.reference["transformer"]))


INVALID = [
    ({"value.lora.rank": -1}, "value.lora.rank must be >= 0"),
    ({"value.lora.targets": "q,zz"}, "value.lora.targets has unknown projections ['zz']"),
    ({"value.lora.targets": "q,gate"}, "value.lora.targets ['gate'] name projections a gpt2 model does not have"),
    ({"value.lora.targets": ""}, "value.lora.targets is empty"),
    ({"value.lora.alpha": 0.0}, "value.lora.alpha must be positive"),
    ({"ppo.advantage_estimator": "rloo", "rollout.num_samples": 2},
     "value.lora.rank=4, but ppo.advantage_estimator='rloo' trains no value model"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=[m for _, m in INVALID])
def test_bad_value_lora_config_fails_before_compiling_with_its_message(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        trainer_for(tmp_path / "run", 1, **{**VALUE_LORA, **overrides})
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ adapters imported from PEFT


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    """A PEFT adapter directory (r 4, alpha 8, o/fc/proj) with random nonzero A and B, written by
    hf.export_adapter for the tiny policy's shape."""
    cfg = build.policy_model_config(Settings.from_config(config(1, **POLICY_LORA)))
    adapters, _ = init_adapters(CausalLM(cfg), jax.random.key(3), make_test_mesh((1, 1, 1)))
    keys = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    return hf.export_adapter(tmp_path_factory.mktemp("sft") / "adapter", cfg, adapters), adapters


@pytest.fixture(scope="module")
def imported_run(peft_dir, tmp_path_factory):
    """Two iterations starting from the PEFT adapters (rank etc. from adapter_config.json)."""
    path, _ = peft_dir
    workdir = tmp_path_factory.mktemp("imported")
    trainer = trainer_for(workdir, 2, **{"policy.lora.init_from": str(path), "optim.policy_lr": 3e-3})
    before = jax.device_get((trainer.state.policy, trainer.frozen.reference))
    history = trainer.train()
    trainer.checkpoints.wait()
    return trainer, history, before, workdir


def test_imported_adapters_start_the_policy_and_are_the_reference(imported_run, peft_dir):
    trainer, history, (start, reference), _ = imported_run
    _, written = peft_dir
    assert trainer.policy_config.lora.rank == 4 and trainer.policy_config.lora.targets == ("o", "fc", "proj")
    assert leaves_equal(start, jax.device_get(written)) and leaves_equal(reference, start)
    # The reference copy is frozen: never donated, unchanged after the updates, apart from the trainable tree.
    assert leaves_equal(jax.device_get(trainer.frozen.reference), reference)
    assert buffers(trainer.frozen.reference).isdisjoint(buffers(trainer.state.policy))
    assert not leaves_equal(jax.device_get(trainer.state.policy), start)
    # The starting policy is the reference bit for bit: KL exactly 0 and ratio 1 at iteration 1.
    assert history[0]["objective/kl"] == 0.0 and history[0]["first_minibatch/ratio"] == 1.0
    assert history[-1]["objective/kl"] != 0.0
    for row in history:
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
    recorded = trainer.checkpoints.read_extra(None)[1]["frozen_checksums"]
    assert set(recorded) == {"policy_base", "policy_init_adapters"}


def test_imported_run_exports_an_adapter_relative_to_the_original_base(imported_run, tmp_path):
    trainer, _, _, workdir = imported_run
    cfg = trainer.policy_config
    tokens, positions, mask = _tokens()
    ours = np.asarray(CausalLM(cfg).apply({"params": trainer.frozen.policy, "lora": trainer.state.policy},
                                          tokens, positions, mask)[0])[mask.astype(bool)]
    adapter = export_checkpoint(str(workdir), str(tmp_path / "adapter"), lora_format="adapter")
    base_dir = hf.export_model(tmp_path / "base", cfg.replace(lora=None), trainer.frozen.policy)
    torch_model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                                 adapter).eval()
    np.testing.assert_allclose(_torch_logits(torch_model), ours, atol=1e-5, rtol=0)


def test_resume_refuses_other_imported_adapters(imported_run, peft_dir, tmp_path):
    _, _, _, workdir = imported_run
    path, written = peft_dir
    shutil.copytree(workdir / "checkpoints", tmp_path / "run" / "checkpoints")
    resumed = trainer_for(tmp_path / "run", 3, **{"policy.lora.init_from": str(path), "optim.policy_lr": 3e-3})
    assert resumed.resumed_from == 2 and leaves_equal(jax.device_get(resumed.frozen.reference), jax.device_get(written))
    resumed.close()
    cfg = build.policy_model_config(Settings.from_config(config(1, **POLICY_LORA)))
    other = hf.export_adapter(tmp_path / "other", cfg, jax.tree.map(lambda x: x + 1.0, written))
    with pytest.raises(CheckpointError, match="were trained on another set of imported adapters"):
        trainer_for(tmp_path / "run", 3, **{"policy.lora.init_from": str(other), "optim.policy_lr": 3e-3})


@pytest.mark.parametrize("overrides,message", [
    ({"policy.lora.rank": 8}, r"policy.lora.rank=8 disagrees with the adapter of policy.lora.init_from=.* \(r in "
                              r"its adapter_config.json gives 4\)"),
    ({"policy.lora.rank": 4, "policy.lora.alpha": 8.0},
     r"policy.lora.targets=\['k', 'o', 'q', 'v'\] disagrees .*target_modules"),
], ids=["rank", "targets"])
def test_imported_adapters_refuse_disagreeing_lora_settings(peft_dir, overrides, message, tmp_path):
    path, _ = peft_dir
    with pytest.raises(ConfigError, match=message):
        trainer_for(tmp_path / "run", 1, **{"policy.lora.init_from": str(path), **overrides})
    assert not (tmp_path / "run").exists()


def test_imported_adapters_need_a_peft_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"policy.lora.init_from=.*has no adapter_config.json"):
        trainer_for(tmp_path / "run", 1, **{"policy.lora.init_from": str(tmp_path)})
