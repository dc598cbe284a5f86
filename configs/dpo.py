"""DPO on your own preferences: a JSONL file of {"prompt", "chosen", "rejected"} records, starting from
your SFT model, which is also the frozen reference.

    python -m ppo_jax.cli.dpo --config=configs/dpo.py --workdir=runs/dpo \
        --config.model.path=runs/sft/hf --config.data.train=prefs.jsonl --config.data.eval=prefs_val.jsonl

IPO instead of DPO: --config.loss.type=ipo; conservative DPO: --config.loss.label_smoothing=0.1.
LoRA (only low-rank adapters train; the frozen base with the adapters off is the reference, no copy):
--config.model.lora.rank=8 --config.model.lora.targets=q,k,v,o (GPT-2: o,fc,proj for a PEFT export) and a
larger --config.optim.lr; <workdir>/hf is then the merged model, or a PEFT adapter directory with
--config.train.lora_export=adapter.
Every field and its meaning: `ppo_jax.supervised.settings.DPOSettings`.
"""

from ppo_jax.supervised.settings import dpo_config


def get_config():
    config = dpo_config()
    config.data.max_prompt_length = 256  # prompt tokens kept (left-truncated beyond)
    config.data.max_response_length = 256  # response tokens kept, EOS included
    config.loss.beta = 0.1  # the usual DPO beta (TRL's default)
    config.train.batch_size = 32  # preference pairs per optimizer step
    config.train.steps = 1000  # optimizer steps (about one epoch of 32k pairs)
    config.train.eval_every = 200  # validation reward accuracy every N steps
    config.train.checkpoint_every = 500  # Orbax checkpoint every N steps (resumed automatically)
    config.optim.lr = 5e-7  # DPO on a pretrained model: a very small learning rate
    config.optim.warmup_steps = 50  # linear warmup
    return config
