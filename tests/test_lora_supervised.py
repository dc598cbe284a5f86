"""LoRA in the supervised trainers (model.lora.rank > 0): SFT, reward model and DPO train adapters (and
the reward model's new head) on a frozen base that is never donated; at step 0 the model is the base
exactly (SFT loss = the base's, DPO loss = log 2 with the base as its reference, no reference copy);
checkpoints hold the adapters and the base's checksums (exact resume, another base refused); exports
merged (our loader) and as a PEFT adapter (peft on transformers) match our LoRA logits; bad configs
are refused naming the field before anything loads or compiles."""

import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import make_test_mesh, preference_tokenizer
from tiny_configs import apply_overrides

from ppo_jax.checkpoint import CheckpointError, CheckpointManager
from ppo_jax.config import ConfigError
from ppo_jax.models import CausalLM, ScalarModel, hf
from ppo_jax.models.forward import sequence_scores, variables
from ppo_jax.supervised.dpo import DPOTrainer, dpo_config
from ppo_jax.supervised.reward_model import RewardModelTrainer, reward_model_config
from ppo_jax.supervised.sft import SFTTrainer, sft_config, sft_loss

# GPT-2's o / fc / proj are one Hugging Face module each: PEFT-representable (q/k/v share c_attn).
LORA = {"rank": 4, "alpha": 8.0, "targets": "o,fc,proj"}


def tokenizer():
    return preference_tokenizer()


def sft_records(n, seed=0):
    """The response repeats the prompt's last word, then says 'w0 .'."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = [f"w{i}" for i in rng.integers(1, 40, size=rng.integers(2, 5))]
        out.append({"prompt": " ".join(words) + " ?", "response": f"{words[-1]} w0 ."})
    return out


def pairs(n, seed=0):
    """Chosen answers say 'good', rejected ones 'bad'."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = " ".join(f"w{i}" for i in rng.integers(1, 40, size=rng.integers(2, 5))) + " ?"
        filler = [f"w{i}" for i in rng.integers(1, 40, size=2)]
        out.append({"prompt": prompt, "chosen": " ".join(filler + ["good"]), "rejected": " ".join(filler + ["bad"])})
    return out


@pytest.fixture(scope="module")
def base_dir(sft_dir):
    """The frozen base: conftest's tiny GPT-2 causal LM over the same words, as a Hugging Face directory."""
    return sft_dir


def tiny(defaults, model_path="", lora=LORA, **overrides):
    """A tiny config of any supervised trainer; overrides as {"section.field": value}."""
    c = defaults()
    c.model.path = model_path
    c.model.config.vocab_size = 48
    c.model.config.hidden_size = 32
    c.model.config.num_heads = 2
    c.model.config.max_position_embeddings = 32
    for key, value in lora.items():
        c.model.lora[key] = value
    c.data.max_prompt_length = 6
    c.data.max_response_length = 6
    c.train.batch_size = 8
    c.train.steps = 3
    c.train.progress = False
    c.train.export = False
    c.optim.lr = 1e-2  # large enough that one step moves every adapter visibly
    c.optim.warmup_steps = 0
    return apply_overrides(c, overrides)


def make(trainer_type, config, workdir, **kw):
    if "train_records" not in kw:
        kw["train_records"] = sft_records(32) if trainer_type is SFTTrainer else pairs(32)
    return trainer_type(config, str(workdir), tokenizer=tokenizer(), mesh=make_test_mesh((1, 1, 1)), **kw)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


def _tokens():
    """Left-padded [2, 10] tokens, positions, mask."""
    mask = np.ones((2, 10), np.int32)
    mask[1, :3] = 0
    tokens = np.random.default_rng(0).integers(4, 48, (2, 10)) * mask
    return tokens, np.maximum(np.cumsum(mask, -1) - 1, 0), mask


def lm_logits(cfg, params, adapters=None):
    """Our logits at the real positions: [N, V]."""
    tokens, positions, mask = _tokens()
    logits = CausalLM(cfg).apply(variables(params, adapters), tokens, positions, mask)[0]
    return np.asarray(logits)[mask.astype(bool)]


# ----------------------------------------------------------------------------------------------
# Config errors: named, before anything loads, compiles or is written.


BAD = [
    (SFTTrainer, sft_config, {"model.lora.rank": -1}, "sft: model.lora.rank must be >= 0"),
    (SFTTrainer, sft_config, {"model.lora.targets": "q,zz"}, r"sft: model.lora.targets has unknown projections \['zz'\]"),
    (DPOTrainer, dpo_config, {"model.lora.targets": "q,gate"},
     r"dpo: model.lora.targets \['gate'\] name projections a gpt2 model does not have"),
    (RewardModelTrainer, reward_model_config, {"model.lora.alpha": 0.0}, "reward_model: model.lora.alpha must be positive"),
    (SFTTrainer, sft_config, {"train.lora_export": "both"}, "sft: train.lora_export='both': use one of merged, adapter"),
    (RewardModelTrainer, reward_model_config, {"train.lora_export": "adapter"},
     "reward_model: train.lora_export='adapter': a reward model exports merged only"),
    (SFTTrainer, sft_config, {"model.lora.rank": 0, "train.lora_export": "adapter"},
     "sft: train.lora_export='adapter' needs model.lora.rank > 0"),
    (DPOTrainer, dpo_config, {"train.lora_export": "adapter"}, "dpo: train.lora_export='adapter' needs model.path"),
]


@pytest.mark.parametrize("trainer_type,defaults,overrides,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_lora_configs_are_refused_by_field_before_anything_runs(trainer_type, defaults, overrides, message,
                                                                     tmp_path):
    with pytest.raises(ConfigError, match=message):
        make(trainer_type, tiny(defaults, **overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_adapter_export_of_a_fused_projection_is_refused_at_config_time(base_dir, tmp_path):
    config = tiny(sft_config, base_dir, lora={**LORA, "targets": "q,v"}, **{"train.lora_export": "adapter"})
    with pytest.raises(ConfigError, match="sft: train.lora_export='adapter' with model.lora.targets='q,v': .*c_attn"):
        make(SFTTrainer, config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# SFT: one run of 3 steps from a Hugging Face base, its resume, its exports.


@pytest.fixture(scope="module")
def sft_run(base_dir, tmp_path_factory):
    """(trainer after 3 steps (a checkpoint at step 2), base and adapters before, step-0 loss without
    LoRA on the first batch, first step's metrics, workdir)."""
    workdir = tmp_path_factory.mktemp("sft_lora")
    trainer = make(SFTTrainer, tiny(sft_config, base_dir), workdir)
    before = host((trainer.base, trainer.state.params))
    position = trainer.loader.state()
    first_batch = next(trainer.loader)
    trainer.loader.restore(position)
    base_loss, _ = sft_loss(CausalLM(trainer.model_config.replace(lora=None)), trainer.base, first_batch)
    first = trainer.train_step()
    trainer.train_step()
    trainer.save(2)  # the checkpoint an interrupted run would have left
    trainer.train_step()
    trainer.close()
    return trainer, before, float(base_loss), first, workdir


def test_sft_trains_only_the_adapters_on_a_bit_identical_base(sft_run, base_dir):
    trainer, (base_before, adapters_before), _, _, _ = sft_run
    assert set(trainer.state.params) == {"lora"}  # no base param in the train state (nor in Adam's)
    assert_trees_equal(trainer.base, base_before)
    assert_trees_equal(trainer.base, hf.load_model(base_dir, make_test_mesh((1, 1, 1)), kind="causal_lm").params)
    after = host(trainer.state.params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(adapters_before), jax.tree.leaves(after)):
        assert not np.array_equal(a, b), jax.tree_util.keystr(path)  # every A and B moved
    n_adapters = sum(x.size for x in jax.tree.leaves(after))
    n_base = sum(x.size for x in jax.tree.leaves(base_before))
    assert n_adapters < n_base / 5


def test_sft_with_lora_at_step_0_has_the_base_models_loss(sft_run):
    _, _, base_loss, first, _ = sft_run
    assert first["train/loss"] == pytest.approx(base_loss, rel=1e-6)


def test_sft_resume_is_exact_and_refuses_another_base(sft_run, base_dir):
    trainer, _, _, _, workdir = sft_run
    manager = CheckpointManager(str(workdir / "checkpoints"))
    _, extra = manager.read_extra(2)
    manager.close()
    assert set(extra["frozen_checksums"]) == {"model_base"}  # the base's checksums, not the base
    resumed = make(SFTTrainer, tiny(sft_config, base_dir), workdir)
    assert resumed.step == 2
    resumed.train()  # 2 + 1 steps
    assert_trees_equal(resumed.state, trainer.state)  # adapters, Adam state and step, bit for bit
    # A fresh base (the seed's init) of the same shapes is another base: refused by its checksums.
    with pytest.raises(CheckpointError, match="were trained on another base model than the one seed=0"):
        make(SFTTrainer, tiny(sft_config), workdir)


def test_sft_merged_export_matches_our_lora_logits(sft_run, tmp_path):
    trainer, *_ = sft_run
    out = trainer.export(str(tmp_path / "merged"))  # train.lora_export = "merged", the default
    loaded = hf.load_model(out, make_test_mesh((1, 1, 1)), kind="causal_lm")
    assert loaded.config.lora is None
    ours = lm_logits(trainer.model_config, trainer.base, trainer.state.params["lora"])
    np.testing.assert_allclose(lm_logits(loaded.config, loaded.params), ours, atol=1e-5, rtol=0)
    assert not np.allclose(lm_logits(trainer.model_config, trainer.base), ours, atol=1e-3)  # adapters matter


def test_sft_adapter_export_loads_in_peft_with_our_logits(sft_run, base_dir, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    trainer, *_ = sft_run
    out = trainer.export(str(tmp_path / "adapter"), lora_export="adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert json.loads(open(os.path.join(out, "adapter_config.json")).read())["base_model_name_or_path"] == base_dir
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), out).eval()
    tokens, positions, mask = _tokens()
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(positions)).logits.numpy()[mask.astype(bool)]
    ours = lm_logits(trainer.model_config, trainer.base, trainer.state.params["lora"])
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# DPO: the reference is the base with the adapters off.


def test_dpo_with_lora_starts_at_log_2_with_no_reference_copy(base_dir, tmp_path):
    trainer = make(DPOTrainer, tiny(dpo_config, base_dir, lora={**LORA, "targets": "q,k,v,o"}), tmp_path)
    base_before = host(trainer.base)
    assert trainer.reference is trainer.base  # the same arrays: nothing copied
    first = trainer.train_step()
    # B = 0: the adapters add exactly 0, so the policy's log-probs are the reference's up to the round-off
    # of two differently compiled programs (a CPU may fuse and round the adapter-on program otherwise,
    # e.g. 1.2e-8 on one machine): a few fp32 ulps of each sequence log-prob, times beta. Any adapter
    # that moved the policy (B != 0) gives rewards of order beta.
    beta = trainer.settings.loss.beta
    for name, logps in (("rewards/chosen", "logps/chosen"), ("rewards/rejected", "logps/rejected")):
        tolerance = beta * 64 * np.finfo(np.float32).eps * max(1.0, abs(first[logps]))
        assert abs(first[name]) <= tolerance, (name, first[name], tolerance)
    assert abs(first["rewards/margins"]) <= 2 * beta * 64 * np.finfo(np.float32).eps * max(
        1.0, abs(first["logps/chosen"]), abs(first["logps/rejected"]))
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    second = trainer.train_step()
    assert second["loss"] != first["loss"]  # the adapters moved the policy off its reference
    assert set(trainer.state.params) == {"lora"}
    assert_trees_equal(trainer.base, base_before)
    extra = trainer.checkpoint_extra()
    assert "reference" not in extra and set(extra["frozen_checksums"]) == {"model_base"}
    trainer.close()


# ----------------------------------------------------------------------------------------------
# Reward model: adapters + the new head train; normalisation and the merged export still work.


def test_reward_model_with_lora_trains_adapters_and_head_normalises_and_exports_merged(base_dir, tmp_path):
    config = tiny(reward_model_config, base_dir, **{"train.steps": 2, "train.export": True,
                                                    "normalize.source": "preferences", "normalize.num_prompts": 16})
    trainer = make(RewardModelTrainer, config, tmp_path)
    base_before, trainable_before = host((trainer.base, trainer.state.params))
    assert set(trainer.state.params) == {"lora", "score"} and set(trainer.base) == {"transformer"}
    trainer.train()
    assert_trees_equal(trainer.base, base_before)
    after = host(trainer.state.params)
    assert not np.array_equal(after["score"]["kernel"], trainable_before["score"]["kernel"])
    for a, b in zip(jax.tree.leaves(trainable_before["lora"]), jax.tree.leaves(after["lora"])):
        assert not np.array_equal(a, b)
    # Normalised: the preference responses score mean 0, std 1 (through the adapters).
    records = pairs(32)[:16]
    prompts = [r["prompt"] for r in records] * 2
    responses = [r["chosen"] for r in records] + [r["rejected"] for r in records]
    ours = trainer.score(prompts, responses)
    assert abs(ours.mean()) < 1e-4 and ours.std() == pytest.approx(1.0, rel=1e-4)
    # The merged export (<workdir>/hf) scores as the adapted model does.
    loaded = hf.load_model(str(tmp_path / "hf"), make_test_mesh((1, 1, 1)), kind="reward")
    batch = trainer.prompt_tokenizer.sft([{"prompt": p, "response": r} for p, r in zip(prompts, responses)],
                                         length=trainer.length)
    theirs = np.asarray(sequence_scores(ScalarModel(loaded.config), loaded.params, batch.tokens, batch.mask))
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
