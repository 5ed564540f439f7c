"""Helpers for arrays split along the sequence axis of the active mesh: the shard layout, running a function per
sequence shard, and the zigzag token order (2N blocks; shard i holds blocks i and 2N-1-i, so causal work balances).

jax only. The model's sequence-parallel attention cores (`dsv4.attention.sequence_parallel`), the expert-parallel
MoE and the Pallas paths that must run per shard build on these.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsv4.sharding.rules import active


def sp_layout(mesh: Mesh | None = None, axis: str | None = None) -> tuple[Mesh, str, int] | None:
    """(mesh, axis name, shard count) of the sequence axis, or None when there is nothing to split over."""
    if mesh is None:
        current = active()
        if current is None:
            return None
        mesh, rules = current
        axis = axis or rules.mesh_axis("seq")
    axis = axis or "sp"
    if axis not in mesh.shape or mesh.shape[axis] < 2:
        return None
    return mesh, axis, mesh.shape[axis]


def per_sequence_shard(fn, sharded, replicated=(), *, fill, mesh: Mesh | None = None, axis: str | None = None):
    """fn over each sequence shard of the active (or given) mesh: `fn(*local sharded, *replicated)`. → the global
    result, its axis 1 the sequence axis like every array in `sharded` ([B, S, ...]).

    For token-local work that lowers to a custom call (the Pallas indexer, the Pallas MoE): XLA's SPMD partitioner
    cannot split a custom call, so given sequence-sharded operands it would gather them and every device would
    compute the whole call. Here each device runs `fn` on its own tokens; `replicated` operands (the indexer keys,
    the expert weights) are gathered once if they are sharded. S is padded to a multiple of the shard count with
    `fill` (one value per sharded array) and the padding is cut from the result. No mesh (or a 1-device axis):
    `fn` directly.
    """
    layout = sp_layout(mesh, axis)
    if layout is None:
        return fn(*sharded, *replicated)
    mesh, axis, n = layout
    s = sharded[0].shape[1]
    pad = -s % n
    if pad:
        sharded = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=f)
                   for x, f in zip(sharded, fill, strict=True)]  # fmt: skip
    spec = P(None, axis)
    out = jax.shard_map(fn, mesh=mesh, in_specs=(*(spec for _ in sharded), *(P() for _ in replicated)),
                        out_specs=spec, check_vma=False)(*sharded, *replicated)  # fmt: skip
    return out[:, :s] if pad else out


def zigzag_shards() -> int | None:
    """N when the active layout keeps sequences in zigzag order over N > 1 shards ("Whole-model zigzag"), else
    None."""
    current = active()
    if current is None or current[1].seq_order != "zigzag":
        return None
    layout = sp_layout()
    return None if layout is None else layout[2]


def zigzag_rows(s: int, n: int, *, multiple: int = 1, min_rows: int = 0) -> int:
    """Rows per block (L) to hold s tokens in zigzag order over n shards: the least multiple of `multiple` that is
    >= ceil(s / 2n) and >= min_rows. The padded length is 2n · L."""
    rows = max(-(-s // (2 * n)), min_rows, 1)
    return -(-rows // multiple) * multiple


def zigzag_model_rows(config, s: int, n: int) -> int:
    """Rows per block for a model (`dsv4.Config`) in zigzag order: whole compressor windows of every rate (so no
    window straddles a block) and at least W - 1 rows (so a block's halo is one block back)."""
    rates = [config.compress_rate(t) for t in config.layer_types]
    return zigzag_rows(s, n, multiple=math.lcm(1, *(r for r in rates if r)), min_rows=config.sliding_window - 1)


def zigzag_row(p: int, s: int, n: int) -> int:
    """Row, in zigzag order, of sequence index p of an S-row sequence (S divisible by 2N)."""
    rows = s // (2 * n)
    return zigzag_order(n).index(p // rows) * rows + p % rows


def zigzag_order(n: int) -> list[int]:
    """Global block index of each of the 2N slots of the permuted sequence ([0, 2N-1, 1, 2N-2, ...])."""
    return [blk for i in range(n) for blk in (i, 2 * n - 1 - i)]


def zigzag_permute(x: jax.Array, n: int, *, inverse: bool = False) -> jax.Array:
    """[B, S, ...] in sequence order → zigzag order (or back): for callers that keep a whole model in zigzag
    order and pass `inputs_permuted=True`. S must be divisible by 2N. (A global gather: GSPMD lays it out.)"""
    order = zigzag_order(n)
    if inverse:
        order = [order.index(j) for j in range(2 * n)]
    b, s = x.shape[:2]
    blocks = x.reshape(b, 2 * n, s // (2 * n), *x.shape[2:])
    return jnp.take(blocks, jnp.asarray(order), axis=1).reshape(x.shape)


def local_stand_in(x: jax.Array) -> jax.Array:
    """comm="local"'s stand-in for a transfer: x rolled by one along its longest axis. Same shape, same bytes
    moved (one local copy), different values, so XLA can neither fold it away (`x + 0`) nor merge the compute of
    two ring steps that would otherwise see identical operands."""
    if x.ndim == 0:
        return x
    return jnp.roll(x, 1, axis=max(range(x.ndim), key=lambda a: x.shape[a]))


def sequence_shards() -> int:
    """Shards of the active mesh's sequence axis (1 without one)."""
    layout = sp_layout()
    return 1 if layout is None else layout[2]
