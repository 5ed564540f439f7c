"""W8A8 linear layers: `x · Wᵀ` with W kept FP8 in DeepSeek's 128 × 128 blocks and x quantized per token and
128-channel group on the way in, as DeepSeek's own FP8 linear layers run (`act_quant`, then a block-scaled FP8
GEMM). It reads the stored e4m3 values: no dequantized copy of the weight is written in each step.

No kernel of its own: the grouped expert GEMMs with a single group (docs/kernels/moe.md). On Hopper the Mosaic GPU
`down` kernel (rows padded to its 128-row tiles, N a multiple of 256), elsewhere the Triton one (interpreted off a
GPU). `linear_w8a8_reference` is the jnp form both are tested against. Weights that read one x run stacked along N as
one GEMM (`linear_w8a8_stacked`), and x quantized once can feed several GEMMs (`quantize_rows`, `x_q=`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dsv4.pallas._device import is_hopper, on_gpu
from dsv4.pallas.moe import grouped_down
from dsv4.pallas.moe_common import FP8, QUANT_BLOCK, dequantize_blocks, quantize_per_token_group
from dsv4.pallas.moe_mgpu import TILE_M, MgpuMoeConfig, grouped_down_mgpu, mgpu_moe_unsupported

F32 = jnp.float32
IMPLS = ("auto", "mgpu", "triton")


def w8a8_unsupported(q: jax.Array, scale: jax.Array) -> str:
    """Why a weight cannot run W8A8 ("" when it can): e4m3 values [N, K] with float32 scales in 128 × 128 blocks."""
    if q.ndim != 2 or q.dtype != FP8:
        return f"weight {q.dtype} {q.shape}: the W8A8 linear takes a 2-D float8_e4m3fn weight [N, K]"
    n, k = q.shape
    if n % QUANT_BLOCK or k % QUANT_BLOCK:
        return f"weight [N, K] = {list(q.shape)}: N and K must be multiples of {QUANT_BLOCK}"
    want = (n // QUANT_BLOCK, k // QUANT_BLOCK)
    if scale.shape != want or scale.dtype != F32:
        return f"scales {scale.dtype} {scale.shape}: float32 {want} (one per 128 × 128 block)"
    return ""


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] as `linear_w8a8` quantizes it: e4m3 values [..., K] and their scales [..., K / 128] float32
    (`quantize_per_token_group`), for callers that feed one x to several W8A8 GEMMs (`linear_w8a8(x_q=...)`, the
    MoE's routed experts). The leading axes stay, so a sequence-sharded x is quantized where it lives."""
    # NOTE: x materialized first. Otherwise XLA fuses x's producer (the mHC pre-mix over 4 residual copies, 4x x's
    # bytes) into both the scales' reduce and the quantizing pass and computes it twice: 0.39 + 0.33 ms for a 16K
    # chunk's [16384, 4096] x (H100 profile, docs/kernels/moe.md "W8A8 dense layers").
    return quantize_per_token_group(lax.optimization_barrier(x))


def linear_w8a8(x: jax.Array, q: jax.Array, scale: jax.Array, *, impl: str = "auto", interpret=None,
                config: MgpuMoeConfig | None = None, x_q: tuple[jax.Array, jax.Array] | None = None,
                ) -> jax.Array:  # fmt: skip
    """x [..., K] (bf16 / f16) · dequantize(q, scale)ᵀ, q [N, K] e4m3 with scale [N / 128, K / 128] float32, x
    quantized per token and 128-group (`quantize_rows`). Accumulates in float32; → [..., N] in x's dtype.

    impl: "mgpu" (the Mosaic GPU kernel; N a multiple of 256), "triton", or "auto": Mosaic on Hopper where the shape
    fits, else Triton. interpret: run the kernel in its interpreter (None: off a GPU). config: the Mosaic kernel's
    launch parameters (None: its defaults; the Triton path has none). x_q: `quantize_rows(x)` when the caller has it
    already (x then gives only the shape and the output dtype).
    """
    why = w8a8_unsupported(q, scale)
    if why:
        raise ValueError(f"linear_w8a8: {why}")
    if impl not in IMPLS:
        raise ValueError(f"linear_w8a8: impl={impl!r}; choose one of {list(IMPLS)}")
    *lead, k = x.shape
    n = q.shape[0]
    if k != q.shape[1]:
        raise ValueError(f"linear_w8a8: x [..., {k}] does not fit the weight [N, K] = {list(q.shape)}")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"linear_w8a8: x.dtype={x.dtype}; bfloat16 or float16")
    gpu = on_gpu()
    interpret = (not gpu) if interpret is None else interpret
    mgpu_fits = not mgpu_moe_unsupported(n, k, w_dtype=FP8, x_dtype=FP8)
    if impl == "auto":
        impl = "mgpu" if gpu and not interpret and is_hopper() and mgpu_fits else "triton"
    if impl == "mgpu" and not mgpu_fits:
        raise ValueError(f"linear_w8a8: impl='mgpu' needs N a multiple of 256, got the weight {list(q.shape)}")
    xq, xs = quantize_rows(x) if x_q is None else x_q
    m = math.prod(lead)
    if xq.size != m * k or xs.size != m * (k // QUANT_BLOCK):
        raise ValueError(f"linear_w8a8: x_q {xq.shape}, {xs.shape} is not x {x.shape} quantized")
    xq, xs = xq.reshape(m, k), xs.reshape(m, k // QUANT_BLOCK)
    if impl == "mgpu":
        y = w8a8_gemm_mgpu(xq, xs, q, scale, out_dtype=x.dtype, config=config, interpret=interpret)
    else:
        y = grouped_down(xq, q[None], jnp.array([m], jnp.int32), h_scales=xs, down_scales=scale[None],
                         out_dtype=x.dtype, interpret=interpret)  # fmt: skip
    return y.reshape(*lead, n)


def stacked_w8a8_unsupported(weights) -> str:
    """Why `linear_w8a8_stacked` should not take these (q, scale) weights ("" when it should): each must run W8A8,
    all over one K, and stacking must not move the GEMM off the Mosaic kernel where a part alone would run on it (N
    a multiple of 256 there)."""
    if len(weights) < 2:
        return "fewer than two weights"
    for q, scale in weights:
        why = w8a8_unsupported(q, scale)
        if why:
            return why
    ks = {q.shape[1] for q, _ in weights}
    if len(ks) != 1:
        return f"weights over different K: {sorted(ks)}"
    k, ns = ks.pop(), [q.shape[0] for q, _ in weights]
    fits = lambda n: not mgpu_moe_unsupported(n, k, w_dtype=FP8, x_dtype=FP8)  # noqa: E731
    if any(map(fits, ns)) and not fits(sum(ns)):
        return f"N = {' + '.join(map(str, ns))} leaves the Mosaic kernel's multiples of 256"
    return ""


def linear_w8a8_stacked(x: jax.Array, weights, **kwargs) -> jax.Array:
    """`linear_w8a8` over several (q, scale) weights of one K as one GEMM: x quantized once, the weights stacked
    along N. → [..., ΣN], each weight's output in its own columns, in order, bit-equal to its own `linear_w8a8`
    (each output column is the same K sum in the same order either way). What goes is a quantization pass over x
    and a narrow GEMM's poor fit (a 16K chunk's wkv, N = 512, ran 0.85x the dequantized route on its own). kwargs:
    `linear_w8a8`'s."""
    why = stacked_w8a8_unsupported(weights)
    if why:
        raise ValueError(f"linear_w8a8_stacked: {why}")
    q = jnp.concatenate([w for w, _ in weights])
    scale = jnp.concatenate([s for _, s in weights])
    return linear_w8a8(x, q, scale, **kwargs)


def w8a8_gemm_mgpu(xq: jax.Array, xs: jax.Array, q: jax.Array, scale: jax.Array, *, out_dtype,
                   config: MgpuMoeConfig | None = None, interpret: bool = False) -> jax.Array:  # fmt: skip
    """`linear_w8a8`'s GEMM on rows already quantized (xq e4m3 [M, K], xs float32 [M, K // 128]): the Mosaic grouped
    `down` kernel with one group. → [M, N] in out_dtype."""
    m = xq.shape[0]
    pad = -m % TILE_M  # whole 128-row tiles: the kernel's TMA stores write whole boxes
    if pad:
        xq, xs = jnp.pad(xq, ((0, pad), (0, 0))), jnp.pad(xs, ((0, pad), (0, 0)), constant_values=1.0)
    tiles = jnp.zeros(((m + pad) // TILE_M,), jnp.int32)  # every row tile is "expert" 0
    mgpu_interpret = None
    if interpret:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

        mgpu_interpret = InterpretGPUParams()
    return grouped_down_mgpu(xq, q[None], tiles, h_scales=xs, down_scales=scale[None], out_dtype=out_dtype,
                             config=config or MgpuMoeConfig(), interpret=mgpu_interpret)[:m]  # fmt: skip


def linear_w8a8_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """The jnp form of `linear_w8a8`: the same quantized x times the dequantized weight, float32 dot."""
    *lead, k = x.shape
    xq, xs = quantize_per_token_group(x.reshape(-1, k))
    xf = dequantize_blocks(xq, xs, (1, QUANT_BLOCK))
    wf = dequantize_blocks(q, scale, (QUANT_BLOCK, QUANT_BLOCK))
    y = jnp.einsum("mk,nk->mn", xf, wf, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype).reshape(*lead, q.shape[0])
