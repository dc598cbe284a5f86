"""safetensors I/O: the weight files of a checkpoint directory (single or sharded with an index),
their tensors read through memory maps, a file written tensor by tensor, and a checkpoint's fingerprint.

Only safetensors is read: pickled `.bin`/`.pt` files are refused and nothing is ever unpickled.
Nothing here knows Hugging Face tensor names or our param trees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from ppo_jax.models.hf.errors import HFModelError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# safetensors dtype code <-> numpy dtype, for the dtypes we read and write.
_SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
DTYPE_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: `shape` elements of `dtype`, row-major, from byte `offset`."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the data in the file


class TensorStore:
    """Every tensor of a checkpoint: name -> where its bytes are, read through memory maps.

    safetensors' own reader validates each file (and names what is wrong with it); data is then
    read through NumPy memory maps, which also handle bfloat16 (safetensors' NumPy reader does not).
    """

    def __init__(self, files: Sequence[Path]):
        self.tensors: dict[str, StoredTensor] = {}
        self._maps: dict[Path, np.memmap] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="numpy"):
                    pass
            except Exception as err:  # SafetensorError, OSError
                raise HFModelError(
                    f"{file} is not a readable safetensors file (truncated or corrupt?): {err}") from err
            with open(file, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            header.pop("__metadata__", None)
            for name, info in header.items():
                code = info["dtype"]
                if code not in _SAFETENSORS_DTYPES:
                    raise HFModelError(
                        f"tensor {name!r} in {file.name} has dtype {code}; supported: "
                        f"{sorted(_SAFETENSORS_DTYPES)}")
                self.tensors[name] = StoredTensor(file, _SAFETENSORS_DTYPES[code],
                                                   tuple(info["shape"]),
                                                   8 + header_len + info["data_offsets"][0])

    def array(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of the whole tensor, shape `tensors[name].shape` (reading it
        touches only what is sliced)."""
        t = self.tensors[name]
        if t.file not in self._maps:
            self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        count = math.prod(t.shape)
        raw = self._maps[t.file][t.offset:t.offset + count * t.dtype.itemsize]
        return raw.view(t.dtype).reshape(t.shape)

    def close(self):
        """Drops the memory maps (views handed out keep their own file alive until released)."""
        self._maps.clear()


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (index first, then the single file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise HFModelError(f"{index} is not a valid safetensors index (needs a "
                                  f"'weight_map'): {err}") from err
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise HFModelError(f"{index.name} in {path} lists shard files that do not exist: "
                                  f"{missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if len(others) == 1:
        return others
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise HFModelError(
            f"{path} has no model.safetensors, only pickled weights ({', '.join(pickles)}); "
            f"ppo_jax reads safetensors only and never unpickles files. Convert the checkpoint "
            f"with transformers: model.save_pretrained(dir, safe_serialization=True)")
    raise HFModelError(
        f"{path} has no weights: expected model.safetensors or model.safetensors.index.json")


def fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """Identifies a checkpoint without reading its tensors: config.json's hash and each weight
    file's size and safetensors-header hash (the header lists every tensor's dtype, shape and
    byte offsets). Recorded in PPO checkpoints so a resume is refused against a different model."""
    path = Path(path)
    out: dict[str, Any] = {"config": hashlib.sha256((path / "config.json").read_bytes()).hexdigest()}
    for f in weight_files(path):
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = fh.read(min(header_len, 100_000_000))
        out[f.name] = {"bytes": f.stat().st_size, "header_sha256": hashlib.sha256(header).hexdigest()}
    return out


def _header(entries: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int]]:
    """safetensors header for tensors in write order; returns (header bytes, name -> data offset)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, position = {}, 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                        "data_offsets": [position, position + size]}
        offsets[name] = position
        position += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, offsets


def write_safetensors(file: str | os.PathLike, entries: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                      tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    """Writes a safetensors file: `entries` (name, dtype, shape) in write order fix the header up
    front, then `tensors` (name, array of that dtype and shape), in the same order, are streamed to
    disk as they come (a lazy iterable need never hold them all in host memory)."""
    header, offsets = _header(entries)
    with open(file, "wb") as fh:
        fh.write(header)
        for name, tensor in tensors:
            assert fh.tell() - len(header) == offsets[name], name
            # safetensors is little-endian, as is every platform JAX runs on.
            fh.write(np.ascontiguousarray(tensor).tobytes())
