"""A task where the tool matters: multiply two long numbers.

    prompt:   "what is 483921 * 705316"
    answer:   "341318425236"

Products of two 6-digit numbers are far past what a tiny policy can compute in its head, and exact
with the calculator. The reward is exact match of the final answer (`arithmetic_exact`, a registered
reward function): the last integer the response states outside tool calls and tool results.

The SFT demonstrations call the calculator and are imperfect on purpose (`demonstration`): a share
copy a digit of the question wrong into the call, or misread the tool's result, so the SFT policy
imitates mistakes and RL on the 1/0 reward has something to correct. Train and eval prompts are
disjoint: a prompt's split is a fixed hash of its numbers. The SFT-then-RL run on it:
`python -m ppo_jax.arithmetic` (arithmetic/pipeline.py, docs/agentic.md).
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ppo_jax import reward_functions
from ppo_jax.agentic import environment, tool_format, tools

_PROMPT = re.compile(r"^what is (\d+) \* (\d+)$")
_TAGGED = re.compile(re.escape(tool_format.CALL_OPEN) + ".*?(?:" + re.escape(tool_format.CALL_CLOSE) + "|$)|"
                     + re.escape(tool_format.RESULT_OPEN) + ".*?(?:" + re.escape(tool_format.RESULT_CLOSE) + "|$)",
                     flags=re.S)
_INTEGER = re.compile(r"-?\d+")


def prompt_for(a: int, b: int) -> str:
    return f"what is {a} * {b}"


def operands(prompt: str) -> tuple[int, int]:
    match = _PROMPT.match(prompt.strip())
    if match is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    return int(match.group(1)), int(match.group(2))


def answer(prompt: str) -> str:
    a, b = operands(prompt)
    return str(a * b)


def final_answer(response: str) -> str | None:
    """The last integer the response states outside tool calls and tool results (None if there is
    none): copying a number out of a tool result into the answer is the skill being learned."""
    numbers = _INTEGER.findall(_TAGGED.sub(" ", response))
    return numbers[-1] if numbers else None


def is_correct(prompt: str, response: str) -> bool:
    return final_answer(response) == answer(prompt)


@reward_functions.register("arithmetic_exact")
def arithmetic_exact(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """1.0 when the final answer is the exact product, else 0.0."""
    return [float(is_correct(p, r)) for p, r in zip(prompts, responses)]


def _split_of(a: int, b: int) -> str:
    # The pair's split is a hash of the unordered pair, so "a * b" and "b * a" land together.
    key = f"{min(a, b)}*{max(a, b)}".encode()
    return "eval" if zlib.crc32(key) % 5 == 0 else "train"


@dataclasses.dataclass(frozen=True)
class Turn:
    """One message of a demonstration: role "assistant" (the policy's text) or "tool" (an observation)."""

    role: str
    content: str


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Seeded prompts and demonstrations. `digits`: length of each factor; `wrong_rate`: the share of
    demonstrations with a mistake (half a mistyped call, half a misread result)."""

    seed: int = 0
    digits: int = 6
    wrong_rate: float = 0.25

    def __post_init__(self):
        if self.digits < 1:
            raise ValueError(f"arithmetic task: digits={self.digits} must be >= 1")
        if not 0.0 <= self.wrong_rate <= 1.0:
            raise ValueError(f"arithmetic task: wrong_rate={self.wrong_rate} must be in [0, 1]")

    def prompts(self, n: int, split: str = "train") -> list[str]:
        """`n` distinct prompts of `split` ("train" or "eval"), the same for the same seed."""
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: use 'train' or 'eval'")
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        seen: set[tuple[int, int]] = set()
        out = []
        for _ in range(1000 * n + 1000):  # enough draws unless the space is tiny
            if len(out) == n:
                break
            a, b = (int(x) for x in rng.integers(low, high, size=2))
            if (a, b) not in seen and _split_of(a, b) == split:
                seen.add((a, b))
                out.append(prompt_for(a, b))
        if len(out) < n:
            raise ValueError(f"only {len(out)} distinct {split} prompts with digits={self.digits}, asked {n}")
        return out

    def demonstration(self, prompt: str, index: int) -> list[Turn]:
        """A worked episode with the calculator: the call, its result, the answer; deterministic in
        (seed, index). Wrong ones either mistype a digit in the call (and answer the wrong product the
        tool returned) or misread one digit of the right result."""
        a, b = operands(prompt)
        rng = np.random.default_rng([self.seed, 2, index])
        mistake = rng.random() < self.wrong_rate
        typo = mistake and rng.random() < 0.5
        if typo:
            a = _change_digit(a, rng)
        call = tool_format.ToolCall("calculator", {"expression": f"{a} * {b}"})
        result = tools.calculator()(call.arguments)
        stated = _change_digit(int(result), rng) if mistake and not typo else int(result)
        return [Turn("assistant", tool_format.render_tool_call(call)),
                Turn("tool", tool_format.render_tool_result(result)),
                Turn("assistant", f"the answer is {stated}")]

    def demonstrations(self, n: int) -> list[tuple[str, list[Turn]]]:
        """`n` (prompt, demonstration) pairs from the train split."""
        return [(p, self.demonstration(p, i)) for i, p in enumerate(self.prompts(n, "train"))]


def _change_digit(value: int, rng: np.random.Generator) -> int:
    """`value` with one digit replaced by a different one (never a leading zero)."""
    digits = list(str(value))
    position = int(rng.integers(len(digits)))
    choices = [d for d in "0123456789" if d != digits[position] and not (position == 0 and d == "0")]
    digits[position] = choices[int(rng.integers(len(choices)))]
    return int("".join(digits))


def record_reward(record: Mapping[str, Any], text: str) -> float:
    """The environment's end-of-episode reward: `arithmetic_exact` on the record's prompt."""
    return float(is_correct(str(record["prompt"]), text))


@environment.register("arithmetic")
def arithmetic_environment(max_turns: int = 3, tokenizer: Any = None) -> environment.ToolEnvironment:
    """The calculator as the only tool, paid 1.0 for the exact product at the end."""
    return environment.ToolEnvironment([tools.calculator()], max_turns=max_turns, reward=record_reward,
                                       tokenizer=tokenizer)
