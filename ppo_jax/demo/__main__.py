"""`python -m ppo_jax.demo` and the console script `ppo-jax-demo`: the offline RLHF demo pipeline (see
`ppo_jax.demo.pipeline`)."""

from ppo_jax import host_memory


def main() -> None:
    """Restarts with jemalloc where it is installed (`host_memory.restart_with_jemalloc`) before the
    pipeline's imports (~2 s that a restart would pay twice), then runs the demo's command line."""
    host_memory.restart_with_jemalloc()
    from ppo_jax.demo.pipeline import main as demo_command

    demo_command()


if __name__ == "__main__":
    main()
