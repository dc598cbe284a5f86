"""The two layer layouts of a model's parameters, and conversion between them.

A Transformer keeps its L blocks either stacked, one `layers` subtree whose leaves carry a leading
[L] axis (the `lax.scan` loop), or per layer, subtrees `layers_0 ... layers_{L-1}` (the Python loop);
`compute.layer_loop` picks one per platform. Everything shaped like the params carries the same
layout: Adam's mu/nu, the LoRA collection, frozen trees. Checkpoints hold whichever layout the run
that wrote them used, so a restore converts when the stored layout and the target's differ.

Here, not in `models/`: the checkpoint package is the consumer and sits below the models (imports
point down), and nothing here knows a model; it knows two dict-key conventions only.

Every function walks any pytree (dicts, optax namedtuples, flax struct dataclasses, Orbax metadata
trees): a "layer dict" is any mapping holding a `layers` key (stacked) or `layers_<i>` keys (per
layer); conversion rewrites those mappings and leaves every other leaf as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

STACKED = "stacked"      # transformer/layers/... with a leading [L] axis
PER_LAYER = "per_layer"  # transformer/layers_0 ... layers_{L-1}
LAYOUTS = (STACKED, PER_LAYER)

_STACKED_KEY = "layers"
_PER_LAYER_KEY = re.compile(r"^layers_(\d+)$")


def _key_layout(key: str) -> str | None:
    if key == _STACKED_KEY:
        return STACKED
    return PER_LAYER if _PER_LAYER_KEY.match(key) else None


def _single(found: set[str], where: str) -> str | None:
    if len(found) > 1:
        raise ValueError(f"{where} holds both stacked `layers` and per-layer `layers_<i>` entries; "
                         "a tree has one layer layout")
    return next(iter(found), None)


def _is_layer_dict(node) -> bool:
    return isinstance(node, Mapping) and any(_key_layout(str(k)) for k in node)


def detect(tree, is_leaf: Callable[[Any], bool] | None = None) -> str | None:
    """STACKED, PER_LAYER, or None for a tree without layers. Raises ValueError for a tree that
    mixes the two. `is_leaf` as in jax.tree_util (e.g. for Orbax metadata trees)."""
    found = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        found.update(layout for k in path if isinstance(k, jax.tree_util.DictKey)
                     and (layout := _key_layout(str(k.key))))
    return _single(found, "the tree")


def detect_names(names: Iterable[str]) -> str | None:
    """The layout of dotted leaf names ("policy.transformer.layers_0.attn.q.kernel", as
    `trees.path_name` writes them; e.g. the keys of a checksum record)."""
    found = {layout for name in names for part in name.split(".") if (layout := _key_layout(part))}
    return _single(found, "the leaf names")


def relayout(tree, to: str, *, stack: Callable[[Sequence[Any]], Any],
             unstack: Callable[[Any, int], Sequence[Any]], leaf: Callable[[Any], Any] = lambda x: x):
    """`tree` in layout `to`, built with the leaf functions given (the one walk every conversion
    here shares).

    stack([x_0 .. x_{L-1}]) -> the stacked leaf of one block leaf of L layers; unstack(x, L) -> its
    L per-layer leaves; leaf(x) -> every leaf not converted (outside the layer dicts, or the whole
    tree when it is already in layout `to` or has no layers).
    """
    if to not in LAYOUTS:
        raise ValueError(f"layer layout must be one of {LAYOUTS}, got {to!r}")
    if detect(tree) in (None, to):
        return jax.tree.map(leaf, tree)

    def convert(node):
        if not _is_layer_dict(node):
            return leaf(node)
        rest = {k: jax.tree.map(convert, v, is_leaf=_is_layer_dict) for k, v in node.items()
                if not _key_layout(str(k))}
        if to == STACKED:
            layers = {_STACKED_KEY: jax.tree.map(lambda *xs: stack(xs), *_blocks(node))}
        else:
            leaves, treedef = jax.tree.flatten(node[_STACKED_KEY])
            count = _layer_count(leaves)
            parts = [unstack(x, count) for x in leaves]
            layers = {f"layers_{i}": treedef.unflatten([p[i] for p in parts]) for i in range(count)}
        merged = {**rest, **layers}
        return merged if isinstance(node, dict) else type(node)(merged)  # e.g. a flax FrozenDict

    return jax.tree.map(convert, tree, is_leaf=_is_layer_dict)


def _blocks(node: Mapping) -> list[Any]:
    """The per-layer subtrees layers_0 ... layers_{L-1} of a layer dict, checked to be one each and
    alike (same structure), so that they stack."""
    index = sorted(int(m[1]) for k in node if (m := _PER_LAYER_KEY.match(str(k))))
    if index != list(range(len(index))):
        raise ValueError(f"per-layer entries must be layers_0 ... layers_{len(index) - 1}, found "
                         f"{', '.join(f'layers_{i}' for i in index)}")
    blocks = [node[f"layers_{i}"] for i in index]
    first = jax.tree.structure(blocks[0])
    for i, block in enumerate(blocks[1:], 1):
        if jax.tree.structure(block) != first:
            raise ValueError(f"layers_{i} differs in structure from layers_0; the layers do not stack")
    return blocks


def _layer_count(leaves: Sequence[Any]) -> int:
    """L: the leading axis every leaf of a stacked block shares."""
    counts = {leaf.shape[0] if leaf.shape else None for leaf in leaves}
    if len(counts) != 1 or None in counts:
        raise ValueError(f"stacked `layers` leaves must share one leading [L] axis, found {sorted(map(str, counts))}")
    return counts.pop()


# ------------------------------------------------------------------ plain arrays (traceable)

def to_layout(tree, to: str):
    """`tree` (arrays, NumPy or traced) in layout `to`: jnp.stack / indexing. Traceable; under jit
    the slices of a stacked leaf fuse into whatever reads them."""
    return relayout(tree, to, stack=jnp.stack, unstack=lambda x, n: [x[i] for i in range(n)])


# ------------------------------------------------------------------ abstract trees

def _trimmed(spec: Sequence[Any]) -> PartitionSpec:
    """PartitionSpec without trailing Nones: how `sharding.logical_to_spec` writes specs (and
    P(None) != P(), so a stacked target must be spelled the same way to compare equal)."""
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _stacked_sharding(sharding):
    """The leading [L] axis is replicated: logical axis "layers" maps to no mesh axis (sharding.py
    rules), so a stacked leaf is sharded as each of its layers, with `None` in front."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, _trimmed((None, *sharding.spec)))
    return sharding  # None, or a single-device sharding: valid for any rank


def _slice_sharding(sharding):
    """A layer of a stacked leaf: its spec without the leading [L] entry (a leading axis that was
    sharded, which this codebase never does, becomes replicated)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, _trimmed(tuple(sharding.spec)[1:]))
    return sharding


def _stack_abstract(xs: Sequence[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    first = xs[0]
    for x in xs[1:]:
        if (x.shape, x.dtype) != (first.shape, first.dtype):
            raise ValueError(f"per-layer leaves differ ({first.shape} {first.dtype} vs {x.shape} {x.dtype}); "
                             "the layers do not stack")
    return jax.ShapeDtypeStruct((len(xs), *first.shape), first.dtype,
                                sharding=_stacked_sharding(getattr(first, "sharding", None)))


def _unstack_abstract(x: jax.ShapeDtypeStruct, count: int) -> list[jax.ShapeDtypeStruct]:
    one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=_slice_sharding(getattr(x, "sharding", None)))
    return [one] * count


def to_layout_abstract(tree, to: str):
    """An abstract tree (jax.ShapeDtypeStruct leaves, shardings optional) in layout `to`: stacking
    prepends [L] to shapes and a replicated entry to NamedSharding specs (P(s..) -> P(None, s..)),
    unstacking drops both."""
    return relayout(tree, to, stack=_stack_abstract, unstack=_unstack_abstract)


# ------------------------------------------------------------------ arrays onto shardings

@functools.lru_cache(maxsize=None)
def _stack_fn(sharding):
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _unstack_fn(shardings: tuple):
    return jax.jit(lambda x: tuple(x[i] for i in range(len(shardings))), out_shardings=shardings)


@dataclasses.dataclass(eq=False)
class _Stack:
    """An output leaf of `to_layout_arrays` still to compute: the stack of `parts`."""

    parts: Sequence[jax.Array]


@dataclasses.dataclass(eq=False)
class _Slice:
    """An output leaf of `to_layout_arrays` still to compute: layer `index` of `source`."""

    source: jax.Array
    index: int
    count: int


def _done(arrays: Sequence[jax.Array], consume: bool, result):
    if consume:  # the next leaf's conversion then reuses this memory
        jax.block_until_ready(result)
        for x in arrays:
            x.delete()
    return result


def to_layout_arrays(tree, to: str, shardings, *, consume: bool = False):
    """`tree` (jax.Arrays) in layout `to`, each converted leaf placed on its entry of `shardings`
    (a tree of shardings in layout `to`, e.g. the restore target's). Leaves outside the layer dicts
    are returned as they are.

    One jitted program per block leaf (L slices -> one [L, ...] leaf, or back), so with `consume`
    (delete each source leaf once converted: only for arrays nobody else holds, e.g. just restored)
    the extra memory at any time is one block leaf, not a second copy of the tree.
    """
    plan = relayout(tree, to, stack=_Stack, unstack=lambda x, n: [_Slice(x, i, n) for i in range(n)])
    planned, treedef = jax.tree.flatten(plan)
    targets = treedef.flatten_up_to(shardings)
    slice_targets: dict[int, dict[int, Any]] = {}  # id(stacked source) -> {layer: its sharding}
    for p, s in zip(planned, targets):
        if isinstance(p, _Slice):
            slice_targets.setdefault(id(p.source), {})[p.index] = s
    slices: dict[int, tuple] = {}  # id(stacked source) -> its L slices, all cut by one program

    def make(p, s):
        if isinstance(p, _Stack):
            return _done(p.parts, consume, _stack_fn(s)(*p.parts))
        if isinstance(p, _Slice):
            if id(p.source) not in slices:
                want = tuple(slice_targets[id(p.source)][i] for i in range(p.count))
                slices[id(p.source)] = _done([p.source], consume, _unstack_fn(want)(p.source))
            return slices[id(p.source)][p.index]
        return p

    return treedef.unflatten([make(p, s) for p, s in zip(planned, targets)])
