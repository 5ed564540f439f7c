"""One refinement level of the grouped exact top-k (`dsv4.topk.top_k`) as a Triton-lowered Pallas kernel, with its
jnp reference.

`top_k` picks the k best of a row by group maxima: it chooses the k groups with the best maxima, then the k best
among those groups' k · group elements. In XLA that second step is a sort of the k chosen group ids (so that
`lax.top_k`'s ties to the lower position are ties to the lower index), a gather of the k · group candidates and a
`lax.top_k` of them, once per recursion level: at a 512K prompt's last query chunk about 0.55 ms of its 2.2 ms,
four levels of it (docs/KERNEL_NOTES.md IX22). This kernel does one level in one pass:

    candidates = x[g · group + j] for each chosen group g and j < group (index >= N: -inf, never preferred)
    → the k best by (value descending, index ascending), best first: exactly `lax.top_k` over the whole row
      whenever the chosen groups hold the row's top k (the grouped argument of `dsv4.topk`)

by a bitonic sort of the (value, index) pairs in registers (`dsv4.pallas.indexer`'s network). The order of the
chosen group ids does not matter: the sort breaks ties by index itself. -0.0 ties with +0.0 here (broken by
index), where `lax.top_k` puts -0.0 below +0.0: the indexer's scores never hold -0.0 (its kernels write +0.0).
NaN is not supported.

Layout: one program = `block_rows` rows; its k · group candidates per row (padded to a power of two with -inf
at indices past N) are gathered with pointer loads, sorted best first, and the first k stored.
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

from dsv4.pallas.indexer import _bitonic_sort, _next_power_of_2

__all__ = ["SelectBlocks", "refine_top_k", "refine_top_k_kernel", "refine_top_k_reference"]

NEG_INF = float("-inf")


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


def refine_top_k_kernel(x_ref, groups_ref, values_ref, indices_ref, *, n_rows: int, group: int):
    """x_ref [block_rows, N]; groups_ref [block_rows, k] int32; values_ref / indices_ref [block_rows, k]."""
    block_rows, n = x_ref.shape
    k = groups_ref.shape[1]
    width = _next_power_of_2(k * group)
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
    values, index = _bitonic_sort(values, index, best_first=True)
    column = slot < k
    plgpu.store(values_ref.at[:, pl.ds(0, width)], values, mask=row_ok[:, None] & column[None, :])
    plgpu.store(indices_ref.at[:, pl.ds(0, width)], index, mask=row_ok[:, None] & column[None, :])


@functools.partial(jax.jit, static_argnames=("group", "blocks", "interpret"))
def refine_top_k(
    x: jax.Array,
    groups: jax.Array,
    *,
    group: int,
    blocks: SelectBlocks = SelectBlocks(),
    interpret: bool = False,
    out_init: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The k best of the chosen groups' elements, per row (see the module docstring).

    x [..., N] float; groups [..., k] int32, distinct group ids in [0, ceil(N / group)), any order. → (values
    [..., k], indices int32 [..., k]), best first, ties to the lower index. interpret: the Pallas interpreter
    (CPU). out_init: testing hook, the output buffers start as these (aliased), so unwritten elements keep them."""
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
    flat_x, flat_g = x.reshape(rows, n), groups.reshape(rows, k)
    out_shape = [jax.ShapeDtypeStruct((rows, k), x.dtype), jax.ShapeDtypeStruct((rows, k), jnp.int32)]
    row_block = lambda w: pl.BlockSpec((blocks.block_rows, w), lambda i: (i, 0))  # noqa: E731
    inits = ()
    if out_init is not None:
        if [(a.shape, a.dtype) for a in out_init] != [((*lead, k), x.dtype), ((*lead, k), jnp.int32)]:
            raise ValueError(f"out_init must be ({x.dtype}, int32) arrays of shape {(*lead, k)}")
        inits = tuple(a.reshape(rows, k) for a in out_init)

    def kernel(x_ref, g_ref, *refs):  # aliased init buffers (never read) come before the outputs
        refine_top_k_kernel(x_ref, g_ref, *refs[len(inits):], n_rows=rows, group=group)

    values, indices = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(rows, blocks.block_rows),),
        in_specs=[row_block(n), row_block(k), *[row_block(k)] * len(inits)],
        out_specs=[row_block(k), row_block(k)],
        input_output_aliases={2 + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="refine_top_k",
    )(flat_x, flat_g, *inits)
    return values.reshape(*lead, k), indices.reshape(*lead, k)


def refine_top_k_reference(x: jax.Array, groups: jax.Array, *, group: int) -> tuple[jax.Array, jax.Array]:
    """The same in plain jnp: gather the candidates (-inf past N), sort by (value descending, index ascending)."""
    n, k = x.shape[-1], groups.shape[-1]
    index = (groups[..., :, None] * group + jnp.arange(group)).reshape(*groups.shape[:-1], k * group)
    values = jnp.where(index < n, jnp.take_along_axis(x, jnp.minimum(index, n - 1), axis=-1), NEG_INF)
    neg, index = lax.sort((-values, index), dimension=-1, num_keys=2)
    return -neg[..., :k], index[..., :k].astype(jnp.int32)
