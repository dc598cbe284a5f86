"""`python -m ppo_jax.demo`: the offline RLHF demo pipeline (see `ppo_jax.demo.pipeline`)."""

from ppo_jax.demo.pipeline import main

if __name__ == "__main__":
    main()
