"""What each Llama-family architecture's transformers class can hold: which projections carry
biases, which block options it always or never has. config_map reads these when it maps a config
and checks them before it writes one, so no option is exported that PyTorch would compute otherwise."""

from __future__ import annotations

from ppo_jax.models.config import MOE_ARCHS, ModelConfig
from ppo_jax.models.hf.errors import HFModelError


def biases(cfg) -> dict[str, bool]:
    """Which projections carry biases. Qwen2 always has q/k/v biases and never an o_proj bias;
    Llama's and Qwen3's `attention_bias` put biases on q, k, v and o_proj alike, Llama's `mlp_bias`
    on gate/up/down."""
    if cfg.model_type == "qwen2":
        return dict(attention_bias=True)
    attention = bool(getattr(cfg, "attention_bias", False))
    return dict(attention_bias=attention, attention_out_bias=attention,
                mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def check_biases(config: ModelConfig):
    """Refuses bias combinations the architecture's transformers class cannot hold."""
    arch = config.arch
    qkv, out, mlp = config.attention_bias, config.attention_out_bias, config.mlp_bias
    if arch == "qwen2" and not (qkv and not out and not mlp):
        raise HFModelError("qwen2 always has q/k/v biases and no o_proj or MLP biases: set "
                              "attention_bias=True, attention_out_bias=False, mlp_bias=False")
    if arch in NO_BIASES and (qkv or out or mlp):
        raise HFModelError(f"{arch} has no projection biases; use arch='llama' (attention_bias, "
                              f"mlp_bias) or 'qwen2' (q/k/v biases)")
    if arch == "qwen2" or arch in NO_BIASES:
        return
    if qkv != out:
        raise HFModelError(
            f"{arch}'s attention_bias puts biases on q/k/v and o_proj together, but attention_bias="
            f"{qkv}, attention_out_bias={out}; use arch='qwen2' for q/k/v-only biases")
    if arch != "llama" and mlp:
        raise HFModelError(f"{arch} has no MLP biases; use arch='llama' for mlp_bias")


# Llama-family architectures whose sliding_window (when set) applies to every layer, and those whose
# transformers class has no projection biases at all.
EVERY_LAYER_SLIDES = ("mistral", "phi3", "mixtral", "qwen3_moe")
NO_BIASES = ("mistral", "phi3", "mixtral")

# Block options each Llama-family architecture fixes (its transformers class always or never has
# them: a config read from the architecture gets them, a config written as it must have them); the
# options not listed are off for every architecture but Gemma 2/3 (Gemma 3 alone has a local rope
# base).
_GEMMA = dict(scale_embeddings=True, norm_unit_offset=True)
ARCH_OPTIONS = {
    "qwen3": dict(qk_norm=True), "qwen3_moe": dict(qk_norm=True), "gemma": _GEMMA,
    "gemma2": dict(_GEMMA, post_norms=True), "gemma3_text": dict(_GEMMA, post_norms=True, qk_norm=True),
    "gpt_oss": dict(attention_sinks=True, router_softmax="topk", router_bias=True, expert_kind="clamped_swiglu",
                    norm_scale_float32=True)}
_FIXED_OFF = dict(qk_norm=False, scale_embeddings=False, norm_unit_offset=False, norm_scale_float32=False,
                  post_norms=False,
                  attention_sinks=False, router_softmax="all", router_bias=False, expert_kind="swiglu")
_GEMMA2_ONLY = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")


def check_options(config: ModelConfig):
    """Refuses block options the architecture's transformers class cannot hold."""
    arch = config.arch
    if bool(config.num_experts) != (arch in MOE_ARCHS):
        raise HFModelError(f"{arch} {'has no' if config.num_experts else 'needs'} experts; mixture-of-experts "
                              f"models are arch {' or '.join(repr(a) for a in MOE_ARCHS)}")
    want = {**_FIXED_OFF, **ARCH_OPTIONS.get(arch, {})}
    wrong = {name: getattr(config, name) for name, value in want.items() if getattr(config, name) != value}
    if wrong:
        raise HFModelError(f"{arch} cannot express {wrong}; it needs "
                              f"{ {name: want[name] for name in wrong} }")
    free = _GEMMA2_ONLY if arch in ("gemma2", "gemma3_text") else ()
    free += ("rope_local_theta",) if arch == "gemma3_text" else ()
    wrong = {name: getattr(config, name) for name in _GEMMA2_ONLY + ("rope_local_theta",)
             if name not in free and getattr(config, name) is not None}
    if wrong:
        raise HFModelError(f"{arch} has no {sorted(wrong)}; set them to None")
