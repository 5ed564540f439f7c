"""One refinement level of the grouped exact top-k (`dsv4.topk.top_k`) as a Triton-lowered Pallas kernel, with its
jnp reference.

`top_k` picks the k best of a row by group maxima: it chooses the k groups with the best maxima, then the k best
among those groups' k · group elements. In XLA that second step is a sort of the k chosen group ids (so that
`lax.top_k`'s ties to the lower position are ties to the lower index), a gather of the k · group candidates and a
`lax.top_k` of them, once per recursion level: a large share of the selection's time at long prompts
(docs/kernels/indexer.md). This kernel finds the k best of one level by a threshold, without
sorting anything:

    candidates = x[g · group + j] for each chosen group g and j < group (index >= N: never chosen)
    t = the k-th largest candidate, by a bitwise search over the values' order-preserving int32 keys (32 counts,
        fewer when the caller passes the chosen groups' maxima: t lies between the smallest and the largest)
    → every candidate above t, and the lowest-index ties at t (a bitwise search over their indices, skipped when
      every tie is needed, as with distinct scores), exactly k:
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
searches here are loops (`fori_loop`) of reductions, quick to compile: at most about 50 reductions per row, about
27 on distinct scores with the maxima given.

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

__all__ = ["SelectBlocks", "chosen_candidates", "refine_for", "refine_top_k", "refine_top_k_kernel",
           "refine_top_k_reference"]

NEG_INF = float("-inf")
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


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


def highest_bit(x: jax.Array) -> jax.Array:
    """int32 x >= 0 → the index of its highest set bit (-1 for 0), or one more where float32 rounds x up to the next
    power of two: an upper bound, as the searches below need (the exponent of float32(x))."""
    exponent = lax.shift_right_logical(lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32), 23) - 127
    return jnp.maximum(exponent, -1)


def refine_top_k_kernel(x_ref, groups_ref, *refs, n_rows: int, group: int, bounded: bool):
    """x_ref [block_rows, N] float; groups_ref [block_rows, k] int32; then, when bounded, group_max_ref
    [block_rows, k] (each chosen group's maximum); values_ref / indices_ref [block_rows, width] (width = k · group
    padded to a power of two: the k chosen first, the other candidates after them)."""
    group_max_ref, values_ref, indices_ref = refs if bounded else (None, *refs)
    block_rows, n = x_ref.shape
    k = groups_ref.shape[1]
    width = next_power_of_2(k * group)
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    row_ok = rows < n_rows
    slot = jnp.arange(width)  # candidate slot: chosen group slot // group, element slot % group
    real = slot < k * group
    local = jnp.arange(block_rows)[:, None]
    of_group = local, jnp.minimum(slot // group, k - 1)[None, :]  # each candidate slot's chosen group
    chosen = plgpu.load(groups_ref.at[of_group], mask=row_ok[:, None] & real[None, :], other=0)  # [R, width]
    index = jnp.where(real[None, :], chosen * group + (slot % group)[None, :], n + slot[None, :])  # [R, width]
    inside = row_ok[:, None] & (index < n)
    values = plgpu.load(x_ref.at[local, jnp.minimum(index, n - 1)], mask=inside, other=NEG_INF)
    key = jnp.where(inside, order_key(values.astype(jnp.float32)), INT32_MIN)  # padding below every real value

    def count(pred):  # [R, width] bool → [R] int32
        return jnp.sum(pred.astype(jnp.int32), axis=1)

    # t: the largest key with at least k candidates >= t (the k-th largest key), as base + d with d found bit by bit
    # from the top. Without bounds: base by the sign's count (0 or INT32_MIN), then 31 counts over d < 2^31. With
    # the chosen groups' maxima: t lies between their smallest and largest keys, lo and hi (each of the k groups
    # holds a candidate >= lo; none exceeds hi), so where the two share a sign, base = lo and d <= hi - lo: about
    # 23 + log2(hi / lo) counts for positive scores, 24-26 for scores within a factor of 2-8.
    base = jnp.where(count(key >= 0) >= k, 0, INT32_MIN).astype(jnp.int32)
    span = jnp.full_like(base, INT32_MAX)  # d's range, per row
    if bounded:
        # loaded per candidate slot as the group ids are (a [R, k] block need not be a power of two wide)
        row_mask = jnp.broadcast_to(row_ok[:, None], (block_rows, width))
        bound = order_key(plgpu.load(group_max_ref.at[of_group], mask=row_mask, other=0.0).astype(jnp.float32))
        lo, hi = jnp.min(bound, axis=1), jnp.max(bound, axis=1)  # padding slots repeat group k - 1: no effect
        same_sign = (lo ^ hi) >= 0  # then hi - lo cannot overflow
        base = jnp.where(same_sign, lo, base)
        span = jnp.where(same_sign, hi - lo, span)
    # The block runs its widest row's bits; a trial past a row's span is refused (and base + trial never overflows).
    steps = jnp.minimum(jnp.max(highest_bit(jnp.where(row_ok, span, 0))), 30) + 1

    def key_bit(i, d):
        trial = d | lax.shift_left(jnp.int32(1), steps - 1 - i)
        keep = (trial <= span) & (count(key >= (base + jnp.minimum(trial, span))[:, None]) >= k)
        return jnp.where(keep, trial, d)

    t = base + lax.fori_loop(0, steps, key_bit, jnp.zeros_like(base))
    above = key > t[:, None]
    tie = key == t[:, None]
    need = k - count(above)  # >= 1 ties to take, the lowest indices first
    index_bits = (n + width).bit_length()
    # With distinct scores only the k-th itself ties (need == ties): every tie is taken and the search over the
    # index bits (one count a bit) is skipped for the block.
    every_tie = jnp.sum(((count(tie) != need) & row_ok).astype(jnp.int32)) == 0

    def index_bit(i, b):  # b: the largest bound with fewer than `need` ties at indices < b
        trial = b | lax.shift_left(jnp.int32(1), index_bits - 1 - i)
        return jnp.where(count(tie & (index < trial[:, None])) < need, trial, b)

    all_indices = jnp.full_like(t, 2**index_bits - 1)  # >= every index: takes every tie
    # NOTE: explicit int32 operands: Pallas' Triton lowering types a `where` of two Python ints as i1
    trips = jnp.where(every_tie, jnp.int32(0), jnp.int32(index_bits))
    b = lax.fori_loop(0, trips, index_bit, jnp.where(every_tie, all_indices, jnp.zeros_like(t)))
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
    group_max: jax.Array | None = None,
    out_init: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The k best of the chosen groups' elements, per row (see the module docstring).

    x [..., N] float; groups [..., k] int32, distinct group ids in [0, ceil(N / group)), any order. → (values
    [..., k], indices int32 [..., k]): the k best by (value descending, index ascending); ordered: best first,
    else in the order of `groups`. interpret: the Pallas interpreter (CPU). group_max: [..., k], each chosen
    group's maximum over x (any order), as `dsv4.topk.top_k` has them from the level below: the k-th best lies
    between their smallest and largest, so the threshold search covers only that range. They must be exact: other
    values give other picks. out_init: testing hook, the kernel's output buffers start as these (aliased), so
    unwritten elements keep them."""
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
    if group_max is not None and (group_max.shape != groups.shape or not jnp.issubdtype(group_max.dtype,
                                                                                         jnp.floating)):
        raise ValueError(f"group_max must be float [..., k] shaped as groups {groups.shape}, got "
                         f"{group_max.dtype}{list(group_max.shape)}")  # fmt: skip
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

    bounds = () if group_max is None else (group_max.reshape(rows, k),)

    def kernel(x_ref, g_ref, *refs):  # aliased init buffers (never read) come before the outputs
        outs = refs[len(bounds) + len(inits):]
        refine_top_k_kernel(x_ref, g_ref, *refs[: len(bounds)], *outs, n_rows=rows, group=group,
                            bounded=bool(bounds))  # fmt: skip

    values, indices = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(rows, blocks.block_rows),),
        in_specs=[row_block(n), row_block(k), *[row_block(k)] * len(bounds), *[row_block(width)] * len(inits)],
        out_specs=[row_block(width), row_block(width)],
        input_output_aliases={2 + len(bounds) + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="refine_top_k",
    )(flat_x, flat_g, *bounds, *inits)
    values, indices = values[:, :k].reshape(*lead, k), indices[:, :k].reshape(*lead, k)
    if ordered:  # candidates came in index order: lax.top_k's ties to the lower position are ties to the lower index
        values, pos = lax.top_k(values, k)
        indices = jnp.take_along_axis(indices, pos, axis=-1)
    return values, indices


def chosen_candidates(x: jax.Array, groups: jax.Array, *, group: int) -> tuple[jax.Array, jax.Array]:
    """The chosen groups' elements in plain jnp: (values [..., k · group], -inf past N; their indices), group by
    group in the order of `groups`."""
    n, k = x.shape[-1], groups.shape[-1]
    index = (groups[..., :, None] * group + jnp.arange(group)).reshape(*groups.shape[:-1], k * group)
    return jnp.where(index < n, jnp.take_along_axis(x, jnp.minimum(index, n - 1), axis=-1), NEG_INF), index


def refine_top_k_reference(x: jax.Array, groups: jax.Array, *, group: int) -> tuple[jax.Array, jax.Array]:
    """The same in plain jnp: gather the candidates (-inf past N), sort by (value descending, index ascending)."""
    k = groups.shape[-1]
    values, index = chosen_candidates(x, groups, group=group)
    neg, index = lax.sort((-values, index), dimension=-1, num_keys=2)
    return -neg[..., :k], index[..., :k].astype(jnp.int32)


def _refine_interpreted(x, groups, *, group, ordered, group_max=None):
    """`refine_top_k` in the Pallas interpreter, one stable callable (`top_k` takes `refine` as a static argument)."""
    return refine_top_k(x, groups, group=group, ordered=ordered, group_max=group_max, interpret=True)


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
