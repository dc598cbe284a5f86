"""Reading a stored tree: a failed read becomes one line (damaged bytes: CheckpointCorruptError; anything
else: CheckpointError), the reads Orbax abandons after the first failure stay quiet, and a tree stored in
the other layer layout is read in its own layout (converted after reading, by the manager)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from ppo_jax import metrics as metrics_lib
from ppo_jax.checkpoint import layout, trees, verify
from ppo_jax.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__


def read_error(what: str, doing: str, err: BaseException) -> CheckpointError:
    damage = verify.damage_line(err)
    if damage is not None:
        return CheckpointCorruptError(f"{what} is damaged: {damage}")
    return CheckpointError(f"{what}: {doing}: {type(err).__name__}: {_first_line(err)}")


def read(reader: Callable[[], Any], what: str, doing: str) -> Any:
    """reader(), with a failure turned into CheckpointCorruptError (bytes damaged; the message holds
    the line that says so, and the TensorStore chain is dropped: it is hundreds of lines of spec)
    or CheckpointError (anything else, chained)."""
    try:
        return reader()
    except Exception as e:
        error = read_error(what, doing, e)
        if not isinstance(error, CheckpointCorruptError):
            raise error from e
    raise error


@contextlib.contextmanager
def quiet_abandoned_reads():
    """When one array fails to read, Orbax abandons the reads of the others, and Python prints each
    abandoned coroutine's exception ("Exception ignored in ...", a TensorStore spec each) when it is
    collected. The first failure is reported as one line instead; collect the rest here, silently."""
    previous = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = previous


def read_target(stored_tree, abstract, what: str) -> tuple[Any, str | None]:
    """(the target to read with, the layer layout to convert to after reading, or None).

    A tree stored in the other layer layout (`compute.layer_loop` picks it per platform: a run
    trained on a GPU, resumed on a CPU) is read in its own layout, onto the target's shardings
    converted; any other difference raises CheckpointMismatchError (compared in the stored layout,
    so the message names what really differs: a layer count, a shape)."""
    stored_layout = layout.detect(stored_tree, is_leaf=trees.is_metadata_leaf)
    target_layout = layout.detect(abstract)
    if stored_layout is None or target_layout is None or stored_layout == target_layout:
        trees.check_tree_matches(stored_tree, abstract, what=what)
        return abstract, None
    try:
        read_as = layout.to_layout_abstract(abstract, stored_layout)
    except ValueError as e:  # a target whose layers do not stack: not this checkpoint's tree either
        raise CheckpointMismatchError(f"{what} stores the layers {stored_layout}; the restore target "
                                      f"cannot be converted to that: {e}") from e
    trees.check_tree_matches(stored_tree, read_as, what=f"{what} (layers {stored_layout})")
    return read_as, target_layout


def to_target_layout(tree, abstract, to: str | None, what: str, *, say: bool):
    """`tree` as read (by `read_target`'s target), converted to layer layout `to` onto the target's
    shardings (as is for None); `say`: print one `warning:` line saying so."""
    if to is None:
        return tree
    start = time.perf_counter()
    tree = layout.to_layout_arrays(tree, to, jax.tree.map(lambda leaf: leaf.sharding, abstract), consume=True)
    if say:
        stored = next(other for other in layout.LAYOUTS if other != to)
        metrics_lib.warn(f"{what} holds its layers {stored}, this run's compute.layer_loop runs them {to}: "
                         f"converted after reading ({time.perf_counter() - start:.1f}s; later trees read "
                         "here are converted likewise, unannounced)")
    return tree
