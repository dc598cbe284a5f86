"""SFT on your own data: a JSONL file of {"prompt", "response"} records and a Hugging Face causal LM.

    python -m ppo_jax.cli.sft --config=configs/sft.py --workdir=runs/sft \
        --config.model.path=/path/to/hf_model --config.data.train=train.jsonl --config.data.eval=eval.jsonl

LoRA (only low-rank adapters train, the base stays frozen): --config.model.lora.rank=8
--config.model.lora.targets=q,k,v,o (GPT-2: o,fc,proj for a PEFT export) and a larger --config.optim.lr;
<workdir>/hf is then the merged model, or a PEFT adapter directory with --config.train.lora_export=adapter.
Every field and its meaning: `ppo_jax.supervised.settings.SFTSettings`.
"""

from ppo_jax.supervised.settings import sft_config


def get_config():
    config = sft_config()
    config.data.max_prompt_length = 256  # prompt tokens kept (left-truncated beyond)
    config.data.max_response_length = 256  # response tokens kept, EOS included
    config.train.batch_size = 32  # examples per optimizer step
    config.train.steps = 2000  # optimizer steps
    config.train.eval_every = 200  # held-out loss every N steps
    config.train.checkpoint_every = 500  # Orbax checkpoint every N steps (resumed automatically)
    config.optim.lr = 2e-5  # fine-tuning a pretrained model: a small learning rate
    config.optim.warmup_steps = 100  # linear warmup
    return config
