"""Tree paths and shapes: naming leaves as Orbax names them on disk, checking a stored tree against a
restore target before any array is read, and the abstract restore target of a state."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
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


def host_arrays_by_path(tree) -> dict[str, np.ndarray]:
    """Every leaf of `tree` as a host array named by its tree path (`keystr`); waits for the device.
    The in-flight rollouts' engine states are saved this way (`tree_from_host_arrays` reads them)."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    host = sharding.to_host([leaf for _, leaf in paths])
    return {jax.tree_util.keystr(path): np.asarray(a) for (path, _), a in zip(paths, host)}


def tree_from_host_arrays(arrays: Mapping[str, np.ndarray], abstract, place: Callable[[np.ndarray], Any], *,
                          what: str, prefix: str = ""):
    """The tree of `abstract`'s structure from `arrays` (`host_arrays_by_path`'s names, after `prefix`),
    each leaf placed by `place`. A leaf missing or of another shape or dtype raises
    CheckpointMismatchError: `what` does not fit this run."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for path, leaf in paths:
        name = prefix + jax.tree_util.keystr(path)
        array = arrays.get(name)
        if array is None or array.shape != leaf.shape or array.dtype != leaf.dtype:
            raise CheckpointMismatchError(
                f"{what} does not fit this run: {name} saved as "
                f"{None if array is None else (array.shape, array.dtype)}, expected {(leaf.shape, leaf.dtype)} "
                "(resume with the settings it was saved with)")
        leaves.append(place(array))
    return jax.tree_util.tree_unflatten(treedef, leaves)
