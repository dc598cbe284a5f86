"""Memory plan of PPO on the GPU probe's shape (docs/gpu_probe.md, docs/gpu_profile.md): a
TinyLlama-1.1B-shaped policy, reward and value model (22 layers, d 2048, 32 query / 4 KV heads, MLP
5632, vocab 32000), bf16 params and compute, 64 prompts x (128 prompt + 128 response) tokens, one
epoch of 32-row minibatches, on one GPU:

    python -m ppo_jax.cli.plan --config=configs/plan_tinyllama.py --platform=gpu --gpu=h100 --device_memory_gb=80
    ... --config.policy.param_dtype=float32     # fp32 master weights (and fp32 Adam moments), bf16 compute
    ... --config.compute.remat=dots              # keep only the matmul outputs for the backward pass

Only shapes are used: no weights exist or are read.
"""

from ppo_jax.config import model_config_dict
from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 1, 1)  # one GPU
    config.policy.model = model_config_dict(
        arch="llama", vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
        intermediate_size=5632, max_position_embeddings=2048, norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, param_dtype="bfloat16", dtype="bfloat16")
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 128  # tokens, left-padded
    config.rollout.batch_size = 64  # prompts per iteration
    config.rollout.response_length = 128  # new tokens per response
    config.ppo.epochs = 1
    config.ppo.num_minibatches = 2  # 32 rows per optimizer step
    return config
