"""What a sweep runs: the trainers it can launch, the swept fields, and the list of runs they expand to.

A sweep is a base config (a config file and `--config.<field>=<value>` overrides, as every command
takes them) × the points of a grid (the product of each swept field's values) or of a list (the
values of all swept fields taken together, i-th with i-th) × seeds. Every run is one process of a
trainer's own command line, in its own workdir, with the point's values and its seed as overrides:
what `ppo-jax-train` would run by hand.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re
from collections.abc import Sequence

from ppo_jax.config import ConfigError
from ppo_jax.config_file import check_overrides


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A command the sweep can launch: its module (run as `python -m`), the metrics log its workdir
    holds (relative path), the final metrics a table shows unless --metrics names others, the logged
    metrics whose learning curves it plots unless --curves names others, and the module whose file is
    its config when --config is not given (None: --config is required)."""

    module: str
    log: str
    metrics: tuple[str, ...]
    curves: tuple[str, ...]
    default_config: str | None = None

    def default_config_file(self) -> str | None:
        return None if self.default_config is None else importlib.util.find_spec(self.default_config).origin


TRAINERS = {
    "ppo": Trainer("ppo_jax.cli.train", "metrics.jsonl", ("objective/scores", "objective/kl"),
                   ("objective/scores", "objective/kl")),
    "sft": Trainer("ppo_jax.cli.sft", "metrics.jsonl", ("eval/loss", "train/loss"), ("train/loss", "eval/loss")),
    "reward_model": Trainer("ppo_jax.cli.reward_model", "metrics.jsonl", ("eval/accuracy", "train/loss"),
                            ("train/loss", "eval/accuracy")),
    "dpo": Trainer("ppo_jax.cli.dpo", "metrics.jsonl", ("eval/accuracy", "train/loss"), ("train/loss", "eval/accuracy")),
    # The demo pipeline writes summary.json (gap_closed, final_kl, ...) and its PPO stage's log (the
    # gold evaluations as gold/*).
    "demo": Trainer("ppo_jax.demo", "ppo/metrics.jsonl", ("gap_closed", "final_kl", "seconds.total"),
                    ("gold/gold", "gold/kl", "objective/scores"), default_config="ppo_jax.demo.default_config"),
    # The verifiable-reward task (SFT, then RL on the checker's 1/0 reward): summary.json and rl/'s log.
    "verifiable": Trainer("ppo_jax.verifiable", "rl/metrics.jsonl",
                          ("accuracy_after", "accuracy_before", "final_kl", "seconds.total"),
                          ("eval/accuracy", "eval/kl", "objective/scores"),
                          default_config="ppo_jax.verifiable.default_config"),
}
SEED_FIELD = "seed"  # every trainer's settings (and the demo's) have one top-level seed


@dataclasses.dataclass(frozen=True)
class Axis:
    """One swept field and its values, as override strings (`--config.<field>=<value>` syntax)."""

    field: str
    values: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """One process of the sweep: its point (field -> value string, in axis order), its seed, and the
    name of its workdir under the sweep directory."""

    index: int
    point: tuple[tuple[str, str], ...]
    seed: int

    @property
    def name(self) -> str:
        parts = [f"{field.rsplit('.', 1)[-1]}={value}" for field, value in self.point] + [f"seed={self.seed}"]
        return f"{self.index:03d}_" + re.sub(r"[^A-Za-z0-9=.,_+-]", "-", "_".join(parts))

    def overrides(self) -> list[str]:
        return [f"--config.{field}={value}" for field, value in self.point] + [f"--config.{SEED_FIELD}={self.seed}"]

    @property
    def label(self) -> str:
        """The point, readable: 'ppo.kl_coef=0.05, ppo.advantage_estimator=grpo' ('base' for a
        seeds-only sweep)."""
        return ", ".join(f"{field}={value}" for field, value in self.point) or "base"

    @property
    def short_label(self) -> str:
        """The point with each field's last name only: 'kl_coef=0.05, advantage_estimator=grpo'."""
        return ", ".join(f"{field.rsplit('.', 1)[-1]}={value}" for field, value in self.point) or "base"


def parse_axis(text: str) -> Axis:
    """'ppo.kl_coef=0.01,0.05' -> Axis('ppo.kl_coef', ('0.01', '0.05')). Tuple values keep their
    parentheses: 'mesh.shape=(1,2,1),(1,1,2)'."""
    field, sep, values = text.partition("=")
    field = field.strip().removeprefix("--config.").removeprefix("config.")
    if not sep or not field:
        raise ConfigError(f"--grid {text!r}: write FIELD=VALUE,VALUE,... (e.g. ppo.kl_coef=0.01,0.05)")
    parsed = tuple(v.strip() for v in _split_values(values) if v.strip())
    if not parsed:
        raise ConfigError(f"--grid {text!r}: {field} has no values; give at least one (FIELD=VALUE,VALUE,...)")
    return Axis(field, parsed)


def _split_values(text: str) -> list[str]:
    """Commas outside parentheses separate values."""
    values, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += char
    return values + [current]


def parse_seeds(text: str) -> tuple[int, ...]:
    """'3' -> (0, 1, 2); '0,4,7' -> (0, 4, 7)."""
    try:
        numbers = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--seeds={text!r}: give a count (3: seeds 0, 1, 2) or a list (0,4,7)") from None
    if len(numbers) == 1 and "," not in text:
        if numbers[0] < 1:
            raise ConfigError(f"--seeds={text}: a count must be at least 1")
        return tuple(range(numbers[0]))
    if not numbers or len(set(numbers)) != len(numbers):
        raise ConfigError(f"--seeds={text!r}: give distinct seeds")
    return numbers


def expand(axes: Sequence[Axis], seeds: Sequence[int], *, zipped: bool = False) -> list[Run]:
    """The runs, point-major (all seeds of a point before the next point): the product of the axes'
    values, or with `zipped` their i-th values together (every axis then has as many values)."""
    fields = [a.field for a in axes]
    if len(set(fields)) != len(fields):
        raise ConfigError(f"a field is swept twice: {sorted(f for f in fields if fields.count(f) > 1)[0]}")
    if SEED_FIELD in fields:
        raise ConfigError(f"{SEED_FIELD} is swept by --seeds, not --grid")
    for axis in axes if not zipped else ():  # (a list may repeat a value: 1, 4, 4 samples beside 3 estimators)
        if len(set(axis.values)) != len(axis.values):
            raise ConfigError(f"--grid {axis.field}: repeats a value")
    if zipped and len({len(a.values) for a in axes}) > 1:
        raise ConfigError("--zip takes the i-th value of every field together, so every field needs as many values; "
                          + ", ".join(f"{a.field} has {len(a.values)}" for a in axes))
    if zipped and axes and len(set(zip(*(a.values for a in axes)))) != len(axes[0].values):
        raise ConfigError("--zip: two points are the same")
    values = [a.values for a in axes]
    points = list(zip(*values)) if zipped else list(itertools.product(*values))
    runs = []
    for point in points or [()]:
        for seed in seeds:
            runs.append(Run(len(runs), tuple(zip(fields, point)), seed))
    return runs


def check_runs(runs: Sequence[Run], config, base_overrides: Sequence[str]) -> None:
    """Every run's overrides name fields of `config` with values of their type: one ConfigError line
    (naming the field, with a suggestion) before anything runs."""
    seen = set()
    for run in runs:
        for arg in list(base_overrides) + run.overrides():
            if arg not in seen:
                seen.add(arg)
                check_overrides([arg], config)
