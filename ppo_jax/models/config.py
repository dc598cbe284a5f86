"""Model configuration: one dataclass drives GPT-2 and the Llama family (Llama, Mistral, Qwen2,
Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3 text, and the mixtures of experts Qwen3-MoE, Mixtral, GPT-OSS)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from ppo_jax.models.lora_config import LoraConfig

FAMILIES = ("gpt2", "llama")
# Hugging Face `model_type` -> our family. Mistral and Qwen2 are Llama with options.
ARCH_TO_FAMILY = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama",
                  "qwen3": "llama", "phi3": "llama", "gemma": "llama", "gemma2": "llama",
                  "gemma3_text": "llama", "qwen3_moe": "llama", "mixtral": "llama", "gpt_oss": "llama"}
# Architectures whose MLP is a mixture of experts (models/moe.py): they need num_experts.
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
# `expert_kind`: the experts' MLP. "swiglu": act(x W_gate) * (x W_up) then W_down, no biases (Mixtral,
# Qwen3-MoE); "clamped_swiglu": GPT-OSS's, one interleaved gate/up projection with biases, the gate
# clamped above at swiglu_limit and the up projection to [-limit, limit], out = (up + 1) * gate *
# sigmoid(swiglu_alpha * gate), then W_down + bias.
EXPERT_KINDS = ("swiglu", "clamped_swiglu")
# `router_softmax`: "all": softmax over every expert's logit, then the top k (Mixtral, Qwen3-MoE);
# "topk": the top k logits, then a softmax over those k (GPT-OSS; its weights always sum to 1).
ROUTER_SOFTMAX = ("all", "topk")

# `attention`: how scores are computed. "einsum" is the reference (float32 scores, any platform);
# "cudnn" and "xla" call jax.nn.dot_product_attention with that implementation (cuDNN flash attention
# on GPU; "xla" exists to check the fused call's plumbing against the reference on CPU). That call
# cannot soft-cap scores: a model with `attn_logit_softcap` (Gemma 2) runs the einsum kernel whatever
# `attention` says; likewise a model with `attention_sinks` (GPT-OSS), which no fused kernel takes.
# "splash" is Pallas splash attention, the TPU's fused kernel (soft-capping
# included). Every kind applies without a cache only: cached prefill and decode run the einsum.
ATTENTION_KINDS = ("einsum", "cudnn", "xla", "splash")


def cudnn_head_dim(dim: int) -> bool:
    """Whether cuDNN's flash attention takes heads of `dim` features (at most 128, a multiple of 8;
    Gemma's 256 is refused: found by compiling Gemma-3-4B for H200s without one)."""
    return dim <= 128 and dim % 8 == 0
# `remat_policy`: which activations the backward pass keeps when remat is on.
REMAT_POLICIES = ("full", "dots")
# Rope scalings (models/rope.py) and the keys each needs; a rope_scaling without "rope_type" is
# Llama 3's (configs written before the others existed).
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
# Fields that choose how the model executes, never what it computes (free to change on load).
EXECUTION_FIELDS = ("attention", "scan_layers", "remat", "remat_policy", "merge_decode_projections_above")

_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
}


def to_dtype(name: str | Any) -> Any:
    """Maps a dtype name ('float32', 'bf16', ...) or a dtype to a jnp dtype."""
    if not isinstance(name, str):
        return jnp.dtype(name)
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    `arch` is the Hugging Face `model_type`; `family` follows from it and selects the block structure:
      gpt2:  learned positions, LayerNorm, GELU MLP, biases everywhere, tied embeddings.
      llama: RoPE, RMSNorm, gated MLP, grouped-query attention, and per-architecture options, each a
             field below (models/hf/config_map.py sets them from a checkpoint's config.json).

    What each architecture uses, every one matched against `transformers` in tests/test_hf.py:
      llama        Llama-3 / linear rope scaling; attention_bias (q/k/v and o: attention_out_bias),
                   mlp_bias
      mistral      sliding_window on every layer
      qwen2        q/k/v biases (attention_bias, no o bias); sliding_layers (layer_types)
      qwen3        qk_norm, explicit head_dim, sliding_layers, optional q/k/v/o biases
      phi3         fused qkv/gate_up projections (only the HF layout differs), sliding_window
      gemma        scale_embeddings, norm_unit_offset, GeGLU (activation "gelu_new": the tanh GELU)
      gemma2       + post_norms, query_pre_attn_scalar, attn_logit_softcap, final_logit_softcap,
                   sliding_layers
      gemma3_text  + qk_norm, rope_local_theta (the sliding layers' rope base), rope scaling on the
                   full-attention layers
      qwen3_moe    qk_norm, num_experts (top-k softmax router, norm_topk_prob), moe_intermediate_size
      mixtral      num_experts (renormalised top-k), sliding_window
      gpt_oss      num_experts with router_softmax="topk", router_bias, expert_kind="clamped_swiglu";
                   attention_sinks, q/k/v/o biases, sliding_layers, YaRN, norm_scale_float32
    """

    arch: str = "gpt2"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: same as num_heads (multi-head attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int | None = None  # None: 4 * hidden_size
    max_position_embeddings: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Rope scaling as transformers' rope_parameters name it: "rope_type" (linear, llama3, yarn,
    # dynamic, longrope; ROPE_SCALING_KEYS) and its fields ("factor", "original_max_position_embeddings",
    # YaRN's "beta_fast"/"beta_slow"/"mscale"/..., LongRoPE's "short_factor"/"long_factor" lists).
    # Sorted (key, value) pairs, lists as tuples, so the config stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v projection biases (Qwen2, Llama attention_bias); GPT-2 always has biases
    attention_out_bias: bool = False  # output projection bias (Llama attention_bias; Qwen2 has none)
    mlp_bias: bool = False  # gate/up/down projection biases (Llama mlp_bias)
    sliding_window: int | None = None  # Mistral: keys older than this many positions are masked
    # Which layers use sliding_window, when some do and some attend to every key (Qwen2 layer_types,
    # Gemma 2/3 interleaving); None: every layer alike.
    sliding_layers: tuple[bool, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before rope (Qwen3, Gemma 3)
    rope_local_theta: float | None = None  # rope base of the sliding layers, unscaled (Gemma 3)
    # Gemma: embeddings times sqrt(hidden_size) (in the compute dtype); RMSNorm scales by (1 + w), in
    # float32 before the cast back.
    scale_embeddings: bool = False
    norm_unit_offset: bool = False
    norm_scale_float32: bool = False  # RMSNorm times w in float32, then the cast back (GPT-OSS's order)
    post_norms: bool = False  # norms on the attention and MLP outputs before the residual add (Gemma 2/3)
    query_pre_attn_scalar: int | None = None  # scores scaled by its -1/2 power; None: head_dim's (Gemma 2/3)
    attn_logit_softcap: float | None = None  # scores -> c * tanh(scores / c) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # LM logits -> c * tanh(logits / c) (Gemma 2)
    # GPT-OSS: a learned logit per query head that joins every softmax over the keys (a "sink" key
    # with no value), so a head can attend to nothing.
    attention_sinks: bool = False
    activation: str | None = None  # None: "gelu_new" for gpt2, "silu" for llama
    # Mixture of experts (models/moe.py; Llama family): every layer's MLP is num_experts gated
    # experts of moe_intermediate_size (None: intermediate_size), each token routed to
    # experts_per_token of them by a softmax router; norm_topk_prob rescales the chosen weights to
    # sum to 1 (Mixtral: always; Qwen3-MoE: its config's flag). 0 experts: the dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    router_softmax: str = "all"  # ROUTER_SOFTMAX
    router_bias: bool = False  # a bias on the router's logits (GPT-OSS)
    expert_kind: str = "swiglu"  # EXPERT_KINDS
    # Which layers are MoE layers, when some keep the dense MLP (intermediate_size wide; Qwen3-MoE's
    # mlp_only_layers / decoder_sparse_step); None: every layer alike. Layers of two kinds cannot
    # share one scanned body, so such a model always runs per-layer params (scan_layers=False).
    moe_layers: tuple[bool, ...] | None = None
    swiglu_limit: float = 7.0  # clamped_swiglu only
    swiglu_alpha: float = 1.702  # clamped_swiglu only
    # Numerics and memory.
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls and activations
    # Execution: how the layers run, not what they compute (every choice gives the same function).
    attention: str = "einsum"  # "einsum" (reference, any platform), "cudnn" (flash attention, GPU, bf16/fp16), "xla", "splash" (TPU)
    scan_layers: bool = True  # True: one layer body scanned over stacked [L, ...] params; False: per-layer params
    remat: bool = False  # rematerialise each layer in the backward pass
    remat_policy: str = "full"  # with remat: "full" (save nothing) or "dots" (keep matmul outputs without batch dims)
    # A decode step runs the projections sharing its input (q/k/v, gate/up) as one GEMM when a kernel
    # holds more than this many bytes (layers.project_shared_input); 0: always; None: never.
    merge_decode_projections_above: int | None = None
    # Token ids the tokenizer uses (carried for export and sampling defaults).
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Low-rank adapters (models/lora.py): which projections may carry them; whether a forward uses
    # them is whether the "lora" collection is passed to `apply`. None (or rank 0): no adapters.
    lora: LoraConfig | None = None

    def __post_init__(self):
        if self.arch not in ARCH_TO_FAMILY:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {sorted(ARCH_TO_FAMILY)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads="
                f"{self.num_heads}; set model.head_dim explicitly"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.kv_heads}"
            )
        if self.family == "gpt2" and self.kv_heads != self.num_heads:
            raise ValueError("gpt2 has no grouped-query attention: leave num_kv_heads unset")
        to_dtype(self.param_dtype)
        to_dtype(self.dtype)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"model.attention={self.attention!r}: use one of {ATTENTION_KINDS}")
        if self.attention == "cudnn" and to_dtype(self.dtype) not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"model.attention='cudnn' (flash attention) computes in bfloat16 or float16, "
                             f"but model.dtype={self.dtype!r}; set dtype=bfloat16 or attention='einsum'")
        if self.attention == "cudnn" and not cudnn_head_dim(self.dim_per_head):
            raise ValueError(f"model.attention='cudnn': cuDNN flash attention takes heads of at most 128 features, a "
                             f"multiple of 8, but this model's are {self.dim_per_head}; use attention='einsum'")
        if self.sliding_layers is not None:
            # A tuple whatever a config file gave (a list): the config must stay hashable.
            object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
            if self.sliding_window is None:
                raise ValueError("model.sliding_layers needs model.sliding_window")
            if len(self.sliding_layers) != self.num_layers:
                raise ValueError(f"model.sliding_layers has {len(self.sliding_layers)} entries for "
                                 f"{self.num_layers} layers")
            if len(set(self.sliding_layers)) == 1:  # one spelling per model, so configs compare equal
                raise ValueError("model.sliding_layers marks every layer alike; use sliding_layers=None "
                                 "(with or without sliding_window) instead")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling, self.dim_per_head))
        if self.rope_local_theta is not None and self.sliding_layers is None:
            raise ValueError("model.rope_local_theta (the sliding layers' rope base) needs "
                             "model.sliding_layers; with every layer alike set rope_theta instead")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be positive or None, got {getattr(self, name)}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"model.remat_policy={self.remat_policy!r}: use one of {REMAT_POLICIES}")
        if (self.merge_decode_projections_above or 0) < 0:
            raise ValueError(f"model.merge_decode_projections_above: None or >= 0, got {self.merge_decode_projections_above}")
        lora = LoraConfig(**self.lora) if isinstance(self.lora, Mapping) else self.lora
        # Rank 0 is "off", spelled None, so configs with and without it compare equal.
        object.__setattr__(self, "lora", lora if lora is not None and lora.rank > 0 else None)
        if self.lora is not None:
            self.lora.check_family(self.family)
        if self.moe_layers is not None:
            self._check_moe_layers()
        if self.num_experts:
            self._check_experts()
        elif self.arch in MOE_ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is a mixture of experts: set model.num_experts and "
                             f"model.experts_per_token")
        else:
            routed = {name: getattr(self, name) for name, off in _MOE_ONLY.items() if getattr(self, name) != off}
            if routed:
                raise ValueError(f"model {routed}: router and expert options need model.num_experts > 0")
        if self.attention_sinks and self.family != "llama":
            raise ValueError("model.attention_sinks is a Llama-family option (GPT-OSS), not gpt2's")
        if self.norm_scale_float32 and (self.family != "llama" or self.norm_unit_offset):
            raise ValueError("model.norm_scale_float32 is GPT-OSS's RMSNorm order: a Llama-family option, "
                             "without norm_unit_offset (which already scales in float32)")

    @property
    def family(self) -> str:
        return ARCH_TO_FAMILY[self.arch]

    @property
    def fused_attention(self) -> bool:
        """Every layer's cache-free attention runs `jax.nn.dot_product_attention` ("cudnn" / "xla"):
        neither soft-capping nor sinks force the einsum kernel."""
        return self.attention in ("cudnn", "xla") and self.attn_logit_softcap is None and not self.attention_sinks

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def expert_mlp_dim(self) -> int:
        return self.moe_intermediate_size or self.mlp_dim

    def _check_moe_layers(self):
        object.__setattr__(self, "moe_layers", tuple(bool(m) for m in self.moe_layers))  # hashable
        if not self.num_experts:
            raise ValueError("model.moe_layers needs model.num_experts > 0")
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"model.moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if len(set(self.moe_layers)) == 1:  # one spelling per model, so configs compare equal
            raise ValueError("model.moe_layers marks every layer alike; use moe_layers=None (every layer an MoE "
                             "layer) or num_experts=0 (none)")
        object.__setattr__(self, "scan_layers", False)  # an execution choice that mixed layers do not have

    def _check_experts(self):
        if self.family != "llama":
            raise ValueError(f"model.num_experts: mixture-of-experts MLPs are a Llama-family option, not {self.arch}'s")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} must be between 1 and "
                             f"model.num_experts={self.num_experts}")
        if self.mlp_bias:
            raise ValueError("model.mlp_bias: the experts' biases come with expert_kind='clamped_swiglu' "
                             "(GPT-OSS); set mlp_bias=False")
        if self.expert_kind not in EXPERT_KINDS:
            raise ValueError(f"model.expert_kind={self.expert_kind!r}: use one of {EXPERT_KINDS}")
        if self.router_softmax not in ROUTER_SOFTMAX:
            raise ValueError(f"model.router_softmax={self.router_softmax!r}: use one of {ROUTER_SOFTMAX}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"model.swiglu_limit must be positive, got {self.swiglu_limit}")
        routed = [t for t in ("gate", "up", "down") if self.lora is not None and t in self.lora.targets]
        if routed:
            raise ValueError(f"model.lora.targets {routed}: LoRA on the experts' projections is not supported "
                             f"yet; target the attention projections (q, k, v, o)")

    @property
    def act(self) -> str:
        return self.activation or ("gelu_new" if self.family == "gpt2" else "silu")

    @property
    def layer_sliding(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window."""
        if self.sliding_layers is not None:
            return self.sliding_layers
        return (self.sliding_window is not None,) * self.num_layers

    @property
    def layer_moe(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the mixture of experts."""
        return self.moe_layers if self.moe_layers is not None else (bool(self.num_experts),) * self.num_layers

    def lora_for(self, projection: str) -> LoraConfig | None:
        """The LoraConfig when `projection` (our name: "q", "gate", ...) carries an adapter, else None."""
        return self.lora if self.lora is not None and projection in self.lora.targets else None

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def jnp_dtype(self):
        return to_dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return to_dtype(self.param_dtype)

    def execution(self) -> dict[str, Any]:
        """The fields that choose how the model executes, to run another model (or load a checkpoint)
        the same way: `hf.load_model(..., execution=cfg.execution())`."""
        return {name: getattr(self, name) for name in EXECUTION_FIELDS}

    def replace(self, **kwargs) -> "ModelConfig":
        return dataclasses.replace(self, **kwargs)

    def num_params(self, with_lm_head: bool = True) -> int:
        """Parameter count, computed from the shapes (no allocation)."""
        d, f, v = self.hidden_size, self.mlp_dim, self.vocab_size
        q = self.num_heads * self.dim_per_head
        kv = self.kv_heads * self.dim_per_head
        if self.family == "gpt2":
            attn = d * (q + 2 * kv) + (q + 2 * kv) + q * d + d
            mlps = self.num_layers * (d * f + f + f * d + d)
            norms = 4 * d
            emb = v * d + self.max_position_embeddings * d
            final = 2 * d
        else:
            attn = (d * (q + 2 * kv) + q * d + ((q + 2 * kv) if self.attention_bias else 0)
                    + (d if self.attention_out_bias else 0))
            dense = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
            experts = 0
            if self.num_experts:  # the router and every expert's gate, up and down (and their biases)
                e, fe = self.num_experts, self.expert_mlp_dim
                experts = d * e + 3 * e * d * fe + (e if self.router_bias else 0)
                experts += e * (2 * fe + d) if self.expert_kind == "clamped_swiglu" else 0
            moe = sum(self.layer_moe)
            mlps = moe * experts + (self.num_layers - moe) * dense
            attn += self.num_heads if self.attention_sinks else 0
            norms = (4 if self.post_norms else 2) * d + (2 * self.dim_per_head if self.qk_norm else 0)
            emb = v * d
            final = d
        head = v * d if (with_lm_head and not self.tie_word_embeddings) else 0
        return self.num_layers * (attn + norms) + mlps + emb + final + head


# The mixture-of-experts options a dense model must leave at these values.
_MOE_ONLY = {"router_softmax": "all", "router_bias": False, "expert_kind": "swiglu"}


def checked_rope_scaling(pairs, dim_per_head: int) -> tuple[tuple[str, Any], ...]:
    """model.rope_scaling as sorted pairs with tuples for lists (a config file gives a dict or lists),
    refused when its type is unknown, a key it needs is missing, or LongRoPE's factor lists do not
    have one entry per rotated pair of dimensions."""
    scaling = dict(pairs.items() if isinstance(pairs, Mapping) else pairs)
    kind = scaling.get("rope_type", "llama3")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"model.rope_scaling: unsupported rope_type {kind!r}; supported: "
                         f"{', '.join(ROPE_SCALING_KEYS)}")
    missing = [k for k in ROPE_SCALING_KEYS[kind] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"model.rope_scaling: {kind} rope scaling needs {', '.join(missing)}")
    for name in ("short_factor", "long_factor"):
        if name in scaling:
            scaling[name] = tuple(float(x) for x in scaling[name])
            if len(scaling[name]) != dim_per_head // 2:
                raise ValueError(f"model.rope_scaling: {name} has {len(scaling[name])} entries; LongRoPE "
                                 f"needs one per rotated pair, head_dim / 2 = {dim_per_head // 2}")
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
