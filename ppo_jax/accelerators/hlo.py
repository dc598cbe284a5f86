"""What a compiled program holds, read from its optimised HLO text (`compiled.as_text()`).

The planner reports it beside each phase's memory, and tests/test_accelerators.py asserts on it: a
GPU program whose attention is not a cuDNN fused call, a per-layer loop that stacks its layers, or an
update that copies its train state is a regression that no CPU test shows.
"""

from __future__ import annotations

import collections
import dataclasses
import re

# cuDNN fused attention (flash attention, forward and backward): "__cudnn$fmhaSoftmax",
# "__cudnn$fmhaSoftmaxBackward", ... Pallas kernels on a TPU lower to "tpu_custom_call".
_FUSED_ATTENTION_TARGETS = re.compile(r'custom_call_target="(__cudnn\$fmha[^"]*|tpu_custom_call)"')
# An instruction: "%name = TYPE op(" where TYPE is an array ("f32[2,3]{1,0}") or a tuple ("(...)").
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?) ([a-z\-]+)\(",
                          re.MULTILINE)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class ProgramStructure:
    """Counts of the instructions that decide an accelerator program's speed and memory.

    fused_attention_calls: cuDNN fMHA or Pallas (TPU) custom calls; transposes; copies; while_loops.
    """

    fused_attention_calls: int
    transposes: int
    copies: int
    while_loops: int

    @classmethod
    def from_hlo(cls, text: str) -> "ProgramStructure":
        ops = collections.Counter(op for _, op in _INSTRUCTION.findall(text))
        return cls(fused_attention_calls=len(_FUSED_ATTENTION_TARGETS.findall(text)),
                   transposes=ops["transpose"], copies=ops["copy"], while_loops=ops["while"])


def result_shapes(text: str, op: str | None = None) -> collections.Counter:
    """How many instructions (of kind `op`, e.g. "copy"; None: all) produce each array shape,
    keyed by (dtype, dims) such as ("f32", (2048, 5632)); a tuple result counts each element."""
    shapes = collections.Counter()
    for result, kind in _INSTRUCTION.findall(text):
        if op is not None and kind != op:
            continue
        for dtype, dims in _ARRAY.findall(result):
            shapes[dtype, tuple(int(d) for d in dims.split(",") if d)] += 1
    return shapes
