"""The mHC mixing matrices' Sinkhorn normalization as one Pallas kernel (Mosaic GPU and Triton lowerings), with its
jnp reference.

Every hyper-connection (two a layer: before attention and before the MoE) makes each token's `hc × hc` mixing matrix
doubly stochastic: columns normalized once, then `iters - 1` rounds of rows then columns (V4: hc = 4, 20 iterations).
The reference is a `lax.fori_loop`, and on a GPU XLA runs a while loop from the host: each of its 19 iterations
launches a handful of tiny kernels and copies the loop predicate back to the host before the next, so most of a
decode step's kernels are these loops' and the GPU sits idle between them (docs/kernels/sinkhorn.md).

The kernel does all of it in registers, one launch per hyper-connection: a program holds `block_tokens` tokens'
matrices as hc² vectors (layout [hc, hc, N], tokens along the lanes), and every row or column sum is hc - 1 adds of
whole vectors, so nothing is reduced across lanes. The arithmetic is the reference's (the same divisions in the same
order; only the order of each 4-term sum may differ), or in the reciprocal form each sum inverted once and the
entries multiplied by it.

Two lowerings of that one body (`_normalize`): `sinkhorn_mgpu` (Mosaic GPU: one warpgroup per CTA, the vectors loaded
from and stored to GMEM straight through registers; the tokens are padded to whole blocks in the wrapper, so nothing
is masked; `Kernels.sinkhorn="pallas"` on Hopper) and `sinkhorn` (Triton: other GPUs and `"pallas-triton"`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as plgpu

from dsv4.pallas._device import is_hopper, on_gpu

__all__ = ["MgpuSinkhornConfig", "SinkhornBlocks", "sinkhorn", "sinkhorn_kernel", "sinkhorn_mgpu",
           "sinkhorn_mgpu_kernel", "sinkhorn_reference"]  # fmt: skip

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


@dataclasses.dataclass(frozen=True)
class MgpuSinkhornConfig:
    """block_tokens: tokens per CTA (one warpgroup), a multiple of 128 (the warpgroup's threads: each holds
    block_tokens / 128 tokens of every vector); fewer tokens run as one block of the next multiple of 128.
    approx_math: Mosaic's fast math, which makes each division an approximate one (about 2 ulp, as the Triton
    lowering's `div.full.f32`); off, `/` is LLVM's IEEE division, as XLA divides (more instructions a division,
    and the kernel is mostly divisions: docs/kernels/sinkhorn.md). reciprocal: each row or column sum inverted
    once and the entries multiplied by it (a fourth of the divisions at hc = 4; within 1.5 ulp of the quotient
    with IEEE reciprocals, about 2.5 with approx_math's)."""

    block_tokens: int = 256
    approx_math: bool = False
    reciprocal: bool = False

    def __post_init__(self):
        if self.block_tokens < 128 or self.block_tokens % 128:
            raise ValueError(f"MgpuSinkhornConfig.block_tokens={self.block_tokens} must be a positive multiple of 128")


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


def _normalize(c: list[list[jax.Array]], *, hc: int, iters: int, eps: float,
               reciprocal: bool = False) -> list[list[jax.Array]]:  # fmt: skip
    """The reference's rounds on c[i][j] (entry (i, j) of every token's matrix, one vector each), unrolled: the body
    of both kernels. reciprocal: each sum's reciprocal once, then products (hc divisions a half-round instead of
    hc²; with IEEE reciprocals each entry is within 1.5 ulp of the quotient)."""

    def scaled(c, s, by_row):
        if reciprocal:
            s = [1.0 / v for v in s]
            return [[c[i][j] * s[i if by_row else j] for j in range(hc)] for i in range(hc)]
        return [[c[i][j] / s[i if by_row else j] for j in range(hc)] for i in range(hc)]

    def columns(c):  # divide by the column sums (over i)
        return scaled(c, [functools.reduce(jnp.add, [c[i][j] for i in range(hc)]) + eps for j in range(hc)], False)

    def rows(c):  # divide by the row sums (over j)
        return scaled(c, [functools.reduce(jnp.add, c[i]) + eps for i in range(hc)], True)

    c = columns(c)
    for _ in range(iters - 1):
        c = columns(rows(c))
    return c


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
    c = _normalize(c, hc=hc, iters=iters, eps=eps)
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


def sinkhorn_mgpu_kernel(c_ref, o_ref, *, hc: int, iters: int, eps: float, block_tokens: int,
                         reciprocal: bool = False):  # fmt: skip
    """c_ref, o_ref: [hc, hc, N] float32 in GMEM, N a multiple of block_tokens; this CTA normalizes tokens
    [t · block_tokens, (t + 1) · block_tokens), each entry (i, j) one [block_tokens] vector in registers.

    NOTE: loaded from GMEM straight into registers (coalesced: consecutive threads hold consecutive tokens), not
    staged through SMEM by TMA: the block is hc² vectors of a few hundred bytes, and the kernel is bound by latency,
    which a TMA and its barrier would only add to."""
    tokens = pl.ds(lax.axis_index("t") * block_tokens, block_tokens)
    c = [[c_ref[i, j, tokens] for j in range(hc)] for i in range(hc)]
    c = _normalize(c, hc=hc, iters=iters, eps=eps, reciprocal=reciprocal)
    for i in range(hc):
        for j in range(hc):
            o_ref[i, j, tokens] = c[i][j]


@functools.partial(jax.jit, static_argnames=("iters", "eps", "config", "interpret"))
def sinkhorn_mgpu(comb: jax.Array, iters: int, eps: float, *, config: MgpuSinkhornConfig = MgpuSinkhornConfig(),
                  interpret=None) -> jax.Array:  # fmt: skip
    """`sinkhorn_reference` as a Mosaic GPU kernel (Hopper). comb [..., hc, hc] → float32 [..., hc, hc].

    Any hc (no power-of-two tile shapes here). The tokens are padded with all-ones matrices to whole blocks (the
    pad and the [hc, hc, N] transpose are one XLA copy, as the Triton path's transpose is), so every load and
    store of the kernel is in bounds. interpret: an `InterpretGPUParams` (the Mosaic GPU interpreter on CPU)."""
    *lead, hc, hc2 = comb.shape
    if hc != hc2:
        raise ValueError(f"sinkhorn_mgpu: comb must be [..., hc, hc], got {list(comb.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn_mgpu: iters={iters} must be >= 1")
    if interpret is None and on_gpu() and not is_hopper():
        raise ValueError("sinkhorn_mgpu: the Mosaic GPU kernel needs a Hopper GPU (compute capability 9.x); use "
                         "`sinkhorn` (Triton) on this GPU")  # fmt: skip
    n = math.prod(lead)
    if n == 0:
        return jnp.zeros(comb.shape, F32)
    bt = min(config.block_tokens, pl.cdiv(n, 128) * 128)
    n_pad = pl.cdiv(n, bt) * bt
    x = jnp.moveaxis(comb.astype(F32).reshape(n, hc, hc), 0, -1)  # [hc, hc, N]: tokens along the lanes
    x = jnp.pad(x, ((0, 0), (0, 0), (0, n_pad - n)), constant_values=1.0)
    out = plmgpu.kernel(
        functools.partial(sinkhorn_mgpu_kernel, hc=hc, iters=iters, eps=eps, block_tokens=bt,
                          reciprocal=config.reciprocal),
        out_type=jax.ShapeDtypeStruct(x.shape, F32),
        grid=(n_pad // bt,),
        grid_names=("t",),
        compiler_params=plmgpu.CompilerParams(
            approx_math=config.approx_math, lowering_semantics=plmgpu.LoweringSemantics.Lane
        ),
        interpret=interpret,
        kernel_name="mhc_sinkhorn_mgpu",
    )(x)
    return jnp.moveaxis(out[..., :n], -1, 0).reshape(comb.shape)
