"""A command's `--help` text: the whole config tree, every field with its value in the config file and
its one-line comment from the settings schema.

absl alone would exit 1 on --help listing only `--config`. (Loading the config file and checking the
overrides, the rest of what a command checks before absl parses its flags, is `ppo_jax.config_file`:
the sweep checks every run's overrides with it too.)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterator
from typing import Any

import ml_collections

from ppo_jax.config import leaf_type, type_hints

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[\w\[]")
_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s?(.*)$")


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
