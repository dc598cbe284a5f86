"""A trainer for the sandbox attack suite (tests/test_sandbox_attacks.py): one tool call, as the PPO
trainer makes it, from a process the test can run as root or as an unprivileged user.

    echo '{"code": "...", "limits": {...}}' | python sandbox_attack_driver.py

The code's `{TRAINER_PID}` becomes this process's PID. Prints one JSON line: the result (or the
SandboxSetupError), the signals this process received while the call ran, and its PID. Imports only
the standard library and ppo_jax.agentic's sandbox, so a copy of those files runs under any Python
that a non-root user can execute.
"""

import json
import os
import signal
import sys
import time

received = []
for number in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, lambda n, _frame: received.append(n))

from ppo_jax.agentic import sandbox  # noqa: E402 (after the handlers: a signal then is counted)


def main():
    request = json.load(sys.stdin)
    code = request["code"].replace("{TRAINER_PID}", str(os.getpid()))
    limits = sandbox.Limits(**request.get("limits", {}))
    reply = {"trainer_pid": os.getpid(), "uid": os.getuid()}
    try:
        result = sandbox.run_python(code, limits)
        reply.update(status=result.status, stdout=result.stdout, stderr=result.stderr, layers=list(result.layers),
                     exit_code=result.exit_code, signal=result.signal)
    except sandbox.SandboxSetupError as e:
        reply["setup_error"] = str(e)
    time.sleep(0.05)  # a signal sent late still lands before the count is read
    reply["signals"] = received
    print(json.dumps(reply))


if __name__ == "__main__":
    main()
