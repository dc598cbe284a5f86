"""Multi-turn and tool-using RL (issue 45): environments, tools, their text format and the sandbox.

    sandbox.py          untrusted Python in a limited, isolated process (stdlib only)
    tools.py            the Tool protocol, an exact calculator, the sandboxed Python tool
    tool_format.py      <tool_call>/<tool_result> text and chat templates that take `tools`
    environment.py      the Environment protocol, its resolution by name, ToolEnvironment, step_all
    arithmetic_task.py  a task where the tool matters: prompts, gold answers, reward, demonstrations
    pipeline.py         the arithmetic run: a character tokenizer, SFT, PPO with the calculator, evaluation
    rollout.py          multi-turn rollouts: turns decoded by sampling/turns.py, every waiting row's
                        environment stepped at once, observations appended to the KV cache

The PPO trainer runs these episodes when the config names an environment (`environment.name`,
rl/episodes.py); `python -m ppo_jax.agentic` (pipeline.py) runs SFT then RL on the arithmetic task.
Not built yet: the continuous engine's multi-turn mode (docs/agentic.md).
"""
