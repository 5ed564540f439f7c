"""DeepSeek-V4 prefill attention core as a Mosaic GPU (Hopper) Pallas kernel: wgmma, TMA, optional warp specialization.

Same semantics as `dsv4.pallas.attention.v4_attention` (see its docstring and docs/kernels/attention.md) for the two
dense modes: the causal sliding window, optionally plus HCA compressed entries (entry c visible iff
c < (p + 1) // compress_rate), with a per-head sink logit; and (`topk_indices`) CSA: the window plus each token's
listed entries, every listed row gathered by its own TMA, issued by the producer's 4 warps (see `gather_rows` below).
FP8 stays on the Triton kernel (the model dequantizes FP8 caches to bf16 for this one).

Restriction (the prefill hot path, "kv aligned"): the kv cache IS the query sequence, kv_pos == q_pos, and each batch
row's positions are contiguous: q_pos[b, s] == q_pos[b, 0] + s with q_pos[b, 0] >= 0. Then the window of token s is
exactly kv rows max(0, s - W + 1) .. s, found by index alone. `v4_attention_mgpu` checks this at run time and falls
back to the Triton kernel (`lax.cond`) when it does not hold (or statically when `kv_pos` is passed).

Design (docs/kernels/attention.md, the Mosaic kernel):
- One item = one token × 64 heads (M = 64). Persistent launch (the default for "ws"): one CTA per SM, CTA c runs
  items c, c + #CTAs, ... back to back, item = (b · H/64 + head group) · S + token, so neighbouring tokens, which
  share most of their KV tiles, run at the same time (L2 reuse). Between items nothing waits: the KV ring runs on
  (the producer is already loading the next item's tiles), each consumer loads the next item's Q half as soon as
  its last Q·Kᵀ of the current item is done, and stages O in the item's last KV tile half (same shape and swizzle
  as a Q half), releasing that slot once the TMA store has read it. Without it (`persistent=False`, and
  "prefetch"): one CTA per item, grid (S, B · H // 64); past 65535 tokens (CUDA's grid limit) S is folded into
  (32768, S / 32768) and q padded.
- Two consumer warpgroups split the head dim D: warpgroup w owns channels [w·D/2, (w+1)·D/2). Its Q half and the
  matching half of every KV tile live in their own SMEM buffers (TMA loads the halves separately), so each
  warpgroup touches only its half:
    S_w = Q_w · K_wᵀ                    wgmma m64 n=block_kv k=D/2 (K-major B: the KV tile transposed)
    S   = S_w + S_{1-w}                 partial logits exchanged through SMEM (f32, one [64, block_kv] per wg),
                                        two mbarriers per step ("written", "read"); both wgs then run the same
                                        online softmax redundantly (bit-identical: f32 addition commutes)
    O_w = O_w·α + P · V_w               wgmma m64 n=D/2 k=block_kv, P (bf16) from registers, V_w = the same
                                        SMEM tile as K_w (K = V: one TMA serves both matmuls)
  O_w is [64, 256] f32 = 128 registers per thread. (Each warpgroup finishing only its half of S's columns, with
  one shared P, is slower.)
- Step stream per CTA: first the HCA tiles 0 .. ceil(n_c / block_kv) - 1 (n_c = visible entries of this token),
  then the window tiles: they start at row r0 = max(0, s - W + 1) rounded down to a multiple of 8 and cover
  [r0, s] (ceil(W / block_kv) tiles when r0 is 8-aligned, usually one more). NOTE: a TMA row start must be a
  multiple of 8: Mosaic tiles the GMEM view (T/8, D/64, 8, 64) and turns a row start r into the coordinates
  (r // 8, r % 8), so an unaligned box silently reads the rest of one 8-row tile then OOB zeros (every token with
  (s - W + 1) % 8 != 0 would be wrong; the CPU interpreter slices exactly and cannot see it).
  Every step masks by column index against [lo, hi) bounds picked per step type, so a single loop body handles
  both.
- Softmax in the log2 domain, state starting at the sink (m = sink·log2e, l = 1, acc = 0), as the Triton kernel.
- Two variants (`MgpuConfig.variant`):
    "ws":       3 warpgroups; warpgroup 2 is the TMA producer (setmaxnreg 40), consumers get 232 registers.
                Each half-tile slot has its own full/consumed barrier pair, so the producer refills half w as soon
                as warpgroup w released it.
    "prefetch": 2 warpgroups, no producer; each consumer issues the TMA for its own half `num_slots` steps ahead
                right after its P·V on that slot has completed (no consumed barriers are needed since the loader is
                the only reader). Simpler, no register rebalancing (each thread may use up to 255 registers).
- Epilogue: O_w / l → bf16 into the last KV tile half (persistent) or the Q_w buffer (Q is dead by then) → TMA
  store.

SMEM at the defaults (D = 512, block_kv = 64, 2 slots): Q 64 KiB + KV 2 × 64 KiB + exchange 2 × 16 KiB + sinks
= 224.5 KiB (+ 2 KiB Pallas reduction scratch), just under the 227 KiB per-block limit. One CTA per SM (registers
cap it anyway), so one CTA per item cannot overlap its Q load and O store with another CTA's matmuls; the
persistent launch overlaps them within the CTA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4.pallas._device import sm_count
from dsv4.pallas.attention_common import (
    F32,
    HEADS_PER_CTA,
    LOG2E,
    M_FLOOR,
    SMEM_LIMIT,
    pv_through_smem,
    pv_with_p_in_smem,
    smem_tiling,
    swap_with_other,
    wgmma_online_softmax_step,
)

__all__ = ["MgpuConfig", "csa_operands", "v4_attention_mgpu", "v4_attention_mgpu_kernel_call", "positions_are_aligned",
           "window_tiles"]  # fmt: skip

_GRID_DIM_MAX = 65535  # CUDA's limit on grid dims y and z
_TOKEN_BLOCK = 32768  # tokens per grid row when the prompt is longer than that
_VARIANTS = ("ws", "prefetch")
_ROW_TILE = 8  # rows of the (8, 64) SMEM tile; TMA row starts in a tiled GMEM view must be multiples of it
_PV_FORMS = ("run_state", "store", "p_smem", "interpret")
_DEBUG_FLAGS = ("unaligned_window", "no_exchange", "plain_exchange", "dump", "csa_no_regroup", "csa_contiguous")
_SEMANTICS = {"lane": plgpu.LoweringSemantics.Lane, "warpgroup": plgpu.LoweringSemantics.Warpgroup}


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tunables of `v4_attention_mgpu`.

    block_kv:   KV rows per step (both window and HCA tiles); a multiple of 64 in [64, 256] (32 allowed for the
                interpreter form). With D = 512 only 64 fits in SMEM (128 needs 256 KiB with its exchange buffers).
    num_slots:  KV tiles in flight (SMEM ring depth), >= 1.
    variant:    "ws" (producer warpgroup + 2 consumers) or "prefetch" (2 consumers that prefetch their own halves).
    approx_math: Mosaic `approx_math` (fast exp2 / reciprocal).
    persistent: one CTA per SM (`num_ctas`; 0 = the device's SM count), each running items (token × 64 heads)
                cta, cta + num_ctas, ... back to back: the KV ring runs on across items, the next item's Q loads
                during the last step of the current one, and O is staged in the last KV tile half. Needs "ws" and
                block_kv >= 64. False: one CTA per item (its Q load, first tiles and O store are not overlapped
                with compute). None (default): persistent where it applies ("ws", block_kv >= 64, no debug flag),
                the faster launch.
    auto_barriers: Pallas' warpgroup barrier before and after every SMEM store (True), or none (False:
                `CompilerParams.unsafe_no_auto_barriers`). The per-step store of the partial logits into the exchange
                buffer is one; the exchange's mbarriers (each thread arrives after its own write or read) already
                order it, and O's staging store comes after the wgmmas that read that buffer have completed and
                before `commit_smem` (fence and barrier). Dropping them gained nothing here, so True stays. CSA's
                producer then syncs its regrouping itself (`gather_rows`).
    """

    block_kv: int = 64
    num_slots: int = 2
    variant: str = "ws"
    approx_math: bool = True
    # NOTE: Pallas reserves 2 KiB of SMEM for cross-warp reductions by default; the row max / sum of a WGMMA-layout
    # tile reduce within a warp, and the default configuration is 104 bytes over the limit with that reserve.
    reduction_scratch_bytes: int = 0
    # NOTE: "lane": the Warpgroup semantics' layout inference rejects TMA copies whose GMEM row start is a dynamic
    # value not provably a multiple of the 8-row SMEM tile (the window tiles start at token - W + 1).
    semantics: str = "lane"
    # How P·V accumulates into O: "run_state" (in place, as the bundled FA3 kernel; the GPU default), "store"
    # (accumulator store + wgmma), "p_smem" (P through SMEM as the wgmma A operand, in place accumulate; +16 KiB
    # SMEM), "interpret" (P via SMEM, zero accumulator + add: doubles O's registers, so only for the CPU interpreter,
    # which cannot run the others: "Cannot lower jaxpr with effects" / accumulator store).
    pv_form: str = "run_state"
    # Debug switches (set by hand when a tiling is wrong on the GPU), a tuple of:
    #   "unaligned_window": the original window tiling (tiles start at row tok - W + 1: wrong on the GPU, see body);
    #   "no_exchange": each consumer computes the full S = Q·Kᵀ from both halves (no SMEM exchange; "ws" only);
    #   "plain_exchange": the exchange buffer without tiling/swizzle transforms;
    #   "dump": a second output [B, S, 2 (wg), 2 (S unscaled, P f32), H, block_kv] f32 with the last step's tiles
    #           (call v4_attention_mgpu_kernel_call directly; +32 KiB SMEM at block_kv 64);
    #   "csa_no_regroup", "csa_contiguous": CSA timing probes with wrong results (bench_attention.py --csa-debug):
    #           the listed rows land but are not re-laid tiled; or each gathered step loads entries
    #           [step · block_kv, (step + 1) · block_kv) by one TMA a half as HCA does (no per-row TMAs, no pass).
    debug: tuple = ()
    persistent: bool | None = None
    num_ctas: int = 0
    auto_barriers: bool = True
    # CSA: listed rows whose indices the producer loads together before issuing their TMAs, so their GMEM loads'
    # latencies overlap (1: one at a time; at most a warp's share of block_kv, see csa_warps). 16 measured fastest
    # of 1, 8, 16 (docs/kernels/attention.md).
    gather_batch: int = 16
    # CSA: warps of the producer warpgroup that issue the row TMAs, each its share of a step's rows (1: one elected
    # thread of the warpgroup issues them all; 2 or 4: `plgpu.warp_map`, one elected thread a warp), so that the
    # issue of the many 1-row TMAs, the step's limit, runs in parallel. 4 measured 1.91x one thread at 128K
    # (1.45x the Triton kernel; docs/kernels/attention.md).
    csa_warps: int = 4

    def __post_init__(self):
        # NOTE: P·V reduces over block_kv; a bf16 wgmma K must be a multiple of 64 (found by lowering, block_kv=32
        # fails "K must be a multiple of 64"). The interpreter form has no such limit (used at 32 in the CPU test).
        step = 32 if self.pv_form == "interpret" else 64
        if self.block_kv % step or not step <= self.block_kv <= 256:
            raise ValueError(f"MgpuConfig.block_kv={self.block_kv} must be a multiple of {step} in [{step}, 256]")
        if self.num_slots < 1:
            raise ValueError(f"MgpuConfig.num_slots={self.num_slots} must be >= 1")
        if self.semantics not in _SEMANTICS:
            raise ValueError(f"MgpuConfig.semantics={self.semantics!r} must be one of {tuple(_SEMANTICS)}")
        if self.pv_form not in _PV_FORMS:
            raise ValueError(f"MgpuConfig.pv_form={self.pv_form!r} must be one of {_PV_FORMS}")
        if not isinstance(self.debug, tuple) or any(f not in _DEBUG_FLAGS for f in self.debug):
            raise ValueError(f"MgpuConfig.debug={self.debug!r} must be a tuple of flags from {_DEBUG_FLAGS}")
        if "no_exchange" in self.debug and self.variant != "ws":
            raise ValueError("MgpuConfig.debug 'no_exchange' needs variant='ws' (consumed barriers guard both halves)")
        if self.variant not in _VARIANTS:
            raise ValueError(f"MgpuConfig.variant={self.variant!r} must be one of {_VARIANTS}")
        if self.gather_batch < 1 or self.block_kv % self.gather_batch:
            raise ValueError(f"MgpuConfig.gather_batch={self.gather_batch} must divide block_kv={self.block_kv}")
        if self.csa_warps not in (1, 2, 4) or (self.block_kv // self.csa_warps) % self.csa_batch:
            raise ValueError(f"MgpuConfig.csa_warps={self.csa_warps} must be 1, 2 or 4, each warp's share of "
                             f"block_kv={self.block_kv} rows whole batches of gather_batch={self.gather_batch}")
        if self.num_ctas < 0:
            raise ValueError(f"MgpuConfig.num_ctas={self.num_ctas} must be >= 0 (0: one per SM)")
        if self.persistent and not self._persistent_applies():
            raise ValueError(f"MgpuConfig.persistent needs variant='ws', block_kv >= {HEADS_PER_CTA} (O is staged in a "
                             f"KV tile) and neither 'no_exchange' nor 'dump' in debug; got variant={self.variant!r}, "
                             f"block_kv={self.block_kv}, debug={self.debug!r}")  # fmt: skip

    def _persistent_applies(self) -> bool:
        return self.variant == "ws" and self.block_kv >= HEADS_PER_CTA and not {"no_exchange", "dump"} & set(self.debug)

    @property
    def csa_batch(self) -> int:
        """The row indices a CSA warp loads together: `gather_batch`, capped at a warp's share of a step's rows."""
        return min(self.gather_batch, self.block_kv // self.csa_warps)

    @property
    def is_persistent(self) -> bool:
        """Whether the launch is persistent (`persistent`, with None resolved)."""
        return self._persistent_applies() if self.persistent is None else self.persistent

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        q = HEADS_PER_CTA * head_dim * itemsize
        kv = self.num_slots * self.block_kv * head_dim * itemsize
        exchange = 2 * HEADS_PER_CTA * self.block_kv * 4
        p = 2 * HEADS_PER_CTA * self.block_kv * itemsize if self.pv_form in ("p_smem", "interpret") else 0
        dump = 4 * HEADS_PER_CTA * self.block_kv * 4 if "dump" in self.debug else 0
        return q + kv + exchange + 2 * HEADS_PER_CTA * 4 + p + dump


class _Item(NamedTuple):
    """One unit of a CTA's work: token `tok` of batch row `bi`, heads h0 .. h0 + 63, and its step stream."""

    tok: jax.Array
    bi: jax.Array
    h0: jax.Array
    n_vis: jax.Array  # visible HCA entries
    n_hca_tiles: jax.Array  # steps 0 .. n_hca_tiles - 1 are HCA tiles, the rest window tiles
    row: jax.Array | None  # the token's own kv row (no window_rows)
    win_lo: jax.Array | None  # window_rows: the window is kv rows [win_lo, win_hi)
    win_hi: jax.Array | None
    win_start: jax.Array  # first window tile's row (a multiple of 8)
    n_steps: jax.Array


def _check_shapes(q, kv, q_pos, sinks, compressed, compress_rate, sliding_window, config: MgpuConfig, kv_offset=0,
                  topk_indices=None):  # fmt: skip
    if q.ndim != 4 or kv.ndim != 3:
        raise ValueError(f"expected q [B, S, H, D] and kv [B, T, D], got q.shape={q.shape}, kv.shape={kv.shape}")
    b, s, h, d = q.shape
    if not isinstance(kv_offset, int) or kv_offset < 0:
        raise ValueError(f"kv_offset={kv_offset!r} must be an int >= 0")
    if kv.shape[0] != b or kv.shape[2] != d or kv.shape[1] < s + kv_offset:
        raise ValueError(f"kv.shape={kv.shape} must be (B, T >= kv_offset + S, D) = ({b}, >= {kv_offset + s}, {d}) "
                         f"(kv aligned with q)")  # fmt: skip
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"q.dtype={q.dtype} must be bfloat16 or float16 (wgmma operands)")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv.dtype={kv.dtype} must equal q.dtype={q.dtype} (FP8 KV: use the Triton kernel)")
    if d % 128 or not 128 <= d <= 512:
        raise ValueError(f"head dim D={d} must be 128, 256, 384 or 512 (two warpgroups × D/2 channels, "
                         f"D/2 a multiple of 64 and <= 256 for the P·V wgmma)")  # fmt: skip
    if h % HEADS_PER_CTA:
        raise ValueError(f"num heads H={h} must be a multiple of {HEADS_PER_CTA} (one CTA = 1 token × 64 heads)")
    if q_pos.shape != (b, s) or q_pos.dtype != jnp.int32:
        raise ValueError(f"q_pos must be int32 [B, S] = ({b}, {s}), got {q_pos.dtype} {q_pos.shape}")
    if sinks.shape != (h,) or sinks.dtype != F32:
        raise ValueError(f"sinks must be float32 [H] = ({h},), got {sinks.dtype} {sinks.shape}")
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int")
    if compressed is not None:
        if compressed.ndim != 3 or compressed.shape[0] != b or compressed.shape[2] != d or compressed.shape[1] < 1:
            raise ValueError(f"compressed.shape={compressed.shape} must be (B, C >= 1, D) = ({b}, C, {d})")
        if compressed.dtype != q.dtype:
            raise ValueError(f"compressed.dtype={compressed.dtype} must equal q.dtype={q.dtype}")
        if topk_indices is not None:
            if topk_indices.ndim != 3 or topk_indices.shape[:2] != (b, s) or topk_indices.dtype != jnp.int32:
                raise ValueError(f"topk_indices must be int32 [B, S, K] = ({b}, {s}, K), got "
                                 f"{topk_indices.dtype} {topk_indices.shape}")  # fmt: skip
            if compress_rate is not None:
                raise ValueError("CSA mode (topk_indices) takes no compress_rate")
            if config.variant != "ws":
                raise ValueError(f"CSA mode needs variant='ws' (its producer gathers the rows), got {config.variant!r}")
        elif not isinstance(compress_rate, int) or compress_rate < 1:
            raise ValueError(f"HCA mode needs compress_rate >= 1, got {compress_rate!r}")
    elif compress_rate is not None or topk_indices is not None:
        raise ValueError("compress_rate or topk_indices given without compressed")
    if config.smem_bytes(d) > SMEM_LIMIT:
        raise ValueError(f"{config} needs {config.smem_bytes(d)} B of shared memory at D={d}; limit {SMEM_LIMIT}")


def positions_are_aligned(q_pos: jax.Array) -> jax.Array:
    """→ bool scalar: every batch row's positions are q_pos[b, 0] + arange(S) with q_pos[b, 0] >= 0."""
    s = q_pos.shape[1]
    expected = q_pos[:, :1] + jnp.arange(s, dtype=jnp.int32)[None, :]
    return jnp.all(q_pos == expected) & jnp.all(q_pos[:, 0] >= 0)


def _pad_rows_to(x, rows):
    """x [B, N, D] → [B, round_up(max(N, rows), 8), D] (zero rows appended): the TMA's GMEM view tiles the row
    dimension by 8 ("dimension 1 must have size smaller or a multiple of its tiling 8")."""
    n = _round_up(max(x.shape[1], rows), _ROW_TILE)
    if n == x.shape[1]:
        return x
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0)))


def _round_up(x, m):
    return (x + m - 1) // m * m


def window_tiles(tok, sliding_window: int, block_kv: int, *, aligned: bool = True):
    """→ (first row, number of tiles) of token `tok`'s window tiles (int32 scalars or arrays).

    The window is kv rows [max(0, tok - W + 1), tok]. NOTE: a TMA row start must be a multiple of 8: the GMEM view is
    tiled (T/8, D/64, 8, 64) and Mosaic turns a dynamic row start r into the coordinates (r // 8, r % 8), so a box
    that starts inside an 8-row tile reads the rest of that tile then OOB zeros. So the tiles start at the window's
    first row rounded down to a multiple of 8 and cover [start, tok]. aligned=False: the original form (start at the
    first row, ceil(W / block_kv) tiles), kept as a debug switch.
    """
    tok = jnp.asarray(tok, jnp.int32)
    win_lo = jnp.maximum(tok - (sliding_window - 1), 0)
    if not aligned:
        return win_lo, tok * 0 + pl.cdiv(sliding_window, block_kv)
    start = win_lo - lax.rem(win_lo, jnp.int32(_ROW_TILE))
    return start, lax.div(tok - start, jnp.int32(block_kv)) + 1


def csa_operands(topk_indices: jax.Array, num_entries: int, block_kv: int):
    """CSA lists → the kernel's operands: (rows int32 [B, S, K'], bits int32 [B, S, K' / 32], slots int32 [B, S]).

    K' = K rounded up to block_kv. rows: each slot's entry, 0 where the slot lists none (-1 or outside
    [0, num_entries): the row is still loaded, then masked); bits: bit j % 32 of word j // 32 says whether slot j
    lists an entry; slots: one past each token's last listing slot (its gathered tiles: ceil(slots / block_kv))."""
    b, s, k = topk_indices.shape
    k_pad = _round_up(k, block_kv)
    idx = jnp.pad(topk_indices, ((0, 0), (0, 0), (0, k_pad - k)), constant_values=-1)
    valid = (idx >= 0) & (idx < num_entries)  # [B, S, K']
    rows = jnp.where(valid, idx, 0)
    words = valid.reshape(b, s, k_pad // 32, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    bits = lax.bitcast_convert_type(words.sum(axis=-1, dtype=jnp.uint32), jnp.int32)  # distinct bits: sum = or
    slots = jnp.max(jnp.where(valid, jnp.arange(1, k_pad + 1, dtype=jnp.int32), 0), axis=-1)
    return rows, bits, slots


def v4_attention_mgpu_kernel_call(q, kv, n_visible, sinks_log2, *, sliding_window, scale, compressed,
                                  config: MgpuConfig, interpret=None, kv_offset: int = 0,
                                  window_rows=None, csa=None, q_scale=None):  # fmt: skip
    """The raw pallas call (no position checks). q [B,S,H,D]; kv [B,T>=kv_offset+S,D] (row kv_offset + j = position
    q_pos[b,0] + j: the kv_offset rows before are the positions just before q's, e.g. a sequence shard's halo);
    window_rows: None, or (lo, hi) int32 [B,S] each: token j's window is kv rows [lo, hi) instead (hi - lo <= W,
    lo < T; e.g. a zigzag shard's two blocks, each after its own halo, in one call);
    n_visible [B,S] int32 visible HCA entries per token (ignored without compressed); sinks_log2 [H] f32 = sinks·log2e;
    compressed [B,C,D] or None; csa: None (window / HCA) or (rows, bits) (`csa_operands`): the listed entries' rows
    int32 [B,S,K] (K a multiple of block_kv; each a row of compressed) and validity bits int32 [B,S,K/32]; n_visible
    then counts each token's list slots; q_scale: None, or float32 [B,S,H]: each (token, head) row's logits times
    q_scale too (q's inverse RMS, folded: the rows of one item are one token's 64 heads, loaded like the sinks).
    → [B,S,H,D] (with config.debug "dump": (out, dbg [B,S,2,2,H,block_kv] f32), see
    MgpuConfig.debug)."""
    b, s_real, h, d = q.shape
    # NOTE: CUDA grid dims y and z stop at 65535, and a long prompt has more tokens than that: the token axis is
    # folded into (s_inner, s_outer) and q padded to whole inner blocks; padded tokens' outputs are cut off.
    # A persistent launch has one grid axis of at most an SM count's CTAs: nothing to fold.
    s_inner = s_real if s_real <= _GRID_DIM_MAX or config.is_persistent else _TOKEN_BLOCK
    s_outer = pl.cdiv(s_real, s_inner)
    s = s_inner * s_outer
    if s != s_real:
        q = jnp.pad(q, [(0, 0), (0, s - s_real), (0, 0), (0, 0)])
        edge = lambda x: None if x is None else jnp.pad(x, [(0, 0), (0, s - s_real)], mode="edge")  # noqa: E731
        n_visible = edge(n_visible)
        window_rows = None if window_rows is None else tuple(edge(x) for x in window_rows)
        if q_scale is not None:
            q_scale = jnp.pad(q_scale, [(0, 0), (0, s - s_real), (0, 0)], constant_values=1.0)
    hg = h // HEADS_PER_CTA
    dtype = q.dtype
    dh = d // 2
    bk, slots = config.block_kv, config.num_slots
    dbg = frozenset(config.debug)
    unaligned = "unaligned_window" in dbg
    no_exchange = "no_exchange" in dbg
    plain_exchange = "plain_exchange" in dbg
    dump = "dump" in dbg
    no_regroup, contiguous = "csa_no_regroup" in dbg, "csa_contiguous" in dbg
    n_win_max = pl.cdiv(sliding_window, bk) if unaligned else pl.cdiv(sliding_window + _ROW_TILE - 1, bk)
    hca = compressed is not None  # compressed steps come first: HCA tiles, or (csa) tiles of listed entries
    if csa is not None and (not hca or config.variant != "ws" or csa[0].shape[2] % bk):
        raise ValueError(f"CSA mode needs compressed entries, variant 'ws' and list slots K a multiple of block_kv "
                         f"{bk}; got variant={config.variant!r}, rows {csa[0].shape}")  # fmt: skip
    n_csa_tiles = 0 if csa is None else csa[0].shape[2] // bk
    itemsize = jnp.dtype(dtype).itemsize
    elems_128b = 128 // itemsize  # the ring's minor tile: 128 bytes, swizzled over 128 bytes
    # TMA boxes past the last row are zero-filled on the GPU (and masked anyway); only the 8-row tiling of the GMEM
    # view (and one whole tile) is needed. The CPU interpreter slices like lax.dynamic_slice (clamping), so there
    # every box must stay in bounds: window tiles reach row tok + block_kv - 1 (+ W in the unaligned debug form).
    kv_rows = max(kv_offset + s, kv.shape[1]) + (n_win_max + 1) * bk if interpret is not None else bk
    kv = _pad_rows_to(kv, kv_rows)
    if hca:
        c = compressed.shape[1]
        compressed = _pad_rows_to(compressed, pl.cdiv(c, bk) * bk)
    ws = config.variant == "ws"
    logit_scale = float(scale) * LOG2E
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    p_via_smem = config.pv_form in ("interpret", "p_smem")

    persistent = config.is_persistent
    n_items_total = b * hg * s_real
    n_ctas = min(config.num_ctas or sm_count(), n_items_total) if persistent else 0

    def body(q_ref, kv_ref, comp_ref, nvis_ref, lo_ref, hi_ref, rows_ref, bits_ref, sinks_ref, qs_ref, o_ref, dbg_ref,
             q_smem, kv_smem, x_smem, sink_smem, q_bar, sink_bar, kv_bar, consumed_bar, x_written, x_read, p_smem,
             dump_smem, landed_bar, qs_smem, qs_bar):  # fmt: skip
        if csa is not None:  # one ring, two views: row-major (the row gathers' destination), tiled (wgmma's operand)
            kv_raw, kv_smem = kv_smem
        wg = lax.axis_index("wg")
        if persistent:  # this CTA's items: cta, cta + n_ctas, ... (item = (b · hg + head group) · S + token)
            cta = lax.axis_index("cta")
            n_items = lax.div(n_items_total - cta + (n_ctas - 1), jnp.int32(n_ctas))  # >= 1: n_ctas <= total

            def item_at(j):
                item = cta + j * n_ctas
                return lax.rem(item, jnp.int32(s_real)), lax.div(item, jnp.int32(s_real))
        else:  # one item: the grid position
            n_items = 1

            def item_at(j):
                del j
                return lax.axis_index("so") * s_inner + lax.axis_index("s"), lax.axis_index("bh")

        def plan(j) -> _Item:
            """The j-th item of this CTA: which token and heads, and its step stream (HCA tiles, then window)."""
            tok, bh = item_at(j)
            bi = lax.div(bh, jnp.int32(hg))
            h0 = lax.rem(bh, jnp.int32(hg)) * HEADS_PER_CTA
            n_vis = nvis_ref[bi, tok] if hca else jnp.int32(0)
            n_hca_tiles = lax.div(n_vis + (bk - 1), jnp.int32(bk))
            if lo_ref is None:
                row = tok + kv_offset  # this token's own kv row
                win_start, n_win = window_tiles(row, sliding_window, bk, aligned=not unaligned)
                win_lo = win_hi = None
            else:  # the caller's rows; at least one (masked) tile, so that every barrier phase happens
                row = None
                win_lo, win_hi = lo_ref[bi, tok], hi_ref[bi, tok]
                win_start = win_lo - lax.rem(win_lo, jnp.int32(_ROW_TILE))
                n_win = jnp.maximum(lax.div(win_hi - 1 - win_start, jnp.int32(bk)) + 1, 1)
            return _Item(tok, bi, h0, n_vis, n_hca_tiles, row, win_lo, win_hi, win_start, n_hca_tiles + n_win)

        def issue(it: _Item, step, slot, half):
            """TMA of item `it`'s step `step`, tile half `half`, into ring slot `slot`."""
            dst = kv_smem.at[slot * 2 + half]
            bar = kv_bar.at[slot * 2 + half]
            cols = pl.ds(half * dh, dh)
            if hca:
                if csa is None:  # (CSA tiles are gathered row by row: `gather_rows`)
                    @pl.when(step < it.n_hca_tiles)
                    def _():
                        plgpu.copy_gmem_to_smem(comp_ref.at[it.bi, pl.ds(step * bk, bk), cols], dst, bar)

                @pl.when(step >= it.n_hca_tiles)
                def _():
                    start = it.win_start + (step - it.n_hca_tiles) * bk
                    plgpu.copy_gmem_to_smem(kv_ref.at[it.bi, pl.ds(start, bk), cols], dst, bar)
            else:
                plgpu.copy_gmem_to_smem(kv_ref.at[it.bi, pl.ds(it.win_start + step * bk, bk), cols], dst, bar)

        def gather_rows(it: _Item, step, slot):
            """CSA step `step` of item `it` into ring slot `slot` (the producer, both halves): one TMA per listed
            entry and half, each a 1-row box into the slot's row-major view, then each 8-row group (the same 4 KiB
            in both views) read into registers and written back tiled and swizzled, in place; then the halves'
            `kv_bar` arrivals. NOTE: Hopper's TMA has no row gather (`tile::gather4` is sm_100+) and Pallas takes a
            TMA into a tiled, swizzled ref only on whole 8-row tiles, hence the row-major landing and the pass.
            The TMAs are issued by `csa_warps` warps, each its share of the rows; each warp loads its rows' indices
            `gather_batch` at a time, all before the batch's first TMA, so the loads' latencies overlap."""
            if contiguous:  # debug probe: the consumers' side alone
                for half in range(2):
                    plgpu.copy_gmem_to_smem(comp_ref.at[it.bi, pl.ds(step * bk, bk), pl.ds(half * dh, dh)],
                                            kv_smem.at[slot * 2 + half], kv_bar.at[slot * 2 + half])  # fmt: skip
                return
            n_warps = config.csa_warps
            share = bk // n_warps  # rows a warp issues
            nb = config.csa_batch

            def issue_rows(warp):
                @pl.loop(0, share // nb)
                def _(r0):
                    land(warp * share + r0 * nb)

            def land(first):
                rows = [rows_ref[it.bi, it.tok, step * bk + first + r] for r in range(nb)]
                for r, row in enumerate(rows):
                    for half in range(2):
                        plgpu.copy_gmem_to_smem(comp_ref.at[it.bi, pl.ds(row, 1), pl.ds(half * dh, dh)],
                                                kv_raw.at[slot * 2 + half, pl.ds(first + r, 1)],
                                                landed_bar.at[slot * 2 + half])  # fmt: skip

            if n_warps == 1:
                issue_rows(0)
            else:
                @plgpu.warp_map
                def _(warp):
                    @pl.when(warp < n_warps)
                    def _():
                        issue_rows(warp)

            group = plgpu.Layout.SMEM_GMEM_COPY((_ROW_TILE, dh), dtype, elems_128b * itemsize)
            # Without Pallas' automatic barriers (`auto_barriers=False`) the warpgroup syncs itself where threads
            # read what others wrote: each group's bytes read before they are overwritten in place (`commit_smem` is
            # a fence and a warpgroup barrier).
            explicit = not config.auto_barriers
            for half in range(2):
                plgpu.barrier_wait(landed_bar.at[slot * 2 + half])
                for g in range(0 if no_regroup else bk // _ROW_TILE):
                    rows = pl.ds(g * _ROW_TILE, _ROW_TILE)
                    value = plgpu.load(kv_raw.at[slot * 2 + half, rows], layout=group)
                    if explicit:
                        plgpu.commit_smem()
                    kv_smem.at[slot * 2 + half][rows] = value
                plgpu.commit_smem()  # the writes, visible to the consumers' wgmma (async proxy)
                plgpu.barrier_arrive(kv_bar.at[slot * 2 + half])

        def listed(it: _Item, i, shape):
            """CSA: whether column j of step i's tile is a listed entry (a validity bit; window steps: all True)."""
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
            step = jnp.minimum(i, n_csa_tiles - 1)  # window steps read the last tile's bits, then ignore them
            words = [bits_ref[it.bi, it.tok, step * (bk // 32) + k] for k in range(bk // 32)]
            word = col * 0 + words[0]
            for k in range(1, bk // 32):
                word = jnp.where(col >= 32 * k, words[k], word)
            bit = lax.shift_right_logical(word, lax.bitwise_and(col, 31)) & 1
            return (bit == 1) | (i >= it.n_hca_tiles)

        def consumer(w):
            if ws:
                plgpu.set_max_registers(232, action="increase")

            def load_q(it: _Item):  # this warpgroup's Q half and its own copy of the sinks (and of q's row scales)
                plgpu.copy_gmem_to_smem(q_ref.at[it.bi, it.tok, pl.ds(it.h0, HEADS_PER_CTA), pl.ds(w * dh, dh)],
                                        q_smem.at[w], q_bar.at[w])  # fmt: skip
                plgpu.copy_gmem_to_smem(sinks_ref.at[pl.ds(it.h0, HEADS_PER_CTA)], sink_smem.at[w], sink_bar.at[w])
                if qs_ref is not None:
                    plgpu.copy_gmem_to_smem(qs_ref.at[it.bi, it.tok, pl.ds(it.h0, HEADS_PER_CTA)], qs_smem.at[w],
                                            qs_bar.at[w])  # fmt: skip

            first = plan(0)
            load_q(first)
            if not ws:
                for i in range(slots):
                    @pl.when(i < first.n_steps)
                    def _():
                        issue(first, jnp.int32(i), jnp.int32(i), w)

            def run_item(j, it: _Item, g0):
                """Item `it`, whose first step is this CTA's step g0 (ring slot (g0 + i) % slots). → g0 + steps."""
                plgpu.barrier_wait(sink_bar.at[w])
                sink = plgpu.load(sink_smem.at[w], layout=row_layout)  # [64] log2 domain
                row_scale = logit_scale  # each row's logit scale: one for all, or times q's row scales (folded)
                if qs_ref is not None:
                    plgpu.barrier_wait(qs_bar.at[w])
                    row_scale = plgpu.load(qs_smem.at[w], layout=row_layout) * logit_scale
                m_i = jnp.maximum(sink, M_FLOOR)
                l_i = jnp.exp2(sink - m_i)
                acc = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, dh), F32), wgmma_layout)
                plgpu.barrier_wait(q_bar.at[w])
                if no_exchange:
                    plgpu.barrier_wait(q_bar.at[1 - w])

                def step_fn(i, carry):
                    acc, m_i, l_i = carry
                    slot = lax.rem(g0 + i, jnp.int32(slots))
                    kv_half = kv_smem.at[slot * 2 + w]
                    plgpu.barrier_wait(kv_bar.at[slot * 2 + w])

                    if no_exchange:  # debug: S from both halves in this warpgroup, no SMEM exchange
                        plgpu.barrier_wait(kv_bar.at[slot * 2 + 1 - w])

                        def qk_full(acc_ref):
                            plgpu.wgmma(acc_ref, q_smem.at[0], kv_smem.at[slot * 2].transpose((1, 0)))
                            plgpu.wgmma(acc_ref, q_smem.at[1], kv_smem.at[slot * 2 + 1].transpose((1, 0)))
                            return acc_ref[...]

                        s_full = pl.run_scoped(qk_full, plgpu.ACC((HEADS_PER_CTA, bk), F32))
                    else:
                        def qk(acc_ref):
                            plgpu.wgmma(acc_ref, q_smem.at[w], kv_half.transpose((1, 0)))
                            return acc_ref[...]

                        s_part = pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, bk), F32))  # [64, bk]

                        if persistent:  # the item's last Q·Kᵀ is done: fetch the next item's Q half now, so
                            # that its load runs under this step's softmax, P·V and the epilogue
                            @pl.when((i == it.n_steps - 1) & (j + 1 < n_items))
                            def _():
                                load_q(plan(j + 1))

                        # Exchange the partial logits with the other warpgroup.
                        s_full = s_part + swap_with_other(x_smem, w, s_part, x_written, x_read, layout=wgmma_layout,
                                                          wait_read=i > 0, optimized=not plain_exchange)  # fmt: skip

                    if csa is not None:  # slots that list no entry (-1, or outside [0, C))
                        s_full = jnp.where(listed(it, i, s_full.shape), s_full, -jnp.inf)
                    # Column mask: HCA steps see entries [0, n_vis); window steps rows [win_lo, win_hi).
                    is_hca = i < it.n_hca_tiles
                    base = jnp.where(is_hca, i * bk, it.win_start + (i - it.n_hca_tiles) * bk)
                    if lo_ref is None:  # NOTE: computed here, not hoisted: hoisted, the CPU interpreter's ws run hung
                        lo = jnp.where(is_hca, 0, it.row - (sliding_window - 1))
                        hi = jnp.where(is_hca, it.n_vis, it.row + 1)
                    else:
                        lo = jnp.where(is_hca, 0, it.win_lo)
                        hi = jnp.where(is_hca, it.n_vis, it.win_hi)
                    col = plgpu.broadcasted_iota(jnp.int32, (HEADS_PER_CTA, bk), 1, layout=wgmma_layout) + base
                    p, m_new, l_new, acc = wgmma_online_softmax_step(s_full, col, lo, hi, row_scale, m_i, l_i, acc)
                    p16 = p.astype(dtype)

                    if dump:  # debug: the last step's S (unscaled, both halves summed) and P (f32) of this warpgroup
                        @pl.when(i == it.n_steps - 1)
                        def _():
                            dump_smem[w, 0] = s_full
                            dump_smem[w, 1] = p
                            plgpu.commit_smem()
                            for k in range(2):
                                dst = dbg_ref.at[it.bi, it.tok, w, k, pl.ds(it.h0, HEADS_PER_CTA)]
                                plgpu.copy_smem_to_gmem(dump_smem.at[w, k], dst)

                    if config.pv_form == "run_state":  # accumulate into acc in place (the bundled FA3 form)
                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, p16, kv_half)

                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    elif config.pv_form == "store":
                        def pv(acc_ref):
                            acc_ref[...] = acc
                            plgpu.wgmma(acc_ref, p16, kv_half)
                            return acc_ref[...]

                        acc = pl.run_scoped(pv, plgpu.ACC((HEADS_PER_CTA, dh), F32))
                    elif config.pv_form == "p_smem":  # P through SMEM (A operand from SMEM), in-place accumulate
                        p_smem[w] = p16
                        plgpu.commit_smem()
                        acc = pv_with_p_in_smem(acc, p_smem.at[w], kv_half, in_place=True)
                    else:  # "interpret"
                        acc = pv_through_smem(acc, p16, p_smem.at[w], [kv_half])
                    if persistent:  # the item's last slot is released after the epilogue has staged O in it
                        @pl.when(i < it.n_steps - 1)
                        def _():
                            plgpu.barrier_arrive(consumed_bar.at[slot * 2 + w])
                    elif ws:
                        plgpu.barrier_arrive(consumed_bar.at[slot * 2 + w])
                        if no_exchange:
                            plgpu.barrier_arrive(consumed_bar.at[slot * 2 + 1 - w])
                    else:
                        @pl.when(i + slots < it.n_steps)
                        def _():
                            issue(it, i + slots, slot, w)
                    return acc, m_new, l_new

                acc, m_i, l_i = lax.fori_loop(0, it.n_steps, step_fn, (acc, m_i, l_i))
                if no_exchange:  # the other warpgroup may still read our Q half: rendezvous before overwriting it
                    plgpu.barrier_arrive(x_written)
                    plgpu.barrier_wait(x_written)
                else:
                    plgpu.barrier_wait(x_read)  # observe the last exchange phase (barrier discipline; nearly free)
                inv = jnp.where(l_i > 0, 1.0 / l_i, 0.0)
                out = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
                dst = o_ref.at[it.bi, it.tok, pl.ds(it.h0, HEADS_PER_CTA), pl.ds(w * dh, dh)]
                if persistent:
                    # O is staged in the item's last KV tile half (same shape and transforms as a Q half): Q already
                    # holds the next item's rows. The slot goes back to the producer once the store has read it.
                    last = lax.rem(g0 + it.n_steps - 1, jnp.int32(slots)) * 2 + w
                    stage = kv_smem.at[last] if bk == HEADS_PER_CTA else kv_smem.at[last, pl.ds(0, HEADS_PER_CTA)]
                    stage[...] = out
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(stage, dst)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(consumed_bar.at[last])
                else:  # O in the Q buffer (Q is dead by now)
                    q_smem[w] = out
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(q_smem.at[w], dst)
                return g0 + it.n_steps

            if persistent:
                lax.fori_loop(0, n_items, lambda j, g0: run_item(j, plan(j), g0), jnp.int32(0))
            else:
                run_item(0, first, 0)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 0)
        def _():
            consumer(0)

        @pl.when(wg == 1)
        def _():
            consumer(1)

        if ws:
            @pl.when(wg == 2)
            def _():
                plgpu.set_max_registers(40, action="decrease")

                def produce(j, g0):
                    it = plan(j)

                    @pl.loop(0, it.n_steps)
                    def _(i):
                        g = g0 + i
                        slot = lax.rem(g, jnp.int32(slots))
                        if csa is not None:  # a gathered tile needs both halves of its slot free at once
                            @pl.when(g >= slots)
                            def _():
                                for half in range(2):
                                    plgpu.barrier_wait(consumed_bar.at[slot * 2 + half])

                            @pl.when(i < it.n_hca_tiles)
                            def _():
                                gather_rows(it, i, slot)

                            @pl.when(i >= it.n_hca_tiles)
                            def _():
                                for half in range(2):
                                    issue(it, i, slot, half)
                            return
                        for half in range(2):
                            @pl.when(g >= slots)
                            def _():
                                plgpu.barrier_wait(consumed_bar.at[slot * 2 + half])

                            issue(it, i, slot, half)

                    return g0 + it.n_steps

                total = lax.fori_loop(0, n_items, produce, jnp.int32(0)) if persistent else produce(0, 0)

                # Drain: observe the consumers' last releases, so every barrier phase is waited on.
                @pl.loop(jnp.maximum(total - slots, 0), total)
                def _(g):
                    slot = lax.rem(g, jnp.int32(slots))
                    for half in range(2):
                        plgpu.barrier_wait(consumed_bar.at[slot * 2 + half])

    def tiled(minor, itemsize=jnp.dtype(dtype).itemsize):
        return smem_tiling(minor, itemsize)

    ring = plgpu.SMEM((slots * 2, bk, dh), dtype, transforms=tiled(elems_128b))  # KV ring: [slot · 2 + half]
    if csa is not None:  # the same bytes, row-major too
        ring = plgpu.RefUnion(plgpu.SMEM((slots * 2, bk, dh), dtype), ring)
    scratch = [
        plgpu.SMEM((2, HEADS_PER_CTA, dh), dtype, transforms=tiled(elems_128b)),  # Q halves, then O halves
        ring,
        plgpu.SMEM((2, HEADS_PER_CTA, bk), F32, transforms=() if plain_exchange else tiled(32, 4)),  # partial logits
        plgpu.SMEM((2, HEADS_PER_CTA), F32),  # sinks (log2 domain), one copy per consumer
        plgpu.Barrier(num_barriers=2),  # q halves
        plgpu.Barrier(num_barriers=2),  # sinks
        plgpu.Barrier(num_barriers=2 * slots),  # kv halves full
        # kv halves consumed (ws only; both consumers read both halves in the no_exchange debug form)
        plgpu.Barrier(num_arrivals=2 if no_exchange else 1, num_barriers=2 * slots) if ws else None,
        plgpu.Barrier(num_arrivals=2),  # exchange written
        plgpu.Barrier(num_arrivals=2),  # exchange read
        # P for the P·V wgmma (pv_form "p_smem" / "interpret")
        plgpu.SMEM((2, HEADS_PER_CTA, bk), dtype, transforms=tiled(min(bk, elems_128b))) if p_via_smem else None,
        plgpu.SMEM((2, 2, HEADS_PER_CTA, bk), F32) if dump else None,  # debug dump staging
        # CSA by TMA: the row gathers of a ring half landed (one arrival per row's TMA)
        plgpu.Barrier(num_arrivals=bk, num_barriers=2 * slots) if csa is not None else None,
        plgpu.SMEM((2, HEADS_PER_CTA), F32) if q_scale is not None else None,  # q's row scales, one copy per consumer
        plgpu.Barrier(num_barriers=2) if q_scale is not None else None,  # q's row scales
    ]
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    if dump:
        out_type = (out_type, jax.ShapeDtypeStruct((b, s, 2, 2, h, bk), F32))
    # Inputs: q, kv, [compressed, n_visible], [window lo, hi], [CSA rows, bits], sinks, [q_scale] (optional ones absent,
    # not None).
    optional = [(compressed, n_visible) if hca else (None, None), tuple(window_rows) if window_rows else (None, None),
                tuple(csa) if csa is not None else (None, None)]  # fmt: skip
    args = (q, kv, *(x for pair in optional for x in pair if x is not None), sinks_log2,
            *((q_scale,) if q_scale is not None else ()))  # fmt: skip

    def kernel_body(*refs):
        it = iter(refs)
        q_ref, kv_ref = next(it), next(it)
        got = [(next(it), next(it)) if pair[0] is not None else (None, None) for pair in optional]
        sinks_ref = next(it)
        qs_ref = next(it) if q_scale is not None else None
        rest = list(it)
        o_ref, dbg_ref, scr = (rest[0], rest[1], rest[2:]) if dump else (rest[0], None, rest[1:])
        return body(q_ref, kv_ref, *got[0], *got[1], *got[2], sinks_ref, qs_ref, o_ref, dbg_ref, *scr)

    out = plgpu.kernel(
        kernel_body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(n_ctas,) if persistent else (s_inner, s_outer, b * hg),
        grid_names=("cta",) if persistent else ("s", "so", "bh"),
        num_threads=3 if ws else 2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math,
                                             reduction_scratch_bytes=config.reduction_scratch_bytes,
                                             lowering_semantics=_SEMANTICS[config.semantics],
                                             unsafe_no_auto_barriers=not config.auto_barriers),
        interpret=interpret,
    )(*args)
    if s == s_real:
        return out
    return (out[0][:, :s_real], out[1][:, :s_real]) if dump else out[:, :s_real]


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "compress_rate", "config", "check_positions",
                                             "interpret", "kv_offset"))  # fmt: skip
def v4_attention_mgpu(
    q: jax.Array,
    kv: jax.Array,
    q_pos: jax.Array,
    sinks: jax.Array,
    *,
    sliding_window: int,
    scale: float,
    compressed: jax.Array | None = None,
    compress_rate: int | None = None,
    kv_pos: jax.Array | None = None,
    config: MgpuConfig = MgpuConfig(),
    check_positions: bool = True,
    interpret=None,
    kv_offset: int = 0,
    window_rows: tuple[jax.Array, jax.Array] | None = None,
    topk_indices: jax.Array | None = None,
    q_scale: jax.Array | None = None,
) -> jax.Array:
    """V4 attention core (window, window + HCA, or window + CSA) for the kv-aligned prefill case. → [B, S, H, D].

    q [B, S, H, D] bf16/f16 (D ∈ {128, 256, 384, 512}, H a multiple of 64); kv [B, T, D] with T >= S, row j holding
    position q_pos[b, 0] + j (the sequence itself; rows >= S are ignored); q_pos [B, S] int32; sinks [H] f32;
    compressed [B, C, D] (HCA, entry c visible iff c < (p + 1) // compress_rate) or None.
    kv_pos: if given, the caller is not in the aligned case: falls back to the Triton kernel (statically).
    kv_offset: kv rows before q's first position (a sequence shard's halo: row kv_offset + j holds q_pos[b, 0] + j,
        rows [0, kv_offset) the kv_offset positions just before it, all real). T >= kv_offset + S.
    window_rows: (lo, hi) int32 [B, S]: token j's window is kv rows [lo[b, j], hi[b, j]) (at most W rows), for a
        kv that is not one run of positions (a zigzag shard: [halo A ‖ block A ‖ halo B ‖ block B]). HCA visibility
        still follows q_pos. Needs check_positions=False (the caller vouches for the rows).
    check_positions: verify at run time that q_pos is contiguous per row (positions_are_aligned) and take the Triton
        kernel (lax.cond) otherwise. False: the caller guarantees it (saves compiling the fallback).
    interpret: passed to plgpu.kernel (e.g. an InterpretGPUParams for the CPU interpreter).
    topk_indices: [B, S, K] int32, CSA mode (with compressed, without compress_rate; variant "ws"): token s sees the
        listed entries (-1 and ids outside [0, C) list nothing), as `dsv4.pallas.attention.v4_attention`. Each
        listed row is gathered by its own TMA into a row-major SMEM tile and rewritten tiled and swizzled by the
        producer (docs/kernels/attention.md, "CSA on Mosaic GPU"): 1.45× the Triton kernel at 128K (H100).
    q_scale: float32 [B, S, H] or None: the result is that of queries q · q_scale (per token and head), with the
        factor folded into each row's logit scale instead of applied to q (q's RMS normalization, `Kernels.q_norm`
        "fold"); the Triton fallback applies it to q.
    """
    _check_shapes(q, kv, q_pos, sinks, compressed, compress_rate, sliding_window, config, kv_offset, topk_indices)
    if q_scale is not None and (q_scale.shape != q.shape[:3] or q_scale.dtype != F32):
        raise ValueError(f"q_scale must be float32 [B, S, H] = {q.shape[:3]}, got {q_scale.dtype} {q_scale.shape}")
    if window_rows is not None:
        lo, hi = window_rows
        if check_positions or lo.shape != q_pos.shape or hi.shape != q_pos.shape:
            raise ValueError(f"window_rows needs check_positions=False and (lo, hi) int32 [B, S] = {q_pos.shape}; "
                             f"got {lo.shape}, {hi.shape}")  # fmt: skip
    if "dump" in config.debug:
        raise ValueError("MgpuConfig.debug 'dump' adds an output: call v4_attention_mgpu_kernel_call directly")
    b, s, h, d = q.shape

    def triton_path(q, kv, q_pos, sinks, compressed, kv_pos):
        from dsv4.pallas.attention import v4_attention  # local import: keeps this module importable on its own

        return v4_attention(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale,
                            compressed=compressed, compress_rate=compress_rate, topk_indices=topk_indices,
                            q_scale=q_scale)  # fmt: skip

    if kv_pos is not None:
        return triton_path(q, kv, q_pos, sinks, compressed, kv_pos)

    n_vis = csa = None
    if topk_indices is not None:
        rows, bits, n_vis = csa_operands(topk_indices, compressed.shape[1], config.block_kv)
        csa = (rows, bits)
    elif compressed is not None:
        n_vis = jnp.clip((q_pos + 1) // compress_rate, 0, compressed.shape[1]).astype(jnp.int32)  # [B, S]

    def mgpu_path(q, kv, q_pos, sinks, compressed, kv_pos):
        del q_pos, kv_pos
        return v4_attention_mgpu_kernel_call(q, kv, n_vis, sinks * LOG2E, sliding_window=sliding_window,
                                             scale=scale, compressed=compressed, config=config,
                                             interpret=interpret, kv_offset=kv_offset,
                                             window_rows=window_rows, csa=csa, q_scale=q_scale)  # fmt: skip

    if not check_positions:
        return mgpu_path(q, kv, q_pos, sinks, compressed, None)
    t = kv.shape[1]
    before = q_pos[:, :1] - kv_offset + jnp.arange(kv_offset, dtype=jnp.int32)[None]  # the halo's positions
    full_pos = jnp.concatenate([before, q_pos], axis=1)
    full_pos = jnp.pad(full_pos, ((0, 0), (0, t - s - kv_offset)), constant_values=-1)  # rows past q's: empty
    return lax.cond(positions_are_aligned(q_pos), mgpu_path, triton_path, q, kv, q_pos, sinks, compressed, full_pos)
