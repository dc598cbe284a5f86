"""Checksums of every leaf of a tree, computed on the devices that hold it.

Written with every save and compared after every restore: a flipped byte in an array file does not
make the read fail (the chunk decodes to a different number, often a NaN), so a restore that only
reads the files would adopt the damage silently.

The checksum of a leaf is `sum_i bits[i] * w[i]  (mod 2^32)` over the leaf's raw bits viewed as
uint32 words, with odd position weights `w[i]`: a change to any one word always changes the sum
(an odd weight is invertible mod 2^32), and moved words change it too. Integer addition is exact
and order-free, so the sum is the same on every mesh and sharding the tree is saved or restored on.

The same two facts make checksums independent of the layer layout (`layout`): the words of layer i
of a stacked [L, ...] leaf are words i*n ... (i+1)*n - 1 of it, so the stacked leaf's checksum is
the sum over layers of each slice's sum with positions offset by i*n, and each slice's own checksum
is one row of a [L, n] view. A tree is therefore checked against a record written in the other
layout without building a relaid-out copy of it.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ppo_jax.checkpoint import layout, trees
from ppo_jax.checkpoint.errors import CheckpointCorruptError, CheckpointError

VERSION = 1
_GOLDEN = 0x9E3779B1  # 2^32 / golden ratio: spreads neighbouring positions over the whole word

# The lines of TensorStore / Orbax errors that mean "these bytes are damaged or missing" (as opposed
# to, e.g., running out of memory, which must not condemn a good checkpoint).
_DAMAGE = re.compile(r"DATA_LOSS|OUT_OF_RANGE|Error reading|Error decoding|checksum|corrupt", re.IGNORECASE)


def _as_words(x: jax.Array) -> jax.Array:
    """Raw bits of `x` as uint32 words (any shape)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size >= 4:  # 8-byte values become two words: [..., 2]
        return lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)


def _position_sums(words: jax.Array, offset: int = 0) -> jax.Array:
    """words [R, n] -> [R] uint32: sum_j words[r, j] * w[offset + j] per row (mod 2^32)."""
    position = lax.iota(jnp.uint32, words.shape[-1]) + jnp.uint32(offset % 2**32)  # positions wrap as uint32
    weight = (position * jnp.uint32(_GOLDEN)) | jnp.uint32(1)
    return jnp.sum(words * weight, axis=-1, dtype=jnp.uint32)


def _leaf_checksum(x: jax.Array, offset: int = 0) -> jax.Array:
    """[] uint32 checksum of `x`, its words counted from position `offset` (0: the leaf's own)."""
    words = _as_words(x)
    return _position_sums(words.reshape(1, words.size), offset)[0]


def _stacked_checksum(parts) -> jax.Array:
    """The checksum the stack of the L leaves `parts` would have, without stacking them."""
    total = jnp.zeros((), jnp.uint32)
    for i, x in enumerate(parts):
        total = total + _leaf_checksum(x, offset=i * _as_words(x).size)  # uint32: wraps mod 2^32
    return total


def _layer_checksums(x: jax.Array, count: int) -> list[jax.Array]:
    """The checksums of x[0] ... x[L-1] of a stacked leaf x [L, ...], without slicing it."""
    words = _as_words(x)
    rows = _position_sums(words.reshape(count, words.size // count))
    return [rows[i] for i in range(count)]


def _checksum_tree(tree, to: str | None):
    """Tree of [] uint32 checksums of `tree`'s leaves, named in layer layout `to` (None: as is)."""
    if to is None:
        return jax.tree.map(_leaf_checksum, tree)
    return layout.relayout(tree, to, stack=_stacked_checksum, unstack=_layer_checksums, leaf=_leaf_checksum)


@functools.lru_cache(maxsize=None)
def _checksum_fn(out_sharding, to):
    return jax.jit(lambda tree: _checksum_tree(tree, to), out_shardings=out_sharding)


def checksums(tree, layer_layout: str | None = None) -> dict[str, int]:
    """{leaf path (as Orbax names it on disk): checksum} of a tree of jax.Arrays.

    layer_layout: name (and sum) the checksums as the tree would have them in this layer layout
    (`layout.STACKED` / `layout.PER_LAYER`); None: the tree's own. The values are those of the
    converted tree, computed without converting it."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return {}
    # Replicated scalars out, so every process can read them (arrays of other processes are not
    # addressable here).
    first = leaves[0].sharding
    out = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else None
    sums = jax.device_get(_checksum_fn(out, layer_layout)(tree))
    return {trees.path_name(path): int(value) for path, value in trees.flatten_with_names(sums)}


def record(tree) -> dict:
    """The JSON written beside a saved tree."""
    return {"version": VERSION, "leaves": checksums(tree)}


def mismatches(tree, recorded: dict) -> list[str]:
    """Leaf paths of `tree` whose checksum differs from `recorded` (from `record`), or that
    `recorded` lacks. The tree may be in either layer layout, whichever `recorded` was taken in
    (paths are then named in the recorded layout)."""
    if recorded.get("version") != VERSION:
        return []  # a format this version cannot check: nothing is claimed either way
    expected = recorded["leaves"]
    in_layout = layout.detect_names(expected)
    return [name for name, value in checksums(tree, in_layout).items() if expected.get(name) != value]


def check_restored(what: str, tree, recorded) -> None:
    """Refuses a tree just read (`what`, for the message) unless it matches its `record`."""
    bad = mismatches(tree, dict(recorded or {}))
    if bad:
        raise CheckpointCorruptError(
            f"{what} is damaged: {len(bad)} array(s) differ from the checksums written when it was "
            f"saved (first: `{bad[0]}`); a file was changed after the save")


def check_rebuilt(tree, recorded: dict | None, where: str, missing: str, what: str, source: str, fix: str) -> None:
    """Refuses a frozen tree rebuilt from its source (a LoRA base, imported adapters, a value base)
    unless its checksums are those a checkpoint recorded (`record`): the steps in `where` were
    trained on exactly that tree, and resuming on another would silently change the run."""
    if recorded is None or mismatches(tree, recorded):
        problem = f"record no {missing}" if recorded is None else f"were trained on another {what}"
        raise CheckpointError(f"the checkpoints in {where} {problem} than the one {source} gives now (checksums "
                              f"differ); {fix}, or a new workdir")


def damage_line(err: BaseException) -> str | None:
    """The line of an exception chain that says stored bytes are damaged or missing, or None when
    the failure is something else (then the checkpoint is not to be blamed)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, json.JSONDecodeError):
            return f"a JSON item is not valid JSON ({err})"
        for line in str(err).splitlines():
            if _DAMAGE.search(line):
                return line.strip()[:300]
        err = err.__cause__ or err.__context__
    return None
