"""The mixture-of-experts MLP (models/moe.py): the block against transformers' Qwen3-MoE, Mixtral and
GPT-OSS blocks with the same random weights, routing as a NumPy loop computes it, and the PPO invariants on an
MoE policy (the sampler's cached decode and the training forward route every token alike, so
rollout log-probs are training log-probs with no routing replay)."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.models import ModelConfig
from ppo_jax.models.moe import MoEMLP, group_pairs, route, router_losses, router_stats
from ppo_jax.rl.trainer import PPOTrainer

D, F, E, K = 32, 16, 6, 2
MOE = dict(arch="qwen3", hidden_size=D, num_heads=4, num_experts=E, experts_per_token=K, moe_intermediate_size=F)


def _hf_block(family: str, norm_topk_prob: bool):
    """transformers' sparse MoE block with every weight random, and its weights in our layout."""
    common = dict(hidden_size=D, num_experts_per_tok=K, hidden_act="silu")
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            **common, num_experts=E, moe_intermediate_size=F, norm_topk_prob=norm_topk_prob))
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        block = MixtralSparseMoeBlock(transformers.MixtralConfig(**common, num_local_experts=E, intermediate_size=F))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]: gate rows, then up rows
    ours = {"router": {"kernel": block.gate.weight.detach().numpy().T},
            "gate": gate_up[:, :F].transpose(0, 2, 1), "up": gate_up[:, F:].transpose(0, 2, 1),
            "down": block.experts.down_proj.detach().numpy().transpose(0, 2, 1)}
    return block.eval(), jax.tree.map(jnp.asarray, ours)


@pytest.mark.parametrize("family, norm_topk_prob", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_block_matches_transformers(family, norm_topk_prob):
    block, params = _hf_block(family, norm_topk_prob)
    x = np.random.default_rng(1).normal(size=(3, 7, D)).astype(np.float32)
    with torch.no_grad():
        theirs = block(torch.tensor(x)).numpy()
    config = ModelConfig(**MOE, norm_topk_prob=norm_topk_prob)
    ours = MoEMLP(config).apply({"params": params}, jnp.asarray(x))
    assert np.abs(theirs).max() > 0.5
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=0)


def test_gpt_oss_block_matches_transformers():
    """GPT-OSS's MLP: a biased router with the softmax over the top k, clamped SwiGLU experts with
    biases (a limit low enough that the clamps bite)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    block = GptOssMLP(transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                                num_experts_per_tok=K, swiglu_limit=1.5)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    experts = block.experts
    params = jax.tree.map(lambda t: jnp.asarray(t.detach().numpy()), {
        "router": {"kernel": block.router.weight.T, "bias": block.router.bias},
        "gate_up": experts.gate_up_proj, "gate_up_bias": experts.gate_up_proj_bias,
        "down": experts.down_proj, "down_bias": experts.down_proj_bias})
    x = np.random.default_rng(1).normal(size=(3, 7, D)).astype(np.float32)
    with torch.no_grad():
        theirs = block(torch.tensor(x))[0].numpy()
    config = ModelConfig(**{**MOE, "moe_intermediate_size": None}, intermediate_size=F, router_softmax="topk",
                         router_bias=True, expert_kind="clamped_swiglu", swiglu_limit=1.5)
    ours = MoEMLP(config).apply({"params": params}, jnp.asarray(x))
    assert np.abs(theirs).max() > 0.5
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_router_losses_match_transformers(tmp_path, family):
    """The load-balancing loss over a left-padded batch's real tokens is transformers' `aux_loss` (its
    load_balancing_loss_func with the attention mask); the z-loss is the masked mean over tokens and
    layers of logsumexp(router logits)^2 computed in NumPy from transformers' router logits."""
    from conftest import make_test_mesh

    from ppo_jax.models import forward, hf

    common = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=64, num_experts_per_tok=K, attn_implementation="eager")
    if family == "gpt_oss":
        torch_model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, intermediate_size=F, num_local_experts=E, sliding_window=4))
    else:
        torch_model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=F, num_experts=E, intermediate_size=F))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in torch_model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    torch_model.save_pretrained(tmp_path)
    mask = np.ones((3, 9), np.int32)
    mask[1, :4], mask[2, :7] = 0, 0
    tokens = np.random.default_rng(0).integers(1, 64, mask.shape).astype(np.int32) * mask
    positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        theirs = torch_model(input_ids=torch.tensor(tokens).long(), attention_mask=torch.tensor(mask).long(),
                             position_ids=torch.tensor(positions).long(), output_router_logits=True)
    mesh = make_test_mesh((1, 1, 1))
    loaded = hf.load_model(str(tmp_path), mesh)
    with jax.set_mesh(mesh):
        ours = jax.jit(lambda p: forward.hidden_states(loaded.module, {"params": p}, tokens, positions, mask,
                                                       router=True)[1])(loaded.params)
    np.testing.assert_allclose(float(ours.balance), float(theirs.aux_loss), rtol=1e-5)
    # The same numbers from transformers' router logits by the formulas in NumPy: our routing chose the
    # experts theirs did (the busiest expert's load would differ otherwise).
    expected = numpy_router_losses([np.asarray(logits) for logits in theirs.router_logits], mask.reshape(-1), K)
    np.testing.assert_allclose(float(ours.balance), expected["balance"], rtol=1e-5)
    np.testing.assert_allclose(float(ours.z), expected["z"], rtol=1e-5)
    np.testing.assert_allclose(float(ours.load_max), expected["load_max"], rtol=1e-6)
    assert float(ours.dropped) == expected["dropped"] == 0


def numpy_router_losses(layer_logits, real, k, kept=None):
    """The router losses by their formulas, float64: layer_logits [N, E] per layer, real [N] (1 = a real
    token), k experts per token; kept[l] (optional) [N, k] bool: which of a layer's assignments were
    computed (a router with a capacity would drop the rest). Balance (Switch Transformer eqs. 4-6, as
    transformers' load_balancing_loss_func): E * sum_e f_e P_e over every layer's real tokens, f_e the
    share of assignments to e (sum_e f_e = k), P_e the mean softmax probability of e."""
    real = np.asarray(real, np.float64)
    num_experts = layer_logits[0].shape[-1]
    counts, probs, z, loads = np.zeros(num_experts), np.zeros(num_experts), 0.0, []
    for layer, logits in enumerate(layer_logits):
        logits = np.asarray(logits, np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        taken = np.ones(top.shape, bool) if kept is None else kept[layer]
        layer_counts = np.zeros(num_experts)
        for t in range(len(real)):
            for slot in range(k):
                layer_counts[top[t, slot]] += real[t] * taken[t, slot]
        counts += layer_counts
        probs += (p * real[:, None]).sum(0)
        z += (real * np.square(np.log(np.exp(logits).sum(-1)))).sum()
        loads.append(layer_counts.max() / layer_counts.mean())
    total = real.sum() * len(layer_logits)
    return {"balance": num_experts * np.sum(counts / total * probs / total), "z": z / total,
            "load_max": max(loads), "dropped": total * k - counts.sum()}


def _losses(layer_logits, real, k, kept=None):
    """ppo_jax's RouterLosses of the same layers (route, then router_stats per layer, pooled)."""
    sown = []
    for layer, logits in enumerate(layer_logits):
        routing = route(jnp.asarray(logits), k, False, jnp.float32)
        stats = router_stats(jnp.asarray(logits), routing, jnp.asarray(real))
        if kept is not None:  # what a capacity-limited router would count: only the computed assignments
            experts = np.asarray(routing.experts)[~kept[layer] & (np.asarray(real)[:, None] > 0)]
            stats["counts"] = stats["counts"] - np.bincount(experts, minlength=logits.shape[-1])
        sown.append(stats)
    return router_losses(sown, k)


def test_the_balance_loss_is_the_switch_formula_and_can_be_below_1():
    """4 tokens, E = 2, k = 1: three tokens pick expert 0 (p = 0.55), one picks expert 1 (p = 0.9):
    f = (3/4, 1/4), P = (0.4375, 0.5625), balance = 2 (3/4 0.4375 + 1/4 0.5625) = 0.9375 (below 1: a
    bound of 1 holds for one token, not for a batch)."""
    p0 = np.array([0.55, 0.55, 0.55, 0.1])
    logits = np.log(np.stack([p0, 1 - p0], -1))
    ours = _losses([logits], np.ones(4), 1)
    assert float(ours.balance) == pytest.approx(0.9375, rel=1e-6)
    assert numpy_router_losses([logits], np.ones(4), 1)["balance"] == pytest.approx(0.9375, rel=1e-12)
    assert float(ours.load_max) == pytest.approx(1.5) and float(ours.dropped) == 0


def test_router_losses_pool_layers_skip_padding_and_count_dropped_assignments():
    """Two layers of random logits, E = 6, k = 2, two padding tokens (which count nowhere), against
    NumPy; and with a capacity-limited router's counts (3 assignments not computed), `dropped` says 3."""
    rng = np.random.default_rng(3)
    layers = [rng.normal(size=(10, E)) * 2 for _ in range(2)]
    real = np.array([1] * 8 + [0] * 2, np.float32)
    ours, expected = _losses(layers, real, K), numpy_router_losses(layers, real, K)
    for name in ("balance", "z", "load_max", "dropped"):
        np.testing.assert_allclose(float(getattr(ours, name)), expected[name], rtol=1e-5, err_msg=name)
    kept = [np.ones((10, K), bool) for _ in layers]
    kept[0][1, 1] = kept[1][5, 0] = kept[1][6, 1] = False
    ours, expected = _losses(layers, real, K, kept), numpy_router_losses(layers, real, K, kept)
    assert float(ours.dropped) == expected["dropped"] == 3
    np.testing.assert_allclose(float(ours.balance), expected["balance"], rtol=1e-5)


def test_routing_as_a_loop_computes_it():
    """Top-k of the softmax per token, optionally renormalised; pairs grouped by expert (group_pairs)."""
    logits = np.random.default_rng(2).normal(size=(9, E)).astype(np.float32)
    for normalize in (False, True):
        r = route(jnp.asarray(logits), K, normalize, jnp.float32)
        for n, row in enumerate(logits):
            probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            chosen = np.argsort(-probs, kind="stable")[:K]
            weights = probs[chosen] / (probs[chosen].sum() if normalize else 1.0)
            assert list(np.asarray(r.experts[n])) == list(chosen)
            np.testing.assert_allclose(np.asarray(r.weights[n]), weights, rtol=1e-6)
        flat = np.asarray(r.experts).reshape(-1)
        groups = group_pairs(r.experts.reshape(-1), E)
        assert list(np.asarray(groups.sizes)) == [int((flat == e).sum()) for e in range(E)]
        assert list(flat[np.asarray(groups.order)]) == sorted(flat) == list(np.asarray(groups.keys))
        # Pairs in no group (key E - 1 here, with E - 1 groups) sort last and are not counted.
        local = group_pairs(r.experts.reshape(-1), E - 1)
        assert list(np.asarray(local.sizes)) == [int((flat == e).sum()) for e in range(E - 1)]
        assert list(np.asarray(local.keys)) == sorted(flat)
    # GPT-OSS: the k largest logits, then a softmax over those k.
    r = route(jnp.asarray(logits), K, False, jnp.float32, softmax="topk")
    for n, row in enumerate(logits):
        chosen = np.argsort(-row, kind="stable")[:K]
        top = np.exp(row[chosen] - row[chosen].max())
        assert list(np.asarray(r.experts[n])) == list(chosen)
        np.testing.assert_allclose(np.asarray(r.weights[n]), top / top.sum(), rtol=1e-6)


def test_a_token_is_routed_and_computed_alike_in_any_batch():
    """What the sampler relies on: one token's output does not depend on the other rows."""
    config = ModelConfig(**MOE)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 5, D)).astype(np.float32))
    module = MoEMLP(config)
    params = module.init(jax.random.key(0), x)["params"]
    whole = np.asarray(module.apply({"params": params}, x))
    for row in range(4):
        for t in range(5):
            alone = np.asarray(module.apply({"params": params}, x[row:row + 1, t:t + 1]))
            np.testing.assert_allclose(alone[0, 0], whole[row, t], atol=1e-6, rtol=0)


# Every (data, fsdp, tensor, expert) shape of 8 devices with an expert axis (the experts: 8).
EXPERT_MESHES = [(4, 1, 1, 2), (1, 4, 1, 2), (1, 1, 4, 2), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2),
                 (2, 1, 1, 4), (1, 2, 1, 4), (1, 1, 2, 4), (1, 1, 1, 8)]


@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu"])
def test_expert_parallel_block_equals_one_device(kind):
    """Experts split over the mesh's expert axis (each device runs its own experts on the tokens of
    its expert group, `moe.expert_parallel`): the output and every gradient equal one device's, on
    every 8-device mesh with an expert axis, for 21 tokens that the 8 batch devices do not divide."""
    from ppo_jax import sharding

    config = ModelConfig(**{**MOE, "num_experts": 8}, **(
        dict(router_softmax="topk", router_bias=True, expert_kind=kind, swiglu_limit=1.5)
        if kind == "clamped_swiglu" else {}))
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 7, D)).astype(np.float32))
    cotangent = jnp.asarray(rng.normal(size=(3, 7, D)).astype(np.float32))
    module = MoEMLP(config)
    boxed = module.init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda p: p * 10, nn.unbox(boxed))  # weights large enough that routing matters

    def loss(params, x):
        return jnp.sum(module.apply({"params": params}, x) * cotangent)

    step = jax.value_and_grad(loss, argnums=(0, 1))
    value, grads = jax.jit(step)(params, x)
    assert abs(float(value)) > 1.0
    meshes = EXPERT_MESHES if kind == "swiglu" else [(1, 2, 2, 2), (1, 1, 1, 8)]
    for shape in meshes:
        mesh = make_test_mesh(shape)
        shardings = sharding.tree_shardings(boxed, mesh)
        assert shardings["gate_up" if kind == "clamped_swiglu" else "up"].spec[0] == "expert"
        with sharding.mesh_context(mesh):
            on_mesh = jax.jit(step)(jax.device_put(params, shardings), jax.device_put(x, sharding.replicated(mesh)))
        np.testing.assert_allclose(float(on_mesh[0]), float(value), rtol=1e-5, err_msg=str(shape))
        for ours, one in zip(jax.tree.leaves(on_mesh[1]), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(ours), np.asarray(one), atol=2e-5 * np.abs(one).max(),
                                       err_msg=str(shape))


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused(tmp_path):
    from ppo_jax.config import ConfigError

    config = tiny_config(**{"policy.model.arch": "qwen3_moe", "policy.model.qk_norm": True,
                            "policy.model.num_heads": 4, "policy.model.num_experts": 6,
                            "policy.model.experts_per_token": 2, "policy.model.moe_intermediate_size": 16})
    with pytest.raises(ConfigError, match="the mesh's expert axis of 4 devices does not divide the model's 6 experts"):
        PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 2, 1, 4)))
    assert not (tmp_path / "checkpoints").exists()


def test_refuses_what_it_does_not_do():
    with pytest.raises(ValueError, match="experts_per_token=0 must be between 1 and model.num_experts=6"):
        ModelConfig(**{**MOE, "experts_per_token": 0})
    with pytest.raises(ValueError, match="Llama-family option, not gpt2"):
        ModelConfig(arch="gpt2", num_experts=4, experts_per_token=1)
    with pytest.raises(ValueError, match="LoRA on the experts' projections is not supported"):
        ModelConfig(**MOE, lora={"rank": 2, "targets": ("q", "up")})
    with pytest.raises(ValueError, match="router and expert options need model.num_experts > 0"):
        ModelConfig(arch="llama", router_bias=True)
    with pytest.raises(ValueError, match="model.expert_kind='geglu': use one of"):
        ModelConfig(**MOE, expert_kind="geglu")
    with pytest.raises(ValueError, match="attention_sinks is a Llama-family option"):
        ModelConfig(arch="gpt2", attention_sinks=True)
    with pytest.raises(ValueError, match="model.moe_layers marks every layer alike; use moe_layers=None"):
        ModelConfig(**MOE, moe_layers=(True, True))
    with pytest.raises(ValueError, match="model.moe_layers has 3 entries for 2 layers"):
        ModelConfig(**MOE, moe_layers=(True, False, True))
    with pytest.raises(ValueError, match="model.moe_layers needs model.num_experts > 0"):
        ModelConfig(arch="llama", moe_layers=(True, False))


def test_mixed_dense_and_moe_layers_run_per_layer():
    """Dense and MoE layers cannot share one scanned body: such a model holds per-layer params, "auto"
    resolves to them on every platform, and an explicit scan is refused by name."""
    from ppo_jax.config import ComputeSettings, ConfigError

    mixed = ModelConfig(**MOE, moe_layers=(False, True))
    assert not mixed.scan_layers and mixed.layer_moe == (False, True)
    assert not ComputeSettings().apply(mixed, "tpu").scan_layers
    with pytest.raises(ConfigError, match="compute.layer_loop='scan': this model mixes dense and MoE layers"):
        ComputeSettings(layer_loop="scan").apply(mixed, "cpu")


def test_router_losses_on_a_dense_policy_are_refused(tmp_path):
    from ppo_jax.config import ConfigError

    config = tiny_config(**{"ppo.router_aux_coef": 0.001})
    with pytest.raises(ConfigError, match="router losses need a mixture-of-experts policy, and this gpt2"):
        PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    assert not (tmp_path / "checkpoints").exists()


def test_experts_on_a_dense_architecture_are_refused_before_anything_is_written(tmp_path):
    """Hugging Face holds experts only in its MoE classes (export parity: tests/test_hf.py)."""
    from ppo_jax.models import hf
    from ppo_jax.models.hf import HFModelError

    config = ModelConfig(**MOE, qk_norm=True)
    with pytest.raises(HFModelError, match="qwen3 has no experts; mixture-of-experts models are arch 'qwen3_moe' or"):
        hf.export_model(tmp_path / "out", config, {})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="arch='mixtral' is a mixture of experts: set model.num_experts"):
        ModelConfig(arch="mixtral")


# GPT-OSS's options on top of the experts: attention sinks, biases, a sliding layer, its router and
# clamped SwiGLU experts.
GPT_OSS = {"arch": "gpt_oss", "router_softmax": "topk", "router_bias": True, "expert_kind": "clamped_swiglu",
           "norm_scale_float32": True,
           "attention_sinks": True, "attention_bias": True, "attention_out_bias": True, "sliding_window": 4,
           "sliding_layers": (True, False), "intermediate_size": 16}
QWEN3_MOE = {"arch": "qwen3_moe", "qk_norm": True, "moe_intermediate_size": 16}
QWEN3_MOE_MIXED = {**QWEN3_MOE, "moe_layers": (False, True)}  # a dense first layer (mlp_only_layers=[0])


@pytest.mark.parametrize("mesh_shape, layer_loop, lora, model", [((2, 2, 2), "scan", False, GPT_OSS),
                                                                  ((1, 1, 1), "unrolled", True, QWEN3_MOE_MIXED)],
                         ids=["gpt_oss-2x2x2-scan", "qwen3_moe_mixed-1x1x1-unrolled-lora"])
def test_ppo_on_an_moe_policy_keeps_the_invariants(tmp_path, mesh_shape, layer_loop, lora, model):
    """First minibatch ratio 1, rollout log-probs == training log-probs, one compile of each phase:
    a GPT-OSS policy on a 2x2x2 mesh (every device's program holds every expert, their embed axis
    over fsdp and mlp over tensor) with scanned layers, and a Qwen3-MoE one whose first layer is dense, with the per-layer
    loop (the sampler's unrolled decode) and LoRA on the attention, exported merged (a
    Qwen3MoeForCausalLM with mlp_only_layers=[0]) and as a PEFT adapter."""
    overrides = {f"policy.model.{name}": value for name, value in model.items()}
    if layer_loop == "scan":  # the router losses on, and their metrics reported
        overrides.update({"ppo.router_aux_coef": 0.01, "ppo.router_z_coef": 0.001})
    else:  # routing replay on (tests/test_router_replay.py): the trainer carries the continuous engine's record through
        overrides.update({"moe.router_replay": True, "rollout.engine": "continuous"})
    config = tiny_config(**{"train.iterations": 2, "policy.model.num_heads": 4, "policy.model.num_experts": 4,
                            "policy.model.experts_per_token": 2, "compute.layer_loop": layer_loop, **overrides})
    if lora:
        config.policy.lora.rank, config.policy.lora.targets = 2, "q,v"
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh(mesh_shape))
    history = trainer.train()
    for row in history:
        assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
        assert row["policy/rollout_logprob_diff_max"] < 1e-5
        assert row.get("rollout/routing_mismatch", 0.0) == 0.0 and ("rollout/routing_mismatch" in row) == (layer_loop != "scan")
        # What holds for any routing (E = 4, k = 2): 0 < E sum_e f_e P_e <= E (f_e <= 1, sum P = 1), the
        # busiest expert between the mean and E / k times it; the exact values are the formulas' (above).
        assert 0.0 < row["moe/balance_loss"] <= 4.0 and row["moe/z_loss"] > 0
        assert 1.0 <= row["moe/expert_load_max"] <= 4 / 2
    assert history[0]["val/ratio"] != 1.0  # the policy moved
    assert trainer.trace_counts == {"experience": 1, "update": 1}
    mlp = trainer.state.policy["transformer"]["layers"]["mlp"] if layer_loop == "scan" else {}
    if model is GPT_OSS:
        assert mlp["gate_up"].shape == (2, 4, 32, 32) and mlp["gate_up"].sharding.spec[2] == "fsdp"
    trainer.close()
    if lora:
        from ppo_jax.rl.export import export_checkpoint

        merged = export_checkpoint(str(tmp_path), str(tmp_path / "merged"), lora_format="merged")
        exported = transformers.AutoModelForCausalLM.from_pretrained(merged)
        assert type(exported).__name__ == "Qwen3MoeForCausalLM" and exported.config.mlp_only_layers == [0]
        assert type(exported.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
        adapter = export_checkpoint(str(tmp_path), str(tmp_path / "adapter"), lora_format="adapter")
        assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_expert_parallel_ppo_gives_one_devices_metrics(tmp_path):
    """1 device == 8 devices with the experts split 4 ways (and the batch 2 ways over fsdp): every
    metric of two PPO iterations on a Qwen3-MoE policy, router losses on, to float32 round-off (padded
    microbatches: a packed microbatch holds a multiple of the data-parallel devices' rows, so its
    router losses, which are each forward's own, are over other tokens on another mesh); and
    the invariants hold under expert parallelism (the sampler's decode steps dispatch and gather
    tokens like the training forward)."""
    def run(mesh_shape, workdir):
        config = tiny_config(**{"train.iterations": 2, "policy.model.num_heads": 4, "policy.model.num_experts": 4,
                                "policy.model.experts_per_token": 2, "compute.layer_loop": "scan",
                                "ppo.router_aux_coef": 0.01, "ppo.router_z_coef": 0.001, "ppo.packing": "off",
                                **{f"policy.model.{name}": value for name, value in QWEN3_MOE.items()}})
        trainer = PPOTrainer(config, str(workdir), mesh=make_test_mesh(mesh_shape))
        history = trainer.train()
        trainer.close()
        return trainer, history

    _, expected = run((1, 1, 1), tmp_path / "one")
    trainer, history = run((1, 2, 1, 4), tmp_path / "ep")
    # [L, E, D, F]: one expert per device of the expert axis, D over fsdp.
    assert trainer.state.policy["transformer"]["layers"]["mlp"]["gate"].sharding.spec[1:3] == ("expert", "fsdp")
    assert trainer.trace_counts == {"experience": 1, "update": 1}
    for want, got in zip(expected, history, strict=True):
        assert abs(got["first_minibatch/ratio"] - 1.0) < 1e-6
        assert got["policy/rollout_logprob_diff_max"] < 1e-5
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):
                np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)


def test_sft_and_dpo_add_the_weighted_router_losses(tmp_path):
    """SFT and DPO on a fresh Qwen3-MoE model: the loss with router coefficients is the loss without
    them plus aux * balance + z * z-loss of the same forward (reported as moe/ metrics either way); a dense model
    with coefficients is refused before anything compiles."""
    import test_dpo
    import test_sft

    from ppo_jax.config import ConfigError

    moe = {"arch": "qwen3_moe", "qk_norm": True, "num_experts": 4, "experts_per_token": 2,
           "moe_intermediate_size": 16}
    coefs = {"router_aux_coef": 0.5, "router_z_coef": 0.25}

    def first_step(module, run, **model_fields):
        config = module.tiny_config()
        for name, value in {**moe, **model_fields}.items():
            target = config.model if name.startswith("router_") else config.model.config
            target[name] = value
        trainer = module.make(config, tmp_path / run)
        metrics = trainer.train_step()
        trainer.close()
        return metrics

    for module, prefix in ((test_sft, "train/moe/"), (test_dpo, "moe/")):
        plain, weighted = first_step(module, f"{prefix}plain"), first_step(module, f"{prefix}weighted", **coefs)
        balance, z = weighted[f"{prefix}balance_loss"], weighted[f"{prefix}z_loss"]
        assert 0.0 < balance <= 4.0 and z > 0 and weighted[f"{prefix}expert_load_max"] >= 1.0  # E = 4
        if module is test_dpo:  # DPO's `loss` is the optimised one
            assert weighted["loss"] == pytest.approx(plain["loss"] + 0.5 * balance + 0.25 * z, rel=1e-5)
        else:  # SFT's train/loss stays the NLL (comparable with eval/loss); the gradient carries the rest
            assert weighted["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-6)
            assert abs(weighted["train/grad_norm"] - plain["train/grad_norm"]) > 1e-3 * plain["train/grad_norm"]
        assert plain[f"{prefix}balance_loss"] == pytest.approx(balance, rel=1e-6)  # reported with the losses off too
    config = test_sft.tiny_config()
    config.model.router_z_coef = 0.001
    with pytest.raises(ConfigError, match="router losses need a mixture-of-experts model, and this gpt2 model"):
        test_sft.make(config, tmp_path / "dense")
