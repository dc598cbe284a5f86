"""Export: our params -> a Hugging Face checkpoint directory (config.json, model.safetensors and,
when given, the tokenizer) that transformers loads, written atomically (a temporary directory
beside the target, renamed into place at the end).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ppo_jax import sharding
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.lora import merge_lora
from ppo_jax.models.hf.config_map import DTYPE_NAMES, KINDS, config_to_hf
from ppo_jax.models.hf.errors import HFModelError
from ppo_jax.models.hf.layouts import TensorMap, path_keys, tensor_maps
from ppo_jax.models.hf.safetensors_io import DTYPE_CODES, write_safetensors

def export_model(out_dir: str | os.PathLike, config: ModelConfig, params: Any, *,
                 kind: str = "causal_lm", tokenizer=None, adapters: Any = None) -> Path:
    """Writes `params` as a Hugging Face checkpoint directory (config.json, model.safetensors and,
    when given, the tokenizer) that transformers' AutoModelForCausalLM / AutoModelForSequence-
    Classification loads. Written to a temporary directory beside `out_dir` and renamed at the
    end, so `out_dir` is never half-written; an existing `out_dir` is replaced.

    adapters: LoRA adapters (config.lora's "lora" tree) merged into the weights first (`merge_lora`):
    full weights of the adapted model. To write the adapters alone use `peft.export_adapter`.

    Tensors are written in the params' dtype, one group of params gathered to host at a time.
    Every process must call this (gathering is collective); process 0 writes.
    """
    if kind not in KINDS:
        raise HFModelError(f"kind must be one of {KINDS}, got {kind!r}")
    if adapters is not None:
        if config.lora is None:
            raise HFModelError("adapters given but config.lora is None: nothing says how to merge them")
        params = merge_lora(params, adapters, config.lora)
    out_dir = Path(out_dir)
    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(params)}
    unsupported = dtypes - set(DTYPE_CODES)
    if unsupported:
        raise HFModelError(f"cannot export params of dtype {sorted(map(str, unsupported))}")
    if dtypes:
        config = config.replace(param_dtype=DTYPE_NAMES[max(dtypes, key=lambda d: d.itemsize)])
    hf_config = config_to_hf(config, kind)  # fails early, before anything is written
    if kind == "reward":
        params = _fold_score_bias(config, params)
    flat = {path_keys(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    groups = _export_groups(config, flat, kind)

    def write_metadata(directory: Path) -> None:
        hf_config.save_pretrained(str(directory))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))

    return write_weights_dir(out_dir, config, groups, flat, weights_file="model.safetensors",
                             write_metadata=write_metadata, what="export")


def write_weights_dir(out_dir: Path, config: ModelConfig, groups: list[_ExportGroup], flat: Mapping, *,
                      weights_file: str, write_metadata: Callable[[Path], None], what: str) -> Path:
    """Writes `groups` (gathered to host one group at a time) as `weights_file` and whatever
    `write_metadata(directory)` adds, into a temporary directory beside `out_dir` that is renamed at
    the end, so `out_dir` is never half-written. Collective: every process calls it, process 0 writes."""
    writer = jax.process_index() == 0
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if writer:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            entries = [(name, g.dtype, g.first.hf_shape)
                       for g in groups for name in g.names(config.num_layers)]
            write_safetensors(tmp / weights_file, entries,
                              (item for group in groups
                               for item in _group_tensors(group, flat, config.num_layers)))
            write_metadata(tmp)
            _replace_dir(tmp, out_dir)
        else:
            for group in groups:  # take part in the collective gathers
                _group_tensors(group, flat, config.num_layers)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"ppo_jax {what} {out_dir}")
    return out_dir


def _replace_dir(tmp: Path, out_dir: Path):
    """Renames `tmp` to `out_dir`; an existing `out_dir` is first renamed aside, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _to_host(x) -> np.ndarray:
    """A param (NumPy or a possibly sharded jax.Array) as one host array (collective for jax)."""
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(sharding.to_host(x))


def _fold_score_bias(config: ModelConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """Hugging Face's score head has no bias. GPT-2's final LayerNorm has one, and the score is
    linear in it: adding delta = b * w / |w|^2 to ln_f's bias adds exactly b to every score. The
    Llama family (RMSNorm, no bias anywhere) has nowhere to put it, so a nonzero bias is an error.

    Score kernel w [D, 1], bias b [1], ln_f bias [D]; returns params with b folded in and set to 0.
    """
    bias = _to_host(params["score"]["bias"]).astype(np.float64)
    if not np.any(bias):
        return dict(params)
    if config.family != "gpt2":
        raise HFModelError(
            f"score bias is {bias.tolist()}, but {config.arch} ForSequenceClassification has no "
            f"score bias and no final-norm bias to fold it into; train the reward head with a zero "
            f"bias (or apply the offset outside the model) before exporting")
    w = _to_host(params["score"]["kernel"]).astype(np.float64)[:, 0]
    transformer = dict(params["transformer"])
    ln_f = dict(transformer["ln_f"])
    old = _to_host(ln_f["bias"])
    ln_f["bias"] = (old.astype(np.float64) + bias[0] * w / np.dot(w, w)).astype(old.dtype)
    transformer["ln_f"] = ln_f
    score = {"kernel": params["score"]["kernel"], "bias": np.zeros_like(bias, dtype=old.dtype)}
    return {**params, "transformer": transformer, "score": score}


@dataclasses.dataclass(frozen=True)
class _ExportGroup:
    """One HF tensor name (per layer when stacked) and the params of ours that fill it."""

    maps: tuple[tuple[tuple[str, ...], TensorMap], ...]
    dtype: np.dtype

    @property
    def first(self) -> TensorMap:
        return self.maps[0][1]

    def names(self, num_layers: int) -> list[str]:
        return [name for _, name in self.first.instances(num_layers)]


def _export_groups(config: ModelConfig, flat: Mapping[tuple[str, ...], Any], kind: str
                   ) -> list[_ExportGroup]:
    """`flat` (our param path -> array) grouped by the HF tensor each param fills, each group in
    the widest dtype of its params; every param the model needs must be there, zeros ones zero."""
    maps = tensor_maps(config, kind)
    missing = sorted(set(maps) - set(flat))
    if missing:
        raise HFModelError(f"params lack {['/'.join(p) for p in missing]}, which a {kind} "
                              f"{config.arch} model needs")
    by_name: dict[str, list[tuple[tuple[str, ...], TensorMap]]] = {}
    for path, m in maps.items():
        if m.zeros:
            if np.any(_to_host(flat[path])):
                raise HFModelError(f"param {'/'.join(path)} must be zero to export")
            continue
        by_name.setdefault(m.name, []).append((path, m))
    return [_ExportGroup(tuple(parts), np.result_type(*[np.dtype(flat[p].dtype) for p, _ in parts]))
            for parts in by_name.values()]


def _group_tensors(group: _ExportGroup, flat: Mapping[tuple[str, ...], Any], num_layers: int
                   ) -> list[tuple[str, np.ndarray]]:
    """The HF tensors of one group, built from our params gathered to host (collective): (name,
    array of shape `group.first.hf_shape`), one per layer when stacked."""
    host = {path: _to_host(flat[path]) for path, _ in group.maps}
    out = []
    for index, name in group.first.instances(num_layers):
        tensor = np.zeros(group.first.hf_shape, group.dtype)
        for path, m in group.maps:
            ours = host[path][index]  # this layer's / expert's slice (index () when neither)
            block = ours.transpose(np.argsort(m.perm)).reshape([math.prod(s) for s in m.split])
            tensor[tuple(slice(b, b + n) for b, n in zip(m.start, block.shape))] = block
        out.append((name, tensor))
    return out
