"""`python -m ppo_jax.demo`: the offline RLHF demo pipeline (see `ppo_jax.demo.pipeline`)."""

from ppo_jax import host_memory

if __name__ == "__main__":
    host_memory.restart_with_jemalloc()  # where jemalloc is installed; before the pipeline's imports (~2 s)
    from ppo_jax.demo.pipeline import main

    main()
