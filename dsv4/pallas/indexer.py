"""DeepSeek-V4 lightning indexer with a streaming top-k, as a Triton-lowered Pallas kernel, with its jnp reference.

For each query token s (position p) and each compressed indexer key c the indexer scores

    score[s, c] = softmax_scale · Σ_h weights[s, h] · ReLU(q[s, h, :] · keys[c, :])        (float32)

over the causally visible entries c < (p + 1) // rate, and keeps the `k` best per query. Layout of this file
(see dsv4/pallas/README.md):

- `BlockSizes`              tile sizes and launch parameters (frozen, validated).
- `index_topk_kernel`       the kernel body: one program = one (query block, batch row); it streams over the
                            visible keys in chunks and merges each chunk into a running top-k buffer.
- `index_topk`              the public jitted entry: checks shapes/dtypes, folds scales into the weights, calls
                            `pl.pallas_call` (`interpret=True` runs it on CPU).
- `index_topk_reference`    the spec in plain jnp (materialized [B, S, C] scores), for tests. It is
                            `dsv4.attention.index_topk_jnp` plus FP8 dequantization and k > C.

Output order (the model only needs the set, but the order is defined): descending score, ties to the lower
entry index, then -1 for the slots left when fewer than k entries are visible. This is exactly what
`lax.top_k` over the masked scores returns, so the kernel and the reference agree element for element
whenever they compute bit-identical scores. -0.0 counts as +0.0 (lax.top_k alone would order -0.0 below +0.0).
NaN scores are not supported (they break the comparison network silently).

NOTE (the top-k merge): the [S, C] score matrix is never written. A program holds a running buffer of the best
K = next_pow2(max(k, block_c)) (score, index) pairs per query, sorted best first, in registers. It scores the
visible keys `K` at a time (a "chunk", computed as K / block_c matmul sub-tiles), sorts the chunk worst first
with a bitonic network, takes the elementwise better of (buffer[i], chunk[i]) — a bitonic sequence that holds
exactly the top K of the union — and sorts that with a bitonic merge (log2 K stages). Chunks where no score
beats the buffer's current K-th best are skipped (`lax.cond`). Per key that is about log2(K)·(log2(K)+3)/4
compare-exchanges (27 at K = 512, 38 at K = 2048), branch-free and exact; docs/kernels/indexer.md has the cost.

FP8: q and/or keys may be float8_e4m3fn with float32 scales, value = float32(fp8) · scale. Scales must be > 0
(ReLU(a·x) = a·ReLU(x) needs a >= 0), which absmax scaling guarantees.
- q_scale: per tensor `()` or per (token, head) `[B, S, Hi]` (DeepSeek's act_quant with block = Di).
  Folded into the weights: w · q_scale.
- k_scale: per tensor `()` (folded into the weights) or per entry `[B, C]` (multiplies score column c).
When both are FP8 the matmul runs in FP8 (f32 accumulate); when one is, it is upcast to the other's dtype
(exact: e4m3 ⊂ bf16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv4.pallas.indexer_common import (
    F32,
    FP8,
    NEG_INF,
    check_index_inputs,
    fold_scales,
    next_power_of_2,
    topk_of_scores,
    visible_entries,
)
from dsv4.pallas.indexer_slab import index_slab_rows
from dsv4.pallas.select import refine_for

__all__ = [
    "BlockSizes",
    "ScoreBlocks",
    "index_scores",
    "index_scores_kernel",
    "index_scores_reference",
    "index_topk",
    "index_topk_kernel",
    "index_topk_reference",
    "index_topk_two_pass",
    "one_band_per_call",
]

# Index of an empty buffer slot or an invisible entry: sorts after every real entry of equal (-inf) score.
_SENTINEL = jnp.iinfo(jnp.int32).max
# NOTE: `tl.dot` needs every matmul dimension >= 16, so compiled tiles need block_q · Hi >= 16 and block_c >= 16.
_MIN_DOT_DIM = 16
_DEFAULT_TILE_ROWS = 64  # matmul rows (tokens × heads) per program when block_q is left to the default


def _is_power_of_2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of `index_topk`.

    block_q:  query tokens per program. None: max(1, 64 // Hi) (1 token × 64 heads for V4). Matmul rows
              M = block_q · Hi (token-major); the running top-k buffer is [block_q, K] scores + indices.
    block_c:  keys per matmul sub-tile ([M, Di] × [Di, block_c]). The merge chunk is K = next_pow2(max(k,
              block_c)) keys, i.e. K / block_c sub-tiles per merge.
    num_warps, num_stages: Triton launch parameters (None: 8 warps when M · block_c >= 8192, else 4; 2 stages).

    All sizes are powers of two (Triton tensor shapes must be). Defaults are picked for Hi = 64, Di = 128 on
    H200, not measured: the [64, 64] f32 score tile is 32 registers per thread at the default 4 warps; the K = 512
    buffer (scores + indices, one query) is 4 KiB.
    """

    block_q: int | None = None
    block_c: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        if self.block_q is not None and not _is_power_of_2(self.block_q):
            raise ValueError(f"BlockSizes.block_q={self.block_q} must be None or a power of two")
        if not _is_power_of_2(self.block_c) or self.block_c < _MIN_DOT_DIM:
            raise ValueError(f"BlockSizes.block_c={self.block_c} must be a power of two >= {_MIN_DOT_DIM}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 1")

    def tile(self, num_heads: int) -> int:
        """→ block_q for an indexer with `num_heads` heads."""
        return self.block_q if self.block_q is not None else max(1, _DEFAULT_TILE_ROWS // num_heads)


# ---------------------------------------------------------------------------------------------
# Input checks shared by the kernel entry and the reference.
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Reference: the spec, with the [B, S, C] scores materialized. Fine for small shapes only.
# ---------------------------------------------------------------------------------------------
def _reference_scores(q, keys, weights, positions, *, rate, softmax_scale, q_scale, k_scale, q_layout, k_layout):
    """[B, S, C] float32 scores, -inf where invisible, -0.0 → +0.0 (shared by both references)."""
    if q_layout is not None:
        scale = q_scale if q_layout == "tensor" else q_scale[..., None]  # [] or [B, S, Hi, 1]
        q = q.astype(F32) * scale
    if k_layout is not None:
        scale = k_scale if k_layout == "tensor" else k_scale[..., None]  # [] or [B, C, 1]
        keys = keys.astype(F32) * scale
    if q.dtype != keys.dtype:
        q, keys = q.astype(F32), keys.astype(F32)
    c = keys.shape[1]
    dots = jnp.einsum("bqhd,bcd->bqhc", q, keys, preferred_element_type=F32)  # [B, S, Hi, C]
    scores = jnp.einsum("bqhc,bqh->bqc", jax.nn.relu(dots) * softmax_scale, weights)  # [B, S, C]
    scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 → +0.0 (lax.top_k orders -0.0 below +0.0)
    visible = visible_entries(positions, rate, c)  # [B, S]
    return jnp.where(jnp.arange(c) < visible[..., None], scores, NEG_INF)


@functools.partial(jax.jit, static_argnames=("rate", "softmax_scale"))
def index_scores_reference(q, keys, weights, positions, *, rate: int, softmax_scale: float, q_scale=None,
                           k_scale=None) -> jax.Array:  # fmt: skip
    """The indexer's scores straight from the spec (arguments as `index_scores`). → float32 [B, S, C], -inf where
    the entry is not visible to the query."""
    q_layout, k_layout = check_index_inputs(q, keys, weights, positions, rate=rate, k=1, q_scale=q_scale,
                                       k_scale=k_scale)  # fmt: skip
    return _reference_scores(q, keys, weights, positions, rate=rate, softmax_scale=softmax_scale, q_scale=q_scale,
                             k_scale=k_scale, q_layout=q_layout, k_layout=k_layout)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("rate", "k", "softmax_scale"))
def index_topk_reference(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    *,
    rate: int,
    k: int,
    softmax_scale: float,
    q_scale: jax.Array | None = None,
    k_scale: jax.Array | None = None,
) -> jax.Array:
    """Lightning indexer top-k straight from the spec (same arguments as `index_topk`). → int32 [B, S, k].

    Numerics follow `dsv4.attention.index_topk_jnp`: f32 dots, ReLU · softmax_scale, head-weighted f32 sum,
    `lax.top_k` (ties to the lower index). FP8 inputs are dequantized to float32 first. k may exceed C.
    """
    q_layout, k_layout = check_index_inputs(q, keys, weights, positions, rate=rate, k=k, q_scale=q_scale,
                                       k_scale=k_scale)  # fmt: skip
    scores = _reference_scores(q, keys, weights, positions, rate=rate, softmax_scale=softmax_scale, q_scale=q_scale,
                               k_scale=k_scale, q_layout=q_layout, k_layout=k_layout)  # fmt: skip
    return topk_of_scores(scores, visible_entries(positions, rate, keys.shape[1]), k, lax.top_k)


# ---------------------------------------------------------------------------------------------
# Bitonic network on (score, index) pairs, row-wise on [R, N] arrays (N a power of two).
# ---------------------------------------------------------------------------------------------
def _better(v1, i1, v2, i2):
    """(v1, i1) ranks before (v2, i2): higher score, ties to the lower index."""
    return (v1 > v2) | ((v1 == v2) & (i1 < i2))


def _compare_exchange(values, indices, stride: int, best_first):
    """One bitonic stage: pairs (i, i + stride) within groups of 2·stride. values/indices: [R, N].

    best_first: bool, broadcastable to [1, N // (2·stride), 1, 1] — the order each group leaves in.
    NOTE: the pair halves come from `jnp.split` over a size-2 axis, which the Triton lowering turns into
    `tt.split` (it cannot slice register tensors); masked sums work too but compile 3× slower in the interpreter.
    """
    r, n = values.shape
    shape = (r, n // (2 * stride), 2, stride)
    v1, v2 = jnp.split(values.reshape(shape), 2, axis=2)  # [R, G, 1, stride] each
    i1, i2 = jnp.split(indices.reshape(shape), 2, axis=2)
    # For distinct pairs better(2, 1) == not better(1, 2); equal pairs (empty slots) are identical, so swapping
    # them is harmless. Hence one comparison serves both directions.
    swap = _better(v2, i2, v1, i1) == best_first  # [R, G, 1, stride]
    keep_first = (lax.broadcasted_iota(jnp.int32, (1, 1, 2, 1), 2) == 0) != swap  # [R, G, 2, stride]
    values = jnp.where(keep_first, v1, v2).reshape(r, n)
    indices = jnp.where(keep_first, i1, i2).reshape(r, n)
    return values, indices


def _bitonic_sort_worst_first(values, indices):
    """Full bitonic sort of each row, worst first. [R, N] → [R, N]; log2(N)·(log2(N)+1)/2 stages."""
    n = values.shape[1]
    size = 2
    while size <= n:
        stride = size // 2
        while stride >= 1:
            group_start = lax.broadcasted_iota(jnp.int32, (1, n // (2 * stride), 1, 1), 1) * (2 * stride)
            best_first = (group_start & size) != 0  # alternate directions build bitonic runs; the last pass is one run
            values, indices = _compare_exchange(values, indices, stride, best_first)
            stride //= 2
        size *= 2
    return values, indices


def _bitonic_merge_best_first(values, indices):
    """Sorts rows that are bitonic (e.g. V-shaped), best first. [R, N] → [R, N]; log2(N) stages."""
    stride = values.shape[1] // 2
    while stride >= 1:
        values, indices = _compare_exchange(values, indices, stride, True)
        stride //= 2
    return values, indices


def _merge_chunk(buffer, chunk):
    """Top-K of buffer ∪ chunk, best first. buffer: sorted best first; chunk: any order. Each ([R, K], [R, K]).

    With the buffer best-first and the chunk worst-first, the better of each aligned pair is a bitonic sequence
    holding exactly the top K of the union (the classic bitonic top-k step); a bitonic merge then sorts it.
    """
    chunk_v, chunk_i = _bitonic_sort_worst_first(*chunk)
    buf_v, buf_i = buffer
    take_buffer = _better(buf_v, buf_i, chunk_v, chunk_i)
    return _bitonic_merge_best_first(jnp.where(take_buffer, buf_v, chunk_v), jnp.where(take_buffer, buf_i, chunk_i))


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------
def index_topk_kernel(
    q_ref,  # [block_q, Hi, Di]
    weights_ref,  # [block_q, Hi] f32, softmax_scale and per-tensor / per-(token, head) scales folded in
    positions_ref,  # [block_q]
    keys_ref,  # [C, Di]
    k_scale_ref,  # [C] f32 per-entry scales, or None
    out_init_ref,  # the aliased output buffer or None; never read
    o_ref,  # [block_q, k]
    *,
    seq_len: int,
    rate: int,
    k: int,
    chunk: int,
    block_c: int,
    compute_dtype,
):
    """One program: the top-k entries of block_q query tokens of one batch row, streaming over their keys.

    The running buffer ([block_q, K] scores and indices, best first) starts empty: (-inf, sentinel). Keys are
    scored `chunk` (= K) at a time in block_c-wide sub-tiles; a chunk is merged only when some of its scores beat
    the buffer's K-th best (keys arrive in increasing index order, so an equal score never wins a tie).
    """
    del out_init_ref
    block_q, num_heads, head_dim = q_ref.shape
    rows = block_q * num_heads
    num_entries = keys_ref.shape[0]
    n_sub = chunk // block_c

    token = pl.program_id(0) * block_q + jnp.arange(block_q)  # [block_q]
    token_valid = token < seq_len  # the last query block may overhang S
    q = plgpu.load(q_ref, mask=token_valid[:, None, None]).astype(compute_dtype)  # [block_q, Hi, Di]
    q = q.reshape(rows, head_dim)  # [M, Di], row = t · Hi + h
    weights = plgpu.load(weights_ref, mask=token_valid[:, None], other=0.0)  # [block_q, Hi]
    positions = plgpu.load(positions_ref, mask=token_valid, other=-1)  # [block_q]
    visible = jnp.minimum(lax.div(jnp.maximum(positions + 1, 0), rate), num_entries)  # [block_q]
    max_visible = visible.max()

    def score_sub_tile(t, carry, chunk_start):
        """Scores keys [chunk_start + t·block_c, +block_c) and writes them into sub-tile t of the chunk."""
        chunk_v, chunk_i = carry  # [block_q, n_sub, block_c]
        start = chunk_start + t * block_c
        entry = start + jnp.arange(block_c)  # [block_c]
        in_bounds = entry < num_entries
        keys = plgpu.load(keys_ref.at[pl.ds(start, block_c), :], mask=in_bounds[:, None])  # [block_c, Di]
        dots = lax.dot_general(q, keys.astype(compute_dtype), (((1,), (1,)), ((), ())),
                               precision=lax.Precision.HIGHEST, preferred_element_type=F32)  # fmt: skip  # [M, block_c]
        dots = jnp.maximum(dots, 0.0).reshape(block_q, num_heads, block_c)
        scores = (dots * weights[:, :, None]).sum(axis=1)  # [block_q, block_c]
        if k_scale_ref is not None:
            scores = scores * plgpu.load(k_scale_ref.at[pl.ds(start, block_c)], mask=in_bounds, other=0.0)[None, :]
        valid = entry[None, :] < visible[:, None]  # [block_q, block_c]; also masks the overhang rows and C
        scores = jnp.where(valid, jnp.where(scores == 0, 0.0, scores), NEG_INF)  # -0.0 → +0.0, as the reference
        entries = jnp.where(valid, entry[None, :], _SENTINEL)
        here = lax.broadcasted_iota(jnp.int32, (1, n_sub, 1), 1) == t  # [1, n_sub, 1]
        return jnp.where(here, scores[:, None, :], chunk_v), jnp.where(here, entries[:, None, :], chunk_i)

    def chunk_body(j, buffer):
        chunk_start = j * chunk
        empty = (jnp.full((block_q, n_sub, block_c), NEG_INF, F32),
                 jnp.full((block_q, n_sub, block_c), _SENTINEL, jnp.int32))  # fmt: skip
        n_tiles = jnp.minimum(lax.div(max_visible - chunk_start + block_c - 1, block_c), n_sub)
        chunk_v, chunk_i = lax.fori_loop(0, n_tiles, functools.partial(score_sub_tile, chunk_start=chunk_start), empty)
        chunk_v, chunk_i = chunk_v.reshape(block_q, chunk), chunk_i.reshape(block_q, chunk)
        kth_best = buffer[0].min(axis=1)  # [block_q]; the buffer's worst entry
        improves = (chunk_v > kth_best[:, None]).astype(jnp.int32).max()
        return lax.cond(improves > 0, lambda: _merge_chunk(buffer, (chunk_v, chunk_i)), lambda: buffer)

    buffer = (jnp.full((block_q, chunk), NEG_INF, F32), jnp.full((block_q, chunk), _SENTINEL, jnp.int32))
    _, best = lax.fori_loop(0, lax.div(max_visible + chunk - 1, chunk), chunk_body, buffer)
    best = jnp.where(best == _SENTINEL, -1, best)  # [block_q, K]
    column = jnp.arange(chunk)
    plgpu.store(o_ref.at[:, pl.ds(0, chunk)], best, mask=token_valid[:, None] & (column < k)[None, :])


# ---------------------------------------------------------------------------------------------
# Public entry.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("rate", "k", "softmax_scale", "block_sizes", "interpret"))
def index_topk(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    *,
    rate: int,
    k: int,
    softmax_scale: float,
    q_scale: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """Lightning-indexer top-k without materializing the scores. → int32 [B, S, k].

    q:         [B, S, Hi, Di] indexer queries (bf16 / f16 / f32 / float8_e4m3fn with q_scale; Hi, Di powers of two)
    keys:      [B, C, Di]     compressed indexer keys (q.dtype, or float8_e4m3fn with k_scale)
    weights:   [B, S, Hi]     float32 per-head weights
    positions: [B, S] int32   global query positions; entry c is visible iff c < (p + 1) // rate
    rate:      compression rate of the keys (4 for CSA)
    k:         entries kept per query (index_topk); may exceed C; slots past the visible count are -1
    softmax_scale: the scores' scale (Di ** -0.5 in the model)
    q_scale:   float32 () or [B, S, Hi], only with FP8 q; k_scale: float32 () or [B, C], only with FP8 keys
    block_sizes: tiles and launch parameters; interpret: run the kernel in the Pallas interpreter (CPU).
    out_init:  testing hook; the output buffer starts as this int32 [B, S, k] array (aliased), so any element the
               kernel fails to write keeps its value (pass an impossible index to poison).

    Output rows are sorted by descending score, ties to the lower index, -1 last (see the module docstring).
    Grid (nQ, B), query blocks first (the launch's x axis, the only one not capped at 65535).
    """
    q_layout, k_layout = check_index_inputs(q, keys, weights, positions, rate=rate, k=k, q_scale=q_scale,
                                       k_scale=k_scale)  # fmt: skip
    b, s, h, d = q.shape
    c = keys.shape[1]
    if not _is_power_of_2(h) or not _is_power_of_2(d) or d < _MIN_DOT_DIM:
        raise ValueError(f"q.shape={q.shape}: Hi must be a power of two and Di a power of two >= {_MIN_DOT_DIM}")
    block_q = block_sizes.tile(h)
    if not interpret and block_q * h < _MIN_DOT_DIM:
        raise ValueError(f"matmul rows block_q * Hi = {block_q} * {h} < {_MIN_DOT_DIM} for q.shape={q.shape}")
    if out_init is not None and (out_init.shape != (b, s, k) or out_init.dtype != jnp.int32):
        raise ValueError(f"out_init must be int32 {(b, s, k)}, got {out_init.dtype} {out_init.shape}")

    weights, k_scale = fold_scales(weights, softmax_scale, q_scale, k_scale, q_layout, k_layout)
    compute_dtype = keys.dtype if q.dtype == FP8 else q.dtype  # both FP8: an FP8 matmul; one: upcast it

    chunk = next_power_of_2(max(k, block_sizes.block_c))
    grid = (pl.cdiv(s, block_q), b)
    out_spec = pl.BlockSpec((None, block_q, k), lambda i, j: (j, i, 0))
    in_specs = [
        pl.BlockSpec((None, block_q, h, d), lambda i, j: (j, i, 0, 0)),  # q
        pl.BlockSpec((None, block_q, h), lambda i, j: (j, i, 0)),  # weights
        pl.BlockSpec((None, block_q), lambda i, j: (j, i)),  # positions
        pl.BlockSpec((None, c, d), lambda i, j: (j, 0, 0)),  # keys
        None if k_scale is None else pl.BlockSpec((None, c), lambda i, j: (j, 0)),  # k_scale
        None if out_init is None else out_spec,
    ]
    args = (q, weights, positions, keys, k_scale, out_init)
    kernel = functools.partial(index_topk_kernel, seq_len=s, rate=rate, k=k, chunk=chunk,
                               block_c=block_sizes.block_c, compute_dtype=compute_dtype)  # fmt: skip
    num_warps = block_sizes.num_warps or (8 if block_q * h * block_sizes.block_c >= 8192 else 4)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((b, s, k), jnp.int32),
        # pallas_call numbers inputs after dropping the Nones
        input_output_aliases={} if out_init is None else {sum(a is not None for a in args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="index_topk",
    )(*args)


# ---------------------------------------------------------------------------------------------
# Two passes: a scores kernel over a block of queries, then an exact grouped top-k (dsv4.topk).
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScoreBlocks:
    """Tile sizes and launch parameters of `index_scores`.

    block_q:  query tokens per program.
    block_c:  keys per matmul tile; span: keys per program (a loop over span // block_c tiles, pipelined by
              Triton with num_stages buffers), so the token's q tile is loaded once per span.
    rows:     which operand forms the matmul's rows. "keys": per token a [block_c, Di] × [Di, Hi] dot; the head
              sum runs along the accumulator's columns (within a warp). "queries": one [block_q·Hi, Di] ×
              [Di, block_c] dot; the head sum runs across rows (through shared memory).
    q_transposed: rows="keys" only: q goes to the kernel as [B, S, Di, Hi] (one XLA transpose per chunk), so the
              dot's second operand is [K, N] as loaded instead of a transposed [N, K] tile.
    num_warps, num_stages: Triton launch parameters.

    block_q, block_c and span are powers of two with span >= block_c >= 16.
    """

    block_q: int = 2
    block_c: int = 128
    span: int = 1024
    rows: str = "keys"
    q_transposed: bool = False
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_c", "span"):
            if not _is_power_of_2(getattr(self, name)):
                raise ValueError(f"ScoreBlocks.{name}={getattr(self, name)} must be a power of two")
        if self.block_c < _MIN_DOT_DIM or self.span < self.block_c:
            raise ValueError(f"ScoreBlocks: need span >= block_c >= {_MIN_DOT_DIM}, got block_c={self.block_c}, "
                             f"span={self.span}")  # fmt: skip
        if self.rows not in ("keys", "queries"):
            raise ValueError(f"ScoreBlocks.rows={self.rows!r} must be 'keys' or 'queries'")
        if self.q_transposed and self.rows != "keys":
            raise ValueError("ScoreBlocks.q_transposed needs rows='keys'")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"ScoreBlocks: num_warps={self.num_warps} (1..16, a power of two), "
                             f"num_stages={self.num_stages} (>= 1)")  # fmt: skip


def index_scores_kernel(
    q_ref,  # [block_q, Hi, Di], or [block_q, Di, Hi] (q_transposed)
    weights_ref,  # [block_q, Hi] f32, softmax_scale and per-tensor / per-(token, head) scales folded in
    positions_ref,  # [block_q]
    keys_ref,  # [C, Di]
    k_scale_ref,  # [C] f32 per-entry scales, or None
    out_init_ref,  # the aliased output buffer or None; never read
    o_ref,  # [block_q, span] f32
    *,
    seq_len: int,
    rate: int,
    block_c: int,
    rows: str,
    q_transposed: bool,
    compute_dtype,
):
    """One program: scores of block_q query tokens against `span` consecutive keys, -inf where not visible.

    Key tiles past the block's last visible entry are not computed, only filled with -inf.
    """
    del out_init_ref
    block_q, num_heads, head_dim = q_ref.shape
    if q_transposed:
        head_dim, num_heads = num_heads, head_dim
    span = o_ref.shape[1]
    num_entries = keys_ref.shape[0]
    n_tiles = span // block_c
    span_start = pl.program_id(1) * span

    token = pl.program_id(0) * block_q + jnp.arange(block_q)  # [block_q]
    token_valid = token < seq_len  # the last query block may overhang S
    positions = plgpu.load(positions_ref, mask=token_valid, other=-1)  # [block_q]
    visible = jnp.minimum(lax.div(jnp.maximum(positions + 1, 0), rate), num_entries)  # [block_q]; 0 for overhang
    n_live = jnp.clip(lax.div(visible.max() - span_start + block_c - 1, block_c), 0, n_tiles)

    def tile_keys(j):
        entry = span_start + j * block_c + jnp.arange(block_c)  # [block_c]
        in_bounds = entry < num_entries
        keys = plgpu.load(keys_ref.at[pl.ds(span_start + j * block_c, block_c), :], mask=in_bounds[:, None])
        keys = keys.astype(compute_dtype)  # [block_c, Di]; rows past C are garbage, their scores never stored
        k_scale = None
        if k_scale_ref is not None:
            k_scale = plgpu.load(k_scale_ref.at[pl.ds(span_start + j * block_c, block_c)], mask=in_bounds, other=0.0)
        return entry, in_bounds, keys, k_scale

    def finish(scores, valid):  # -0.0 → +0.0 (as the reference), -inf where not visible
        return jnp.where(valid, jnp.where(scores == 0, 0.0, scores), NEG_INF)

    if rows == "keys":
        # Per token: its q tile, weights and visible count (scalars come from masked reductions: Triton cannot
        # index a register tensor).
        per_token = []
        for t in range(block_q):
            here = jnp.arange(block_q) == t
            valid_t = (here & token_valid).astype(jnp.int32).max() > 0
            q_t = plgpu.load(q_ref.at[jnp.int32(t)], mask=jnp.full(q_ref.shape[1:], valid_t))  # [Hi, Di] / [Di, Hi]
            w_t = plgpu.load(weights_ref.at[jnp.int32(t)], mask=jnp.full((num_heads,), valid_t), other=0.0)
            per_token.append((q_t.astype(compute_dtype), w_t, jnp.where(here, visible, 0).max(), valid_t))

        def live_tile(j, carry):
            entry, in_bounds, keys, k_scale = tile_keys(j)
            for t, (q_t, w_t, visible_t, valid_t) in enumerate(per_token):
                dots = lax.dot_general(keys, q_t, (((1,), (0 if q_transposed else 1,)), ((), ())),
                                       precision=lax.Precision.HIGHEST, preferred_element_type=F32)  # [block_c, Hi]
                scores = (jnp.maximum(dots, 0.0) * w_t[None, :]).sum(axis=1)  # [block_c]
                if k_scale is not None:
                    scores = scores * k_scale
                plgpu.store(o_ref.at[jnp.int32(t), pl.ds(j * block_c, block_c)], finish(scores, entry < visible_t),
                            mask=in_bounds & valid_t)  # fmt: skip
            return carry

        def dead_tile(j, carry):
            in_bounds = span_start + j * block_c + jnp.arange(block_c) < num_entries
            for t, (_, _, _, valid_t) in enumerate(per_token):
                plgpu.store(o_ref.at[jnp.int32(t), pl.ds(j * block_c, block_c)], jnp.full((block_c,), NEG_INF, F32),
                            mask=in_bounds & valid_t)  # fmt: skip
            return carry
    else:
        q = plgpu.load(q_ref, mask=token_valid[:, None, None]).astype(compute_dtype)
        q = q.reshape(block_q * num_heads, head_dim)  # [M, Di], row = t · Hi + h
        weights = plgpu.load(weights_ref, mask=token_valid[:, None], other=0.0)  # [block_q, Hi]

        def live_tile(j, carry):
            entry, in_bounds, keys, k_scale = tile_keys(j)
            dots = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                   preferred_element_type=F32)  # fmt: skip  # [M, block_c]
            dots = jnp.maximum(dots, 0.0).reshape(block_q, num_heads, block_c)
            scores = (dots * weights[:, :, None]).sum(axis=1)  # [block_q, block_c]
            if k_scale is not None:
                scores = scores * k_scale[None, :]
            plgpu.store(o_ref.at[:, pl.ds(j * block_c, block_c)], finish(scores, entry[None, :] < visible[:, None]),
                        mask=token_valid[:, None] & in_bounds[None, :])  # fmt: skip
            return carry

        def dead_tile(j, carry):
            in_bounds = span_start + j * block_c + jnp.arange(block_c) < num_entries
            plgpu.store(o_ref.at[:, pl.ds(j * block_c, block_c)], jnp.full((block_q, block_c), NEG_INF, F32),
                        mask=token_valid[:, None] & in_bounds[None, :])  # fmt: skip
            return carry

    lax.fori_loop(0, n_live, live_tile, 0)
    lax.fori_loop(n_live, n_tiles, dead_tile, 0)


@functools.partial(jax.jit, static_argnames=("rate", "softmax_scale", "blocks", "interpret"))
def index_scores(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    *,
    rate: int,
    softmax_scale: float,
    q_scale: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    blocks: ScoreBlocks = ScoreBlocks(),
    interpret: bool = False,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """The indexer's scores for a block of queries. → float32 [B, S, C]: -inf where entry c is not visible
    (c >= (p + 1) // rate), -0.0 written as +0.0.

    Arguments as `index_topk` (q, keys, weights, positions, rate, softmax_scale, q_scale, k_scale, interpret,
    out_init: an aliased float32 [B, S, C] buffer for poisoning in tests). Grid (nQ, nSpan, B).
    Callers bound the [S, C] output by passing a chunk of the queries at a time (`index_topk_two_pass`).
    """
    q_layout, k_layout = check_index_inputs(q, keys, weights, positions, rate=rate, k=1, q_scale=q_scale,
                                       k_scale=k_scale)  # fmt: skip
    b, s, h, d = q.shape
    c = keys.shape[1]
    if not _is_power_of_2(h) or not _is_power_of_2(d) or d < _MIN_DOT_DIM or (h < _MIN_DOT_DIM and not interpret):
        raise ValueError(f"q.shape={q.shape}: Hi and Di must be powers of two >= {_MIN_DOT_DIM}")
    if out_init is not None and (out_init.shape != (b, s, c) or out_init.dtype != F32):
        raise ValueError(f"out_init must be float32 {(b, s, c)}, got {out_init.dtype} {out_init.shape}")
    weights, k_scale = fold_scales(weights, softmax_scale, q_scale, k_scale, q_layout, k_layout)
    compute_dtype = keys.dtype if q.dtype == FP8 else q.dtype  # both FP8: an FP8 matmul; one: upcast it
    bq, span = blocks.block_q, min(blocks.span, max(blocks.block_c, next_power_of_2(c)))
    out_spec = pl.BlockSpec((None, bq, span), lambda i, j, n: (n, i, j))
    in_specs = [
        pl.BlockSpec((None, bq, h, d), lambda i, j, n: (n, i, 0, 0)),  # q
        pl.BlockSpec((None, bq, h), lambda i, j, n: (n, i, 0)),  # weights
        pl.BlockSpec((None, bq), lambda i, j, n: (n, i)),  # positions
        pl.BlockSpec((None, c, d), lambda i, j, n: (n, 0, 0)),  # keys
        None if k_scale is None else pl.BlockSpec((None, c), lambda i, j, n: (n, 0)),  # k_scale
        None if out_init is None else out_spec,
    ]
    if weights.shape != (b, s, h):
        weights = jnp.broadcast_to(weights, (b, s, h))
    if blocks.q_transposed:
        q = jnp.swapaxes(q, 2, 3)  # [B, S, Di, Hi]
        in_specs[0] = pl.BlockSpec((None, bq, d, h), lambda i, j, n: (n, i, 0, 0))
    args = (q, weights, positions, keys, k_scale, out_init)
    kernel = functools.partial(index_scores_kernel, seq_len=s, rate=rate, block_c=blocks.block_c, rows=blocks.rows,
                               q_transposed=blocks.q_transposed, compute_dtype=compute_dtype)  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(s, bq), pl.cdiv(c, span), b),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((b, s, c), F32),
        input_output_aliases={} if out_init is None else {sum(a is not None for a in args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="index_scores",
    )(*args)


def default_query_chunk(num_entries: int, batch: int = 1) -> int:
    """The most queries an `index_topk_two_pass` step takes: the float32 [B, chunk, C] scores stay within 512 MiB
    (`indexer_slab.INDEX_SLAB_BYTES`, which the memory plan counts), 128..4096, a multiple of 128."""
    return index_slab_rows(num_entries, batch)


def band_widths(num_entries: int, bands: int, align: int = 64) -> tuple[int, ...]:
    """The static slab widths of `index_topk_two_pass`: C · j / bands for j = 1 .. bands, rounded up to `align`
    (the scores kernels' key tile) and capped at C, without repeats. The last is always C."""
    ceil = lambda x, m: -(-x // m)  # noqa: E731
    return tuple(sorted({min(ceil(ceil(num_entries * j, bands), align) * align, num_entries)
                         for j in range(1, bands + 1)}))  # fmt: skip


def one_band_per_call(num_queries: int, rate: int, num_entries: int, bands: int) -> bool:
    """Whether `index_topk_two_pass` should choose one width band for a call of `num_queries` contiguous positions:
    they then see at most one band's step more than each other. Callers whose queries are not contiguous (a
    sequence shard of a zigzag layout) pass the extent their positions span instead."""
    return -(-num_queries // rate) <= band_widths(num_entries, bands)[0]


@functools.partial(jax.jit, static_argnames=("rate", "k", "softmax_scale", "query_chunk", "blocks", "group",
                                             "interpret", "scores_impl", "mgpu_config", "width_bands",
                                             "selection", "call_band", "ordered"))  # fmt: skip
def index_topk_two_pass(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    *,
    rate: int,
    k: int,
    softmax_scale: float,
    q_scale: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    query_chunk: int | None = None,
    blocks: ScoreBlocks = ScoreBlocks(),
    group: int = 4,
    interpret: bool = False,
    scores_impl: str = "triton",
    mgpu_config=None,
    width_bands: int = 1,
    selection: str = "auto",
    call_band: bool | None = None,
    ordered: bool = True,
) -> jax.Array:
    """`index_topk` in two passes per chunk of queries: the scores kernel writes a [B, chunk, C] float32 slab
    (never the whole [S, C]), then `dsv4.topk.top_k` picks exactly what `lax.top_k` would while sorting only about
    k · group elements per query. → int32 [B, S, k], ordered as `index_topk` (score desc, ties to the lower index,
    -1 past the visible count).

    query_chunk: queries per step (None: as many as a 512 MiB float32 slab of the keys scored holds,
    `default_query_chunk`, evened out over the steps); group: `dsv4.topk.top_k`'s group
    size. scores_impl: "triton" (`index_scores`, any dtype) or "mgpu" (`dsv4.pallas.indexer_mgpu.index_scores_mgpu`:
    e4m3 or bf16 q and keys, Hi = 64, Hopper; `mgpu_config` its MgpuScoreConfig, None for the dtype's default; with
    `interpret` it runs in the Mosaic GPU interpreter). Other arguments as `index_topk`.

    width_bands: a chunk whose queries see at most n entries is scored and searched over only the first W keys,
    the narrowest of `band_widths(C, width_bands)` that holds n (a `lax.switch` over the bands' programs). Causal
    chunks early in a prompt then skip the invisible columns: with 4 bands the slabs average 5/8 of C instead of
    all of it, at the cost of one compile per band (docs/kernels/indexer.md). When the call's S queries span no
    more than the narrowest band (S / rate <= C / width_bands: a prefill chunk of a long prompt), one band serves
    the whole call, chosen once (`call_band`: None decides so by `one_band_per_call`, assuming contiguous
    positions; True / False force one band a call / a band per query chunk; the indices are the same). 1 (off) by
    default here; the model's FP8 indexer on a Hopper GPU (`dsv4.attention.index_topk_fp8`) passes 4.

    selection: how `dsv4.topk.top_k` refines each level: "xla" (a sort of the chosen group ids, a gather and
    `lax.top_k`), "kernel" (`dsv4.pallas.select.refine_top_k`, one pass; interpreted with `interpret`), or "auto"
    (the default: "kernel" on a Hopper GPU, where it is the faster, whatever computes the scores; "xla"
    elsewhere). The same picks either way.

    ordered=False: each query's same k picks in no particular order (its -1s anywhere among them), for a caller that
    uses them as a set, as the attention does: the refinement kernel then skips the last level's sort of the chosen
    groups and the top-k that puts its picks best first (two sorts of k per query). "xla" picks come ordered anyway.
    """
    from dsv4.topk import top_k

    check_index_inputs(q, keys, weights, positions, rate=rate, k=k, q_scale=q_scale, k_scale=k_scale)
    b, s = positions.shape
    c = keys.shape[1]
    per_token_q_scale = q_scale is not None and q_scale.ndim == 3
    if scores_impl not in ("triton", "mgpu"):
        raise ValueError(f"scores_impl={scores_impl!r} must be 'triton' or 'mgpu'")
    if width_bands < 1:
        raise ValueError(f"width_bands={width_bands} must be >= 1")
    refine = refine_for(selection, interpret)
    widths = band_widths(c, width_bands)
    row_k_scale = k_scale is not None and k_scale.ndim == 2

    def chunk_at_width(width, qc, wc, pc, qsc):
        """Top-k of one chunk over the first `width` keys (its queries see no further)."""
        keys_w = keys[:, :width]
        k_scale_w = k_scale[:, :width] if row_k_scale else k_scale
        if scores_impl == "mgpu":
            from jax.experimental.pallas import mosaic_gpu as plmgpu

            from dsv4.pallas.indexer_mgpu import index_scores_mgpu

            scores = index_scores_mgpu(qc, keys_w, wc, pc, rate=rate, softmax_scale=softmax_scale, q_scale=qsc,
                                       k_scale=k_scale_w, config=mgpu_config,
                                       interpret=plmgpu.InterpretGPUParams() if interpret else None)  # fmt: skip
        else:
            scores = index_scores(qc, keys_w, wc, pc, rate=rate, softmax_scale=softmax_scale, q_scale=qsc,
                                  k_scale=k_scale_w, blocks=blocks, interpret=interpret)  # fmt: skip
        select = functools.partial(top_k, group=group, refine=refine, ordered=ordered)
        return topk_of_scores(scores, visible_entries(pc, rate, width), k, lambda x, kk: select(x, kk))

    def band_of(pos):  # the narrowest width that holds every entry these queries see
        return jnp.sum(jnp.asarray(widths, jnp.int32) < jnp.max(visible_entries(pos, rate, c)))

    def all_chunks(width=None):
        """Every query, `chunk` at a time, over the first `width` keys; None: each chunk in its own band."""
        chunk = min(query_chunk or default_query_chunk(width or c, b), s)
        n_chunks = -(-s // chunk)
        # as many steps, evenly filled (less padding in the last), in whole 16-query tiles of the scores kernels
        chunk = min((-(-s // n_chunks) + 15) // 16 * 16, chunk)
        n_chunks = -(-s // chunk)
        pad = n_chunks * chunk - s

        def split(x, fill):  # [B, S, ...] → [n_chunks, B, chunk, ...]; padding queries (position -1) see nothing
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
            return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

        def one_chunk(args):
            qc, wc, pc, qsc = args
            qsc = qsc if per_token_q_scale else q_scale
            if width is not None or len(widths) == 1:
                return chunk_at_width(width or c, qc, wc, pc, qsc)
            branches = [functools.partial(chunk_at_width, w) for w in widths]
            return lax.switch(band_of(pc), branches, qc, wc, pc, qsc)

        xs = (split(q, 0), split(weights, 0), split(positions, -1),
              split(q_scale, 1) if per_token_q_scale else jnp.zeros((n_chunks,), F32))  # fmt: skip
        # One chunk (every decode step) runs straight, not as a one-trip loop: on a GPU XLA drives a while loop from
        # the host, with a predicate copy back each trip.
        if n_chunks == 1:
            out = one_chunk(jax.tree.map(lambda a: a[0], xs))[None]
        else:
            out = lax.map(one_chunk, xs)
        return jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * chunk, k)[:, :s]

    if call_band is None:
        call_band = one_band_per_call(s, rate, c, width_bands)
    if len(widths) > 1 and call_band:
        # The queries of this call see at most one band's step more than each other when their positions are
        # contiguous (a prefill chunk): one band for the whole call, each band's program stepping through the
        # queries in as many rows as its slab holds. A GPU copies a conditional's branch index to the host before
        # it runs the branch, so a band per query chunk costs a sync per chunk (64 in a 16K-token step at 512K).
        return lax.switch(band_of(positions), [functools.partial(all_chunks, w) for w in widths])
    return all_chunks()
