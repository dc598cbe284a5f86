"""Whether XLA compiles a run's programs faster side by side (issue 63 item 4): the sampler, experience
and update programs of the TinyLlama plan (`configs/plan_tinyllama.py`, LAYERS layers, 64 x (128 + 128),
bf16), lowered on abstract inputs and compiled for one H200 without one (compile-only), either one
after another (`seq`) or in three threads (`par`). Run each mode in a process of its own, with no
persistent cache, so that neither reuses the other's work (mode `lower`: the tracing and lowering alone,
which a start with a warm persistent cache pays too):

    JAX_ENABLE_COMPILATION_CACHE=false python bench/compile_concurrency.py 22 seq
    JAX_ENABLE_COMPILATION_CACHE=false python bench/compile_concurrency.py 22 par

Needs the CUDA plugin (the `cuda12` extra). Compile-only GEMMs are not autotuned, so a GPU host's own
compile differs (docs/benchmarks.md).
"""

import concurrent.futures
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin's compile-only devices (../shared/compile_only.md)

from ppo_jax.accelerators import planning_devices  # noqa: E402
from ppo_jax.config_file import load_config  # noqa: E402
from ppo_jax.plan.memory import planned_settings  # noqa: E402
from ppo_jax.plan.programs import lower_programs, planned_run  # noqa: E402

PROGRAMS = ("sampler", "experience", "update")


def main():
    layers, mode = int(sys.argv[1]), sys.argv[2]
    config = load_config("configs/plan_tinyllama.py")
    config.policy.model.num_layers = layers
    config.rollout.min_new_tokens = 128
    start = time.perf_counter()
    run = planned_run(planned_settings(config), None, planning_devices("gpu", 1, gpu="h200"))
    built = time.perf_counter()
    lowered = lower_programs(run).lowered
    # What a warm start pays too.
    print(f"layers {layers}: abstract run built in {built - start:.1f} s, the programs traced and lowered in "
          f"{time.perf_counter() - built:.1f} s")
    start = time.perf_counter()
    if mode == "lower":
        return
    if mode == "seq":
        for name in PROGRAMS:
            lowered[name].compile()
    else:
        with concurrent.futures.ThreadPoolExecutor(len(PROGRAMS)) as pool:
            list(pool.map(lambda name: lowered[name].compile(), PROGRAMS))
    print(f"layers {layers} {mode}: {time.perf_counter() - start:.1f} s; cores {os.cpu_count()}")


if __name__ == "__main__":
    main()
