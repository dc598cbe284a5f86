"""`python -m ppo_jax.agentic` was the arithmetic run's command; the run is an application now."""

import sys

if __name__ == "__main__":
    print("error: the arithmetic run moved: python -m ppo_jax.arithmetic (same flags)", file=sys.stderr)
    sys.exit(2)
