"""The offline RLHF demo with LoRA PPO: the same SFT policy, preference pairs and reward model as
configs/demo.py, then PPO that trains rank-8 adapters on every projection of the frozen SFT policy
instead of the whole policy, and a value model that is rank-8 adapters + a head on the frozen reward
model (the demo's value.init = "reward"). The reference is the frozen policy base with its adapters
off, so no reference copy exists, and nothing full-size trains.

    python -m ppo_jax.demo --config=configs/demo_lora.py --workdir=runs/demo_lora

docs/demo.md ("LoRA") compares its gold reward and KL with full fine-tuning; docs/lora.md explains
the mode. Every other field is the full demo's (`ppo_jax.demo.settings.DemoSettings`).
"""

from ppo_jax.demo.settings import get_config as demo_config


def get_config():
    config = demo_config()
    lora = config.ppo.policy.lora
    lora.rank = 8  # adapters of rank 8 on a d = 128 model
    lora.alpha = 16.0  # scale alpha / rank = 2
    lora.targets = "q,k,v,o,fc,proj"  # every projection of GPT-2's blocks
    # Adapters start at B = 0 and move the policy through a rank-8 bottleneck: they need a larger
    # step than full fine-tuning's 3e-4 to move as far (tuned on the d = 64 demo of 60 iterations).
    config.ppo.optim.policy_lr = 1e-3
    value = config.ppo.value.lora  # the value model: adapters + head on the reward model, shared with it
    value.rank = 8
    value.alpha = 16.0
    value.targets = "q,k,v,o,fc,proj"
    config.ppo.optim.value_lr = 1e-3
    return config
