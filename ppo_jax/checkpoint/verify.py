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
import numpy as np
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


def _host_words(x) -> np.ndarray:
    """`_as_words` of a leaf in host memory, flat [n] (the words in the same order)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    if x.dtype.itemsize >= 4:  # an 8-byte value's two words in memory order, as XLA's bitcast gives them
        return x.view(np.uint32)
    return x.view({1: np.uint8, 2: np.uint16}[x.dtype.itemsize]).astype(np.uint32)


def _position_sums(words, offset: int = 0, host: bool = False):
    """words [R, n] -> [R] uint32: sum_j words[r, j] * w[offset + j] per row (mod 2^32)."""
    xp = np if host else jnp
    position = xp.arange(words.shape[-1], dtype=xp.uint32) + xp.uint32(offset % 2**32)  # wraps as uint32
    weight = (position * xp.uint32(_GOLDEN)) | xp.uint32(1)
    return xp.sum(words * weight, axis=-1, dtype=xp.uint32)


def _words(x, host: bool):
    return _host_words(x) if host else _as_words(x)


def _words_checksum(words, offset: int, host: bool):
    """[] uint32 checksum of a leaf's words (any shape), counted from position `offset`."""
    return _position_sums(words.reshape(1, words.size), offset, host)[0]


def _leaf_checksum(x, host: bool = False):
    """[] uint32 checksum of `x`."""
    return _words_checksum(_words(x, host), 0, host)


def _stacked_checksum(parts, host: bool = False):
    """The checksum the stack of the L leaves `parts` would have, without stacking them: each part's
    words counted from where they would sit in the stack."""
    sums, offset = [], 0
    for x in parts:
        words = _words(x, host)
        sums.append(_words_checksum(words, offset, host))
        offset += words.size
    if host:  # Python ints: numpy warns on a uint32 scalar's wrap-around
        return np.uint32(sum(int(s) for s in sums) % 2**32)
    return functools.reduce(jnp.add, sums, jnp.zeros((), jnp.uint32))  # uint32: wraps mod 2^32


def _layer_checksums(x, count: int, host: bool = False) -> list:
    """The checksums of x[0] ... x[L-1] of a stacked leaf x [L, ...], without slicing it."""
    words = _words(x, host)
    rows = _position_sums(words.reshape(count, words.size // count), host=host)
    return [rows[i] for i in range(count)]


def _checksum_tree(tree, to: str | None, host: bool = False):
    """Tree of [] uint32 checksums of `tree`'s leaves, named in layer layout `to` (None: as is)."""
    leaf = functools.partial(_leaf_checksum, host=host)
    if to is None:
        return jax.tree.map(leaf, tree)
    return layout.relayout(tree, to, stack=functools.partial(_stacked_checksum, host=host),
                           unstack=functools.partial(_layer_checksums, host=host), leaf=leaf)


@functools.lru_cache(maxsize=None)
def _checksum_fn(out_sharding, to):
    return jax.jit(lambda tree: _checksum_tree(tree, to), out_shardings=out_sharding)


def _in_host_memory(leaf) -> bool:
    """Whether this process holds all of `leaf` in host memory (a NumPy array, or a jax.Array on CPU
    devices, all of them its own)."""
    if isinstance(leaf, np.ndarray):
        return True
    return (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
            and all(device.platform == "cpu" for device in leaf.devices()))


def checksums(tree, layer_layout: str | None = None, *, on_host: bool | None = None) -> dict[str, int]:
    """{leaf path (as Orbax names it on disk): checksum} of a tree of jax.Arrays.

    layer_layout: name (and sum) the checksums as the tree would have them in this layer layout
    (`layout.STACKED` / `layout.PER_LAYER`); None: the tree's own. The values are those of the
    converted tree, computed without converting it. on_host: compute them with NumPy (None: where
    every leaf is in this process's host memory, as on a CPU), else with one program on the devices
    that hold the tree. The two give the same numbers; the host needs no tracing or compiling, which
    a new tree structure otherwise costs at each save (0.1-0.2 s a save on a CPU, 5% of the trainer
    tests' time with a cold compilation cache)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return {}
    if on_host if on_host is not None else all(map(_in_host_memory, leaves)):
        sums = _checksum_tree(tree, layer_layout, host=True)
    else:
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
