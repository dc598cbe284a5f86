"""LoRA adapters: exact base at init and with adapters off, merged == unmerged, scanned == unrolled,
cached decode == full forward, gradients on adapters only, and parity with `peft` on tiny
`transformers` models through our PEFT export and import."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from conftest import make_test_mesh

from ppo_jax.models import (CausalLM, LoraConfig, ModelConfig, init_adapters, init_cache, merge_lora,
                            positions_from_mask)
from ppo_jax.models import hf
from ppo_jax.models.cache import split_cache
from ppo_jax.models.forward import response_logits, token_logprobs
from ppo_jax.models.hf import HFModelError
from ppo_jax.models.transformer import split_layer_params
from ppo_jax.sampling.config import SamplingConfig
from ppo_jax.sampling.loop import sample

LLAMA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
GPT2_TARGETS = ("o", "fc", "proj")  # GPT-2's q/k/v are one fused c_attn: not a PEFT module of ours
LENGTHS = (7, 4, 1)
T = max(LENGTHS)


def _config(arch="llama", scan_layers=True, targets=LLAMA_TARGETS, **kw):
    gqa = dict(num_kv_heads=2) if arch == "llama" else {}
    kw.setdefault("lora", LoraConfig(rank=4, alpha=8.0, targets=targets))
    return ModelConfig(arch=arch, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2,
                       intermediate_size=48, scan_layers=scan_layers, **gqa, **kw)


def _batch():
    """Left-padded tokens, positions, mask [3, T]."""
    mask = np.zeros((len(LENGTHS), T), np.int32)
    for row, n in enumerate(LENGTHS):
        mask[row, T - n:] = 1
    tokens = np.random.default_rng(0).integers(1, 64, (len(LENGTHS), T)) * mask
    return jnp.asarray(tokens), positions_from_mask(mask), jnp.asarray(mask)


def _init(cfg):
    """(base params, fresh adapters) of a CausalLM with `cfg`."""
    variables = nn.unbox(CausalLM(cfg).init(jax.random.key(0), *_batch()))
    return variables["params"], variables["lora"]


def _random(adapters, key=1, scale=0.2):
    """Adapters with every A and B nonzero (B is zero at init)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _logits(cfg, params, adapters=None):
    variables = {"params": params} if adapters is None else {"params": params, "lora": adapters}
    return np.asarray(CausalLM(cfg).apply(variables, *_batch())[0])


@pytest.mark.parametrize("arch,targets,dtypes", [
    ("llama", LLAMA_TARGETS, {}),
    ("gpt2", ("q", "k", "v", "o", "fc", "proj"), {}),
    ("llama", LLAMA_TARGETS, {"param_dtype": "bfloat16", "dtype": "bfloat16"}),  # bf16 base, fp32 adapters
])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_adapters_at_init_and_off_give_the_base_exactly(arch, targets, dtypes, scan_layers):
    cfg = _config(arch, scan_layers, targets, **dtypes)
    params, fresh = _init(cfg)
    base = _logits(cfg.replace(lora=None), params)
    np.testing.assert_array_equal(_logits(cfg, params, fresh), base)  # B = 0 at init
    np.testing.assert_array_equal(_logits(cfg, params), base)  # adapters off, the future PPO reference
    assert np.abs(_logits(cfg, params, _random(fresh)) - base).max() > 1e-2


def test_init_is_peft_kaiming_uniform_and_b_zero():
    cfg = _config()
    _, fresh = _init(cfg)
    layers = fresh["transformer"]["layers"]
    for name, fan_in in (("q", 32), ("o", 32), ("down", 48)):
        module = layers["attn" if name in "qo" else "mlp"][name]
        a = np.asarray(module["a"])
        assert np.abs(a).max() <= 1 / np.sqrt(fan_in) and np.abs(a).max() > 0.8 / np.sqrt(fan_in)
        assert not np.any(np.asarray(module["b"]))


@pytest.mark.parametrize("arch,targets,execution", [
    ("llama", LLAMA_TARGETS, {}),
    ("gpt2", ("q", "k", "v", "o", "fc", "proj"), {}),
    ("llama", LLAMA_TARGETS, {"attention": "xla", "remat": True}),  # the fused attention call, remat
])
def test_merged_weights_compute_the_adapted_model(arch, targets, execution):
    cfg = _config(arch, targets=targets, **execution)
    params, fresh = _init(cfg)
    adapters = _random(fresh)
    merged = merge_lora(params, adapters, cfg.lora)
    np.testing.assert_allclose(_logits(cfg.replace(lora=None), merged), _logits(cfg, params, adapters),
                               atol=1e-5, rtol=0)


def test_scanned_and_unscanned_adapters_agree():
    scanned, unscanned = _config(scan_layers=True), _config(scan_layers=False)
    params, fresh = _init(scanned)
    adapters = _random(fresh)

    def per_layer(tree):
        return {"transformer": {**{k: v for k, v in tree["transformer"].items() if k != "layers"},
                                **{f"layers_{i}": p for i, p in enumerate(split_layer_params(tree))}}}

    np.testing.assert_allclose(_logits(unscanned, {**params, **per_layer(params)}, per_layer(adapters)),
                               _logits(scanned, params, adapters), atol=1e-6, rtol=0)


@pytest.mark.parametrize("unrolled", [False, True])
def test_cached_chunked_decode_with_adapters_equals_full_forward(unrolled):
    cfg = _config()
    params, fresh = _init(cfg)
    adapters = _random(fresh)
    tokens, positions, mask = _batch()
    model = CausalLM(cfg)
    full = _logits(cfg, params, adapters)
    cache = init_cache(cfg, len(LENGTHS), T)
    chunks = []
    for start, stop in ((0, 4), (4, 6), (6, 7)):  # a prefill, then smaller steps
        kv_mask = mask.at[:, stop:].set(0)
        args = (tokens[:, start:stop], positions[:, start:stop], kv_mask)
        if unrolled:
            caches = split_cache(cache) if start == 0 else cache
            hidden, cache = model.apply({"params": params}, *args, caches, split_layer_params(params),
                                        split_layer_params(adapters),
                                        method=lambda m, *a: m.transformer.unrolled(*a))
            out = model.apply({"params": params}, hidden, method=CausalLM.project)
        else:
            out, cache = model.apply({"params": params, "lora": adapters}, *args, cache)
        chunks.append(np.asarray(out))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.concatenate(chunks, axis=1)[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("unroll_layers", [False, True])
def test_rollout_logprobs_with_adapters_equal_the_training_forward(unroll_layers):
    cfg = _config()
    params, fresh = _init(cfg)
    adapters = _random(fresh)
    tokens, _, mask = _batch()
    config = SamplingConfig(max_new_tokens=5, pad_token_id=0, temperature=0.7, num_samples=2,
                            unroll_layers=unroll_layers)
    model = CausalLM(cfg)
    out = jax.jit(lambda p, a: sample(p, tokens, mask, jax.random.key(0), model=model, config=config,
                                      adapters=a))(params, adapters)
    logits = response_logits(model, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, 0.7,
                             adapters=adapters)
    np.testing.assert_allclose(token_logprobs(logits, out.tokens, out.mask), out.logprobs, atol=1e-5, rtol=0)
    base = jax.jit(lambda p: sample(p, tokens, mask, jax.random.key(0), model=model, config=config))(params)
    assert np.abs(np.asarray(base.logprobs) - np.asarray(out.logprobs)).max() > 1e-3  # adapters were on


def test_gradient_over_the_adapter_tree_only():
    cfg = _config()
    params, fresh = _init(cfg)
    adapters = _random(fresh)
    tokens, positions, mask = _batch()

    def loss(adapters):
        logits = CausalLM(cfg).apply({"params": params, "lora": adapters}, tokens, positions, mask)[0]
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * mask)

    grads = jax.grad(loss)(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    # At init (B = 0) the gradient reaches B (A's is zero, as in PEFT): training starts moving.
    grads0 = jax.grad(loss)(fresh)
    assert float(jnp.abs(grads0["transformer"]["layers"]["attn"]["q"]["b"]).max()) > 0


def test_adapters_shard_on_the_mesh():
    cfg = _config()
    mesh = make_test_mesh((1, 2, 4))
    adapters, shardings = init_adapters(CausalLM(cfg), jax.random.key(0), mesh)
    spec = shardings["transformer"]["layers"]["attn"]["q"]["b"].spec
    assert spec == jax.sharding.PartitionSpec(None, None, "tensor")  # [L, r, H, Dh]: heads on tensor
    assert not np.any(np.asarray(adapters["transformer"]["layers"]["mlp"]["up"]["b"]))


def test_bad_lora_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="lora.rank must be >= 0"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match=r"unknown projections \['qkv'\]"):
        LoraConfig(targets=("q", "qkv"))
    with pytest.raises(ValueError, match=r"\['gate'\] name projections a gpt2 model does not have"):
        _config("gpt2", targets=("q", "gate"))
    assert _config(lora=None).replace(lora=LoraConfig(rank=0)).lora is None  # rank 0 is off
    assert _config().replace(lora={"rank": 2, "targets": ["q"]}).lora == LoraConfig(rank=2, targets=("q",))


# --- PEFT parity on tiny transformers models ---------------------------------------------------

HF_BASES = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
        intermediate_size=48, max_position_embeddings=32, tie_word_embeddings=False,
        attn_implementation="eager"),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32,
                                            attn_implementation="eager"),
}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def hf_base(request, tmp_path_factory):
    """(arch, directory of a tiny random transformers model)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_BASES[request.param]()).eval()
    path = tmp_path_factory.mktemp(f"base_{request.param}")
    model.save_pretrained(path)
    return request.param, path


def _torch_logits(model):
    tokens, positions, mask = _batch()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(tokens)), attention_mask=torch.tensor(np.asarray(mask)),
                    position_ids=torch.tensor(np.asarray(positions)))
    return out.logits.numpy()


def _assert_parity(ours, theirs):
    real = np.asarray(_batch()[2], bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_our_export_loads_in_peft_with_the_same_logits(hf_base, tmp_path, scan_layers):
    arch, path = hf_base
    mesh = make_test_mesh((1, 1, 1))
    base = hf.load_model(path, mesh, execution={"scan_layers": scan_layers})
    targets = LLAMA_TARGETS if arch == "llama" else GPT2_TARGETS
    cfg = base.config.replace(lora=LoraConfig(rank=4, alpha=8.0, targets=targets, rslora=arch == "gpt2"))
    fresh, _ = init_adapters(CausalLM(cfg), jax.random.key(0), mesh)
    adapters = _random(fresh)
    hf.export_adapter(tmp_path / "adapter", cfg, adapters, base_model_name_or_path=str(path))
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(path)
    peft_model = peft.PeftModel.from_pretrained(torch_base, tmp_path / "adapter").eval()
    _assert_parity(_logits(cfg, base.params, adapters), _torch_logits(peft_model))


def test_peft_saved_adapter_imports_with_the_same_logits(hf_base, tmp_path):
    arch, path = hf_base
    modules = (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if arch == "llama"
               else ["c_proj", "c_fc"])  # GPT-2: "c_proj" is both attn.c_proj and mlp.c_proj
    torch.manual_seed(1)
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(path)
    peft_model = peft.get_peft_model(torch_base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=modules, lora_dropout=0.0, init_lora_weights=False,
        fan_in_fan_out=arch == "gpt2")).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    mesh = make_test_mesh((2, 2, 2))
    base = hf.load_model(path, mesh)
    cfg, adapters = hf.load_adapter(tmp_path / "adapter", base.config, mesh)
    assert set(cfg.lora.targets) == set(LLAMA_TARGETS if arch == "llama" else GPT2_TARGETS)
    _assert_parity(_logits(cfg, base.params, adapters), _torch_logits(peft_model))


def test_merged_export_matches_the_adapted_model(hf_base, tmp_path):
    arch, path = hf_base
    mesh = make_test_mesh((1, 1, 1))
    base = hf.load_model(path, mesh)
    cfg = base.config.replace(lora=LoraConfig(rank=4, targets=LLAMA_TARGETS if arch == "llama" else GPT2_TARGETS))
    adapters = _random(init_adapters(CausalLM(cfg), jax.random.key(0), mesh)[0])
    hf.export_model(tmp_path / "merged", cfg, base.params, adapters=adapters)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    _assert_parity(_logits(cfg, base.params, adapters), _torch_logits(merged))


def _write_adapter_config(directory, **overrides):
    data = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({**data, **overrides}))
    return directory


@pytest.mark.parametrize("overrides,message", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"target_modules": ["q_proj", "w_in"]}, r"target_modules \['w_in'\] match no projection"),
    ({"target_modules": ".*q_proj"}, "a regex string is not read"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])
def test_unsupported_peft_options_are_refused_before_weights(tmp_path, overrides, message):
    directory = _write_adapter_config(tmp_path / "adapter", **overrides)  # no weights file at all
    with pytest.raises(HFModelError, match=message):
        hf.load_adapter(directory, _config(lora=None), make_test_mesh((1, 1, 1)))


def test_fused_projection_export_is_refused_by_name(tmp_path):
    cfg = _config("gpt2", targets=("q", "o"))
    _, fresh = _init(cfg)
    with pytest.raises(HFModelError, match="fused tensor 'transformer.h.N.attn.c_attn.weight'"):
        hf.export_adapter(tmp_path / "adapter", cfg, fresh)


def test_adapter_tensors_that_disagree_with_the_config_are_refused(tmp_path):
    cfg = _config()
    _, fresh = _init(cfg)
    directory = hf.export_adapter(tmp_path / "adapter", cfg, fresh)
    config_file = directory / "adapter_config.json"
    data = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**data, "r": 2}))
    with pytest.raises(HFModelError, match=r"lora_A.weight' has shape \[4, 32\], but r and the base"):
        hf.load_adapter(directory, cfg.replace(lora=None), make_test_mesh((1, 1, 1)))
    config_file.write_text(json.dumps({**data, "target_modules": ["self_attn.q_proj"]}))
    with pytest.raises(HFModelError, match="has tensors that adapter_config.json does not describe"):
        hf.load_adapter(directory, cfg.replace(lora=None), make_test_mesh((1, 1, 1)))
