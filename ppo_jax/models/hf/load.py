"""Hugging Face checkpoints <-> ppo_jax models: the only module that knows Hugging Face names.

Supported architectures (config.json `architectures`):
  causal LMs:    GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
  reward models: GPT2/Llama/Mistral/Qwen2 ForSequenceClassification with num_labels = 1, read into
                 our `ScalarModel` (its `score` head; Hugging Face has no score bias, so it loads as 0).

Weights are read from safetensors only (single file or sharded with `model.safetensors.index.json`);
pickled `.bin`/`.pt` files are refused, nothing is ever unpickled, and `trust_remote_code` is never on.

How a tensor travels. Every parameter of ours is described by a `TensorMap`: a window of one Hugging
Face tensor (per layer for our scanned, stacked layers), split into sub-axes and transposed into our
layout. GPT-2's packed `c_attn` [D, 3D] (Conv1D, [in, out]) gives q, k, v as three windows of its
output axis split into (H, Dh); Llama's `q_proj.weight` [H*Dh, D] (torch Linear, [out, in]) splits
into (H, Dh, D) and transposes to our [D, H, Dh]. The same table drives loading (each device shard
reads only the rows and columns it needs, straight from a memory map of the file) and export (the
inverse transpose, written into the window).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath

from ppo_jax import sharding
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.transformer import CausalLM, ScalarModel, positions_from_mask


class CheckpointError(ValueError):
    """A Hugging Face checkpoint directory that ppo_jax cannot read (or a config it cannot write)."""


KINDS = ("causal_lm", "reward")

# Hugging Face class name -> (model_type, kind).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "GPT2LMHeadModel": ("gpt2", "causal_lm"),
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "MistralForCausalLM": ("mistral", "causal_lm"),
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "GPT2ForSequenceClassification": ("gpt2", "reward"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "MistralForSequenceClassification": ("mistral", "reward"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
}
_CLASS_FOR = {value: name for name, value in ARCHITECTURES.items()}

# Activation names Hugging Face writes -> ours (ppo_jax.models.transformer.MLP).
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
                "relu": "relu", "silu": "silu", "swish": "silu"}
_DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "llama": "silu"}

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_DTYPE_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
_DTYPE_NAMES = {np.dtype("<f8"): "float64", np.dtype("<f4"): "float32", np.dtype("<f2"): "float16",
                np.dtype(ml_dtypes.bfloat16): "bfloat16"}

# Tensors some checkpoints carry that are not parameters (old GPT-2 causal-mask buffers, cached
# rotary frequencies): skipped silently.
_BUFFER_PATTERN = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


# ============================================================================================
# Config mapping.


def _supported_list() -> str:
    return ", ".join(ARCHITECTURES)


def _as_dict(hf_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise CheckpointError(f"expected a config.json dict or a transformers PretrainedConfig, got "
                          f"{type(hf_config).__name__}")


def _hf_config_object(hf_config: Mapping[str, Any] | Any):
    """A transformers config object, so that every key a config.json omits takes the same default
    the PyTorch model would use (Mistral's sliding_window, Llama's rms_norm_eps, ...)."""
    if not isinstance(hf_config, Mapping):
        return hf_config
    import transformers

    data = dict(hf_config)
    model_type = data.get("model_type")
    if model_type is None:
        raise CheckpointError("config.json has no model_type (expected one of gpt2, llama, mistral, "
                              "qwen2)")
    if model_type not in {t for t, _ in ARCHITECTURES.values()}:
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in config.json; supported architectures: "
            f"{_supported_list()}")
    data.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except Exception as err:  # transformers validates strictly; say which file and why.
        raise CheckpointError(f"config.json is not a valid {model_type} config: {err}") from err


def checkpoint_kind(hf_config: Mapping[str, Any] | Any) -> str:
    """"causal_lm" or "reward", from config.json's `architectures` (causal_lm when absent)."""
    data = _as_dict(hf_config)
    names = data.get("architectures") or []
    if not names:
        return "causal_lm"
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        raise CheckpointError(
            f"unsupported architecture {unknown[0]!r} in config.json; supported: {_supported_list()}")
    model_type = data.get("model_type")
    wrong = [n for n in names if model_type is not None and ARCHITECTURES[n][0] != model_type]
    if wrong:
        raise CheckpointError(f"config.json says model_type={model_type!r} but architectures="
                              f"{names}; they must agree")
    kinds = {ARCHITECTURES[n][1] for n in names}
    if len(kinds) > 1:
        raise CheckpointError(f"config.json names architectures of different kinds: {names}")
    kind = kinds.pop()
    if kind == "reward":
        labels = data.get("num_labels") or len(data.get("id2label") or {}) or 1
        if labels != 1:
            raise CheckpointError(
                f"{names[0]} with num_labels={labels}: a reward model needs num_labels=1 "
                f"(one scalar score)")
    return kind


def _token_id(value) -> int | None:
    # Llama 3 lists several EOS ids; our config keeps one (the first, the tokenizer's own EOS).
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _activation(name: str, field: str, family: str) -> str | None:
    if name not in _ACTIVATIONS:
        raise CheckpointError(f"unsupported {field}={name!r}; supported: {sorted(_ACTIVATIONS)}")
    ours = _ACTIVATIONS[name]
    return None if ours == _DEFAULT_ACTIVATION[family] else ours


def _rope_settings(cfg) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling) from either transformers 5's `rope_parameters` dict or the older
    `rope_theta` + `rope_scaling` attributes."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        params = dict(params)
        if any(isinstance(v, Mapping) for v in params.values()):
            raise CheckpointError(f"per-layer rope_parameters are not supported: {params}")
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
        scaling = params
    else:
        theta = getattr(cfg, "rope_theta", None) or 10000.0
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"unsupported partial_rotary_factor={partial} (only full rotary "
                              f"embeddings are supported)")
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), (("factor", float(scaling["factor"])), ("rope_type", "linear"))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise CheckpointError(f"llama3 rope scaling is missing {missing}")
        pairs = tuple((k, float(scaling[k])) for k in keys) + (("rope_type", "llama3"),)
        return float(theta), tuple(sorted(pairs))
    raise CheckpointError(f"unsupported rope type {kind!r}; supported: default, linear, llama3")


def config_from_hf(hf_config: Mapping[str, Any] | Any) -> ModelConfig:
    """A config.json dict (or a transformers PretrainedConfig) -> our ModelConfig.

    Raises CheckpointError naming any option ppo_jax would silently compute differently.
    """
    data = _as_dict(hf_config)
    checkpoint_kind(data)  # validates `architectures`
    cfg = _hf_config_object(hf_config)
    arch = cfg.model_type
    common = dict(
        arch=arch, vocab_size=cfg.vocab_size,
        bos_token_id=_token_id(getattr(cfg, "bos_token_id", None)),
        eos_token_id=_token_id(getattr(cfg, "eos_token_id", None)),
        pad_token_id=_token_id(getattr(cfg, "pad_token_id", None)),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
    )
    if arch == "gpt2":
        problems = {name: getattr(cfg, name, default) for name, default in (
            ("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
            ("add_cross_attention", False))}
        problems = {k: v for k, v in problems.items() if v}
        if not getattr(cfg, "scale_attn_weights", True):
            problems["scale_attn_weights"] = False
        if problems:
            raise CheckpointError(f"unsupported GPT-2 options: {problems}")
        return ModelConfig(
            **common, hidden_size=cfg.n_embd, num_layers=cfg.n_layer, num_heads=cfg.n_head,
            intermediate_size=cfg.n_inner, max_position_embeddings=cfg.n_positions,
            norm_eps=float(cfg.layer_norm_epsilon),
            activation=_activation(cfg.activation_function, "activation_function", "gpt2"))

    # Llama family.
    if getattr(cfg, "mlp_bias", False):
        raise CheckpointError("unsupported option mlp_bias=True (MLP projections with biases)")
    if arch == "llama" and getattr(cfg, "attention_bias", False):
        raise CheckpointError(
            "unsupported option attention_bias=True for llama (it adds an o_proj bias as well as "
            "q/k/v biases); only Qwen2-style q/k/v biases are supported")
    sliding_window = None
    if arch == "mistral":
        sliding_window = getattr(cfg, "sliding_window", None)
    elif arch == "qwen2":
        layer_types = list(getattr(cfg, "layer_types", None) or [])
        uses_window = getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
        if uses_window and not layer_types:  # transformers < 5: windows from max_window_layers on
            first = getattr(cfg, "max_window_layers", 0)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(cfg.num_hidden_layers)]
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise CheckpointError(f"unsupported layer_types {unknown}")
        if uses_window and "sliding_attention" in layer_types:
            if "full_attention" in layer_types:
                raise CheckpointError(
                    f"unsupported mix of sliding-window and full-attention layers "
                    f"(use_sliding_window=True, layer_types={layer_types}); all layers must be alike")
            sliding_window = cfg.sliding_window
    theta, scaling = _rope_settings(cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim == cfg.hidden_size // heads:
        head_dim = None
    return ModelConfig(
        **common, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
        attention_bias=arch == "qwen2", sliding_window=sliding_window,
        activation=_activation(cfg.hidden_act, "hidden_act", "llama"))


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def config_to_hf(config: ModelConfig, kind: str = "causal_lm"):
    """Our ModelConfig -> a transformers PretrainedConfig (with `architectures` set) for `kind`."""
    import transformers

    if kind not in KINDS:
        raise CheckpointError(f"kind must be one of {KINDS}, got {kind!r}")
    arch = config.arch
    common = dict(
        architectures=[_CLASS_FOR[(arch, kind)]], vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, tie_word_embeddings=config.tie_word_embeddings,
        dtype=_DTYPE_NAMES[np.dtype(config.jnp_param_dtype)],
    )
    if kind == "reward":
        common["num_labels"] = 1
    if arch == "gpt2":
        if config.head_dim not in (None, config.hidden_size // config.num_heads):
            raise CheckpointError(f"GPT-2 has no head_dim option; head_dim={config.head_dim} "
                                  f"differs from hidden_size // num_heads")
        if config.sliding_window is not None:
            raise CheckpointError("GPT-2 has no sliding window; set sliding_window=None")
        return transformers.GPT2Config(
            **common, n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_heads,
            n_inner=config.intermediate_size, n_positions=config.max_position_embeddings,
            layer_norm_epsilon=config.norm_eps, activation_function=config.act,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)

    if arch in ("llama", "mistral") and config.attention_bias:
        raise CheckpointError(
            f"{arch} cannot express q/k/v-only biases (attention_bias=True); use arch='qwen2'")
    if arch == "qwen2" and not config.attention_bias:
        raise CheckpointError("qwen2 always has q/k/v biases: set attention_bias=True")
    if arch == "llama" and config.sliding_window is not None:
        raise CheckpointError("llama has no sliding window; use arch='mistral' or 'qwen2'")
    family = dict(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.dim_per_head, intermediate_size=config.mlp_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_eps,
        hidden_act=config.act, attention_dropout=0.0)
    scaling = config.rope_scaling_dict
    if scaling is not None:
        scaling.setdefault("rope_type", "llama3")  # what transformer.rope_inverse_frequencies assumes
        if "original_max_position_embeddings" in scaling:  # transformers validates it as an int
            scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if _transformers_major() >= 5:
        family["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta,
                                     **(scaling or {})}
    else:
        family["rope_theta"] = config.rope_theta
        family["rope_scaling"] = scaling
    if arch == "mistral":
        family["sliding_window"] = config.sliding_window
    if arch == "qwen2":
        window = config.sliding_window
        family.update(use_sliding_window=window is not None, sliding_window=window,
                      max_window_layers=0 if window is not None else config.num_layers,
                      layer_types=[("sliding_attention" if window else "full_attention")]
                      * config.num_layers)
    if arch == "llama":
        family.update(attention_bias=False, mlp_bias=False)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[arch]
    return cls(**common, **family)


# ============================================================================================
# Parameter <-> tensor mapping.


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters as a window of one Hugging Face tensor.

    name:     the HF tensor name; "{layer}" stands for the layer index of a stacked (scanned) param,
              whose leading L axis is then assembled from L tensors.
    hf_shape: the full shape the HF tensor must have.
    start:    per HF axis, where the window begins (GPT-2's c_attn packs q, k, v side by side).
    split:    per HF axis, the sub-axes that axis splits into (their product is the window's size).
    perm:     our (per-layer) axes as a permutation of the flattened sub-axes.
    zeros:    no HF tensor: the param (of shape hf_shape) is all zeros on load (the score bias) and
              must be zero on export.
    """

    name: str
    hf_shape: tuple[int, ...]
    start: tuple[int, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    zeros: bool = False

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.name

    def layer_name(self, layer: int | None) -> str:
        return self.name.format(layer=layer) if self.stacked else self.name

    @property
    def our_shape(self) -> tuple[int, ...]:
        if self.zeros:
            return self.hf_shape
        flat = [d for sub in self.split for d in sub]
        return tuple(flat[p] for p in self.perm)


def _window(name, hf_shape, split, perm, start=None) -> TensorMap:
    start = start if start is not None else (0,) * len(hf_shape)
    return TensorMap(name, tuple(hf_shape), tuple(start), tuple(tuple(s) for s in split), tuple(perm))


def _same(name, shape) -> TensorMap:
    """Tensor stored exactly as we store it."""
    return _window(name, shape, [(d,) for d in shape], range(len(shape)))


def _transposed(name, out_dim, in_dim) -> TensorMap:
    """torch Linear weight [out, in] -> our kernel [in, out]."""
    return _window(name, (out_dim, in_dim), [(out_dim,), (in_dim,)], (1, 0))


def _zeros(shape) -> TensorMap:
    return TensorMap("", tuple(shape), (), (), tuple(range(len(shape))), zeros=True)


def _gpt2_maps(cfg: ModelConfig, prefix: str) -> dict[tuple[str, ...], TensorMap]:
    d, h, dh, f, v = cfg.hidden_size, cfg.num_heads, cfg.dim_per_head, cfg.mlp_dim, cfg.vocab_size
    layer = f"{prefix}h.{{layer}}."
    maps = {
        ("transformer", "embed", "embedding"): _same(f"{prefix}wte.weight", (v, d)),
        ("transformer", "pos_embed", "embedding"): _same(
            f"{prefix}wpe.weight", (cfg.max_position_embeddings, d)),
        ("transformer", "ln_f", "scale"): _same(f"{prefix}ln_f.weight", (d,)),
        ("transformer", "ln_f", "bias"): _same(f"{prefix}ln_f.bias", (d,)),
        # Conv1D weights are [in, out]: q, k, v are windows of c_attn's output axis.
        ("layers", "attn", "o", "kernel"): _window(
            layer + "attn.c_proj.weight", (h * dh, d), [(h, dh), (d,)], (0, 1, 2)),
        ("layers", "attn", "o", "bias"): _same(layer + "attn.c_proj.bias", (d,)),
        ("layers", "mlp", "fc", "kernel"): _same(layer + "mlp.c_fc.weight", (d, f)),
        ("layers", "mlp", "fc", "bias"): _same(layer + "mlp.c_fc.bias", (f,)),
        ("layers", "mlp", "proj", "kernel"): _same(layer + "mlp.c_proj.weight", (f, d)),
        ("layers", "mlp", "proj", "bias"): _same(layer + "mlp.c_proj.bias", (d,)),
    }
    for i, part in enumerate("qkv"):
        maps[("layers", "attn", part, "kernel")] = _window(
            layer + "attn.c_attn.weight", (d, 3 * h * dh), [(d,), (h, dh)], (0, 1, 2),
            start=(0, i * h * dh))
        maps[("layers", "attn", part, "bias")] = _window(
            layer + "attn.c_attn.bias", (3 * h * dh,), [(h, dh)], (0, 1), start=(i * h * dh,))
    for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
        maps[("layers", ours, "scale")] = _same(layer + f"{theirs}.weight", (d,))
        maps[("layers", ours, "bias")] = _same(layer + f"{theirs}.bias", (d,))
    return maps


def _llama_maps(cfg: ModelConfig, prefix: str) -> dict[tuple[str, ...], TensorMap]:
    d, h, k, dh, f = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.mlp_dim
    layer = f"{prefix}layers.{{layer}}."
    maps = {
        ("transformer", "embed", "embedding"): _same(f"{prefix}embed_tokens.weight",
                                                     (cfg.vocab_size, d)),
        ("transformer", "ln_f", "scale"): _same(f"{prefix}norm.weight", (d,)),
        ("layers", "ln_1", "scale"): _same(layer + "input_layernorm.weight", (d,)),
        ("layers", "ln_2", "scale"): _same(layer + "post_attention_layernorm.weight", (d,)),
        # torch Linear [out, in]: q_proj [H*Dh, D] -> our [D, H, Dh]; o_proj [D, H*Dh] -> [H, Dh, D].
        ("layers", "attn", "o", "kernel"): _window(
            layer + "self_attn.o_proj.weight", (d, h * dh), [(d,), (h, dh)], (1, 2, 0)),
        ("layers", "mlp", "gate", "kernel"): _transposed(layer + "mlp.gate_proj.weight", f, d),
        ("layers", "mlp", "up", "kernel"): _transposed(layer + "mlp.up_proj.weight", f, d),
        ("layers", "mlp", "down", "kernel"): _transposed(layer + "mlp.down_proj.weight", d, f),
    }
    for part, heads in (("q", h), ("k", k), ("v", k)):
        maps[("layers", "attn", part, "kernel")] = _window(
            layer + f"self_attn.{part}_proj.weight", (heads * dh, d), [(heads, dh), (d,)], (2, 0, 1))
        if cfg.attention_bias:
            maps[("layers", "attn", part, "bias")] = _window(
                layer + f"self_attn.{part}_proj.bias", (heads * dh,), [(heads, dh)], (0, 1))
    return maps


_PREFIXES = {"gpt2": ("transformer.", ""), "llama": ("model.", "")}
_EMBED_NAME = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}


def tensor_maps(config: ModelConfig, kind: str, prefix: str | None = None
                ) -> dict[tuple[str, ...], TensorMap]:
    """Our param path (tuple of keys) -> TensorMap, for every param of the model of `kind`.

    `prefix` is the backbone's name prefix in the checkpoint ("transformer." / "model." as
    transformers writes them; "" for checkpoints saved from the bare backbone, like the original
    gpt2 upload).
    """
    family = config.family
    prefix = _PREFIXES[family][0] if prefix is None else prefix
    backbone = (_gpt2_maps if family == "gpt2" else _llama_maps)(config, prefix)
    maps = {(("transformer",) + path if path[0] == "layers" else path): m
            for path, m in backbone.items()}
    d, v = config.hidden_size, config.vocab_size
    if kind == "reward":
        maps[("score", "kernel")] = _transposed("score.weight", 1, d)
        maps[("score", "bias")] = _zeros((1,))
    elif not config.tie_word_embeddings:
        maps[("lm_head", "kernel")] = _transposed("lm_head.weight", v, d)
    return maps


def make_model(config: ModelConfig, kind: str) -> nn.Module:
    """The Flax module for a checkpoint kind: CausalLM or ScalarModel."""
    if kind not in KINDS:
        raise CheckpointError(f"kind must be one of {KINDS}, got {kind!r}")
    return CausalLM(config) if kind == "causal_lm" else ScalarModel(config)


def abstract_params(config: ModelConfig, kind: str) -> Any:
    """Boxed abstract param tree (shapes, dtypes, logical axis names) of the model; no allocation."""
    model = make_model(config, kind)
    tokens = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens,
                                             positions_from_mask(mask), mask)["params"])


def _path_keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", p)) for p in path)


def _check_maps_cover(abstract: Any, maps: Mapping[tuple[str, ...], TensorMap], num_layers: int):
    """Internal consistency: the table names exactly our params, with their shapes."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    ours = {}
    for path, leaf in leaves:
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        ours[_path_keys(path)] = tuple(value.shape)
    if set(ours) != set(maps):
        raise AssertionError(f"HF tensor table out of sync with the model: only in model "
                             f"{sorted(set(ours) - set(maps))}, only in table {sorted(set(maps) - set(ours))}")
    for path, m in maps.items():
        want = ((num_layers,) if m.stacked else ()) + m.our_shape
        if ours[path] != want:
            raise AssertionError(f"HF tensor table gives {path} shape {want}, model has {ours[path]}")


# ============================================================================================
# Reading safetensors.


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the data in the file


class _TensorStore:
    """Every tensor of a checkpoint: name -> where its bytes are, read through memory maps.

    safetensors' own reader validates each file (and names what is wrong with it); data is then
    read through NumPy memory maps, which also handle bfloat16 (safetensors' NumPy reader does not).
    """

    def __init__(self, files: Sequence[Path]):
        from safetensors import safe_open

        self.tensors: dict[str, _StoredTensor] = {}
        self._maps: dict[Path, np.memmap] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="numpy"):
                    pass
            except Exception as err:  # SafetensorError, OSError
                raise CheckpointError(
                    f"{file} is not a readable safetensors file (truncated or corrupt?): {err}") from err
            with open(file, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            header.pop("__metadata__", None)
            for name, info in header.items():
                code = info["dtype"]
                if code not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name} has dtype {code}; supported: "
                        f"{sorted(_SAFETENSORS_DTYPES)}")
                self.tensors[name] = _StoredTensor(file, _SAFETENSORS_DTYPES[code],
                                                   tuple(info["shape"]),
                                                   8 + header_len + info["data_offsets"][0])

    def array(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of the whole tensor (reading it touches only what is sliced)."""
        t = self.tensors[name]
        if t.file not in self._maps:
            self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        count = math.prod(t.shape)
        raw = self._maps[t.file][t.offset:t.offset + count * t.dtype.itemsize]
        return raw.view(t.dtype).reshape(t.shape)

    def close(self):
        self._maps.clear()


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (index first, then the single file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a "
                                  f"'weight_map'): {err}") from err
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} in {path} lists shard files that do not exist: "
                                  f"{missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if len(others) == 1:
        return others
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{path} has no model.safetensors, only pickled weights ({', '.join(pickles)}); "
            f"ppo_jax reads safetensors only and never unpickles files. Convert the checkpoint "
            f"with transformers: model.save_pretrained(dir, safe_serialization=True)")
    raise CheckpointError(
        f"{path} has no weights: expected model.safetensors or model.safetensors.index.json")


def _read_config_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory (expected a Hugging Face "
                              f"checkpoint directory with config.json and safetensors weights)")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json; a Hugging Face checkpoint directory "
                              f"needs config.json next to its safetensors weights")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file} is not valid JSON: {err}") from err


def _slice_bounds(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _read_window(store: _TensorStore, m: TensorMap, name: str, bounds) -> np.ndarray:
    """The part `bounds` (per our per-layer axis: (start, stop)) of one layer's param.

    Reads only the HF rows/columns needed when the slice is contiguous in the HF layout (always
    the case under the default rules, which never split head_dim), else the whole window.
    """
    sub_bounds: list[tuple[int, int] | None] = [None] * len(m.perm)
    for our_axis, flat_axis in enumerate(m.perm):
        sub_bounds[flat_axis] = bounds[our_axis]
    hf_index, read_shape, post = [], [], []
    flat = 0
    for axis, sub in enumerate(m.split):
        parts = sub_bounds[flat:flat + len(sub)]
        inner = math.prod(sub[1:])
        begin = m.start[axis]
        if all(parts[j] == (0, sub[j]) for j in range(1, len(sub))):
            lo, hi = parts[0]
            hf_index.append(slice(begin + lo * inner, begin + hi * inner))
            read_shape += [hi - lo, *sub[1:]]
            post += [slice(None)] * len(sub)
        else:
            hf_index.append(slice(begin, begin + math.prod(sub)))
            read_shape += list(sub)
            post += [slice(lo, hi) for lo, hi in parts]
        flat += len(sub)
    block = np.asarray(store.array(name)[tuple(hf_index)])
    return block.reshape(read_shape)[tuple(post)].transpose(m.perm)


def _shard_reader(store: _TensorStore, m: TensorMap, shape: tuple[int, ...], dtype) -> Callable:
    """Callback for jax.make_array_from_callback: global index -> that shard as a host array."""
    cache: dict[Any, np.ndarray] = {}  # replicated shards are read once, not once per device

    def read(index: tuple[slice, ...]) -> np.ndarray:
        bounds = _slice_bounds(index, shape)
        if bounds in cache:
            return cache[bounds]
        if m.zeros:
            out = np.zeros([hi - lo for lo, hi in bounds], dtype)
        elif m.stacked:
            (first, last), rest = bounds[0], bounds[1:]
            out = np.stack([_read_window(store, m, m.layer_name(i), rest).astype(dtype)
                            for i in range(first, last)])
        else:
            out = _read_window(store, m, m.name, bounds).astype(dtype)
        cache[bounds] = out
        return out

    return read


def _find_prefix(store: _TensorStore, config: ModelConfig) -> str:
    for prefix in _PREFIXES[config.family]:
        if prefix + _EMBED_NAME[config.family] in store.tensors:
            return prefix
    return _PREFIXES[config.family][0]  # the missing-tensor check names the canonical name


def _validate_tensors(store: _TensorStore, maps: Mapping[tuple[str, ...], TensorMap],
                      config: ModelConfig, path: Path):
    """Every tensor present with the shape config.json implies; nothing left unused."""
    needed: dict[str, tuple[int, ...]] = {}
    for m in maps.values():
        if m.zeros:
            continue
        for layer in (range(config.num_layers) if m.stacked else [None]):
            needed[m.layer_name(layer)] = m.hf_shape
    for name, want in needed.items():
        if name not in store.tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path}")
        got = store.tensors[name].shape
        if got != want:
            raise CheckpointError(
                f"shape mismatch: tensor {name!r} in {store.tensors[name].file.name} has shape "
                f"{list(got)}, but config.json implies {list(want)}")
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unused = sorted(n for n in store.tensors
                    if n not in needed and n not in tied_head and not _BUFFER_PATTERN.search(n))
    if unused:
        shown = ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "")
        raise CheckpointError(
            f"checkpoint in {path} has {len(unused)} tensors that config.json does not use "
            f"({shown}); config.json does not describe these weights")


@flax.struct.dataclass
class LoadedModel:
    """A checkpoint loaded onto a mesh.

    config: our ModelConfig; params: plain param tree, each array on its target NamedSharding;
    kind: "causal_lm" (CausalLM, logits) or "reward" (ScalarModel, scores).
    """

    config: ModelConfig = flax.struct.field(pytree_node=False)
    params: Any
    kind: str = flax.struct.field(pytree_node=False, default="causal_lm")

    @property
    def module(self) -> nn.Module:
        return make_model(self.config, self.kind)


def load_config(path: str | os.PathLike) -> tuple[ModelConfig, str]:
    """(ModelConfig, kind) of a checkpoint directory, from its config.json alone."""
    data = _read_config_json(Path(path))
    return config_from_hf(data), checkpoint_kind(data)


def fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """Identifies a checkpoint without reading its tensors: config.json's hash and each weight
    file's size and safetensors-header hash (the header lists every tensor's dtype, shape and
    byte offsets). Recorded in PPO checkpoints so a resume is refused against a different model."""
    import hashlib

    path = Path(path)
    out: dict[str, Any] = {"config": hashlib.sha256((path / "config.json").read_bytes()).hexdigest()}
    for f in _weight_files(path):
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = fh.read(min(header_len, 100_000_000))
        out[f.name] = {"bytes": f.stat().st_size, "header_sha256": hashlib.sha256(header).hexdigest()}
    return out


def load_model(path: str | os.PathLike, mesh: jax.sharding.Mesh, rules=sharding.DEFAULT_RULES, *,
               param_dtype: str | None = None, dtype: str | None = None,
               kind: str | None = None) -> LoadedModel:
    """Loads a local Hugging Face checkpoint directory onto `mesh`.

    Each device reads only its own shard of each tensor (straight from a memory map of the
    safetensors file), so a model that does not fit on one device still loads. Everything is
    validated (files, architecture, tensor names and shapes) before any device memory is used.

    param_dtype / dtype: parameter and compute dtypes (default float32 for both; a bf16 checkpoint
    is upcast unless param_dtype="bfloat16"). kind: defaults to what config.json's architectures
    say; a mismatch raises.
    """
    path = Path(path)
    data = _read_config_json(path)
    found_kind = checkpoint_kind(data)
    if kind is not None and kind != found_kind:
        raise CheckpointError(f"{path} holds a {found_kind} checkpoint "
                              f"({data.get('architectures')}), but kind={kind!r} was requested")
    config = config_from_hf(data)
    overrides = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v is not None}
    config = config.replace(**overrides)
    store = _TensorStore(_weight_files(path))
    try:
        maps = tensor_maps(config, found_kind, _find_prefix(store, config))
        abstract = abstract_params(config, found_kind)
        _check_maps_cover(abstract, maps, config.num_layers)
        _validate_tensors(store, maps, config, path)
        shardings = sharding.tree_shardings(abstract, mesh, rules)
        values = nn.unbox(abstract)
        target_dtype = np.dtype(config.jnp_param_dtype)

        def load_leaf(keypath, leaf, leaf_sharding):
            m = maps[_path_keys(keypath)]
            return jax.make_array_from_callback(
                leaf.shape, leaf_sharding, _shard_reader(store, m, leaf.shape, target_dtype))

        params = jax.tree_util.tree_map_with_path(load_leaf, values, shardings)
    finally:
        store.close()
    return LoadedModel(config=config, params=params, kind=found_kind)


# ============================================================================================
# Export.


def _to_host(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(sharding.to_host(x))


def _fold_score_bias(config: ModelConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """Hugging Face's score head has no bias. GPT-2's final LayerNorm has one, and the score is
    linear in it: adding delta = b * w / |w|^2 to ln_f's bias adds exactly b to every score. The
    Llama family (RMSNorm, no bias anywhere) has nowhere to put it, so a nonzero bias is an error."""
    bias = _to_host(params["score"]["bias"]).astype(np.float64)
    if not np.any(bias):
        return dict(params)
    if config.family != "gpt2":
        raise CheckpointError(
            f"score bias is {bias.tolist()}, but {config.arch} ForSequenceClassification has no "
            f"score bias and no final-norm bias to fold it into; train the reward head with a zero "
            f"bias (or apply the offset outside the model) before exporting")
    w = _to_host(params["score"]["kernel"]).astype(np.float64)[:, 0]
    transformer = dict(params["transformer"])
    ln_f = dict(transformer["ln_f"])
    old = _to_host(ln_f["bias"])
    ln_f["bias"] = (old.astype(np.float64) + bias[0] * w / np.dot(w, w)).astype(old.dtype)
    transformer["ln_f"] = ln_f
    score = {"kernel": params["score"]["kernel"], "bias": np.zeros_like(bias, dtype=old.dtype)}
    return {**params, "transformer": transformer, "score": score}


def _header(entries: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int]]:
    """safetensors header for tensors in write order; returns (header bytes, name -> data offset)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, position = {}, 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape),
                        "data_offsets": [position, position + size]}
        offsets[name] = position
        position += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, offsets


@dataclasses.dataclass(frozen=True)
class _ExportGroup:
    """One HF tensor name (per layer when stacked) and the params of ours that fill it."""

    maps: tuple[tuple[tuple[str, ...], TensorMap], ...]
    dtype: np.dtype

    @property
    def first(self) -> TensorMap:
        return self.maps[0][1]

    def names(self, num_layers: int) -> list[str]:
        m = self.first
        return [m.layer_name(i) for i in (range(num_layers) if m.stacked else [None])]


def _export_groups(config: ModelConfig, flat: Mapping[tuple[str, ...], Any], kind: str
                   ) -> list[_ExportGroup]:
    maps = tensor_maps(config, kind)
    missing = sorted(set(maps) - set(flat))
    if missing:
        raise CheckpointError(f"params lack {['/'.join(p) for p in missing]}, which a {kind} "
                              f"{config.arch} model needs")
    by_name: dict[str, list[tuple[tuple[str, ...], TensorMap]]] = {}
    for path, m in maps.items():
        if m.zeros:
            if np.any(_to_host(flat[path])):
                raise CheckpointError(f"param {'/'.join(path)} must be zero to export")
            continue
        by_name.setdefault(m.name, []).append((path, m))
    return [_ExportGroup(tuple(parts), np.result_type(*[np.dtype(flat[p].dtype) for p, _ in parts]))
            for parts in by_name.values()]


def _group_tensors(group: _ExportGroup, flat: Mapping[tuple[str, ...], Any], num_layers: int
                   ) -> list[tuple[str, np.ndarray]]:
    """The HF tensors of one group, built from our params gathered to host (collective)."""
    host = {path: _to_host(flat[path]) for path, _ in group.maps}
    out = []
    for layer, name in zip(range(num_layers), group.names(num_layers)):
        tensor = np.zeros(group.first.hf_shape, group.dtype)
        for path, m in group.maps:
            ours = host[path][layer] if m.stacked else host[path]
            block = ours.transpose(np.argsort(m.perm)).reshape([math.prod(s) for s in m.split])
            tensor[tuple(slice(b, b + n) for b, n in zip(m.start, block.shape))] = block
        out.append((name, tensor))
    return out


def export_model(out_dir: str | os.PathLike, config: ModelConfig, params: Any, *,
                 kind: str = "causal_lm", tokenizer=None) -> Path:
    """Writes `params` as a Hugging Face checkpoint directory (config.json, model.safetensors and,
    when given, the tokenizer) that transformers' AutoModelForCausalLM / AutoModelForSequence-
    Classification loads. Written to a temporary directory beside `out_dir` and renamed at the
    end, so `out_dir` is never half-written; an existing `out_dir` is replaced.

    Tensors are written in the params' dtype, one group of params gathered to host at a time.
    Every process must call this (gathering is collective); process 0 writes.
    """
    if kind not in KINDS:
        raise CheckpointError(f"kind must be one of {KINDS}, got {kind!r}")
    out_dir = Path(out_dir)
    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(params)}
    unsupported = dtypes - set(_DTYPE_CODES)
    if unsupported:
        raise CheckpointError(f"cannot export params of dtype {sorted(map(str, unsupported))}")
    if dtypes:
        config = config.replace(param_dtype=_DTYPE_NAMES[max(dtypes, key=lambda d: d.itemsize)])
    hf_config = config_to_hf(config, kind)  # fails early, before anything is written
    if kind == "reward":
        params = _fold_score_bias(config, params)
    flat = {_path_keys(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    groups = _export_groups(config, flat, kind)
    writer = jax.process_index() == 0
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if writer:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            entries = [(name, g.dtype, g.first.hf_shape)
                       for g in groups for name in g.names(config.num_layers)]
            header, offsets = _header(entries)
            with open(tmp / "model.safetensors", "wb") as fh:
                fh.write(header)
                for group in groups:
                    for name, tensor in _group_tensors(group, flat, config.num_layers):
                        assert fh.tell() - len(header) == offsets[name], name
                        # safetensors is little-endian, as is every platform JAX runs on.
                        fh.write(np.ascontiguousarray(tensor).tobytes())
            hf_config.save_pretrained(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            _replace_dir(tmp, out_dir)
        else:
            for group in groups:  # take part in the collective gathers
                _group_tensors(group, flat, config.num_layers)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"ppo_jax export {out_dir}")
    return out_dir


def _replace_dir(tmp: Path, out_dir: Path):
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ============================================================================================
# Tokenizer.


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a checkpoint directory (local files only, never remote code)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"tokenizer directory {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=False)
    except Exception as err:
        raise CheckpointError(f"cannot load a tokenizer from {path}: {err}") from err


__all__ = [
    "ARCHITECTURES", "CheckpointError", "LoadedModel", "TensorMap", "abstract_params",
    "checkpoint_kind", "config_from_hf", "config_to_hf", "export_model", "load_config",
    "load_model", "load_tokenizer", "make_model", "tensor_maps",
]


def save_tokenizer(tokenizer, directory: str) -> None:
    """`save_pretrained` into a local or remote (gs://) directory."""
    if "://" not in directory:
        tokenizer.save_pretrained(directory)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        target = epath.Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(tmp):
            (target / f).write_bytes(open(os.path.join(tmp, f), "rb").read())
