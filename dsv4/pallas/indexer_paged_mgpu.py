"""The indexer's decode-step scores straight from its paged key cache, as a Mosaic GPU (Hopper) Pallas kernel: key
tiles by TMA through the block table, bf16 wgmma, consumer warpgroups fed by a producer.

Same contract as `dsv4.pallas.indexer_paged.index_scores_paged` (read its module docstring first) for unquantized
pages in q's dtype (bf16 or f16: the engine's cache format for a bf16 model) whose page holds whole 64-row tiles:

    score[b, s, c] = Σ_h w'[b, s, h] · ReLU(q[b, s, h, :] · key_c)        (c < n_vis[b, s])
                   = -inf                                                (c >= n_vis[b, s])

key_c = key_pages[block_table[b, c // R], c % R], w' = weights · softmax_scale, n_vis = min((p + 1) // rate, C),
C = max_pages · R; -0.0 written as +0.0. Products accumulate in float32 in the tensor core; the head sum runs in
float32 registers, as `indexer_mgpu`.

Why a second kernel: the Triton backend is deprecated in jax 0.11.2, and this one is on the default decode path. A
key costs 2 · 64 · 128 = 16 KiFLOP against its 256 B row: at 64 FLOP per byte the step is bound by reading the keys,
so the design is a TMA ring kept full rather than a faster matmul.

Design:
- One CTA = `tokens` queries of one request × `span` keys; grid (C / span, S / tokens, B). The producer (the last
  warpgroup) loads the CTA's q rows and folded weights once, then per key tile reads its page id from the block
  table and issues one TMA of `key_pages[page, row0 : row0 + 64]` (R a multiple of 64, so a tile never crosses
  pages). Tiles at or past the CTA's largest visible count are not loaded: written as -inf.
- Consumer warpgroup w takes tiles w, w + n, w + 2n, ... (n = `consumers`) through its own ring of `slots`: a
  barrier's phase is tracked by each thread that waits on it, so each slot has one waiting consumer, which sees
  every phase in turn.
- Per tile one wgmma `acc[64 keys, 64 · tokens] = K_tile · Qᵀ` (both K-major in SMEM, as `indexer_mgpu`: a query's
  64 head rows are contiguous, so the CTA's queries are one operand), then per query `indexer_mgpu.score_columns`
  into a [tokens, 64] float32 staging tile (double-buffered per consumer), which a TMA stores.
- Rows past a query's visible count inside a live tile may hold anything (rows never written, NaN included): each
  spoils only its own score, which the mask replaces.

Restrictions (`mgpu_takes`): Hi = 64; Di · 2 a multiple of 128 bytes and Di <= 256; pages unquantized in q's dtype
(bf16 or f16); R a multiple of 64. FP8 split rows keep the Triton kernel (docs/kernels/README.md says why).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4.pallas._device import sm_count
from dsv4.pallas.attention_common import SMEM_LIMIT
from dsv4.pallas.indexer_common import F32, check_paged_inputs, next_power_of_2, visible_entries
from dsv4.pallas.indexer_mgpu import HEADS, KEYS_PER_TILE, fill_neg_inf, score_columns

__all__ = ["MgpuPagedConfig", "index_scores_paged_mgpu", "mgpu_takes"]


@dataclasses.dataclass(frozen=True)
class MgpuPagedConfig:
    """Tunables of `index_scores_paged_mgpu`.

    tokens:    queries per CTA (1, 2 or 4: the wgmma's N is 64 · tokens); None: the request's S rounded up to a
               power of two, at most 4 (decode steps have one).
    span:      keys per CTA, a multiple of 64; None: `span_for` (enough CTAs to fill the GPU twice over, within
               256 .. max_span keys).
    max_span:  the automatic span's upper bound.
    slots:     key tiles in flight per consumer (its TMA ring depth).
    consumers: consumer warpgroups (1 to 3), taking the CTA's tiles in turn.
    """

    tokens: int | None = None
    span: int | None = None
    max_span: int = 2048
    slots: int = 2
    consumers: int = 2

    def __post_init__(self):
        if self.tokens not in (None, 1, 2, 4):
            raise ValueError(f"MgpuPagedConfig.tokens={self.tokens} must be None, 1, 2 or 4")
        for name in ("span", "max_span"):
            value = getattr(self, name)
            if value is not None and (value < KEYS_PER_TILE or value % KEYS_PER_TILE):
                raise ValueError(f"MgpuPagedConfig.{name}={value} must be a positive multiple of {KEYS_PER_TILE}")
        if self.slots < 1:
            raise ValueError(f"MgpuPagedConfig.slots={self.slots} must be >= 1")
        if self.consumers not in (1, 2, 3):
            raise ValueError(f"MgpuPagedConfig.consumers={self.consumers} must be 1, 2 or 3")

    def smem_bytes(self, tokens: int, index_dim: int, itemsize: int = 2) -> int:
        q = tokens * HEADS * index_dim * itemsize
        keys = self.consumers * self.slots * KEYS_PER_TILE * index_dim * itemsize
        weights = tokens * HEADS * 4
        staging = self.consumers * 2 * tokens * KEYS_PER_TILE * 4
        return q + keys + weights + staging

    def span_for(self, capacity: int, ctas_per_span: int, sms: int) -> int:
        """Keys per CTA: the fewest 64-key tiles that leave at most two CTAs an SM, 4 tiles at least (each CTA loads
        its q rows once), `max_span` at most. ctas_per_span: the grid's other axes (query groups × requests)."""
        tiles = -(-capacity // KEYS_PER_TILE)
        want = -(-tiles * ctas_per_span // (2 * sms))
        return KEYS_PER_TILE * max(1, min(tiles, max(4, want), self.max_span // KEYS_PER_TILE))


def mgpu_takes(q, key_pages, key_scales=None, key_rope_pages=None) -> bool:
    """Whether `index_scores_paged_mgpu` takes these operands (see the module docstring's restrictions)."""
    _, _, h, d = q.shape
    return (q.dtype in (jnp.bfloat16, jnp.float16) and key_pages.dtype == q.dtype and key_scales is None
            and key_rope_pages is None and h == HEADS and key_pages.shape[-1] == d and d * 2 % 128 == 0 and d <= 256
            and key_pages.shape[1] % KEYS_PER_TILE == 0)  # fmt: skip


def _paged_call(q, weights, n_vis, key_pages, block_table, *, tokens, span, config: MgpuPagedConfig, interpret):
    """q [B, S, 64, Di] (S a multiple of tokens); weights [B, S, 64] f32 (folded); n_vis [B, S] int32; key_pages
    [P, R, Di] as q; block_table [B, max_pages] int32. → f32 [B, S, max_pages · R]."""
    b, s, h, d = q.shape
    rows = key_pages.shape[1]
    c = block_table.shape[1] * rows
    slots, n_cons = config.slots, config.consumers
    q = q.reshape(b, s * h, d)  # a query's 64 head rows, then the next query's: the CTA's queries are one operand
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # [64] per key (accumulator rows)
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # [64] per head (accumulator columns)

    def paged_scores(q_ref, w_ref, nvis_ref, table_ref, k_ref, o_ref, q_smem, k_smem, w_smem, o_smem, q_bar, k_bar,
                     consumed):  # fmt: skip
        ci, qi, bi = lax.axis_index("c"), lax.axis_index("q"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        q0 = qi * tokens
        c_begin = ci * span
        n_tiles = lax.div(jnp.minimum(c - c_begin, span), KEYS_PER_TILE)  # C is a multiple of 64
        vis = [nvis_ref[bi, q0 + j] for j in range(tokens)]
        most = functools.reduce(jnp.maximum, vis)
        n_live = jnp.clip(lax.div(most - c_begin + (KEYS_PER_TILE - 1), KEYS_PER_TILE), 0, n_tiles)

        def slot_of(i):  # tile i → its consumer's ring slot
            return lax.rem(i, n_cons) * slots + lax.rem(lax.div(i, n_cons), slots)

        def consumer(w):
            plgpu.barrier_wait(q_bar.at[0])
            plgpu.barrier_wait(q_bar.at[1])

            @pl.loop(w, n_tiles, step=n_cons)
            def _(i):
                c0 = c_begin + i * KEYS_PER_TILE
                buf = o_smem.at[w, lax.rem(lax.div(i, n_cons), 2)]
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from two tiles ago has read buf
                key = plgpu.broadcasted_iota(jnp.int32, (KEYS_PER_TILE,), 0, layout=row_layout) + c0

                @pl.when(i < n_live)
                def _():
                    slot = slot_of(i)
                    plgpu.barrier_wait(k_bar.at[slot])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.transpose((1, 0)))
                        return acc_ref[...]

                    acc_all = pl.run_scoped(qk, plgpu.ACC((KEYS_PER_TILE, tokens * HEADS), F32))
                    for j in range(tokens):
                        acc = acc_all if tokens == 1 else acc_all[:, j * HEADS : (j + 1) * HEADS]
                        wj = plgpu.load(w_smem.at[j], layout=col_layout)
                        buf[j] = score_columns(acc, wj, None, key < vis[j])
                    plgpu.barrier_arrive(consumed.at[slot])

                pl.when(i >= n_live)(functools.partial(fill_neg_inf, buf, row_layout))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buf, o_ref.at[bi, pl.ds(q0, tokens), pl.ds(c0, KEYS_PER_TILE)])

            plgpu.wait_smem_to_gmem(0)

        for w in range(n_cons):
            pl.when(wg == w)(functools.partial(consumer, w))

        @pl.when(wg == n_cons)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q0 * h, tokens * h)], q_smem, q_bar.at[0])
            plgpu.copy_gmem_to_smem(w_ref.at[bi, pl.ds(q0, tokens)], w_smem, q_bar.at[1])

            @pl.loop(0, n_live)
            def _(i):
                slot = slot_of(i)

                @pl.when(i >= n_cons * slots)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])  # the slot's previous tile, i - n_cons · slots

                c0 = c_begin + i * KEYS_PER_TILE
                page = table_ref[bi, lax.div(c0, rows)]
                rows_in_page = pl.ds(lax.rem(c0, rows), KEYS_PER_TILE)
                plgpu.copy_gmem_to_smem(k_ref.at[page, rows_in_page], k_smem.at[slot], k_bar.at[slot])

            @pl.loop(jnp.maximum(n_live - n_cons * slots, 0), n_live)  # every consumed phase is waited on
            def _(i):
                plgpu.barrier_wait(consumed.at[slot_of(i)])

    dtype = q.dtype
    tiled = (plgpu.TilingTransform((8, 128 // dtype.itemsize)), plgpu.SwizzleTransform(128))  # 128-byte rows
    scratch = [
        plgpu.SMEM((tokens * h, d), dtype, transforms=tiled),  # the CTA's q rows
        plgpu.SMEM((n_cons * slots, KEYS_PER_TILE, d), dtype, transforms=tiled),  # key rings, one per consumer
        plgpu.SMEM((tokens, h), F32),  # folded head weights
        plgpu.SMEM((n_cons, 2, tokens, KEYS_PER_TILE), F32),  # output staging, double-buffered per consumer
        plgpu.Barrier(num_barriers=2),  # q rows, weights
        plgpu.Barrier(num_barriers=n_cons * slots),  # key tile landed
        plgpu.Barrier(num_barriers=n_cons * slots),  # key tile consumed
    ]
    return plgpu.kernel(
        paged_scores,
        out_type=jax.ShapeDtypeStruct((b, s, c), F32),
        scratch_types=scratch,
        grid=(pl.cdiv(c, span), s // tokens, b),
        grid_names=("c", "q", "b"),
        num_threads=n_cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=interpret,
    )(q, weights, n_vis, block_table, key_pages)


@functools.partial(jax.jit, static_argnames=("rate", "softmax_scale", "config", "interpret"))
def index_scores_paged_mgpu(
    q: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    key_pages: jax.Array,
    block_table: jax.Array,
    *,
    rate: int,
    softmax_scale: float,
    config: MgpuPagedConfig = MgpuPagedConfig(),
    interpret=None,
) -> jax.Array:
    """`indexer_paged.index_scores_paged` for unquantized bf16 (or f16) pages on a Hopper GPU. → float32 [B, S, C],
    C = max_pages · R: -inf where entry c is not visible (c >= (p + 1) // rate), -0.0 written as +0.0.

    q [B, S, 64, Di], weights [B, S, 64] (before softmax_scale), positions [B, S], key_pages [P, R, Di] in q's dtype
    (R a multiple of 64), block_table [B, max_pages] (entries past what a request sees are never read).
    interpret: passed to plgpu.kernel (an InterpretGPUParams for the CPU interpreter).
    """
    check_paged_inputs(q, weights, positions, key_pages, None, None, block_table)
    if not mgpu_takes(q, key_pages):
        raise ValueError(f"index_scores_paged_mgpu needs Hi = {HEADS}, Di <= 256 a multiple of 64, pages in q's "
                         f"dtype (bfloat16 or float16) of a multiple of {KEYS_PER_TILE} rows; got q {q.dtype} "
                         f"{q.shape}, key_pages {key_pages.dtype} {key_pages.shape}")  # fmt: skip
    b, s, h, d = q.shape
    capacity = block_table.shape[1] * key_pages.shape[1]
    tokens = config.tokens or min(4, next_power_of_2(s))
    s_pad = -(-s // tokens) * tokens
    span = config.span or config.span_for(capacity, b * (s_pad // tokens), sm_count())
    if config.smem_bytes(tokens, d, q.dtype.itemsize) > SMEM_LIMIT:
        raise ValueError(f"{config} needs {config.smem_bytes(tokens, d, q.dtype.itemsize)} B of shared memory at "
                         f"Di={d}, {tokens} queries a CTA; limit {SMEM_LIMIT}")  # fmt: skip
    weights = weights.astype(F32) * softmax_scale
    n_vis = visible_entries(positions.astype(jnp.int32), rate, capacity)
    if s_pad != s:  # padded queries see nothing
        q = jnp.pad(q, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, s_pad - s), (0, 0)))
        n_vis = jnp.pad(n_vis, ((0, 0), (0, s_pad - s)))
    out = _paged_call(q, weights, n_vis, key_pages, block_table.astype(jnp.int32), tokens=tokens, span=span,
                      config=config, interpret=interpret)  # fmt: skip
    return out[:, :s] if s_pad != s else out
