"""Mixture-of-experts settings: Qwen3-MoE's and Mixtral's expert and router fields <-> ModelConfig's
num_experts / experts_per_token / moe_intermediate_size / norm_topk_prob (models/moe.py computes with
them; models/hf/layouts.py maps their tensors)."""

from __future__ import annotations

from typing import Any

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.hf.errors import CheckpointError


def moe_from_hf(cfg) -> dict[str, Any]:
    """Qwen3-MoE's and Mixtral's experts and router; mixed dense/MoE stacks and router noise refused."""
    if cfg.model_type == "qwen3_moe":
        dense = list(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1)
        if dense or step != 1:
            raise CheckpointError(f"unsupported mixed dense/MoE layers (mlp_only_layers={dense}, "
                                  f"decoder_sparse_step={step}): every layer must be an MoE layer")
        return dict(num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                    moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=bool(cfg.norm_topk_prob))
    if cfg.model_type == "mixtral":
        if getattr(cfg, "router_jitter_noise", 0.0):
            raise CheckpointError(f"unsupported router_jitter_noise={cfg.router_jitter_noise} (training-time "
                                  f"noise on the router's input)")
        return dict(num_experts=cfg.num_local_experts, experts_per_token=cfg.num_experts_per_tok)
    return {}


def moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The expert fields of a Qwen3-MoE or Mixtral transformers config."""
    if config.arch == "qwen3_moe":
        return dict(num_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
                    moe_intermediate_size=config.expert_mlp_dim, norm_topk_prob=config.norm_topk_prob,
                    mlp_only_layers=[], decoder_sparse_step=1)
    if config.moe_intermediate_size not in (None, config.mlp_dim):
        raise CheckpointError(f"mixtral's experts are intermediate_size wide; moe_intermediate_size="
                              f"{config.moe_intermediate_size} differs from intermediate_size={config.mlp_dim}")
    if not config.norm_topk_prob:
        raise CheckpointError("mixtral always renormalises the top-k router weights: set norm_topk_prob=True")
    return dict(num_local_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
                router_jitter_noise=0.0)
