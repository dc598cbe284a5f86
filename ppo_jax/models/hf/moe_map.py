"""Mixture-of-experts settings: Qwen3-MoE's, Mixtral's and GPT-OSS's expert and router fields <->
ModelConfig's num_experts / experts_per_token / moe_intermediate_size / norm_topk_prob / swiglu_*
(models/moe.py computes with them; models/hf/layouts.py maps their tensors; the router and expert
kinds each architecture fixes are in arch_options.ARCH_OPTIONS)."""

from __future__ import annotations

from typing import Any

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.hf.errors import HFModelError


def moe_from_hf(cfg) -> dict[str, Any]:
    """Qwen3-MoE's, Mixtral's and GPT-OSS's experts and router (Qwen3-MoE's dense layers too);
    router noise refused."""
    if cfg.model_type == "qwen3_moe":
        return dict(num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                    moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=bool(cfg.norm_topk_prob),
                    moe_layers=_qwen3_moe_layers(cfg))
    if cfg.model_type == "mixtral":
        if getattr(cfg, "router_jitter_noise", 0.0):
            raise HFModelError(f"unsupported router_jitter_noise={cfg.router_jitter_noise} (training-time "
                                  f"noise on the router's input)")
        return dict(num_experts=cfg.num_local_experts, experts_per_token=cfg.num_experts_per_tok)
    if cfg.model_type == "gpt_oss":
        return dict(num_experts=cfg.num_local_experts, experts_per_token=cfg.num_experts_per_tok,
                    swiglu_limit=float(cfg.swiglu_limit), swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)))
    return {}


def _qwen3_moe_layers(cfg) -> tuple[bool, ...] | None:
    """ModelConfig.moe_layers as Qwen3MoeDecoderLayer chooses its MLP: layer i is an MoE layer unless
    it is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step; None when every
    layer is."""
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))
    if not any(layers):
        raise HFModelError(f"mlp_only_layers={sorted(dense)} and decoder_sparse_step={step} leave no MoE layer: "
                              f"this is a dense model; save it as a Qwen3ForCausalLM")
    return None if all(layers) else layers


def moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The expert fields of a Qwen3-MoE, Mixtral or GPT-OSS transformers config (only Qwen3-MoE's
    can mark dense layers: mlp_only_layers)."""
    if config.arch == "qwen3_moe":
        return dict(num_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
                    moe_intermediate_size=config.expert_mlp_dim, norm_topk_prob=config.norm_topk_prob,
                    mlp_only_layers=[i for i, moe in enumerate(config.layer_moe) if not moe],
                    decoder_sparse_step=1)
    if config.moe_layers is not None:
        raise HFModelError(f"{config.arch} has an MoE MLP in every layer; moe_layers={config.moe_layers} "
                              f"(dense layers) is expressible as qwen3_moe only")
    if config.moe_intermediate_size not in (None, config.mlp_dim):
        raise HFModelError(f"{config.arch}'s experts are intermediate_size wide; moe_intermediate_size="
                              f"{config.moe_intermediate_size} differs from intermediate_size={config.mlp_dim}")
    if not config.norm_topk_prob:  # (GPT-OSS's softmax over the top k sums to 1 by itself)
        raise HFModelError(f"{config.arch} always renormalises the top-k router weights: set norm_topk_prob=True")
    experts = dict(num_local_experts=config.num_experts, num_experts_per_tok=config.experts_per_token)
    if config.arch == "gpt_oss":
        return dict(experts, swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha)
    return dict(experts, router_jitter_noise=0.0)


def check_quantization(data: dict[str, Any]):
    """Refuses a quantised checkpoint (config.json's `quantization_config`): its tensors are packed
    blocks and scales, not weights. GPT-OSS's MXFP4 release is dequantised by transformers."""
    quant = data.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    hint = (" Dequantise it first: load it with transformers' `Mxfp4Config(dequantize=True)` as "
            "`quantization_config` and `save_pretrained` the bfloat16 model." if method == "mxfp4" else "")
    raise HFModelError(f"unsupported quantised checkpoint (quantization_config.quant_method={method!r}): "
                          f"ppo_jax loads float32/bfloat16/float16 weights.{hint}")
