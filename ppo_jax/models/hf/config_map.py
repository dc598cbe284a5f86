"""Config mapping: a Hugging Face config.json (or transformers PretrainedConfig) <-> our ModelConfig.

Per-family tables (architectures, activation names, dtype names) and the checks that refuse any
option ppo_jax would silently compute differently from PyTorch.

transformers is imported inside the functions that need it, not at the top: importing it (and the
torch its AutoConfig pulls in) takes seconds, and ppo_jax.rl / ppo_jax.supervised import this
package even for runs that never read or write a Hugging Face checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.hf import arch_options, moe_map, rope_map
from ppo_jax.models.hf.arch_options import ARCH_OPTIONS, EVERY_LAYER_SLIDES, NO_BIASES
from ppo_jax.models.hf.errors import HFModelError

# Checkpoint kinds: "causal_lm" (our CausalLM, logits) and "reward" (our ScalarModel, one score).
KINDS = ("causal_lm", "reward")

# Hugging Face class name -> (model_type, kind).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "GPT2LMHeadModel": ("gpt2", "causal_lm"),
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "MistralForCausalLM": ("mistral", "causal_lm"),
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen3ForCausalLM": ("qwen3", "causal_lm"),
    "Phi3ForCausalLM": ("phi3", "causal_lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "causal_lm"),
    "MixtralForCausalLM": ("mixtral", "causal_lm"),
    "GptOssForCausalLM": ("gpt_oss", "causal_lm"),
    "GemmaForCausalLM": ("gemma", "causal_lm"),
    "Gemma2ForCausalLM": ("gemma2", "causal_lm"),
    "Gemma3ForCausalLM": ("gemma3_text", "causal_lm"),
    "GPT2ForSequenceClassification": ("gpt2", "reward"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "MistralForSequenceClassification": ("mistral", "reward"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
    "Qwen3ForSequenceClassification": ("qwen3", "reward"),
    "Phi3ForSequenceClassification": ("phi3", "reward"),
    "Qwen3MoeForSequenceClassification": ("qwen3_moe", "reward"),
    "MixtralForSequenceClassification": ("mixtral", "reward"),
    "GptOssForSequenceClassification": ("gpt_oss", "reward"),
    "GemmaForSequenceClassification": ("gemma", "reward"),
    "Gemma2ForSequenceClassification": ("gemma2", "reward"),
    "Gemma3TextForSequenceClassification": ("gemma3_text", "reward"),
}
_CLASS_FOR = {value: name for name, value in ARCHITECTURES.items()}

# Activation names Hugging Face writes -> ours (ppo_jax.models.transformer.MLP).
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
                "relu": "relu", "silu": "silu", "swish": "silu"}
_DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "llama": "silu"}

# numpy dtype -> the name config.json (`dtype`) and our ModelConfig.param_dtype use for it.
DTYPE_NAMES = {np.dtype("<f8"): "float64", np.dtype("<f4"): "float32", np.dtype("<f2"): "float16",
               np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def _supported_list() -> str:
    return ", ".join(ARCHITECTURES)


def _model_types() -> list[str]:
    return list(dict.fromkeys(t for t, _ in ARCHITECTURES.values()))


def _as_dict(hf_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise HFModelError(f"expected a config.json dict or a transformers PretrainedConfig, got "
                          f"{type(hf_config).__name__}")


def _hf_config_object(hf_config: Mapping[str, Any] | Any):
    """A transformers config object, so that every key a config.json omits takes the same default
    the PyTorch model would use (Mistral's sliding_window, Llama's rms_norm_eps, ...)."""
    if not isinstance(hf_config, Mapping):
        return hf_config
    import transformers  # lazy: see the module docstring

    data = dict(hf_config)
    model_type = data.get("model_type")
    if model_type is None:
        raise HFModelError(f"config.json has no model_type (expected one of "
                              f"{', '.join(_model_types())})")
    if model_type not in _model_types():
        raise HFModelError(
            f"unsupported model_type {model_type!r} in config.json; supported architectures: "
            f"{_supported_list()}")
    data.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except Exception as err:  # transformers validates strictly; say which file and why.
        raise HFModelError(f"config.json is not a valid {model_type} config: {err}") from err


def checkpoint_kind(hf_config: Mapping[str, Any] | Any) -> str:
    """"causal_lm" or "reward", from config.json's `architectures` (causal_lm when absent)."""
    data = _as_dict(hf_config)
    names = data.get("architectures") or []
    if not names:
        return "causal_lm"
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        raise HFModelError(
            f"unsupported architecture {unknown[0]!r} in config.json; supported: {_supported_list()}")
    model_type = data.get("model_type")
    wrong = [n for n in names if model_type is not None and ARCHITECTURES[n][0] != model_type]
    if wrong:
        raise HFModelError(f"config.json says model_type={model_type!r} but architectures="
                              f"{names}; they must agree")
    kinds = {ARCHITECTURES[n][1] for n in names}
    if len(kinds) > 1:
        raise HFModelError(f"config.json names architectures of different kinds: {names}")
    kind = kinds.pop()
    if kind == "reward":
        labels = data.get("num_labels") or len(data.get("id2label") or {}) or 1
        if labels != 1:
            raise HFModelError(
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
        raise HFModelError(f"unsupported {field}={name!r}; supported: {sorted(_ACTIVATIONS)}")
    ours = _ACTIVATIONS[name]
    return None if ours == _DEFAULT_ACTIVATION[family] else ours


def _layer_windows(layer_types, window: int | None, num_layers: int
                   ) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, sliding_layers) of our config from HF `layer_types` and the window the
    sliding layers use (None: no layer slides)."""
    layer_types = list(layer_types or [])
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise HFModelError(f"unsupported layer_types {unknown}")
    if len(layer_types) != num_layers:
        raise HFModelError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    if window is None or not any(sliding):
        return None, None
    return int(window), (None if all(sliding) else sliding)


def _qwen_windows(cfg) -> tuple[int | None, tuple[bool, ...] | None]:
    """Qwen2/Qwen3: `layer_types` says which layers slide, and only with use_sliding_window."""
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", False) else None
    layer_types = getattr(cfg, "layer_types", None)
    if not layer_types:  # transformers < 5: windows from max_window_layers on
        first = getattr(cfg, "max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(cfg.num_hidden_layers)]
    return _layer_windows(layer_types, window, cfg.num_hidden_layers)


def _hf_layer_types(config: ModelConfig) -> list[str]:
    return ["sliding_attention" if s else "full_attention" for s in config.layer_sliding]


def config_from_hf(hf_config: Mapping[str, Any] | Any) -> ModelConfig:
    """A config.json dict (or a transformers PretrainedConfig) -> our ModelConfig.

    Raises HFModelError naming any option ppo_jax would silently compute differently.
    """
    data = _as_dict(hf_config)
    checkpoint_kind(data)  # validates `architectures`
    moe_map.check_quantization(data)
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
            raise HFModelError(f"unsupported GPT-2 options: {problems}")
        return ModelConfig(
            **common, hidden_size=cfg.n_embd, num_layers=cfg.n_layer, num_heads=cfg.n_head,
            intermediate_size=cfg.n_inner, max_position_embeddings=cfg.n_positions,
            norm_eps=float(cfg.layer_norm_epsilon),
            activation=_activation(cfg.activation_function, "activation_function", "gpt2"))

    # Llama family.
    sliding_window, sliding_layers = None, None
    if arch in EVERY_LAYER_SLIDES:  # (Qwen3-MoE's config already cleared it without use_sliding_window)
        sliding_window = getattr(cfg, "sliding_window", None)
    elif arch in ("qwen2", "qwen3"):
        sliding_window, sliding_layers = _qwen_windows(cfg)
    elif arch == "gpt_oss":
        sliding_window, sliding_layers = _layer_windows(cfg.layer_types, cfg.sliding_window, cfg.num_hidden_layers)
    theta, scaling = rope_map.rope_from_hf(cfg) if arch != "gemma3_text" else (None, None)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim == cfg.hidden_size // heads:
        head_dim = None
    act_field = "hidden_activation" if arch in ("gemma2", "gemma3_text") else "hidden_act"
    fields = dict(
        **common, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
        sliding_window=sliding_window, sliding_layers=sliding_layers,
        **ARCH_OPTIONS.get(arch, {}),
        **arch_options.biases(cfg), **moe_map.moe_from_hf(cfg),
        activation=_activation(getattr(cfg, act_field), act_field, "llama"))
    if arch.startswith("gemma"):
        fields.update(_gemma_fields(cfg))
    return ModelConfig(**fields)


def _gemma_fields(cfg) -> dict[str, Any]:
    """What Gemma changes in the Llama block: scaled embeddings and (1 + w) norms (all three);
    post-attention/post-MLP norms, query_pre_attn_scalar, soft-capping and interleaved sliding
    layers (Gemma 2 and 3); q/k norms and a separate rope base for the sliding layers (Gemma 3)."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise HFModelError("unsupported option use_bidirectional_attention=True (ppo_jax models "
                              "are causal decoders)")
    fields = dict(scale_embeddings=True, norm_unit_offset=True)
    if cfg.model_type == "gemma":
        return fields
    window, sliding = _layer_windows(cfg.layer_types, cfg.sliding_window, cfg.num_hidden_layers)
    fields.update(
        post_norms=True, query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        attn_logit_softcap=_float_or_none(cfg.attn_logit_softcapping),
        final_logit_softcap=_float_or_none(cfg.final_logit_softcapping),
        sliding_window=window, sliding_layers=sliding)
    if cfg.model_type == "gemma3_text":
        theta, scaling, local_theta = rope_map.gemma3_rope_from_hf(cfg)
        if sliding is not None:
            fields.update(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)
        elif window is not None:  # every layer slides: only the local rope is used
            fields.update(rope_theta=local_theta, rope_scaling=None)
        else:
            fields.update(rope_theta=theta, rope_scaling=scaling)
        fields["qk_norm"] = True
    return fields


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _transformers_major() -> int:
    import transformers  # lazy: see the module docstring

    return int(transformers.__version__.split(".")[0])


def config_to_hf(config: ModelConfig, kind: str = "causal_lm"):
    """Our ModelConfig -> a transformers PretrainedConfig (with `architectures` set) for `kind`."""
    import transformers  # lazy: see the module docstring

    if kind not in KINDS:
        raise HFModelError(f"kind must be one of {KINDS}, got {kind!r}")
    arch = config.arch
    common = dict(
        architectures=[_CLASS_FOR[(arch, kind)]], vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, tie_word_embeddings=config.tie_word_embeddings,
        dtype=DTYPE_NAMES[np.dtype(config.jnp_param_dtype)],
    )
    if kind == "reward":
        common["num_labels"] = 1
    if arch == "gpt2":
        if config.head_dim not in (None, config.hidden_size // config.num_heads):
            raise HFModelError(f"GPT-2 has no head_dim option; head_dim={config.head_dim} "
                                  f"differs from hidden_size // num_heads")
        if config.sliding_window is not None:
            raise HFModelError("GPT-2 has no sliding window; set sliding_window=None")
        return transformers.GPT2Config(
            **common, n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_heads,
            n_inner=config.intermediate_size, n_positions=config.max_position_embeddings,
            layer_norm_epsilon=config.norm_eps, activation_function=config.act,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)

    arch_options.check_biases(config)
    arch_options.check_options(config)
    if arch in ("llama", "gemma") and config.sliding_window is not None:
        raise HFModelError(f"{arch} has no sliding window; use arch='mistral' or 'qwen2'")
    if arch in EVERY_LAYER_SLIDES and config.sliding_layers is not None:
        raise HFModelError(f"{arch} slides every layer or none; use arch='qwen2' for "
                              f"sliding_layers")
    if arch == "phi3" and config.head_dim not in (None, config.hidden_size // config.num_heads):
        raise HFModelError(f"phi3 has no head_dim option; head_dim={config.head_dim} differs from "
                              f"hidden_size // num_heads")
    family = dict(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.dim_per_head, intermediate_size=config.mlp_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_eps,
        hidden_act=config.act, attention_dropout=0.0)
    scaling = rope_map.rope_to_hf(config.rope_scaling_dict)
    if _transformers_major() >= 5:
        family["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta,
                                     **(scaling or {})}
    else:
        family["rope_theta"] = config.rope_theta
        family["rope_scaling"] = scaling
    if arch in ("mistral", "phi3", "mixtral"):
        family["sliding_window"] = config.sliding_window
    if arch == "qwen3_moe":
        family.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window)
    if arch == "gpt_oss":
        family.update(sliding_window=config.sliding_window, layer_types=_hf_layer_types(config))
    if config.num_experts:
        family.update(moe_map.moe_to_hf(config))
    if arch == "phi3":  # its head size is always hidden_size // num_heads; dropouts off
        del family["head_dim"]
        family.update(resid_pdrop=0.0, embd_pdrop=0.0)
        if scaling and "original_max_position_embeddings" in scaling:
            # Phi3Config keeps this beside rope_parameters and overwrites theirs with it.
            family["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    if arch in ("qwen2", "qwen3"):
        window = config.sliding_window
        family.update(use_sliding_window=window is not None, sliding_window=window,
                      max_window_layers=(config.layer_sliding.index(True) if window
                                         else config.num_layers),
                      layer_types=_hf_layer_types(config))
    if arch == "llama":
        family.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    if arch not in ("llama", "qwen2") + NO_BIASES:
        family.update(attention_bias=config.attention_bias)
    if arch.startswith("gemma"):
        _gemma_to_hf(config, family)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "phi3": transformers.Phi3Config, "gemma": transformers.GemmaConfig,
           "gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "gpt_oss": transformers.GptOssConfig}[arch]
    return cls(**common, **family)


def _gemma_to_hf(config: ModelConfig, family: dict[str, Any]):
    """The Gemma keys of `family` (the Llama-family transformers config kwargs), in place."""
    if config.act == "gelu_new":  # the same tanh approximation, under the name Gemma configs use
        family["hidden_act"] = "gelu_pytorch_tanh"
    if config.arch == "gemma":
        return
    family["hidden_activation"] = family.pop("hidden_act")
    family.update(query_pre_attn_scalar=config.query_pre_attn_scalar or config.dim_per_head,
                  attn_logit_softcapping=config.attn_logit_softcap,
                  final_logit_softcapping=config.final_logit_softcap,
                  sliding_window=config.sliding_window, layer_types=_hf_layer_types(config))
    if config.arch == "gemma3_text":
        local_theta = config.rope_local_theta or config.rope_theta
        if "rope_parameters" not in family:  # transformers 4: one rope dict and the local base
            family["rope_local_base_freq"] = local_theta
            return
        full = family["rope_parameters"]
        every_layer_slides = config.sliding_layers is None and config.sliding_window is not None
        if every_layer_slides and full["rope_type"] != "default":
            raise HFModelError("gemma3 never scales the rope of its sliding layers, and every layer "
                                  "slides here: set rope_scaling=None")
        family["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": local_theta}}
