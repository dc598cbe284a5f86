"""What a command checks before absl parses its flags: `--help` prints the whole config tree (every
field, its value in the config file and its one-line comment from the settings schema), the config
file exists, and every `--config.<field>` override names a field (with a suggestion when it does not).

absl alone would exit 1 on --help listing only `--config`, and a misspelled override would end in a
chained traceback from inside ml_collections; these are one-line answers instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections.config_flags import tuple_parser

from ppo_jax.config import ConfigError, type_hints, leaf_type

# How config_flags will parse an override of a field of each type (absl's and ml_collections' own
# parsers, so "accepted here" means "accepted there").
_VALUE_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser(),
                  tuple: tuple_parser.TupleParser()}
_TYPE_NAMES = {int: "a whole number", float: "a number", bool: "true or false", tuple: "a tuple, e.g. (1,-1,1)"}

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[\w\[]")
_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s?(.*)$")


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in argv (the last one wins, as in absl)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


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


def field_comments(schema: type) -> dict[str, str]:
    """{field: the comment at the end of its line} of a settings dataclass (inherited fields too; a
    subclass's comment wins)."""
    comments: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        comments.update(_comments_in(source))
    return comments


def _comments_in(source: str) -> dict[str, str]:
    """A field's comment ends its line, or (when long) fills the comment lines just above it."""
    found: dict[str, str] = {}
    above: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        trailing = _FIELD_COMMENT.match(line)
        field = trailing or _FIELD.match(line)
        if field and (trailing or above):
            found[field.group(1)] = trailing.group(2).strip() if trailing else " ".join(above)
        above = []
    return found


def _rows(config: ml_collections.ConfigDict, schema: type | None, prefix: str) -> Iterator[tuple[str, Any, str]]:
    """(dotted field, value, comment) of every leaf, in the schema's order where there is one."""
    comments = field_comments(schema) if schema is not None else {}
    hints = type_hints(schema) if schema is not None else {}
    names = [f.name for f in dataclasses.fields(schema) if f.name in config] if schema is not None else []
    names += [k for k in config.keys() if k not in names]
    for name in names:
        value = config[name]
        if isinstance(value, ml_collections.ConfigDict):
            kind = leaf_type(hints[name]) if name in hints else None
            yield from _rows(value, kind if dataclasses.is_dataclass(kind) else None, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value, comments.get(name, "")


def help_text(config: ml_collections.ConfigDict, schema: type | None, *, what: str, config_spec: str | None,
              takes_workdir: bool, title: str | None = None) -> str:
    """The whole config tree with values and comments, and how to override it (config_spec None: the
    values are the schema's defaults)."""
    rows = list(_rows(config, schema, ""))
    settings = [f"--config.{name}={value!r}" for name, value, _ in rows]
    width = min(max(map(len, settings), default=0), 60)
    source = config_spec or "the defaults (a config file starts from these)"
    lines = [f"{title or what + ' run'}. Flags:",
             f"  --config=FILE       {what} config file (a Python file with get_config())"
             + (f"; now {config_spec}" if config_spec else "")]
    if takes_workdir:
        lines.append("  --workdir=DIR       directory for metrics, checkpoints and outputs (the same one resumes)")
    lines += ["  --verbose           library INFO logs and full tracebacks on the terminal",
              "",
              f"Every field of the config, with its value in {source}; override any of them as shown:"]
    for setting, (_, _, comment) in zip(settings, rows):
        lines.append(f"  {setting:<{width}}  # {comment}" if comment else f"  {setting}")
    return "\n".join(lines)


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
