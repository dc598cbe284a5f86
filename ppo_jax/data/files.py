"""Sources read from local files, whole and at once: JSON Lines and plain text (one prompt a line).

Every record is validated while the file is read, so bad data fails at start-up naming its file and
line. Files are UTF-8 (a byte-order mark at the start is accepted); invalid UTF-8 names the line.
"""

from __future__ import annotations

import codecs
import json
import os

from ppo_jax.data.sources import FieldSpec, ListSource, check_text_fields, field_map, select_fields


def readable_file(path: str | os.PathLike, what: str) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path!r} is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{what} {path!r} is not readable (check its permissions)")
    return path


def _lines(path: str):
    """(line number, line) of a UTF-8 text file, the line ending kept.

    A byte-order mark at the start is dropped (editors on Windows write one; it is not part of the
    first record). Invalid UTF-8 raises ValueError naming the file and line: the decoder alone
    names neither.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield from enumerate(f, start=1)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _not_utf8(path: str) -> ValueError:
    """The error for a file that does not decode: finds its first bad line (read again as bytes)."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return ValueError(f"{path}:{line_number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                                  f"byte {e.start + 1} of the line); re-save the file as UTF-8, e.g. "
                                  f"iconv -f latin1 -t utf-8")
    return ValueError(f"{path}: not valid UTF-8; re-save the file as UTF-8")


def from_jsonl(path: str | os.PathLike, fields: FieldSpec = None) -> ListSource:
    """Source over a JSON Lines file: one JSON object per line; blank lines are skipped.

    The file is UTF-8 (a byte-order mark at its start is accepted). A malformed line or invalid
    UTF-8 raises ValueError naming the file and line number; a missing field (MissingFieldError)
    names the field, the file and the line; a file without records says it is empty.
    """
    path = readable_file(path, "JSONL file")
    mapping = field_map(fields)
    out, lines = [], []
    for line_number, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno}): "
                             f"{line.strip()[:80]!r}") from None
        selected = select_fields(record, mapping, where)
        check_text_fields(selected, where)
        out.append(selected)
        lines.append(line_number)
    if not out:
        raise ValueError(f"JSONL file {path!r} is empty (no records)")
    return ListSource(out, name=path, lines=lines)


def from_text(path: str | os.PathLike, field: str = "prompt") -> ListSource:
    """Source over a UTF-8 text file with one prompt per line (blank and whitespace-only lines are
    skipped; a byte-order mark at the start is accepted).

    Each line becomes `{field: line}` without its line ending. Invalid UTF-8 raises ValueError
    naming the file and line.
    """
    path = readable_file(path, "text file")
    out, lines = [], []
    for line_number, line in _lines(path):
        text = line.rstrip("\r\n")
        if text.strip():
            out.append({field: text})
            lines.append(line_number)
    if not out:
        raise ValueError(f"text file {path!r} is empty (no non-blank lines)")
    return ListSource(out, name=path, lines=lines)
