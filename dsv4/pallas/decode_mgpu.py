"""DeepSeek-V4 paged decode attention (window ring + HCA entries) as a Mosaic GPU (Hopper) Pallas kernel: wgmma,
TMA, warp specialization. Same semantics, cache layout and split/combine contract as
`dsv4.pallas.decode.paged_decode_attention` (read its module docstring first); this file only changes how one split
is computed. CSA (top-k row gathers: Hopper's TMA cannot gather rows) and FP8 pages with per-token tile scales stay
on the Triton kernel.

Why a second kernel: a decode step is 64 heads × 512 channels against each 1 KiB KV row, 128 FLOP per byte of bf16
KV, so reading at copy bandwidth needs far more tensor throughput than the Triton kernel reaches. This kernel is the
prefill kernel's plan (`attention_mgpu.py`) with the query fixed and the keys streamed from pages.

Design (docs/kernels/decode.md, "The Mosaic decode kernel"):
- One CTA = one request × 64 heads × one split of its key tiles; grid (B · H / 64, num_splits).
- A key tile is 64 rows of one page (page sizes must be multiples of 64), fetched by one TMA per half of D from
  `pages[page, row0 : row0 + 64, half]`; the producer reads each page id from a block table one step before it
  issues that tile's TMA.
- The tiles of a request, numbered window-first:
    window visits k = 0 .. n_wt - 1: the window's slots form one run [s0, s0 + n_w) of "unwrapped" ring slots
        (s0 = (L - n_w) mod R, n_w = min(L, W), R = ring_size); visit k covers unwrapped slots
        [U, U + 64) with U = (s0 // 64 + k) · 64, i.e. ring tile (U mod R) / 64, and keeps the slots in
        [s0, s0 + n_w). Counting by unwrapped slot keeps a ring tile that the window enters twice (wrap-around)
        from being counted twice: each visit keeps a disjoint part of it.
    compressed tiles k = 0 .. ceil(count / 64) - 1: entries [64k, 64k + 64), kept below count.
  Split `sp` walks tiles [sp · per, min((sp + 1) · per, n)), per = ceil(n / num_splits), as the Triton kernel.
- Warpgroups: 2 consumers split D (warpgroup w owns channels [w·D/2, (w+1)·D/2)); a third is the TMA producer.
  S_w = Q_w·K_wᵀ, the partial logits exchanged through SMEM, the online softmax run by both (bit-identical), then
  O_w += P·V_w with V_w the same SMEM half-tile as K_w (K = V). As `attention_mgpu.py`.
- A tile with rows outside its kept range (the window's edges, the last compressed tile) has those rows zeroed in
  SMEM by their consumer before the matmuls: cache rows nobody wrote may hold anything, NaN included, and a masked
  logit alone does not stop 0 · NaN in P·V.
- The state starts empty (max -1e30 in the log2 domain, sum 0, acc 0), no sink; each CTA writes (acc [64, D] f32,
  max [64], sum [64]) to its split's slot and `attention_common.combine_splits` adds the sink once. A split with no
  tiles writes the empty state. After the loop the KV ring is dead, so the f32 accumulator is staged for its TMA store
  in the ring's SMEM (a `RefUnion`), once both consumers are past their last P·V.
- FP8 pages (float8_e4m3fn with per-channel scales, one [D] vector per pool): the kernel runs in f16 (q rounded to
  f16; e4m3 → f16 is exact and one instruction per two values, where Mosaic has no direct e4m3 → bf16). The ring
  holds e4m3 tiles (half the bytes to load); each consumer converts its half of a tile into its own f16 tile, 64
  channels at a time, times the pool's scales (loaded into SMEM with Q), releases the e4m3 slot, zeroes the rows
  outside [lo, hi) of an edge tile as bf16 pages do, and runs the same matmuls on the f16 tile. The scales are
  rounded to f16 and multiplied in f16: they must be normal f16 values (6.1e-5 .. 65504, as an FP8 cache's
  amax / 448 scales of RMS-normed rows are), and so must value × scale.
- `pv_chunks` (2 at D = 512): each consumer's P·V runs as that many wgmmas over column chunks of its half (and its
  Q·Kᵀ as as many over K), and each chunk of the slot goes back to the producer (which loads it by its own TMA) as
  soon as its wgmma is done, instead of the whole half after the last one.

SMEM at D = 512, 2 slots: Q 64 KiB + KV ring 128 KiB (= the f32 output staging) + exchange 32 KiB + stats 0.5 KiB.
FP8 pages: the ring is 2 × 32 KiB of e4m3 + the two consumers' f16 tile halves, 64 KiB, and the scales (2 KiB) beside
them; the stats move into the output staging's share of the union.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4.pallas.attention_common import (
    F32,
    HEADS_PER_CTA,
    LOG2E,
    M_FLOOR,
    SMEM_LIMIT,
    check_decode_inputs,
    combine_splits,
    default_num_splits,
    pv_in_place_chunked,
    pv_through_smem,
    smem_tiling,
    swap_with_other,
    wgmma_online_softmax_step,
)

__all__ = ["MgpuDecodeConfig", "mgpu_decode_supported", "paged_decode_attention_mgpu", "unsupported_reason"]

TILE = 64  # key rows per step: a bf16 wgmma K (P·V) must be a multiple of 64
_FP8_CHUNK = 64  # FP8 pages: channels per e4m3 → f16 conversion chunk (a 64-byte-swizzled e4m3 tile's width)
_PV_FORMS = ("run_state", "interpret")
_DEBUG_FLAGS = ("stream_only", "compute_only", "skip_exchange", "skip_softmax", "skip_convert", "skip_scale",
                "skip_mask")  # fmt: skip
# FP8 pages: the register layout of the e4m3 → f16 conversion (its SMEM loads and stores). WGMMA: 2-byte e4m3
# loads and 4-byte f16 stores; the upcast layouts hold 4 (2x) or 8 (4x) consecutive values a thread.
_FP8_LAYOUTS = {"wgmma": plgpu.Layout.WGMMA, "upcast2x": plgpu.Layout.WGMMA_UPCAST_2X,
                "upcast4x": plgpu.Layout.WGMMA_UPCAST_4X}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MgpuDecodeConfig:
    """Tunables of `paged_decode_attention_mgpu`.

    num_slots:  key tiles in flight (SMEM ring depth), >= 1; 2 is what fits at D = 512.
    num_splits: key-axis splits per (request, head block); None: `default_num_splits` (one wave).
    pv_chunks:  column chunks of each consumer's P·V, each released to the producer (and refilled by its own TMA)
                as soon as its wgmma completes; 1: the half-tile at once. D / 2 must be a multiple of 64 · pv_chunks
                (whole 128-byte swizzle tiles); None: 2 where D / 2 allows it, else 1 (2 was the fastest measured, for
                bf16 and FP8 pages).
    fp8_layout: FP8 pages: the register layout of the e4m3 → f16 conversion, one of "wgmma" (2-byte e4m3 loads),
                "upcast2x" (4-byte), "upcast4x" (8-byte); the f16 tile is stored from the same layout. The upcast
                layouts' wider accesses read the cache faster than "wgmma".
    approx_math: Mosaic `approx_math` (fast exp2 / reciprocal).
    pv_form:    "run_state" (P·V accumulated in place, the GPU form) or "interpret" (P through SMEM into a fresh
                accumulator, then added: the only form the CPU Mosaic interpreter runs; not for the GPU).
    auto_barriers: Pallas' warpgroup barrier before and after every SMEM store (True), or none (False:
                `CompilerParams.unsafe_no_auto_barriers`). The per-step store of the partial logits into the exchange
                buffer is one; the exchange's own mbarriers (each thread arrives after its own write or read)
                already order it, the masked-row zeroing reads and writes each element from its owner thread, and
                every store a TMA or wgmma reads, or another thread reads back (the FP8 conversion's, read again
                by the edge rows' zeroing in another layout), is followed by `commit_smem` (fence and barrier). Without
                them the cache reads faster (bf16 and FP8 pages), so False is the default.
    registers:  (each consumer's, the producer's) register count per thread after `setmaxnreg`: multiples of 8,
                the producer >= 24, 2 · consumer + producer <= 504: `setmaxnreg` can only move the registers the CTA
                was launched with, 384 threads at ptxas' 168 each (65536 / 384, rounded down to 8), 3 · 168 = 504 a
                lane ((240, 32) hung on the GPU). The default (232, 40) is the whole budget.
    debug:      measurement switches, a tuple of: "stream_only" (the consumers wait for each tile and release it,
                no matmuls: the kernel's load path alone), "compute_only" (only the first `num_slots` tiles are
                loaded; every later step computes on whatever its slot holds: the consumers alone),
                "skip_exchange" (no partial-logit exchange: each warpgroup uses twice its own partial), "skip_softmax"
                (P = the logits, no max / exp2 / sums / rescale), "skip_convert" (FP8 pages: no e4m3 → f16
                conversion; the matmuls read whatever the f16 tile holds), "skip_scale" (FP8 pages: the conversion
                without its scale multiply), "skip_mask" (edge tiles' rows outside [lo, hi) not zeroed). With any
                of them the output is meaningless.
    """

    num_slots: int = 2
    num_splits: int | None = None
    pv_chunks: int | None = None
    fp8_layout: str = "upcast2x"
    approx_math: bool = True
    pv_form: str = "run_state"
    auto_barriers: bool = False
    registers: tuple = (232, 40)
    debug: tuple = ()

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"MgpuDecodeConfig.num_slots={self.num_slots} must be >= 1")
        if self.pv_chunks is not None and self.pv_chunks < 1:
            raise ValueError(f"MgpuDecodeConfig.pv_chunks={self.pv_chunks} must be None or >= 1")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"MgpuDecodeConfig.num_splits={self.num_splits} must be None or >= 1")
        if self.fp8_layout not in _FP8_LAYOUTS:
            raise ValueError(f"MgpuDecodeConfig.fp8_layout={self.fp8_layout!r} must be one of {tuple(_FP8_LAYOUTS)}")
        if self.pv_form not in _PV_FORMS:
            raise ValueError(f"MgpuDecodeConfig.pv_form={self.pv_form!r} must be one of {_PV_FORMS}")
        c, pr = self.registers
        if c % 8 or pr % 8 or pr < 24 or 2 * c + pr > 504:
            raise ValueError(f"MgpuDecodeConfig.registers={self.registers} must be multiples of 8, the producer's >= "
                             f"24, with 2 · consumer + producer <= 504 (3 warpgroups launched at 168)")  # fmt: skip
        if not isinstance(self.debug, tuple) or any(f not in _DEBUG_FLAGS for f in self.debug):
            raise ValueError(f"MgpuDecodeConfig.debug={self.debug!r} must be a tuple of flags from {_DEBUG_FLAGS}")

    def resolved_pv_chunks(self, head_dim: int) -> int:
        """`pv_chunks` at this head dim, None resolved: 2 where each half holds two 64-channel tiles, else 1."""
        if self.pv_chunks is not None:
            return self.pv_chunks
        return 2 if (head_dim // 2) % (2 * TILE) == 0 else 1

    def smem_bytes(self, head_dim: int, itemsize: int = 2, fp8: bool = False) -> int:
        """Shared memory at this head dim; fp8: e4m3 pages (an e4m3 ring, one f16 tile, the scales)."""
        q = HEADS_PER_CTA * head_dim * itemsize
        ring = self.num_slots * TILE * head_dim * (1 if fp8 else itemsize) + (TILE * head_dim * itemsize if fp8 else 0)
        stats = 2 * HEADS_PER_CTA * 4
        if fp8:  # the scales in the ring's part of the union, the stats in the output's
            union = max(ring + 2 * head_dim * 2, HEADS_PER_CTA * head_dim * 4 + stats)
        else:
            union = max(ring, HEADS_PER_CTA * head_dim * 4) + stats  # ∪ f32 staging; stats outside
        exchange = 2 * HEADS_PER_CTA * TILE * 4
        p = 2 * HEADS_PER_CTA * TILE * itemsize if self.pv_form == "interpret" else 0
        return q + union + exchange + p


def _unsupported(q, kv_pages, ring_size, compressed_pages, topk_indices, kv_scales, compressed_scales,
                 config: MgpuDecodeConfig) -> str | None:  # fmt: skip
    """Why this kernel cannot take these inputs (None: it can). Inputs already passed `check_decode_inputs`."""
    b, h, d = q.shape
    if jax.dtypes.canonicalize_dtype(q.dtype) not in (jnp.bfloat16, jnp.float16):
        return f"q.dtype={q.dtype} must be bfloat16 or float16 (wgmma operands)"
    fp8 = kv_pages.dtype == jnp.float8_e4m3fn
    if fp8:  # e4m3 pages with per-channel scales, converted to f16 in SMEM
        if kv_scales is None or kv_scales.shape != (d,):
            got = None if kv_scales is None else kv_scales.shape
            return f"FP8 kv_pages need per-channel kv_scales of shape ({d},) here, got {got} (per-token tiles: " \
                   f"use the Triton kernel)"  # fmt: skip
        if compressed_pages is not None and (compressed_pages.dtype != kv_pages.dtype or compressed_scales is None
                                             or compressed_scales.shape != (d,)):  # fmt: skip
            return f"with FP8 kv_pages, compressed_pages must be float8_e4m3fn too (got {compressed_pages.dtype}) " \
                   f"with per-channel compressed_scales of shape ({d},)"  # fmt: skip
    elif kv_pages.dtype != q.dtype or kv_scales is not None or compressed_scales is not None:
        return f"kv_pages.dtype={kv_pages.dtype} must equal q.dtype={q.dtype}, or be float8_e4m3fn with per-channel " \
               f"scales"  # fmt: skip
    elif compressed_pages is not None and compressed_pages.dtype != q.dtype:
        return f"compressed_pages.dtype={compressed_pages.dtype} must equal q.dtype={q.dtype}"
    if topk_indices is not None:
        return "topk_indices (CSA) needs row gathers: use the Triton kernel"
    if d % 128 or not 128 <= d <= 512:
        return f"head dim D={d} must be 128, 256, 384 or 512 (two warpgroups × D/2 channels, D/2 <= 256)"
    if h % HEADS_PER_CTA:
        return f"num heads H={h} must be a multiple of {HEADS_PER_CTA} (one CTA = 64 heads of one request)"
    if kv_pages.shape[1] % TILE:
        return f"page_size={kv_pages.shape[1]} (kv_pages.shape={kv_pages.shape}) must be a multiple of {TILE}"
    if ring_size % TILE:
        return f"ring_size={ring_size} must be a multiple of {TILE}"
    if compressed_pages is not None and compressed_pages.shape[1] % TILE:
        return f"compressed page size {compressed_pages.shape[1]} (compressed_pages.shape={compressed_pages.shape}) " \
               f"must be a multiple of {TILE}"  # fmt: skip
    if config.pv_chunks is not None and (d // 2) % (TILE * config.pv_chunks):
        return f"pv_chunks={config.pv_chunks} needs D/2={d // 2} to be a multiple of {TILE * config.pv_chunks}"
    if config.smem_bytes(d, fp8=fp8) > SMEM_LIMIT:
        return f"{config} needs {config.smem_bytes(d, fp8=fp8)} B of shared memory at D={d}; limit {SMEM_LIMIT}"
    return None


def unsupported_reason(q, kv_pages, *, sliding_window, ring_size=None, compressed_pages=None, topk_indices=None,
                       kv_scales=None, compressed_scales=None, config=None) -> str | None:  # fmt: skip
    """Why `paged_decode_attention_mgpu` cannot take these (static) shapes and dtypes; None when it can."""
    ring_size = sliding_window if ring_size is None else ring_size
    return _unsupported(q, kv_pages, ring_size, compressed_pages, topk_indices, kv_scales, compressed_scales,
                        config or MgpuDecodeConfig())  # fmt: skip


def mgpu_decode_supported(q, kv_pages, **kw) -> bool:
    """True when `paged_decode_attention_mgpu` takes these shapes and dtypes (keywords as `unsupported_reason`)."""
    return unsupported_reason(q, kv_pages, **kw) is None


class _TileStream:
    """One CTA's run of 64-row key tiles (module docstring): bounds, page lookup and TMA views. Built inside a kernel
    body from its refs; `first` / `n_steps` are the CTA's split of the request's tiles."""

    def __init__(self, meta_ref, table_ref, ctable_ref, kv_ref, comp_ref, *, bi, sp, num_splits, ring_size,
                 page_size, cps):  # fmt: skip
        self.refs = (table_ref, ctable_ref, kv_ref, comp_ref)
        self.bi, self.ring_size, self.page_size, self.cps = bi, ring_size, page_size, cps
        self.n_wt, self.s0, self.n_w, self.count = (meta_ref[bi, k] for k in range(4))
        self.n_tiles = self.n_wt + lax.div(self.count + (TILE - 1), jnp.int32(TILE))
        per = lax.div(self.n_tiles + (num_splits - 1), jnp.int32(num_splits))
        self.first = jnp.minimum(sp * per, self.n_tiles)
        self.n_steps = jnp.minimum(self.first + per, self.n_tiles) - self.first
        self.u0 = lax.div(self.s0, jnp.int32(TILE)) * TILE  # the first window visit's unwrapped slot

    def tile_bounds(self, g):
        """Tile g of the request → (is_window, first row id, kept [lo, hi)) in unwrapped slots / entry ids."""
        is_win = g < self.n_wt
        base = jnp.where(is_win, self.u0 + g * TILE, (g - self.n_wt) * TILE)
        lo = jnp.where(is_win, self.s0, 0)
        hi = jnp.where(is_win, self.s0 + self.n_w, self.count)
        return is_win, base, lo, hi

    def locate(self, step):
        """→ (is_window, page id, first row) of step `step`'s tile, the page id read from a block table (a global
        load: issue it early, use it late). Steps past the CTA's last are clamped to a real tile."""
        table_ref, ctable_ref, _, comp_ref = self.refs
        g = jnp.clip(self.first + step, 0, jnp.maximum(self.n_tiles - 1, 0))
        is_win, base, _, _ = self.tile_bounds(g)
        ring_row = lax.rem(base, jnp.int32(self.ring_size))
        page = table_ref[self.bi, lax.div(ring_row, jnp.int32(self.page_size))]
        row0 = lax.rem(ring_row, jnp.int32(self.page_size))
        if comp_ref is not None:
            cpage = ctable_ref[self.bi, jnp.clip(lax.div(base, jnp.int32(self.cps)), 0, ctable_ref.shape[1] - 1)]
            page = jnp.where(is_win, page, cpage)
            row0 = jnp.where(is_win, row0, lax.rem(base, jnp.int32(self.cps)))
        return is_win, page, row0

    def on_tile(self, loc, col0, width, op):
        """op(GMEM view) of channels [col0, col0 + width) ([64 rows, width]) of the tile at loc = locate(step)."""
        _, _, kv_ref, comp_ref = self.refs
        is_win, page, row0 = loc
        cols = pl.ds(col0, width)

        @pl.when(is_win)
        def _():
            op(kv_ref.at[page, pl.ds(row0, TILE), cols])

        if comp_ref is not None:
            @pl.when(jnp.logical_not(is_win))
            def _():
                op(comp_ref.at[page, pl.ds(row0, TILE), cols])


def _produce(locate, issue, consumed, n_steps, *, slots, nc, registers, compute_only=False):
    """The TMA producer warpgroup: every step's tile, both halves, chunk by chunk, each chunk once its slot's
    previous tile has been released; then it observes the last releases (barrier discipline). registers: its
    setmaxnreg count (MgpuDecodeConfig.registers[1])."""
    plgpu.set_max_registers(registers, action="decrease")

    # NOTE: each page id is read from its block table one iteration before it is used, so that the global load's
    # latency overlaps a barrier wait instead of stalling the TMA issue.
    def produce(i, loc):
        slot = lax.rem(i, jnp.int32(slots))
        loc_next = locate(i + 1)
        for half in range(2):
            for j in range(nc):
                @pl.when(i >= slots)
                def _():
                    plgpu.barrier_wait(consumed(slot, half, j))

                issue(i, loc, half, j)
        return loc_next

    first_loc = locate(jnp.int32(0))
    if compute_only:  # debug: the first tiles only, no releases to observe
        lax.fori_loop(0, jnp.minimum(n_steps, slots), produce, first_loc)
        return
    lax.fori_loop(0, n_steps, produce, first_loc)

    @pl.loop(jnp.maximum(n_steps - slots, 0), n_steps)  # observe the consumers' last releases
    def _(i):
        slot = lax.rem(i, jnp.int32(slots))
        for half in range(2):
            for j in range(nc):
                plgpu.barrier_wait(consumed(slot, half, j))


def _decode_call(q, meta, kv_pages, block_tables, compressed_pages, compressed_block_tables, channel_scales=None, *,
                 scale, ring_size, num_splits, config: MgpuDecodeConfig, interpret):  # fmt: skip
    """The raw kernel. meta [B, 4] int32 = (window visits n_wt, first unwrapped slot s0, window slots n_w, compressed
    entries count). FP8 pages (float8_e4m3fn): q float16 and channel_scales [2, D] float16 (ring pages' per-channel
    scales, then the compressed pages'). → (acc [B, splits, H, D] f32, max [B, splits, H] f32 (log2 domain),
    sum [B, splits, H] f32)."""
    b, h, d = q.shape
    hg = h // HEADS_PER_CTA
    dh = d // 2
    dtype = q.dtype
    itemsize = jnp.dtype(dtype).itemsize
    fp8 = kv_pages.dtype == jnp.float8_e4m3fn
    nc = config.resolved_pv_chunks(d)
    cw = dh // nc  # channels per P·V chunk (and per TMA)
    slots = config.num_slots
    page_size = kv_pages.shape[1]
    hca = compressed_pages is not None
    cps = compressed_pages.shape[1] if hca else TILE
    logit_scale = float(scale) * LOG2E
    wgmma_layout = plgpu.Layout.WGMMA
    interp_pv = config.pv_form == "interpret"
    stream_only = "stream_only" in config.debug
    compute_only = "compute_only" in config.debug
    skip_exchange = "skip_exchange" in config.debug
    skip_softmax = "skip_softmax" in config.debug
    skip_convert = "skip_convert" in config.debug
    skip_scale = "skip_scale" in config.debug
    skip_mask = "skip_mask" in config.debug
    conv_layout = _FP8_LAYOUTS[config.fp8_layout]

    def body(q_ref, meta_ref, kv_ref, table_ref, comp_ref, ctable_ref, scales_ref, acc_out, max_out, sum_out, q_smem,
             union, x_smem, stats_smem, p_smem, q_bar, kv_bar, consumed_bar, x_written, x_read, done_bar):  # fmt: skip
        ring, stage_smem = union
        kv_smem, work_smem, scales_smem = ring if fp8 else (ring, None, None)  # FP8: + f16 tile halves, scales
        if fp8:  # the stats share the output's part of the union, the scales the ring's
            stage_smem, stats_smem = stage_smem
        bh, sp, wg = lax.axis_index("bh"), lax.axis_index("sp"), lax.axis_index("wg")
        bi = lax.div(bh, jnp.int32(hg))
        h0 = lax.rem(bh, jnp.int32(hg)) * HEADS_PER_CTA
        ts = _TileStream(meta_ref, table_ref, ctable_ref, kv_ref, comp_ref, bi=bi, sp=sp, num_splits=num_splits,
                         ring_size=ring_size, page_size=page_size, cps=cps)
        first, n_steps, tile_bounds, locate, on_tile = ts.first, ts.n_steps, ts.tile_bounds, ts.locate, ts.on_tile

        def issue(step, loc, half, j):
            """TMA of step `step`'s tile half `half`, chunk j (at loc) into its ring slot."""
            slot = lax.rem(step, jnp.int32(slots))
            dst = kv_smem.at[slot * 2 + half, j]
            on_tile(loc, half * dh + j * cw, cw,
                    lambda src: plgpu.copy_gmem_to_smem(src, dst, kv_bar.at[slot * 2 + half]))  # fmt: skip

        def consumed(slot, half, j):
            """The barrier that hands chunk j of `slot`'s half `half` back to the producer."""
            return consumed_bar.at[(slot * 2 + half) * nc + j]

        def release(slot, w):
            """Give warpgroup w's half of `slot` back to the producer, every chunk."""
            for j in range(nc):
                plgpu.barrier_arrive(consumed(slot, w, j))

        def consumer(w):
            plgpu.set_max_registers(config.registers[0], action="increase")
            for j in range(nc):
                plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(h0, HEADS_PER_CTA), pl.ds(w * dh + j * cw, cw)],
                                        q_smem.at[w, j], q_bar.at[w])  # fmt: skip
            if fp8:  # one more arrival on q_bar[w]
                plgpu.copy_gmem_to_smem(scales_ref.at[:, pl.ds(w * dh, dh)], scales_smem.at[w], q_bar.at[w])
            row_layout = wgmma_layout.reduce(1)
            m_i = plgpu.layout_cast(jnp.full((HEADS_PER_CTA,), M_FLOOR, F32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), F32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, dh), F32), wgmma_layout)
            plgpu.barrier_wait(q_bar.at[w])

            def step_fn(i, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(i, jnp.int32(slots))
                kv_half = kv_smem.at[slot * 2 + w]  # [nc, 64 rows, cw]: this warpgroup's half, by chunk
                if compute_only:
                    @pl.when(i < slots)
                    def _():
                        plgpu.barrier_wait(kv_bar.at[slot * 2 + w])
                else:
                    plgpu.barrier_wait(kv_bar.at[slot * 2 + w])
                if stream_only:
                    release(slot, w)
                    return carry
                is_win, base, lo, hi = tile_bounds(first + i)

                if fp8:
                    # e4m3 → f16 (exact) × the pool's channel scale, into this warpgroup's own f16 tile half; then
                    # the e4m3 slot half goes back to the producer
                    pool = jnp.where(is_win, 0, 1)
                    for c in range(0 if skip_convert else dh // _FP8_CHUNK):
                        j, off = divmod(c * _FP8_CHUNK, cw)
                        cols = pl.ds(off, _FP8_CHUNK)
                        vals = plgpu.load(kv_half.at[j, :, cols], layout=conv_layout).astype(jnp.float16)
                        if not skip_scale:
                            sc = plgpu.load(scales_smem.at[w, pool, pl.ds(c * _FP8_CHUNK, _FP8_CHUNK)],
                                            layout=conv_layout.reduce(0), optimized=False)  # fmt: skip
                            vals = vals * plgpu.layout_cast(lax.broadcast_in_dim(sc, (TILE, _FP8_CHUNK), [1]),
                                                            conv_layout)  # fmt: skip
                        work_smem.at[w, j, :, cols][...] = vals
                    plgpu.commit_smem()
                    if not compute_only:
                        release(slot, w)
                    kv_half = work_smem.at[w]

                # NOTE: the zeroing is a second pass on edge tiles only; inside the FP8 conversion it would run on
                # every tile
                if not skip_mask:
                    @pl.when((base < lo) | (base + TILE > hi))
                    def _():  # rows outside [lo, hi) may hold anything (NaN): zero this warpgroup's half of them
                        rows = plgpu.broadcasted_iota(jnp.int32, (TILE, cw), 0, layout=wgmma_layout) + base
                        for j in range(nc):
                            tile = plgpu.load(kv_half.at[j], layout=wgmma_layout)
                            kv_half.at[j][...] = jnp.where((rows >= lo) & (rows < hi), tile, jnp.zeros_like(tile))
                        plgpu.commit_smem()

                def qk(acc_ref):
                    for j in range(nc):
                        plgpu.wgmma(acc_ref, q_smem.at[w, j], kv_half.at[j].transpose((1, 0)))
                    return acc_ref[...]

                s_part = pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, TILE), F32))  # [64 heads, 64 keys]

                if skip_exchange:  # debug
                    s_full = s_part + s_part
                else:
                    s_full = s_part + swap_with_other(x_smem, w, s_part, x_written, x_read, layout=wgmma_layout,
                                                      wait_read=i > 0)  # fmt: skip

                if skip_softmax:  # debug
                    p, m_new, l_new = s_full, m_i, l_i
                else:
                    col = plgpu.broadcasted_iota(jnp.int32, (HEADS_PER_CTA, TILE), 1, layout=wgmma_layout) + base
                    p, m_new, l_new, acc = wgmma_online_softmax_step(s_full, col, lo, hi, logit_scale, m_i, l_i, acc)
                p16 = p.astype(dtype)
                # bf16 pages: chunk j of the slot half goes back as soon as its P·V is done (FP8: released above)
                release_chunk = None if (compute_only or fp8) else (
                    lambda j: plgpu.barrier_arrive(consumed(slot, w, j)))  # fmt: skip
                v_chunks = [kv_half.at[j] for j in range(nc)]
                if interp_pv:
                    acc = pv_through_smem(acc, p16, p_smem.at[w], v_chunks, release=release_chunk)
                else:
                    acc = pv_in_place_chunked(acc, p16, v_chunks, release=release_chunk)
                return acc, m_new, l_new

            acc, m_i, l_i = lax.fori_loop(0, n_steps, step_fn, (acc, m_i, l_i))

            if not (stream_only or skip_exchange):
                @pl.when(n_steps > 0)
                def _():
                    plgpu.barrier_wait(x_read)  # observe the last exchange phase

            # The ring becomes the output staging: wait until both consumers are past their last P·V.
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
            stage_smem[w] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage_smem.at[w],
                                    acc_out.at[bi, sp, pl.ds(h0, HEADS_PER_CTA), pl.ds(w * dh, dh)])  # fmt: skip

            @pl.when(w == 0)
            def _():
                stats_smem[0] = m_i
                stats_smem[1] = l_i
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stats_smem.at[0], max_out.at[bi, sp, pl.ds(h0, HEADS_PER_CTA)])
                plgpu.copy_smem_to_gmem(stats_smem.at[1], sum_out.at[bi, sp, pl.ds(h0, HEADS_PER_CTA)])

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 0)
        def _():
            consumer(0)

        @pl.when(wg == 1)
        def _():
            consumer(1)

        @pl.when(wg == 2)
        def _():
            _produce(locate, issue, consumed, n_steps, slots=slots, nc=nc, registers=config.registers[1],
                     compute_only=compute_only)  # fmt: skip

    elems_128b = 128 // itemsize
    # Every [64 rows, cw] chunk its own contiguous block: a TMA's SMEM destination must be contiguous
    ring = plgpu.SMEM((slots * 2, nc, TILE, cw), dtype, transforms=smem_tiling(elems_128b, itemsize))
    out_staging = plgpu.SMEM((2, HEADS_PER_CTA, dh), F32, transforms=smem_tiling(32, 4))
    stats = plgpu.SMEM((2, HEADS_PER_CTA), F32)  # (max, sum) staging
    if fp8:  # the TMA'd e4m3 ring (64-byte swizzle: 64-column conversion chunks), each consumer's f16 tile half and
        # the [half, pool, channel] scales, while the stats join the output staging's group: the union grows by
        # 1.5 KiB and fits at D = 512, where 2 KiB of scales beside it were 120 B over the limit
        ring = (plgpu.SMEM((slots * 2, nc, TILE, cw), kv_pages.dtype, transforms=smem_tiling(_FP8_CHUNK, 1)),
                plgpu.SMEM((2, nc, TILE, cw), dtype, transforms=smem_tiling(elems_128b, itemsize)),
                plgpu.SMEM((2, 2, dh), jnp.float16))  # fmt: skip
        out_staging, stats = (out_staging, stats), None
    scratch = [
        plgpu.SMEM((2, nc, HEADS_PER_CTA, cw), dtype, transforms=smem_tiling(elems_128b, itemsize)),  # Q by chunk
        plgpu.RefUnion(ring, out_staging),  # KV ring [slot · 2 + half] (FP8: + more) ∪ f32 output staging [half]
        plgpu.SMEM((2, HEADS_PER_CTA, TILE), F32, transforms=smem_tiling(32, 4)),  # partial-logit exchange
        stats,
        plgpu.SMEM((2, HEADS_PER_CTA, TILE), dtype, transforms=smem_tiling(elems_128b, itemsize))
        if interp_pv else None,
        plgpu.Barrier(num_barriers=2, num_arrivals=nc + int(fp8)),  # q halves (one TMA a chunk; + FP8 scales)
        plgpu.Barrier(num_barriers=2 * slots, num_arrivals=nc),  # kv halves full (one TMA a chunk)
        plgpu.Barrier(num_barriers=2 * slots * nc),  # kv half chunks consumed
        plgpu.Barrier(num_arrivals=2),  # exchange written
        plgpu.Barrier(num_arrivals=2),  # exchange read
        plgpu.Barrier(num_arrivals=2),  # both consumers done with the ring
    ]
    out_type = (jax.ShapeDtypeStruct((b, num_splits, h, d), F32), jax.ShapeDtypeStruct((b, num_splits, h), F32),
                jax.ShapeDtypeStruct((b, num_splits, h), F32))  # fmt: skip
    args = (q, meta, kv_pages, block_tables) + ((compressed_pages, compressed_block_tables) if hca else ())
    args += (channel_scales,) if fp8 else ()

    def kernel_body(*refs):
        q_ref, meta_ref, kv_ref, table_ref = refs[:4]
        comp_ref, ctable_ref, rest = (refs[4], refs[5], refs[6:]) if hca else (None, None, refs[4:])
        scales_ref, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
        return body(q_ref, meta_ref, kv_ref, table_ref, comp_ref, ctable_ref, scales_ref, *rest)

    return plgpu.kernel(
        kernel_body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(b * hg, num_splits),
        grid_names=("bh", "sp"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math, reduction_scratch_bytes=0,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=not config.auto_barriers),  # fmt: skip
        interpret=interpret,
    )(*args)


def decode_meta(seq_lens, *, sliding_window: int, ring_size: int, compressed_lens=None, capacity: int = 0):
    """Per-request tile bounds → int32 [B, 4] = (window visits n_wt, first unwrapped ring slot s0, window slots n_w,
    compressed entries count) (see the module docstring)."""
    seq_lens = jnp.maximum(seq_lens.astype(jnp.int32), 0)
    n_w = jnp.minimum(seq_lens, sliding_window)
    s0 = lax.rem(seq_lens - n_w, jnp.int32(ring_size))
    n_wt = jnp.where(n_w > 0, (lax.rem(s0, jnp.int32(TILE)) + n_w + TILE - 1) // TILE, 0)
    count = jnp.zeros_like(seq_lens) if compressed_lens is None else jnp.clip(compressed_lens, 0, capacity)
    return jnp.stack([n_wt, s0, n_w, count.astype(jnp.int32)], axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "ring_size", "config", "interpret"))
def paged_decode_attention_mgpu(
    q: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    sinks: jax.Array,
    *,
    sliding_window: int,
    scale: float,
    ring_size: int | None = None,
    compressed_pages: jax.Array | None = None,
    compressed_block_tables: jax.Array | None = None,
    compressed_lens: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    compressed_scales: jax.Array | None = None,
    config: MgpuDecodeConfig = MgpuDecodeConfig(),
    interpret=None,
) -> jax.Array:
    """`decode.paged_decode_attention` for window and HCA layers with bf16/f16 pages, or float8_e4m3fn pages with
    per-channel scales, on Hopper. → [B, H, D].

    Arguments as `paged_decode_attention` (no topk_indices; FP8 scales per channel only, [D]); page sizes and
    ring_size must be multiples of 64, H a multiple of 64, D ∈ {128, 256, 384, 512}. FP8 pages run in float16
    (e4m3 → f16 is exact and one instruction; q is rounded to f16): each consumer converts its half of every tile in
    SMEM, times the channel scale. config: MgpuDecodeConfig; interpret: an InterpretGPUParams for the CPU Mosaic
    interpreter (with config.pv_form="interpret").
    """
    ring_size, _, _ = check_decode_inputs(
        q, kv_pages, block_tables, seq_lens, sinks, sliding_window=sliding_window, ring_size=ring_size,
        compressed_pages=compressed_pages, compressed_block_tables=compressed_block_tables,
        compressed_lens=compressed_lens, topk_indices=None, kv_scales=kv_scales, compressed_scales=compressed_scales,
    )  # fmt: skip
    why = _unsupported(q, kv_pages, ring_size, compressed_pages, None, kv_scales, compressed_scales, config)
    if why:
        raise ValueError(f"paged_decode_attention_mgpu: {why}")
    b, h, _ = q.shape
    capacity = 0
    if compressed_pages is not None:
        capacity = compressed_block_tables.shape[1] * compressed_pages.shape[1]
    meta = decode_meta(seq_lens, sliding_window=sliding_window, ring_size=ring_size, compressed_lens=compressed_lens,
                       capacity=capacity)  # fmt: skip
    num_splits = config.num_splits
    if num_splits is None:
        max_tiles = pl.cdiv(sliding_window + TILE - 1, TILE) + pl.cdiv(capacity, TILE)
        num_splits = default_num_splits(b * (h // HEADS_PER_CTA), max_tiles)
    channel_scales, qk = None, q
    if kv_pages.dtype == jnp.float8_e4m3fn:
        comp = kv_scales if compressed_scales is None else compressed_scales  # (window only: an unread copy)
        channel_scales = jnp.stack([kv_scales, comp]).astype(jnp.float16)
        qk = q.astype(jnp.float16)
    acc, row_max, row_sum = _decode_call(qk, meta, kv_pages, block_tables, compressed_pages, compressed_block_tables,
                                         channel_scales, scale=scale, ring_size=ring_size, num_splits=num_splits,
                                         config=config, interpret=interpret)  # fmt: skip
    return combine_splits(acc, row_max, row_sum, sinks, q.dtype)
