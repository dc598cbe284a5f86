"""Loss aggregation (token_mean: DAPO; sequence_mean: GRPO; constant: Dr. GRPO) against one
whole-minibatch NumPy computation: uneven microbatches, 8 devices and packed rows all add up to it
exactly, for every policy objective; and the config refuses what does not compose, in one line.

Red with (each tried, then reverted): sequence_mean's normaliser counting tokens instead of rows that
hold one; constant's normaliser the minibatch's tokens instead of rows x response length; the
microbatch loss normalised by the microbatch's own count (`update.minibatch_batch` reading the
microbatch's mask)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from test_ppo_objective import hyper

from ppo_jax import ppo
from ppo_jax.config import ConfigError
from ppo_jax.models import packing
from ppo_jax.rl.objective import TokenOutputs, ppo_loss
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Experience
from ppo_jax.rl.update import minibatch_batch, pack_minibatch
from tiny_configs import tiny_config

from conftest import make_test_mesh

R, LQ, LR, V = 8, 3, 6, 5
LENGTHS = np.array([6, 2, 0, 5, 1, 6, 3, 4])  # row 2 holds no token
MICROBATCHES = (slice(0, 3), slice(3, 4), slice(4, 8))  # uneven on purpose


def numpy_aggregate(per_token, mask, mode):
    """The papers' reductions of per-token losses l [R, L], float64, written with loops."""
    total, tokens, sequence_means = 0.0, 0, []
    for i in range(per_token.shape[0]):
        row = [np.float64(per_token[i, t]) for t in range(per_token.shape[1]) if mask[i, t]]
        total, tokens = total + sum(row), tokens + len(row)
        if row:
            sequence_means.append(sum(row) / len(row))
    if mode == "token_mean":  # DAPO: sum_i sum_t l / sum_i |o_i|
        return total / tokens
    if mode == "sequence_mean":  # GRPO: (1/G) sum_i (1/|o_i|) sum_t l
        return sum(sequence_means) / len(sequence_means)
    return total / (per_token.shape[0] * per_token.shape[1])  # Dr. GRPO: sum / (G * L)


def random_batch(seed):
    rng = np.random.default_rng(seed)
    mask = np.arange(LR)[None, :] < LENGTHS[:, None]
    logp = -rng.exponential(1.0, (R, LR)).astype(np.float32) * mask
    old = ((logp + rng.normal(0, 0.3, (R, LR))) * mask).astype(np.float32)
    adv = (rng.normal(size=(R, LR)) * mask).astype(np.float32)
    return logp, old, adv, mask


@pytest.mark.parametrize("mode", ppo.AGGREGATIONS)
def test_each_aggregation_is_the_papers_and_microbatches_and_devices_add_up_to_it(mode):
    logp, old, adv, mask = random_batch(0)
    ratio = np.exp(logp.astype(np.float64) - old)
    per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))  # PPO's clipped loss
    expected = numpy_aggregate(per_token, mask, mode)
    normaliser = ppo.minibatch_normaliser(mode, mask)  # the whole minibatch's, known up front

    def loss(lp, o, a, m):
        return ppo.policy_loss(lp, o, a, m, num_tokens=ppo.token_denominators(mode, normaliser, m))[0]

    grad_fn = jax.jit(jax.value_and_grad(loss))
    full, full_grad = grad_fn(logp, old, adv, mask)
    np.testing.assert_allclose(float(full), expected, rtol=1e-5)
    parts = [grad_fn(*(x[rows] for x in (logp, old, adv, mask))) for rows in MICROBATCHES]
    np.testing.assert_allclose(sum(float(v) for v, _ in parts), expected, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([g for _, g in parts]), full_grad, rtol=1e-5, atol=1e-8)
    # 8 devices, one row each: the same program sharded by rows.
    rows = NamedSharding(make_test_mesh((8, 1, 1)), PartitionSpec(("data", "fsdp")))
    sharded = jax.jit(jax.value_and_grad(loss), in_shardings=(rows,) * 4)(logp, old, adv, mask)
    np.testing.assert_allclose(float(sharded[0]), expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sharded[1]), full_grad, rtol=1e-5, atol=1e-8)


def experience_and_outputs(seed):
    logp, old, adv, mask = random_batch(seed)
    rng = np.random.default_rng(seed + 1)
    prompt_mask = (np.arange(LQ)[None] >= rng.integers(0, LQ, (R, 1))).astype(np.int32)  # left-padded, >= 1 token
    exp = Experience(prompt_tokens=jnp.asarray(rng.integers(1, 9, (R, LQ)) * prompt_mask, jnp.int32),
                     prompt_mask=jnp.asarray(prompt_mask), tokens=jnp.asarray(rng.integers(1, 9, (R, LR)) * mask),
                     mask=jnp.asarray(mask, jnp.int32), old_logprobs=jnp.asarray(old), ref_logprobs=jnp.asarray(old),
                     values=jnp.zeros((R, LR)), advantages=jnp.asarray(adv), returns=jnp.zeros((R, LR)),
                     scores=jnp.zeros(R), sequence_kl=jnp.zeros(R))
    logits = jnp.asarray(rng.normal(size=(R, LR, V)), jnp.float32)
    return exp, TokenOutputs(logits, jnp.asarray(logp))


def packed_losses(exp, out, minibatch, hp):
    """The minibatch packed as the update packs it (`update.pack_minibatch`), its outputs placed at
    the slots that predict each token; the loss of each packed microbatch."""
    picked = jnp.arange(R)
    packed, layout = pack_minibatch(exp, picked, hp)
    slots = packing.prediction_slots(layout, LQ, exp.mask)
    at_slots = functools.partial(packing.scatter, slots=slots, packing=layout)
    outputs = TokenOutputs(at_slots(out.logits), at_slots(out.logprobs))
    return [ppo_loss(jax.tree.map(lambda x: x[k], outputs), minibatch.replace(experience=jax.tree.map(
        lambda x: x[k], packed)), hp)[0] for k in range(int(layout.microbatches_used))]


@pytest.mark.parametrize("objective", ppo.OBJECTIVES)
def test_every_objective_and_aggregation_adds_up_over_microbatches_and_packed_rows(objective):
    """`ppo_loss` with `update.minibatch_batch`'s minibatch-wide numbers, as the update runs it: the
    padded minibatch in one piece, in uneven microbatches and packed give the same loss, and the
    microbatch gradients are the minibatch's."""
    exp, out = experience_and_outputs(1)
    for mode in ppo.AGGREGATIONS:
        hp = hyper(policy_objective=objective, loss_aggregation=mode, packed_rows=2, packed_length=LQ + LR,
                   clip_eps=0.1, kl_cov_fraction=0.2)
        minibatch = minibatch_batch(exp, jnp.arange(R), hp, jnp.float32(0.05), None)

        def loss(logprobs, rows):
            part = jax.tree.map(lambda x: x[rows], exp)
            return ppo_loss(TokenOutputs(out.logits[rows], logprobs), minibatch.replace(experience=part), hp)[0]

        full, full_grad = jax.value_and_grad(loss)(out.logprobs, slice(None))
        parts = [jax.value_and_grad(loss)(out.logprobs[rows], rows) for rows in MICROBATCHES]
        np.testing.assert_allclose(sum(float(v) for v, _ in parts), float(full), rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(np.concatenate([g for _, g in parts]), full_grad, rtol=1e-5, atol=1e-8,
                                   err_msg=mode)
        np.testing.assert_allclose(sum(map(float, packed_losses(exp, out, minibatch, hp))), float(full), rtol=1e-5,
                                   err_msg=mode)


@pytest.mark.parametrize("overrides,message", [
    ({"ppo.policy_objective": "gpso"}, "ppo.policy_objective='gpso': use one of ppo, gspo, gspo_token, cispo, kl_cov"),
    ({"ppo.loss_aggregation": "mean"}, "ppo.loss_aggregation='mean': use auto or one of token_mean, sequence_mean"),
    ({"ppo.policy_objective": "gspo"}, "ppo.advantage_estimator=gae gives one per token: use grpo or rloo, or "
                                       "gspo_token"),
    ({"ppo.policy_objective": "gspo", "ppo.advantage_estimator": "grpo", "rollout.num_samples": 2,
      "ppo.off_policy_ratio": "truncated_is"}, "ppo.policy_objective=gspo with ppo.off_policy_ratio=truncated_is"),
    ({"ppo.policy_objective": "cispo", "ppo.dual_clip": 3.0}, "ppo.policy_objective=cispo has none"),
    ({"ppo.policy_objective": "kl_cov", "ppo.clip_eps_high": 0.28}, "kl_cov clips nothing"),
    ({"ppo.clip_eps": 1.0}, "only cispo takes >= 1"),
    ({"ppo.policy_objective": "kl_cov", "ppo.kl_cov_fraction": 0.0}, "ppo.kl_cov_fraction must be in (0, 1]"),
    ({"ppo.grpo_divide_by_std": False}, "ppo.grpo_divide_by_std=False (Dr. GRPO) changes grpo's advantages"),
    ({"ppo.entropy_target": 0.5, "ppo.ent_coef": -0.01}, "starts at ppo.ent_coef, which must be >= 0"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_what_does_not_compose_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        Settings.from_config(tiny_config(**overrides), reward_in_code=False)
    assert "\n" not in str(err.value)


def test_what_composes_is_accepted():
    """GSPO with the sequence-level corrections, off-policy steps and its own ratio's clip; CISPO
    without a lower bound; Dr. GRPO = grpo without the std division and the constant normaliser."""
    grpo = {"ppo.advantage_estimator": "grpo", "rollout.num_samples": 2}
    for overrides in ({"ppo.policy_objective": "gspo", "ppo.off_policy_ratio": "sequence_truncated_is",
                       "ppo.clip_eps": 3e-4, "ppo.clip_eps_high": 4e-4, **grpo},
                      {"ppo.policy_objective": "gspo", "rollout.off_policy_steps": 1, **grpo},
                      {"ppo.policy_objective": "gspo_token", "ppo.off_policy_ratio": "masked_is"},
                      {"ppo.policy_objective": "cispo", "ppo.clip_eps": 1.0, "ppo.clip_eps_high": 4.0},
                      {"ppo.grpo_divide_by_std": False, "ppo.loss_aggregation": "constant", **grpo},
                      {"ppo.policy_objective": "kl_cov", "ppo.entropy_target": 0.3}):
        Settings.from_config(tiny_config(**overrides), reward_in_code=False)


def test_gspo_with_the_adaptive_entropy_coefficient_end_to_end_keeps_the_invariants_on_8_devices(tmp_path):
    """A GRPO run with GSPO (auto: sequence_mean) and the adaptive entropy coefficient, packed rows on
    CPU: on the first minibatch the sequence ratio is exactly 1 and nothing is clipped, the
    coefficient acts and steps by ppo.entropy_coef_step, and 8 devices log the one device's numbers."""
    from conftest import make_test_mesh as mesh_of
    from ppo_jax.rl.trainer import PPOTrainer

    config = tiny_config(**{"ppo.advantage_estimator": "grpo", "rollout.num_samples": 2, "rollout.batch_size": 8,
                            "ppo.policy_objective": "gspo", "ppo.clip_eps": 0.01, "ppo.ent_coef": 0.01,
                            "ppo.entropy_target": 9.0, "ppo.entropy_coef_step": 0.02, "optim.policy_lr": 3e-3,
                            "train.iterations": 1})
    one, eight = (PPOTrainer(config, str(tmp_path / name), mesh=mesh_of(shape)).train()
                  for name, shape in (("one", (1, 1, 1)), ("eight", (2, 2, 2))))
    (row,) = one
    assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6 and row["first_minibatch/clipfrac"] == 0.0
    assert row["first_minibatch/approxkl"] < 1e-12
    np.testing.assert_allclose([row["policy/entropy_coef"], row["policy/entropy_coef_next"]], [0.01, 0.03], rtol=1e-6)
    assert row["val/ratio"] != 1.0 and row["policy/clipfrac_avg"] > 0  # the policy moved; the clip bound
    for want, got in zip(one, eight):
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):
                np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)


def test_help_names_each_objective_with_its_paper():
    """What `--config=configs/ppo_toy.py --help` prints beside each field (the schema's comments)."""
    from ppo_jax.cli.config_help import field_comments
    from ppo_jax.rl.settings import PPOLossSettings

    comments = field_comments(PPOLossSettings)
    for field, names in {
        "policy_objective": ['"ppo"', "Schulman et al. 2017", '"gspo"', "GSPO, Zheng et al. 2025", '"gspo_token"',
                             "GSPO-token", '"cispo"', "CISPO, MiniMax-M1 2025", '"kl_cov"', "KL-Cov, Cui et al. 2025"],
        "loss_aggregation": ["DAPO, Yu et al. 2025", "GRPO, Shao et al. 2024", "Dr. GRPO, Liu et al. 2025"],
        "grpo_divide_by_std": ["Dr. GRPO, Liu et al. 2025"],
        "entropy_target": ["Skywork-OR1, He et al. 2025"],
    }.items():
        for name in names:
            assert name in comments[field], (field, name)
