"""On-policy distillation (distill.teacher_path): a frozen teacher, any Hugging Face causal LM with the
policy's tokenizer, scores the student's own samples in the experience step, and minus the per-token
reverse KL to it is the reward. Checked against transformers' forward of the teacher and a NumPy
transcription of the rewards; with LoRA students, packed and padded rows, in the memory plan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.data import toy
from ppo_jax.models import CausalLM, ModelConfig, hf, init_params
from ppo_jax.rl.experience import experience_from_outputs
from ppo_jax.rl.forwards import ForwardOutputs
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.rl.state import Rollout
from ppo_jax.rl.trainer import PPOTrainer

VOCAB = 32
LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "policy.lora.targets": "o,fc,proj"}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A Llama-shaped teacher, wider and deeper than the GPT-2 student, over the toy tokenizer."""
    tok = toy.tokenizer(VOCAB)
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                      intermediate_size=96, max_position_embeddings=32, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    params, _ = init_params(CausalLM(cfg), jax.random.key(7), make_test_mesh((1, 1, 1)))
    params = jax.tree.map(lambda x: 3 * x, params)  # peaked next-token distributions, far from the student's
    out = tmp_path_factory.mktemp("teacher") / "hf"
    hf.export_model(out, cfg, params, kind="causal_lm", tokenizer=tok)
    return str(out)


def run(workdir, teacher, **overrides):
    config = tiny_config(**{"distill.teacher_path": teacher, "distill.coef": 0.5, "reward.functions": "",
                            "train.iterations": 1, **overrides})
    trainer = PPOTrainer(config, str(workdir), mesh=make_test_mesh((1, 1, 1)))
    history = trainer.train()
    trainer.close()
    return trainer, history


def transformers_logprobs(path, prompt_tokens, prompt_mask, tokens, mask):
    """[B, Lr] log-probs of the response tokens under the Hugging Face model at `path` (PyTorch)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    seq = np.concatenate([prompt_tokens, tokens], axis=1)
    seq_mask = np.concatenate([prompt_mask, mask], axis=1)
    positions = np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(seq), attention_mask=torch.tensor(seq_mask),
                       position_ids=torch.tensor(positions)).logits.numpy()
    lq = prompt_tokens.shape[1]
    logp = jax.nn.log_softmax(logits[:, lq - 1:-1], axis=-1)
    picked = np.take_along_axis(np.asarray(logp), tokens[..., None], axis=-1)[..., 0]
    return picked * mask


@pytest.mark.parametrize("packing", ["off", "on"])
def test_the_teachers_kl_is_transformers_teacher_on_the_students_samples(teacher_dir, packing, tmp_path):
    """objective/teacher_kl == mean over responses of sum_t (log pi(y_t) - log pi_teacher(y_t)), the
    teacher's log-probs from transformers' PyTorch forward, the student's the experience's own; a LoRA
    student, padded and packed rows."""
    trainer, history = run(tmp_path, teacher_dir, **LORA, **{"ppo.packing": packing})
    rollout, exp = trainer._last_rollout
    pt, pm, t, m, old = (np.asarray(x) for x in (rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens,
                                                 rollout.mask, exp.old_logprobs))
    teacher = transformers_logprobs(teacher_dir, pt, pm, t, m)
    want = ((old - teacher) * m).sum(-1).mean()
    np.testing.assert_allclose(history[0]["objective/teacher_kl"], want, rtol=1e-4, atol=1e-4)
    assert abs(want) > 1.0  # a teacher far from the student: the check compares something


def test_a_teacher_that_is_the_student_costs_nothing(tmp_path):
    """The student's own initial weights exported as the teacher: at the first iteration the reverse KL
    is 0 on every token (the same weights, the same forward)."""
    config = tiny_config(**{"train.iterations": 1})
    first = PPOTrainer(config, str(tmp_path / "first"), mesh=make_test_mesh((1, 1, 1)))
    hf.export_model(tmp_path / "student_hf", first.policy_config, jax.device_get(first.state.policy),
                    kind="causal_lm", tokenizer=first.tokenizer)
    first.close()
    _, history = run(tmp_path / "second", str(tmp_path / "student_hf"), **{"reward.functions": "toy_target_count"})
    assert abs(history[0]["objective/teacher_kl"]) < 1e-5 and abs(history[0]["objective/teacher_kl_per_token"]) < 1e-6


@pytest.mark.parametrize("overrides, message", [
    ({"roles.scoring": "sampler", "roles.sampler_mesh": (1, 1, 8)}, "distill.teacher_path with roles.scoring=sampler"),
    ({"distill.coef": -1.0}, "distill.coef must be >= 0"),
])
def test_bad_distillation_settings_fail_in_one_line(teacher_dir, overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, teacher_dir, **overrides)


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_loads(teacher_dir, tmp_path):
    other = tmp_path / "other"
    cfg, _ = hf.load_config(teacher_dir)
    params, _ = init_params(CausalLM(cfg.replace(vocab_size=40)), jax.random.key(0), make_test_mesh((1, 1, 1)))
    hf.export_model(other, cfg.replace(vocab_size=40), params, kind="causal_lm", tokenizer=toy.tokenizer(40))
    with pytest.raises(ConfigError, match="the teacher's tokenizer differs from the policy's"):
        run(tmp_path / "run", str(other))


def test_the_memory_plan_counts_the_teacher(teacher_dir):
    from ppo_jax import plan as plan_lib

    config = tiny_config(**{"distill.teacher_path": teacher_dir})
    plan = plan_lib.plan_memory(config, make_test_mesh((1, 1, 1)), phases=("experience",))
    cfg, _ = hf.load_config(teacher_dir)
    assert plan.params["teacher"] == 4 * cfg.num_params()


@pytest.mark.parametrize("gamma", [0.9, 0.0])  # 0.0: the recipe's (each token's return is its own reward)
def test_rewards_are_minus_the_reverse_kl_per_token_numpy(gamma):
    """experience_from_outputs with a teacher against a NumPy transcription: REINFORCE++ returns of the
    token rewards -beta*KL_ref - coef*(log pi - log pi_teacher) + score on the last token."""
    s = Settings.from_config(tiny_config(**{"ppo.advantage_estimator": "reinforce_pp", "ppo.gamma": gamma,
                                            "distill.coef": 0.5, "rollout.batch_size": 4,
                                            "rollout.forward_microbatch": 0}))
    s = s.replace(distill=dataclasses.replace(s.distill, teacher_path="/a/teacher"))
    hp = PPOHyper.from_settings(s, derive_sizes(s))
    rng = np.random.default_rng(0)
    b, length = 4, 6
    mask = (np.arange(length)[None] < np.array([6, 3, 1, 5])[:, None]).astype(np.float32)
    logp, ref, teacher = (rng.normal(size=(b, length)).astype(np.float32) * mask for _ in range(3))
    scores = rng.normal(size=b).astype(np.float32)
    out = ForwardOutputs(jnp.asarray(logp), jnp.asarray(ref), jnp.zeros((b, length)), jnp.zeros((b, length)),
                         jnp.zeros(b), teacher_logprobs=jnp.asarray(teacher))
    rollout = Rollout(prompt_tokens=jnp.zeros((b, 2), jnp.int32), prompt_mask=jnp.ones((b, 2), jnp.int32),
                      tokens=jnp.ones((b, length), jnp.int32), mask=jnp.asarray(mask, jnp.int32),
                      sampler_logprobs=jnp.asarray(logp), behaviour_logprobs=jnp.asarray(logp),
                      stopped=jnp.ones(b, bool), host_scores=jnp.asarray(scores))
    exp, metrics = experience_from_outputs(out, rollout, jnp.asarray(0.1), hp)
    want = np.zeros((b, length), np.float32)
    for i in range(b):
        n = int(mask[i].sum())
        rewards = [-0.1 * (logp[i, t] - ref[i, t]) - 0.5 * (logp[i, t] - teacher[i, t]) for t in range(n)]
        rewards[n - 1] += scores[i]
        running = 0.0
        for t in reversed(range(n)):
            running = rewards[t] + gamma * running
            want[i, t] = running
    np.testing.assert_allclose(np.asarray(exp.returns), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["objective/teacher_kl"], ((logp - teacher) * mask).sum(-1).mean(), rtol=1e-5)
