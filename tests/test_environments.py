"""Environments (issue 45 item 1): named like reward functions, one clear line for bad input, the tool
environment's episode (calls, results, the end, max_turns), and rows stepped in parallel."""

import time

import pytest

from ppo_jax.agentic import environment, tool_format, tools
from ppo_jax.agentic.environment import StepResult, ToolEnvironment, Turn
from ppo_jax.agentic.sandbox import Limits
from ppo_jax.config import ConfigError


class SleepyEnvironment:
    """Answers every turn after `seconds` (a stand-in for a slow tool or a remote environment)."""

    stop_strings = ("</tool_call>",)

    def __init__(self, seconds: float = 0.2):
        self.seconds = seconds

    def reset(self, record):
        return record["prompt"]

    def step(self, turn_text, turn_token_ids):
        time.sleep(self.seconds)
        return StepResult(observation=f"seen {len(turn_token_ids)} tokens", reward=1.0, done=True)


def sleepy(seconds: float = 0.2):
    return SleepyEnvironment(seconds)


def call(name, **arguments):
    return tool_format.render_tool_call(tool_format.ToolCall(name, arguments))


def test_a_registered_name_and_a_module_path_resolve():
    assert environment.resolve("tools") is environment.tool_environment
    assert environment.resolve(" ppo_jax.agentic.environment:tool_environment ") is environment.tool_environment
    assert environment.resolve("test_environments:sleepy")(0.0).step("x", [1, 2]).observation == "seen 2 tokens"


@pytest.mark.parametrize("spec, message", [
    ("no_such_environment", "environment.name='no_such_environment' is not a registered environment"),
    ("no_such_module_ppo_jax:make", "environment.name='no_such_module_ppo_jax:make' does not resolve: "
                                    "cannot import module 'no_such_module_ppo_jax'"),
    ("ppo_jax.agentic.environment:nothing_here", "has no callable 'nothing_here'"),
])
def test_a_spec_that_does_not_resolve_is_one_config_error_line(spec, message):
    with pytest.raises(ConfigError) as raised:
        environment.resolve(spec)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert "reward function" not in str(raised.value)


def test_max_turns_below_one_and_undeclared_tools_are_config_errors():
    with pytest.raises(ConfigError, match=r"environment.max_turns=0: an episode needs at least 1 turn"):
        environment.tool_environment("calculator", max_turns=0)
    with pytest.raises(ConfigError, match=r"tool\(s\) \['shell'\] are not declared"):
        environment.resolve_tools("calculator, shell")
    with pytest.raises(ConfigError, match="named twice"):
        environment.resolve_tools(["calculator", "calculator"])


def test_a_registered_tool_can_be_named():
    @environment.register_tool("echo_for_test")
    def echo():
        return tools.Tool("echo_for_test", "echoes", {"type": "object", "properties": {"text": {"type": "string"}}},
                          run=lambda args: args.get("text", ""))

    env = environment.tool_environment("echo_for_test")
    env.reset({"prompt": "say hi"})
    assert env.step(call("echo_for_test", text="hi"), [0]).observation == "<tool_result>hi</tool_result>"


def test_a_turn_stop_the_tokenizer_cannot_encode_is_a_config_error():
    pytest.importorskip("transformers")
    from ppo_jax.data.tokenizers import build_word_tokenizer

    plain = build_word_tokenizer(["what", "is"])
    with pytest.raises(ConfigError, match=r"environment.turn_stop='</tool_call>': the tokenizer cannot encode it"):
        environment.check_turn_stop(plain, "</tool_call>")
    environment.check_turn_stop(build_word_tokenizer(["what"], extra_special_tokens=["</tool_call>"]), "</tool_call>")


def test_a_tool_episode_calls_answers_and_ends_at_the_answer_with_the_reward():
    env = ToolEnvironment([tools.calculator()], max_turns=4,
                          reward=lambda record, text: float(text.strip().endswith(record["answer"])))
    prompt = env.reset({"prompt": "what is 12 * 34", "answer": "408"})
    assert "calculator" in prompt and prompt.endswith("assistant:")
    first = env.step("Let me use the tool. " + call("calculator", expression="12 * 34"), [5, 6, 7])
    assert first == StepResult("<tool_result>408</tool_result>", 0.0, False,
                               {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0})
    last = env.step("The answer is 408", [8])
    assert last.done and last.reward == 1.0 and last.observation == ""


def test_mistakes_are_observations_and_the_episode_goes_on():
    env = ToolEnvironment([tools.calculator()], max_turns=5)
    env.reset({"prompt": "what is 2 + 2"})
    unknown = env.step(call("shell", cmd="ls"), [1])
    assert not unknown.done and "there is no tool 'shell'" in unknown.observation and unknown.info["tool_errors"] == 1
    malformed = env.step("<tool_call>{not json}</tool_call>", [1])
    assert not malformed.done and "not valid JSON" in malformed.observation
    bad_expression = env.step(call("calculator", expression="import os"), [1])
    assert bad_expression.observation.startswith("<tool_result>error: not an arithmetic expression")


def test_tool_failures_and_time_outs_are_counted_apart():
    slow = tools.Tool("slow", "times out", {"type": "object", "properties": {}},
                      run=lambda args: "stopped: time limit (10.0 s)")
    env = ToolEnvironment([tools.calculator(), slow], max_turns=3)
    env.reset({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1/0?"}]})
    step = env.step(call("calculator", expression="1/0") + call("slow") + call("calculator", expression="2"), [1])
    assert step.info == {"tool_calls": 3.0, "tool_errors": 1.0, "tool_timeouts": 1.0}
    assert step.observation.count("<tool_result>") == 3
    assert [tools.outcome(o) for o in ("killed (signal 9)", "stopped: memory limit reached", "42")] == [
        "error", "error", "ok"]


def test_the_episode_ends_at_max_turns_even_mid_tool_use():
    env = ToolEnvironment([tools.calculator()], max_turns=2, reward=lambda record, text: -1.0)
    env.reset({"prompt": "loop"})
    assert not env.step(call("calculator", expression="1"), [1]).done
    ended = env.step(call("calculator", expression="2"), [1])
    assert ended.done and ended.reward == -1.0 and ended.info["tool_calls"] == 1


def test_rows_wait_for_their_environments_in_parallel():
    envs = [SleepyEnvironment(0.2) for _ in range(8)]
    batch = environment.step_all(envs, [Turn("hi", [1] * i) for i in range(8)], max_workers=8)
    assert [r.observation for r in batch.results] == [f"seen {i} tokens" for i in range(8)]
    assert all(s >= 0.2 for s in batch.seconds)
    assert batch.wall_seconds < 0.2 * 8 / 2, batch.wall_seconds  # one by one would take 1.6 s


def test_sandboxed_tool_calls_run_in_parallel_too():
    limits = Limits(wall_seconds=10.0, cpu_seconds=1, memory_bytes=256 << 20)
    envs = [ToolEnvironment([tools.python(limits)], max_turns=3) for _ in range(4)]
    for env in envs:
        env.reset({"prompt": "sleep"})
    turns = [Turn(call("python", code=f"import time\ntime.sleep(1.0)\nprint({i})"), [1]) for i in range(4)]
    batch = environment.step_all(envs, turns, max_workers=4)
    assert [r.observation for r in batch.results] == [f"<tool_result>{i}\n</tool_result>" for i in range(4)]
    assert batch.wall_seconds < 3.0, batch.wall_seconds  # one by one: over 4 s


def test_an_environment_that_raises_names_its_row():
    class Broken(SleepyEnvironment):
        def step(self, turn_text, turn_token_ids):
            raise KeyError("state")

    with pytest.raises(RuntimeError, match="the environment of row 1 raised KeyError"):
        environment.step_all([SleepyEnvironment(0.0), Broken()], [Turn("a", [1]), Turn("b", [2])])
    with pytest.raises(ConfigError, match="environment.workers=0"):
        environment.step_all([SleepyEnvironment(0.0)], [Turn("a", [1])], max_workers=0)


# ----------------------------------------------------------------------------------------------
# The arithmetic task (issue 45 item 6, data only).

from ppo_jax.arithmetic import task as arithmetic_task  # noqa: E402
from ppo_jax.arithmetic.task import ArithmeticTask  # noqa: E402


def test_the_generator_is_deterministic_in_its_seed_and_the_splits_are_disjoint():
    task = ArithmeticTask(seed=3, digits=6)
    train, again = task.prompts(50, "train"), ArithmeticTask(seed=3, digits=6).prompts(50, "train")
    assert train == again and len(set(train)) == 50
    assert train != ArithmeticTask(seed=4, digits=6).prompts(50, "train")
    evals = task.prompts(50, "eval")
    assert not set(train) & set(evals)
    a, b = arithmetic_task.operands(train[0])
    assert 10 ** 5 <= a < 10 ** 6 and 10 ** 5 <= b < 10 ** 6
    assert [task.demonstration(p, i) for i, p in enumerate(train[:10])] == [
        d for _, d in task.demonstrations(10)]


@pytest.mark.parametrize("response, correct", [
    ("the answer is 56088", True),
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"123 * 456\"}}</tool_call>"
     "<tool_result>56088</tool_result>the answer is 56088", True),
    ("<tool_result>56088</tool_result>", False),  # the tool's number is not an answer
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"56088\"}}", False),
    ("56088 is close, the answer is 56089", False),
    ("the answer is 5608", False),
    ("I do not know", False),
])
def test_the_reward_is_exact_match_of_the_final_answer(response, correct):
    assert arithmetic_task.arithmetic_exact(["what is 123 * 456"], [response]) == [float(correct)]


def test_demonstrations_call_the_calculator_and_a_share_of_them_are_wrong():
    task = ArithmeticTask(seed=0, digits=6, wrong_rate=0.25)
    pairs = task.demonstrations(200)
    wrong = 0
    for prompt, turns in pairs:
        assert [t.role for t in turns] == ["assistant", "tool", "assistant"]
        (call,) = tool_format.parse_tool_calls(turns[0].content)
        assert call.name == "calculator"
        text = "".join(t.content for t in turns)
        wrong += not arithmetic_task.is_correct(prompt, text)
    assert 0.15 < wrong / len(pairs) < 0.35, wrong
    assert all(arithmetic_task.is_correct(p, "".join(t.content for t in turns))
               for p, turns in ArithmeticTask(seed=0, wrong_rate=0.0).demonstrations(50))


def test_the_arithmetic_environment_pays_the_exact_product():
    env = environment.resolve("arithmetic")(max_turns=3)
    prompt = ArithmeticTask(seed=1).prompts(1)[0]
    env.reset({"prompt": prompt})
    a, b = arithmetic_task.operands(prompt)
    observed = env.step(call("calculator", expression=f"{a} * {b}"), [1])
    assert observed.observation == f"<tool_result>{a * b}</tool_result>"
    assert env.step(f"the answer is {a * b}", [2]).reward == 1.0


def test_the_guides_example_environment_works_as_written():
    import os
    import re

    guide = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "agentic.md"),
                 encoding="utf-8").read()
    example = re.search(r"## Bring your own environment.*?```python\n(.*?)```", guide, flags=re.S).group(1)
    namespace = {}
    exec(compile(example, "docs/agentic.md", "exec"), namespace)  # noqa: S102 -- our own guide
    env = environment.resolve("guess_the_number")()
    assert env.reset({"prompt": "guess", "secret": 42}) == "guess"
    assert env.step("<guess>7</guess>", [1]).observation == "higher"
    assert env.step("<guess>x</guess>", [1]).observation == "write <guess>a number</guess>"
    assert env.step("<guess>42</guess>", [1]) == StepResult("", 1.0, True)
