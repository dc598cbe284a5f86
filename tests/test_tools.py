"""Tools and their text format (issue 45 item 4): the calculator is exact (checked against Python's
fractions on random expressions) and refuses anything but arithmetic; a malformed call or bad
arguments come back as a clear "error:" observation; the chat-template path renders the tools through
a tiny locally built tokenizer's template (no network)."""

import ast
import random
from fractions import Fraction

import pytest

from ppo_jax.agentic import tool_format, tools
from ppo_jax.agentic.sandbox import Limits
from ppo_jax.agentic.tool_format import ToolCall, ToolCallError

OPS = ["+", "-", "*", "/", "//", "%"]


def random_expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.25:
        n = rng.randint(-60, 60)
        return f"({n})" if n < 0 else str(n)
    if rng.random() < 0.15:  # a power with a small literal exponent, maybe negative
        return f"({random_expression(rng, depth - 1)}) ** ({rng.randint(-2, 3)})"
    if rng.random() < 0.1:
        return f"-({random_expression(rng, depth - 1)})"
    op = rng.choice(OPS)
    left, right = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    if rng.random() < 0.5:  # sometimes leave precedence to the parser
        return f"{left} {op} {right}"
    return f"({left}) {op} ({right})"


class _OverFractions(ast.NodeTransformer):
    """Python's own parse of the text with every literal and every result a Fraction (Fraction //
    Fraction is an int, and int / int a float, in plain Python)."""

    def _fraction(self, node):
        return ast.Call(func=ast.Name("Fraction", ast.Load()), args=[node], keywords=[])

    def visit_Constant(self, node):
        return self._fraction(node)

    def visit_BinOp(self, node):
        return self._fraction(self.generic_visit(node))


def python_fractions(text: str) -> Fraction:
    tree = ast.fix_missing_locations(_OverFractions().visit(ast.parse(text, mode="eval")))
    return eval(compile(tree, "<expected>", "eval"), {"Fraction": Fraction})  # noqa: S307 -- generated text


def test_the_calculator_agrees_with_pythons_fractions_on_random_expressions():
    rng = random.Random(0)
    checked = errors = 0
    for _ in range(400):
        text = random_expression(rng, depth=4)
        try:
            expected = python_fractions(text)
        except ZeroDivisionError:
            with pytest.raises(tools.CalculatorError, match="division by zero"):
                tools.calculate(text)
            errors += 1
            continue
        assert tools.calculate(text) == expected, text
        checked += 1
    assert checked > 300 and errors > 0


def test_big_integers_and_decimals_are_exact():
    a, b = 123456789012345678901234567890, 987654321098765432109876543210
    calc = tools.calculator()
    assert calc({"expression": f"{a} * {b}"}) == str(a * b)
    assert calc({"expression": "0.1 + 0.2"}) == "3/10"
    assert calc({"expression": "2 ** -3 + 7 // 2"}) == "25/8"
    assert calc({"expression": "(-1) ** (10 ** 9)"}) == "1"


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "function call is not allowed"),
    ("x + 1", "the name 'x' is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("'a' * 3", "the literal 'a' is not allowed"),
    ("2 ** 0.5", "exponent must be an integer"),
    ("9 ** 9 ** 9", "more than 8192 bits"),
    ("1e999999999 + 1", "too large or too small"),  # would take minutes to build as a Fraction
    ("(" + "9" * 990 + ") ** 3", "more than 8192 bits"),
    ("1 / (3 - 3)", "division by zero"),
    ("2 +", "not an arithmetic expression"),
    ("1 << 3", "the operator LShift is not allowed"),
    ("(" * 400 + "1" + ")" * 400, "nested too deeply|not an arithmetic expression"),
])
def test_anything_but_arithmetic_is_a_clear_error_observation(expression, message):
    observation = tools.calculator()({"expression": expression})
    assert observation.startswith("error: ")
    assert __import__("re").search(message, observation), observation


@pytest.mark.parametrize("arguments, message", [
    ({}, "needs argument(s) ['expression']"),
    ({"expression": "1", "precision": 3}, "has no argument(s) ['precision']"),
    ({"expression": 12}, "'expression' of calculator must be a string"),
    (["1 + 1"], "must be a JSON object"),
])
def test_bad_arguments_are_an_error_observation(arguments, message):
    observation = tools.calculator()(arguments)
    assert observation.startswith("error: ") and message in observation, observation


def test_a_tools_own_exception_is_an_observation_not_a_crash():
    broken = tools.Tool("broken", "fails", {"type": "object", "properties": {}}, run=lambda args: 1 / 0)
    assert broken({}) == "error: broken failed: ZeroDivisionError: division by zero"


def test_the_python_tool_returns_what_the_code_printed_or_how_it_failed():
    python = tools.python(Limits(wall_seconds=10.0, cpu_seconds=1, memory_bytes=256 << 20))
    assert python({"code": "print(sum(range(10 ** 5)))"}) == "4999950000\n"
    failed = python({"code": "import socket\nsocket.socket()"})
    assert failed.startswith("error (exit code 1)") and "PermissionError" in failed
    assert python({"code": "while True:\n    pass"}).startswith("stopped:")


def test_tool_calls_round_trip_and_are_found_in_order():
    first = ToolCall("calculator", {"expression": "12 * 34"})
    second = ToolCall("python", {"code": "print(1)"})
    text = f"Let me compute. {tool_format.render_tool_call(first)} and {tool_format.render_tool_call(second)}"
    assert tool_format.parse_tool_calls(text) == [first, second]
    assert tool_format.parse_tool_calls("The answer is 408.") == []
    assert tool_format.render_tool_call(first).endswith(tool_format.TURN_STOP)


def test_other_spellings_of_the_arguments_are_read():
    llama = '<tool_call>{"name": "calculator", "parameters": {"expression": "1+1"}}</tool_call>'
    openai = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    for text in (llama, openai):
        assert tool_format.parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+1"})]


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{'name': 'calculator'}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', '"arguments" of the tool call'),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "without </tool_call>"),
])
def test_malformed_tool_calls_raise_a_message_meant_for_the_policy(text, message):
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace("[", r"\[")):
        tool_format.parse_tool_calls(text)


TOOLS_TEMPLATE = ("{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.description }};"
                  "{% endfor %}</tools>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _tokenizer(template):
    from ppo_jax.data.tokenizers import build_word_tokenizer

    return build_word_tokenizer(["what", "is", "2", "+"], chat_template=template)


def test_a_template_that_takes_tools_declares_them():
    pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "what is 2 + 2"}]
    text = tool_format.render_conversation(messages, [tools.calculator()], _tokenizer(TOOLS_TEMPLATE))
    assert text.startswith("<tools>calculator:Exact arithmetic") and text.endswith(
        "<|user|>what is 2 + 2<|assistant|>")


def test_a_template_without_tools_falls_back_to_the_plain_format_which_still_declares_them():
    pytest.importorskip("transformers")
    tokenizer = _tokenizer(PLAIN_TEMPLATE)
    assert not tool_format.template_accepts_tools(tokenizer)
    messages = [{"role": "user", "content": "what is 2 + 2"}, {"role": "tool", "content": "4"}]
    text = tool_format.render_conversation(messages, [tools.calculator()], tokenizer)
    assert text.startswith("system: You may call these tools") and '"name": "calculator"' in text
    assert text.endswith("user: what is 2 + 2\n<tool_result>4</tool_result>\nassistant:")
