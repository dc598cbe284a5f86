"""Record sources: the one small random-access interface every data reader gives, records held in a
list, and the record-at-a-time wrapper the dataset libraries' adapters share.

A source is anything with `__len__` and `__getitem__(i) -> dict`. Records are plain dicts of Python
values; the trainers read these fields:

  prompts      {"prompt"}
  SFT          {"prompt", "response"}
  preferences  {"prompt", "chosen", "rejected"}

A prompt is a string or a list of chat messages (`[{"role": ..., "content": ...}, ...]`, used with a
chat template); responses are strings (a one-message assistant list is also accepted by the
tokenizer).

`fields` (every constructor) chooses and renames fields:
  None                          keep every field as stored, require nothing;
  ("prompt", "response")        require these fields and keep only them;
  {"prompt": "question", ...}   our name -> the name in the data (rename while loading).

The readers: `data/files.py` (JSONL and text files), `data/tfds_source.py` (TensorFlow Datasets) and
`data/hf_source.py` (Hugging Face `datasets`); the last two are optional extras (`pip install
ppo_jax[tfds]`, `ppo_jax[hf-datasets]`), imported only when their constructor is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

PROMPT_FIELDS = ("prompt",)
SFT_FIELDS = ("prompt", "response")
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")

FieldSpec = Sequence[str] | Mapping[str, str] | None


@runtime_checkable
class Source(Protocol):
    """Random access to records: `len(source)` and `source[i] -> dict` for 0 <= i < len."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


# --------------------------------------------------------------------------------------------
# Field selection and checks shared by every source.


def field_map(fields: FieldSpec) -> dict[str, str] | None:
    """Normalises `fields` to {our name: stored name}, or None for 'keep everything'."""
    if fields is None:
        return None
    if isinstance(fields, str):
        raise TypeError(f"fields must be a sequence of names or a mapping, not the string {fields!r}; "
                        f"write fields=({fields!r},)")
    if isinstance(fields, Mapping):
        mapping = {str(k): str(v) for k, v in fields.items()}
    else:
        mapping = {str(name): str(name) for name in fields}
    if not mapping:
        raise ValueError("fields is empty; pass None to keep every field, or name the fields you need")
    return mapping


def describe_field(ours: str, stored: str) -> str:
    return repr(ours) if ours == stored else f"{ours!r} (stored as {stored!r})"


class MissingFieldError(ValueError, KeyError):
    """A record lacks a field the source was asked for.

    A ValueError with a plain one-line message (KeyError's str() would wrap it in quotes), and still
    a KeyError for callers that catch one. `where` (file:line or name[index]), `field` (our name),
    `stored` (its name in the data) and `available` (the record's fields) let a caller that knows
    where the field name came from (a config) say how to fix it there.
    """

    __str__ = BaseException.__str__

    def __init__(self, message: str, *, where: str, field: str, stored: str, available: list[str]):
        super().__init__(message)
        self.where, self.field, self.stored, self.available = where, field, stored, available


def select_fields(record: Any, mapping: dict[str, str] | None, where: str) -> dict[str, Any]:
    """Projects and renames one record; `where` names its origin for error messages."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be a JSON object / dict, got {type(record).__name__}")
    if mapping is None:
        return dict(record)
    out = {}
    for ours, stored in mapping.items():
        if stored not in record:
            available = sorted(record)
            raise MissingFieldError(
                f"{where}: missing field {describe_field(ours, stored)}; the record has fields "
                f"{available}. Fix the data or map the field with "
                f"fields={{{ours!r}: '<name in your data>'}}",
                where=where, field=ours, stored=stored, available=available)
        out[ours] = record[stored]
    return out


def check_text_fields(record: dict[str, Any], where: str) -> None:
    """Known text fields must be strings (a prompt may also be a list of chat messages)."""
    for name in ("prompt", "response", "chosen", "rejected"):
        if name not in record:
            continue
        value = record[name]
        if isinstance(value, str):
            continue
        if isinstance(value, list) and all(isinstance(m, Mapping) and "content" in m for m in value):
            continue  # chat messages
        raise ValueError(f"{where}: field {name!r} must be a string or a list of chat messages "
                         f"({{'role': ..., 'content': ...}}), got {type(value).__name__}: "
                         f"{str(value)[:80]!r}")


# --------------------------------------------------------------------------------------------
# Records held in memory (a list, or a file read whole: validated eagerly, so bad data fails at
# start-up with its file and line, never halfway through a run).


class ListSource:
    """Records held in memory; every record was validated when the source was built.

    lines: the file line of each record (JSONL, text), so later checks can name it as file:line.
    """

    def __init__(self, records: list[dict[str, Any]], name: str = "list",
                 lines: Sequence[int] | None = None):
        if lines is not None and len(lines) != len(records):
            raise ValueError(f"{len(lines)} line numbers for {len(records)} records")
        self._records = records
        self._lines = lines
        self.name = name

    def __len__(self) -> int:
        return len(self._records)

    def where(self, index: int) -> str:
        """Where record `index` came from: "file:line", or "name[index]"."""
        if self._lines is not None:
            return f"{self.name}:{self._lines[index]}"
        return f"{self.name}[{index}]"

    def __getitem__(self, index: int) -> dict[str, Any]:
        # A copy: callers may mutate what they get without changing the source.
        return dict(self._records[index])

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, {len(self)} records)"


def from_list(records: Sequence[Mapping[str, Any]], fields: FieldSpec = None,
              name: str = "list") -> ListSource:
    """Source over in-memory records (dicts). Errors name the record index."""
    mapping = field_map(fields)
    out = []
    for i, record in enumerate(records):
        where = f"{name}[{i}]"
        selected = select_fields(record, mapping, where)
        check_text_fields(selected, where)
        out.append(selected)
    if not out:
        raise ValueError(f"{name}: no records (the list is empty)")
    return ListSource(out, name=name)


def where(source: Source, index: int) -> str:
    """Names record `index` of any source in messages (file:line where the source knows it)."""
    if hasattr(source, "where"):
        return source.where(index)
    return f"{getattr(source, 'name', 'source')}[{index}]"


class DatasetSource:
    """Random access over a dataset library's indexable split (TFDS, Hugging Face `datasets`), each
    record converted to plain Python (`to_python`), projected by the fields and checked as it is read:
    such a split may be too large to validate at start-up."""

    def __init__(self, dataset: Any, mapping: dict[str, str] | None, name: str,
                 to_python: Callable[[Any], Any] = lambda record: record):
        self._dataset = dataset
        self._mapping = mapping
        self._to_python = to_python
        self.name = name

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = f"{self.name}[{index}]"
        record = select_fields(self._to_python(self._dataset[int(index)]), self._mapping, where)
        check_text_fields(record, where)
        return record

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self)} records)"
