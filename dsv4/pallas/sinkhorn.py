"""The mHC mixing matrices' Sinkhorn normalization as one Triton-lowered Pallas kernel, with its jnp reference.

Every hyper-connection (two a layer: before attention and before the MoE) makes each token's `hc × hc` mixing matrix
doubly stochastic: columns normalized once, then `iters - 1` rounds of rows then columns (V4: hc = 4, 20 iterations).
The reference is a `lax.fori_loop`, and on a GPU XLA runs a while loop from the host: each of its 19 iterations
launches a handful of tiny kernels and copies the loop predicate back to the host before the next, so most of a
decode step's kernels are these loops' and the GPU sits idle between them (docs/kernels/sinkhorn.md).

The kernel does all of it in registers, one launch per hyper-connection: a program holds `block_tokens` tokens'
matrices as hc² vectors (layout [hc, hc, N], tokens along the lanes), and every row or column sum is hc - 1 adds of
whole vectors, so nothing is reduced across lanes. The arithmetic is the reference's (the same divisions in the same
order; only the order of each 4-term sum may differ).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["SinkhornBlocks", "sinkhorn", "sinkhorn_kernel", "sinkhorn_reference"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SinkhornBlocks:
    """block_tokens: tokens per program (a power of two; fewer tokens than that run as one masked block);
    num_warps: the launch's warps."""

    block_tokens: int = 256
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_tokens", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SinkhornBlocks.{name}={v} must be a power of two")


def sinkhorn_reference(comb: jax.Array, iters: int, eps: float, *, unroll: bool = False) -> jax.Array:
    """comb [..., hc, hc] (positive) → doubly stochastic [..., hc, hc], float32: columns first, then (iters - 1)
    rounds of rows and columns, as in the reference implementation. unroll: the rounds as straight-line XLA
    (`scripts/bench_mhc.py` times that form too)."""
    comb = comb.astype(F32)
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)

    def step(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    # A loop, not an unrolled Python for: 2 × 43 layers × 20 steps would bloat every compile.
    return jax.lax.fori_loop(0, iters - 1, step, comb, unroll=unroll)


def sinkhorn_kernel(c_ref, o_ref, *, hc: int, iters: int, eps: float, num_tokens: int):
    """c_ref, o_ref: [hc, hc, block_tokens] float32 (entry (i, j) of each of the block's matrices along the lanes).

    NOTE: a block past the last token is masked by hand. The Triton lowering does not mask a block that overhangs
    the array: unmasked, the last block's stores to lanes past N land in the next row's first lanes (row (i, j + 1)
    of the [hc, hc, N] layout), or past the buffer's end for the last row. Which write wins then depends on the
    programs' order (NaN appeared in tokens of the first block on the GPU); the interpreter drops such writes, so only
    the GPU shows it."""
    bt = o_ref.shape[-1]
    valid = pl.program_id(0) * bt + jnp.arange(bt) < num_tokens
    at = lambda ref, i, j: ref.at[jnp.int32(i), jnp.int32(j)]  # noqa: E731  # entry (i, j) of the block's matrices
    c = [[plgpu.load(at(c_ref, i, j), mask=valid, other=1.0) for j in range(hc)] for i in range(hc)]

    def columns(c):  # divide by the column sums (over i)
        s = [functools.reduce(jnp.add, [c[i][j] for i in range(hc)]) + eps for j in range(hc)]
        return [[c[i][j] / s[j] for j in range(hc)] for i in range(hc)]

    def rows(c):  # divide by the row sums (over j)
        s = [functools.reduce(jnp.add, c[i]) + eps for i in range(hc)]
        return [[c[i][j] / s[i] for j in range(hc)] for i in range(hc)]

    c = columns(c)
    for _ in range(iters - 1):
        c = columns(rows(c))
    for i in range(hc):
        for j in range(hc):
            plgpu.store(at(o_ref, i, j), c[i][j], mask=valid)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "blocks", "interpret"))
def sinkhorn(comb: jax.Array, iters: int, eps: float, *, blocks: SinkhornBlocks = SinkhornBlocks(),
             interpret: bool = False) -> jax.Array:  # fmt: skip
    """`sinkhorn_reference` in one kernel. comb [..., hc, hc] → float32 [..., hc, hc]."""
    *lead, hc, hc2 = comb.shape
    if hc != hc2:
        raise ValueError(f"sinkhorn: comb must be [..., hc, hc], got {list(comb.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn: iters={iters} must be >= 1")
    n = 1
    for d in lead:
        n *= d
    if n == 0:
        return jnp.zeros(comb.shape, F32)
    bt = min(blocks.block_tokens, pl.next_power_of_2(n))
    x = jnp.moveaxis(comb.astype(F32).reshape(n, hc, hc), 0, -1)  # [hc, hc, N]: tokens along the lanes
    out = pl.pallas_call(
        functools.partial(sinkhorn_kernel, hc=hc, iters=iters, eps=eps, num_tokens=n),
        out_shape=jax.ShapeDtypeStruct(x.shape, F32),
        grid=(pl.cdiv(n, bt),),
        in_specs=[pl.BlockSpec((hc, hc, bt), lambda t: (0, 0, t))],
        out_specs=pl.BlockSpec((hc, hc, bt), lambda t: (0, 0, t)),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="mhc_sinkhorn",
    )(x)
    return jnp.moveaxis(out, -1, 0).reshape(comb.shape)
