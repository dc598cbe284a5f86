"""Tensor layouts: which Hugging Face tensor (name, shape, window, axis order) holds each of our params.

How a tensor travels. Every parameter of ours is described by a `TensorMap`: a window of one Hugging
Face tensor (per layer for our scanned, stacked layers), split into sub-axes and transposed into our
layout. GPT-2's packed `c_attn` [D, 3D] (Conv1D, [in, out]) gives q, k, v as three windows of its
output axis split into (H, Dh) (Phi-3's fused `qkv_proj` and `gate_up_proj` likewise, by rows);
Llama's `q_proj.weight` [H*Dh, D] (torch Linear, [out, in]) splits into (H, Dh, D) and transposes to
our [D, H, Dh]. The same table drives loading (`load`: each device shard reads only the rows and
columns it needs) and export (`export`: the inverse transpose, written into the window).

Also here: the same table for LoRA adapters in PEFT's names (`lora_tensor_maps`), and our side of the
table, the Flax module and abstract param tree for a checkpoint kind.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import flax.linen as nn
import jax

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.lora_config import TARGETS
from ppo_jax.models.hf.config_map import KINDS
from ppo_jax.models.hf.errors import HFModelError
from ppo_jax.models.init import boxed_params
from ppo_jax.models.transformer import CausalLM, ScalarModel



@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters as a window of one Hugging Face tensor.

    name:     the HF tensor name; "{layer}" stands for the layer index of a stacked (scanned) param,
              whose leading L axis is then assembled from L tensors.
    hf_shape: the full shape the HF tensor must have.
    start:    per HF axis, where the window begins (GPT-2's c_attn packs q, k, v side by side).
    split:    per HF axis, the sub-axes that axis splits into (their product is the window's size).
    perm:     our (per-layer) axes as a permutation of the flattened sub-axes.
    zeros:    no HF tensor: the param (of shape hf_shape) is all zeros on load (the score bias) and
              must be zero on export.
    experts:  MoE expert weights: "{expert}" in `name` stands for the expert index, and our
              (per-layer) param's leading [E] axis is assembled from E tensors (0: not an expert map).
    """

    name: str
    hf_shape: tuple[int, ...]
    start: tuple[int, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    zeros: bool = False
    experts: int = 0

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.name

    def tensor_name(self, layer: int | None = None, expert: int | None = None) -> str:
        """The HF tensor of one layer (when stacked) and one expert (of an expert map)."""
        name = self.name if layer is None else self.name.replace("{layer}", str(layer))
        return name if expert is None else name.replace("{expert}", str(expert))

    def instances(self, num_layers: int) -> list[tuple[tuple[int, ...], str]]:
        """Every HF tensor this param is assembled from: (its index into our param's leading
        [L] and/or [E] axes, its name)."""
        layers = range(num_layers) if self.stacked else [None]
        experts = range(self.experts) if self.experts else [None]
        return [(tuple(i for i in (layer, expert) if i is not None), self.tensor_name(layer, expert))
                for layer in layers for expert in experts]

    @property
    def our_shape(self) -> tuple[int, ...]:
        """Our param's shape (per layer when stacked: the full param is [L, *our_shape]); an
        expert map's starts with [E]."""
        if self.zeros:
            return self.hf_shape
        flat = [d for sub in self.split for d in sub]
        return ((self.experts,) if self.experts else ()) + tuple(flat[p] for p in self.perm)


def _window(name, hf_shape, split, perm, start=None) -> TensorMap:
    start = start if start is not None else (0,) * len(hf_shape)
    return TensorMap(name, tuple(hf_shape), tuple(start), tuple(tuple(s) for s in split), tuple(perm))


def _same(name, shape) -> TensorMap:
    """Tensor stored exactly as we store it."""
    return _window(name, shape, [(d,) for d in shape], range(len(shape)))


def _transposed(name, out_dim, in_dim) -> TensorMap:
    """torch Linear weight [out, in] -> our kernel [in, out]."""
    return _window(name, (out_dim, in_dim), [(out_dim,), (in_dim,)], (1, 0))


def _expert_weights(name, out_dim, in_dim, experts: int) -> TensorMap:
    """E torch Linear weights [out, in], one per "{expert}" -> our stacked kernel [E, in, out]."""
    return dataclasses.replace(_transposed(name, out_dim, in_dim), experts=experts)


# An MoE layer's tensors: the module holding the router and experts, and each expert's gate, up and
# down projections (Mixtral's w1, w3, w2).
_MOE_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _moe_maps(cfg: ModelConfig, layer: str) -> dict[tuple[str, ...], TensorMap]:
    """Router [E, D] -> our [D, E]; experts.{e}.gate/up [F, D] -> our [E, D, F]; down [D, F] -> [E, F, D].
    GPT-OSS stores each layer's experts stacked, as we do: gate_up_proj [E, D, 2F], down_proj
    [E, F, D] and their biases, and a router bias."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.expert_mlp_dim
    if cfg.arch == "gpt_oss":
        experts = f"{layer}mlp.experts."
        return {
            ("layers", "mlp", "router", "kernel"): _transposed(f"{layer}mlp.router.weight", e, d),
            ("layers", "mlp", "router", "bias"): _same(f"{layer}mlp.router.bias", (e,)),
            ("layers", "mlp", "gate_up"): _same(f"{experts}gate_up_proj", (e, d, 2 * f)),
            ("layers", "mlp", "gate_up_bias"): _same(f"{experts}gate_up_proj_bias", (e, 2 * f)),
            ("layers", "mlp", "down"): _same(f"{experts}down_proj", (e, f, d)),
            ("layers", "mlp", "down_bias"): _same(f"{experts}down_proj_bias", (e, d)),
        }
    module, (gate, up, down) = _MOE_NAMES[cfg.arch]
    experts = f"{layer}{module}.experts.{{expert}}."
    return {
        ("layers", "mlp", "router", "kernel"): _transposed(f"{layer}{module}.gate.weight", e, d),
        ("layers", "mlp", "gate"): _expert_weights(f"{experts}{gate}.weight", f, d, e),
        ("layers", "mlp", "up"): _expert_weights(f"{experts}{up}.weight", f, d, e),
        ("layers", "mlp", "down"): _expert_weights(f"{experts}{down}.weight", d, f, e),
    }


def _zeros(shape) -> TensorMap:
    return TensorMap("", tuple(shape), (), (), tuple(range(len(shape))), zeros=True)


def _gpt2_maps(cfg: ModelConfig, prefix: str) -> dict[tuple[str, ...], TensorMap]:
    d, h, dh, f, v = cfg.hidden_size, cfg.num_heads, cfg.dim_per_head, cfg.mlp_dim, cfg.vocab_size
    layer = f"{prefix}h.{{layer}}."
    maps = {
        ("transformer", "embed", "embedding"): _same(f"{prefix}wte.weight", (v, d)),
        ("transformer", "pos_embed", "embedding"): _same(
            f"{prefix}wpe.weight", (cfg.max_position_embeddings, d)),
        ("transformer", "ln_f", "scale"): _same(f"{prefix}ln_f.weight", (d,)),
        ("transformer", "ln_f", "bias"): _same(f"{prefix}ln_f.bias", (d,)),
        # Conv1D weights are [in, out]: q, k, v are windows of c_attn's output axis.
        ("layers", "attn", "o", "kernel"): _window(
            layer + "attn.c_proj.weight", (h * dh, d), [(h, dh), (d,)], (0, 1, 2)),
        ("layers", "attn", "o", "bias"): _same(layer + "attn.c_proj.bias", (d,)),
        ("layers", "mlp", "fc", "kernel"): _same(layer + "mlp.c_fc.weight", (d, f)),
        ("layers", "mlp", "fc", "bias"): _same(layer + "mlp.c_fc.bias", (f,)),
        ("layers", "mlp", "proj", "kernel"): _same(layer + "mlp.c_proj.weight", (f, d)),
        ("layers", "mlp", "proj", "bias"): _same(layer + "mlp.c_proj.bias", (d,)),
    }
    for i, part in enumerate("qkv"):
        maps[("layers", "attn", part, "kernel")] = _window(
            layer + "attn.c_attn.weight", (d, 3 * h * dh), [(d,), (h, dh)], (0, 1, 2),
            start=(0, i * h * dh))
        maps[("layers", "attn", part, "bias")] = _window(
            layer + "attn.c_attn.bias", (3 * h * dh,), [(h, dh)], (0, 1), start=(i * h * dh,))
    for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
        maps[("layers", ours, "scale")] = _same(layer + f"{theirs}.weight", (d,))
        maps[("layers", ours, "bias")] = _same(layer + f"{theirs}.bias", (d,))
    return maps


def _mlp_maps(cfg: ModelConfig, layer: str, moe: bool) -> dict[tuple[str, ...], TensorMap]:
    """A Llama-family layer's MLP: the experts (`_moe_maps`) or the dense gated MLP."""
    if moe:
        return _moe_maps(cfg, layer)
    d, f = cfg.hidden_size, cfg.mlp_dim
    maps = {("layers", "mlp", "down", "kernel"): _transposed(layer + "mlp.down_proj.weight", d, f)}
    if cfg.arch == "phi3":  # gate_up_proj [2F, D]: the gate's rows, then the up projection's
        for i, part in enumerate(("gate", "up")):
            maps[("layers", "mlp", part, "kernel")] = _window(
                layer + "mlp.gate_up_proj.weight", (2 * f, d), [(f,), (d,)], (1, 0), start=(i * f, 0))
    else:
        for part in ("gate", "up"):
            maps[("layers", "mlp", part, "kernel")] = _transposed(layer + f"mlp.{part}_proj.weight", f, d)
    if cfg.mlp_bias:
        for part, size in (("gate", f), ("up", f), ("down", d)):
            maps[("layers", "mlp", part, "bias")] = _same(layer + f"mlp.{part}_proj.bias", (size,))
    return maps


def _mixed_mlp_maps(cfg: ModelConfig, prefix: str) -> dict[tuple[str, ...], TensorMap]:
    """Each layer's own MLP entries, ("transformer", "layers_i", "mlp", ...), for a model whose
    layers are dense or MoE by `moe_layers` (always per-layer params)."""
    out = {}
    for i, moe in enumerate(cfg.moe_layers):
        for path, m in _mlp_maps(cfg, f"{prefix}layers.{{layer}}.", moe).items():
            out[("transformer", f"layers_{i}") + path[1:]] = dataclasses.replace(m, name=m.tensor_name(i))
    return out


def _llama_maps(cfg: ModelConfig, prefix: str) -> dict[tuple[str, ...], TensorMap]:
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
    layer = f"{prefix}layers.{{layer}}."
    maps = {
        ("transformer", "embed", "embedding"): _same(f"{prefix}embed_tokens.weight",
                                                     (cfg.vocab_size, d)),
        ("transformer", "ln_f", "scale"): _same(f"{prefix}norm.weight", (d,)),
        ("layers", "ln_1", "scale"): _same(layer + "input_layernorm.weight", (d,)),
        # torch Linear [out, in]: q_proj [H*Dh, D] -> our [D, H, Dh]; o_proj [D, H*Dh] -> [H, Dh, D].
        ("layers", "attn", "o", "kernel"): _window(
            layer + "self_attn.o_proj.weight", (d, h * dh), [(d,), (h, dh)], (1, 2, 0)),
    }
    if cfg.moe_layers is None:  # (mixed layers: per layer, `_mixed_mlp_maps`)
        maps.update(_mlp_maps(cfg, layer, bool(cfg.num_experts)))
    if cfg.post_norms:  # Gemma 2/3: "post_attention_layernorm" normalises the attention output
        maps.update({
            ("layers", "post_attn_norm", "scale"): _same(layer + "post_attention_layernorm.weight", (d,)),
            ("layers", "ln_2", "scale"): _same(layer + "pre_feedforward_layernorm.weight", (d,)),
            ("layers", "post_mlp_norm", "scale"): _same(layer + "post_feedforward_layernorm.weight", (d,)),
        })
    else:
        maps[("layers", "ln_2", "scale")] = _same(layer + "post_attention_layernorm.weight", (d,))
    if cfg.qk_norm:
        for part in ("q", "k"):
            maps[("layers", "attn", f"{part}_norm", "scale")] = _same(
                layer + f"self_attn.{part}_norm.weight", (dh,))
    if cfg.attention_sinks:
        maps[("layers", "attn", "sinks")] = _same(layer + "self_attn.sinks", (h,))
    if cfg.attention_out_bias:
        maps[("layers", "attn", "o", "bias")] = _same(layer + "self_attn.o_proj.bias", (d,))
    row = 0  # Phi-3's qkv_proj [(H + 2K)*Dh, D] stacks the q, k and v rows in that order
    for part, heads in (("q", h), ("k", k), ("v", k)):
        if cfg.arch == "phi3":
            maps[("layers", "attn", part, "kernel")] = _window(
                layer + "self_attn.qkv_proj.weight", ((h + 2 * k) * dh, d), [(heads, dh), (d,)],
                (2, 0, 1), start=(row, 0))
            row += heads * dh
            continue
        maps[("layers", "attn", part, "kernel")] = _window(
            layer + f"self_attn.{part}_proj.weight", (heads * dh, d), [(heads, dh), (d,)], (2, 0, 1))
        if cfg.attention_bias:
            maps[("layers", "attn", part, "bias")] = _window(
                layer + f"self_attn.{part}_proj.bias", (heads * dh,), [(heads, dh)], (0, 1))
    return maps


# Backbone name prefixes a checkpoint may use, canonical (as transformers writes it) first; the
# embedding tensor tells which one a checkpoint has.
_PREFIXES = {"gpt2": ("transformer.", ""), "llama": ("model.", "")}
_EMBED_NAME = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}


def tensor_maps(config: ModelConfig, kind: str, prefix: str | None = None
                ) -> dict[tuple[str, ...], TensorMap]:
    """Our param path (tuple of keys) -> TensorMap, for every param of the model of `kind`.

    `prefix` is the backbone's name prefix in the checkpoint ("transformer." / "model." as
    transformers writes them; "" for checkpoints saved from the bare backbone, like the original
    gpt2 upload).
    """
    family = config.family
    prefix = _PREFIXES[family][0] if prefix is None else prefix
    backbone = (_gpt2_maps if family == "gpt2" else _llama_maps)(config, prefix)
    maps = {(("transformer",) + path if path[0] == "layers" else path): m
            for path, m in backbone.items()}
    if not config.scan_layers:
        maps = _unscanned(maps, config.num_layers)
    if config.moe_layers is not None:
        maps.update(_mixed_mlp_maps(config, prefix))
    d, v = config.hidden_size, config.vocab_size
    if kind == "reward":
        maps[("score", "kernel")] = _transposed("score.weight", 1, d)
        maps[("score", "bias")] = _zeros((1,))
    elif not config.tie_word_embeddings:
        maps[("lm_head", "kernel")] = _transposed("lm_head.weight", v, d)
    return maps


def _unscanned(maps: dict[tuple[str, ...], TensorMap], num_layers: int) -> dict[tuple[str, ...], TensorMap]:
    """The table for per-layer params: each stacked ("transformer", "layers", ...) entry becomes one
    plain entry per layer, ("transformer", "layers_i", ...) reading tensor `name` of layer i."""
    out = {}
    for path, m in maps.items():
        if not m.stacked:
            out[path] = m
            continue
        for i in range(num_layers):
            out[(path[0], f"layers_{i}") + path[2:]] = dataclasses.replace(m, name=m.tensor_name(i))
    return out


# Our kernel's input axes per LoRA target (1 unless named): o reads [H, Dh].
_LORA_IN_AXES = {"o": 2}
# PEFT's names: the wrapper's prefix before a module's name, and the adapter tensors' infixes.
PEFT_PREFIX = "base_model.model."
_MODULE_IN_LAYER = re.compile(r"\.(?:layers|h)\.\{layer\}\.(.+)\.weight$")


def lora_module_names(config: ModelConfig) -> dict[str, str]:
    """Our LoRA target name -> the Hugging Face module inside a layer ("self_attn.q_proj",
    "attn.c_proj", ...), for every target of the config's family: PEFT's `target_modules` entries,
    specific enough that GPT-2's attention c_proj and MLP c_proj are told apart."""
    maps = tensor_maps(config.replace(scan_layers=True, lora=None, moe_layers=None), "causal_lm")
    out = {}
    for target in TARGETS[config.family]:
        part = "attn" if target in ("q", "k", "v", "o") else "mlp"
        key = ("transformer", "layers", part, target, "kernel")
        if key in maps:  # an MoE layer's experts are not LoRA targets
            out[target] = _MODULE_IN_LAYER.search(maps[key].name)[1]
    return out


def lora_tensor_maps(config: ModelConfig) -> dict[tuple[str, ...], TensorMap]:
    """Our adapter path (("transformer", "layers", "attn", "q", "a"), ...) -> TensorMap of the PEFT
    tensor holding it: lora_A.weight [r, in] (torch Linear) for our A [*in, r], lora_B.weight [out, r]
    for our B [r, *out], named after the base tensor with PEFT's prefix. Only projections that are one
    whole Hugging Face tensor qualify: GPT-2's c_attn and Phi-3's qkv_proj / gate_up_proj pack several
    of ours, which PEFT adapts with one shared A, so they are refused by name."""
    lora = config.lora
    base = tensor_maps(config.replace(lora=None), "causal_lm")
    out = {}
    for path, m in base.items():
        if path[-1] != "kernel" or path[-2] not in lora.targets:
            continue
        if any(m.start) or tuple(math.prod(sub) for sub in m.split) != m.hf_shape:
            raise HFModelError(
                f"LoRA on {path[-2]!r} cannot be written as a PEFT adapter: in {config.arch} it is a window "
                f"of the fused tensor {m.name.format(layer='N')!r}, which PEFT adapts as one module")
        name_a, name_b = (PEFT_PREFIX + m.name.removesuffix("weight") + f"lora_{x}.weight" for x in "AB")
        n_in = _LORA_IN_AXES.get(path[-2], 1)
        in_flat = {m.perm[i] for i in range(n_in)}
        in_axis = 0 if in_flat == set(range(len(m.split[0]))) else 1  # Conv1D [in, out] or Linear [out, in]
        in_sub, out_sub = m.split[in_axis], m.split[1 - in_axis]
        in_offset, out_offset = (0, len(in_sub)) if in_axis == 0 else (len(out_sub), 0)
        rank = lora.rank
        # A: HF [r, in] splits into (r,) + in_sub; our axes are (*in, r).
        out[path[:-1] + ("a",)] = _window(name_a, (rank, math.prod(in_sub)), [(rank,), in_sub],
                                          [m.perm[i] - in_offset + 1 for i in range(n_in)] + [0])
        # B: HF [out, r] splits into out_sub + (r,); our axes are (r, *out).
        out[path[:-1] + ("b",)] = _window(name_b, (math.prod(out_sub), rank), [out_sub, (rank,)],
                                          [len(out_sub)] + [m.perm[i] - out_offset for i in range(n_in, len(m.perm))])
    return out


def find_prefix(names: Collection[str], config: ModelConfig) -> str:
    """The backbone prefix of a checkpoint holding tensors `names` (the canonical one when none
    fits, so that the missing-tensor check names the canonical tensor name)."""
    for prefix in _PREFIXES[config.family]:
        if prefix + _EMBED_NAME[config.family] in names:
            return prefix
    return _PREFIXES[config.family][0]


def make_model(config: ModelConfig, kind: str) -> nn.Module:
    """The Flax module for a checkpoint kind: CausalLM or ScalarModel."""
    if kind not in KINDS:
        raise HFModelError(f"kind must be one of {KINDS}, got {kind!r}")
    return CausalLM(config) if kind == "causal_lm" else ScalarModel(config)


def abstract_params(config: ModelConfig, kind: str) -> Any:
    """Boxed abstract param tree (shapes, dtypes, logical axis names) of the model; no allocation."""
    return boxed_params(make_model(config, kind))


def path_keys(path) -> tuple[str, ...]:
    """A jax key path -> our param path as a tuple of strings, the keys of `tensor_maps`."""
    return tuple(str(getattr(p, "key", p)) for p in path)


def check_maps_cover(abstract: Any, maps: Mapping[tuple[str, ...], TensorMap], num_layers: int):
    """Internal consistency: the table names exactly our params, with their shapes."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    ours = {}
    for path, leaf in leaves:
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        ours[path_keys(path)] = tuple(value.shape)
    if set(ours) != set(maps):
        raise AssertionError(f"HF tensor table out of sync with the model: only in model "
                             f"{sorted(set(ours) - set(maps))}, only in table {sorted(set(maps) - set(ours))}")
    for path, m in maps.items():
        want = ((num_layers,) if m.stacked else ()) + m.our_shape
        if ours[path] != want:
            raise AssertionError(f"HF tensor table gives {path} shape {want}, model has {ours[path]}")
