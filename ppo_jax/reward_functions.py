"""Python reward functions: `fn(prompts: list[str], responses: list[str]) -> list[float]`.

They run on the host between sampling and the experience math, alone or weighted together with a
reward model. Config strings name them: a registered name ("toy_target_count") or an import path
("my_package.rewards:brevity"). Importing a module the user names is the user's choice; file paths
from configs are never executed.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from ppo_jax import metrics

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
_REGISTRY: dict[str, RewardFn] = {}


def register(name: str):
    """Decorator: makes a reward function available to configs under `name`."""

    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


def resolve(spec: str) -> RewardFn:
    """A registered name or "module:function" -> the function, with a clear error otherwise."""
    spec = spec.strip()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r} is not registered (registered in this process: "
                         f"{sorted(_REGISTRY)}); use a registered name or 'module:function', which imports "
                         "the module (e.g. 'ppo_jax.demo.world:gold_reward_fn')")
    module_name, fn_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name} has no callable {fn_name!r}")
    return fn


def parse(functions: str, weights: str) -> list[tuple[RewardFn, float]]:
    """Config strings -> [(fn, weight)]."""
    names = [s for s in functions.split(",") if s.strip()] if functions else []
    if not names:
        return []
    if weights:
        try:
            ws = [float(w) for w in weights.split(",")]
        except ValueError:
            raise ValueError(f"reward.function_weights={weights!r}: use comma-separated numbers") from None
        if len(ws) != len(names):
            raise ValueError(f"reward.function_weights has {len(ws)} entries but reward.functions has {len(names)}")
    else:
        ws = [1.0] * len(names)
    return [(resolve(n), w) for n, w in zip(names, ws)]


def combined_scores(fns: list[tuple[RewardFn, float]], prompts: Sequence[str],
                    responses: Sequence[str]) -> np.ndarray:
    """Weighted sum of every function's scores: [B] float32."""
    total = np.zeros(len(responses), np.float32)
    for fn, weight in fns:
        scores = np.asarray(fn(prompts, responses), np.float32)
        if scores.shape != (len(responses),):
            raise ValueError(f"reward function {getattr(fn, '__name__', fn)} returned shape {scores.shape}, "
                             f"expected ({len(responses)},)")
        total += weight * scores
    return total


# Past this a sequence score drowns the rest of the reward. PPO adds a per-token KL penalty -β·KL_t
# (typically 1e-4 to 1e-2 a token) to the score and sums them into float32 returns; float32 spaces the
# numbers near 1e6 by 0.0625, so beside such a score the penalty rounds away (the KL leash is gone),
# and the value model must regress targets a million times the scale its head starts at. Past ~1.8e19
# the squared value error is inf in float32 and every update is skipped as non-finite.
SCORE_MAGNITUDE_LIMIT = 1e6


def score_magnitude_problem(scores: np.ndarray, limit: float = SCORE_MAGNITUDE_LIMIT) -> str | None:
    """What is wrong with a batch of reward-function scores [B] that no update can learn from (non-finite
    values, or magnitudes past `limit`; see SCORE_MAGNITUDE_LIMIT), or None when nothing is."""
    scores = np.asarray(scores, np.float64)
    finite = np.isfinite(scores)
    problems = []
    if not finite.all():
        problems.append(f"{int((~finite).sum())} of {scores.size} are NaN or inf (those updates are skipped, and "
                        "the run stops after train.max_consecutive_nonfinite such iterations)")
    huge = finite & (np.abs(scores) > limit)
    if huge.any():
        problems.append(f"{int(huge.sum())} of {scores.size} have |score| > {limit:g} (largest "
                        f"{np.abs(scores[huge]).max():.3g}): beside such scores float32 rounds away the KL "
                        "penalty and the value model's targets are out of scale; rescale the reward function "
                        "(e.g. to about [-10, 10])")
    return "reward-function scores: " + "; ".join(problems) if problems else None


_WARNED_RUNS: weakref.WeakSet = weakref.WeakSet()


def warn_once_if_meaningless(scores: np.ndarray, run: object) -> None:
    """`score_magnitude_problem` as a `warning:` line (the run's other warnings' way: process 0, on the
    terminal), at most once per `run` (any object that lives as long as the run, e.g. its rollouts): a
    run with bad rewards has them in every batch."""
    if run in _WARNED_RUNS:
        return
    problem = score_magnitude_problem(scores)
    if problem is not None:
        _WARNED_RUNS.add(run)
        metrics.warn(problem)


@register("toy_target_count")
def toy_target_count(prompts: Sequence[str], responses: Sequence[str], target: str = "w7") -> list[float]:
    """Fraction of response words equal to `target` (the built-in toy task)."""
    out = []
    for response in responses:
        words = response.split()
        out.append(sum(w == target for w in words) / max(len(words), 1))
    return out
