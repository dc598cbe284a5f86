"""Record sources: one small random-access interface over JSONL, text, lists, TFDS and HF datasets.

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

TensorFlow Datasets and Hugging Face `datasets` are optional extras (`pip install ppo_jax[tfds]`,
`ppo_jax[hf-datasets]`); they are imported only when their constructor is called.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

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
# Field selection shared by every source.


def _field_map(fields: FieldSpec) -> dict[str, str] | None:
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


def _describe_field(ours: str, stored: str) -> str:
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


def _select(record: Any, mapping: dict[str, str] | None, where: str) -> dict[str, Any]:
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
                f"{where}: missing field {_describe_field(ours, stored)}; the record has fields "
                f"{available}. Fix the data or map the field with "
                f"fields={{{ours!r}: '<name in your data>'}}",
                where=where, field=ours, stored=stored, available=available)
        out[ours] = record[stored]
    return out


def _check_text_fields(record: dict[str, Any], where: str) -> None:
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


def _check_path(path: str | os.PathLike, what: str) -> str:
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


# --------------------------------------------------------------------------------------------
# In-memory sources: lists, JSONL and text files (loaded and validated eagerly, so bad data fails
# at start-up with its file and line, never halfway through a run).


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
    mapping = _field_map(fields)
    out = []
    for i, record in enumerate(records):
        where = f"{name}[{i}]"
        selected = _select(record, mapping, where)
        _check_text_fields(selected, where)
        out.append(selected)
    if not out:
        raise ValueError(f"{name}: no records (the list is empty)")
    return ListSource(out, name=name)


def where(source: Source, index: int) -> str:
    """Names record `index` of any source in messages (file:line where the source knows it)."""
    if hasattr(source, "where"):
        return source.where(index)
    return f"{getattr(source, 'name', 'source')}[{index}]"


def from_jsonl(path: str | os.PathLike, fields: FieldSpec = None) -> ListSource:
    """Source over a JSON Lines file: one JSON object per line; blank lines are skipped.

    The file is UTF-8 (a byte-order mark at its start is accepted). A malformed line or invalid
    UTF-8 raises ValueError naming the file and line number; a missing field (MissingFieldError)
    names the field, the file and the line; a file without records says it is empty.
    """
    path = _check_path(path, "JSONL file")
    mapping = _field_map(fields)
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
        selected = _select(record, mapping, where)
        _check_text_fields(selected, where)
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
    path = _check_path(path, "text file")
    out, lines = [], []
    for line_number, line in _lines(path):
        text = line.rstrip("\r\n")
        if text.strip():
            out.append({field: text})
            lines.append(line_number)
    if not out:
        raise ValueError(f"text file {path!r} is empty (no non-blank lines)")
    return ListSource(out, name=path, lines=lines)


# --------------------------------------------------------------------------------------------
# TensorFlow Datasets (array_record, random access without TensorFlow).


def _to_python(value: Any) -> Any:
    """TFDS values -> plain Python: bytes -> str, NumPy scalars/arrays -> Python values/lists."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "SO":
            return [_to_python(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_python(v) for v in value]
    return value


class TfdsSource:
    """Random access over a prepared TFDS split in array_record format."""

    def __init__(self, data_source: Any, mapping: dict[str, str] | None, name: str):
        self._data_source = data_source
        self._mapping = mapping
        self.name = name

    def __len__(self) -> int:
        return len(self._data_source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = f"{self.name}[{index}]"
        record = _select(_to_python(self._data_source[int(index)]), self._mapping, where)
        _check_text_fields(record, where)
        return record

    def __repr__(self) -> str:
        return f"TfdsSource({self.name!r}, {len(self)} records)"


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("TensorFlow Datasets sources need the optional extra: "
                          "pip install 'ppo_jax[tfds]' (tensorflow-datasets, array_record, "
                          "importlib_resources; TensorFlow itself is not needed)") from e
    return tfds


def from_tfds(name: Any, split: str = "train", data_dir: str | os.PathLike | None = None,
              fields: FieldSpec = None, download: bool = False) -> TfdsSource:
    """Source over a TFDS split read through `tfds.data_source` (array_record; no TensorFlow).

    name: a registered dataset name ("my_dataset", "my_dataset/config:1.0.0") or a
      `tfds.core.DatasetBuilder` instance. The dataset must be prepared with
      `file_format="array_record"` (random access); `download=True` lets TFDS prepare it.
    split: any TFDS split expression ("train", "train[:90%]", ...).
    Text features arrive as bytes and are decoded to str.
    """
    tfds = _import_tfds()
    if data_dir is not None and not os.path.isdir(os.fspath(data_dir)):
        raise FileNotFoundError(f"TFDS data_dir {os.fspath(data_dir)!r} does not exist or is not a "
                                f"directory")
    mapping = _field_map(fields)
    if isinstance(name, tfds.core.DatasetBuilder):
        builder = name
        label = f"tfds:{builder.name}/{split}"
        if download:
            builder.download_and_prepare(file_format="array_record")
        try:
            data_source = builder.as_data_source(split=split)
        except Exception as e:  # TFDS raises several types here; say what to do.
            raise ValueError(f"{label}: cannot open as a random-access data source ({e}); prepare "
                             f"it with file_format='array_record'") from e
    else:
        label = f"tfds:{name}/{split}"
        try:
            data_source = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
        except Exception as e:
            raise ValueError(f"{label}: cannot open from data_dir={data_dir!r} ({type(e).__name__}: "
                             f"{e}). Prepare the dataset there with file_format='array_record', or "
                             f"pass download=True") from e
    if mapping is not None:
        available = set(data_source.dataset_info.features.keys())
        missing = [f"{_describe_field(o, s)}" for o, s in mapping.items() if s not in available]
        if missing:
            raise KeyError(f"{label}: missing field(s) {', '.join(missing)}; the dataset has "
                           f"features {sorted(available)}")
    if len(data_source) == 0:
        raise ValueError(f"{label} is empty (no records)")
    return TfdsSource(data_source, mapping, label)


# --------------------------------------------------------------------------------------------
# Hugging Face `datasets` (local files or a dataset saved with `save_to_disk`).

_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                ".txt": "text", ".arrow": "arrow"}


class HfDatasetSource:
    """Random access over a Hugging Face `datasets.Dataset`."""

    def __init__(self, dataset: Any, mapping: dict[str, str] | None, name: str):
        self._dataset = dataset
        self._mapping = mapping
        self.name = name

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = f"{self.name}[{index}]"
        record = _select(self._dataset[int(index)], self._mapping, where)
        _check_text_fields(record, where)
        return record

    def __repr__(self) -> str:
        return f"HfDatasetSource({self.name!r}, {len(self)} records)"


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError("Hugging Face datasets sources need the optional extra: "
                          "pip install 'ppo_jax[hf-datasets]'") from e
    return datasets


def _load_hf(datasets, path_or_files: Any, split: str, cache_dir: str | None):
    """Returns (Dataset, label). Only local data: no hub names, no downloads."""
    if isinstance(path_or_files, datasets.Dataset):
        return path_or_files, "hf:<Dataset>"
    if isinstance(path_or_files, datasets.DatasetDict):
        if split not in path_or_files:
            raise KeyError(f"hf:<DatasetDict> has no split {split!r}; splits: {list(path_or_files)}")
        return path_or_files[split], f"hf:<DatasetDict>/{split}"
    files = [path_or_files] if isinstance(path_or_files, str | os.PathLike) else list(path_or_files)
    if not files:
        raise ValueError("from_hf_datasets: no files given")
    files = [os.fspath(f) for f in files]
    for f in files:
        if not os.path.exists(f):
            raise FileNotFoundError(f"Hugging Face dataset path {f!r} does not exist (only local "
                                    f"files or save_to_disk directories are read)")
    if len(files) == 1 and os.path.isdir(files[0]):
        loaded = datasets.load_from_disk(files[0])
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise KeyError(f"hf:{files[0]} has no split {split!r}; splits: {list(loaded)}")
            loaded = loaded[split]
        return loaded, f"hf:{files[0]}"
    extensions = {os.path.splitext(f)[1].lower() for f in files}
    builders = {_HF_BUILDERS.get(ext) for ext in extensions}
    if None in builders or len(builders) != 1:
        raise ValueError(f"from_hf_datasets: cannot tell the format of {files}; use files of one kind "
                         f"among {sorted(_HF_BUILDERS)} or a save_to_disk directory")
    for f in files:
        _check_path(f, "Hugging Face dataset file")
        if os.path.getsize(f) == 0:
            raise ValueError(f"Hugging Face dataset file {f!r} is empty (no records)")
    # Local files are always in the "train" split of the json/csv/... builders.
    label = f"hf:{files[0]}" + (f" (+{len(files) - 1} files)" if len(files) > 1 else "")
    try:
        dataset = datasets.load_dataset(builders.pop(), data_files=files, split="train",
                                        cache_dir=cache_dir)
    except Exception as e:
        raise ValueError(f"{label}: could not be read by datasets ({type(e).__name__}: {e})") from e
    return dataset, label


def from_hf_datasets(path_or_files: Any, split: str = "train", fields: FieldSpec = None,
                     cache_dir: str | os.PathLike | None = None) -> HfDatasetSource:
    """Source over a Hugging Face `datasets.Dataset` from local data only.

    path_or_files: a local file or list of files (.jsonl/.json/.csv/.parquet/.txt/.arrow), a
      directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or an in-memory
      `datasets.Dataset` / `DatasetDict`.
    split: chooses the split of a DatasetDict; plain files form a single split.
    cache_dir: where `datasets` writes its Arrow cache for plain files (default: its own).
    """
    datasets = _import_datasets()
    dataset, label = _load_hf(datasets, path_or_files, split,
                              None if cache_dir is None else os.fspath(cache_dir))
    mapping = _field_map(fields)
    if mapping is not None:
        columns = set(dataset.column_names)
        missing = [_describe_field(o, s) for o, s in mapping.items() if s not in columns]
        if missing:
            raise KeyError(f"{label}: missing field(s) {', '.join(missing)}; the dataset has columns "
                           f"{sorted(columns)}")
    if len(dataset) == 0:
        raise ValueError(f"{label} is empty (no records)")
    return HfDatasetSource(dataset, mapping, label)
