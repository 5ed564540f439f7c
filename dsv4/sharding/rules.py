"""Logical axis names → mesh axes: the one table that decides how dsv4 is laid out over devices.

Model code names logical axes only (`"seq"`, `"experts"`, `"embed"`, ...): on every parameter through
its `axes` metadata, and on activations through `constrain(x, axes)`. Turning sequence parallelism on
is a change of this table, not of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

SEQ_ORDERS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """logical axis → mesh axis (or None: replicated). Unlisted logical axes are replicated.

    seq_order: how the tokens of a sequence map onto the shards of the "seq" mesh axis.
      "contiguous": shard i holds tokens [i·S/N, (i+1)·S/N).
      "zigzag": the sequence is cut into 2N blocks and shard i holds blocks i and 2N-1-i, so every shard
        does the same causal work (HCA entries, indexer keys). The full-sequence forward permutes the token
        ids once at the input and the hidden states back once at the output; every layer in between runs
        in that order (`dsv4.attention.sequence_parallel`, "Whole-model zigzag").
    """

    rules: tuple[tuple[str, str | None], ...] = ()
    seq_order: str = "contiguous"

    def __post_init__(self):
        if self.seq_order not in SEQ_ORDERS:
            raise ValueError(f"ShardingRules.seq_order={self.seq_order!r}; available: {SEQ_ORDERS}")

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else dict(self.rules).get(logical)

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for an array with these logical axes; a mesh axis may appear only once."""
        physical = [self.mesh_axis(a) for a in logical_axes]
        used = [p for p in physical if p is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {tuple(logical_axes)} map mesh axis twice: {tuple(physical)}")
        return PartitionSpec(*physical)


# The seed article's layout: the sequence split over every device, positions kept global; the routed
# experts split over the same devices (expert parallelism); all other weights replicated.
SEQUENCE_PARALLEL = ShardingRules((("seq", "sp"), ("experts", "sp")))
# As SEQUENCE_PARALLEL, with the causal work balanced: shard i holds sequence blocks i and 2N-1-i.
SEQUENCE_PARALLEL_ZIGZAG = dataclasses.replace(SEQUENCE_PARALLEL, seq_order="zigzag")
# The sequence split, every weight replicated: the routed experts run data-parallel on each shard's own tokens.
SEQUENCE_ONLY = ShardingRules((("seq", "sp"),))
REPLICATED = ShardingRules()

_ACTIVE: list[tuple[Mesh, ShardingRules]] = []


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: ShardingRules = SEQUENCE_PARALLEL) -> Iterator[None]:
    """Within this block, `constrain` lays activations out on `mesh` by `rules` (tracing reads it)."""
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> tuple[Mesh, ShardingRules] | None:
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Annotates an activation's layout; a no-op when no mesh is active (the single-device path)."""
    current = active()
    if current is None:
        return x
    mesh, rules = current
    spec = rules.spec(logical_axes)
    if all(p is None for p in spec):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def named_sharding(mesh: Mesh, rules: ShardingRules, logical_axes: Sequence[str | None], shape) -> NamedSharding:
    """Sharding for a parameter; an axis that does not divide evenly over its mesh axis stays replicated."""
    spec = list(rules.spec(logical_axes))
    for i, axis in enumerate(spec):
        if axis is not None and shape[i] % mesh.shape[axis]:
            spec[i] = None
    return NamedSharding(mesh, PartitionSpec(*spec))
