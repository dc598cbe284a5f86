"""The arithmetic task, an application on top of the library (next to demo/ and verifiable/): a tiny
policy learns to call the calculator for "what is A * B" (SFT on demonstrations, a share of them
wrong), then PPO with the real calculator as its tool. `python -m ppo_jax.arithmetic` runs it.

    task.py       prompts, gold products, the exact reward, demonstrations; registers the
                  "arithmetic" environment when imported
    pipeline.py   the character tokenizer, SFT, PPO with the calculator, evaluation, summary.json
"""
