"""MoE routing replay (`moe.router_replay`, rl/router_replay.py): the sampler records each token's
experts, the policy's training forwards route to them.

The perturbation: experts 0 and 1 of every layer get identical router columns (an exact tie that the
sampler always resolves to expert 0), then the trainer's copy of the router gets N(0, 1e-6) noise, so
the tie flips for about half the tokens where it decides the top k, as a bf16 sampler's round-off
would, while every gate weight moves by ~1e-6 only. Without replay those tokens go to another expert
and their log-probs move by O(0.1); with replay every log-prob stays within 1e-5 of the sampler's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_configs import tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.models import ModelConfig, forward, init_params, moe, packing
from ppo_jax.models.transformer import CausalLM, chosen_experts
from ppo_jax.rl import build
from ppo_jax.rl.forwards import ResponseRows, packed_forwards, padded_forwards, run_packed
from ppo_jax.rl.objective import packed_outputs, padded_outputs
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Experience, FrozenParams, Modules, Trainable
from ppo_jax.rl.update import pack_minibatch
from ppo_jax.sampling import segments
from ppo_jax.sampling.config import SamplingConfig
from ppo_jax.sampling.continuous import sample_continuous
from ppo_jax.sampling.loop import sample

from conftest import make_test_mesh
from test_ppo_objective import hyper

MOE = dict(arch="qwen3", vocab_size=64, hidden_size=32, num_heads=4, num_experts=4, experts_per_token=2,
           moe_intermediate_size=16, max_position_embeddings=64)
# (scan_layers, moe_layers, unrolled decode): the scanned decode, the unrolled one, and mixed dense / MoE layers.
LAYOUTS = {"scan": (True, None, False), "unrolled": (True, None, True), "mixed": (False, (False, True, True), True)}


@functools.lru_cache(maxsize=None)
def tied_model(layout: str, engine: str = "static"):
    """A 2- or 3-layer MoE model whose experts 0 and 1 tie in every router, its params (router x50,
    experts x10, so routing decides and a flip shows), and a recorded sample of 8 rows (on the
    continuous engine: 3 slots fed 2 prompts at a time, so rows take slots at different steps)."""
    scan, moe_layers, unroll = LAYOUTS[layout]
    cfg = ModelConfig(**MOE, num_layers=3 if moe_layers else 2, scan_layers=scan, moe_layers=moe_layers)
    model = CausalLM(cfg)
    params = tied_params(model)
    config = sampling_config(unroll, engine)
    sampler = sample_continuous if engine == "continuous" else sample
    out = jax.jit(functools.partial(sampler, model=model, config=config))(params, *moe_prompts(), jax.random.key(1))
    return model, params, out


def tied_params(model: CausalLM):
    """Random params whose experts 0 and 1 tie in every router, the router x50 and the experts x10."""
    params, _ = init_params(model, jax.random.key(0), make_test_mesh((1, 1, 1)))

    def tie(path, x):
        names = [getattr(k, "key", "") for k in path]
        if "router" in names:
            return (x.at[..., 1].set(x[..., 0]) * 50)
        return x * 10 if "mlp" in names and "router" not in names else x

    return jax.tree_util.tree_map_with_path(tie, params)


def moe_prompts():
    """4 prompts [4, 6], two of them left-padded, and their mask."""
    prompts = jnp.asarray(np.random.default_rng(0).integers(1, 64, (4, 6)), jnp.int32)
    return prompts, jnp.ones((4, 6), jnp.int32).at[0, :2].set(0).at[2, :4].set(0)


def sampling_config(unroll: bool, engine: str) -> SamplingConfig:
    """2 samples of up to 10 tokens per prompt, recording the routing (continuous: 3 slots, 2 prompts per prefill)."""
    engine_args = dict(engine="continuous", slots=3, prefill_prompts=2) if engine == "continuous" else {}
    return SamplingConfig(max_new_tokens=10, pad_token_id=0, stop_token_ids=(3,), num_samples=2,
                          record_experts=True, unroll_layers=unroll, **engine_args)


def perturbed(params, scale: float):
    """The trainer's copy: N(0, scale) added to every router kernel."""
    def noise(path, x):
        names = [getattr(k, "key", "") for k in path]
        return x + scale * jax.random.normal(jax.random.key(5), x.shape) if "router" in names else x
    return jax.tree_util.tree_map_with_path(noise, params)


def training_logprobs(model, params, out, replay: bool):
    """(log-probs [R, N] of the sampled tokens, the flips [R, N] or None) of one training forward."""
    res = forward.response_outputs(model, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, 1.0,
                                   experts=out.routed_experts if replay else None)
    return np.asarray(forward.token_logprobs(res.hidden, out.tokens, out.mask)), res.flips


ENGINES = [("scan", "static"), ("unrolled", "static"), ("mixed", "static"), ("scan", "continuous"),
           ("mixed", "continuous")]


@pytest.mark.parametrize("layout, engine", ENGINES)
def test_the_record_is_the_training_forwards_own_routing_and_replaying_it_changes_nothing(layout, engine):
    """Unperturbed: replay gives the very same log-probs (bit for bit) and no token's own top k
    differs from the record; every real token is recorded, padding is not."""
    model, params, out = tied_model(layout, engine)
    rec = np.asarray(out.routed_experts)
    lq = out.prompt_tokens.shape[1]
    moe_layers = sum(model.config.layer_moe)
    assert rec.shape == (8, lq + 10, moe_layers, 2) and rec.dtype == np.int8
    real = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.mask)], 1).astype(bool)
    assert (rec[~real] == -1).all()
    last = lq + np.asarray(out.mask).sum(-1) - 1  # a row's last token is never fed back (maybe unrecorded)
    fed = real.copy()
    fed[np.arange(8), last] = False
    assert (rec[fed] >= 0).all()
    plain, _ = training_logprobs(model, params, out, replay=False)
    replayed, flips = training_logprobs(model, params, out, replay=True)
    np.testing.assert_array_equal(replayed, plain)
    assert float(np.asarray(flips).sum()) == 0
    assert np.abs(plain - np.asarray(out.logprobs)).max() < 1e-5


@pytest.mark.parametrize("layout, engine", [("scan", "static"), ("mixed", "static"), ("scan", "continuous")])
def test_replay_keeps_the_samplers_log_probs_under_a_perturbed_router(layout, engine):
    model, params, out = tied_model(layout, engine)
    trainer_params = perturbed(params, 1e-6)
    mask = np.asarray(out.mask).astype(bool)
    plain, _ = training_logprobs(model, trainer_params, out, replay=False)
    replayed, flips = training_logprobs(model, trainer_params, out, replay=True)
    flipped = np.asarray(flips).astype(bool) & mask
    # A token's routing shapes the hidden state that predicts the next token: the log-prob a flip moves.
    after = np.zeros_like(mask)
    after[:, 1:] = flipped[:, :-1] & mask[:, 1:]
    sampler = np.asarray(out.logprobs)
    without, with_ = np.abs(plain - sampler), np.abs(replayed - sampler)
    # Numbers for docs/off_policy.md (pytest -s).
    print(f"\n{layout}: {flipped.sum()} of {mask.sum()} response tokens flipped; |diff| of the next token's "
          f"log-prob without replay: max {without[after].max():.3g}, mean {without[after].mean():.3g}; all "
          f"tokens, without replay: max {without[mask].max():.3g}, with replay: max {with_[mask].max():.2g}")
    assert flipped.sum() >= 5
    assert without[after].mean() > 1e-2  # the flip moves the next token's log-prob
    assert with_[mask].max() <= 1e-5


def test_gradients_reach_the_router_through_the_replayed_gate_weights():
    model, params, out = tied_model("scan")

    def total(p):
        res = forward.response_outputs(model, p, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, 1.0,
                                       experts=out.routed_experts)
        return forward.token_logprobs(res.hidden, out.tokens, out.mask).sum()

    grad = jax.grad(total)(params)["transformer"]["layers"]["mlp"]["router"]["kernel"]
    assert float(jnp.abs(grad).max()) > 1e-4


def plain_routing(model, params, out) -> np.ndarray:
    """[R, Lq + N, Lm, k]: the experts a plain forward of `params` over each row's prompt + response
    sends every token to."""
    seq, pos, mask = forward.sequence_inputs(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    _, sown = model.apply({"params": params}, seq, pos, mask, method=CausalLM.hidden, mutable=[moe.CHOSEN])
    return np.asarray(chosen_experts(sown[moe.CHOSEN]))


def test_a_partial_rollout_records_each_tokens_routing_under_the_weights_that_fed_it():
    """moe.router_replay with partial rollouts: a weight sync lands in the middle of rows. It rotates
    the expert columns of the last layer's router only, so every KV cache is the same under both
    weights (a layer's keys and values come from its input) and a token's routing under either is
    that of a plain forward of them. Each token's record must be the routing of the weights that fed
    it: a prompt's, those of its prefill (which chose the row's first token); response token j's,
    those of the step that chose token j + 1. Replaying it gives the trainer the sampler's experts."""
    model, old, _ = tied_model("mixed", "continuous")
    new = jax.tree.map(lambda x: x, old)
    new["transformer"]["layers_2"]["mlp"]["router"]["kernel"] = (
        old["transformer"]["layers_2"]["mlp"]["router"]["kernel"][:, jnp.asarray([2, 3, 0, 1])])
    static = dict(model=model, config=sampling_config(True, "continuous"))
    state = jax.jit(functools.partial(segments.begin, **static))(old, *moe_prompts(), jax.random.key(1), 0, 4)
    out = jax.device_get(jax.jit(functools.partial(segments.finish, **static))(new, state, 1))
    versions, mask = out.token_policy_version, out.mask.astype(bool)
    lq = out.prompt_tokens.shape[1]
    fed_by = np.full(out.routed_experts.shape[:2], -1)  # [R, Lq + N]: the version that fed each token
    fed_by[:, :lq] = np.where(out.prompt_mask > 0, versions[:, :1], -1)
    fed_by[:, lq:-1] = np.where(mask[:, 1:], versions[:, 1:], -1)
    assert ((fed_by == 0).any(1) & (fed_by == 1).any(1)).any()  # rows the sync interrupted
    assert (fed_by[:, :lq] == 1).any()  # and rows prefilled after it
    routing = {0: plain_routing(model, old, out), 1: plain_routing(model, new, out)}
    for version in (0, 1):
        fed = fed_by == version
        np.testing.assert_array_equal(out.routed_experts[fed], routing[version][fed], err_msg=f"version {version}")
    # The two weights route the new tokens apart (the last layer), and the others alike.
    later = fed_by == 1
    assert (routing[0][later][:, -1] != routing[1][later][:, -1]).any(-1).mean() > 0.5
    np.testing.assert_array_equal(routing[0][..., :-1, :], routing[1][..., :-1, :])


def forced_rows(layout="mixed"):
    """The recorded rows with a forced routing (every recorded token to experts 3 and 2): a replay that
    differs from the model's own routing wherever it would not pick {2, 3}."""
    model, params, out = tied_model(layout)
    forced = jnp.where(out.routed_experts[..., :1] >= 0, jnp.asarray([3, 2], jnp.int8), -1).astype(jnp.int8)
    rows = ResponseRows(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, forced)
    return model, params, rows


@pytest.mark.parametrize("packed", [False, True])
def test_the_experience_and_the_update_replay_the_record_and_count_the_flips(packed):
    """The PPO forwards (padded and packed rows) give the log-probs of a forward with the replayed
    routing, and rollout/routing_mismatch is the share of response tokens whose routing differs."""
    model, params, rows = forced_rows()
    hp = hyper(estimator="grpo", packed_rows=4 if packed else 0, packed_length=16)
    modules = Modules(policy=model, value=None, reward=None)
    frozen = FrozenParams(reference=params, reward=None)
    want = forward.response_outputs(model, params, rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask,
                                    1.0, experts=rows.experts)
    want_logp = np.asarray(forward.token_logprobs(want.hidden, rows.tokens, rows.mask))
    own = forward.response_logits(model, params, rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask, 1.0)
    own = np.asarray(forward.token_logprobs(own, rows.tokens, rows.mask))
    assert np.abs(own - want_logp).max() > 1e-2  # the forced routing matters
    params_t = Trainable(params, None)
    if packed:
        def forward_packed(r):
            return packed_forwards(modules, params_t, frozen, r, hp).replace(scores=None), r.tokens

        out, _, _ = run_packed(forward_packed, rows, hp)
    else:
        out = padded_forwards(modules, params_t, frozen, rows, hp)
    np.testing.assert_allclose(np.asarray(out.logprobs), want_logp, atol=2e-5)
    mask = np.asarray(rows.mask)
    np.testing.assert_array_equal(np.asarray(out.routing_flips) * mask, np.asarray(want.flips) * mask)
    assert 0 < (np.asarray(want.flips) * mask).sum() < mask.sum()
    # The update's forward of the same rows, as an Experience (the padded microbatch, or every packed one).
    zeros, per_row = jnp.zeros(rows.tokens.shape, jnp.float32), jnp.zeros(rows.tokens.shape[:1])
    exp = Experience(prompt_tokens=rows.prompt_tokens, prompt_mask=rows.prompt_mask, tokens=rows.tokens,
                     mask=rows.mask, old_logprobs=zeros, ref_logprobs=zeros, values=zeros, advantages=zeros,
                     returns=zeros, scores=per_row, sequence_kl=per_row, routed_experts=rows.experts)
    no_frozen = FrozenParams(reference=None, reward=None)
    if packed:
        picked, layout = pack_minibatch(exp, jnp.arange(rows.tokens.shape[0]), hp)
        per_slot = jnp.stack([packed_outputs(modules, params_t, no_frozen, packing.microbatch(picked, k), hp).logprobs
                              for k in range(layout.shape[0])])
        logp = packing.gather(per_slot, packing.prediction_slots(layout, rows.prompt_tokens.shape[1], rows.mask))
    else:
        logp = padded_outputs(modules, params_t, no_frozen, exp, hp).logprobs
    np.testing.assert_allclose(np.asarray(logp), want_logp, atol=2e-5)


@pytest.mark.parametrize("schedule", ["rounds", "continuous"])
def test_multi_turn_episodes_record_every_fed_tokens_routing(schedule):
    """Multi-turn episodes (sampling/turns.py: start, decode, append) on the tied 2-layer MoE: every
    prompt, action and observation token fed is recorded, padding is not, and the record is the
    training forward's own routing (replaying it changes no log-prob, flips none)."""
    import test_multi_turn as mt

    from ppo_jax.agentic import continuous_rollout, rollout as rollout_lib
    from ppo_jax.data import build_word_tokenizer
    from ppo_jax.sampling.turns import TurnDecoder

    tokenizer = build_word_tokenizer(mt.WORDS)
    model = CausalLM(ModelConfig(**{**MOE, "vocab_size": len(tokenizer)}, num_layers=2))
    params = tied_params(model)
    decoder = TurnDecoder(model, mt._turn_config(tokenizer, record_experts=True))
    run = rollout_lib.rollout if schedule == "rounds" else continuous_rollout.rollout
    out = run(decoder, params, *mt._prompts(tokenizer), [mt.Scripted(row) for row in range(mt.ROWS)],
              jax.random.key(3), tokenizer=tokenizer, max_turns=3)
    rec, lq = out.routed_experts, out.prompt_tokens.shape[1]
    real = np.concatenate([out.prompt_mask, out.mask], 1).astype(bool)
    assert (rec[~real] == -1).all()
    fed = real.copy()
    fed[np.arange(mt.ROWS), lq + out.mask.sum(-1) - 1] = False  # a row's last token is never fed back
    assert (rec[fed] >= 0).all()
    observations = np.concatenate([np.zeros_like(out.prompt_mask), out.mask & ~out.action_mask], 1).astype(bool)
    assert observations.sum() > 10 and (rec[observations] >= 0).all()

    def logprobs(replay: bool):
        res = forward.response_outputs(model, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, 1.0,
                                       experts=jnp.asarray(rec) if replay else None)
        return np.asarray(forward.token_logprobs(res.hidden, out.tokens, out.action_mask)), res.flips

    plain, _ = logprobs(False)
    replayed, flips = logprobs(True)
    np.testing.assert_array_equal(replayed, plain)
    assert float(np.asarray(flips).sum()) == 0
    assert np.abs(plain - out.logprobs).max() < 1e-5


def test_router_replay_on_a_dense_policy_is_refused():
    s = Settings.from_config(tiny_config(**{"moe.router_replay": True}), reward_in_code=False)
    with pytest.raises(ConfigError, match="moe.router_replay replays the experts of a mixture-of-experts policy"):
        build.policy_model_config(s)
