"""The lightning indexer's scores as a Mosaic GPU (Hopper) Pallas kernel: wgmma on e4m3 or bf16 operands, a TMA
ring of key tiles, a producer warpgroup and four consumer warpgroups.

Same contract as `dsv4.pallas.indexer.index_scores` for FP8 q and keys (its Triton kernel's FP8 dot ran slower than
its bf16 one), or bf16 q and keys (no scales):

    scores[b, s, c] = k_scale[b, c] · Σ_h w'[b, s, h] · ReLU(q8[b, s, h] · k8[b, c])        (c < n_vis[b, s])
                    = -inf                                                                  (c >= n_vis[b, s])

with w' = weights · softmax_scale · q_scale (`indexer_common.fold_scales`: every scale of a whole (token, head) row
folds into the head weight, since ReLU commutes with a positive factor), n_vis = min((p + 1) // rate, C), and -0.0
written as +0.0. The products accumulate in the tensor core, whose e4m3 wgmma keeps fewer bits than float32 (about
1e-3 of the largest score on full-range inputs, docs/kernels/indexer.md); bf16 products accumulate in float32.
The head sum runs in float32 registers.

Design:
- One CTA = `tokens` queries × `span` keys, grid (S / tokens, ceil(C / span), B). Keys stream through a ring of
  `num_slots` TMA slots, 64 keys × Di (8 KiB in e4m3, 16 in bf16) plus their 64 float32 scales per slot. Tiles at
  or past the CTA's largest visible count are not loaded: they are written as -inf.
- The last warpgroup (the producer) issues the key TMAs. Consumer warpgroup w (`consumers` of them, 4 by default)
  owns tokens / consumers of the CTA's queries: their q rows (× 64 heads × Di) and weights sit in SMEM for the
  whole CTA.
- Per key tile and group of g = `queries_per_mma` queries: `acc[64 keys, 64 g] = K_tile · Q_gᵀ`, one wgmma
  m64 n=64g k=Di with both operands K-major in SMEM (e4m3 wgmma needs that, bf16 takes it; the g queries' [heads,
  Di] rows are contiguous as stored, passed transposed). Then per query j, its 64 columns: ReLU(acc_j) · w'_j
  broadcast along the rows (WGMMA column layout) summed over the heads within each warp, times the keys' scales,
  masked, and written as one row of a [tokens / consumers, 64] float32 staging tile, which a TMA stores. That
  epilogue costs more than an e4m3 wgmma: the consumers' wgmmas and epilogues interleave on the SM.
- The consumers release a slot (one arrival each) after their last wgmma on it; the producer refills it.

Restrictions: Hi = 64 (the wgmma N); q and keys both float8_e4m3fn or both bfloat16; Di · itemsize a multiple of
128 bytes (whole swizzled SMEM rows) and Di <= 256 (tuned at 128, V4's index_head_dim). A bf16 CTA's q rows take
twice the SMEM, so its default CTA holds 8 queries instead of 16 (`default_config`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4.pallas._device import is_hopper
from dsv4.pallas.attention_common import SMEM_LIMIT
from dsv4.pallas.indexer_common import FP8, check_index_inputs, fold_scales, visible_entries

__all__ = ["MgpuScoreConfig", "default_config", "index_scores_mgpu", "fill_neg_inf", "is_hopper", "score_columns"]

F32 = jnp.float32
KEYS_PER_TILE = 64  # M of the wgmma
HEADS = 64  # N of the wgmma (V4's index_n_heads)
_GRID_DIM_MAX = 65535


@dataclasses.dataclass(frozen=True)
class MgpuScoreConfig:
    """Tunables of `index_scores_mgpu`.

    tokens:    queries per CTA, split evenly between the consumer warpgroups (a multiple of `consumers`).
    span:      keys per CTA (a multiple of 64).
    num_slots: key tiles in flight (TMA ring depth).
    queries_per_mma: queries sharing one wgmma (N = 64 · queries_per_mma: their q rows are contiguous in SMEM),
               dividing tokens / consumers. Each key tile is read from SMEM once per wgmma, so a wider N reads it
               less, and each wgmma's wait covers g queries' epilogues.
    consumers: consumer warpgroups (2, 3 or 4), each owning tokens / consumers queries. The epilogue (ReLU, head
               weights, head sum, mask, store) costs more than the wgmma, so more warpgroups, each waiting on its
               own wgmma, keep the tensor core busier. At 4 the launch gives every
               thread 96 registers, which the kernel fits without spilling.
    auto_barriers: Pallas' automatic warpgroup barrier before and after every SMEM store (True), or none (False,
               the default; `CompilerParams.unsafe_no_auto_barriers`). Each query's score row is such a store, so
               with them every query's epilogue synchronizes the consumer's 4 warps twice. Safe to drop here: no
               thread reads SMEM it writes (the staging rows are read only by the TMA store, after `commit_smem`'s
               barrier, and rewritten only after `wait_smem_to_gmem`'s), and every thread arrives on `consumed`
               itself after its own reads. Without them the indexer is faster, with identical index sets.
    debug:     measurement switch, off in use: ("no_mma",) runs the epilogue on the key scales instead of a wgmma's
               result (the epilogue's cost alone).

    Defaults: the fastest configuration measured (4 consumers × 2 queries per wgmma, 16 tokens per CTA;
    docs/kernels/indexer.md has the comparison).
    """

    tokens: int = 16
    span: int = 2048
    num_slots: int = 3
    queries_per_mma: int = 2
    consumers: int = 4
    auto_barriers: bool = False
    debug: tuple[str, ...] = ()

    def __post_init__(self):
        if self.consumers not in (2, 3, 4):
            raise ValueError(f"MgpuScoreConfig.consumers={self.consumers} must be 2, 3 or 4")
        if self.tokens < self.consumers or self.tokens % self.consumers:
            raise ValueError(f"MgpuScoreConfig.tokens={self.tokens} must be a positive multiple of "
                             f"consumers={self.consumers}")  # fmt: skip
        if self.span < KEYS_PER_TILE or self.span % KEYS_PER_TILE:
            raise ValueError(f"MgpuScoreConfig.span={self.span} must be a positive multiple of {KEYS_PER_TILE}")
        if self.num_slots < 1:
            raise ValueError(f"MgpuScoreConfig.num_slots={self.num_slots} must be >= 1")
        per = self.tokens // self.consumers
        if self.queries_per_mma not in (1, 2, 4) or per % self.queries_per_mma:
            raise ValueError(f"MgpuScoreConfig.queries_per_mma={self.queries_per_mma} must be 1, 2 or 4 and divide "
                             f"tokens / consumers = {per}")  # fmt: skip
        if set(self.debug) - {"no_mma"}:
            raise ValueError(f"MgpuScoreConfig.debug={self.debug}: unknown flags")

    def smem_bytes(self, index_dim: int, itemsize: int = 1) -> int:
        q = self.tokens * HEADS * index_dim * itemsize
        keys = self.num_slots * KEYS_PER_TILE * (index_dim * itemsize + 4)
        weights = self.tokens * HEADS * 4
        staging = 2 * self.tokens * KEYS_PER_TILE * 4
        return q + keys + weights + staging


def default_config(dtype) -> MgpuScoreConfig:
    """The fastest measured configuration for e4m3 operands; for bf16 the same with 8 queries a CTA, as 16 queries'
    bf16 q rows (256 KiB) exceed the SMEM (the fastest of the bf16 configurations tried: docs/kernels/indexer.md)."""
    return MgpuScoreConfig() if jnp.dtype(dtype).itemsize == 1 else MgpuScoreConfig(tokens=8)


def score_columns(acc, w_row, key_scale, visible):
    """One query's scores from its [64 keys, 64 heads] accumulator block (WGMMA layout): Σ_h ReLU(acc) · w'_h, the
    head sum within each warp, times the keys' scales (None: unscaled), -0.0 written as +0.0, -inf where not
    `visible`. A key row the cache never wrote (NaN) spoils only its own score, which the mask replaces."""
    weighted = jnp.maximum(acc, 0.0) * lax.broadcast_in_dim(w_row, acc.shape, [1])
    score = weighted.sum(axis=1)
    if key_scale is not None:
        score = score * key_scale
    score = jnp.where(score == 0.0, 0.0, score)  # -0.0 → +0.0
    return jnp.where(visible, score, -jnp.inf)


def fill_neg_inf(buf, row_layout):
    """Every row of a [queries, 64] staging tile set to -inf: a key tile past every query's visible count."""
    for j in range(buf.shape[0]):
        buf[j] = plgpu.layout_cast(jnp.full((KEYS_PER_TILE,), -jnp.inf, F32), row_layout)


def _scores_call(q, keys, k_scale, weights, n_vis, *, config: MgpuScoreConfig, interpret=None):
    """q [B, S, 64, Di] e4m3 or bf16 (S a multiple of config.tokens); keys [B, C, Di] as q (C a multiple of 64);
    k_scale [B, C] f32; weights [B, S, 64] f32 (folded); n_vis [B, S] int32. → f32 [B, S, C]."""
    b, s, h, d = q.shape
    c = keys.shape[1]
    t, span, slots, g = config.tokens, config.span, config.num_slots, config.queries_per_mma
    n_cons = config.consumers
    per = t // n_cons  # queries per consumer
    no_mma = "no_mma" in config.debug
    q = q.reshape(b, s * h, d)  # a query's 64 head rows, then the next query's: g queries = one [64 g, Di] operand
    n_spans = pl.cdiv(c, span)
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # [64] per key (accumulator rows)
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # [64] per head (accumulator columns)

    def body(q_ref, k_ref, ks_ref, w_ref, nvis_ref, o_ref, q_smem, k_smem, ks_smem, w_smem, o_smem, q_bar, k_bar,
             ks_bar, consumed):  # fmt: skip
        ti, ci, bi = lax.axis_index("t"), lax.axis_index("c"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        t0 = ti * t
        c_begin = ci * span
        n_tiles = lax.div(jnp.minimum(c - c_begin, span) + (KEYS_PER_TILE - 1), KEYS_PER_TILE)
        most = nvis_ref[bi, t0]
        for j in range(1, t):
            most = jnp.maximum(most, nvis_ref[bi, t0 + j])
        n_live = jnp.clip(lax.div(most - c_begin + (KEYS_PER_TILE - 1), KEYS_PER_TILE), 0, n_tiles)

        def consumer(w):
            first = t0 + w * per
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(first * h, per * h)], q_smem.at[w], q_bar.at[w])
            plgpu.copy_gmem_to_smem(w_ref.at[bi, pl.ds(first, per)], w_smem.at[w], q_bar.at[n_cons + w])
            plgpu.barrier_wait(q_bar.at[w])
            plgpu.barrier_wait(q_bar.at[n_cons + w])
            vis = [nvis_ref[bi, first + j] for j in range(per)]

            @pl.loop(0, n_tiles)
            def _(i):
                c0 = c_begin + i * KEYS_PER_TILE
                buf = o_smem.at[w, lax.rem(i, 2)]
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from two tiles ago has read buf
                key = plgpu.broadcasted_iota(jnp.int32, (KEYS_PER_TILE,), 0, layout=row_layout) + c0

                @pl.when(i < n_live)
                def _():
                    slot = lax.rem(i, jnp.int32(slots))
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(ks_bar.at[slot])
                    kscale = plgpu.load(ks_smem.at[slot], layout=row_layout)
                    for j0 in range(0, per, g):
                        def qk(acc_ref, j0=j0):
                            q_rows = q_smem.at[w, pl.ds(j0 * HEADS, g * HEADS)]  # [64 g, Di]
                            plgpu.wgmma(acc_ref, k_smem.at[slot], q_rows.transpose((1, 0)))
                            return acc_ref[...]

                        if no_mma:
                            acc_g = lax.broadcast_in_dim(kscale, (KEYS_PER_TILE, g * HEADS), [0])
                        else:
                            acc_g = pl.run_scoped(qk, plgpu.ACC((KEYS_PER_TILE, g * HEADS), F32))  # [64 keys, 64 g]
                        for j in range(j0, j0 + g):
                            acc = acc_g if g == 1 else acc_g[:, (j - j0) * HEADS : (j - j0 + 1) * HEADS]
                            wj = plgpu.load(w_smem.at[w, j], layout=col_layout)
                            buf[j] = score_columns(acc, wj, kscale, key < vis[j])
                    plgpu.barrier_arrive(consumed.at[slot])

                pl.when(i >= n_live)(functools.partial(fill_neg_inf, buf, row_layout))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buf, o_ref.at[bi, pl.ds(first, per), pl.ds(c0, KEYS_PER_TILE)])

            plgpu.wait_smem_to_gmem(0)

        for w in range(n_cons):
            @pl.when(wg == w)
            def _(w=w):
                # NOTE: no setmaxnreg increase for the consumers. The launch gives every thread 64 Ki / threads
                # registers (rounded down to 8: 96 with 4 consumers), and an increase waits until the CTA's pool
                # holds it: asking for more than the producer's decrease freed hangs the kernel. 96 is enough:
                # ptxas spills nothing at 4 consumers.
                consumer(w)

        @pl.when(wg == n_cons)
        def _():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, n_live)
            def _(i):
                slot = lax.rem(i, jnp.int32(slots))

                @pl.when(i >= slots)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                rows = pl.ds(c_begin + i * KEYS_PER_TILE, KEYS_PER_TILE)
                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(ks_ref.at[bi, rows], ks_smem.at[slot], ks_bar.at[slot])

            @pl.loop(jnp.maximum(n_live - slots, 0), n_live)  # every consumed phase is waited on
            def _(i):
                plgpu.barrier_wait(consumed.at[lax.rem(i, jnp.int32(slots))])

    dtype = q.dtype
    tiled = (plgpu.TilingTransform((8, 128 // dtype.itemsize)), plgpu.SwizzleTransform(128))  # 128-byte rows
    scratch = [
        plgpu.SMEM((n_cons, per * h, d), dtype, transforms=tiled),  # q rows of each consumer's queries
        plgpu.SMEM((slots, KEYS_PER_TILE, d), dtype, transforms=tiled),  # key ring
        plgpu.SMEM((slots, KEYS_PER_TILE), F32),  # key scales ring
        plgpu.SMEM((n_cons, per, h), F32),  # folded head weights
        plgpu.SMEM((n_cons, 2, per, KEYS_PER_TILE), F32),  # output staging, double-buffered per consumer
        plgpu.Barrier(num_barriers=2 * n_cons),  # q, weights per consumer
        plgpu.Barrier(num_barriers=slots),  # keys full
        plgpu.Barrier(num_barriers=slots),  # key scales full
        plgpu.Barrier(num_arrivals=n_cons, num_barriers=slots),  # slot consumed by every consumer
    ]
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, s, c), F32),
        scratch_types=scratch,
        grid=(s // t, n_spans, b),
        grid_names=("t", "c", "b"),
        num_threads=n_cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=not config.auto_barriers),
        interpret=interpret,
    )(q, keys, k_scale, weights, n_vis)


@functools.partial(jax.jit, static_argnames=("rate", "softmax_scale", "config", "interpret"))
def index_scores_mgpu(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    *,
    rate: int,
    softmax_scale: float,
    q_scale: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    config: MgpuScoreConfig | None = None,
    interpret=None,
) -> jax.Array:
    """`dsv4.pallas.indexer.index_scores` for e4m3 q [B, S, 64, Di] and keys [B, C, Di] (with their scales), or bf16
    ones, on a Hopper GPU. → float32 [B, S, C]: -inf where entry c is not visible (c >= (p + 1) // rate), -0.0 as
    +0.0.

    config: None for `default_config(q.dtype)`. interpret: passed to plgpu.kernel (an InterpretGPUParams for the CPU
    interpreter).
    """
    q_layout, k_layout = check_index_inputs(q, keys, weights, positions, rate=rate, k=1, q_scale=q_scale,
                                       k_scale=k_scale)  # fmt: skip
    b, s, h, d = q.shape
    c = keys.shape[1]
    if q.dtype != keys.dtype or q.dtype not in (FP8, jnp.bfloat16):
        raise ValueError(f"index_scores_mgpu needs float8_e4m3fn or bfloat16 q and keys of one dtype, got {q.dtype} "
                         f"and {keys.dtype}")  # fmt: skip
    itemsize = q.dtype.itemsize
    if h != HEADS or d * itemsize % 128 or d > 256:
        raise ValueError(f"q.shape={q.shape}: index_scores_mgpu needs Hi = {HEADS} and Di <= 256 a multiple of "
                         f"{128 // itemsize} for {q.dtype}")  # fmt: skip
    config = config or default_config(q.dtype)
    if config.smem_bytes(d, itemsize) > SMEM_LIMIT:
        raise ValueError(f"{config} needs {config.smem_bytes(d, itemsize)} B of shared memory at Di={d} in "
                         f"{q.dtype}; limit {SMEM_LIMIT}")  # fmt: skip
    weights, k_scale = fold_scales(weights, softmax_scale, q_scale, k_scale, q_layout, k_layout)
    weights = jnp.broadcast_to(weights, (b, s, h)).astype(F32)
    k_scale = jnp.ones((b, c), F32) if k_scale is None else jnp.broadcast_to(k_scale, (b, c)).astype(F32)
    n_vis = visible_entries(positions, rate, c).astype(jnp.int32)
    # Pad queries to whole CTAs (padding sees nothing) and keys to whole tiles (never visible: n_vis <= C).
    s_pad = -(-s // config.tokens) * config.tokens
    c_pad = -(-c // KEYS_PER_TILE) * KEYS_PER_TILE
    if s_pad // config.tokens > _GRID_DIM_MAX:
        raise ValueError(f"{s} queries need {s_pad // config.tokens} CTAs along the grid's first axis (at most "
                         f"{_GRID_DIM_MAX}); pass fewer queries per call")  # fmt: skip
    if s_pad != s:
        q = jnp.pad(q, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, s_pad - s), (0, 0)))
        n_vis = jnp.pad(n_vis, ((0, 0), (0, s_pad - s)))
    if c_pad != c:
        keys = jnp.pad(keys, ((0, 0), (0, c_pad - c), (0, 0)))
        k_scale = jnp.pad(k_scale, ((0, 0), (0, c_pad - c)))
    out = _scores_call(q, keys, k_scale, weights, n_vis, config=config, interpret=interpret)
    # NOTE: when C or S is not a whole number of tiles this slice copies the slab once more. Writing [B, S, C]
    # directly needs TMA stores clipped at C.
    if s_pad != s or c_pad != c:
        out = out[:, :s, :c]
    return out
