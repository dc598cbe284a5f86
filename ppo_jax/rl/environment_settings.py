"""Multi-turn PPO settings (the config's `environment` section, issue 45): which environment answers
the policy between its turns, how many turns, where a turn ends, how long an observation may be.

`environment.name` = "" (the default) is a one-turn run: nothing below changes its programs. Set, the
rollouts are multi-turn episodes (`rl/episodes.py`, on `agentic/rollout.py`) and the PPO math runs
over the policy's tokens only (`Rollout.action_mask`).

Checked in two places, both before anything compiles: `validate` (the name resolves, the numbers,
the settings multi-turn rows cannot take yet) while the config is read, and `turn_stops` once the
tokenizer is loaded (a stop marker it cannot encode).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

from ppo_jax.config import check


@dataclasses.dataclass(frozen=True)
class EnvironmentSettings:
    """Multi-turn episodes: an environment steps each row's turns (docs/agentic.md)."""

    name: str = ""  # the environment factory: a registered name ("tools"; "arithmetic" once ppo_jax.arithmetic is imported, as ppo-jax-train does) or "module:function"; "" = one-turn rollouts
    max_turns: int = 4  # policy turns per episode (>= 1); also passed to a factory that takes max_turns
    turn_stop: str = ""  # comma-separated markers that end a turn and step the environment (e.g. "</tool_call>"); "" = the environment's stop_strings
    workers: int = 16  # threads stepping the waiting rows' environments at once
    max_observation_tokens: int = 32  # tokens one observation may append (longer ones are cut; the row's total is rollout.response_length)
    # The tools' code is trusted: where the sandbox's kernel boundary (bwrap, user namespaces) cannot be
    # set up, the `python` tool runs the code as this user with rlimits and seccomp only, and says so in
    # the log; False (the default) stops the run in one line instead (docs/agentic.md, threat model).
    trusted_tool_code: bool = False
    segment_steps: int = 8  # rollout.engine=continuous: decode steps between the host's looks at the rows (a row's environment is stepped, and its observation appended, at the first look after its turn ends or it answers)
    # rollout.slots with an environment (continuous engine): 0 = a cache row per episode for its whole
    # life; S = S decode slots shared by the episodes, a waiting episode's slot given to another and
    # the episode re-prefilled when its environment answers (agentic/slot_rollout.py);
    # rollout.prefill_prompts = the episodes one insert re-prefills (0: a quarter of the slots).

    @property
    def enabled(self) -> bool:
        return bool(self.name.strip())

    def validate(self, *, engine: str, slots: int, prefill_prompts: int, router_replay: bool,
                 chat_template: bool) -> None:
        """Every check that needs no tokenizer: the numbers, the name resolves, and the rollout
        settings multi-turn rows do not support yet (each one ConfigError line)."""
        if not self.enabled:
            return
        check(self.max_turns >= 1, f"environment.max_turns={self.max_turns}: an episode needs at least 1 turn")
        check(self.workers >= 1, f"environment.workers={self.workers}: use at least 1 thread")
        check(self.max_observation_tokens >= 1,
              f"environment.max_observation_tokens={self.max_observation_tokens}: use at least 1")
        check(self.segment_steps >= 1, f"environment.segment_steps={self.segment_steps}: use at least 1 decode step")
        check(not prefill_prompts or 0 < prefill_prompts <= slots, f"environment.name={self.name!r} with "
              f"rollout.prefill_prompts={prefill_prompts}: it is the episodes one insert re-prefills, at most the "
              f"rollout.slots={slots} slots (0: a quarter of them)")
        check(not (router_replay and engine == "continuous" and slots), f"environment.name={self.name!r} with "
              f"moe.router_replay and rollout.slots={slots}: the slot schedule routes a re-prefilled episode's "
              "tokens a second time, and one record cannot replay both; set rollout.slots=0 (a decode row per "
              "episode) or moe.router_replay=False")
        check(not chat_template, f"environment.name={self.name!r} with data.chat_template: the environment's "
              "reset renders the prompt (ToolEnvironment applies the chat template itself); set "
              "data.chat_template=False")
        self.factory()  # resolves, or one line naming environment.name

    def factory(self) -> Callable[[], Any]:
        """A zero-argument environment factory: the named one, given `max_turns` and `tokenizer`
        when it takes them (bound later by `bind`)."""
        from ppo_jax.agentic import environment

        return environment.resolve(self.name, field="environment.name")

    def bind(self, tokenizer: Any) -> Callable[[], Any]:
        """The factory with the keyword arguments it accepts among max_turns and tokenizer: the
        registered ToolEnvironments end their episodes after `max_turns` and render prompts with
        the tokenizer's chat template."""
        factory = self.factory()
        offered = {"max_turns": self.max_turns, "tokenizer": tokenizer}
        if self.trusted_tool_code:
            offered["trusted_tool_code"] = True
            logging.getLogger(__name__).warning(
                "environment.trusted_tool_code=True: tool code runs without the sandbox's kernel boundary "
                "wherever that cannot be set up (docs/agentic.md)")
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # a builtin or C callable: call it bare
            return factory
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
        return lambda: factory(**kwargs)

    def turn_stops(self, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
        """The turn-stop markers as token-id sequences: `turn_stop`, or the environment's own
        `stop_strings` (read off one instance); a marker the tokenizer cannot encode is one
        ConfigError line (`environment.check_turn_stop`)."""
        from ppo_jax.agentic import environment

        markers = [m.strip() for m in self.turn_stop.split(",") if m.strip()]
        if not markers:
            markers = list(getattr(self.bind(tokenizer)(), "stop_strings", ()))
        check(bool(markers), f"environment.name={self.name!r} names no stop_strings: set environment.turn_stop "
              "(the marker that ends a turn)")
        for marker in markers:
            environment.check_turn_stop(tokenizer, marker, field="environment.turn_stop")
        return tuple(tuple(tokenizer.encode(m, add_special_tokens=False)) for m in markers)
