"""Environments: what answers the policy between its turns in a multi-turn episode.

One environment object per row and episode (it may keep the episode's state):

    env = make_environment(**kwargs)           # the factory a config names
    prompt = env.reset(record)                 # the first turn's prompt text
    result = env.step(turn_text, turn_token_ids)
    # -> StepResult(observation, reward, done): the observation's text is appended to the row as
    #    context (not actions) and decoding goes on, until `done`.

A config names the factory like a reward function: a registered name (`@register("name")`) or an
import path "module:function" (resolved by `ppo_jax.reward_functions.resolve`, the one importer of
user code). `ToolEnvironment` is the built-in one: it runs the tool calls of each turn. `step_all`
steps many rows at once on a thread pool (tools are subprocesses or I/O, so threads suffice).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ppo_jax import reward_functions
from ppo_jax.agentic import tool_format, tools as tools_lib
from ppo_jax.config import ConfigError, check


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment answers to one turn. `reward` is this turn's (an end-of-episode reward is
    the last step's); `info` holds counts for the run's metrics (e.g. tool_calls, tool_errors)."""

    observation: str
    reward: float
    done: bool
    info: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn the policy wrote: its text and its token ids [T_turn]."""

    text: str
    token_ids: Sequence[int]


class Environment(Protocol):
    """`stop_strings`: where a turn ends and the environment is stepped (e.g. the close of a tool
    call); the row's end-of-sequence token ends a turn too."""

    stop_strings: Sequence[str]

    def reset(self, record: Mapping[str, Any]) -> str:
        """Starts an episode from a prompt record ({"prompt": ..., ...}); returns the first prompt text."""

    def step(self, turn_text: str, turn_token_ids: Sequence[int]) -> StepResult:
        """The policy's turn -> the observation, this turn's reward and whether the episode ends."""


EnvironmentFactory = Callable[..., Environment]
_REGISTRY: dict[str, EnvironmentFactory] = {}


def register(name: str):
    """Decorator: makes an environment factory available to configs under `name`."""

    def wrap(factory: EnvironmentFactory) -> EnvironmentFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def resolve(spec: str, field: str = "environment.name") -> EnvironmentFactory:
    """A registered name or "module:function" -> the factory, or one ConfigError line naming `field`."""
    spec = spec.strip()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    check(":" in spec, f"{field}={spec!r} is not a registered environment (registered: {sorted(_REGISTRY)}); "
                       "use a registered name or 'module:function', which imports the module")
    try:
        factory = reward_functions.resolve(spec)
    except ValueError as e:  # its message names a "reward function": the import part is what matters here
        raise ConfigError(f"{field}={spec!r} does not resolve: "
                          f"{str(e).removeprefix(f'reward function {spec!r}: ')}") from None
    return factory


def check_turn_stop(tokenizer: Any, stop: str, field: str = "environment.turn_stop") -> None:
    """A turn stop marker must survive encode -> decode, or the sampler could never see it (a word
    tokenizer turns an unknown word into <unk>)."""
    ids = tokenizer.encode(stop, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    check(bool(ids) and stop in decoded,
          f"{field}={stop!r}: the tokenizer cannot encode it (it decodes to {decoded!r}); pick a marker "
          "made of the tokenizer's own tokens")


# ----------------------------------------------------------------------------------------------
# Tools as an environment.

_TOOLS: dict[str, Callable[[], tools_lib.Tool]] = dict(tools_lib.BUILTIN_TOOLS)


def register_tool(name: str):
    """Decorator: a zero-argument function returning a `Tool`, available to configs under `name`."""

    def wrap(make: Callable[[], tools_lib.Tool]) -> Callable[[], tools_lib.Tool]:
        _TOOLS[name] = make
        return make

    return wrap


def resolve_tools(names: str | Sequence[str], field: str = "rollout.tools",
                  trusted_tool_code: bool = False) -> list[tools_lib.Tool]:
    """Comma-separated (or listed) tool names -> the tools, or one ConfigError line for a name that is
    not declared (built in or `register_tool`-ed). `trusted_tool_code` reaches the tools whose factory
    takes `trusted_code` (the sandboxed `python`: run without the kernel boundary where it is missing)."""
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in names if n not in _TOOLS]
    check(not unknown, f"{field}: tool(s) {unknown} are not declared (declared: {sorted(_TOOLS)}); "
                       "register one with ppo_jax.agentic.environment.register_tool")
    check(len(set(names)) == len(names), f"{field}={names}: a tool is named twice")
    return [_TOOLS[n](**({"trusted_code": True} if trusted_tool_code and _takes(_TOOLS[n], "trusted_code") else {}))
            for n in names]


def _takes(function: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


class ToolEnvironment:
    """Runs the tool calls in each turn and answers with their results in `<tool_result>` tags. The
    episode ends at a turn without a tool call (the answer) or after `max_turns` turns; then `reward`
    (record, the policy's whole text) -> float is paid, 0.0 without one (the run's reward functions and
    reward model score the final text anyway). Not thread-safe: one instance per row."""

    stop_strings = (tool_format.TURN_STOP,)

    def __init__(self, tools: Sequence[tools_lib.Tool], max_turns: int = 4,
                 reward: Callable[[Mapping[str, Any], str], float] | None = None, tokenizer: Any = None):
        check(max_turns >= 1, f"environment.max_turns={max_turns}: an episode needs at least 1 turn")
        self.tools = {tool.name: tool for tool in tools}
        self.max_turns, self.reward, self.tokenizer = max_turns, reward, tokenizer
        self._record: Mapping[str, Any] | None = None
        self._turns: list[str] = []

    def reset(self, record: Mapping[str, Any]) -> str:
        self._record, self._turns = record, []
        # A chat record brings its own messages; a plain one is a single user message.
        messages = record.get("messages") or [{"role": "user", "content": str(record["prompt"])}]
        return tool_format.render_conversation(messages, list(self.tools.values()), self.tokenizer)

    def step(self, turn_text: str, turn_token_ids: Sequence[int]) -> StepResult:
        if self._record is None:
            raise RuntimeError("ToolEnvironment.step before reset")
        self._turns.append(turn_text)
        try:
            calls = tool_format.parse_tool_calls(turn_text)
        except tool_format.ToolCallError as e:
            return self._answer([f"error: {e}"], calls=1, errors=1, timeouts=0)
        if not calls:
            return self._end({"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0})
        observations = [self._call(call) for call in calls]
        outcomes = [tools_lib.outcome(o) for o in observations]
        errors, timeouts = outcomes.count("error"), outcomes.count("timeout")
        return self._answer(observations, calls=len(calls), errors=errors, timeouts=timeouts)

    def _call(self, call: tool_format.ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: there is no tool {call.name!r}; the tools are {sorted(self.tools)}"
        return tool(call.arguments)

    def _answer(self, observations: list[str], calls: int, errors: int, timeouts: int) -> StepResult:
        info = {"tool_calls": float(calls), "tool_errors": float(errors), "tool_timeouts": float(timeouts)}
        if len(self._turns) >= self.max_turns:
            return self._end(info)
        text = "".join(tool_format.render_tool_result(o) for o in observations)
        return StepResult(observation=text, reward=0.0, done=False, info=info)

    def _end(self, info: Mapping[str, float]) -> StepResult:
        reward = float(self.reward(self._record, "".join(self._turns))) if self.reward else 0.0
        return StepResult(observation="", reward=reward, done=True, info=info)


@register("tools")
def tool_environment(tools: str | Sequence[str] = "calculator", max_turns: int = 4,
                     reward: Callable[[Mapping[str, Any], str], float] | None = None,
                     tokenizer: Any = None, trusted_tool_code: bool = False) -> ToolEnvironment:
    """The registered "tools" environment: `ToolEnvironment` over tools named in a config
    (`environment.trusted_tool_code` reaches the sandboxed tools: `resolve_tools`)."""
    return ToolEnvironment(resolve_tools(tools, trusted_tool_code=trusted_tool_code), max_turns=max_turns,
                           reward=reward, tokenizer=tokenizer)


# ----------------------------------------------------------------------------------------------
# Many rows at once.


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """`results[i]` answers `turns[i]`; `seconds[i]` is how long row i's step took and `wall_seconds`
    the whole batch's (`time/environment`): close to max(seconds) when the rows ran in parallel."""

    results: tuple[StepResult, ...]
    seconds: tuple[float, ...]
    wall_seconds: float


def timed_step(env: Environment, turn: Turn) -> tuple[StepResult, float]:
    """Steps `env` with `turn`: (its result, the seconds it took)."""
    start = time.perf_counter()
    result = env.step(turn.text, turn.token_ids)
    return result, time.perf_counter() - start


class EnvironmentFailure(RuntimeError):
    """An environment raised or answered with something else than a StepResult: a bug in it, not
    the policy's doing. `row` is the batch row it answers."""

    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


def step_all(envs: Sequence[Environment], turns: Sequence[Turn], max_workers: int = 16,
             rows: Sequence[int] | None = None) -> StepBatch:
    """Steps `envs[i]` with `turns[i]` for every waiting row, all at once on up to `max_workers` threads
    (rows wait for their environments in parallel, never one after another). An environment that
    raises propagates as EnvironmentFailure, naming its row: `rows[i]`, or i without `rows`."""
    check(len(envs) == len(turns), f"step_all: {len(envs)} environments but {len(turns)} turns")
    check(max_workers >= 1, f"environment.workers={max_workers}: use at least 1")
    start = time.perf_counter()
    if not envs:
        return StepBatch(results=(), seconds=(), wall_seconds=0.0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(max_workers, len(envs)),
                                               thread_name_prefix="environment") as pool:
        futures = [pool.submit(timed_step, env, turn) for env, turn in zip(envs, turns)]
        named = range(len(futures)) if rows is None else rows
        results, seconds = zip(*(step_outcome(int(row), future) for row, future in zip(named, futures)))
    return StepBatch(results=tuple(results), seconds=tuple(seconds), wall_seconds=time.perf_counter() - start)


def step_outcome(row: int, future: concurrent.futures.Future) -> tuple[StepResult, float]:
    """The (result, seconds) of a `timed_step` future, waited for: an environment that raises or
    returns something else is a bug in it, not the policy's doing, and the error names its row."""
    try:
        result, seconds = future.result()
    except Exception as e:
        raise EnvironmentFailure(row, f"the environment of row {row} raised {type(e).__name__}: {e}") from e
    if not isinstance(result, StepResult):
        raise EnvironmentFailure(row, f"the environment of row {row} returned {type(result).__name__}, not a "
                                      "StepResult")
    return result, seconds
