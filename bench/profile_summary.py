"""Where a traced program's device time goes: a `jax.profiler` trace (an .xplane.pb) summed by XLA
module and, inside each, by kind of kernel (GEMM, fused attention, copy, transpose, ...).

This is the method of docs/gpu_profile.md as a function, so a device session gets the breakdown in
the same call as its timings (`bench_accel.py --profile DIR`), or later from a saved trace:

    python bench/profile_summary.py TRACE_DIR_OR_XPLANE_PB [--top 12]

On a GPU or TPU the events are the device's own kernels ("XLA Ops" line of the device plane, with
the `hlo_module` / `hlo_op` stats XLA attaches); on a CPU, the XLA:CPU thunks of the host plane.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re

# Kernel kinds, first match wins; matched against "hlo_op event-name" in lower case.
KINDS = (
    ("attention", re.compile(r"cudnn|fmha|flash|splash|dot_product_attention")),
    ("gemm", re.compile(r"gemm|cublas|nvjet|matmul|\bdot\b|dot\.|convolution|ynn_fusion")),
    ("copy", re.compile(r"copy|memcpy|memset")),
    ("transpose", re.compile(r"transpose")),
    ("dynamic-slice", re.compile(r"dynamic[-_]update[-_]slice|dynamic[-_]slice")),
    ("collective", re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective|nccl")),
    ("reduce", re.compile(r"reduce")),
)
SKIPPED_LINES = {"XLA Modules", "Launch Stats", "Steps", "Source code", "XLA TraceMe", "TensorFlow Ops",
                 "Framework Ops", "Framework Name Scope"}


@dataclasses.dataclass
class ModuleTime:
    """Busy time of one XLA module (program) in the trace."""

    name: str
    seconds: float = 0.0
    events: int = 0
    first_ns: float = float("inf")  # the first kernel's start and the last one's end: busy / span is
    last_ns: float = 0.0  # how much of the program's time on the device is spent in kernels

    @property
    def span_seconds(self) -> float:
        return max(0.0, self.last_ns - self.first_ns) * 1e-9
    by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_op: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def kind_of(op: str, event: str) -> str:
    text = f"{op} {event}".lower()
    return next((kind for kind, pattern in KINDS if pattern.search(text)), "other")


def find_xplane(path: str) -> str:
    """The newest .xplane.pb at or under `path`."""
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {path}")
    return found[-1]


def _op_events(plane):
    """The kernel events of a plane: its "XLA Ops" line where it has one, else every line that is
    not a summary line (CPU thunks, GPU streams); only those XLA names (`hlo_module`), and of those the
    leaves, so that a while loop's event and the events of its body, nested inside it on the same
    line, are not counted twice. A leaf is an event that does not contain the next one: neighbours
    whose GPU timestamps overlap by a few ns are both kernels (counting only those that end before the
    next starts lost 40% of the H200 update's kernels). Yields (event, its stats as a dict)."""
    lines = list(plane.lines)
    ops = [line for line in lines if line.name == "XLA Ops"]
    for line in ops or [line for line in lines if line.name not in SKIPPED_LINES]:
        events = sorted(((e, dict(e.stats)) for e in line.events if any(k == "hlo_module" for k, _ in e.stats)),
                        key=lambda pair: pair[0].start_ns)
        for (event, stats), (following, _) in zip(events, events[1:] + [(None, None)]):
            if following is None or not _contains(event, following):
                yield event, stats


def _contains(outer, inner) -> bool:
    return inner.start_ns + inner.duration_ns <= outer.start_ns + outer.duration_ns


def op_name(stats: dict, event_name: str) -> str:
    """The HLO op an event ran; inside a command buffer (a CUDA graph: XLA:GPU's default for fusions
    and library calls) the op is the graph, so the kernel's own name says more."""
    op = str(stats.get("hlo_op", event_name))
    return event_name if op.startswith("command_buffer") else op


def summarize(path: str) -> dict[str, ModuleTime]:
    """{module name: ModuleTime} from the trace at `path`, device planes if any, else the host's."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(find_xplane(path))
    planes = [p for p in data.planes if p.name.startswith("/device:") and any(True for _ in p.lines)]
    planes = planes or [p for p in data.planes if p.name == "/host:CPU"]
    modules: dict[str, ModuleTime] = {}
    for plane in planes:
        for event, stats in _op_events(plane):
            module = stats["hlo_module"]
            op = op_name(stats, event.name)
            entry = modules.setdefault(str(module), ModuleTime(str(module)))
            seconds = event.duration_ns * 1e-9
            entry.seconds += seconds
            entry.events += 1
            entry.first_ns = min(entry.first_ns, event.start_ns)
            entry.last_ns = max(entry.last_ns, event.start_ns + event.duration_ns)
            entry.by_kind[kind_of(op, event.name)] += seconds
            entry.by_op[op] += seconds
    return modules


def format_summary(modules: dict[str, ModuleTime], top: int = 10) -> str:
    lines = []
    for m in sorted(modules.values(), key=lambda m: -m.seconds):
        kinds = ", ".join(f"{k} {1e3 * s:.1f} ({s / m.seconds:.0%})" for k, s in m.by_kind.most_common())
        lines.append(f"{m.name}: {1e3 * m.seconds:.1f} ms busy of a {1e3 * m.span_seconds:.1f} ms span over "
                     f"{m.events} kernels — {kinds}")
        for op, s in m.by_op.most_common(top):
            lines.append(f"    {1e3 * s:8.2f} ms  {op}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a trace directory (jax.profiler.trace) or an .xplane.pb file")
    p.add_argument("--top", type=int, default=12, help="ops listed per module")
    args = p.parse_args(argv)
    print(format_summary(summarize(args.path), args.top))


if __name__ == "__main__":
    main()
