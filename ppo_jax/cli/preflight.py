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

from ppo_jax.config import ConfigError, type_hints, leaf_type

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


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`path.py` or `path.py:arg` (as config_flags reads it) -> get_config()'s ConfigDict."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist (--config takes a Python file with get_config(), "
                          "e.g. configs/ppo_toy.py)")
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


def help_text(config: ml_collections.ConfigDict, schema: type | None, *, what: str, config_spec: str,
              takes_workdir: bool) -> str:
    """The whole config tree with values and comments, and how to override it."""
    rows = list(_rows(config, schema, ""))
    settings = [f"--config.{name}={value!r}" for name, value, _ in rows]
    width = min(max(map(len, settings), default=0), 60)
    lines = [f"{what} run. Flags:",
             f"  --config=FILE       {what} config file (a Python file with get_config()); now {config_spec}"]
    if takes_workdir:
        lines.append("  --workdir=DIR       directory for metrics, checkpoints and outputs (the same one resumes)")
    lines += ["  --verbose           library INFO logs and full tracebacks on the terminal",
              "",
              f"Every field of the config, with its value in {config_spec}; override any of them as shown:"]
    for setting, (_, _, comment) in zip(settings, rows):
        lines.append(f"  {setting:<{width}}  # {comment}" if comment else f"  {setting}")
    return "\n".join(lines)


def check_overrides(argv: Sequence[str], config: ml_collections.ConfigDict) -> None:
    """Every `--config.a.b=value` must name a field of `config`; the error suggests the closest."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        dotted = arg[len("--config."):].split("=", 1)[0]
        node: Any = config
        walked: list[str] = []
        for part in dotted.split("."):
            if not isinstance(node, ml_collections.ConfigDict):
                if node is None:
                    break  # a section left unset (a placeholder): its fields are checked when it is read
                raise ConfigError(f"--config.{dotted}: {'.'.join(walked)} is a value, not a section")
            if part not in node:
                fields = list(node.keys())
                close = difflib.get_close_matches(part, fields, n=1)
                where = ".".join(walked) or "the config"
                hint = (f"did you mean --config.{'.'.join(walked + close)}?" if close
                        else f"{where} has {', '.join(sorted(fields))}")
                raise ConfigError(f"unknown config field --config.{dotted}: {where} has no field {part!r}; {hint}")
            node = node[part]
            walked.append(part)
