"""`python -m ppo_jax.verifiable`: SFT then RL on a verifiable reward (see `ppo_jax.verifiable.pipeline`)."""

from ppo_jax.verifiable.pipeline import main

if __name__ == "__main__":
    main()
