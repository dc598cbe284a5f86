"""PEFT LoRA adapter directories <-> our adapter tree ("lora" collection, models/lora.py).

A PEFT directory is `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with tensors `base_model.model.<HF module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]; `peft.PeftModel.from_pretrained(base, dir)` loads it on the base model.
The tensor table is layouts.lora_tensor_maps; loading and writing reuse load's shard reader and
export's gather and atomic directory write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.models import lora as lora_lib
from ppo_jax.models.config import LoraConfig, ModelConfig
from ppo_jax.models.hf.errors import HFModelError
from ppo_jax.models.hf.export import _ExportGroup, write_weights_dir
from ppo_jax.models.hf.layouts import lora_module_names, lora_tensor_maps, make_model, path_keys
from ppo_jax.models.hf.load import _shard_reader
from ppo_jax.models.hf.safetensors_io import TensorStore
from ppo_jax.models.init import boxed_params

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json options that change the function or the tensors beyond plain LoRA: refused by
# name when set to anything but their "off" value.
_UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "bias": "none", "rank_pattern": {},
                "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
                "layer_replication": None, "target_parameters": None, "lora_bias": False,
                "trainable_token_indices": None, "use_qalora": False, "exclude_modules": None}


def export_adapter(out_dir: str | os.PathLike, config: ModelConfig, adapters: Any, *,
                   base_model_name_or_path: str | None = None) -> Path:
    """Writes `adapters` (the "lora" tree of a model with `config.lora`) as a PEFT adapter directory.

    target_modules are the Hugging Face modules inside a layer ("self_attn.q_proj"; PEFT matches
    them as suffixes). Written to a temporary directory and renamed; every process must call this
    (gathering is collective); process 0 writes.
    """
    if config.lora is None:
        raise HFModelError("config.lora is None: there are no adapters to export")
    out_dir = Path(out_dir)
    maps = lora_tensor_maps(config)
    flat = {path_keys(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    if set(flat) != set(maps):
        raise HFModelError(f"adapters do not match config.lora: only in adapters "
                              f"{sorted(set(flat) - set(maps))}, only in config {sorted(set(maps) - set(flat))}")
    groups = [_ExportGroup(((path, m),), np.dtype(flat[path].dtype)) for path, m in maps.items()]
    names = lora_module_names(config)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": config.lora.rank, "lora_alpha": config.lora.alpha, "use_rslora": config.lora.rslora,
        "target_modules": sorted({names[t] for t in config.lora.targets}),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": config.family == "gpt2",  # GPT-2's Conv1D
        "inference_mode": True, "use_dora": False, "modules_to_save": None,
    }
    return write_weights_dir(
        out_dir, config, groups, flat, weights_file=WEIGHTS_FILE, what="export_adapter",
        write_metadata=lambda directory: (directory / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2)))


def adapter_lora_config(path: str | os.PathLike, config: ModelConfig) -> LoraConfig:
    """The LoraConfig a PEFT directory describes for a base model of `config`; anything that is not
    plain LoRA on projections we have is refused by name, before any weight is read."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise HFModelError(f"{path} has no {CONFIG_FILE}; a PEFT adapter directory needs it")
    data = json.loads(file.read_text())
    if data.get("peft_type") != "LORA":
        raise HFModelError(f"{file}: peft_type {data.get('peft_type')!r} is not supported (only LORA)")
    for key, off in _UNSUPPORTED.items():
        if data.get(key, off) not in (off, None, {}, [], False):
            raise HFModelError(f"{file}: {key}={data[key]!r} is not supported (plain LoRA only)")
    modules = data.get("target_modules")
    if not isinstance(modules, list):
        raise HFModelError(f"{file}: target_modules={modules!r} is not supported; give a list of "
                              f"module names (a regex string is not read)")
    names = lora_module_names(config)
    # PEFT adapts a module whose name is a target or ends with "." + a target.
    targets = [t for t, name in names.items()
               if any(name == m or name.endswith("." + m) for m in modules)]
    unmatched = [m for m in modules if not any(n == m or n.endswith("." + m) for n in names.values())]
    if unmatched:
        raise HFModelError(f"{file}: target_modules {unmatched} match no projection of a {config.arch} "
                              f"model (its modules: {sorted(set(names.values()))})")
    return LoraConfig(rank=int(data["r"]), alpha=float(data["lora_alpha"]), targets=tuple(targets),
                      rslora=bool(data.get("use_rslora", False)))


def load_adapter(path: str | os.PathLike, config: ModelConfig, mesh: jax.sharding.Mesh,
                 rules=sharding.DEFAULT_RULES) -> tuple[ModelConfig, Any]:
    """Reads a PEFT LoRA directory for a base model of `config` (e.g. `hf.load_model(...).config`).

    Returns (config with `lora` set, the adapter tree placed on its mesh shardings, float32). Options
    and tensor names and shapes are all checked before any device memory is used.
    """
    path = Path(path)
    config = config.replace(lora=adapter_lora_config(path, config))
    maps = lora_tensor_maps(config)
    store = TensorStore([path / WEIGHTS_FILE])
    try:
        needed = {name: m.hf_shape for m in maps.values() for _, name in m.instances(config.num_layers)}
        for name, shape in needed.items():
            if name not in store.tensors:
                raise HFModelError(f"tensor {name!r} is missing from {path / WEIGHTS_FILE}")
            if store.tensors[name].shape != shape:
                raise HFModelError(f"tensor {name!r} has shape {list(store.tensors[name].shape)}, "
                                      f"but r and the base model imply {list(shape)}")
        unused = sorted(set(store.tensors) - set(needed))
        if unused:
            raise HFModelError(f"{path / WEIGHTS_FILE} has tensors that adapter_config.json does not "
                                  f"describe: {unused[:8]}")
        abstract = boxed_params(make_model(config, "causal_lm"), collection=lora_lib.COLLECTION)
        shardings = sharding.tree_shardings(abstract, mesh, rules)
        dtype = np.dtype(config.lora.param_dtype)

        def load_leaf(keypath, leaf, leaf_sharding):
            reader = _shard_reader(store, maps[path_keys(keypath)], leaf.shape, dtype)
            return jax.make_array_from_callback(leaf.shape, leaf_sharding, reader)

        adapters = jax.tree_util.tree_map_with_path(load_leaf, nn.unbox(abstract), shardings)
    finally:
        store.close()
    return config, adapters
