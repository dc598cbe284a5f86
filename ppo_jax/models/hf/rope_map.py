"""Rope settings: a Hugging Face config's rope parameters (transformers 5's `rope_parameters`, or
transformers 4's `rope_theta` + `rope_scaling`) <-> ModelConfig's rope_theta / rope_scaling /
rope_local_theta. Each scaling's fields are kept as transformers names them, so an export writes back
what was read; models/rope.py computes with them, and ModelConfig checks they are complete."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_jax.models.config import ROPE_SCALING_KEYS, checked_rope_scaling
from ppo_jax.models.hf.errors import HFModelError

RopeScaling = tuple[tuple[str, Any], ...]


def rope_from_hf(cfg) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either transformers 5's `rope_parameters` dict or the older
    `rope_theta` + `rope_scaling` attributes."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        params = dict(params)
        if any(isinstance(v, Mapping) for v in params.values()):
            raise HFModelError(f"per-layer rope_parameters are not supported: {params}")
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
        raise HFModelError(f"unsupported rope type {kind!r} on gemma3 sliding layers (their rope "
                              f"must be default)")
    full = params["full_attention"]
    return (*_rope_from(full["rope_theta"], full, cfg), float(local["rope_theta"]))


# The optional fields of each rope scaling we carry besides the ones it needs (ROPE_SCALING_KEYS);
# transformers' defaults fill the rest.
_OPTIONAL_FIELDS = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("factor", "attention_factor"),
}


def _rope_from(theta, scaling: Mapping[str, Any], cfg) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) of one rope parameter dict; unsupported kinds refused by name."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise HFModelError(f"unsupported partial_rotary_factor={partial} (only full rotary "
                              f"embeddings are supported)")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_SCALING_KEYS:
        raise HFModelError(f"unsupported rope type {kind!r}; supported: default, {', '.join(ROPE_SCALING_KEYS)}")
    if kind == "yarn" and scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
        # DeepSeek-style: the extension is max / original (what transformers computes then).
        scaling = {**scaling, "factor": cfg.max_position_embeddings / scaling["original_max_position_embeddings"]}
    fields = ROPE_SCALING_KEYS[kind] + _OPTIONAL_FIELDS.get(kind, ())
    pairs = {k: _number(scaling[k]) for k in fields if scaling.get(k) is not None}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        return float(theta), checked_rope_scaling({**pairs, "rope_type": kind}, head_dim)
    except ValueError as e:
        raise HFModelError(str(e).replace("model.rope_scaling: ", "rope_parameters: ")) from None


def _number(value):
    """A rope field as ModelConfig holds it: numbers as floats (config.json may give ints); flags and
    LongRoPE's lists as they are (checked_rope_scaling makes the lists tuples of floats)."""
    return value if isinstance(value, (bool, list, tuple)) else float(value)


def rope_to_hf(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our rope_scaling as transformers' rope parameters: lists for LongRoPE's factors, an int
    original length (transformers validates it as one)."""
    if scaling is None:
        return None
    scaling.setdefault("rope_type", "llama3")  # what models/rope.py assumes without a type
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
