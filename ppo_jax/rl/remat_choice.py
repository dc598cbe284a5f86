"""`compute.remat="auto"` on a GPU: the update without remat where it fits the devices' memory, else
with full remat.

Full remat (recompute every layer in the backward pass) costs ~21% of a bf16 update (H200, TinyLlama
4-layer slice, 0.105 s against 0.087 s without; docs/benchmarks.md "The third H200 session"), and the
TinyLlama iteration without it peaked at 27.8 GiB of the H200's 141. It is needed only where the
activations would not fit. So the choice is XLA's own buffer assignment, on the real arguments: the
update is compiled without remat first, and `memory_analysis()` says what running it allocates
beyond the buffers already held (its temporaries, and its outputs less the donated state they reuse).
If that fits in `MARGIN` of the smallest free memory of any device of any process, it is the program;
otherwise the update is compiled again with full remat (one more compile: `compute.remat=full` or
`none` skips the choice). Every process takes the same choice, or their programs would differ.

The planner (`ppo-jax-plan`) plans the full-remat update: the program that always fits best.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ppo_jax.rl.state import Modules

MARGIN = 0.9  # of the free device memory: room for the allocator's fragmentation and what later steps hold


def applies(remat: str, platform: str, model_sets_remat: bool) -> bool:
    """Whether the update's remat is chosen by memory: compute.remat "auto", on a GPU, for a model
    that does not set its own remat (a `policy.model` section with remat=True keeps it)."""
    return remat == "auto" and platform == "gpu" and not model_sets_remat


def without_remat(modules: Modules) -> Modules:
    """The same modules with remat off in the trained models (the policy and the value model): the
    parameter trees are the same, only the backward pass keeps the layers' activations."""

    def lean(module):
        return None if module is None else module.clone(config=module.config.replace(remat=False))

    return dataclasses.replace(modules, policy=lean(modules.policy), value=lean(modules.value))


def allocated_bytes(compiled) -> int:
    """What running `compiled` allocates beyond its arguments, per device: its temporaries and its
    outputs, less the outputs written into donated arguments."""
    stats = compiled.memory_analysis()
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes)


class MemoryChosenUpdate:
    """Called like the jitted update it replaces. On its first call (or `choose`, ahead of it) it
    compiles `candidates` ((name, jitted update) pairs, least recompute first) on the call's
    arguments, one after another, and keeps the first whose `allocated_bytes` fits in MARGIN of
    `free_bytes()` (the last one in any case, and at once when free_bytes() is None;
    `sharding.free_device_bytes`, the same on every process). `chosen` names it; `report` says why."""

    def __init__(self, candidates: Sequence[tuple[str, Any]], free_bytes: Callable[[], int | None],
                 log: Callable[[str], None] = print):
        self.candidates, self.free_bytes, self.log = tuple(candidates), free_bytes, log
        self.chosen: str | None = None
        self.allocated: dict[str, int] = {}  # bytes each compiled candidate allocates
        self.report = ""
        self._compiled = None

    def __call__(self, *args):
        if self._compiled is None:
            self.choose(args, self.free_bytes())
        return self._compiled(*args)

    def lower(self, *args):
        """The last candidate lowered: what a plan compiles, the program that always fits best."""
        return self.candidates[-1][1].lower(*args)

    def choose(self, args, free: int | None) -> None:
        """Compiles the candidates on `args` (the call's arrays, or their ShapeDtypeStructs ahead of
        it: `rl/precompile.py`) and keeps the first that fits in MARGIN of `free` bytes."""
        tried = []
        for i, (name, jitted) in enumerate(self.candidates):
            last = i == len(self.candidates) - 1
            if free is None and not last:
                continue
            compiled = jitted.lower(*args).compile()
            need = self.allocated[name] = allocated_bytes(compiled)
            tried.append(f"{name} {need / 2**30:.2f} GiB")
            if last or need <= MARGIN * free:
                self.chosen, self._compiled = name, compiled
                break
        free_text = "unknown" if free is None else f"{free / 2**30:.1f} GiB free"
        self.report = (f"compute.remat=auto: the update runs with remat {self.chosen} "
                       f"({', '.join(tried)} beyond its arguments; {free_text} per device)")
        self.log(self.report)
