"""Tree paths and shapes: naming leaves as Orbax names them on disk, checking a stored tree against a
restore target before any array is read, and the abstract restore target of a state."""

from __future__ import annotations

from typing import Any

import jax

from ppo_jax.checkpoint.errors import CheckpointMismatchError

def _key_token(key) -> str:
    """One path entry as Orbax names it on disk: dict keys, attribute names, sequence indices."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "<root>"


def is_metadata_leaf(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def flatten_with_names(tree, is_leaf=None) -> list[tuple[tuple[str, ...], Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(tuple(_key_token(k) for k in path), leaf) for path, leaf in leaves]


def _is_key_dtype(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _stored_shape(abstract_leaf) -> tuple[int, ...]:
    """Shape Orbax stores for a target leaf: typed PRNG keys are stored as their key data."""
    if _is_key_dtype(abstract_leaf.dtype):
        plain = jax.ShapeDtypeStruct(abstract_leaf.shape, abstract_leaf.dtype)
        return tuple(jax.eval_shape(jax.random.key_data, plain).shape)
    return tuple(abstract_leaf.shape)


def check_state_leaves(state) -> None:
    """Saved leaves must be jax.Arrays: they carry the sharding Orbax writes collectively."""
    for path, leaf in flatten_with_names(state):
        if not isinstance(leaf, jax.Array):
            raise TypeError(
                f"checkpoint state leaf `{path_name(path)}` has type {type(leaf).__name__}, not "
                "jax.Array; put it on the mesh first (jnp.asarray / jax.device_put), or move "
                "non-array values into `extra`")


def to_abstract(abstract_state):
    """Target leaves -> ShapeDtypeStruct with a sharding (jax.Arrays are accepted as targets)."""

    def one(path, leaf):
        name = path_name(tuple(_key_token(k) for k in path))
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"restore target leaf `{name}` has type {type(leaf).__name__}; expected "
                "jax.ShapeDtypeStruct(shape, dtype, sharding=...) (e.g. from jax.eval_shape)")
        if leaf.sharding is None:
            raise ValueError(
                f"restore target leaf `{name}` has no sharding; build the target with "
                "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) so the "
                "checkpoint can be placed on the current mesh")
        return leaf

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def check_tree_matches(stored_tree, abstract_state, *, what: str) -> None:
    """Raises CheckpointMismatchError naming the first path where `abstract_state` differs.

    `stored_tree` is Orbax's metadata tree (leaves with .shape/.dtype); `abstract_state` the
    restore target. Dtypes may differ (Orbax casts on restore) except that a typed PRNG key must
    be restored as a typed key of the same key shape.
    """
    stored = dict(flatten_with_names(stored_tree, is_leaf=is_metadata_leaf))
    target = flatten_with_names(abstract_state)
    hint = ("the checkpoint was probably written for a different model or state layout; restore "
            "with the configuration it was saved with")
    for path, leaf in target:
        name = path_name(path)
        if path not in stored:
            raise CheckpointMismatchError(
                f"{what} has no entry `{name}` that the restore target expects "
                f"(shape {tuple(leaf.shape)}); {hint}")
        found = tuple(stored[path].shape)
        expected = _stored_shape(leaf)
        if found != expected:
            if _is_key_dtype(leaf.dtype):
                detail = (f"expected a PRNG key array of shape {tuple(leaf.shape)} (key data "
                          f"{expected}), found shape {found}")
            else:
                detail = f"expected shape {expected}, found {found}"
            raise CheckpointMismatchError(f"{what} differs at `{name}`: {detail}; {hint}")
    target_paths = {path for path, _ in target}
    for path in stored:
        if path not in target_paths:
            raise CheckpointMismatchError(
                f"{what} has an entry `{path_name(path)}` (shape {tuple(stored[path].shape)}) "
                f"that the restore target does not have; {hint}")
