"""The static profiles of a run's programs as a table (`ppo-jax-plan --profile`, docs/benchmarks.md).

Per phase: kernel launches, host round trips, FLOPs, bytes and the estimated time, split by kind of
kernel; for a sampler, the same per decode step; then the largest groups of kernels by what they
compute (the JAX op path with layer numbers folded: every layer's `mlp/up` is one group).
"""

from __future__ import annotations

import collections
import dataclasses
import re

from ppo_jax.accelerators.profile import DeviceModel, ProgramProfile

CATEGORIES = ("gemm", "attention", "reduction", "elementwise", "slice", "copy", "transpose", "collective", "sort",
              "other")


@dataclasses.dataclass(frozen=True)
class OpGroup:
    """Kernels that compute the same thing in every layer (or once), summed over one program run."""

    where: str  # "loop" when inside a loop, else "top"
    category: str
    op: str  # the op path's last parts, layer numbers folded ("layers_*/mlp/up/dot_general")
    launches: int
    flops: float
    bytes: float
    seconds: float


def op_groups(profile: ProgramProfile, device: DeviceModel) -> list[OpGroup]:
    """The profile's kernels grouped by (inside a loop or not, kind, op path), largest time first."""
    sums = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for k in profile.kernels:
        op = re.sub(r"^jit\([\w.]+\)/", "", re.sub(r"layers_\d+", "layers_*", k.op_name))
        op = "/".join(op.split("/")[-3:]) or k.name
        row = sums["loop" if k.loop else "top", k.category, op]
        row[0] += k.executions
        row[1] += k.flops * k.executions
        row[2] += k.bytes * k.executions
        row[3] += k.seconds(device) * k.executions
    groups = [OpGroup(where, category, op, *row) for (where, category, op), row in sums.items()]
    return sorted(groups, key=lambda g: -g.seconds)


def format_profiles(profiles: dict[str, ProgramProfile], device: DeviceModel, decode_steps: int | None = None,
                    top: int = 8) -> str:
    """The table of every phase, then each phase's `top` op groups. decode_steps: the decode steps one
    sampler run stands for (its per-step line); None: no such line."""
    lines = [f"Static profile for {device.name} (compile-only XLA:GPU; estimate per kernel = max(FLOPs / "
             f"{device.matmul_efficiency:.0%} of peak, bytes / {device.memory_efficiency:.0%} of "
             f"{device.hbm_bytes_per_s / 1e12:.2f} TB/s) + {device.launch_seconds * 1e6:.1f} us; "
             f"{device.host_sync_seconds * 1e6:.0f} us per host round trip)",
             f"{'phase':<12}{'launches':>10}{'host syncs':>12}{'TFLOP':>9}{'GB':>9}{'est. ms':>10}   by kind (est. ms)"]
    for name, p in profiles.items():
        kinds = p.by_category(device)
        split = ", ".join(f"{kind} {row['seconds'] * 1e3:.1f}" for kind, row in kinds.items() if row["seconds"] >= 5e-5)
        lines.append(f"{name:<12}{p.launches:>10}{p.host_syncs:>12}{p.flops / 1e12:>9.2f}{p.bytes / 1e9:>9.2f}"
                     f"{p.seconds(device) * 1e3:>10.1f}   {split}")
        if name == "sampler" and decode_steps:
            lines.append(decode_step_line(p, device, decode_steps))
    for name, p in profiles.items():
        lines.append(f"\n{name}: largest kernel groups (one run)")
        for g in op_groups(p, device)[:top]:
            lines.append(f"  {g.seconds * 1e3:8.2f} ms {g.launches:6d}x {g.category:<11} {g.flops / 1e12:7.3f} TFLOP "
                         f"{g.bytes / 1e9:7.3f} GB  {g.where}: {g.op}")
    return "\n".join(lines)


def decode_step_line(sampler: ProgramProfile, device: DeviceModel, decode_steps: int) -> str:
    """Kernels, host round trips and estimated time per decode step of a sampler's profile (the
    prefill's share left out: everything outside the decode loop)."""
    decode = sampler.outer_unknown_loop()
    if decode is None:
        return "  decode: no data-dependent loop (every step in a loop of known trip count)"
    inside = [k for k in sampler.kernels if k.loop and _within(sampler, k.loop, decode.name)]
    seconds = sum(k.seconds(device) * k.executions for k in inside) + decode.trip_count * device.host_sync_seconds
    launches = sum(k.executions for k in inside)
    return (f"  per decode step: {launches / decode_steps:.0f} kernels, {decode.trip_count / decode_steps:.3f} host "
            f"round trips, est. {seconds / decode_steps * 1e3:.3f} ms")


def _within(profile: ProgramProfile, loop: str, ancestor: str) -> bool:
    """Whether `loop` is `ancestor` or nested in it."""
    parents = {l.name: l.parent for l in profile.loops}
    while loop:
        if loop == ancestor:
            return True
        loop = parents.get(loop, "")
    return False
