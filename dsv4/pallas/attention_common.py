"""What the attention kernels share: prefill (`attention.py`, `attention_mgpu.py`) and paged decode (`decode.py`,
`decode_mgpu.py`), Triton and Mosaic GPU alike; the paged indexer (`indexer_paged.py`) reads its rows through the
paged loaders here too. Design notes: docs/kernels/attention.md and docs/kernels/decode.md.

- constants and shape rules (FP8 scale tiles, the softmax floor, Triton's 16-wide `tl.dot`, Mosaic's 64-head CTA);
- Triton: the dequantizing row loaders and the log2-domain online-softmax step. NOTE: the prefill and decode
  kernels share them on purpose: they must round identically (FP8 → q.dtype, P → q.dtype for P·V, exp2);
- paged caches: the decode input checks, the paged scale / RoPE-page checks, the reference gather, and the exact
  flash-decoding combine of per-split softmax states;
- Mosaic GPU: the warpgroup pieces of the two-consumer kernels (the logit exchange, the online-softmax step on a
  WGMMA tile, the P·V forms).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as pltriton

from dsv4.pallas._device import sm_count as device_sm_count

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
SCALE_TILE = 64  # channels per scale in the per-token-tile FP8 layout
LOG2E = math.log2(math.e)
# Floor for the running max: keeps every exp2 argument finite even when a sink is -inf.
M_FLOOR = -1e30
# NOTE: `tl.dot` needs every matmul dimension >= 16, so compiled (non-interpret) tiles must have >= 16 rows.
MIN_DOT_DIM = 16
HEADS_PER_CTA = 64  # Mosaic kernels: M of every wgmma, one token × 64 heads
SMEM_LIMIT = 227 * 1024  # shared memory per block on Hopper


def is_power_of_2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def smem_tiling(minor: int, itemsize: int):
    """Mosaic SMEM transforms of a [rows, minor] tile: (8, minor) tiling and a minor · itemsize-byte swizzle."""
    return plmgpu.TilingTransform((8, minor)), plmgpu.SwizzleTransform(minor * itemsize)


# ---------------------------------------------------------------------------------------------
# Triton: row loads and the online-softmax step.
# ---------------------------------------------------------------------------------------------
def load_values(ref, scales_ref, scale_layout, rows, row_valid, compute_dtype):
    """Loads value rows and dequantizes them to `compute_dtype`.

    ref: [N_all, D] (maybe FP8). rows: a `pl.ds` (contiguous rows) or int32 [N] (gather). row_valid: [N].
    → [N, D]; invalid rows are 0.
    """
    d = ref.shape[-1]
    # NOTE: the Triton lowering cannot cast an `other` fill value to FP8, so FP8 rows are zeroed after the upcast.
    other = None if scale_layout is not None else 0
    if isinstance(rows, pl.Slice):
        raw = pltriton.load(ref.at[rows, :], mask=row_valid[:, None], other=other)  # [N, D]
    else:  # NOTE: two array indexers (not array + slice): the interpreter only gathers with all-array indices.
        raw = pltriton.load(ref.at[rows[:, None], jnp.arange(d)[None, :]], mask=row_valid[:, None], other=other)
    if scale_layout is None:
        return raw
    values = jnp.where(row_valid[:, None], raw.astype(F32), 0.0)  # [N, D]
    if scale_layout == "channel":
        values = values * scales_ref[...][None, :]  # [N, D] · [1, D]
    else:
        n, groups = row_valid.shape[0], d // SCALE_TILE
        if isinstance(rows, pl.Slice):
            s = pltriton.load(scales_ref.at[rows, :], mask=row_valid[:, None], other=0)  # [N, D // 64]
        else:
            s = pltriton.load(scales_ref.at[rows[:, None], jnp.arange(groups)[None, :]], mask=row_valid[:, None],
                              other=0)  # fmt: skip
        s = jnp.broadcast_to(s[:, :, None], (n, groups, SCALE_TILE)).reshape(n, d)  # [N, D]
        values = values * s
    return values.astype(compute_dtype)


def online_softmax_step(carry, q, keys, mask, *, logit_scale, compute_dtype):
    """One online-softmax update (log2 domain) of the tile state with a block of keys.

    carry: (acc [M, D] f32, row_max [M] f32, row_sum [M] f32), log2 domain; q: [M, D]; keys: [N, D] (K = V);
    mask: [M, N] bool.
    """
    acc, row_max, row_sum = carry
    s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=F32)  # fmt: skip  # [M, N]
    s = jnp.where(mask, s * logit_scale, -jnp.inf)
    max_next = jnp.maximum(row_max, s.max(axis=1))  # [M]; never -inf: starts at max(sink, M_FLOOR)
    alpha = jnp.exp2(row_max - max_next)  # [M]
    p = jnp.exp2(s - max_next[:, None])  # [M, N]
    row_sum = row_sum * alpha + p.sum(axis=1)
    pv = jnp.dot(p.astype(compute_dtype), keys, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    acc = acc * alpha[:, None] + pv  # [M, D]
    return acc, max_next, row_sum


# ---------------------------------------------------------------------------------------------
# Paged caches: checks, the reference gather, row loads, and the split combine.
# ---------------------------------------------------------------------------------------------
def default_num_splits(programs: int, max_blocks: int, sm_count: int | None = None) -> int:
    """Key-axis splits for `programs` (request, head-block) pairs with at most `max_blocks` key blocks each.

    One program holds a [64, 512] float32 accumulator, so one fits an SM at a time: aim for one full wave,
    splits = floor(SMs / programs) (at least 1, at most one per key block). Rounding down, not up: 32 requests on
    132 SMs take 4 splits (128 programs, one wave), where 5 would spill 28 programs into a second wave; and each
    split adds a [H, D] float32 partial that is written and read back by the combine.
    """
    sm_count = device_sm_count() if sm_count is None else sm_count
    return max(1, min(sm_count // max(programs, 1), max_blocks))


def check_page_scales(name, scales, pages, pages_name, *, mixed=False) -> str | None:
    """Validates FP8 scales for rows [P, R, n] (pages, or a dense array [B, N, D]); → "channel", "tile" or None
    (not FP8). mixed: the pages hold only a row's first n channels (its RoPE channels are in their own pages), and
    a short last tile is fine."""
    p, page_size, d = pages.shape
    if pages.dtype != FP8:
        if scales is not None:
            raise ValueError(f"{name} given but {pages_name} is {pages.dtype}, not float8_e4m3fn")
        return None
    if scales is None:
        raise ValueError(f"{pages_name} is float8_e4m3fn {pages.shape}; {name} is required")
    if scales.dtype != F32:
        raise ValueError(f"{name} must be float32, got {scales.dtype}")
    if scales.shape == (d,):
        return "channel"
    tiles = -(-d // SCALE_TILE)
    if (mixed or d % SCALE_TILE == 0) and scales.shape == (p, page_size, tiles):
        return "tile"
    raise ValueError(
        f"{name}.shape={scales.shape} fits neither per-channel ({d},) nor per-token-tile "
        f"({p}, {page_size}, {tiles}) ({'' if mixed else f'D % {SCALE_TILE} == 0, '}one scale per {SCALE_TILE} "
        f"channels) for {pages_name}.shape={pages.shape}"
    )


def check_rope_pages(rope, pages, d, rope_name, pages_name) -> None:
    """A split row: pages [P, ps, D - Dr] FP8 (the nope channels) beside rope [P, ps, Dr] (the RoPE channels)."""
    if pages.dtype != FP8:
        raise ValueError(f"{rope_name} given, so {pages_name} must hold the FP8 nope channels; got {pages.dtype}")
    if rope.ndim != 3 or rope.shape[:2] != pages.shape[:2] or rope.shape[2] < 1 or pages.shape[2] + rope.shape[2] != d:
        raise ValueError(f"{rope_name}.shape={rope.shape} must be ({pages.shape[0]}, {pages.shape[1]}, Dr) with "
                         f"{pages_name}.shape[2] + Dr = D = {d} ({pages_name}.shape={pages.shape})")  # fmt: skip
    if rope.dtype not in (jnp.bfloat16, jnp.float16, F32):
        raise ValueError(f"{rope_name}.dtype={rope.dtype} must be bfloat16, float16 or float32")
    if not is_power_of_2(rope.shape[2]):
        raise ValueError(f"{rope_name}.shape={rope.shape}: Dr = {rope.shape[2]} must be a power of two (a Triton tile)")


def check_decode_inputs(q, kv_pages, block_tables, seq_lens, sinks, *, sliding_window, ring_size, compressed_pages,
                  compressed_block_tables, compressed_lens, topk_indices, kv_scales, compressed_scales,
                  kv_rope_pages=None, compressed_rope_pages=None):  # fmt: skip
    """Raises ValueError (with shapes) on malformed inputs; → (ring_size, kv scale layout, compressed scale layout)."""
    if q.ndim != 3 or kv_pages.ndim != 3:
        raise ValueError(f"expected q [B, H, D] and kv_pages [P, page_size, D], got q.shape={q.shape}, "
                         f"kv_pages.shape={kv_pages.shape}")  # fmt: skip
    b, h, d = q.shape
    page_size = kv_pages.shape[1]
    if kv_rope_pages is not None:
        check_rope_pages(kv_rope_pages, kv_pages, d, "kv_rope_pages", "kv_pages")
    elif kv_pages.shape[2] != d:
        raise ValueError(f"kv_pages.shape={kv_pages.shape} must be (P >= 1, page_size >= 1, D = {d})")
    if kv_pages.shape[0] == 0 or page_size == 0:
        raise ValueError(f"kv_pages.shape={kv_pages.shape} must be (P >= 1, page_size >= 1, D = {d})")
    if q.dtype not in (jnp.bfloat16, jnp.float16, F32):
        raise ValueError(f"q.dtype={q.dtype} must be bfloat16, float16 or float32")
    if kv_pages.dtype not in (q.dtype, FP8):
        raise ValueError(f"kv_pages.dtype={kv_pages.dtype} must be q.dtype={q.dtype} or float8_e4m3fn")
    if sinks.shape != (h,) or sinks.dtype != F32:
        raise ValueError(f"sinks must be float32 [H] = ({h},), got {sinks.dtype} {sinks.shape}")
    if seq_lens.shape != (b,) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be int32 [B] = ({b},), got {seq_lens.dtype} {seq_lens.shape}")
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int")
    ring_size = sliding_window if ring_size is None else ring_size
    if not isinstance(ring_size, int) or ring_size < sliding_window:
        raise ValueError(f"ring_size={ring_size!r} must be an int >= sliding_window={sliding_window}")
    ring_pages = -(-ring_size // page_size)
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.shape[1] < ring_pages \
            or block_tables.dtype != jnp.int32:  # fmt: skip
        raise ValueError(f"block_tables must be int32 [B, >= ceil(ring_size / page_size)] = ({b}, >= {ring_pages}) "
                         f"for ring_size={ring_size}, page_size={page_size}; got {block_tables.dtype} "
                         f"{block_tables.shape}")  # fmt: skip
    kv_layout = check_page_scales("kv_scales", kv_scales, kv_pages, "kv_pages", mixed=kv_rope_pages is not None)
    compressed_layout = None
    if compressed_pages is None:
        if any(x is not None for x in (compressed_block_tables, compressed_lens, topk_indices, compressed_scales,
                                       compressed_rope_pages)):  # fmt: skip
            raise ValueError("compressed_block_tables / compressed_lens / topk_indices / compressed_scales / "
                             "compressed_rope_pages given without compressed_pages")  # fmt: skip
    else:
        width = d if compressed_rope_pages is None else compressed_pages.shape[-1]
        if compressed_pages.ndim != 3 or compressed_pages.shape[2] != width or 0 in compressed_pages.shape:
            raise ValueError(f"compressed_pages.shape={compressed_pages.shape} must be (Pc >= 1, cps >= 1, D = {d})")
        if compressed_rope_pages is not None:
            check_rope_pages(compressed_rope_pages, compressed_pages, d, "compressed_rope_pages", "compressed_pages")
            if kv_rope_pages is not None and kv_rope_pages.shape[-1] != compressed_rope_pages.shape[-1]:
                raise ValueError(f"kv_rope_pages and compressed_rope_pages must hold the same RoPE channels, got "
                                 f"{kv_rope_pages.shape[-1]} and {compressed_rope_pages.shape[-1]}")  # fmt: skip
        if compressed_pages.dtype not in (q.dtype, FP8):
            raise ValueError(f"compressed_pages.dtype={compressed_pages.dtype} must be q.dtype={q.dtype} or "
                             "float8_e4m3fn")  # fmt: skip
        cbt = compressed_block_tables
        if cbt is None or cbt.ndim != 2 or cbt.shape[0] != b or cbt.shape[1] == 0 or cbt.dtype != jnp.int32:
            raise ValueError(f"compressed_block_tables must be int32 [B, >= 1] with B = {b}, got "
                             f"{None if cbt is None else (cbt.dtype, cbt.shape)}")  # fmt: skip
        if compressed_lens is None or compressed_lens.shape != (b,) or compressed_lens.dtype != jnp.int32:
            raise ValueError(
                f"compressed_lens must be int32 [B] = ({b},), got "
                f"{None if compressed_lens is None else (compressed_lens.dtype, compressed_lens.shape)}"
            )
        if topk_indices is not None and (topk_indices.ndim != 2 or topk_indices.shape[0] != b
                                         or topk_indices.shape[1] == 0 or topk_indices.dtype != jnp.int32):  # fmt: skip
            raise ValueError(f"topk_indices must be int32 [B, K >= 1] with B = {b}, got {topk_indices.dtype} "
                             f"{topk_indices.shape}")  # fmt: skip
        compressed_layout = check_page_scales("compressed_scales", compressed_scales, compressed_pages,
                                              "compressed_pages", mixed=compressed_rope_pages is not None)  # fmt: skip
    return ring_size, kv_layout, compressed_layout


def gather_pages_reference(pages, scales, table, entry, dtype, rope=None):
    """pages [P, ps, n], table [B, m], entry int32 [B, N] (>= 0) → dequantized rows [B, N, D] in `dtype` (D = n,
    or n + Dr with the RoPE channels' own pages rope [P, ps, Dr] appended)."""
    page_size, n = pages.shape[1:]
    page = jnp.take_along_axis(table, entry // page_size, axis=1)  # [B, N]
    row = entry % page_size
    values = pages[page, row]  # [B, N, n]
    if scales is not None:
        full = scales[None, None, :] if scales.ndim == 1 else jnp.repeat(scales[page, row], SCALE_TILE, -1)[..., :n]
        values = values.astype(F32) * full
    values = values.astype(dtype)
    return values if rope is None else jnp.concatenate([values, rope[page, row].astype(dtype)], axis=-1)


def load_paged_rows(ref, scales_ref, scale_layout, rows, row_valid, d, compute_dtype):
    """Gathers rows int32 [N] and dequantizes them to `compute_dtype` → [N, d]; invalid rows are 0.

    Whole rows (ref [rows, d]) are `load_values`'. Split rows, the cache's FP8 formats: ref holds only
    the first n < d channels in FP8 (scales per channel [n] or per row and 64-channel tile [rows, ceil(n / 64)]),
    read as a d-wide masked load (Triton tiles are powers of two; n is not, 448 of 512 for V4), and channels n ..
    d - 1 come back 0: the RoPE channels go through `load_rope_rows` and dots of their own. Rounded as
    `dsv4.cache.quant.dequantize` rounds.
    """
    n = ref.shape[-1]
    if n == d:
        return load_values(ref, scales_ref, scale_layout, rows, row_valid, compute_dtype)
    col = jnp.arange(d)
    nope, valid = col < n, row_valid[:, None]
    # NOTE: column offsets stay affine (not clamped), so that Triton can vectorize the masked load. Masked lanes are
    # never read on the GPU; the interpreter reads them, and the select drops them.
    raw = pltriton.load(ref.at[rows[:, None], col[None, :]], mask=valid & nope[None, :])
    values = jnp.where(valid & nope[None, :], raw.astype(F32), 0.0)  # [N, d] (no FP8 `other`: see load_values)
    if scale_layout == "channel":
        values = values * pltriton.load(scales_ref.at[col], mask=nope, other=0.0)[None, :]
    else:
        tiles = scales_ref.shape[-1]
        if d % SCALE_TILE == 0:  # one load per tile, broadcast over its 64 channels
            t = jnp.arange(d // SCALE_TILE)
            s = pltriton.load(scales_ref.at[rows[:, None], t[None, :]], mask=valid & (t < tiles)[None, :],
                              other=0.0)  # fmt: skip  # [N, d // 64]
            s = jnp.broadcast_to(s[:, :, None], (*s.shape, SCALE_TILE)).reshape(values.shape)
        else:  # d < 64 (small test shapes): one tile, its scale gathered for each channel
            s = pltriton.load(scales_ref.at[rows[:, None], (col // d)[None, :]], mask=valid & nope[None, :], other=0.0)
        values = values * s
    return values.astype(compute_dtype)


def load_rope_rows(rope_ref, rows, row_valid, compute_dtype):
    """The RoPE channels of split rows: rope_ref [rows, Dr] gathered → [N, Dr] in `compute_dtype` (invalid rows 0)."""
    dr = rope_ref.shape[-1]
    raw = pltriton.load(rope_ref.at[rows[:, None], jnp.arange(dr)[None, :]], mask=row_valid[:, None], other=0)
    return raw.astype(compute_dtype)


def combine_splits(acc, row_max, row_sum, sinks, dtype):
    """Exact flash-decoding combine. acc [B, n, H, D], row_max / row_sum [B, n, H] (log2 domain) → [B, H, D]."""
    sink = sinks * LOG2E  # [H]
    total_max = jnp.maximum(jnp.maximum(row_max.max(axis=1), sink), M_FLOOR)  # [B, H]
    weight = jnp.exp2(row_max - total_max[:, None])  # [B, n, H]
    denom = (weight * row_sum).sum(axis=1) + jnp.exp2(sink - total_max)  # [B, H]
    out = (weight[..., None] * acc).sum(axis=1)  # [B, H, D]
    out = out * jnp.where(denom > 0, 1.0 / denom, 0.0)[..., None]  # 0 only for a -inf sink and no keys
    return out.astype(dtype)


def scale_queries(q, q_scale):
    """q [B, S, H, D] times q_scale [B, S, H] (float32; None: q as is), rounded to q's dtype: the queries of a core
    that does not fold the factor into its logits (`Kernels.q_norm` "fold" hands the cores q's inverse RMS)."""
    return q if q_scale is None else (q.astype(F32) * q_scale[..., None]).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Mosaic GPU: warpgroup helpers of the two-consumer kernels (`attention_mgpu.py`, `decode_mgpu.py`).
# ---------------------------------------------------------------------------------------------
def wgmma_online_softmax_step(s, col, lo, hi, logit_scale, m_i, l_i, acc):
    """One step of the log2-domain online softmax on a WGMMA-layout [64, n] logit tile, shared by the prefill and
    decode kernels: columns `col` outside [lo, hi) masked, logits = s · logit_scale (a scalar, or a [64] row-layout
    vector: one scale per row). → (P f32 [64, n], new running max [64], new row sum [64], acc [64, d] rescaled to the
    new max)."""
    if jnp.ndim(logit_scale):
        logit_scale = lax.broadcast_in_dim(logit_scale, s.shape, [0])
    logits = jnp.where((col >= lo) & (col < hi), s * logit_scale, -jnp.inf)
    m_new = jnp.maximum(m_i, logits.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
    l_new = l_i * alpha + p.sum(axis=1)
    return p, m_new, l_new, acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def pv_through_smem(acc, p16, p_smem, v_chunks, *, release=None):
    """acc + P · V with P staged in SMEM (`p_smem`, this warpgroup's [64, block_kv] buffer) into a fresh
    accumulator: the only P·V form the CPU Mosaic interpreter runs (its wgmma needs SMEM operands and a new
    accumulator). Twice O's registers, so not a GPU configuration. Shared by the prefill and decode kernels.
    v_chunks: SMEM refs holding V's column chunks in order (one ref: the whole V), as `pv_in_place_chunked`, with
    release(j) after chunk j's product."""
    p_smem[...] = p16
    plmgpu.commit_smem()
    cw = acc.shape[1] // len(v_chunks)
    parts = []
    for j, v_j in enumerate(v_chunks):
        parts.append(pv_with_p_in_smem(acc[:, j * cw:(j + 1) * cw], p_smem, v_j, in_place=False))
        if release is not None:
            release(j)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def pv_in_place_chunked(acc, p16, v_chunks, *, release=None):
    """acc + P · V accumulated in place (`pl.run_state`, the GPU form), P from registers, V given as a list of SMEM
    refs holding its column chunks in order (one ref: the whole V). One wgmma per chunk (into acc's matching
    columns), all issued at once, then release(j) for each chunk j as soon as its wgmma has completed (`wgmma_wait`),
    so that a producer can refill that chunk of V's slot while the rest still runs. release None: the caller
    releases the slot itself."""
    chunks = len(v_chunks)
    cw = acc.shape[1] // chunks

    def pv(acc_ref):
        for j, v_j in enumerate(v_chunks):
            plmgpu.wgmma(acc_ref if chunks == 1 else acc_ref.at[:, pl.ds(j * cw, cw)], p16, v_j)
        if release is not None:
            for j in range(chunks):
                plmgpu.wgmma_wait(chunks - 1 - j)
                release(j)

    return pl.run_state(pv)(plmgpu.ACC.init(acc))


def pv_with_p_in_smem(acc, p_smem, kv_half, *, in_place: bool):
    """acc + P · V with P (the wgmma A operand) already in SMEM: accumulated in place (`pl.run_state`, the GPU
    form) or into a fresh accumulator that is then added (the CPU interpreter's wgmma)."""
    if in_place:
        def pv_in_place(acc_ref):
            plmgpu.wgmma(acc_ref, p_smem, kv_half)

        return pl.run_state(pv_in_place)(plmgpu.ACC.init(acc))

    def pv(acc_ref):
        plmgpu.wgmma(acc_ref, p_smem, kv_half)
        return acc_ref[...]

    return acc + pl.run_scoped(pv, plmgpu.ACC(acc.shape, jnp.float32))


def swap_with_other(buf, w, value, written, read, *, layout, wait_read=None, optimized=True):
    """One rendezvous of the two consumer warpgroups (w = 0, 1) through `buf` [2, ...]: waits until the other has
    read our previous value (`wait_read`: a bool scalar, or None for no wait), writes `value` into buf[w], waits for
    both writes, loads buf[1 - w] in `layout`, and arrives on `read`. → the other's value. Every phase of `written`
    is waited here; the caller waits the last phase of `read` (barrier discipline). Shared by the prefill and
    decode kernels."""
    if wait_read is not None:
        @pl.when(wait_read)
        def _():
            plmgpu.barrier_wait(read)

    buf[w] = value
    plmgpu.barrier_arrive(written)
    plmgpu.barrier_wait(written)
    other = plmgpu.load(buf.at[1 - w], layout=layout, optimized=optimized)
    plmgpu.barrier_arrive(read)
    return other
