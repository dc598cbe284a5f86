"""Published model architectures for the memory planner (`ppo_jax.plan`): `model_shape(name)` gives a
policy.model section with a published model's shape, for planning without a checkpoint."""

from __future__ import annotations

from ppo_jax.config import ConfigError, model_config_dict

# Published architectures (their Hugging Face config.json), for planning without a checkpoint. Shapes
# and the layer options that change memory; rope details that do not (Gemma 3's global-layer scaling)
# are left out.
_LLAMA = dict(norm_eps=1e-5, tie_word_embeddings=False)
MODEL_SHAPES = {
    "llama2-7b": dict(_LLAMA, arch="llama", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=32, intermediate_size=11008, max_position_embeddings=4096,
                      rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    "llama3-8b": dict(_LLAMA, arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, intermediate_size=14336, max_position_embeddings=8192,
                      rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    "llama3-70b": dict(_LLAMA, arch="llama", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, intermediate_size=28672, max_position_embeddings=8192,
                       rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    # google/gemma-3-4b-it (text_config): five sliding-window layers to one global, 262k vocabulary.
    "gemma3-4b": dict(arch="gemma3_text", vocab_size=262208, hidden_size=2560, num_layers=34, num_heads=8,
                      num_kv_heads=4, head_dim=256, intermediate_size=10240, max_position_embeddings=131072,
                      norm_eps=1e-6, tie_word_embeddings=True, activation="gelu_new", scale_embeddings=True,
                      norm_unit_offset=True, post_norms=True, qk_norm=True, query_pre_attn_scalar=256,
                      sliding_window=1024, sliding_layers=tuple((i + 1) % 6 != 0 for i in range(34)),
                      rope_theta=1e6, rope_local_theta=1e4, bos_token_id=2, eos_token_id=1),
    # Qwen/Qwen3-8B.
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=12288, max_position_embeddings=40960,
                     norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True, rope_theta=1e6,
                     bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, 8 per token (3.3B of 30.5B parameters active).
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, experts_per_token=8, norm_topk_prob=True,
                          max_position_embeddings=40960, norm_eps=1e-6, tie_word_embeddings=False,
                          qk_norm=True, rope_theta=1e6, bos_token_id=151643, eos_token_id=151645),
    # openai/gpt-oss-20b (as dequantised to bf16): 32 experts of 2880, 4 per token (3.6B of 20.9B
    # parameters active); attention sinks, alternating 128-token sliding and full layers, YaRN x32.
    "gpt-oss-20b": dict(arch="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
                        num_kv_heads=8, head_dim=64, intermediate_size=2880, num_experts=32, experts_per_token=4,
                        router_softmax="topk", router_bias=True, expert_kind="clamped_swiglu",
                        norm_scale_float32=True, attention_sinks=True, attention_bias=True,
                        attention_out_bias=True, sliding_window=128, sliding_layers=tuple(i % 2 == 0 for i in range(24)),
                        max_position_embeddings=131072, norm_eps=1e-5, tie_word_embeddings=False,
                        rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                                               beta_slow=1.0, truncate=False,
                                                               original_max_position_embeddings=4096),
                        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336, 2 per token.
    "mixtral-8x7b": dict(_LLAMA, arch="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                         num_kv_heads=8, intermediate_size=14336, num_experts=8, experts_per_token=2,
                         max_position_embeddings=32768, rope_theta=1e6, bos_token_id=1, eos_token_id=2),
}


def model_shape(name: str, **overrides):
    """A model section (as policy.model) with the shape of a published model: see MODEL_SHAPES."""
    if name not in MODEL_SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}")
    return model_config_dict(**dict(MODEL_SHAPES[name], **overrides))
