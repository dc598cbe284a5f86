"""Tools a policy may call inside an episode: a name, a description, JSON-schema parameters and a call
that turns arguments into an observation string.

    calc = calculator()
    calc({"expression": "123456789 * 987654321"})   # "121932631112635269"
    calc({"expression": "1/0"})                     # "error: division by zero"

A tool never raises on the policy's input: bad arguments and failures come back as an observation
starting with "error:", because the episode goes on and the policy should see what it did wrong.
`Tool.schema()` is the OpenAI-style function description that chat templates take as `tools`.
"""

from __future__ import annotations

import ast
import dataclasses
import decimal
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from ppo_jax.agentic import sandbox

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


@dataclasses.dataclass(frozen=True)
class Tool:
    """One callable tool. `run` gets arguments already checked against `parameters` (required keys
    present, no unknown keys, JSON types right) and returns the observation text."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema of type "object"
    run: Callable[[Mapping[str, Any]], str]

    def schema(self) -> dict:
        """The function description `tokenizer.apply_chat_template(..., tools=[...])` accepts."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": dict(self.parameters)}}

    def check_arguments(self, arguments: Any) -> str | None:
        """What is wrong with `arguments` for this tool (one line), or None."""
        if not isinstance(arguments, Mapping):
            return f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
        properties = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", ()) if k not in arguments]
        if missing:
            return f"{self.name} needs argument(s) {missing}; it takes {sorted(properties)}"
        unknown = [k for k in arguments if k not in properties]
        if unknown:
            return f"{self.name} has no argument(s) {unknown}; it takes {sorted(properties)}"
        for key, value in arguments.items():
            expected = _JSON_TYPES.get(properties[key].get("type", ""), object)
            if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
                return f"argument {key!r} of {self.name} must be a {properties[key]['type']}, got {value!r}"
        return None

    def __call__(self, arguments: Any) -> str:
        problem = self.check_arguments(arguments)
        if problem is not None:
            return f"error: {problem}"
        try:
            return self.run(arguments)
        except sandbox.SandboxSetupError:
            raise  # the host cannot run tools safely: the run stops, the policy is not to blame
        except Exception as e:  # a tool's own bug must not end the run: the observation says it
            return f"error: {self.name} failed: {type(e).__name__}: {e}"


def outcome(observation: str) -> str:
    """"ok", "error" or "timeout": how a tool call went, read off its observation (for the metrics
    tool errors and time-outs). Tools say failure with an "error" prefix; the sandbox's observations
    start "error", "stopped: ..." or "killed"."""
    if observation.startswith(("stopped: time limit", "stopped: CPU time limit")):
        return "timeout"
    if observation.startswith(("error", "stopped:", "killed")):
        return "error"
    return "ok"


# ----------------------------------------------------------------------------------------------
# The calculator: exact integers and rationals, evaluated by walking the AST (never eval).

MAX_EXPRESSION_CHARS = 2000
# 8,192 bits ~ 2,466 digits: `9**9**9` would otherwise run for minutes, and Python refuses to print an
# int of more than 4,300 digits (sys.set_int_max_str_digits).
MAX_RESULT_BITS = 1 << 13


class CalculatorError(ValueError):
    """An expression the calculator does not take; the message is the observation."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def _bits(x: Fraction) -> int:
    return max(x.numerator.bit_length(), x.denominator.bit_length())


def _decimal_literal(text: str) -> Fraction:
    """A decimal literal as written ("0.1" is 1/10, not the nearest binary float). Its exponent is
    checked first: Fraction("1e999999999") would compute a billion-digit power of ten."""
    number = decimal.Decimal(text.replace("_", ""))
    if abs(number.adjusted()) > MAX_RESULT_BITS // 3:  # 10**e has ~3.3 e bits
        raise CalculatorError(f"the number {text[:20]} is too large or too small (over {MAX_RESULT_BITS} bits)")
    return Fraction(number)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("the exponent must be an integer (results stay exact rationals)")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if abs(exponent) > 1 and _bits(base) * abs(exponent) > MAX_RESULT_BITS and abs(base) != 1:
        raise CalculatorError(f"the result would have more than {MAX_RESULT_BITS} bits")
    return Fraction(base) ** int(exponent)


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, source)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = _decimal_literal(ast.get_source_segment(source, node)) if isinstance(node.value, float) else \
            Fraction(node.value)
        if _bits(value) > MAX_RESULT_BITS:
            raise CalculatorError(f"the number {ast.get_source_segment(source, node)[:20]}... has more than "
                                  f"{MAX_RESULT_BITS} bits")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, source)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and (isinstance(node.op, ast.Pow) or type(node.op) in _BINARY):
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalculatorError("division by zero")
        # Fraction // Fraction is an int, and int ** -n a float: every result goes back to a Fraction.
        result = Fraction(_BINARY[type(node.op)](left, right))
        if _bits(result) > MAX_RESULT_BITS:
            raise CalculatorError(f"the result would have more than {MAX_RESULT_BITS} bits")
        return result
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = "a function call"
    elif isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    elif isinstance(node, ast.Constant):
        what = f"the literal {node.value!r}"
    raise CalculatorError(f"{what} is not allowed: use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, or CalculatorError naming what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"not an arithmetic expression ({getattr(e, 'msg', e)})") from None
    try:
        return _evaluate(tree, source)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Fraction) -> str:
    """An integer as its digits, a rational as "numerator/denominator" (lowest terms)."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _run_calculator(arguments: Mapping[str, Any]) -> str:
    try:
        return format_number(calculate(arguments["expression"]))
    except CalculatorError as e:
        return f"error: {e}"


def calculator() -> Tool:
    return Tool(name="calculator",
                description="Exact arithmetic on integers and fractions: + - * / // % ** and parentheses.",
                parameters={"type": "object",
                            "properties": {"expression": {"type": "string",
                                                          "description": "e.g. (12345 * 6789) // 7"}},
                            "required": ["expression"]},
                run=_run_calculator)


def python(limits: sandbox.Limits = sandbox.Limits(), trusted_code: bool = False) -> Tool:
    """Runs the code in the sandbox (`sandbox.run_python`); the observation is what it printed, or how it
    failed (the sandbox's observation: error text, time-out, memory or output limit). `trusted_code`:
    where the kernel boundary cannot be set up, run the code anyway (`Limits.trusted_code`)."""
    if trusted_code:
        limits = dataclasses.replace(limits, trusted_code=True)

    def run(arguments: Mapping[str, Any]) -> str:
        return sandbox.run_python(arguments["code"], limits).observation()

    return Tool(name="python",
                description="Runs Python 3 code (standard library only) in a sandbox with no network and "
                            "only /sandbox writable, and returns what it printed.",
                parameters={"type": "object",
                            "properties": {"code": {"type": "string", "description": "a Python program; "
                                                                                     "print the result"}},
                            "required": ["code"]},
                run=run)


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": calculator, "python": python}
