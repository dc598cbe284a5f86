"""TensorFlow Datasets as a source: a prepared split in array_record format, read with random access
through `tfds.data_source` (no TensorFlow). An optional extra: `pip install 'ppo_jax[tfds]'`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ppo_jax.data.sources import DatasetSource, FieldSpec, describe_field, field_map


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


class TfdsSource(DatasetSource):
    """Random access over a prepared TFDS split in array_record format (bytes decoded to str, NumPy
    values to Python ones)."""

    def __init__(self, data_source: Any, mapping: dict[str, str] | None, name: str):
        super().__init__(data_source, mapping, name, to_python=_to_python)


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
    mapping = field_map(fields)
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
        missing = [f"{describe_field(o, s)}" for o, s in mapping.items() if s not in available]
        if missing:
            raise KeyError(f"{label}: missing field(s) {', '.join(missing)}; the dataset has "
                           f"features {sorted(available)}")
    if len(data_source) == 0:
        raise ValueError(f"{label} is empty (no records)")
    return TfdsSource(data_source, mapping, label)
