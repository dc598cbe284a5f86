"""Rope settings: a Hugging Face config's rope parameters (transformers 5's `rope_parameters`, or
transformers 4's `rope_theta` + `rope_scaling`) <-> ModelConfig's rope_theta / rope_scaling /
rope_local_theta. Each scaling's fields are kept as transformers names them, so an export writes back
what was read; models/rope.py computes with them, and ModelConfig checks they are complete."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.hf.errors import CheckpointError

RopeScaling = tuple[tuple[str, Any], ...]


def rope_from_hf(cfg) -> tuple[float, RopeScaling | None]:
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
    return _rope_from(theta, scaling, cfg)


def gemma3_rope_from_hf(cfg) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's per-layer-type rope: (rope_theta, rope_scaling) of its full-attention layers and
    the base of its sliding layers (`rope_local_base_freq`), whose rope is never scaled."""
    params = {name: dict(value) for name, value in dict(cfg.rope_parameters).items()}
    local = params["sliding_attention"]
    kind = local.get("rope_type", "default")
    if kind != "default":
        raise CheckpointError(f"unsupported rope type {kind!r} on gemma3 sliding layers (their rope "
                              f"must be default)")
    full = params["full_attention"]
    return (*_rope_from(full["rope_theta"], full, cfg), float(local["rope_theta"]))


# The fields of each rope scaling we carry (beyond rope_type); transformers' defaults fill the rest.
_ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor",
                 "attention_factor"),
}


def _rope_from(theta, scaling: Mapping[str, Any], cfg) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) of one rope parameter dict; unsupported kinds refused by name."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"unsupported partial_rotary_factor={partial} (only full rotary "
                              f"embeddings are supported)")
    if kind == "default":
        return float(theta), None
    if kind not in _ROPE_FIELDS:
        raise CheckpointError(f"unsupported rope type {kind!r}; supported: default, {', '.join(_ROPE_FIELDS)}")
    if kind == "yarn" and scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
        # DeepSeek-style: the extension is max / original (what transformers computes then).
        scaling = {**scaling, "factor": cfg.max_position_embeddings / scaling["original_max_position_embeddings"]}
    pairs = {k: _rope_value(scaling[k]) for k in _ROPE_FIELDS[kind] if scaling.get(k) is not None}
    try:
        checked = ModelConfig(arch="llama", rope_scaling=tuple({**pairs, "rope_type": kind}.items()),
                              hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                              head_dim=getattr(cfg, "head_dim", None))
    except ValueError as e:
        raise CheckpointError(str(e).replace("model.rope_scaling: ", "rope_parameters: ")) from None
    return float(theta), checked.rope_scaling


def _rope_value(value):
    """A rope field as ModelConfig holds it: lists as tuples of floats, flags as bools, numbers as floats."""
    if isinstance(value, (list, tuple)):
        return tuple(float(x) for x in value)
    return value if isinstance(value, bool) else float(value)


def rope_to_hf(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our rope_scaling as transformers' rope parameters: lists for LongRoPE's factors, an int
    original length (transformers validates it as one)."""
    if scaling is None:
        return None
    scaling.setdefault("rope_type", "llama3")  # what models/rope.py assumes without a type
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
