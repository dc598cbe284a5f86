"""The only module that knows mesh axis names.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with sharded parameters and optimizer
state), `tensor` (Megatron-style heads / MLP / vocabulary split), `expert` (expert parallelism: a
mixture-of-experts layer's experts split over it, `ppo_jax.models.moe`; everywhere else it is one more
FSDP axis, so its devices share the batch and the dense weights instead of repeating them), `context`
(sequence parallelism: a cache-free forward's activations split along the sequence between attention
calls, each device attending with its queries over the keys and values all-gathered along the axis,
`ppo_jax.models.context`; the sampler's KV cache split along its slots, logical `cache_length`; for
the weights it is one more FSDP axis, for the batch a replica). Models
name their parameter axes logically ("embed", "heads", "mlp", ...); the rules below map logical names
to mesh axes. A mesh axis is dropped from a parameter's spec where it does not divide that dimension,
so any model runs on any mesh shape (a 2-kv-head model on a 4-way tensor mesh keeps its kv heads
replicated).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert", "context")
BATCH_AXES = ("data", "fsdp", "expert")
CONTEXT_AXIS = "context"

# logical axis -> mesh axes, tried in order.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "expert", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),  # MoE experts: a [E, ...] weight's expert index (so its embed axis keeps fsdp alone)
    ("positions", None),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("score", None),
    ("lora_rank", None),  # LoRA adapters' rank axis: small, replicated (A and B shard like their kernel)
    ("length", None),  # the sampler's rows and hidden states: whole on every device of the context axis
    ("cache_length", CONTEXT_AXIS),  # the static sampler's KV cache slots: split along the sequence
    ("act_length", CONTEXT_AXIS),  # a cache-free forward's activations [B, T, D]: split along the sequence
    ("act_embed", None),
)


def make_mesh(shape: Sequence[int] = (1, -1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over (data, fsdp, tensor, expert, context); `shape` gives 3 entries (expert = context = 1),
    4 (context = 1) or 5, one of which may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    shape = list(shape)
    if len(shape) not in (3, 4, 5):
        raise ValueError(f"mesh shape must have 3 entries (data, fsdp, tensor), 4 (+ expert) or 5 (data, fsdp, "
                         f"tensor, expert, context), got {tuple(shape)}")
    shape += [1] * (len(MESH_AXES) - len(shape))
    if shape.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {tuple(shape)}")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        if len(devices) % known:
            raise ValueError(f"mesh shape {tuple(shape)} does not divide {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices but {len(devices)} are "
            f"available; set mesh.shape so that its product is {len(devices)} (one entry may be -1)")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=axis_types, devices=devices)
    except AssertionError:
        # jax's TPU mesh builder asserts that the devices fill their bounding box in the torus; a
        # subset such as a disaggregated role's (the last chips of every host, rl/roles.py) does not.
        # Lay it out in the given order: device order moves collectives' speed, not correctness.
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def expert_axis_size(mesh) -> int:
    """How many ways `mesh` (concrete or abstract; None: no mesh) splits the experts."""
    if mesh is None or mesh.empty or "expert" not in mesh.axis_names:
        return 1
    return int(mesh.shape["expert"])


def check_experts_split(num_experts: int, mesh, what: str, error: type[Exception] = ValueError) -> None:
    """A mesh with an expert axis must split the experts evenly: each of its devices holds
    num_experts / expert of them (a dense model just shares the batch and weights over the axis).
    Raises `error` (the trainers pass their ConfigError)."""
    n = expert_axis_size(mesh)
    if n > 1 and num_experts and num_experts % n:
        raise error(f"{what}: the mesh's expert axis of {n} devices does not divide the model's "
                         f"{num_experts} experts; use an expert axis that divides {num_experts}")


def _mesh_axes_for(name: str | None, rules) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    raise ValueError(f"logical axis {name!r} has no sharding rule; add it to sharding rules")


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=DEFAULT_RULES) -> P:
    """PartitionSpec for an array with logical axis `names`, keeping only mesh axes that divide.

    Each mesh axis is used at most once per array; axes of size 1 are left out (they change nothing
    and keep the specs readable).
    """
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        chosen = []
        size = 1
        for axis in _mesh_axes_for(name, rules):
            n = mesh.shape[axis]
            if axis in used or n == 1 or dim % (size * n):
                continue
            chosen.append(axis)
            size *= n
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _is_boxed(x) -> bool:
    return isinstance(x, nn.Partitioned)


def tree_shardings(boxed_tree: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings for a tree of `nn.LogicallyPartitioned` leaves (abstract or concrete).

    Leaves without logical names (optimizer counters, scalars) are replicated.
    """

    def one(leaf):
        if _is_boxed(leaf):
            value = leaf.value
            return NamedSharding(mesh, logical_to_spec(leaf.names, value.shape, mesh, rules))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, boxed_tree, is_leaf=_is_boxed)


def data_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch-major arrays: leading axis over (data, fsdp), the rest replicated."""
    del ndim
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
    """How many ways the batch axis is split: a global batch must be a multiple of this."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def batch_axes_text(mesh: Mesh) -> str:
    """'data x fsdp x expert = 2 x 2 x 1', for errors about the batch split."""
    return f"{' x '.join(BATCH_AXES)} = {' x '.join(str(mesh.shape[a]) for a in BATCH_AXES)}"


def put_local_batch(tree: Any, mesh: Mesh) -> Any:
    """This process's rows (host NumPy, [b, ...]) -> global arrays batch-sharded over the mesh.

    One process: b is the global batch. Several: each process holds its consecutive block of the
    global batch, as `ppo_jax.data` loaders hand it out.
    """
    sharding = data_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def put_batch(tree: Any, mesh: Mesh) -> Any:
    """Places host arrays (the whole global batch, identical on every process) batch-sharded."""
    sharding = data_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]),
        tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Host values (identical on every process; typed PRNG keys included) -> replicated global arrays."""
    target = replicated(mesh)

    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(one(jax.random.key_data(x)), impl=impl)
        if jax.process_count() == 1:
            return jax.device_put(x, target)
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, target, lambda idx: value[idx])

    return jax.tree.map(one, tree)


def copy_tree(params: Any, shardings: Any) -> Any:
    """A real copy on the given shardings (a reference aliasing the policy would die on donation)."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(params)


def reshard(tree: Any, shardings: Any) -> Any:
    """`tree`'s arrays on `shardings` (another layout, mesh or device set: a sampler's, from the
    trainer's), leaving the inputs as they are. An array already on its target is returned as it is
    (no copy).

    One process moves anything with `jax.device_put`. Several processes can `device_put` only within
    one device set, so between two disjoint sets of equal size (disaggregated roles, `rl/roles.py`)
    the arrays travel through one program over both sets (`_reshard_across`).
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    local, across = [], []  # indices of the leaves that move, by how
    for i, (x, target) in enumerate(zip(leaves, targets)):
        if x.sharding != target:
            crosses = jax.process_count() > 1 and x.sharding.device_set != target.device_set
            (across if crosses else local).append(i)
    out = list(leaves)
    for indices, move in ((local, jax.device_put), (across, _reshard_across)):
        if indices:
            for i, y in zip(indices, move([leaves[i] for i in indices], [targets[i] for i in indices])):
                out[i] = y
    return jax.tree.unflatten(treedef, out)


def _union_mesh(first: Mesh, second: Mesh, shape_of: Mesh) -> Mesh:
    """A mesh over both device sets, `first`'s devices then `second`'s, as a leading "role" axis of 2
    over `shape_of`'s axes."""
    devices = np.array(list(first.devices.flat) + list(second.devices.flat)).reshape((2,) + shape_of.devices.shape)
    return Mesh(devices, ("role",) + tuple(shape_of.axis_names), axis_types=(AxisType.Auto,) * (devices.ndim))


@functools.cache
def _broadcast_first_role(out_shardings):
    """Jitted [2, ...] -> [2, ...] with both halves the first: the cross-set copy, as XLA's collectives."""
    return jax.jit(lambda xs: [jnp.broadcast_to(x[:1], x.shape) for x in xs], out_shardings=list(out_shardings))


def _reshard_across(xs: list, targets: list) -> list:
    """Arrays moved between two disjoint device sets of equal size, across processes.

    Each array becomes the first half of a [2, ...] array over both sets (the second half, on the
    target's devices, is filler), one program copies the first half into the second in the target's
    layout, and the target's shards of that are the result. The copy on the source's devices is
    dropped at once. Raises ValueError for sets of different sizes (no such program exists).
    """
    out_shardings, inputs = [], []
    for x, target in zip(xs, targets):
        src = x.sharding
        if not (isinstance(src, NamedSharding) and isinstance(target, NamedSharding)):
            raise ValueError("arrays move between device sets only with NamedShardings")
        if src.mesh.size != target.mesh.size or src.device_set & target.device_set:
            raise ValueError(f"arrays move across processes only between disjoint device sets of equal size; got "
                             f"{src.mesh.size} and {target.mesh.size} devices")
        in_sh = NamedSharding(_union_mesh(src.mesh, target.mesh, src.mesh), P("role", *src.spec))
        out_shardings.append(NamedSharding(_union_mesh(src.mesh, target.mesh, target.mesh), P("role", *target.spec)))
        shape = (2,) + x.shape
        own = {s.device: s.data[None] for s in x.addressable_shards}
        parts = []
        for device, index in in_sh.addressable_devices_indices_map(shape).items():
            if device in own:
                parts.append(own[device])
            else:
                part_shape = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))
                parts.append(jnp.zeros(part_shape, x.dtype, device=device))
        inputs.append(jax.make_array_from_single_device_arrays(shape, in_sh, parts))
    copied = _broadcast_first_role(tuple(out_shardings))(inputs)
    results = []
    for y, target in zip(copied, targets):
        mine = [s.data.reshape(s.data.shape[1:]) for s in y.addressable_shards if s.device in target.device_set]
        results.append(jax.make_array_from_single_device_arrays(y.shape[1:], target, mine))
    return results


def to_host(tree: Any) -> Any:
    """Global arrays -> NumPy on every process (metrics, samples)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def activation_rules(rules=DEFAULT_RULES):
    """Context that lets `nn.with_logical_constraint` in the models resolve activation axes."""
    return nn.logical_axis_rules(rules)


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules=DEFAULT_RULES) -> Iterator[None]:
    """The mesh and the logical activation rules every jitted model function runs under."""
    with jax.set_mesh(mesh), activation_rules(rules):
        yield


def on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` (a jitted model function) called under `mesh_context(mesh)`."""

    def run(*args):
        with mesh_context(mesh):
            return fn(*args)

    return run


def axis_size(name: str, mesh=None) -> int:
    """How many devices axis `name` of `mesh` (concrete or abstract; None: the mesh being traced
    under) has; 1 outside a mesh or on one without that axis."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or name not in mesh.axis_names:
        return 1
    return int(mesh.shape[name])


def context_axis_size(mesh=None) -> int:
    """How many ways `mesh` (concrete or abstract; None: the mesh being traced under) splits a row's
    sequence; 1 outside a mesh or on one without a context axis."""
    return axis_size(CONTEXT_AXIS, mesh)


def check_context_split(length: int, mesh, what: str, error: type[Exception] = ValueError) -> None:
    """Rows of `length` slots must split evenly over the context axis (each device holds length /
    context of them); raises `error` naming the padding that would make them divide."""
    n = context_axis_size(mesh)
    if n > 1 and length % n:
        pad = -length % n
        raise error(f"{what}: rows of {length} tokens do not split over the mesh's context axis of {n} devices; "
                    f"pad them by {pad} to {length + pad} tokens, or use a context axis that divides {length}")


def over_context(fn: Callable, in_axes: Sequence[int | None], out_axis: int) -> Callable:
    """`fn` run per device of the context axis (`jax.shard_map`, manual over that axis only; the
    others stay with XLA's partitioner): each positional argument split along its `in_axes` entry
    (None: whole on every device), the result split along `out_axis`."""
    def spec(axis):
        return P() if axis is None else P(*((None,) * axis), CONTEXT_AXIS)

    return jax.shard_map(fn, in_specs=tuple(spec(a) for a in in_axes), out_specs=spec(out_axis),
                         axis_names={CONTEXT_AXIS}, check_vma=False)


def over_every_axis(fn: Callable, in_names: Sequence[Sequence[str | None]], out_like: int = 0) -> Callable:
    """`fn` run per device of the whole mesh (`jax.shard_map`, manual over every axis): each positional
    argument split as its logical axis names map (`logical_to_spec`: only mesh axes that divide it),
    the result split like argument `out_like` (same shape). For calls that XLA's partitioner cannot
    take inside a partly manual region: cuDNN attention's custom partitioner fails on the shardings
    that `over_context` leaves it (`'GSPMDSharding' object has no attribute 'spec'`, XLA:GPU)."""
    def run(*args):
        mesh = jax.sharding.get_abstract_mesh()
        specs = tuple(logical_to_spec(names, x.shape, mesh) for names, x in zip(in_names, args))
        return jax.shard_map(fn, in_specs=specs, out_specs=specs[out_like], check_vma=False)(*args)

    return run


def splits_alike(*named_dims: tuple[str, int]) -> bool:
    """Whether every (logical name, size) splits over the same mesh axes on the mesh being traced under
    (e.g. q's heads and k's KV heads: a GQA group then stays on one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return len({tuple(logical_to_spec((name,), (dim,), mesh)) for name, dim in named_dims}) == 1


def gather_context(x: jax.Array, axis: int) -> jax.Array:
    """Inside `over_context`: every device's part of x, concatenated along `axis` in device order."""
    return jax.lax.all_gather(x, CONTEXT_AXIS, axis=axis, tiled=True)


def context_index() -> jax.Array:
    """Inside `over_context`: [] int32, this device's index along the context axis."""
    return jax.lax.axis_index(CONTEXT_AXIS)


def permute_context(x: jax.Array, pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """Inside `over_context`: x sent from device src to device dst of the context axis for each
    (src, dst) pair (a permutation); a device no pair sends to gets zeros."""
    return jax.lax.ppermute(x, CONTEXT_AXIS, perm=list(pairs))


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs with shardings: each leaf's
    shard shape times its item size (every device of a leaf's sharding holds the same shard shape, as
    `logical_to_spec` uses only mesh axes that divide; a typed PRNG key counts its key data)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def free_device_bytes(devices: Iterable[jax.Device], gather: Callable[[np.ndarray], np.ndarray] | None = None
                      ) -> int | None:
    """The least free memory (`bytes_limit - bytes_in_use`) among `devices`: this process's own, and
    with several processes the least of every process's (`gather`: all processes' values; by default
    `process_allgather`, so every process must call this at the same point, and all get the same
    answer: a refusal or a choice made from it is the same everywhere). None when a device reports
    none (a CPU)."""
    free = []
    for device in (d for d in devices if d.process_index == jax.process_index()):
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    if not free:
        return None
    if gather is None and jax.process_count() > 1:
        gather = multihost_utils.process_allgather
    mine = np.asarray(min(free), np.int64)
    return int(np.min(gather(mine))) if gather is not None else int(mine)
