"""Per-call cost of the tool sandbox (issue 59): `sandbox.run_python("print(1)")` now against the
sandbox at an earlier commit, in alternating rounds in one process, beside a bare interpreter start.

    python bench/bench_sandbox.py [--calls 40] [--rounds 5] [--before 57d9289] [--out results.json]

`--before REV` extracts that commit's ppo_jax/agentic/sandbox.py and _sandbox_child.py into a temporary
package and times it the same way (57d9289: the in-process audit hook, namespaces by unshare, no
bwrap). Each round times `--calls` calls of each variant in turn; the table gives each variant's
median and minimum per call over the rounds, in milliseconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ppo_jax.agentic import sandbox  # noqa: E402


def _sandbox_at(rev: str, into: str):
    """The sandbox module as it was at `rev`, loaded from files extracted into `into`."""
    for name in ("sandbox.py", "_sandbox_child.py"):
        text = subprocess.run(["git", "-C", REPO, "show", f"{rev}:ppo_jax/agentic/{name}"], check=True,
                              capture_output=True, text=True).stdout
        with open(os.path.join(into, name), "w") as f:
            f.write(text)
    spec = importlib.util.spec_from_file_location(f"sandbox_{rev}", os.path.join(into, "sandbox.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _per_call(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", default="57d9289", help="a commit whose sandbox to time too ('' = none)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    python = os.path.realpath(sys.executable)
    variants = {"interpreter start (python -I -S -c pass)":
                lambda: subprocess.run([python, "-I", "-S", "-c", "pass"], check=True),
                "run_python, kernel boundary (now)": lambda: _checked(sandbox.run_python("print(1)"))}
    with tempfile.TemporaryDirectory() as scratch:
        if args.before:
            old = _sandbox_at(args.before, scratch)
            variants[f"run_python at {args.before}"] = lambda: _checked(old.run_python("print(1)"))
        for call in variants.values():
            call()  # warm: bwrap's probe, ldd, page cache
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, call in variants.items():
                times[name].append(_per_call(call, args.calls))
    rows = {name: {"median_ms": statistics.median(t), "min_ms": min(t)} for name, t in times.items()}
    print(f"| per call ({args.calls} calls x {args.rounds} rounds, {os.cpu_count()} CPUs) | median ms | min ms |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_ms']:.1f} | {row['min_ms']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls": args.calls, "rounds": args.rounds, "per_call": rows}, f, indent=1)


def _checked(result) -> None:
    if result.status != "ok" or result.stdout != "1\n":
        raise RuntimeError(f"the sandbox did not run print(1): {result}")


if __name__ == "__main__":
    main()
