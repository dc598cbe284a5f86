"""A static profile of a compiled GPU program: its kernels, what each costs, and a time estimate.

What a GPU runs is in the optimised HLO that XLA:GPU compiles on this machine without a GPU
(`compiled.as_text()`): every kernel (a fusion, a library call such as a cuBLAS GEMM or cuDNN
attention, an unfused copy or transpose), the loops around them and how often each runs. For each
kernel XLA's own cost analysis (`HloCostAnalysis`, run on a one-kernel module through the CPU client)
gives its floating-point operations and the bytes it reads and writes; cuDNN attention, which that
analysis sees as an opaque call, gets its FLOPs from its operand shapes. A kernel's estimated time is

    max(FLOPs / peak FLOP/s of its dtype, bytes / HBM bandwidth) + one launch

and a loop whose trip count XLA could not prove (its condition reads device data: the decode loop's
"every row stopped" test) adds a host round trip per iteration, because XLA:GPU copies the predicate
to the host and waits for it before it launches the next iteration.

What this cannot see: XLA:GPU autotunes GEMM tiles on a real device; compiled here it keeps untuned
fallbacks (split-K partial sums among them), so GEMM kernel counts and bytes are those of the
fallback, not of what a device picks. Overlap between kernels, caches (an L2 hit costs no HBM
bytes) and the efficiency of each kernel at its size are one factor each in `DeviceModel`; how far
the estimate is from measured runs, phase by phase, is in docs/benchmarks.md. Use the profile to
rank causes and to check a change before a device is lent, not as a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

from ppo_jax.accelerators.hlo_module import DTYPE_BYTES, Computation, Instruction, Module, array_shapes, type_bytes

# Instructions that launch no kernel: they name, regroup or reinterpret buffers, or are control flow
# whose bodies are walked instead (while, conditional, call).
NOT_KERNELS = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "domain", "while", "conditional", "call", "copy-done",
    "send-done", "recv-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done",
    "async-update", "get-dimension-size", "iota",
})
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_ATTENTION_PREFIX = "__cudnn$fmha"


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """A GPU as the estimate sees it: peaks, and the fixed costs of a launch and of a host sync.

    matmul_efficiency / memory_efficiency: the fraction of the peak a kernel reaches (1 = the
    roofline itself); launch_seconds: the fixed cost of one kernel (launch gap plus ramp-up, a few
    microseconds on Hopper even under CUDA graphs); host_sync_seconds: one device-to-host copy of a
    loop predicate and the wait before the next iteration's launches.
    """

    name: str
    bf16_flops: float  # dense tensor-core peak, FLOP/s (bf16 / fp16 operands)
    f32_flops: float  # fp32 operands (XLA:GPU's default precision multiplies them as TF32)
    hbm_bytes_per_s: float
    # 1.9 us, fitted on the traced bf16 H200 decode loop (2026-11-27, docs/benchmarks.md "Recalibrated"):
    # its ~49,500 kernels took 0.257-0.272 s where their rooflines sum to 0.173 s, 1.7-2.0 us a kernel
    # (was 4 us, which put the launch-bound decode loop's estimate 1.3-1.4x above the device)
    launch_seconds: float = 1.9e-6
    host_sync_seconds: float = 20e-6
    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.8

    def kernel_seconds(self, flops: float, bytes_: float, tensor_core: bool) -> float:
        peak = (self.bf16_flops if tensor_core else self.f32_flops) * self.matmul_efficiency
        return max(flops / peak, bytes_ / (self.hbm_bytes_per_s * self.memory_efficiency)) + self.launch_seconds


# Vendor figures (SXM parts): dense bf16 and TF32 tensor-core peaks, HBM bandwidth.
DEVICE_MODELS = {
    "h100": DeviceModel("NVIDIA H100 80GB HBM3", bf16_flops=989e12, f32_flops=494e12, hbm_bytes_per_s=3.35e12),
    "h200": DeviceModel("NVIDIA H200", bf16_flops=989e12, f32_flops=494e12, hbm_bytes_per_s=4.8e12),
    "a100": DeviceModel("NVIDIA A100-SXM4-80GB", bf16_flops=312e12, f32_flops=156e12, hbm_bytes_per_s=2.04e12),
}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a program, per execution, and how many times one run of the program executes it."""

    name: str  # the HLO instruction
    category: str  # gemm, attention, reduction, elementwise, copy, transpose, slice, collective, sort, other
    flops: float
    bytes: float
    tensor_core: bool  # bf16 / fp16 operands (for the FLOP peak)
    executions: int
    loop: str  # the innermost loop it runs in ("" at the top level)
    op_name: str  # the JAX op path of the metadata: which model and layer it computes

    def seconds(self, device: DeviceModel) -> float:
        """Estimated time of one execution."""
        return device.kernel_seconds(self.flops, self.bytes, self.tensor_core)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop: its trip count (proved by XLA, or the caller's assumption) and how many kernels
    one iteration launches (nested loops' kernels times their trip counts)."""

    name: str
    trip_count: int
    known: bool  # XLA proved the trip count: no host round trip per iteration
    executions: int  # times the loop itself runs per program run
    kernels_per_iteration: int
    parent: str  # the enclosing loop ("" at the top level)


@dataclasses.dataclass(frozen=True)
class ProgramProfile:
    """The kernels and loops of one compiled program, and what one run of it costs."""

    name: str
    kernels: tuple[Kernel, ...]
    loops: tuple[Loop, ...]

    @property
    def launches(self) -> int:
        return sum(k.executions for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.flops * k.executions for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes * k.executions for k in self.kernels)

    @property
    def host_syncs(self) -> int:
        """Host round trips of one run: every iteration of a loop whose trip count is not proved."""
        return sum(loop.trip_count * loop.executions for loop in self.loops if not loop.known)

    def seconds(self, device: DeviceModel) -> float:
        """Estimated time of one run: the kernels one after another, plus the host round trips."""
        return (sum(k.seconds(device) * k.executions for k in self.kernels)
                + self.host_syncs * device.host_sync_seconds)

    def by_category(self, device: DeviceModel) -> dict[str, dict[str, float]]:
        """category -> {launches, flops, bytes, seconds}, largest time first."""
        out = collections.defaultdict(lambda: {"launches": 0, "flops": 0.0, "bytes": 0.0, "seconds": 0.0})
        for k in self.kernels:
            row = out[k.category]
            row["launches"] += k.executions
            row["flops"] += k.flops * k.executions
            row["bytes"] += k.bytes * k.executions
            row["seconds"] += k.seconds(device) * k.executions
        return dict(sorted(out.items(), key=lambda item: -item[1]["seconds"]))

    def top_kernels(self, device: DeviceModel, n: int = 10) -> list[tuple[Kernel, float]]:
        """The n kernels with the largest total estimated time in one run, with that time."""
        timed = [(k, k.seconds(device) * k.executions) for k in self.kernels]
        return sorted(timed, key=lambda kt: -kt[1])[:n]

    def outer_unknown_loop(self) -> Loop | None:
        """The outermost loop whose trip count is not proved (a sampler's decode loop), if any."""
        unknown = [loop for loop in self.loops if not loop.known and not loop.parent]
        return unknown[0] if unknown else None


def categorize(instruction: Instruction, module: Module) -> str:
    """What kind of work a kernel does, from its opcode, fusion kind and what it fuses."""
    op = instruction.opcode
    if op == "custom-call":
        target = instruction.custom_call_target
        if target.startswith(_ATTENTION_PREFIX):
            return "attention"
        if target in _GEMM_TARGETS:
            return "gemm"
        return "other"
    if op == "fusion":
        body = module.computations[instruction.called_as("calls")] if instruction.called_as("calls") else None
        opcodes = {i.opcode for i in body.instructions} if body is not None else set()
        if "dot" in opcodes or "convolution" in opcodes or "gemm" in instruction.name:
            return "gemm"
        if "dynamic-update-slice" in opcodes or "dynamic-slice" in opcodes:
            return "slice"
        if instruction.fusion_kind == "kInput" or "reduce" in opcodes:
            return "reduction"
        if opcodes <= {"parameter", "transpose", "bitcast", "copy"} and "transpose" in opcodes:
            return "transpose"
        return "elementwise"
    if op in ("copy", "copy-start"):
        return "copy"
    if op == "transpose":
        return "transpose"
    if op in ("dynamic-slice", "dynamic-update-slice", "slice", "gather", "scatter", "pad", "concatenate"):
        return "slice"
    if op.startswith(("all-", "reduce-scatter", "collective-", "send", "recv")):
        return "collective"
    if op == "sort":
        return "sort"
    if op in ("reduce", "reduce-window"):
        return "reduction"
    return "other"


def attention_flops(instruction: Instruction, types: dict[str, str]) -> float:
    """FLOPs of a cuDNN fused attention call from its operands: q [B, T, H, D] and k [B, S, K, D] in
    the layout its operand_layout_constraints list (or the operand types), 4·B·H·T·S·D forward (the
    two matmuls, no causal halving, as the benchmark counts them), 2.5x that backward (five matmuls)."""
    shapes = [dims for _, dims in array_shapes(instruction.attributes.split("operand_layout_constraints={", 1)[1])] \
        if "operand_layout_constraints={" in instruction.attributes else \
        [array_shapes(types[o])[0][1] for o in instruction.operands[:2]]
    q, k = shapes[0], shapes[1]
    # [B, T, H, D] (BTNH) is the layout jax.nn.dot_product_attention hands cuDNN; S is k's dim 1.
    batch, t, heads, dim = q
    s = k[1]
    forward = 4.0 * batch * heads * t * s * dim
    return 2.5 * forward if instruction.custom_call_target.endswith("Backward") else forward


def gemm_call_flops(instruction: Instruction, types: dict[str, str]) -> float:
    """FLOPs of a cuBLAS GEMM custom call: 2 x output elements x contracted size."""
    config = instruction.backend_config.get("gemm_backend_config", {})
    dims = config.get("dot_dimension_numbers", {})
    lhs = array_shapes(types[instruction.operands[0]])[0][1]
    contracted = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []))
    out = array_shapes(instruction.type)[0][1]
    return 2.0 * math.prod(out) * contracted


def _kernel_text(module: Module, computation: Computation, instruction: Instruction) -> str:
    """A module whose entry runs `instruction` alone on parameters of its operands' types, with the
    computations it calls (metadata stripped: it points into tables of the whole module)."""
    types = computation.types()
    params = ", ".join(f"p{i}: {types[o]}" for i, o in enumerate(instruction.operands))
    lines = ["HloModule kernel", ""]
    for name in module.reachable(instruction.called):
        called = module.computations[name]
        lines.append(called.header + " {")
        last = len(called.instructions) - 1
        lines += ["  " + _without_metadata(i, root=j == last) for j, i in enumerate(called.instructions)]
        lines += ["}", ""]
    lines.append(f"ENTRY %main ({params}) -> {instruction.type} {{")
    lines += [f"  %p{i} = {types[o]} parameter({i})" for i, o in enumerate(instruction.operands)]
    operands = ", ".join(f"%p{i}" for i in range(len(instruction.operands)))
    attributes = instruction.without_metadata()
    lines += [f"  ROOT %k = {instruction.type} {instruction.opcode}({operands})"
              + (f", {attributes}" if attributes else ""), "}"]
    return "\n".join(lines)


def _without_metadata(instruction: Instruction, root: bool) -> str:
    line = instruction.line[len("ROOT "):] if instruction.line.startswith("ROOT ") else instruction.line
    head = line[:len(line) - len(instruction.attributes)].rstrip(", ") if instruction.attributes else line
    attributes = instruction.without_metadata()
    return ("ROOT " if root else "") + head + (f", {attributes}" if attributes else "")


@functools.lru_cache(maxsize=1)
def _cost_client():
    import jax

    return jax.devices("cpu")[0].client


def _operand_cost(text: str) -> tuple[float, dict[int, float], float]:
    """XLA's HloCostAnalysis of a one-kernel module: (FLOPs, bytes read per operand, bytes written)."""
    import jaxlib._hlo as hlo
    from jax._src.lib import _jax

    cost = _jax.hlo_module_cost_analysis(_cost_client(), hlo.hlo_module_from_text(text))
    reads = {int(key[len("bytes accessed"):-2]): value for key, value in cost.items()
             if key.startswith("bytes accessed") and key.endswith("{}") and key[len("bytes accessed"):-2].isdigit()}
    return float(cost.get("flops", 0.0)), reads, float(cost.get("bytes accessedout{}", 0.0))


def _gathered_bytes(module: Module, instruction: Instruction) -> dict[int, float]:
    """Operands of a fusion that it only gathers from (an embedding table): the bytes of the rows it
    gathers, where HloCostAnalysis counts the whole table."""
    called = instruction.called_as("calls")
    if instruction.opcode != "fusion" or called is None:
        return {}
    body = module.computations[called]
    parameters = {i.name: int(i.line.split("parameter(")[1].split(")")[0]) for i in body.instructions
                  if i.opcode == "parameter"}
    users = collections.defaultdict(list)
    for i in body.instructions:
        for position, operand in enumerate(i.operands):
            users[operand].append((i, position))
    out = {}
    for name, index in parameters.items():
        uses = users.get(name, [])
        if uses and all(user.opcode == "gather" and position == 0 for user, position in uses):
            out[index] = sum(type_bytes(user.type) for user, _ in uses)
    return out


def kernel_cost(module: Module, computation: Computation, instruction: Instruction) -> tuple[float, float]:
    """(FLOPs, bytes read and written) of one execution of a kernel.

    XLA's HloCostAnalysis on the kernel alone, with two corrections: a fusion that gathers rows of
    an operand reads those rows, not the operand; a library call (cuDNN, cuBLAS), opaque to the
    analysis, reads its operands and writes its results (its scratch workspace aside), and its FLOPs
    come from its shapes (`attention_flops`, `gemm_call_flops`).
    """
    types = computation.types()
    if instruction.opcode == "custom-call":
        results = [(dtype, dims) for dtype, dims in array_shapes(instruction.type) if dtype != "u8"]
        written = sum(math.prod(dims) * DTYPE_BYTES.get(dtype, 4) for dtype, dims in results)
        read = sum(type_bytes(types[o]) for o in instruction.operands)
        target = instruction.custom_call_target
        flops = (attention_flops(instruction, types) if target.startswith(_ATTENTION_PREFIX) else
                 gemm_call_flops(instruction, types) if target in _GEMM_TARGETS else 0.0)
        return flops, read + written
    flops, reads, written = _operand_cost(_kernel_text(module, computation, instruction))
    reads.update(_gathered_bytes(module, instruction))
    return flops, sum(reads.values()) + written


def _tensor_core(instruction: Instruction, types: dict[str, str]) -> bool:
    """Whether the kernel's operands are 16-bit floats (tensor-core peak) rather than fp32."""
    dtypes = {dtype for o in instruction.operands for dtype, dims in array_shapes(types.get(o, "")) if len(dims) >= 2}
    return bool(dtypes & {"bf16", "f16"}) or not dtypes & {"f32"}


def profile_program(name: str, text: str, unknown_trip_count: int = 1) -> ProgramProfile:
    """The static profile of one optimised HLO module's text.

    unknown_trip_count: iterations assumed for a loop whose trip count XLA could not prove (for a
    sampler's decode loop: the decode steps of a full-length response divided by the steps one
    iteration decodes).
    """
    module = Module.from_text(text)
    kernels: list[Kernel] = []
    loops: list[Loop] = []
    costs: dict[str, tuple[float, float]] = {}

    def kernel(computation: Computation, instruction: Instruction, executions: int, loop: str) -> Kernel:
        key = _kernel_text(module, computation, instruction)
        if key not in costs:
            costs[key] = kernel_cost(module, computation, instruction)
        flops, bytes_ = costs[key]
        return Kernel(name=instruction.name, category=categorize(instruction, module), flops=flops, bytes=bytes_,
                      tensor_core=_tensor_core(instruction, computation.types()), executions=executions, loop=loop,
                      op_name=instruction.op_name)

    def walk(computation_name: str, executions: int, loop: str, into: list[Kernel]) -> int:
        """Appends to `into` the kernels of `executions` runs of a computation; returns the launches
        of one run."""
        computation = module.computations[computation_name]
        launches = 0
        for instruction in computation.instructions:
            if instruction.opcode == "while":
                known = instruction.known_trip_count
                trips = known if known is not None else unknown_trip_count
                per_iteration = sum(walk(instruction.called_as(part), executions * trips, instruction.name, into)
                                    for part in ("body", "condition"))
                loops.append(Loop(instruction.name, trips, known is not None, executions, per_iteration, loop))
                launches += per_iteration * trips
            elif instruction.opcode == "conditional":
                # One branch runs: the one that launches most stands for it (an upper bound).
                branches = []
                for branch in instruction.called:
                    branch_kernels: list[Kernel] = []
                    branches.append((walk(branch, executions, loop, branch_kernels), branch_kernels))
                branch_launches, branch_kernels = max(branches, key=lambda b: b[0], default=(0, []))
                into += branch_kernels
                launches += branch_launches
            elif instruction.opcode == "call":
                launches += walk(instruction.called_as("to_apply"), executions, loop, into)
            elif instruction.opcode not in NOT_KERNELS:
                into.append(kernel(computation, instruction, executions, loop))
                launches += 1
        return launches

    walk(module.entry, 1, "", kernels)
    return ProgramProfile(name=name, kernels=tuple(kernels), loops=tuple(loops))
