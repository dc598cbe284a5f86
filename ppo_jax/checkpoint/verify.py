"""Checksums of every leaf of a tree, computed on the devices that hold it.

Written with every save and compared after every restore: a flipped byte in an array file does not
make the read fail (the chunk decodes to a different number, often a NaN), so a restore that only
reads the files would adopt the damage silently.

The checksum of a leaf is `sum_i bits[i] * w[i]  (mod 2^32)` over the leaf's raw bits viewed as
uint32 words, with odd position weights `w[i]`: a change to any one word always changes the sum
(an odd weight is invertible mod 2^32), and moved words change it too. Integer addition is exact
and order-free, so the sum is the same on every mesh and sharding the tree is saved or restored on.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ppo_jax.checkpoint import trees

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


def _leaf_checksum(x: jax.Array) -> jax.Array:
    words = _as_words(x)
    position = lax.iota(jnp.uint32, words.size).reshape(words.shape)
    weight = (position * jnp.uint32(_GOLDEN)) | jnp.uint32(1)
    return jnp.sum(words * weight, dtype=jnp.uint32)


@functools.lru_cache(maxsize=None)
def _checksum_fn(out_sharding):
    return jax.jit(lambda tree: jax.tree.map(_leaf_checksum, tree), out_shardings=out_sharding)


def checksums(tree) -> dict[str, int]:
    """{leaf path (as Orbax names it on disk): checksum} of a tree of jax.Arrays."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return {}
    # Replicated scalars out, so every process can read them (arrays of other processes are not
    # addressable here).
    first = leaves[0].sharding
    out = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else None
    sums = jax.device_get(_checksum_fn(out)(tree))
    return {trees.path_name(path): int(value) for path, value in trees.flatten_with_names(sums)}


def record(tree) -> dict:
    """The JSON written beside a saved tree."""
    return {"version": VERSION, "leaves": checksums(tree)}


def mismatches(tree, recorded: dict) -> list[str]:
    """Leaf paths of `tree` whose checksum differs from `recorded` (from `record`), or that
    `recorded` lacks."""
    if recorded.get("version") != VERSION:
        return []  # a format this version cannot check: nothing is claimed either way
    expected = recorded["leaves"]
    return [name for name, value in checksums(tree).items() if expected.get(name) != value]


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
