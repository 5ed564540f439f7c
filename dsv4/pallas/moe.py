"""Grouped expert GEMMs for DeepSeek-V4's routed experts (dropless), as Triton-lowered Pallas kernels, with references.

On Hopper `routed_experts` hands bf16 / f16 and W8A8 to the Mosaic GPU kernels of `moe_mgpu.py` (impl="auto"); the
kernels here are the CPU-testable path, W8A16's, and the fallback for shapes those do not take.

Token-expert pairs are sorted by expert, so each expert owns one contiguous run of rows ("group") of the sorted
activations. Two kernels then do the expert MLP, and `routed_experts` composes them with the sort and the combine:

    x_sorted [M, D] ──grouped_gate_up──▶ h [M, I] = silu(min(x·Wg_eᵀ, L)) · clip(x·Wu_eᵀ, ±L)   (SwiGLU fused)
    h        [M, I] ──grouped_down─────▶ y [M, D] = (h·Wd_eᵀ) · row_weight                     (weight fused)

Weights keep the checkpoint layout: gate_up [E, 2I, D] (rows 0..I-1 gate, I..2I-1 up), down [E, D, I].
Layout of this file (see dsv4/pallas/README.md):

- `BlockSizes`                tile sizes and launch parameters (frozen, validated).
- `grouped_matmul_kernel`     the kernel body shared by both GEMMs: one program = one (row tile, column tile).
- `grouped_gate_up`, `grouped_down`, `routed_experts`   the public jitted entries.
- `*_reference`               the spec in plain jnp (dense over experts, no sorting), for tests.
- `quantize_per_token_group`, `dequantize_blocks`       DeepSeek's FP8 formats.

NOTE (tiles never straddle experts, and nothing is padded in memory): the wrapper turns `group_sizes` into a
tile map [T, 3] = (expert, row_start, row_end). Each group is cut into ceil(size / block_m) tiles that start at
the group's own offset, so a tile is a window [row_start, row_start + block_m) into the unpadded sorted rows,
masked to rows < row_end. Padding to a multiple of block_m exists only in the tile count, not in HBM: no padded
copy of x, no scatter of the output back to unpadded rows, and every row is written by exactly one program per
column tile. T is static: sum_e ceil(g_e / bm) <= (M + (bm - 1) · min(E + 1, M)) // bm; programs past the real tile
count see row_end == row_start and do nothing. Rows past sum(group_sizes) form one extra "zero" group whose tiles
write zeros (as `lax.ragged_dot` does), so the output is fully defined.

FP8 (DeepSeek's format): weights float8_e4m3fn with float32 `weight_scale_inv`-style block scales, one per
128 × 128 block: w[e, o, i] = fp8[e, o, i] · scale[e, o // 128, i // 128]. Activations are either
- bf16 (W8A16): the fp8 weight tile is upcast to bf16 in registers (exact: e4m3 ⊂ bf16), multiplied in bf16
  with f32 accumulation, and the block scale multiplies the partial product; or
- fp8 with per-token 128-group scales (W8A8, as DeepSeek runs it): x[m, k] = fp8[m, k] · x_scales[m, k // 128];
  the fp8 × fp8 product accumulates in f32 and is scaled by x_scale[row] · w_scale per 128-wide K step.
  `routed_experts` quantizes x per token (before the gather) and h per row between the two kernels.
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

from dsv4.pallas import moe_mgpu
from dsv4.pallas._device import is_hopper
from dsv4.pallas._jax_compat import I32_OFFSETS_MAX_ELEMENTS, install_fp8_fast_accum, install_wide_offsets
from dsv4.pallas.moe_common import FP8, FP8_MAX, QUANT_BLOCK, dequantize_blocks, quantize_per_token_group

__all__ = [
    "FP8_MAX",
    "QUANT_BLOCK",
    "BlockSizes",
    "dequantize_blocks",
    "grouped_down",
    "grouped_down_reference",
    "grouped_gate_up",
    "grouped_gate_up_reference",
    "grouped_matmul_kernel",
    "quantize_per_token_group",
    "routed_experts",
    "routed_experts_reference",
    "tile_map",
]

F32 = jnp.float32
_MIN_DOT_DIM = 16  # `tl.dot` needs every matmul dimension >= 16
_ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16, F32)


def _is_power_of_2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the grouped GEMMs.

    block_m: sorted rows per tile (tiles start at their expert's first row, so a small group wastes at most
             block_m - 1 rows of one tile).
    block_n: output columns per tile, clamped to the output width N (N must then be a multiple). In
             `grouped_gate_up` a program computes block_n gate and block_n up columns (2 accumulators).
    block_k: reduction step, clamped to the reduction width K (K must then be a multiple). None (the default):
             64 for bf16 / f16 / f32 weights, 128 (= QUANT_BLOCK) for fp8 weights: one K step per weight-scale
             block, so the f32 promotion of the fp8 partial product (scale, add) runs once per 128 of K, and an
             fp8 K step moves the same bytes as a bf16 one at 64.
    num_warps, num_stages: Triton launch parameters (None: 4 warps for block_m · block_n <= 64 · 64, else 8).
    fp8_fast_accum: W8A8 only. True: each fp8 × fp8 `tl.dot` (one K step) accumulates inside the tensor core and
             the kernel promotes it to f32 once per step (scale, add), as DeepGEMM does per 128 of K and as Triton's
             own `tl.dot` does by default on sm90 (max_num_imprecise_acc = 2^30). False: Pallas's default
             (max_num_imprecise_acc = 0), which adds every 32-wide wgmma into an f32 partial sum in registers:
             4 promotions per 128-wide K step instead of 1 (docs/kernels/moe.md).

    All sizes are powers of two >= 16 (Triton tensor shapes, `tl.dot`). FP8 weights need block_n and block_k to
    divide 128, so one weight scale covers a whole tile column-block per K step. Defaults are picked for V4
    shapes on Hopper in the Triton lowering, not measured (docs/kernels/moe.md).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int = 3
    fp8_fast_accum: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if name == "block_k" and value is None:
                continue
            if not _is_power_of_2(value) or value < _MIN_DOT_DIM:
                raise ValueError(f"BlockSizes.{name}={value} must be a power of two >= {_MIN_DOT_DIM}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 1")

    def tile(self, n: int, k: int, *, fp8: bool, what: str) -> tuple[int, int]:
        """→ (block_n, block_k) clamped to an output width n and reduction width k; ValueError if they misfit."""
        block_k = self.block_k or (QUANT_BLOCK if fp8 else 64)
        block_n, block_k = min(self.block_n, n), min(block_k, k)
        fits = all(_is_power_of_2(b) and b >= _MIN_DOT_DIM for b in (block_n, block_k))
        if n % block_n or k % block_k or not fits:
            raise ValueError(f"{what}: output width {n} and reduction width {k} must be multiples of the tile "
                             f"(block_n={block_n}, block_k={block_k}, powers of two >= {_MIN_DOT_DIM})")  # fmt: skip
        if fp8 and (QUANT_BLOCK % block_n or QUANT_BLOCK % block_k):
            raise ValueError(f"{what}: FP8 weights need block_n={block_n} and block_k={block_k} to divide "
                             f"{QUANT_BLOCK} (one block scale per tile and K step)")  # fmt: skip
        return block_n, block_k

    def warps(self) -> int:
        return self.num_warps or (4 if self.block_m * self.block_n <= 64 * 64 else 8)


# ---------------------------------------------------------------------------------------------
# Input checks shared by the kernel entries and the references.
# ---------------------------------------------------------------------------------------------
def _check_grouped(what, x, weight, group_sizes, x_scales, weight_scales, *, x_name, w_name):
    """Validates one grouped GEMM's inputs (gate_up when w_name == "gate_up": N = 2I is even)."""
    if x.ndim != 2 or weight.ndim != 3:
        raise ValueError(f"{what}: expected {x_name} [M, K] and {w_name} [E, N, K], got {x_name}.shape={x.shape}, "
                         f"{w_name}.shape={weight.shape}")  # fmt: skip
    m, k = x.shape
    e, n, wk = weight.shape
    if wk != k or m == 0 or e == 0 or (w_name == "gate_up" and n % 2):
        raise ValueError(f"{what}: {w_name}.shape={weight.shape} does not fit {x_name}.shape={x.shape} "
                         f"(need M >= 1, E >= 1, matching K{', even 2I' if w_name == 'gate_up' else ''})")  # fmt: skip
    if group_sizes.shape != (e,) or group_sizes.dtype != jnp.int32:
        raise ValueError(f"{what}: group_sizes must be int32 [E] = ({e},), got {group_sizes.dtype} {group_sizes.shape}")
    weight_fp8 = weight.dtype == FP8
    x_fp8 = x.dtype == FP8
    if not weight_fp8 and weight.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"{what}: {w_name}.dtype={weight.dtype} must be bfloat16, float16, float32 or float8_e4m3fn")
    if not x_fp8 and x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"{what}: {x_name}.dtype={x.dtype} must be bfloat16, float16, float32 or float8_e4m3fn")
    if not weight_fp8 and not x_fp8 and x.dtype != weight.dtype:
        raise ValueError(f"{what}: {x_name}.dtype={x.dtype} and {w_name}.dtype={weight.dtype} differ")
    if x_fp8 and not weight_fp8:
        raise ValueError(f"{what}: float8 {x_name} needs float8_e4m3fn {w_name}, got {weight.dtype}")
    if weight_fp8:
        if n % QUANT_BLOCK or k % QUANT_BLOCK:
            raise ValueError(f"{what}: FP8 {w_name}.shape={weight.shape} needs N and K multiples of {QUANT_BLOCK}")
        want = (e, n // QUANT_BLOCK, k // QUANT_BLOCK)
        if weight_scales is None or weight_scales.shape != want or weight_scales.dtype != F32:
            got = None if weight_scales is None else f"{weight_scales.dtype} {weight_scales.shape}"
            raise ValueError(f"{what}: FP8 {w_name}.shape={weight.shape} needs float32 scales {want}, got {got}")
    elif weight_scales is not None:
        raise ValueError(f"{what}: scales given but {w_name} is {weight.dtype}, not float8_e4m3fn")
    if x_fp8:
        want = (m, k // QUANT_BLOCK)
        if x_scales is None or x_scales.shape != want or x_scales.dtype != F32:
            got = None if x_scales is None else f"{x_scales.dtype} {x_scales.shape}"
            raise ValueError(f"{what}: FP8 {x_name}.shape={x.shape} needs float32 per-token scales {want}, got {got}")
    elif x_scales is not None:
        raise ValueError(f"{what}: {x_name}_scales given but {x_name} is {x.dtype}, not float8_e4m3fn")


def _default_out_dtype(x):
    return jnp.bfloat16 if x.dtype == FP8 else x.dtype


# ---------------------------------------------------------------------------------------------
# References: dense over experts, no sorting, everything dequantized to float32. Small shapes only.
# ---------------------------------------------------------------------------------------------
def _expert_of_row(group_sizes, m):
    """→ int32 [M]: each sorted row's expert; E for rows past sum(group_sizes) (they output 0)."""
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    return jnp.searchsorted(ends, jnp.arange(m), side="right").astype(jnp.int32)


def _per_row_expert_matmul(rows, weight, expert_of_row):
    """rows [R, K] f32 · weight[expert]ᵀ for each row's expert ([E, N, K] f32) → [R, N] f32; expert E gives 0.

    Computes every expert for every row and keeps the right one: E× the work, but no sort and no ragged op,
    so it shares no logic with the kernels.
    """
    e = weight.shape[0]
    every = jnp.einsum("rk,enk->ern", rows, weight, precision=lax.Precision.HIGHEST)  # [E, R, N]
    picked = jnp.take_along_axis(every, jnp.minimum(expert_of_row, e - 1)[None, :, None], axis=0)[0]  # [R, N]
    return jnp.where((expert_of_row < e)[:, None], picked, 0.0)


def _swiglu(gate, up, limit):
    """silu(min(gate, limit)) · clip(up, ±limit) (dsv4.moe.swiglu)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def _dequantize_operand(values, scales, block_shape):
    return values.astype(F32) if scales is None else dequantize_blocks(values, scales, block_shape)


@functools.partial(jax.jit, static_argnames=("limit", "out_dtype"))
def grouped_gate_up_reference(
    x_sorted: jax.Array,
    gate_up: jax.Array,
    group_sizes: jax.Array,
    *,
    limit: float,
    x_scales: jax.Array | None = None,
    gate_up_scales: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """`grouped_gate_up` from the spec (same arguments) → [M, I]: f32 products of the dequantized operands."""
    _check_grouped("grouped_gate_up_reference", x_sorted, gate_up, group_sizes, x_scales, gate_up_scales,
                   x_name="x_sorted", w_name="gate_up")  # fmt: skip
    inter = gate_up.shape[1] // 2
    x = _dequantize_operand(x_sorted, x_scales, (1, QUANT_BLOCK))  # [M, D]
    w = _dequantize_operand(gate_up, gate_up_scales, (QUANT_BLOCK, QUANT_BLOCK))  # [E, 2I, D]
    h = _per_row_expert_matmul(x, w, _expert_of_row(group_sizes, x.shape[0]))  # [M, 2I]
    return _swiglu(h[:, :inter], h[:, inter:], limit).astype(out_dtype or _default_out_dtype(x_sorted))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_down_reference(
    h: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
    *,
    h_scales: jax.Array | None = None,
    down_scales: jax.Array | None = None,
    row_weights: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """`grouped_down` from the spec (same arguments) → [M, D]."""
    _check_grouped("grouped_down_reference", h, down, group_sizes, h_scales, down_scales, x_name="h",
                   w_name="down")  # fmt: skip
    rows = _dequantize_operand(h, h_scales, (1, QUANT_BLOCK))  # [M, I]
    w = _dequantize_operand(down, down_scales, (QUANT_BLOCK, QUANT_BLOCK))  # [E, D, I]
    y = _per_row_expert_matmul(rows, w, _expert_of_row(group_sizes, h.shape[0]))  # [M, D]
    if row_weights is not None:
        y = y * row_weights.astype(F32)[:, None]
    return y.astype(out_dtype or _default_out_dtype(h))


# NOTE (the W8A8 reference on GPU, docs/kernels/moe.md): XLA:GPU runs SimplifyFPConversions
# by default (`xla_allow_excess_precision`), which folds any chain of float converts A → B → C into A → C, through
# the reshape between them. Inside one jit, dequantize(quantize(x)) = f32(fp8(x / s)) · s then comes back as x,
# unrounded, and h's bf16 rounding (f32 → bf16 → f32) goes too. The kernel path cannot lose them (its fp8 / bf16
# operands are pallas_call inputs), so on a GPU only the reference would skip the activation quantization, and W8A8
# would be off it by exactly the quantization error of x and h. The barrier keeps the rounded values real, as
# `KVStore.round_trip` does for the KV cache (dsv4/cache/quant.py).
def _fake_quantize(x: jax.Array) -> jax.Array:
    """x [R, K] → float32 dequantize(quantize_per_token_group(x)): the values the W8A8 kernels see, rounded to fp8
    even where XLA would fold the convert pair (the NOTE above)."""
    values, scales = quantize_per_token_group(x)
    return dequantize_blocks(lax.optimization_barrier(values), scales, (1, QUANT_BLOCK))


@functools.partial(jax.jit, static_argnames=("limit", "fp8_activations"))
def routed_experts_reference(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    limit: float,
    *,
    gate_up_scales: jax.Array | None = None,
    down_scales: jax.Array | None = None,
    fp8_activations: bool = True,
) -> jax.Array:
    """`routed_experts` from the spec (same arguments) → [N, D], per (token, k) pair without sorting.

    Same numerics as dsv4.moe.routed_experts_jnp: f32 products, SwiGLU in f32, h rounded to x.dtype, f32 weighted
    sum, one rounding at the end. With FP8 weights and fp8_activations, x and h go through the same per-token
    128-group quantization as the kernel path, so the two differ only in f32 summation order.
    """
    n, k = expert_ids.shape
    inter = gate_up.shape[1] // 2
    quantize_acts = gate_up.dtype == FP8 and fp8_activations
    e = gate_up.shape[0]
    ids = expert_ids.reshape(-1)  # [N·K], pair p = token p // K
    ids = jnp.where((ids >= 0) & (ids < e), ids, e)  # an id outside [0, E) contributes nothing
    xf = _fake_quantize(x) if quantize_acts else x.astype(F32)
    w1 = _dequantize_operand(gate_up, gate_up_scales, (QUANT_BLOCK, QUANT_BLOCK))  # [E, 2I, D]
    w2 = _dequantize_operand(down, down_scales, (QUANT_BLOCK, QUANT_BLOCK))  # [E, D, I]
    h = _per_row_expert_matmul(jnp.repeat(xf, k, axis=0), w1, ids)  # [N·K, 2I]
    h = lax.optimization_barrier(_swiglu(h[:, :inter], h[:, inter:], limit).astype(x.dtype))  # [N·K, I], rounded
    hf = _fake_quantize(h) if quantize_acts else h.astype(F32)
    y = _per_row_expert_matmul(hf, w2, ids) * weights.reshape(-1, 1).astype(F32)  # [N·K, D]
    return y.reshape(n, k, -1).sum(1).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------
def grouped_matmul_kernel(
    tiles_ref,  # [T, 3] int32: (expert, row_start, row_end) per row tile
    x_ref,  # [M, K] activations (bf16 / f16 / f32, or fp8)
    x_scales_ref,  # [K // 128, M] f32 per-token group scales (transposed: one row-tile load per K step) or None
    w_ref,  # [E, N_all, K] expert weights, output rows × reduction (bf16 / f16 / f32, or fp8)
    w_scales_ref,  # [E, N_all // 128, K // 128] f32 block scales or None
    row_weights_ref,  # [M] f32 per-row output scale or None
    out_init_ref,  # the aliased output buffer or None; never read
    o_ref,  # [M, N_out]
    *,
    num_experts: int,
    num_col_tiles: int,
    block_m: int,
    block_n: int,
    block_k: int,
    swiglu_limit: float | None,
):
    """One program: block_m sorted rows of one expert × block_n output columns, reduced over all of K.

    The 1-D grid runs column tiles fastest (program p = tile · num_col_tiles + col): concurrent programs share the
    row tile's x (read from HBM once) and walk one expert's weights. With `swiglu_limit` (gate_up) the program
    computes columns [c·bn, c·bn + bn) of the gate half (weight rows c·bn..) and of the up half (weight rows
    I + c·bn..) in two accumulators and stores silu(min(g, L)) · clip(u, ±L) to h[:, c·bn : c·bn + bn]; without it
    (down) one accumulator, times the row weight when given.
    """
    del out_init_ref
    n_all, k_all = w_ref.shape[1], w_ref.shape[2]
    tile, col = pl.program_id(0) // num_col_tiles, pl.program_id(0) % num_col_tiles
    expert, row_start, row_end = tiles_ref[tile, 0], tiles_ref[tile, 1], tiles_ref[tile, 2]
    rows = pl.ds(row_start, block_m)
    row_valid = row_start + jnp.arange(block_m) < row_end  # [bm]; all False past the real tile count
    # The zero group (expert == E, rows past sum(group_sizes)) and empty tiles run no K steps: acc stays 0.
    has_work = (row_end > row_start) & (expert < num_experts)
    expert = jnp.minimum(expert, num_experts - 1)  # keeps addresses in bounds; unused when not has_work
    x_fp8, w_fp8 = x_ref.dtype == FP8, w_ref.dtype == FP8
    compute_dtype = FP8 if x_fp8 else x_ref.dtype

    col_start = col * block_n
    band_starts = [col_start] if swiglu_limit is None else [col_start, n_all // 2 + col_start]  # (gate, up)

    def k_step(step, accs):
        k_start = step * block_k
        cols_k = pl.ds(k_start, block_k)
        # NOTE: no `other` for fp8 (the Triton lowering cannot cast the fill value to fp8); masked
        # rows then hold garbage, which stays in rows that are never stored (a row's result reads only its row).
        x = plgpu.load(x_ref.at[rows, cols_k], mask=row_valid[:, None], other=None if x_fp8 else 0)  # [bm, bk]
        if x_fp8:
            x_scale = plgpu.load(x_scales_ref.at[k_start // QUANT_BLOCK, rows], mask=row_valid, other=0.0)  # [bm]
        new = []
        for acc, n_start in zip(accs, band_starts, strict=True):
            w = plgpu.load(w_ref.at[expert, pl.ds(n_start, block_n), cols_k])  # [bn, bk], K contiguous
            if w_fp8 and not x_fp8:
                w = w.astype(compute_dtype)  # exact: every e4m3 value is a bf16 value
            part = lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                   preferred_element_type=F32)  # fmt: skip  # [bm, bn]
            if w_fp8:  # one 128 × 128 weight block covers this [bn, bk] tile (block_n, block_k divide 128)
                scale = w_scales_ref[expert, n_start // QUANT_BLOCK, k_start // QUANT_BLOCK]
                part = part * (x_scale[:, None] * scale if x_fp8 else scale)
            new.append(acc + part)
        return tuple(new)

    accs = tuple(jnp.zeros((block_m, block_n), F32) for _ in band_starts)
    accs = lax.fori_loop(0, has_work.astype(jnp.int32) * (k_all // block_k), k_step, accs)

    if swiglu_limit is None:
        out = accs[0]
        if row_weights_ref is not None:
            out = out * plgpu.load(row_weights_ref.at[rows], mask=row_valid, other=0.0)[:, None]
    else:
        gate, up = accs
        gate = jnp.minimum(gate, swiglu_limit)
        out = gate / (1.0 + jnp.exp(-gate)) * jnp.clip(up, -swiglu_limit, swiglu_limit)  # silu(g) · clip(u)
    plgpu.store(o_ref.at[rows, pl.ds(col_start, block_n)], out.astype(o_ref.dtype), mask=row_valid[:, None])


# ---------------------------------------------------------------------------------------------
# Triton lowering: 64-bit element offsets for arrays of more than 2^31 elements, fp8 accumulation.
# ---------------------------------------------------------------------------------------------
# NOTE (wide offsets): the Pallas Triton lowering computes a load's or store's element offsets in i32 unless the whole
# array is more than 2^32 *bytes*, so 1-byte arrays of 2^31 < elements <= 2^32 wrap negative past element 2^31. The
# fp8 gate_up of V4-Flash, [256, 2 · 2048, 4096] = 2^32 elements, is exactly that (every expert >= 128 faulted), and
# fp8 activations hit it from about 87K tokens (x_sorted) and 175K (h). `_jax_compat.install_wide_offsets` makes the
# lowering pick i64 for them; without it `_check_offsets_fit` refuses such operands. docs/kernels/moe.md.
_WIDE_OFFSETS = install_wide_offsets()

# NOTE (fp8 accumulation): Pallas emits `tt.dot` without maxNumImpreciseAcc (0), so Triton splits every fp8 dot on
# Hopper into 32-wide wgmmas, each added into an f32 partial sum in registers. This kernel already promotes each K
# step itself (fresh accumulator, block scales applied in f32), so the kernels named below get 2^30 (Triton's own
# `tl.dot` default on sm90) on their fp8 × fp8 dots; other Pallas kernels are left as lowered.
_FP8_FAST_ACCUM_KERNELS = ("grouped_gate_up", "grouped_down")  # pallas_call names (`BlockSizes.fp8_fast_accum`)
_FP8_FAST_ACCUM = install_fp8_fast_accum(_FP8_FAST_ACCUM_KERNELS)


def _check_offsets_fit(name, arrays, interpret):
    """Refuses, instead of faulting on the GPU, arrays past i32 offsets if the lowering fix could not be installed."""
    if interpret or _WIDE_OFFSETS:
        return
    for a in arrays:
        if a is not None and math.prod(a.shape) > I32_OFFSETS_MAX_ELEMENTS and jnp.dtype(a.dtype).itemsize < 4:
            raise ValueError(f"{name}: a {a.dtype} {a.shape} operand has more than 2^31 elements, which this jax's "
                             f"Pallas Triton lowering addresses with wrapping i32 offsets (docs/kernels/moe.md), and "
                             f"the dsv4 fix for it is not installed (dsv4.pallas._jax_compat)")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Public entries.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("num_rows", "block_m"))
def tile_map(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """Row tiles of the sorted rows, none straddling two experts. → int32 [T, 3]: (expert, row_start, row_end).

    group_sizes [E] int32: rows of expert e are [offset_e, offset_e + g_e) with offset = exclusive cumsum (negative
    sizes count as 0; groups are cut at num_rows). Rows past sum(g) form group E (the kernels write zeros there).
    Each group of size g becomes ceil(g / block_m) tiles starting at its offset. T is the static bound
    (M + (block_m - 1) · min(E + 1, M)) // block_m; tiles past the real count are (E, 0, 0), i.e. empty.
    """
    e = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), num_rows)  # [E]
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, ends.dtype)])  # [E + 1], the zero group last
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])  # [E + 1]
    tiles = (ends - starts + block_m - 1) // block_m  # [E + 1]
    tiles_end = jnp.cumsum(tiles)
    num_tiles = (num_rows + (block_m - 1) * min(e + 1, num_rows)) // block_m
    t = jnp.arange(num_tiles)
    group = jnp.searchsorted(tiles_end, t, side="right")  # [T], E + 1 for unused tiles
    used = group <= e
    group = jnp.minimum(group, e)
    row_start = starts[group] + (t - (tiles_end[group] - tiles[group])) * block_m
    row_end = jnp.minimum(row_start + block_m, ends[group])
    meta = jnp.stack([jnp.where(used, group, e), jnp.where(used, row_start, 0), jnp.where(used, row_end, 0)], -1)
    return meta.astype(jnp.int32)


def _grouped_matmul(x, weight, group_sizes, *, x_scales, weight_scales, row_weights, swiglu_limit, out_dtype,
                    block_sizes, interpret, out_init, name):  # fmt: skip
    m, k = x.shape
    e, n_all, _ = weight.shape
    n_out = n_all // 2 if swiglu_limit is not None else n_all
    w_fp8 = weight.dtype == FP8
    block_n, block_k = block_sizes.tile(n_out, k, fp8=w_fp8, what=f"{name}(x.shape={x.shape}, w.shape={weight.shape})")
    block_m = block_sizes.block_m
    if out_init is not None and (out_init.shape != (m, n_out) or out_init.dtype != out_dtype):
        raise ValueError(f"{name}: out_init must be {jnp.dtype(out_dtype)} {(m, n_out)}, "
                         f"got {out_init.dtype} {out_init.shape}")  # fmt: skip
    tiles = tile_map(group_sizes, num_rows=m, block_m=block_m)  # [T, 3]
    num_col_tiles = n_out // block_n
    x_scales_t = None if x_scales is None else x_scales.T  # [K // 128, M]: a row tile's scales are contiguous
    if row_weights is not None:
        row_weights = row_weights.astype(F32)

    def whole(a):
        return None if a is None else pl.BlockSpec(a.shape, lambda p, nd=a.ndim: (0,) * nd)

    args = (tiles, x, x_scales_t, weight, weight_scales, row_weights, out_init)
    _check_offsets_fit(name, (*args, jax.ShapeDtypeStruct((m, n_out), out_dtype)), interpret)
    kernel = functools.partial(
        grouped_matmul_kernel, num_experts=e, num_col_tiles=num_col_tiles, block_m=block_m, block_n=block_n,
        block_k=block_k, swiglu_limit=None if swiglu_limit is None else float(swiglu_limit),
    )  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(tiles.shape[0] * num_col_tiles,),
        in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((m, n_out), lambda p: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        # pallas_call numbers inputs after dropping the Nones
        input_output_aliases={} if out_init is None else {sum(a is not None for a in args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.warps(), num_stages=block_sizes.num_stages),
        interpret=interpret,
        name=name if block_sizes.fp8_fast_accum else f"{name}_fp8_promote32",  # see _FP8_FAST_ACCUM_KERNELS
    )(*args)


@functools.partial(jax.jit, static_argnames=("limit", "out_dtype", "block_sizes", "interpret"))
def grouped_gate_up(
    x_sorted: jax.Array,
    gate_up: jax.Array,
    group_sizes: jax.Array,
    *,
    limit: float,
    x_scales: jax.Array | None = None,
    gate_up_scales: jax.Array | None = None,
    out_dtype=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """h = silu(min(x·Wgᵀ, limit)) · clip(x·Wuᵀ, ±limit) per row's expert. → [M, I].

    x_sorted:       [M, D] rows sorted by expert (bf16 / f16 / f32, or float8_e4m3fn with x_scales)
    gate_up:        [E, 2I, D] checkpoint layout: rows 0..I-1 gate, I..2I-1 up (x's dtype, or float8_e4m3fn)
    group_sizes:    [E] int32 rows per expert, in order; rows past their sum output 0
    limit:          SwiGLU clamp (config.swiglu_limit)
    x_scales:       [M, D // 128] f32 per-token group scales, with fp8 x_sorted (W8A8)
    gate_up_scales: [E, 2I // 128, D // 128] f32 block scales, with fp8 gate_up (w = fp8 · scale)
    out_dtype:      default x's dtype (bfloat16 for fp8 x)
    block_sizes: tiles and launch parameters; interpret: run in the Pallas interpreter (CPU).
    out_init:    testing hook; the output buffer starts as this [M, I] array (aliased), so rows the kernel fails to
                 write keep its value (pass NaNs to poison).
    """
    _check_grouped("grouped_gate_up", x_sorted, gate_up, group_sizes, x_scales, gate_up_scales, x_name="x_sorted",
                   w_name="gate_up")  # fmt: skip
    return _grouped_matmul(x_sorted, gate_up, group_sizes, x_scales=x_scales, weight_scales=gate_up_scales,
                           row_weights=None, swiglu_limit=limit, out_dtype=out_dtype or _default_out_dtype(x_sorted),
                           block_sizes=block_sizes, interpret=interpret, out_init=out_init,
                           name="grouped_gate_up")  # fmt: skip


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def grouped_down(
    h: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
    *,
    h_scales: jax.Array | None = None,
    down_scales: jax.Array | None = None,
    row_weights: jax.Array | None = None,
    out_dtype=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """y = (h·Wdᵀ) per row's expert, times row_weights when given. → [M, D].

    h:           [M, I] rows sorted by expert (bf16 / f16 / f32, or float8_e4m3fn with h_scales)
    down:        [E, D, I] checkpoint layout (h's dtype, or float8_e4m3fn with down_scales [E, D // 128, I // 128])
    group_sizes: [E] int32; rows past their sum output 0
    h_scales:    [M, I // 128] f32 per-token group scales, with fp8 h (W8A8)
    row_weights: [M] routing weight of each sorted row (applied in f32 before the output rounding)
    out_dtype:   default h's dtype (bfloat16 for fp8 h); `routed_experts` asks for float32
    block_sizes, interpret, out_init: as in `grouped_gate_up` (out_init is [M, D]).
    """
    _check_grouped("grouped_down", h, down, group_sizes, h_scales, down_scales, x_name="h",
                   w_name="down")  # fmt: skip
    if row_weights is not None and row_weights.shape != (h.shape[0],):
        raise ValueError(f"grouped_down: row_weights.shape={row_weights.shape} must be (M,) = ({h.shape[0]},)")
    return _grouped_matmul(h, down, group_sizes, x_scales=h_scales, weight_scales=down_scales,
                           row_weights=row_weights, swiglu_limit=None, out_dtype=out_dtype or _default_out_dtype(h),
                           block_sizes=block_sizes, interpret=interpret, out_init=out_init,
                           name="grouped_down")  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=("limit", "fp8_activations", "block_sizes", "down_block_sizes", "interpret", "out_dtype", "impl"),
)
def routed_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    limit: float,
    *,
    gate_up_scales: jax.Array | None = None,
    down_scales: jax.Array | None = None,
    fp8_activations: bool = True,
    x_scales: jax.Array | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    down_block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    out_dtype=None,
    impl: str = "auto",
) -> jax.Array:
    """Dropless routed experts: sort pairs by expert → grouped_gate_up → grouped_down → weighted combine. → [N, D].

    x: [N, D]; expert_ids [N, K] int32; weights [N, K] (routing weights, scaling included);
    gate_up [E, 2I, D], down [E, D, I] in x's dtype, or float8_e4m3fn with gate_up_scales [E, 2I // 128, D // 128]
    and down_scales [E, D // 128, I // 128]. Same result as dsv4.moe.routed_experts_jnp.
    fp8_activations (FP8 weights only): quantize x and h per token per 128-group and multiply in fp8 (W8A8, as
    DeepSeek does); False keeps activations in x's dtype and upcasts weight tiles (W8A16).
    x_scales: x already quantized for W8A8 (x float8_e4m3fn, x_scales float32 [N, D // 128], as
    `quantize_per_token_group` gives): expert parallelism quantizes a token once where it lives and sends 1-byte
    values. The SwiGLU output h is then rounded to bf16 before its own quantization; out_dtype must be given.
    out_dtype: the result's dtype (default x's); expert parallelism asks for float32 partial sums.
    A pair whose id is outside [0, E) contributes nothing and costs no FLOPs (it sorts into the empty group).

    The combine is a gather (each token sums its K rows of y through the inverse permutation), not a scatter-add:
    deterministic and free of atomics. y stays float32 up to that sum, as in the reference.

    impl: "triton" (this file's kernels), "mgpu" (`moe_mgpu.routed_experts_mgpu`, the Mosaic GPU kernels for Hopper:
    bf16 / f16 or W8A8, D a multiple of 256 and I of 128; ValueError naming the reason otherwise; with interpret,
    the CPU Mosaic interpreter), or "auto": "mgpu" on a Hopper GPU for what it takes, with the default block sizes
    and not interpreted, else "triton".
    """
    if impl not in ("auto", "triton", "mgpu"):
        raise ValueError(f"routed_experts: impl={impl!r} must be 'auto', 'triton' or 'mgpu'")
    if x.ndim != 2 or expert_ids.ndim != 2 or weights.shape != expert_ids.shape or x.shape[0] != expert_ids.shape[0]:
        raise ValueError(f"routed_experts: expected x [N, D], expert_ids and weights [N, K], got x.shape={x.shape}, "
                         f"expert_ids.shape={expert_ids.shape}, weights.shape={weights.shape}")  # fmt: skip
    if expert_ids.dtype != jnp.int32:
        raise ValueError(f"routed_experts: expert_ids must be int32, got {expert_ids.dtype}")
    n, k = expert_ids.shape
    e, two_i, d = gate_up.shape
    prequantized = x.dtype == FP8
    if prequantized:
        if gate_up.dtype != FP8 or not fp8_activations:
            raise ValueError("routed_experts: x is float8_e4m3fn (pre-quantized), which only W8A8 takes (FP8 weights, "
                             f"fp8_activations=True); got weights {gate_up.dtype}, fp8_activations={fp8_activations}")
        if x_scales is None or x_scales.shape != (n, d // QUANT_BLOCK) or x_scales.dtype != F32:
            got = None if x_scales is None else f"{x_scales.dtype} {x_scales.shape}"
            raise ValueError(f"routed_experts: pre-quantized x needs x_scales float32 {(n, d // QUANT_BLOCK)}, "
                             f"got {got}")  # fmt: skip
        if out_dtype is None:
            raise ValueError("routed_experts: pre-quantized x needs out_dtype (x's own dtype is float8)")
    elif x_scales is not None:
        raise ValueError(f"routed_experts: x_scales given but x is {x.dtype}; x_scales go with float8_e4m3fn x")
    elif x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"routed_experts: x.dtype={x.dtype} must be bfloat16, float16 or float32 (or float8_e4m3fn "
                         "with x_scales)")  # fmt: skip
    if down.shape != (e, d, two_i // 2):
        raise ValueError(f"routed_experts: down.shape={down.shape} must be (E, D, I) = {(e, d, two_i // 2)} for "
                         f"gate_up.shape={gate_up.shape}")  # fmt: skip
    if n == 0:
        return jnp.zeros(x.shape, out_dtype or x.dtype)
    h_dtype = jnp.bfloat16 if prequantized else x.dtype  # the dtype h is rounded to (before quantizing, for W8A8)
    if impl != "triton":
        why = moe_mgpu.mgpu_moe_unsupported(d, two_i // 2, w_dtype=gate_up.dtype, x_dtype=h_dtype,
                                            fp8_activations=fp8_activations)  # fmt: skip
        if impl == "mgpu" and why:
            raise ValueError(f"routed_experts(impl='mgpu'): {why}")
        defaults = block_sizes == BlockSizes() and down_block_sizes is None
        if impl == "mgpu" or (not why and defaults and not interpret and is_hopper()):
            if down.dtype != gate_up.dtype:
                raise ValueError(f"routed_experts(impl='mgpu'): gate_up is {gate_up.dtype} but down is {down.dtype}")
            if gate_up.dtype == FP8:
                want = {"gate_up_scales": (e, two_i // QUANT_BLOCK, d // QUANT_BLOCK),
                        "down_scales": (e, d // QUANT_BLOCK, two_i // 2 // QUANT_BLOCK)}  # fmt: skip
                for name, scales in (("gate_up_scales", gate_up_scales), ("down_scales", down_scales)):
                    if scales is None or scales.shape != want[name] or scales.dtype != F32:
                        got = None if scales is None else f"{scales.dtype} {scales.shape}"
                        raise ValueError(f"routed_experts: FP8 weights need {name} float32 {want[name]}, got {got}")
            params = plmgpu.InterpretGPUParams() if interpret else None
            return moe_mgpu.routed_experts_mgpu(x, expert_ids, weights, gate_up, down, limit,
                                                gate_up_scales=gate_up_scales, down_scales=down_scales,
                                                x_scales=x_scales, interpret=params, out_dtype=out_dtype)  # fmt: skip
    w8a8 = gate_up.dtype == FP8 and down.dtype == FP8 and fp8_activations
    flat_ids = expert_ids.reshape(-1)  # [N·K]
    # An id outside [0, E) sorts last, past every group, into the zero group: it contributes nothing.
    flat_ids = jnp.where((flat_ids >= 0) & (flat_ids < e), flat_ids, e)
    order = jnp.argsort(flat_ids, stable=True)  # sorted row r is pair order[r]
    token_of_row = order // k  # [M = N·K]
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)  # [E]
    if w8a8:  # quantize the N tokens once, then gather fp8 rows (half the bytes of a bf16 gather)
        xq, xs = (x, x_scales) if prequantized else quantize_per_token_group(x)
        x_sorted, x_scales = xq[token_of_row], xs[token_of_row]  # [M, D], [M, D // 128]
    else:
        x_sorted, x_scales = x[token_of_row], None  # [M, D]
    h = grouped_gate_up(x_sorted, gate_up, group_sizes, limit=limit, x_scales=x_scales, gate_up_scales=gate_up_scales,
                        out_dtype=h_dtype, block_sizes=block_sizes, interpret=interpret)  # fmt: skip  # [M, I]
    h_scales = None
    if w8a8:
        h, h_scales = quantize_per_token_group(h)  # NOTE: could move into gate_up's epilogue (block_n = 128)
    y = grouped_down(h, down, group_sizes, h_scales=h_scales, down_scales=down_scales,
                     row_weights=weights.reshape(-1)[order], out_dtype=F32,
                     block_sizes=down_block_sizes or block_sizes, interpret=interpret)  # fmt: skip  # [M, D]
    row_of_pair = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))  # inverse permutation
    return y[row_of_pair].reshape(n, k, d).sum(1).astype(out_dtype or x.dtype)
