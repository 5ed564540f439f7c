"""DeepSeek-V4 prefill attention core as a Triton-lowered Pallas kernel, with its jnp reference.

The core, after projections and RoPE: one shared head `kv` that is both K and V, a per-head sink logit,
a causal sliding window over raw tokens, and optionally compressed entries (HCA: every causally complete
entry; CSA: the indexer's top-k picks per query). Layout of this file (see dsv4/pallas/README.md):

- `BlockSizes`              tile sizes and launch parameters (frozen, validated).
- `v4_attention_kernel`     the kernel body: one program = one (query block, batch row, head block).
- `v4_attention`            the public jitted entry: checks shapes/dtypes, computes per-block loop bounds,
                            calls `pl.pallas_call` (`interpret=True` runs it on CPU).
- `v4_attention_reference`  the spec in plain jnp (materialized mask), for tests.

NOTE: all heads share the single KV head (MQA), so a tile's matmul rows are (block_q tokens × block_h
heads), token-major: row r = t · block_h + h. One KV tile load then serves every head of every token in
the block, for both Q·Kᵀ and P·V (K = V). docs/kernels/attention.md has the reasoning.

FP8 KV: `kv` / `compressed` may be float8_e4m3fn with float32 scales, dequantized inside the kernel as
value = float32(fp8) · scale, rounded to q.dtype before the matmuls. Two scale layouts:
- per channel:          scales [D]                      value[b, t, d] = fp8[b, t, d] · s[d]
- per token, 64-tiles:  scales [B, T, D // 64]          value[b, t, d] = fp8[b, t, d] · s[b, t, d // 64]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv4.pallas.attention_common import (
    F32,
    FP8,
    LOG2E,
    M_FLOOR,
    MIN_DOT_DIM,
    SCALE_TILE,
    check_page_scales,
    is_power_of_2,
    load_values,
    online_softmax_step,
)

__all__ = ["SCALE_TILE", "BlockSizes", "v4_attention", "v4_attention_kernel", "v4_attention_reference"]

_DEFAULT_TILE_ROWS = 64  # rows (tokens × heads) per tile when block_q is left to the default


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of `v4_attention`.

    block_q:          query tokens per program. None: enough tokens for 64 tile rows
                      (block_q = max(1, 64 // block_h)); for H = 64 that is 1 token × 64 heads.
    block_h:          heads per program (clamped to H; must then divide H). Tile rows M = block_q · block_h.
    block_kv:         window KV rows per inner step (the band's start is not aligned to it).
    block_compressed: HCA compressed entries per inner step.
    block_topk:       CSA top-k slots per token per inner step (gathered in-kernel).
    num_warps, num_stages: Triton launch parameters (None: 8 warps for D >= 256, else 4; 2 stages).

    All sizes are powers of two (Triton tensor shapes must be); the KV-side blocks are >= 16 (`tl.dot`).
    Defaults: 128-row KV blocks with one pipeline stage, the fastest measured (docs/kernels/attention.md). A
    [128, 512] bf16 tile is 128 KiB of shared memory, so there is no room for a second stage.
    """

    block_q: int | None = None
    block_h: int = 64
    block_kv: int = 128
    block_compressed: int = 128
    block_topk: int = 128
    num_warps: int | None = None
    num_stages: int = 1

    def __post_init__(self):
        if self.block_q is not None and not is_power_of_2(self.block_q):
            raise ValueError(f"BlockSizes.block_q={self.block_q} must be None or a power of two")
        if not is_power_of_2(self.block_h):
            raise ValueError(f"BlockSizes.block_h={self.block_h} must be a power of two")
        for name in ("block_kv", "block_compressed", "block_topk"):
            value = getattr(self, name)
            if not is_power_of_2(value) or value < MIN_DOT_DIM:
                raise ValueError(f"BlockSizes.{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 1")

    def tile(self, num_heads: int) -> tuple[int, int]:
        """→ (block_q, block_h) for a model with `num_heads` heads."""
        block_h = min(self.block_h, num_heads)
        if num_heads % block_h:
            raise ValueError(f"BlockSizes.block_h={self.block_h} does not divide num_heads={num_heads}")
        block_q = self.block_q if self.block_q is not None else max(1, _DEFAULT_TILE_ROWS // block_h)
        return block_q, block_h


# FP8 KV (kv or compressed entries in float8_e4m3fn) with `block_sizes=None`: 64-row KV blocks, 2 stages. The bf16
# default's [128, 512] tiles do not fit once the FP8 tile and its bf16 upcast both live in shared memory (at 64
# heads x 512 Triton asks 320 KiB of the 227 KiB a block may have).
FP8_BLOCK_SIZES = BlockSizes(block_kv=64, block_compressed=64, block_topk=64, num_stages=2)


def default_block_sizes(kv_dtype, compressed_dtype=None) -> BlockSizes:
    """`v4_attention`'s tiles when none are given: `FP8_BLOCK_SIZES` if the kv or the compressed entries are FP8,
    else `BlockSizes()`."""
    fp8 = any(dt is not None and jnp.dtype(dt) == FP8 for dt in (kv_dtype, compressed_dtype))
    return FP8_BLOCK_SIZES if fp8 else BlockSizes()


# ---------------------------------------------------------------------------------------------
# Input checks shared by the kernel entry and the reference.
# ---------------------------------------------------------------------------------------------
def _check_inputs(
    q,
    kv,
    q_pos,
    kv_pos,
    sinks,
    *,
    sliding_window,
    compressed,
    compress_rate,
    topk_indices,
    kv_scales,
    compressed_scales,
    q_scale=None,
) -> tuple[str | None, str | None]:
    """Raises ValueError (with shapes) on malformed inputs; → (kv scale layout, compressed scale layout)."""
    if q.ndim != 4 or kv.ndim != 3:
        raise ValueError(f"expected q [B, S, H, D] and kv [B, T, D], got q.shape={q.shape}, kv.shape={kv.shape}")
    b, s, h, d = q.shape
    t = kv.shape[1]
    if kv.shape != (b, t, d) or t == 0:
        raise ValueError(f"kv.shape={kv.shape} must be (B, T, D) = ({b}, T >= 1, {d}) for q.shape={q.shape}")
    if q_pos.shape != (b, s) or q_pos.dtype != jnp.int32:
        raise ValueError(f"q_pos must be int32 [B, S] = ({b}, {s}), got {q_pos.dtype} {q_pos.shape}")
    if kv_pos.shape != (b, t) or kv_pos.dtype != jnp.int32:
        raise ValueError(f"kv_pos must be int32 [B, T] = ({b}, {t}), got {kv_pos.dtype} {kv_pos.shape}")
    if sinks.shape != (h,) or sinks.dtype != F32:
        raise ValueError(f"sinks must be float32 [H] = ({h},), got {sinks.dtype} {sinks.shape}")
    if q.dtype not in (jnp.bfloat16, jnp.float16, F32):
        raise ValueError(f"q.dtype={q.dtype} must be bfloat16, float16 or float32")
    if kv.dtype not in (q.dtype, FP8):
        raise ValueError(f"kv.dtype={kv.dtype} must be q.dtype={q.dtype} or float8_e4m3fn")
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int")
    if q_scale is not None and (q_scale.shape != (b, s, h) or q_scale.dtype != F32):
        raise ValueError(f"q_scale must be float32 [B, S, H] = ({b}, {s}, {h}), got {q_scale.dtype} {q_scale.shape}")
    kv_layout = check_page_scales("kv_scales", kv_scales, kv, "kv")
    compressed_layout = None
    if compressed is None:
        if compress_rate is not None or topk_indices is not None or compressed_scales is not None:
            raise ValueError("compress_rate / topk_indices / compressed_scales given without compressed")
    else:
        c = compressed.shape[1] if compressed.ndim == 3 else 0
        if compressed.shape != (b, c, d) or c == 0:
            raise ValueError(f"compressed.shape={compressed.shape} must be (B, C >= 1, D) = ({b}, C, {d})")
        if compressed.dtype not in (q.dtype, FP8):
            raise ValueError(f"compressed.dtype={compressed.dtype} must be q.dtype={q.dtype} or float8_e4m3fn")
        if topk_indices is None:
            if not isinstance(compress_rate, int) or compress_rate < 1:
                raise ValueError(f"HCA mode (no topk_indices) needs compress_rate >= 1, got {compress_rate!r}")
        elif topk_indices.ndim != 3 or topk_indices.shape[:2] != (b, s) or topk_indices.dtype != jnp.int32:
            raise ValueError(f"topk_indices must be int32 [B, S, K] with (B, S) = ({b}, {s}), "
                             f"got {topk_indices.dtype} {topk_indices.shape}")  # fmt: skip
        elif topk_indices.shape[2] == 0:
            raise ValueError(f"topk_indices.shape={topk_indices.shape} has K = 0")
        compressed_layout = check_page_scales("compressed_scales", compressed_scales, compressed, "compressed")
    return kv_layout, compressed_layout


# ---------------------------------------------------------------------------------------------
# Reference: the spec, with the mask materialized. Fine for small shapes only.
# ---------------------------------------------------------------------------------------------
def _dequantize_reference(values, scales, dtype):
    """values [B, N, D] (maybe FP8) → [B, N, D] in `dtype`."""
    if scales is None:
        return values.astype(dtype)
    if scales.ndim == 1:  # per channel [D]
        full = scales[None, None, :]
    else:  # per token and 64-channel tile [B, N, D // 64]
        full = jnp.repeat(scales, SCALE_TILE, axis=-1)  # [B, N, D]
    return (values.astype(F32) * full).astype(dtype)


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "compress_rate"))
def v4_attention_reference(
    q: jax.Array,
    kv: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    sinks: jax.Array,
    *,
    sliding_window: int,
    scale: float,
    compressed: jax.Array | None = None,
    compress_rate: int | None = None,
    topk_indices: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    compressed_scales: jax.Array | None = None,
    q_scale: jax.Array | None = None,
) -> jax.Array:
    """V4 attention core, straight from the spec (same arguments as `v4_attention`). → [B, S, H, D].

    Numerics follow the model's jnp path (dsv4/attention.py `core_attention_jnp`): f32 logits, the sink
    joins the row max, unnormalized probabilities are rounded to the value dtype for P·V (f32 accumulate),
    and the sum is divided by the f32 denominator at the end. FP8 values are dequantized to q.dtype first.
    """
    _check_inputs(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, compressed=compressed,
                  compress_rate=compress_rate, topk_indices=topk_indices, kv_scales=kv_scales,
                  compressed_scales=compressed_scales, q_scale=q_scale)  # fmt: skip
    keys = _dequantize_reference(kv, kv_scales, q.dtype)  # [B, T, D]
    pos, kpos = q_pos[:, :, None], kv_pos[:, None, :]
    mask = (kpos >= 0) & (kpos <= pos) & (kpos > pos - sliding_window)  # [B, S, T]
    if compressed is not None:
        entries = _dequantize_reference(compressed, compressed_scales, q.dtype)  # [B, C, D]
        c = entries.shape[1]
        ids = jnp.arange(c)
        if topk_indices is None:  # HCA: causally complete entries
            cmask = ids[None, None, :] < ((q_pos + 1) // compress_rate)[:, :, None]  # [B, S, C]
        else:  # CSA: the listed entries; -1 (and anything outside [0, C)) lists nothing
            cmask = jnp.any(topk_indices[:, :, :, None] == ids, axis=2)  # [B, S, C]
        keys = jnp.concatenate([keys, entries], axis=1)  # [B, T + C, D]
        mask = jnp.concatenate([mask, cmask], axis=2)  # [B, S, T + C]
    logits = jnp.einsum("bshd,btd->bsht", q, keys, preferred_element_type=F32) * scale  # [B, S, H, T(+C)]
    if q_scale is not None:
        logits = logits * q_scale[..., None]
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    row_max = jnp.maximum(logits.max(-1), sinks)  # [B, S, H]
    row_max = jnp.maximum(row_max, M_FLOOR)  # only matters for a -inf sink on a row with no keys
    probs = jnp.exp(logits - row_max[..., None])  # unnormalized, [B, S, H, T(+C)]
    denom = probs.sum(-1) + jnp.exp(sinks - row_max)  # [B, S, H]
    out = jnp.einsum("bsht,btd->bshd", probs.astype(keys.dtype), keys, preferred_element_type=F32)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------
def v4_attention_kernel(
    q_ref,  # [block_q, block_h, D]
    q_pos_ref,  # [block_q]
    meta_ref,  # [4]: window rows [lo, hi), visible HCA entries, top-k slots in use
    sinks_ref,  # [block_h]
    q_scale_ref,  # [block_q, block_h] float32 or None
    kv_ref,  # [T, D]
    kv_pos_ref,  # [T]
    kv_scales_ref,  # [D] or [T, D // 64] or None
    compressed_ref,  # [C, D] or None
    compressed_scales_ref,  # [D] or [C, D // 64] or None
    topk_ref,  # [block_q, K] or None
    out_init_ref,  # the aliased output buffer or None; never read
    o_ref,  # [block_q, block_h, D]
    *,
    seq_len: int,
    sliding_window: int,
    scale: float,
    compress_rate: int | None,
    kv_scale_layout: str | None,
    compressed_scale_layout: str | None,
    block_kv: int,
    block_compressed: int,
    block_topk: int,
):
    """One program: block_q query tokens × block_h heads of one batch row, against all their keys.

    The tile is flattened to M = block_q · block_h rows (token-major) so that every matmul is [M, D] × [D, N]
    against one shared KV block. The softmax state starts at the sink: row_max = sink, row_sum = exp(sink - row_max)
    = 1, acc = 0, so a row that sees no key ends as 0 and masked logits (-inf) never meet a -inf running max.
    """
    del out_init_ref
    block_q, block_h, head_dim = q_ref.shape
    rows = block_q * block_h
    compute_dtype = q_ref.dtype
    kv_len = kv_ref.shape[0]

    token = pl.program_id(0) * block_q + jnp.arange(block_q)  # [block_q]
    token_valid = token < seq_len  # the last query block may overhang S
    q = plgpu.load(q_ref, mask=token_valid[:, None, None], other=0)  # [block_q, block_h, D]
    q = q.reshape(rows, head_dim)  # [M, D], row = t * block_h + h
    q_pos = plgpu.load(q_pos_ref, mask=token_valid, other=-1)  # [block_q]
    row_pos = jnp.broadcast_to(q_pos[:, None], (block_q, block_h)).reshape(rows)  # [M]
    sinks = jnp.broadcast_to(sinks_ref[...][None, :], (block_q, block_h)).reshape(rows)  # [M]

    logit_scale = scale * LOG2E
    if q_scale_ref is not None:  # q's inverse RMS folded into each row's logit scale (the sink is not scaled)
        q_scale = plgpu.load(q_scale_ref, mask=token_valid[:, None], other=1.0)  # [block_q, block_h]
        logit_scale = logit_scale * q_scale.reshape(rows)[:, None]  # [M, 1]

    row_max = jnp.maximum(sinks * LOG2E, M_FLOOR)  # [M], log2 domain
    row_sum = jnp.exp2(sinks * LOG2E - row_max)  # [M], the sink's own term
    acc = jnp.zeros((rows, head_dim), F32)  # [M, D]
    step = functools.partial(online_softmax_step, logit_scale=logit_scale, compute_dtype=compute_dtype)
    carry = (acc, row_max, row_sum)

    # (a) Window: the band of kv rows [lo, hi) the wrapper found for this block, in steps of block_kv rows
    # starting at lo (not at a block_kv multiple, so a 1-token block with W = 128 is exactly 128 rows).
    kv_lo, kv_hi = meta_ref[0], meta_ref[1]

    def window_body(i, carry):
        start = kv_lo + i * block_kv
        kv_row = start + jnp.arange(block_kv)  # [N]
        in_bounds = kv_row < kv_len
        kv_pos = plgpu.load(kv_pos_ref.at[pl.ds(start, block_kv)], mask=in_bounds, other=-1)  # [N]
        keys = load_values(kv_ref, kv_scales_ref, kv_scale_layout, pl.ds(start, block_kv), in_bounds,
                            compute_dtype)  # fmt: skip  # [N, D]
        kp, qp = kv_pos[None, :], row_pos[:, None]
        mask = (kp >= 0) & (kp <= qp) & (kp > qp - sliding_window)  # [M, N]
        return step(carry, q, keys, mask)

    carry = lax.fori_loop(0, lax.div(kv_hi - kv_lo + block_kv - 1, block_kv), window_body, carry)

    if compressed_ref is not None and topk_ref is None:
        # (b) HCA: entries [0, meta[2]) cover what the block's last query sees; each row masks its own limit.
        num_compressed = compressed_ref.shape[0]
        visible = lax.div(jnp.maximum(row_pos + 1, 0), compress_rate)  # [M]

        def hca_body(i, carry):
            start = i * block_compressed
            entry = start + jnp.arange(block_compressed)  # [N]
            in_bounds = entry < num_compressed
            keys = load_values(compressed_ref, compressed_scales_ref, compressed_scale_layout,
                                pl.ds(start, block_compressed), in_bounds, compute_dtype)  # fmt: skip  # [N, D]
            mask = in_bounds[None, :] & (entry[None, :] < visible[:, None])  # [M, N]
            return step(carry, q, keys, mask)

        n_steps = lax.div(meta_ref[2] + block_compressed - 1, block_compressed)
        carry = lax.fori_loop(0, n_steps, hca_body, carry)

    if topk_ref is not None:
        # (c) CSA: per step, gather block_topk listed entries of each of the block_q tokens ([block_q · block_topk]
        # rows) and mask the matmul block-diagonally (row token == column token). With block_q = 1 (H >= 64)
        # nothing is wasted; with block_q > 1 the Q·Kᵀ does block_q× the useful work (small-H models only).
        num_compressed, topk = compressed_ref.shape[0], topk_ref.shape[1]
        cols = block_q * block_topk
        row_token = jnp.broadcast_to(jnp.arange(block_q)[:, None], (block_q, block_h)).reshape(rows)  # [M]
        col_token = jnp.broadcast_to(jnp.arange(block_q)[:, None], (block_q, block_topk)).reshape(cols)  # [N]

        def csa_body(i, carry):
            slot = i * block_topk + jnp.arange(block_topk)  # [block_topk]
            load_mask = token_valid[:, None] & (slot < topk)[None, :]
            idx = plgpu.load(topk_ref.at[:, pl.ds(i * block_topk, block_topk)], mask=load_mask,
                             other=-1)  # fmt: skip  # [block_q, block_topk]
            valid = ((idx >= 0) & (idx < num_compressed)).reshape(cols)  # [N]
            idx = jnp.where(valid, idx.reshape(cols), 0)  # [N]
            keys = load_values(compressed_ref, compressed_scales_ref, compressed_scale_layout, idx, valid,
                                compute_dtype)  # fmt: skip  # [N, D]
            mask = (row_token[:, None] == col_token[None, :]) & valid[None, :]  # [M, N]
            return step(carry, q, keys, mask)

        n_steps = lax.div(meta_ref[3] + block_topk - 1, block_topk)
        carry = lax.fori_loop(0, n_steps, csa_body, carry)

    acc, _, row_sum = carry
    out = acc * jnp.where(row_sum > 0, 1.0 / row_sum, 0.0)[:, None]  # 0 only for a -inf sink on a keyless row
    out = out.reshape(block_q, block_h, head_dim).astype(o_ref.dtype)
    plgpu.store(o_ref, out, mask=token_valid[:, None, None])


# ---------------------------------------------------------------------------------------------
# Public entry.
# ---------------------------------------------------------------------------------------------
def _block_metadata(q_pos, kv_pos, *, block_q, sliding_window, compressed_len, compress_rate, topk_indices):
    """Per (batch row, query block) loop bounds. → int32 [B, nQ, 4]: (kv_lo, kv_hi, hca_entries, topk_slots).

    Window: kv rows whose position can be in some valid query's window form one index range [lo, hi) when the
    valid rows of kv_pos are sorted by position (-1 slots anywhere); it is found by binary search on the
    running max of kv_pos. A batch row whose valid kv_pos are not sorted falls back to all T rows (correct,
    slower). Queries with q_pos < 0 see no window/HCA key and do not widen the band.
    """
    b, s = q_pos.shape
    t = kv_pos.shape[1]
    n_blocks = pl.cdiv(s, block_q)
    qp = jnp.pad(q_pos, ((0, 0), (0, n_blocks * block_q - s)), constant_values=-1).reshape(b, n_blocks, block_q)
    valid = qp >= 0
    any_valid = valid.any(-1)  # [B, nQ]
    p_min = jnp.where(valid, qp, jnp.iinfo(jnp.int32).max).min(-1)  # [B, nQ]
    p_max = jnp.where(valid, qp, -1).max(-1)  # [B, nQ]

    running_max = lax.cummax(kv_pos, axis=1)  # [B, T], non-decreasing
    is_sorted = jnp.all((kv_pos < 0) | (kv_pos >= running_max), axis=1)  # [B]
    search = jax.vmap(functools.partial(jnp.searchsorted, side="right"))
    lo = search(running_max, p_min - sliding_window)  # first row with position > p_min - W
    hi = search(running_max, p_max)  # first row with position > p_max
    lo = jnp.where(is_sorted[:, None], lo, 0)
    hi = jnp.where(is_sorted[:, None], hi, t)
    lo, hi = jnp.where(any_valid, lo, 0), jnp.where(any_valid, jnp.maximum(hi, lo), 0)

    hca = jnp.zeros_like(lo)
    if compress_rate is not None and topk_indices is None:
        hca = jnp.where(any_valid, jnp.clip((p_max + 1) // compress_rate, 0, compressed_len), 0)
    slots = jnp.zeros_like(lo)
    if topk_indices is not None:
        k = topk_indices.shape[2]
        used = jnp.where(topk_indices >= 0, jnp.arange(1, k + 1), 0).max(-1)  # [B, S]: last listed slot + 1
        used = jnp.pad(used, ((0, 0), (0, n_blocks * block_q - s)))
        slots = used.reshape(b, n_blocks, block_q).max(-1)
    return jnp.stack([lo, hi, hca, slots], axis=-1).astype(jnp.int32)  # [B, nQ, 4]


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "compress_rate", "block_sizes", "interpret"))
def v4_attention(
    q: jax.Array,
    kv: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    sinks: jax.Array,
    *,
    sliding_window: int,
    scale: float,
    compressed: jax.Array | None = None,
    compress_rate: int | None = None,
    topk_indices: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    compressed_scales: jax.Array | None = None,
    q_scale: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """DeepSeek-V4 attention core (window + optional HCA / CSA compressed entries + sink). → [B, S, H, D].

    q:       [B, S, H, D] (bf16 / f16 / f32; D a power of two >= 16)
    kv:      [B, T, D]    the one shared head, both K and V (q.dtype, or float8_e4m3fn with kv_scales)
    q_pos:   [B, S] int32 global query positions
    kv_pos:  [B, T] int32 global kv positions, -1 = empty slot. Fast path: valid rows sorted by position.
    sinks:   [H] float32 per-head sink logit (in the softmax denominator, no value)
    sliding_window: query at p sees kv row j iff kv_pos[j] >= 0 and p - sliding_window < kv_pos[j] <= p
    scale:   logit scale
    compressed: [B, C, D] compressed entries or None (q.dtype, or FP8 with compressed_scales)
    compress_rate: HCA mode (topk_indices None): query at p sees entry c iff c < (p + 1) // compress_rate.
               Not used in CSA mode.
    topk_indices: [B, S, K] int32, CSA mode: query s sees the listed entries (distinct; -1 = none; entries
               outside [0, C) are ignored). The list is taken as is: no causal check.
    kv_scales / compressed_scales: float32 [D] (per channel) or [B, N, D // 64] (per token, 64-channel tiles).
    q_scale: float32 [B, S, H] or None: each (token, head)'s logits also times its factor (q's inverse RMS,
               `Kernels.q_norm` "fold"), as for queries q · q_scale but without rounding those to q's dtype.
    block_sizes: tiles and launch parameters (None: `default_block_sizes`, i.e. `BlockSizes()`, or
               `FP8_BLOCK_SIZES` for FP8 kv / compressed entries); interpret: run the kernel in the Pallas
               interpreter (CPU).
    out_init: testing hook; the output buffer starts as this [B, S, H, D] array (aliased), so any element the
               kernel fails to write keeps its value (pass NaNs to poison).

    Grid (nQ, B, H // block_h), query blocks first (the launch's x axis, the only one not capped at 65535).
    """
    kv_layout, compressed_layout = _check_inputs(
        q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, compressed=compressed,
        compress_rate=compress_rate, topk_indices=topk_indices, kv_scales=kv_scales,
        compressed_scales=compressed_scales, q_scale=q_scale,
    )  # fmt: skip
    b, s, h, d = q.shape
    t = kv.shape[1]
    if not is_power_of_2(d) or d < MIN_DOT_DIM:
        raise ValueError(f"head dim D={d} (q.shape={q.shape}) must be a power of two >= {MIN_DOT_DIM}")
    if block_sizes is None:
        block_sizes = default_block_sizes(kv.dtype, None if compressed is None else compressed.dtype)
    block_q, block_h = block_sizes.tile(h)
    if not interpret and block_q * block_h < MIN_DOT_DIM:
        raise ValueError(f"tile rows block_q * block_h = {block_q} * {block_h} < {MIN_DOT_DIM} for q.shape={q.shape}")
    if out_init is not None and (out_init.shape != q.shape or out_init.dtype != q.dtype):
        raise ValueError(f"out_init must be {q.dtype} {q.shape}, got {out_init.dtype} {out_init.shape}")
    c = 0 if compressed is None else compressed.shape[1]
    hca_rate = compress_rate if topk_indices is None else None

    meta = _block_metadata(q_pos, kv_pos, block_q=block_q, sliding_window=sliding_window, compressed_len=c,
                           compress_rate=hca_rate, topk_indices=topk_indices)  # fmt: skip  # [B, nQ, 4]
    grid = (pl.cdiv(s, block_q), b, h // block_h)

    def scale_spec(layout, n):
        if layout == "channel":
            return pl.BlockSpec((d,), lambda i, j, k: (0,))
        if layout == "tile":
            return pl.BlockSpec((None, n, d // SCALE_TILE), lambda i, j, k: (j, 0, 0))
        return None

    out_spec = pl.BlockSpec((None, block_q, block_h, d), lambda i, j, k: (j, i, k, 0))
    topk_spec = None
    if topk_indices is not None:
        topk_spec = pl.BlockSpec((None, block_q, topk_indices.shape[2]), lambda i, j, k: (j, i, 0))
    in_specs = [
        out_spec,  # q
        pl.BlockSpec((None, block_q), lambda i, j, k: (j, i)),  # q_pos
        pl.BlockSpec((None, None, 4), lambda i, j, k: (j, i, 0)),  # meta
        pl.BlockSpec((block_h,), lambda i, j, k: (k,)),  # sinks
        None if q_scale is None else pl.BlockSpec((None, block_q, block_h), lambda i, j, k: (j, i, k)),
        pl.BlockSpec((None, t, d), lambda i, j, k: (j, 0, 0)),  # kv
        pl.BlockSpec((None, t), lambda i, j, k: (j, 0)),  # kv_pos
        scale_spec(kv_layout, t),  # kv_scales
        None if compressed is None else pl.BlockSpec((None, c, d), lambda i, j, k: (j, 0, 0)),
        scale_spec(compressed_layout, c),  # compressed_scales
        topk_spec,
        None if out_init is None else out_spec,
    ]
    args = (q, q_pos, meta, sinks, q_scale, kv, kv_pos, kv_scales, compressed, compressed_scales, topk_indices,
            out_init)
    kernel = functools.partial(
        v4_attention_kernel, seq_len=s, sliding_window=sliding_window, scale=float(scale),
        compress_rate=hca_rate, kv_scale_layout=kv_layout, compressed_scale_layout=compressed_layout,
        block_kv=block_sizes.block_kv, block_compressed=block_sizes.block_compressed,
        block_topk=block_sizes.block_topk,
    )  # fmt: skip
    num_warps = block_sizes.num_warps or (8 if d >= 256 else 4)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        # pallas_call numbers inputs after dropping the Nones
        input_output_aliases={} if out_init is None else {sum(a is not None for a in args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="v4_attention",
    )(*args)
