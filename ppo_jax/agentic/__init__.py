"""Multi-turn and tool-using RL (issue 45): environments, tools, their text format and the sandbox.

    sandbox.py          untrusted Python behind a kernel boundary (sandbox_boundary.py, seccomp.py)
    tools.py            the Tool protocol, an exact calculator, the sandboxed Python tool
    tool_format.py      <tool_call>/<tool_result> text and chat templates that take `tools`
    environment.py      the Environment protocol, its resolution by name, ToolEnvironment, step_all
    rollout.py          multi-turn rollouts: turns decoded by sampling/turns.py, every waiting row's
                        environment stepped at once, observations appended to the KV cache

The PPO trainer runs these episodes when the config names an environment (`environment.name`,
rl/episodes.py); `python -m ppo_jax.arithmetic` (an application above the library, ppo_jax/arithmetic/) runs SFT
then RL on a task where the calculator matters.
Not built yet: the continuous engine's multi-turn mode (docs/agentic.md).
"""
