"""One refinement level of the grouped exact top-k (`dsv4.topk.top_k`) as a Triton-lowered Pallas kernel, with its
jnp reference.

`top_k` picks the k best of a row by group maxima: it chooses the k groups with the best maxima, then the k best
among those groups' k · group elements. In XLA that second step is a sort of the k chosen group ids (so that
`lax.top_k`'s ties to the lower position are ties to the lower index), a gather of the k · group candidates and a
`lax.top_k` of them, once per recursion level: a large share of the selection's time at long prompts
(docs/kernels/indexer.md). This kernel finds the k best of one level by a threshold, without
sorting anything:

    candidates = x[g · group + j] for each chosen group g and j < group (index >= N: never chosen)
    t = the k-th largest candidate, by a bitwise search over the values' order-preserving int32 keys (31 counts)
    → every candidate above t, and the lowest-index ties at t (a bitwise search over their indices), exactly k:
      the k best by (value descending, index ascending), as `lax.top_k` over the whole row picks them whenever the
      chosen groups hold the row's top k (the grouped argument of `dsv4.topk`)
    → stored compacted (a cumulative sum gives each chosen candidate its slot) in candidate order.

Candidate order is the chosen groups' order. `ordered=False` returns that (the inner levels of `top_k` only need
the set). `ordered=True` sorts the group ids first, so candidate order is index order, and then `lax.top_k` of
the k values puts them best first with ties to the lower index: exactly `lax.top_k`'s answer, for a sort of k
ids and a top-k of k values instead of k · group. The int32 keys order -0.0 below +0.0 as `lax.top_k` does.
NaN is not supported.

Why not a sort network: the first version sorted the k · group pairs with `dsv4.pallas.indexer`'s bitonic network
in registers (66 stages at 2048 wide); Triton took minutes to compile it at k = 512. The
searches here are loops (`fori_loop`) of reductions, quick to compile, and about 50 reductions per row.

Layout: one program = `block_rows` rows; its k · group candidates per row (padded to a power of two, at indices
past N) are gathered with pointer loads.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv4.pallas.indexer_common import next_power_of_2

__all__ = ["SelectBlocks", "refine_for", "refine_top_k", "refine_top_k_kernel", "refine_top_k_reference"]

NEG_INF = float("-inf")
INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class SelectBlocks:
    """block_rows rows per program (a power of two); num_warps for the launch."""

    block_rows: int = 1
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SelectBlocks.{name}={value} must be a positive power of two")


def order_key(values: jax.Array) -> jax.Array:
    """float32 → int32 with the same order (-inf lowest real value, -0.0 just below +0.0): negative floats have
    their magnitude bits flipped."""
    bits = lax.bitcast_convert_type(values, jnp.int32)
    return bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF)


def refine_top_k_kernel(x_ref, groups_ref, values_ref, indices_ref, *, n_rows: int, group: int):
    """x_ref [block_rows, N] float; groups_ref [block_rows, k] int32; values_ref / indices_ref [block_rows, width]
    (width = k · group padded to a power of two: the k chosen first, the other candidates after them)."""
    block_rows, n = x_ref.shape
    k = groups_ref.shape[1]
    width = next_power_of_2(k * group)
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    row_ok = rows < n_rows
    slot = jnp.arange(width)  # candidate slot: chosen group slot // group, element slot % group
    real = slot < k * group
    local = jnp.arange(block_rows)[:, None]
    chosen = plgpu.load(groups_ref.at[local, jnp.minimum(slot // group, k - 1)[None, :]],
                        mask=row_ok[:, None] & real[None, :], other=0)  # fmt: skip  # [R, width]
    index = jnp.where(real[None, :], chosen * group + (slot % group)[None, :], n + slot[None, :])  # [R, width]
    inside = row_ok[:, None] & (index < n)
    values = plgpu.load(x_ref.at[local, jnp.minimum(index, n - 1)], mask=inside, other=NEG_INF)
    key = jnp.where(inside, order_key(values.astype(jnp.float32)), INT32_MIN)  # padding below every real value

    def count(pred):  # [R, width] bool → [R] int32
        return jnp.sum(pred.astype(jnp.int32), axis=1)

    # t: the largest key with at least k candidates >= t (the k-th largest key), built from the sign bit down
    t = jnp.where(count(key >= 0) >= k, 0, INT32_MIN).astype(jnp.int32)

    def key_bit(i, t):
        trial = t | lax.shift_left(jnp.int32(1), 30 - i)
        return jnp.where(count(key >= trial[:, None]) >= k, trial, t)

    t = lax.fori_loop(0, 31, key_bit, t)
    above = key > t[:, None]
    tie = key == t[:, None]
    need = k - count(above)  # >= 1 ties to take, the lowest indices first
    index_bits = (n + width).bit_length()

    def index_bit(i, b):  # b: the largest bound with fewer than `need` ties at indices < b
        trial = b | lax.shift_left(jnp.int32(1), index_bits - 1 - i)
        return jnp.where(count(tie & (index < trial[:, None])) < need, trial, b)

    b = lax.fori_loop(0, index_bits, index_bit, jnp.zeros_like(t))
    take = above | (tie & (index <= b[:, None]))  # exactly k per row
    # every candidate gets its own output slot, in candidate order: the k taken in [0, k), the rest after them (a
    # permutation, so no two lanes store to one address: the interpreter's masked scatter would let them collide)
    taken = jnp.cumsum(take.astype(jnp.int32), axis=1)
    out = jnp.where(take, taken - 1, k + slot[None, :] - taken)
    plgpu.store(values_ref.at[local, out], values, mask=row_ok[:, None])
    plgpu.store(indices_ref.at[local, out], index, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("group", "ordered", "blocks", "interpret"))
def refine_top_k(
    x: jax.Array,
    groups: jax.Array,
    *,
    group: int,
    ordered: bool = True,
    blocks: SelectBlocks = SelectBlocks(),
    interpret: bool = False,
    out_init: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The k best of the chosen groups' elements, per row (see the module docstring).

    x [..., N] float; groups [..., k] int32, distinct group ids in [0, ceil(N / group)), any order. → (values
    [..., k], indices int32 [..., k]): the k best by (value descending, index ascending); ordered: best first,
    else in the order of `groups`. interpret: the Pallas interpreter (CPU). out_init: testing hook, the kernel's
    output buffers start as these (aliased), so unwritten elements keep them."""
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"refine_top_k needs a float x [..., N], got {x.dtype}{list(x.shape)}")
    if groups.shape[:-1] != x.shape[:-1] or groups.dtype != jnp.int32:
        raise ValueError(f"groups must be int32 [..., k] with x's leading dims {x.shape[:-1]}, got "
                         f"{groups.dtype}{list(groups.shape)}")  # fmt: skip
    if group < 1:
        raise ValueError(f"group={group} must be >= 1")
    *lead, n = x.shape
    k = groups.shape[-1]
    if not 1 <= k <= -(-n // group):
        raise ValueError(f"k={k} chosen groups must be in [1, ceil(N / group) = {-(-n // group)}]")
    rows = math.prod(lead)
    if ordered:
        groups = jnp.sort(groups, axis=-1)  # candidate order = index order (see the module docstring)
    flat_x, flat_g = x.reshape(rows, n), groups.reshape(rows, k)
    width = next_power_of_2(k * group)
    out_shape = [jax.ShapeDtypeStruct((rows, width), x.dtype), jax.ShapeDtypeStruct((rows, width), jnp.int32)]
    row_block = lambda w: pl.BlockSpec((blocks.block_rows, w), lambda i: (i, 0))  # noqa: E731
    inits = ()
    if out_init is not None:
        if [(a.shape, a.dtype) for a in out_init] != [((*lead, k), x.dtype), ((*lead, k), jnp.int32)]:
            raise ValueError(f"out_init must be ({x.dtype}, int32) arrays of shape {(*lead, k)}")
        inits = tuple(jnp.pad(a.reshape(rows, k), ((0, 0), (0, width - k)), mode="edge") for a in out_init)

    def kernel(x_ref, g_ref, *refs):  # aliased init buffers (never read) come before the outputs
        refine_top_k_kernel(x_ref, g_ref, *refs[len(inits):], n_rows=rows, group=group)

    values, indices = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(rows, blocks.block_rows),),
        in_specs=[row_block(n), row_block(k), *[row_block(width)] * len(inits)],
        out_specs=[row_block(width), row_block(width)],
        input_output_aliases={2 + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="refine_top_k",
    )(flat_x, flat_g, *inits)
    values, indices = values[:, :k].reshape(*lead, k), indices[:, :k].reshape(*lead, k)
    if ordered:  # candidates came in index order: lax.top_k's ties to the lower position are ties to the lower index
        values, pos = lax.top_k(values, k)
        indices = jnp.take_along_axis(indices, pos, axis=-1)
    return values, indices


def refine_top_k_reference(x: jax.Array, groups: jax.Array, *, group: int) -> tuple[jax.Array, jax.Array]:
    """The same in plain jnp: gather the candidates (-inf past N), sort by (value descending, index ascending)."""
    n, k = x.shape[-1], groups.shape[-1]
    index = (groups[..., :, None] * group + jnp.arange(group)).reshape(*groups.shape[:-1], k * group)
    values = jnp.where(index < n, jnp.take_along_axis(x, jnp.minimum(index, n - 1), axis=-1), NEG_INF)
    neg, index = lax.sort((-values, index), dimension=-1, num_keys=2)
    return -neg[..., :k], index[..., :k].astype(jnp.int32)


def _refine_interpreted(x, groups, *, group, ordered):
    """`refine_top_k` in the Pallas interpreter, one stable callable (`top_k` takes `refine` as a static argument)."""
    return refine_top_k(x, groups, group=group, ordered=ordered, interpret=True)


def refine_for(selection: str, interpret: bool):
    """`dsv4.topk.top_k`'s `refine` for a selection: "xla" → None, "kernel" → `select.refine_top_k` (interpreted
    with `interpret`), "auto" → "kernel" on a Hopper GPU, "xla" elsewhere."""
    if selection not in ("auto", "xla", "kernel"):
        raise ValueError(f"selection={selection!r} must be 'auto', 'xla' or 'kernel'")
    if selection == "auto":
        from dsv4.pallas._device import is_hopper  # looked up per call (tests patch it)

        selection = "kernel" if not interpret and is_hopper() else "xla"
    if selection == "xla":
        return None
    return _refine_interpreted if interpret else refine_top_k
