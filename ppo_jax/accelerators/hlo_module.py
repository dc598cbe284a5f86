"""An optimised HLO module's text (`compiled.as_text()`) read as computations of instructions.

Only what a static profile needs (`profile.py`): each instruction's name, result type, opcode,
operands, the computations it calls and its attributes, and the computations in the text. Nothing is
re-derived that the text does not say; the text is XLA's own, after every optimisation pass.
"""

from __future__ import annotations

import dataclasses
import json
import re

# Attributes naming the computations an instruction runs: a fusion's body, a reduction's combiner, a
# while's body and condition, a conditional's branches, an async op's wrapped computation.
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")

# Bytes per element of the HLO primitive types (pred and the 8-bit floats are one byte).
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group that opens at text[start] ("(", "{" or "[")."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    quoted = False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        if quoted:
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 80]!r}")


def array_shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(dtype, dims)] of every array in a result type ("bf16[2,3]{1,0}" or a tuple of them)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(_COMMENT.sub("", type_text))]


def type_bytes(type_text: str) -> float:
    """Bytes of every array in a result type."""
    total = 0.0
    for dtype, dims in array_shapes(type_text):
        n = 1
        for d in dims:
            n *= d
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `%name = type opcode(operands), attributes`."""

    name: str
    type: str  # the result type as printed, e.g. "bf16[64,2048]{1,0}" or "(s32[], f32[4])"
    opcode: str
    operands: tuple[str, ...]  # operand instruction names (constants' literals are not operands)
    attributes: str  # everything after the operand list, metadata included
    line: str  # the whole line

    @property
    def called(self) -> tuple[str, ...]:
        """Names of the computations this instruction runs."""
        names = [name for _, name in _CALLED.findall(self.attributes)]
        for _, inner in _CALLED_LIST.findall(self.attributes):
            names += [n.strip().lstrip("%") for n in inner.split(",") if n.strip()]
        return tuple(names)

    def called_as(self, role: str) -> str | None:
        """The computation of one attribute ("body", "condition", "calls", ...), None if absent."""
        for attribute, name in _CALLED.findall(self.attributes):
            if attribute == role:
                return name
        return None

    @property
    def custom_call_target(self) -> str:
        match = _TARGET.search(self.attributes)
        return match.group(1) if match else ""

    @property
    def fusion_kind(self) -> str:
        """kLoop, kInput (a reduction), kOutput, kCustom (a Triton GEMM or another emitter); "" if not a fusion."""
        match = _FUSION_KIND.search(self.attributes) if self.opcode == "fusion" else None
        return match.group(1) if match else ""

    @property
    def backend_config(self) -> dict:
        """The JSON backend config ({} where there is none or it is not JSON)."""
        start = self.attributes.find("backend_config=")
        if start < 0:
            return {}
        brace = self.attributes.find("{", start)
        if brace < 0 or brace != start + len("backend_config="):
            return {}
        try:
            return json.loads(self.attributes[brace:_balanced_end(self.attributes, brace)])
        except ValueError:
            return {}

    @property
    def known_trip_count(self) -> int | None:
        """A while loop's trip count when XLA proved it (its backend config), else None: a loop whose
        condition reads device data, which XLA:GPU evaluates on the host after every iteration."""
        n = self.backend_config.get("known_trip_count", {}).get("n")
        return int(n) if n is not None else None

    @property
    def op_name(self) -> str:
        """The JAX op path from the metadata ("jit(update)/while/body/..."), "" where there is none."""
        match = re.search(r'op_name="([^"]*)"', self.attributes)
        return match.group(1) if match else ""

    def without_metadata(self) -> str:
        """The attribute text with its metadata and control dependencies left out: both refer to
        tables and instructions outside the instruction."""
        text = self.attributes
        for key in ("metadata={", "control-predecessors={"):
            while (start := text.find(key)) >= 0:
                end = _balanced_end(text, start + len(key) - 1)
                text = text[:start].rstrip(", ") + ", " + text[end:].lstrip(", ")
        return text.strip(", ")


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    header: str  # "%name (p0: T0, ...) -> T"
    instructions: tuple[Instruction, ...]

    def types(self) -> dict[str, str]:
        """Instruction name -> result type."""
        return {i.name: i.type for i in self.instructions}


@dataclasses.dataclass(frozen=True)
class Module:
    """The computations of one optimised HLO module and the name of its entry."""

    computations: dict[str, Computation]
    entry: str

    @classmethod
    def from_text(cls, text: str) -> "Module":
        computations, entry = {}, None
        current, header, instructions = None, "", []
        for line in text.splitlines():
            stripped = line.strip()
            if current is None:
                is_entry = stripped.startswith("ENTRY %")
                if (is_entry or stripped.startswith("%")) and stripped.endswith("{") and " = " not in stripped:
                    header = stripped[len("ENTRY "):] if is_entry else stripped
                    current = header.split()[0].lstrip("%")
                    entry = current if is_entry else entry
                    header, instructions = header[:-1].rstrip(), []
                continue
            if stripped == "}":
                computations[current] = Computation(current, header, tuple(instructions))
                current = None
            elif stripped:
                instructions.append(parse_instruction(stripped))
        if entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        return cls(computations, entry)

    def reachable(self, names) -> list[str]:
        """`names` and every computation they call, callees before their callers."""
        order, seen = [], set()

        def visit(name):
            if name in seen:
                return
            seen.add(name)
            for instruction in self.computations[name].instructions:
                for callee in instruction.called:
                    visit(callee)
            order.append(name)

        for name in names:
            visit(name)
        return order


def parse_instruction(line: str) -> Instruction:
    """One instruction line (without leading whitespace)."""
    body = line[len("ROOT "):] if line.startswith("ROOT ") else line
    name, rest = body.split(" = ", 1)
    if rest.startswith("("):
        end = _balanced_end(rest, 0)
        type_text, rest = rest[:end], rest[end:].lstrip()
    else:
        type_text, rest = rest.split(" ", 1)
    paren = rest.index("(")
    opcode = rest[:paren]
    end = _balanced_end(rest, paren)
    operand_text = rest[paren + 1:end - 1]
    operands = tuple(m.group(1) for m in re.finditer(r"%([\w.\-]+)", _COMMENT.sub("", operand_text)))
    return Instruction(name=name.lstrip("%"), type=type_text, opcode=opcode, operands=operands,
                       attributes=rest[end:].lstrip(", "), line=line)
