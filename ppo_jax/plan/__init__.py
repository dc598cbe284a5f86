"""The memory planner: a PPO run's per-device bytes, phase by phase, from the run's own programs
compiled on abstract inputs (`memory.plan_memory`), for this machine's devices or compile-only GPUs and
TPU slices; `report.format_plan` prints a plan, `shapes.model_shape` gives published model shapes.
It builds with `ppo_jax.rl`; nothing in `rl/` imports it."""

from ppo_jax.plan.memory import GB, GIB, PHASES, MemoryPlan, PhaseMemory, plan_memory
from ppo_jax.plan.report import format_plan
from ppo_jax.plan.shapes import MODEL_SHAPES, model_shape

__all__ = ["GB", "GIB", "PHASES", "MODEL_SHAPES", "MemoryPlan", "PhaseMemory", "format_plan", "model_shape",
           "plan_memory"]
