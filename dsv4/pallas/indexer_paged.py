"""The lightning indexer over its paged key cache, for decode steps: a Triton-lowered Pallas scores kernel that reads
the cache's stored rows through the block table, then the exact grouped top-k; with its jnp reference. On Hopper,
bf16 pages take the Mosaic GPU form instead (`indexer_paged_mgpu.py`, chosen by `index_topk_paged`).

A decode step has one query per request (a few for short chunks) against every visible key of its request. The
dense route first reads the whole key cache out (`KVStore.read`: every page of the table gathered and dequantized
to a [B, capacity, Di] copy), then scores that copy. This kernel scores the stored rows where they lie:

    score[b, s, c] = softmax_scale · Σ_h weights[b, s, h] · ReLU(q[b, s, h, :] · key_c)      (float32)

for the entries c < (positions[b, s] + 1) // rate, -inf elsewhere, with key_c the row at
`key_pages[block_table[b, c // R], c % R]` (R = rows per page) dequantized as `dsv4.cache.quant.dequantize`
rounds it. Layout of this file (see dsv4/pallas/README.md):

- `PagedScoreBlocks`              tile sizes and launch parameters (frozen, validated).
- `index_scores_paged_kernel`     one program = one request × `span` entries, all of its queries.
- `index_scores_paged`            the public jitted entry: checks shapes / dtypes, splits q into the stored
                                  channels' parts, calls `pl.pallas_call`. → [B, S, C] float32.
- `index_topk_paged`              scores, then `dsv4.topk.top_k` (the refinement kernel on Hopper) → [B, S, k].
- `index_scores_paged_reference`  the spec in jnp: gather, dequantize, `indexer.index_scores_reference`.

Stored rows (the cache's formats, `dsv4.cache.layout.KVFormat`), each paged [P, R, ·]:
- unquantized: `key_pages` holds whole rows [P, R, Di] in q's dtype; no scales, no RoPE pages.
- FP8: `key_pages` holds the first n = Di - Dr channels in e4m3, `key_scales` their float32 scales, per channel
  [n] (a per-tensor scale broadcast) or per row and 64-channel tile [P, R, ceil(n / 64)]; `key_rope_pages`
  [P, R, Dr] the RoPE channels (bf16), or None when Dr = 0.
A key's score is the f32 sum of its two dots (stored channels, RoPE channels), each accumulated in f32 from
operands in q's dtype: the same operands as the dense route, summed in another order.

NOTE (cost): the work is 2 · Hi · Di FLOPs per key (16 KiFLOP for V4's 64 heads × 128) against the stored row
(192 B in FP8 with bf16 RoPE channels, 256 B in bf16): 85-64 FLOP per byte. Measured on bf16 pages (H100, 128K
context × 32 requests) both this kernel and the Mosaic one read the keys at 2.7 TB/s: the reads set the pace. What
the kernel saves is the dense route's copy: its reads of every page the table lists (not only the visible ones) and
its write and re-read of 256 B a key.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv4.pallas._device import is_hopper

# The paged rows are the decode kernel's (attention_common): dequantized as `dsv4.cache.quant.dequantize` rounds.
from dsv4.pallas.attention_common import (
    SCALE_TILE,
    gather_pages_reference,
    load_paged_rows,
    load_rope_rows,
)
from dsv4.pallas.indexer import index_scores_reference
from dsv4.pallas.indexer_common import (
    F32,
    MAX_QUERIES,
    NEG_INF,
    check_paged_inputs,
    next_power_of_2,
    topk_of_scores,
    visible_entries,
)
from dsv4.pallas.indexer_paged_mgpu import index_scores_paged_mgpu, mgpu_takes
from dsv4.pallas.select import refine_for

__all__ = ["MAX_QUERIES", "PagedScoreBlocks", "index_scores_paged", "index_scores_paged_kernel",
           "index_scores_paged_reference", "index_topk_paged"]  # fmt: skip

_MIN_DOT_DIM = 16  # `tl.dot` needs every matmul dimension >= 16


@dataclasses.dataclass(frozen=True)
class PagedScoreBlocks:
    """Tile sizes and launch parameters of `index_scores_paged`.

    block_c: keys per tile (one gather of rows through the block table, one dot per query and part); span: keys
    per program, a loop over span // block_c tiles (tiles past the request's visible keys only write -inf).
    Both powers of two, span >= block_c >= 16. num_warps, num_stages: Triton launch parameters.
    """

    block_c: int = 64
    span: int = 1024
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_c", "span"):
            value = getattr(self, name)
            if value < _MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"PagedScoreBlocks.{name}={value} must be a power of two >= {_MIN_DOT_DIM}")
        if self.span < self.block_c:
            raise ValueError(f"PagedScoreBlocks: span={self.span} must be >= block_c={self.block_c}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"PagedScoreBlocks: num_warps={self.num_warps} (1..16, a power of two), "
                             f"num_stages={self.num_stages} (>= 1)")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------
def index_scores_paged_kernel(
    q_ref,  # [S, Hi, Dk]: q's channels matching key_pages' (zero past them, Dk = next_pow2(n))
    q_rope_ref,  # [S, Hi, Dr] or None: q's RoPE channels
    weights_ref,  # [S, Hi] f32, softmax_scale folded in
    positions_ref,  # [S] int32
    table_ref,  # [max_pages] int32
    keys_ref,  # [P · R, n]: whole rows, or the e4m3 channels of split rows
    scales_ref,  # [n] or [P · R, tiles] f32, or None
    rope_ref,  # [P · R, Dr] or None
    out_init_ref,  # the aliased output buffer or None; never read
    o_ref,  # [S, span] f32
    *,
    rate: int,
    rows_per_page: int,
    block_c: int,
    scale_layout: str | None,
):
    """One program: the scores of every query of request pl.program_id(1) against keys [span_start, +span).

    Each live tile gathers block_c rows (page id from the table, row within the page), dequantizes them once and
    scores them for every query; rows no query sees are zero and their scores are replaced by -inf.
    """
    del out_init_ref
    num_queries, _, width = q_ref.shape
    span = o_ref.shape[1]
    n_tiles = span // block_c
    capacity = table_ref.shape[0] * rows_per_page
    span_start = pl.program_id(0) * span
    compute_dtype = q_ref.dtype

    per_query = []
    for t in range(num_queries):
        visible = jnp.minimum(lax.div(jnp.maximum(positions_ref[t] + 1, 0), rate), capacity)
        q_rope = None if q_rope_ref is None else plgpu.load(q_rope_ref.at[jnp.int32(t)])
        per_query.append((plgpu.load(q_ref.at[jnp.int32(t)]), q_rope, plgpu.load(weights_ref.at[jnp.int32(t)]),
                          visible))  # fmt: skip
    seen = per_query[0][3]
    for *_, visible in per_query[1:]:
        seen = jnp.maximum(seen, visible)  # keys any query of the request sees
    n_live = jnp.clip(lax.div(seen - span_start + block_c - 1, block_c), 0, n_tiles)

    def live_tile(j, carry):
        entry = span_start + j * block_c + jnp.arange(block_c)  # [block_c]
        in_bounds = entry < capacity
        wanted = entry < seen
        page = plgpu.load(table_ref.at[lax.div(entry, rows_per_page)], mask=wanted, other=0)
        row = jnp.where(wanted, page * rows_per_page + lax.rem(entry, rows_per_page), 0)
        keys = load_paged_rows(keys_ref, scales_ref, scale_layout, row, wanted, width, compute_dtype)  # [block_c, Dk]
        rope = None if rope_ref is None else load_rope_rows(rope_ref, row, wanted, compute_dtype)  # [block_c, Dr]
        dims = (((1,), (1,)), ((), ()))
        for t, (q_t, q_rope_t, w_t, visible_t) in enumerate(per_query):
            dots = lax.dot_general(keys, q_t, dims, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
            if rope is not None:
                dots = dots + lax.dot_general(rope, q_rope_t, dims, precision=lax.Precision.HIGHEST,
                                              preferred_element_type=F32)  # fmt: skip  # [block_c, Hi]
            scores = (jnp.maximum(dots, 0.0) * w_t[None, :]).sum(axis=1)  # [block_c]
            scores = jnp.where(entry < visible_t, jnp.where(scores == 0, 0.0, scores), NEG_INF)  # -0.0 → +0.0
            plgpu.store(o_ref.at[jnp.int32(t), pl.ds(j * block_c, block_c)], scores, mask=in_bounds)
        return carry

    def dead_tile(j, carry):
        in_bounds = span_start + j * block_c + jnp.arange(block_c) < capacity
        for t in range(num_queries):
            plgpu.store(o_ref.at[jnp.int32(t), pl.ds(j * block_c, block_c)], jnp.full((block_c,), NEG_INF, F32),
                        mask=in_bounds)  # fmt: skip
        return carry

    lax.fori_loop(0, n_live, live_tile, 0)
    lax.fori_loop(n_live, n_tiles, dead_tile, 0)


# ---------------------------------------------------------------------------------------------
# Public entries.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("rate", "softmax_scale", "blocks", "interpret"))
def index_scores_paged(
    q: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    key_pages: jax.Array,
    block_table: jax.Array,
    *,
    rate: int,
    softmax_scale: float,
    key_scales: jax.Array | None = None,
    key_rope_pages: jax.Array | None = None,
    blocks: PagedScoreBlocks = PagedScoreBlocks(),
    interpret: bool = False,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """The indexer's scores straight from its paged key cache. → float32 [B, S, C], C = max_pages · R: -inf where
    entry c is not visible (c >= (p + 1) // rate), -0.0 written as +0.0.

    q [B, S, Hi, Di] (S <= MAX_QUERIES), weights [B, S, Hi] (float32, before softmax_scale), positions [B, S];
    key_pages / key_scales / key_rope_pages as the module docstring lays them out, block_table [B, max_pages]
    (entries past what a request sees are never dereferenced). out_init: an aliased float32 [B, S, C] buffer for
    poisoning in tests. Grid (C / span, B).
    """
    scale_layout = check_paged_inputs(q, weights, positions, key_pages, key_scales, key_rope_pages, block_table)
    b, s, h, d = q.shape
    pages, rows, n = key_pages.shape
    capacity = block_table.shape[1] * rows
    if out_init is not None and (out_init.shape != (b, s, capacity) or out_init.dtype != F32):
        raise ValueError(f"out_init must be float32 {(b, s, capacity)}, got {out_init.dtype} {out_init.shape}")
    width = next_power_of_2(n)  # Triton tiles are powers of two: the stored channels load as a masked tile
    if scale_layout == "tile" and width == n and n % SCALE_TILE:
        width *= 2  # NOTE: whole rows narrower than a tile (test shapes) take load_paged_rows' masked path
    if not interpret and (h < _MIN_DOT_DIM or h & (h - 1) or width < _MIN_DOT_DIM):
        raise ValueError(f"q.shape={q.shape}, key channels {n}: the compiled kernel needs Hi a power of two >= "
                         f"{_MIN_DOT_DIM} and >= {_MIN_DOT_DIM} stored channels")
    q_main = jnp.pad(q[..., :n], [(0, 0)] * 3 + [(0, width - n)])  # [B, S, Hi, width]: zero past the stored part
    q_rope = None if key_rope_pages is None else q[..., n:]
    weights = weights.astype(F32) * softmax_scale
    positions = positions.astype(jnp.int32)
    span = min(blocks.span, max(blocks.block_c, next_power_of_2(capacity)))

    def flat(x):  # [P, R, ·] → [P · R, ·]: rows gathered by page · R + row
        return x.reshape(pages * rows, x.shape[-1])

    def whole(x):
        return None if x is None else pl.BlockSpec(x.shape, lambda j, i: (0,) * x.ndim)

    keys_flat = flat(key_pages)
    scales = flat(key_scales) if scale_layout == "tile" else key_scales  # float32 (checked)
    rope_flat = None if key_rope_pages is None else flat(key_rope_pages)
    out_spec = pl.BlockSpec((None, s, span), lambda j, i: (i, 0, j))
    in_specs = [
        pl.BlockSpec((None, s, h, width), lambda j, i: (i, 0, 0, 0)),  # q's stored channels
        None if q_rope is None else pl.BlockSpec((None, s, h, q_rope.shape[-1]), lambda j, i: (i, 0, 0, 0)),
        pl.BlockSpec((None, s, h), lambda j, i: (i, 0, 0)),  # weights
        pl.BlockSpec((None, s), lambda j, i: (i, 0)),  # positions
        pl.BlockSpec((None, block_table.shape[1]), lambda j, i: (i, 0)),  # the request's block table
        whole(keys_flat),
        whole(scales),
        whole(rope_flat),
        None if out_init is None else out_spec,
    ]
    args = (q_main, q_rope, weights, positions, block_table.astype(jnp.int32), keys_flat, scales, rope_flat,
            out_init)  # fmt: skip
    kernel = functools.partial(index_scores_paged_kernel, rate=rate, rows_per_page=rows, block_c=blocks.block_c,
                               scale_layout=scale_layout)  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(capacity, span), b),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((b, s, capacity), F32),
        input_output_aliases={} if out_init is None else {sum(a is not None for a in args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="index_scores_paged",
    )(*args)


@functools.partial(jax.jit, static_argnames=("rate", "k", "softmax_scale", "blocks", "group", "interpret",
                                             "selection", "ordered", "scores_impl"))  # fmt: skip
def index_topk_paged(
    q: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    key_pages: jax.Array,
    block_table: jax.Array,
    *,
    rate: int,
    k: int,
    softmax_scale: float,
    key_scales: jax.Array | None = None,
    key_rope_pages: jax.Array | None = None,
    blocks: PagedScoreBlocks = PagedScoreBlocks(),
    group: int = 4,
    interpret: bool = False,
    selection: str = "auto",
    ordered: bool = True,
    scores_impl: str = "auto",
) -> jax.Array:
    """The indexer's top-k over its paged key cache: the scores, then `dsv4.topk.top_k` (group, selection, ordered
    as `dsv4.pallas.indexer.index_topk_two_pass`: "auto" refines by the `select.py` kernel on Hopper). → int32
    [B, S, k], ordered as `index_topk` (score descending, ties to the lower index, -1 past the visible count; k may
    exceed C), or the same picks in any order (ordered=False).

    scores_impl: "triton" (`index_scores_paged`, every stored format), "mgpu" (`index_scores_paged_mgpu`: bf16 or
    f16 pages on Hopper) or "auto" (the Mosaic kernel on a Hopper GPU wherever it takes the operands)."""
    from dsv4.topk import top_k

    if scores_impl not in ("auto", "triton", "mgpu"):
        raise ValueError(f"scores_impl={scores_impl!r} must be 'auto', 'triton' or 'mgpu'")
    if scores_impl == "auto":
        mgpu = not interpret and is_hopper() and mgpu_takes(q, key_pages, key_scales, key_rope_pages)
        scores_impl = "mgpu" if mgpu else "triton"
    refine = refine_for(selection, interpret)
    if scores_impl == "mgpu":
        if key_scales is not None or key_rope_pages is not None:
            raise ValueError("scores_impl='mgpu' takes unquantized pages only (no key_scales, no key_rope_pages)")
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

        scores = index_scores_paged_mgpu(q, weights, positions, key_pages, block_table, rate=rate,
                                         softmax_scale=softmax_scale,
                                         interpret=InterpretGPUParams() if interpret else None)  # fmt: skip
    else:
        scores = index_scores_paged(q, weights, positions, key_pages, block_table, rate=rate,
                                    softmax_scale=softmax_scale, key_scales=key_scales, key_rope_pages=key_rope_pages,
                                    blocks=blocks, interpret=interpret)  # fmt: skip
    select = functools.partial(top_k, group=group, refine=refine, ordered=ordered)
    return topk_of_scores(scores, visible_entries(positions, rate, scores.shape[-1]), k, lambda x, kk: select(x, kk))


# ---------------------------------------------------------------------------------------------
# Reference: the spec, every key gathered and dequantized. Fine for small shapes only.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("rate", "softmax_scale"))
def index_scores_paged_reference(q, weights, positions, key_pages, block_table, *, rate: int, softmax_scale: float,
                                 key_scales=None, key_rope_pages=None) -> jax.Array:  # fmt: skip
    """`index_scores_paged` from the spec: every row the table lists gathered and dequantized to q's dtype (as
    `KVStore.read` does), then `indexer.index_scores_reference`. → float32 [B, S, C]."""
    check_paged_inputs(q, weights, positions, key_pages, key_scales, key_rope_pages, block_table)
    capacity = block_table.shape[1] * key_pages.shape[1]
    entry = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (q.shape[0], capacity))
    keys = gather_pages_reference(key_pages, key_scales, block_table, entry, q.dtype, rope=key_rope_pages)  # [B, C, Di]
    return index_scores_reference(q, keys, weights.astype(F32), positions, rate=rate, softmax_scale=softmax_scale)
