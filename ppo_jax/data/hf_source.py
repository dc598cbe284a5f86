"""Hugging Face `datasets` as a source, from local data only: files (.jsonl/.json/.csv/.parquet/.txt/
.arrow), a `save_to_disk` directory or an in-memory Dataset; no hub names, no downloads. An optional
extra: `pip install 'ppo_jax[hf-datasets]'`."""

from __future__ import annotations

import os
from typing import Any

from ppo_jax.data.files import readable_file
from ppo_jax.data.sources import DatasetSource, FieldSpec, describe_field, field_map

_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                ".txt": "text", ".arrow": "arrow"}


class HfDatasetSource(DatasetSource):
    """Random access over a Hugging Face `datasets.Dataset`."""


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
        readable_file(f, "Hugging Face dataset file")
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
    mapping = field_map(fields)
    if mapping is not None:
        columns = set(dataset.column_names)
        missing = [describe_field(o, s) for o, s in mapping.items() if s not in columns]
        if missing:
            raise KeyError(f"{label}: missing field(s) {', '.join(missing)}; the dataset has columns "
                           f"{sorted(columns)}")
    if len(dataset) == 0:
        raise ValueError(f"{label} is empty (no records)")
    return HfDatasetSource(dataset, mapping, label)
