"""Issue 31: the sampler on its own mesh (colocated with another layout, or on devices of its own),
the weight sync, and one-step off-policy rollouts. On 8 CPU devices: every layout logs the
one-mesh run's metrics; the sampler's weights equal the trainer's bit for bit; the pipelined
off-policy run equals a plain loop written here; a SIGTERM mid-pipeline resumes exactly."""

import os
import sys
from unittest import mock

import jax
import numpy as np
import pytest
from conftest import make_test_mesh
from test_reliability import _toy_reward_then_sigterm_at
from tiny_configs import tiny_config

from ppo_jax import reward_functions as reward_fns
from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.data import toy
from ppo_jax.models import ScalarModel, hf, init_params
from ppo_jax.models import lora as lora_lib
from ppo_jax.rl import build
from ppo_jax.rl.held_out import HeldOutSampler
from ppo_jax.rl.settings import Settings
from ppo_jax.rl import roles
from ppo_jax.rl.state import policy_variables
from ppo_jax.rl.trainer import PPOTrainer

# name -> (mesh.shape, roles overrides): the trainer's mesh, and where the sampler runs.
LAYOUTS = {
    "colocated_tensor": ((1, 8, 1), {"roles.sampler_mesh": (1, 1, 8)}),
    "disaggregated": ((4, 1, 1), {"roles.sampler_devices": 4, "roles.sampler_mesh": (1, 2, 2)}),
}
LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "value.lora.rank": 4, "value.lora.alpha": 8.0}


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


def assert_same_metrics(expected, history, rtol=2e-3, atol=2e-4):
    assert len(expected) == len(history)
    for want, got in zip(expected, history):
        for key, value in comparable(want).items():
            np.testing.assert_allclose(got[key], value, rtol=rtol, atol=atol, err_msg=key)


def layout_trainer(layout, workdir, reward_functions=None, **overrides):
    shape, placement = LAYOUTS[layout]
    config = tiny_config(**{"train.iterations": 2, "mesh.shape": shape, **placement, **overrides})
    return PPOTrainer(config, str(workdir), reward_functions=reward_functions)


@pytest.fixture(scope="module")
def one_mesh(tmp_path_factory):
    """Two iterations with everything on one device: what every layout must log."""
    runs = {}
    for name, overrides in (("full", {}), ("lora", LORA)):
        trainer = PPOTrainer(tiny_config(**{"train.iterations": 2, **overrides}),
                             str(tmp_path_factory.mktemp(name)), mesh=make_test_mesh((1, 1, 1)))
        runs[name] = trainer.train()
    return runs


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_logs_the_one_mesh_metrics_and_syncs_exact_weights(one_mesh, layout, lora, tmp_path):
    trainer = layout_trainer(layout, tmp_path, **(LORA if lora else {}))
    assert not trainer.meshes.shared
    assert trainer.meshes.disaggregated == (layout == "disaggregated")
    history = trainer.train()
    assert_same_metrics(one_mesh["lora" if lora else "full"], history)
    for row in history:  # the sampler decodes exactly the weights being trained
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
        assert row["perf/weight_sync_bytes"] > 0
    # The weight sync: the sampler's copy equals the trainer's weights bit for bit, on the sampler's mesh.
    synced = trainer.sampler_weights()
    params, adapters = policy_variables(trainer.state.policy, trainer.frozen.policy)
    pairs = [(synced.params, params)] + ([(synced.adapters, adapters)] if lora else [])
    sampler_devices = set(trainer.meshes.sampler.devices.flat)
    for theirs, ours in pairs:
        for a, b in zip(jax.tree.leaves(theirs), jax.tree.leaves(ours)):
            assert a.sharding.device_set == sampler_devices
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # LoRA moves only the adapters each step; the frozen base went to the sampler once.
    adapter_bytes = roles.tree_bytes(adapters if lora else params)
    assert history[-1]["perf/weight_sync_bytes"] == adapter_bytes
    trainer.close()


@pytest.mark.parametrize("layout", ["disaggregated", "shared"])
def test_merged_lora_sync_decodes_the_merged_weights(one_mesh, layout, tmp_path):
    """roles.lora_sync="merged": only the adapters travel; the sampler folds them into its own
    decoding copy (the same function, so the same metrics up to matmul round-off)."""
    overrides = {**LORA, "roles.lora_sync": "merged"}
    if layout == "shared":
        trainer = PPOTrainer(tiny_config(**{"train.iterations": 2, **overrides}), str(tmp_path),
                             mesh=make_test_mesh((2, 2, 2)))
    else:
        trainer = layout_trainer(layout, tmp_path, **overrides)
    assert trainer.sampler.takes_adapters is False
    history = trainer.train()
    assert_same_metrics(one_mesh["lora"], history)
    synced = trainer.sampler_weights()
    assert synced.adapters is None
    params, adapters = policy_variables(trainer.state.policy, trainer.frozen.policy)
    assert history[0]["perf/weight_sync_bytes"] == (roles.tree_bytes(adapters) if layout != "shared" else 0)
    merged = jax.device_get(lora_lib.merge_lora(jax.device_get(params), jax.device_get(adapters),
                                                trainer.policy_config.lora))
    for a, b in zip(jax.tree.leaves(synced.params), jax.tree.leaves(merged)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)
    trainer.close()


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A random tiny GPT-2 reward model (ForSequenceClassification) with the toy tokenizer."""
    s = Settings.from_config(tiny_config())
    cfg = build.policy_model_config(s)
    params, _ = init_params(ScalarModel(cfg, head_init="reward"), jax.random.key(7), make_test_mesh((1, 1, 1)))
    return str(hf.export_model(tmp_path_factory.mktemp("rm") / "rm", cfg, params, kind="reward",
                               tokenizer=toy.tokenizer(cfg.vocab_size)))


@pytest.fixture(scope="module")
def with_reward_model(reward_dir, tmp_path_factory):
    """(overrides, one-device history) of a run scored by a reward model and the toy function, its
    value model started from the reward model."""
    overrides = {"reward.path": reward_dir, "value.init": "reward", "train.iterations": 2}
    trainer = PPOTrainer(tiny_config(**overrides), str(tmp_path_factory.mktemp("rm_run")), mesh=make_test_mesh((1, 1, 1)))
    return overrides, trainer.train()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scoring_on_the_sampler_mesh_logs_the_same_metrics_and_frees_the_trainer(with_reward_model, layout, tmp_path):
    """roles.scoring="sampler": the reference and the reward model live on the sampler's mesh and
    score each rollout there; the trainer's devices hold neither."""
    overrides, expected = with_reward_model
    trainer = layout_trainer(layout, tmp_path, **overrides, **{"roles.scoring": "sampler"})
    assert trainer.frozen.reference is None and trainer.frozen.reward is None
    sampler_devices = set(trainer.meshes.sampler.devices.flat)
    for leaf in jax.tree.leaves((trainer.scorer.reference, trainer.scorer.reward)):
        assert leaf.sharding.device_set == sampler_devices
    history = trainer.train()
    assert_same_metrics(expected, history)
    # The scoring program's numbers are the reference's and the reward model's, as transformers computes
    # them from the same weights: in the experience step (the KL it reports), in the raw scores it
    # sampled with, and through score_responses (what held-out evaluation scores with).
    rollout, exp = trainer._last_rollout
    want_ref, want_scores = transformers_scores(trainer, overrides["reward.path"], rollout, tmp_path / "hf_reference")
    ref, scores = trainer.score_responses(rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask)
    np.testing.assert_allclose(np.asarray(exp.ref_logprobs), want_ref, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref), want_ref, atol=1e-4)
    np.testing.assert_allclose(np.asarray(rollout.frozen_outputs.model_scores), want_scores, atol=1e-4)
    np.testing.assert_allclose(np.asarray(scores), want_scores * trainer.hp.score_gain + trainer.hp.score_bias,
                               atol=1e-4)
    # Held-out evaluation (the demo's and the verifiable task's) samples on the sampler's mesh and
    # scores with the scorer's trees.
    held_out = HeldOutSampler(trainer, [f"w{i} w{i + 1}" for i in range(32)], seed=3)()
    assert len(held_out) == 32 and all(np.isfinite([s.kl for s in held_out]))
    trainer.close()


def transformers_scores(trainer, reward_dir, rollout, export_dir):
    """(the reference policy's log-probs [B, Lr] at the rollout temperature, the reward model's raw
    scores [B] at each row's last real token) of a rollout's rows, by transformers' GPT-2 in float32:
    the reference exported from the scorer's tree, the reward model from its own directory."""
    import torch
    import transformers

    hf.export_model(export_dir, trainer.modules.policy.config, jax.device_get(trainer.scorer.reference),
                    kind="causal_lm")
    policy = transformers.GPT2LMHeadModel.from_pretrained(export_dir).eval()
    reward = transformers.GPT2ForSequenceClassification.from_pretrained(reward_dir).eval()
    host = jax.device_get((rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask))
    prompt_tokens, prompt_mask, tokens, mask = (np.asarray(a) for a in host)
    ids = torch.tensor(np.concatenate([prompt_tokens, tokens], 1)).long()
    seq_mask = np.concatenate([prompt_mask, mask], 1).astype(np.int64)
    inputs = dict(input_ids=ids, attention_mask=torch.tensor(seq_mask),
                  position_ids=torch.tensor(np.clip(np.cumsum(seq_mask, 1) - 1, 0, None)))
    lq, lr = prompt_tokens.shape[1], tokens.shape[1]
    with torch.no_grad():
        logits = policy(**inputs).logits[:, lq - 1: lq + lr - 1].double().numpy() / trainer.hp.temperature
        per_position = reward.score(reward.transformer(**inputs).last_hidden_state)[..., 0].double().numpy()
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    ref = np.where(mask > 0, np.take_along_axis(logp, tokens[..., None].astype(np.int64), -1)[..., 0], 0.0)
    last_real = seq_mask.shape[1] - 1 - np.argmax(seq_mask[:, ::-1], axis=1)
    return ref, per_position[np.arange(len(ids)), last_real]


def test_scoring_on_the_sampler_mesh_with_lora(one_mesh, tmp_path):
    trainer = layout_trainer("disaggregated", tmp_path, **{**LORA, "value.lora.rank": 0, "roles.scoring": "sampler"})
    lora_full_value = PPOTrainer(tiny_config(**{**LORA, "value.lora.rank": 0, "train.iterations": 2}),
                                 str(tmp_path / "one"), mesh=make_test_mesh((1, 1, 1))).train()
    assert_same_metrics(lora_full_value, trainer.train())
    assert trainer.scorer.policy is trainer.rollouts.sync.base  # the reference is the sampler's base copy
    trainer.close()


def test_the_default_layout_shares_one_mesh_and_copies_nothing(tmp_path):
    trainer = PPOTrainer(tiny_config(**{"train.iterations": 1}), str(tmp_path), mesh=make_test_mesh((2, 2, 2)))
    assert trainer.meshes.shared
    row = trainer.train()[0]
    assert row["perf/weight_sync_bytes"] == 0 and row["time/weight_sync"] == 0
    synced = trainer.sampler_weights()
    for a, b in zip(jax.tree.leaves(synced.params), jax.tree.leaves(trainer.state.policy)):
        assert a is b  # the trainer's own arrays: no copy
    trainer.close()


def test_devices_split_per_process_and_bad_layouts_fail_in_one_line():
    devices = jax.devices()
    trainer, sampler = roles.split_devices(2, devices)
    assert sampler == devices[6:] and trainer == devices[:6]
    meshes = roles.make_role_meshes(roles.RolesSettings(sampler_devices=2), (-1, 1, 1), devices)
    assert meshes.trainer.size == 6 and meshes.sampler.size == 2 and meshes.disaggregated
    # A TPU slice's mesh builder refuses device sets that do not fill their torus box (the last
    # chips of every host): the role's mesh then keeps the split order.
    with mock.patch.object(sharding.jax, "make_mesh", side_effect=AssertionError("bounding box")):
        meshes = roles.make_role_meshes(roles.RolesSettings(sampler_devices=4, sampler_mesh=(1, 2, -1)), (-1, 1, 1),
                                        devices)
    assert list(meshes.sampler.devices.flat) == devices[4:] and meshes.sampler.devices.shape == (1, 2, 2, 1, 1)  # data, fsdp, tensor, expert, context
    for placement, shape, message in [
        (dict(sampler_devices=8), (-1, 1, 1), "leaves no devices for training"),
        (dict(sampler_devices=4), (1, 8, 1), "mesh.shape=(1, 8, 1) does not fit the trainer's 4 devices"),
        (dict(sampler_devices=4, sampler_mesh=(1, 1, 8)), (-1, 1, 1),
         "roles.sampler_mesh=(1, 1, 8) does not fit the sampler's 4 devices"),
        (dict(sampler_mesh=(3, 1, 1)), (8, 1, 1), "roles.sampler_mesh=(3, 1, 1) does not fit the sampler's 8"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            roles.make_role_meshes(roles.RolesSettings(**placement), shape, devices)


@pytest.mark.parametrize("overrides,message", [
    ({"roles.sampler_devices": -1}, "roles.sampler_devices must be >= 0"),
    ({"roles.sampler_mesh": (1, 0, 8)}, "roles.sampler_mesh=(1, 0, 8): give 3 or 4 positive sizes"),
    ({"roles.scoring": "reward"}, "roles.scoring='reward': use one of trainer, sampler"),
    ({"roles.scoring": "sampler"}, "roles.scoring=sampler scores on the sampler's own mesh"),
    ({"roles.scoring": "sampler", "roles.sampler_devices": 4, "value.lora.rank": 4},
     "the LoRA value model's frozen base is the reference's transformer"),
    ({"roles.lora_sync": "folded"}, "roles.lora_sync='folded': use one of adapters, merged"),
    ({"roles.lora_sync": "merged"}, "roles.lora_sync='merged' applies to a LoRA policy"),
    ({"rollout.off_policy_steps": 5}, "rollout.off_policy_steps=5: use 0 (on-policy) to 4"),
    ({"ppo.off_policy_ratio": "clipped"}, "ppo.off_policy_ratio='clipped': use one of auto, none, behaviour, "),
    ({"rollout.off_policy_steps": 1, "ppo.is_cap": 0.5}, "ppo.is_cap must be a finite number >= 1"),
    ({"roles.sampler_devices": 4, "rollout.batch_size": 6, "mesh.shape": (1, 1, 4), "roles.sampler_mesh": (4, 1, 1)},
     "rollout.batch_size=6 is not a multiple of the sampler's 4 data-parallel devices"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_role_settings_fail_before_compiling(overrides, message, tmp_path):
    overrides = {"rollout.forward_microbatch": 0, "ppo.num_microbatches": 1, **overrides}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PPOTrainer(tiny_config(**overrides), str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing written


# ---------------------------------------------------------------------------------------- off-policy

OFF_POLICY = {"rollout.off_policy_steps": 1, "train.iterations": 3}


@pytest.mark.parametrize("ratio", ["behaviour", "truncated_is"])
def test_pipelined_off_policy_equals_the_plain_loop(ratio, tmp_path):
    overrides = {**OFF_POLICY, "ppo.off_policy_ratio": ratio, "ppo.is_cap": 1.5}
    reference = PPOTrainer(tiny_config(**overrides), str(tmp_path / "plain"), mesh=make_test_mesh((1, 1, 1)))
    from test_off_policy_pipeline import plain_k_step_loop  # (it imports this module's helpers)

    expected = plain_k_step_loop(reference, 3, k=1)  # batch j sampled with the weights before update j - 1
    trainer = layout_trainer("disaggregated", tmp_path / "pipelined", **overrides)
    history = trainer.train()
    assert_same_metrics(expected, [{k: v for k, v in row.items() if k in expected[0]} for row in history])
    # Batches 0 and 1 come from the initial weights; batch 1 is then one update old.
    assert history[0]["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert history[1]["rollout/mismatch_kl"] > 1e-8 and history[1]["rollout/policy_lag_mean"] == 1.0
    first = history[1]["first_minibatch/ratio"]
    if ratio == "behaviour":  # the ratio divides by the sampler's log-probs: not 1 on a stale batch
        assert abs(first - 1.0) > 1e-4
    else:  # the ratio to the recomputed policy (1 on the first minibatch), the staleness in the weights
        assert abs(first - 1.0) < 1e-6 and history[1]["off_policy/is_weight_max"] > 1.0
    assert not trainer.rollouts.in_flight  # the last iteration started no sample
    assert trainer.trace_counts == {"experience": 1, "update": 1} and trainer.sampler.trace_count == 1
    trainer.close()


@pytest.mark.parametrize("scoring", ["trainer", "sampler"])
def test_sigterm_mid_pipeline_resumes_exactly(scoring, request, tmp_path):
    """The checkpoint holds the sample in flight (started with the weights before the last update),
    so the resumed run uses that very batch: identical metrics and parameters. Scored on the
    sampler's mesh (by a reward model there), the restored sample is scored again, bit for bit."""
    overrides = {**OFF_POLICY, "train.iterations": 4, "roles.scoring": scoring}
    if scoring == "sampler":
        overrides["reward.path"] = request.getfixturevalue("reward_dir")
    toy = [(reward_fns.toy_target_count, 1.0)]
    straight = layout_trainer("disaggregated", tmp_path / "straight", toy, **overrides)
    expected = straight.train()
    expected_policy = jax.device_get(straight.state.policy)
    straight.close()

    workdir = tmp_path / "interrupted"
    first = layout_trainer("disaggregated", workdir, [(_toy_reward_then_sigterm_at(2), 1.0)], **overrides)
    partial = first.train()
    assert first.stopped_by == "SIGTERM" and len(partial) == 2
    first.close()
    resumed = layout_trainer("disaggregated", workdir, toy, **overrides)
    assert resumed.resumed_from == 2 and len(resumed.rollouts.in_flight) == 1
    rest = resumed.train()
    for want, got in zip(expected[2:], rest):
        assert comparable(got) == comparable(want)  # bitwise
    for a, b in zip(jax.tree.leaves(expected_policy), jax.tree.leaves(jax.device_get(resumed.state.policy))):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_timeline_model_overlaps_only_what_runs_on_separate_hardware():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import timeline

    p = timeline.parse_phases("G=4,H=0.5,E=1,U=2,S=0.25")
    assert timeline.predict(p, off_policy=False, disaggregated=True) == 7.75  # everything in turn
    assert timeline.predict(p, off_policy=True, disaggregated=True) == 4.25  # S + max(G, H + E + U)
    assert timeline.predict(p, off_policy=True, disaggregated=False) == 7.25  # only the host overlaps G
    slow_trainer = timeline.Phases(G=1, H=0.5, E=1, U=2)
    assert timeline.predict(slow_trainer, off_policy=True, disaggregated=True) == 3.5

    # Iteration by iteration, constant phases give the closed forms for every k >= 1.
    n = 20
    for disaggregated in (False, True):
        for k in (0, 1, 2, 4):
            done = timeline.simulate([4.0] * n, [0.5] * n, p, k=k, disaggregated=disaggregated)
            closed = timeline.predict(p, off_policy=k > 0, disaggregated=disaggregated)
            assert abs(timeline.steady_seconds(done, 5) - closed) < 1e-9, (disaggregated, k)


def test_more_staleness_lets_the_sampler_run_ahead_of_a_slow_batch():
    """One slow batch (G = 5 among 1s), a trainer at 2 s a batch, disaggregated, counted by hand:
    with k = 1 the sampler cannot start batch 4 before update 2 ends (t = 7) and the trainer waits for
    it until 12; with k = 2 it may start at update 1's end (t = 5) and the trainer waits until 10."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import timeline

    p, generate, host = timeline.Phases(G=0, H=0, E=1, U=1), [1, 1, 1, 1, 5, 1, 1], [0] * 7
    assert timeline.simulate(generate, host, p, k=1, disaggregated=True) == [3, 5, 7, 9, 14, 16, 18]
    assert timeline.simulate(generate, host, p, k=2, disaggregated=True) == [3, 5, 7, 9, 12, 14, 16]
    assert timeline.simulate(generate, host, p, k=0, disaggregated=True)[-1] == sum(generate) + 7 * 2


def test_the_roles_preset_config_validates_and_splits_8_devices():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "ppo_roles.py")
    spec = importlib.util.spec_from_file_location("ppo_roles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    s = Settings.from_config(module.get_config())
    meshes = roles.make_role_meshes(s.roles, s.mesh.shape)
    assert meshes.disaggregated and meshes.trainer.shape["fsdp"] == 4 and meshes.sampler.shape["tensor"] == 2
