"""A config file as a command line names it: `path.py[:arg]` loaded into its ConfigDict, and the
`--config.<field>=<value>` overrides checked against it, each a one-line ConfigError, before absl
parses anything.

absl and ml_collections would end a misspelled override in a chained traceback from inside
config_flags, and a value of the wrong type in a FATAL flags error; the commands (`ppo_jax.cli`) and
the sweep, which checks every run's overrides before it starts one, answer with one line instead.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections.config_flags import tuple_parser

from ppo_jax.config import ConfigError

# How config_flags will parse an override of a field of each type (absl's and ml_collections' own
# parsers, so "accepted here" means "accepted there").
_VALUE_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser(),
                  tuple: tuple_parser.TupleParser()}
_TYPE_NAMES = {int: "a whole number", float: "a number", bool: "true or false", tuple: "a tuple, e.g. (1,-1,1)"}


def load_config(spec: str, *, example: str = "configs/ppo_toy.py") -> ml_collections.ConfigDict:
    """`path.py` or `path.py:arg` (as config_flags reads it) -> get_config()'s ConfigDict."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist (--config takes a Python file with get_config(), "
                          f"e.g. {example})")
    module_spec = importlib.util.spec_from_file_location("_ppo_jax_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        get_config = module.get_config
        return get_config(arg) if arg else get_config()
    except Exception as e:
        raise ConfigError(f"config file {path!r} failed to load: {type(e).__name__}: {e}") from e


def check_overrides(argv: Sequence[str], config: ml_collections.ConfigDict) -> None:
    """Every `--config.a.b=value` must name a field of `config` (the error suggests the closest), and
    its value must parse as that field's type (absl would end the run with a FATAL flags error)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("--config."):
            continue
        dotted, inline, value = arg[len("--config."):].partition("=")
        field = _field(config, dotted)
        if field is _UNSET:
            continue
        if inline:
            _check_value(config, dotted, value, field, inline=True)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):  # `--config.a.b value`
            _check_value(config, dotted, argv[i + 1], field, inline=False)


_UNSET = object()


def _field(config: ml_collections.ConfigDict, dotted: str) -> Any:
    """The current value of the field `dotted` names (_UNSET inside a section left unset)."""
    node: Any = config
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        walked = parts[:depth]
        if not isinstance(node, ml_collections.ConfigDict):
            if node is None:
                return _UNSET  # a section left unset (a placeholder): its fields are checked when it is read
            raise ConfigError(f"--config.{dotted}: {'.'.join(walked)} is a value, not a section")
        if part not in node:
            where = ".".join(walked) or "the config"
            raise ConfigError(f"unknown config field --config.{dotted}: {where} has no field {part!r}; "
                              f"{_suggestion(node, walked, parts[depth:])}")
        node = node[part]
    return node


def _suggestion(section: ml_collections.ConfigDict, walked: list[str], missing: list[str]) -> str:
    """A close name at this level, else the fields deeper in `section` whose path ends with `missing`
    (the demo's `ppo.kl_coef` is `ppo.ppo.kl_coef`), else the section's fields."""
    close = difflib.get_close_matches(missing[0], list(section.keys()), n=1)
    if close:
        return f"did you mean --config.{'.'.join(walked + close)}?"
    tail = ".".join(missing)
    deeper = [path for path in _paths(section) if path.endswith("." + tail)]
    if deeper:
        return "did you mean " + " or ".join(f"--config.{'.'.join(walked + [path])}" for path in deeper[:3]) + "?"
    return f"{'.'.join(walked) or 'the config'} has {', '.join(sorted(section.keys()))}"


def _paths(section: ml_collections.ConfigDict) -> Iterator[str]:
    """Every dotted path (sections and leaves) under `section`."""
    for name, value in section.items():
        yield name
        if isinstance(value, ml_collections.ConfigDict):
            yield from (f"{name}.{path}" for path in _paths(value))


def _check_value(config: ml_collections.ConfigDict, dotted: str, value: str, current: Any, *, inline: bool) -> None:
    """`value` parses as the field's type, or one line naming the field, its type and its value now.
    (`--config.flag value` does not give a bool field a value: absl takes the flag alone as true.)"""
    if isinstance(current, ml_collections.ConfigDict):
        return
    parent, _, name = dotted.rpartition(".")
    section = _field(config, parent) if parent else config
    kind = section.get_type(name) if isinstance(section, ml_collections.ConfigDict) else type(current)
    parser = _VALUE_PARSERS.get(kind)
    if parser is None or (kind is bool and not inline):
        return
    try:
        parser.parse(value)
    except ValueError:
        raise ConfigError(f"--config.{dotted}={value}: {dotted} takes {_TYPE_NAMES[kind]} "
                          f"(now {current!r})") from None
