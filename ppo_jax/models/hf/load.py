"""Loading: a local Hugging Face checkpoint directory -> our params, placed straight onto their mesh
shardings (each device reads only its own shard of each tensor, from a memory map of the file).

Everything is validated (files, architecture, tensor names and shapes) before any device memory is
used.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.models.config import EXECUTION_FIELDS, ModelConfig
from ppo_jax.models.hf.config_map import checkpoint_kind, config_from_hf
from ppo_jax.models.hf.errors import HFModelError
from ppo_jax.models.hf.layouts import (
    TensorMap,
    abstract_params,
    check_maps_cover,
    find_prefix,
    make_model,
    path_keys,
    tensor_maps,
)
from ppo_jax.models.hf.safetensors_io import TensorStore, weight_files

# Tensors some checkpoints carry that are not parameters (old GPT-2 causal-mask buffers, cached
# rotary frequencies): skipped silently.
_BUFFER_PATTERN = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


@flax.struct.dataclass
class LoadedModel:
    """A checkpoint loaded onto a mesh.

    config: our ModelConfig; params: plain param tree, each array on its target NamedSharding
    (stacked layer params have a leading [L] axis, e.g. q kernel [L, D, H, Dh]);
    kind: "causal_lm" (CausalLM, logits [B, T, V]) or "reward" (ScalarModel, scores [B, T]).
    """

    config: ModelConfig = flax.struct.field(pytree_node=False)
    params: Any
    kind: str = flax.struct.field(pytree_node=False, default="causal_lm")

    @property
    def module(self) -> nn.Module:
        return make_model(self.config, self.kind)


def load_config(path: str | os.PathLike) -> tuple[ModelConfig, str]:
    """(ModelConfig, kind) of a checkpoint directory, from its config.json alone."""
    data = _read_config_json(Path(path))
    return config_from_hf(data), checkpoint_kind(data)


def load_model(path: str | os.PathLike, mesh: jax.sharding.Mesh, rules=sharding.DEFAULT_RULES, *,
               param_dtype: str | None = None, dtype: str | None = None,
               kind: str | None = None, execution: Mapping[str, Any] | None = None) -> LoadedModel:
    """Loads a local Hugging Face checkpoint directory onto `mesh`.

    Each device reads only its own shard of each tensor (straight from a memory map of the
    safetensors file), so a model that does not fit on one device still loads. Everything is
    validated (files, architecture, tensor names and shapes) before any device memory is used.

    param_dtype / dtype: parameter and compute dtypes (default float32 for both; a bf16 checkpoint
    is upcast unless param_dtype="bfloat16"). kind: defaults to what config.json's architectures
    say; a mismatch raises. execution: ModelConfig execution fields (attention, scan_layers, remat,
    remat_policy) to run the model with; `scan_layers=False` loads per-layer params.
    """
    path = Path(path)
    data = _read_config_json(path)
    found_kind = checkpoint_kind(data)
    if kind is not None and kind != found_kind:
        raise HFModelError(f"{path} holds a {found_kind} checkpoint "
                              f"({data.get('architectures')}), but kind={kind!r} was requested")
    config = config_from_hf(data)
    overrides = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v is not None}
    unknown = set(execution or ()) - set(EXECUTION_FIELDS)
    if unknown:
        raise ValueError(f"load_model(execution=...) takes only {EXECUTION_FIELDS}, got {sorted(unknown)}")
    config = config.replace(**overrides, **(execution or {}))
    store = TensorStore(weight_files(path))
    try:
        maps = tensor_maps(config, found_kind, find_prefix(store.tensors, config))
        abstract = abstract_params(config, found_kind)
        check_maps_cover(abstract, maps, config.num_layers)
        _validate_tensors(store, maps, config, path)
        shardings = sharding.tree_shardings(abstract, mesh, rules)
        values = nn.unbox(abstract)
        target_dtype = np.dtype(config.jnp_param_dtype)

        def load_leaf(keypath, leaf, leaf_sharding):
            m = maps[path_keys(keypath)]
            return jax.make_array_from_callback(
                leaf.shape, leaf_sharding, _shard_reader(store, m, leaf.shape, target_dtype))

        params = jax.tree_util.tree_map_with_path(load_leaf, values, shardings)
    finally:
        store.close()
    return LoadedModel(config=config, params=params, kind=found_kind)


def _read_config_json(path: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, with an error naming what is missing or broken."""
    if not path.exists():
        raise HFModelError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise HFModelError(f"checkpoint path {path} is not a directory (expected a Hugging Face "
                              f"checkpoint directory with config.json and safetensors weights)")
    file = path / "config.json"
    if not file.is_file():
        raise HFModelError(f"{path} has no config.json; a Hugging Face checkpoint directory "
                              f"needs config.json next to its safetensors weights")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HFModelError(f"{file} is not valid JSON: {err}") from err


def _slice_bounds(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A shard's index (one slice per axis of an array of `shape`) -> per axis (start, stop)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _read_window(store: TensorStore, m: TensorMap, name: str, bounds) -> np.ndarray:
    """The part `bounds` (per our per-layer axis: (start, stop)) of one layer's param: an array of
    shape [stop - start per axis] (a sub-block of `m.our_shape`) in the checkpoint's dtype.

    Reads only the HF rows/columns needed when the slice is contiguous in the HF layout (always
    the case under the default rules, which never split head_dim), else the whole window.
    """
    sub_bounds: list[tuple[int, int] | None] = [None] * len(m.perm)
    for our_axis, flat_axis in enumerate(m.perm):
        sub_bounds[flat_axis] = bounds[our_axis]
    hf_index, read_shape, post = [], [], []
    flat = 0
    for axis, sub in enumerate(m.split):
        parts = sub_bounds[flat:flat + len(sub)]
        inner = math.prod(sub[1:])
        begin = m.start[axis]
        if all(parts[j] == (0, sub[j]) for j in range(1, len(sub))):
            lo, hi = parts[0]
            hf_index.append(slice(begin + lo * inner, begin + hi * inner))
            read_shape += [hi - lo, *sub[1:]]
            post += [slice(None)] * len(sub)
        else:
            hf_index.append(slice(begin, begin + math.prod(sub)))
            read_shape += list(sub)
            post += [slice(lo, hi) for lo, hi in parts]
        flat += len(sub)
    block = np.asarray(store.array(name)[tuple(hf_index)])
    return block.reshape(read_shape)[tuple(post)].transpose(m.perm)


def _read_layer(store: TensorStore, m: TensorMap, layer: int | None, bounds) -> np.ndarray:
    """One layer's part of our param (`bounds` over its per-layer axes); an expert map stacks the
    experts' tensors in bounds[0]'s range."""
    if not m.experts:
        return _read_window(store, m, m.tensor_name(layer), bounds)
    (first, last), rest = bounds[0], bounds[1:]
    return np.stack([_read_window(store, m, m.tensor_name(layer, e), rest) for e in range(first, last)])


def _shard_reader(store: TensorStore, m: TensorMap, shape: tuple[int, ...], dtype) -> Callable:
    """Callback for jax.make_array_from_callback: global index -> that shard of our param (whose full
    shape is `shape`, [L, *m.our_shape] when stacked) as a host array of `dtype`."""
    cache: dict[Any, np.ndarray] = {}  # replicated shards are read once, not once per device

    def read(index: tuple[slice, ...]) -> np.ndarray:
        bounds = _slice_bounds(index, shape)
        if bounds in cache:
            return cache[bounds]
        if m.zeros:
            out = np.zeros([hi - lo for lo, hi in bounds], dtype)
        elif m.stacked:
            (first, last), rest = bounds[0], bounds[1:]
            out = np.stack([_read_layer(store, m, i, rest).astype(dtype) for i in range(first, last)])
        else:
            out = _read_layer(store, m, None, bounds).astype(dtype)
        cache[bounds] = out
        return out

    return read


def _validate_tensors(store: TensorStore, maps: Mapping[tuple[str, ...], TensorMap],
                      config: ModelConfig, path: Path):
    """Every tensor present with the shape config.json implies; nothing left unused."""
    needed: dict[str, tuple[int, ...]] = {}
    for m in maps.values():
        if m.zeros:
            continue
        for _, name in m.instances(config.num_layers):
            needed[name] = m.hf_shape
    for name, want in needed.items():
        if name not in store.tensors:
            raise HFModelError(f"tensor {name!r} is missing from the checkpoint in {path}")
        got = store.tensors[name].shape
        if got != want:
            raise HFModelError(
                f"shape mismatch: tensor {name!r} in {store.tensors[name].file.name} has shape "
                f"{list(got)}, but config.json implies {list(want)}")
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unused = sorted(n for n in store.tensors
                    if n not in needed and n not in tied_head and not _BUFFER_PATTERN.search(n))
    if unused:
        shown = ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "")
        raise HFModelError(
            f"checkpoint in {path} has {len(unused)} tensors that config.json does not use "
            f"({shown}); config.json does not describe these weights")
