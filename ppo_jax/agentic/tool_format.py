"""How tool calls and their results appear in the text the policy reads and writes.

The plain tag format (the one Qwen's and Hermes' chat templates use, so a model trained on those
already writes it):

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>
    <tool_result>408</tool_result>

A turn that calls a tool ends at TURN_STOP (the close tag), where the sampler hands the row to its
environment. Declaring the tools to the policy goes through the tokenizer's chat template when it
takes `tools` (transformers' `apply_chat_template(..., tools=[...])`: Qwen 2.5, Llama 3.1, Hermes),
else through `tool_instructions`, a plain system text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_jax.agentic.tools import Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"
TURN_STOP = CALL_CLOSE  # where a tool-calling turn ends


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


class ToolCallError(ValueError):
    """A tool call the policy wrote that cannot be read; the message is the observation it gets back."""


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos}): "
                            f'write {CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}') from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('the tool call must be a JSON object with a string "name" and an object '
                            '"arguments"')
    # "parameters" is Llama 3.1's spelling; OpenAI-style calls carry the arguments as a JSON string.
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        raise ToolCallError(f'the "arguments" of the tool call to {call["name"]!r} must be a JSON object, '
                            f"got {arguments!r}")
    return ToolCall(name=call["name"], arguments=arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` in `text`, in order ([] when there is none). Raises
    ToolCallError, with a message meant for the policy, on a call that cannot be read."""
    calls, position = [], 0
    while (start := text.find(CALL_OPEN, position)) >= 0:
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            raise ToolCallError(f"{CALL_OPEN} without {CALL_CLOSE}: the tool call is not finished")
        calls.append(_parse_one(text[start + len(CALL_OPEN): end].strip()))
        position = end + len(CALL_CLOSE)
    return calls


def render_tool_call(call: ToolCall) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': call.name, 'arguments': dict(call.arguments)})}{CALL_CLOSE}"


def render_tool_result(observation: str) -> str:
    return f"{RESULT_OPEN}{observation}{RESULT_CLOSE}"


def tool_instructions(tools: Sequence[Tool]) -> str:
    """The plain format's declaration of `tools`, for a system message."""
    lines = ["You may call these tools. To call one, write", f'{CALL_OPEN}{{"name": <tool name>, "arguments": '
             f"<arguments object>}}{CALL_CLOSE}", f"and its answer comes back as {RESULT_OPEN}...{RESULT_CLOSE}.",
             "Tools:"]
    lines += [json.dumps(tool.schema()["function"]) for tool in tools]
    return "\n".join(lines)


def template_accepts_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument (it names the variable). A
    template that ignores `tools` would silently hide the tools from the policy."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the one apply_chat_template uses for tools
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def _plain_message(message: Mapping[str, str]) -> str:
    if message["role"] == "tool":
        return render_tool_result(message["content"])
    return f"{message['role']}: {message['content']}"


def render_conversation(messages: Sequence[Mapping[str, str]], tools: Sequence[Tool], tokenizer: Any = None,
                        add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation ([{"role", "content"}], roles system/user/assistant/tool) with
    `tools` declared: through the tokenizer's chat template when it takes tools, else in the plain
    format (a system message of `tool_instructions`, one "role: content" line per message, tool
    results in their tags)."""
    if tokenizer is not None and template_accepts_tools(tokenizer):
        return tokenizer.apply_chat_template(list(map(dict, messages)), tools=[t.schema() for t in tools],
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    lines = [f"system: {tool_instructions(tools)}"] if tools else []
    lines += [_plain_message(m) for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)
