"""DeepSeek-V4 decode attention over a paged cache (flash-decoding), as a Triton-lowered Pallas kernel, with its
jnp reference.

One new token per request, requests of different lengths in one batch. Each query (request b, head h) sees the
last `sliding_window` raw tokens of its request (a ring of pages), optionally compressed entries from a second
paged pool (HCA: every visible entry; CSA: the indexer's top-k picks), and a per-head sink logit. All heads share
the one KV head that is both K and V. Layout of this file (see dsv4/pallas/README.md):

- `BlockSizes`                       tile sizes, the split count and launch parameters (frozen, validated).
- `paged_decode_attention_kernel`    one program = one (request, head block, key split); writes a partial
                                     softmax state (max, sum, acc) for its share of the keys.
- `paged_decode_attention`           the public jitted entry: checks shapes/dtypes, computes per-request bounds,
                                     calls `pl.pallas_call`, and combines the splits exactly in jnp. On Hopper,
                                     window and HCA layers with bf16 pages (or whole FP8 rows with per-channel
                                     scales) go to `dsv4.pallas.decode_mgpu` (the Mosaic GPU kernel, same
                                     contract) unless impl="triton".
- `paged_decode_attention_reference` the spec in plain jnp (gathers every key, materialized mask), for tests.

Cache layout (the cache subsystem adapts to this; dsv4/cache/README.md sizes the page groups):

    Window ring.  kv_pages [P, page_size, D], block_tables [B, max_pages] int32, seq_lens [B] int32.
        Request b has seq_lens[b] = L tokens, the new one included, and the new token's KV is already written.
        Token t (0-based position) lives in ring slot r = t mod ring_size, i.e. at
            kv_pages[block_tables[b, r // page_size], r % page_size, :].
        ring_size defaults to sliding_window (the cache manager's `max_entries=sliding_window` group, which
        needs ceil(sliding_window / page_size) pages); any ring_size >= sliding_window works, and a ring_size
        at least the longest request is a plain linear paged cache. The query (position L - 1) sees tokens
        max(0, L - sliding_window) .. L - 1. L = 0 marks an empty batch slot (output 0).
    Compressed pool (optional).  compressed_pages [Pc, compressed_page_size, D],
        compressed_block_tables [B, max_compressed_pages] int32, compressed_lens [B] int32.
        Entry c of request b lives at compressed_pages[compressed_block_tables[b, c // cps], c % cps, :]
        (cps = compressed_page_size); compressed_lens[b] = entries present and visible (for HCA the caller
        passes L // compress_rate: complete entries only), capped at max_compressed_pages · cps.
        HCA (topk_indices None): entries 0 .. compressed_lens[b] - 1 are all visible.
        CSA: topk_indices [B, K] int32 lists entry ids (distinct; -1 = none; ids outside
        [0, compressed_lens[b]) are ignored). The list is taken as is: no causal check beyond that.
    FP8 (optional): kv_pages / compressed_pages float8_e4m3fn with float32 scales, value = f32(fp8) · scale:
        per channel [D], or per token and 64-channel tile [P, page_size, D // 64] (paged like the values).
    Split FP8 rows (optional; the cache's own FP8 formats, `dsv4.cache.layout.KVFormat`): kv_pages /
        compressed_pages hold a row's first D - Dr channels in FP8, scaled over those channels, and kv_rope_pages /
        compressed_rope_pages [P, page_size, Dr] its RoPE channels (bf16), paged alike: the row is their join.
    Block-table entries past what a request uses are never dereferenced (any id, e.g. the null page 0).

NOTE: flash-decoding. The keys of one request (window blocks, then compressed blocks, `block_kv` keys each) are
dealt to `num_splits` programs in contiguous runs; each writes (max, sum, acc) with the max in the log2 domain,
starting from an empty state (no sink). The sink joins once, in the jnp combine, so it is neither lost nor counted
per split. A split with no keys writes (-1e30, 0, 0) and drops out of the combine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv4.pallas import decode_mgpu as dm
from dsv4.pallas._device import is_hopper as _is_hopper

# NOTE: the row loaders and the online-softmax step are the prefill kernel's (attention_common), shared on purpose:
# the two kernels must round identically (FP8 → q.dtype, P → q.dtype for P·V, log2-domain exp2).
from dsv4.pallas.attention_common import (
    F32,
    FP8,
    LOG2E,
    M_FLOOR,
    MIN_DOT_DIM,
    check_decode_inputs,
    combine_splits,
    default_num_splits,
    gather_pages_reference,
    is_power_of_2,
    load_paged_rows,
    load_rope_rows,
    online_softmax_step,
)

__all__ = ["FP8_BLOCK_SIZES", "SPLIT_ROW_BLOCK_SIZES", "BlockSizes", "default_block_sizes", "default_num_splits",
           "paged_decode_attention", "paged_decode_attention_kernel", "paged_decode_attention_reference",
           "unsupported_shape"]





@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of `paged_decode_attention`.

    block_h:    heads per program (clamped to H; must then divide H). Tile rows M = block_h (one token).
    block_kv:   keys per inner step (window tokens, compressed entries or top-k slots; gathered row by row).
    num_splits: key-axis splits per (request, head block). None: `default_num_splits` (one wave of programs over
                the device's SMs, at most one split per key block).
    num_warps, num_stages: Triton launch parameters (None: 8 warps for D >= 256, else 4; 2 stages).

    Defaults are picked for H = 64, D = 512 on H200, not measured: one program holds all 64 heads of a request,
    so each KV row is read once per split for every head (MQA); the [64, 512] f32 accumulator is 128 registers
    per thread at 8 warps, as in the prefill kernel.
    """

    block_h: int = 64
    block_kv: int = 64
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        if not is_power_of_2(self.block_h):
            raise ValueError(f"BlockSizes.block_h={self.block_h} must be a power of two")
        if not is_power_of_2(self.block_kv) or self.block_kv < MIN_DOT_DIM:
            raise ValueError(f"BlockSizes.block_kv={self.block_kv} must be a power of two >= {MIN_DOT_DIM}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"BlockSizes.num_splits={self.num_splits} must be None or >= 1")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 1")


# NOTE: split rows carry a second pair of dots (q_rope · K_ropeᵀ, P · K_rope) and their operands, which at the
# whole-row tiles (64 keys, 2 stages) need more shared memory than a Hopper block has: they get tiles of their own.
SPLIT_ROW_BLOCK_SIZES = BlockSizes(block_kv=32, num_stages=1)
# NOTE: whole e4m3 rows take 1 stage: the dequantized tile feeds the dots, so a second stage only holds bytes
# (docs/kernels/decode.md).
FP8_BLOCK_SIZES = BlockSizes(num_stages=1)


def default_block_sizes(split_rows: bool, fp8: bool = False) -> BlockSizes:
    """The tiles `paged_decode_attention` uses when given none: `SPLIT_ROW_BLOCK_SIZES` for split rows (either
    source), `FP8_BLOCK_SIZES` for whole e4m3 rows (fp8: either source), else `BlockSizes()`."""
    return SPLIT_ROW_BLOCK_SIZES if split_rows else FP8_BLOCK_SIZES if fp8 else BlockSizes()


# ---------------------------------------------------------------------------------------------
# Reference: the spec, every key gathered and masked. Fine for small shapes only.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "ring_size"))
def paged_decode_attention_reference(
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
    topk_indices: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    compressed_scales: jax.Array | None = None,
    kv_rope_pages: jax.Array | None = None,
    compressed_rope_pages: jax.Array | None = None,
) -> jax.Array:
    """Paged V4 decode attention straight from the spec (same arguments as `paged_decode_attention`). → [B, H, D].

    Numerics follow `dsv4.pallas.attention.v4_attention_reference`: f32 logits, the sink joins the row max,
    unnormalized probabilities rounded to the value dtype for P·V (f32 accumulate), divided at the end.
    """
    ring_size, _, _ = check_decode_inputs(
        q, kv_pages, block_tables, seq_lens, sinks, sliding_window=sliding_window, ring_size=ring_size,
        compressed_pages=compressed_pages, compressed_block_tables=compressed_block_tables,
        compressed_lens=compressed_lens, topk_indices=topk_indices, kv_scales=kv_scales,
        compressed_scales=compressed_scales, kv_rope_pages=kv_rope_pages, compressed_rope_pages=compressed_rope_pages,
    )  # fmt: skip
    b = q.shape[0]
    token = seq_lens[:, None] - sliding_window + jnp.arange(sliding_window)  # [B, W]: the window's positions
    mask = token >= 0
    keys = gather_pages_reference(kv_pages, kv_scales, block_tables, jnp.where(mask, token, 0) % ring_size, q.dtype,
                             kv_rope_pages)  # fmt: skip
    if compressed_pages is not None:
        capacity = compressed_block_tables.shape[1] * compressed_pages.shape[1]
        count = jnp.minimum(compressed_lens, capacity)[:, None]  # [B, 1]
        if topk_indices is None:  # HCA
            entry = jnp.broadcast_to(jnp.arange(capacity), (b, capacity))
        else:  # CSA
            entry = topk_indices
        cmask = (entry >= 0) & (entry < count)  # [B, N]
        entries = gather_pages_reference(compressed_pages, compressed_scales, compressed_block_tables,
                                    jnp.where(cmask, entry, 0), q.dtype, compressed_rope_pages)  # fmt: skip
        keys = jnp.concatenate([keys, entries], axis=1)  # [B, W + N, D]
        mask = jnp.concatenate([mask, cmask], axis=1)
    keys = jnp.where(mask[..., None], keys, 0)  # rows nobody wrote may hold anything (NaN): 0 · NaN is NaN
    logits = jnp.einsum("bhd,bnd->bhn", q, keys, preferred_element_type=F32) * scale  # [B, H, N]
    logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
    row_max = jnp.maximum(jnp.maximum(logits.max(-1), sinks), M_FLOOR)  # [B, H]
    probs = jnp.exp(logits - row_max[..., None])  # unnormalized
    denom = probs.sum(-1) + jnp.exp(sinks - row_max)
    out = jnp.einsum("bhn,bnd->bhd", probs.astype(keys.dtype), keys, preferred_element_type=F32)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q.dtype)


def unsupported_shape(num_heads: int, head_dim: int, block_sizes: BlockSizes = BlockSizes(), *,
                      compiled: bool = True) -> str | None:
    """Why the Triton kernel cannot take q of num_heads × head_dim at these tiles (None: it can). compiled: for
    the GPU; the interpreter also takes tile rows below the 16 a compiled `tl.dot` needs."""
    block_h = min(block_sizes.block_h, num_heads)
    if not is_power_of_2(head_dim) or head_dim < MIN_DOT_DIM:
        return f"head dim D={head_dim} must be a power of two >= {MIN_DOT_DIM}"
    if num_heads % block_h:
        return f"BlockSizes.block_h={block_sizes.block_h} does not divide num_heads={num_heads}"
    if compiled and block_h < MIN_DOT_DIM:
        return f"tile rows block_h = {block_h} < {MIN_DOT_DIM} for num_heads={num_heads}"
    return None


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------
def _split_softmax_step(carry, q, q_rope, keys, rope_keys, mask, *, logit_scale, compute_dtype):
    """`attention_common.online_softmax_step` over split rows: keys [N, D] the nope channels (0 in the last Dr),
    rope_keys [N, Dr] the RoPE ones, q_rope [M, Dr] q's last Dr channels; carry (acc [M, D], acc_rope [M, Dr], max,
    sum). Logits as one f32 sum of the two dots; P rounded once, as for whole rows."""
    acc, acc_rope, row_max, row_sum = carry
    dims = (((1,), (1,)), ((), ()))
    s = lax.dot_general(q, keys, dims, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    s = s + lax.dot_general(q_rope, rope_keys, dims, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    s = jnp.where(mask, s * logit_scale, -jnp.inf)
    max_next = jnp.maximum(row_max, s.max(axis=1))  # never -inf: starts at M_FLOOR
    alpha = jnp.exp2(row_max - max_next)
    p = jnp.exp2(s - max_next[:, None])
    row_sum = row_sum * alpha + p.sum(axis=1)
    p = p.astype(compute_dtype)
    acc = acc * alpha[:, None] + jnp.dot(p, keys, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    acc_rope = acc_rope * alpha[:, None] + jnp.dot(p, rope_keys, precision=lax.Precision.HIGHEST,
                                                   preferred_element_type=F32)  # fmt: skip
    return acc, acc_rope, max_next, row_sum


def paged_decode_attention_kernel(
    q_ref,  # [block_h, D]
    meta_ref,  # [4]: seq_len, window tokens visible, compressed items to scan, compressed entries present
    block_table_ref,  # [max_pages]
    kv_ref,  # [P · page_size, D] (pages flattened), or [P · page_size, D - Dr] FP8 beside kv_rope_ref
    kv_scales_ref,  # [D] or [P · page_size, D // 64] or None (per the channels kv_ref holds)
    kv_rope_ref,  # [P · page_size, Dr] or None: the RoPE channels of split rows
    compressed_table_ref,  # [max_compressed_pages] or None
    compressed_ref,  # [Pc · cps, D] or None (or the nope channels, as kv_ref)
    compressed_scales_ref,  # [D] or [Pc · cps, D // 64] or None
    compressed_rope_ref,  # [Pc · cps, Dr] or None
    topk_ref,  # [K] or None
    acc_init_ref,  # aliased partial buffers or None; never read
    max_init_ref,
    sum_init_ref,
    rope_init_ref,
    acc_ref,  # [block_h, D] f32 (split rows: their RoPE columns 0)
    max_ref,  # [block_h] f32, log2 domain
    sum_ref,  # [block_h] f32
    rope_acc_ref,  # [block_h, Dr] f32 or None: P·V of split rows' RoPE channels (added to acc's last Dr columns)
    *,
    sliding_window: int,
    ring_size: int,
    page_size: int,
    compressed_page_size: int,
    scale: float,
    num_splits: int,
    kv_scale_layout: str | None,
    compressed_scale_layout: str | None,
    block_kv: int,
):
    """One program: block_h heads of one request, against its share (split pl.program_id(2)) of the keys.

    The request's key blocks, window first, are numbered 0 .. n_window_blocks + n_compressed_blocks - 1 and split
    into `num_splits` contiguous runs; this program walks its run in two loops (window part, compressed part),
    gathering rows through the block tables. The state starts empty: max = -1e30 (never -inf), sum = 0, acc = 0.
    """
    del acc_init_ref, max_init_ref, sum_init_ref, rope_init_ref, sliding_window
    block_h, head_dim = q_ref.shape
    compute_dtype = q_ref.dtype
    split = pl.program_id(2)

    q = q_ref[...]  # [block_h, D]
    seq_len, n_window, n_items, count = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    n_window_blocks = lax.div(n_window + block_kv - 1, block_kv)
    n_blocks = n_window_blocks + lax.div(n_items + block_kv - 1, block_kv)
    per_split = lax.div(n_blocks + num_splits - 1, num_splits)
    lo = jnp.minimum(split * per_split, n_blocks)
    hi = jnp.minimum(lo + per_split, n_blocks)

    has_rope = rope_acc_ref is not None  # some source holds split rows: the state carries acc_rope
    dr = rope_acc_ref.shape[-1] if has_rope else 0
    q_rope = q_ref[:, pl.ds(head_dim - dr, dr)] if has_rope else None
    whole = functools.partial(online_softmax_step, logit_scale=scale * LOG2E, compute_dtype=compute_dtype)
    split_step = functools.partial(_split_softmax_step, logit_scale=scale * LOG2E, compute_dtype=compute_dtype)

    def attend(carry, ref, scales_ref, rope_ref, scale_layout, row, valid):
        keys = load_paged_rows(ref, scales_ref, scale_layout, row, valid, head_dim, compute_dtype)  # [N, D]
        mask = jnp.broadcast_to(valid[None, :], (block_h, block_kv))
        if not has_rope:
            return whole(carry, q, keys, mask)
        if rope_ref is None:  # whole rows beside split ones: acc_rope only rescaled (P·0)
            zeros = jnp.zeros((block_kv, dr), compute_dtype)
            return split_step(carry, q, q_rope, keys, zeros, mask)
        return split_step(carry, q, q_rope, keys, load_rope_rows(rope_ref, row, valid, compute_dtype), mask)

    carry = (jnp.zeros((block_h, head_dim), F32), jnp.full((block_h,), M_FLOOR, F32), jnp.zeros((block_h,), F32))
    if has_rope:
        carry = (carry[0], jnp.zeros((block_h, dr), F32), *carry[1:])
    first_token = seq_len - n_window

    def window_body(i, carry):
        j = i * block_kv + jnp.arange(block_kv)  # [N]: j-th visible token of the window
        valid = j < n_window
        slot = lax.rem(first_token + j, ring_size)  # ring slot (positions are >= 0)
        page = plgpu.load(block_table_ref.at[lax.div(slot, page_size)], mask=valid, other=0)  # [N]
        row = jnp.where(valid, page * page_size + lax.rem(slot, page_size), 0)
        return attend(carry, kv_ref, kv_scales_ref, kv_rope_ref, kv_scale_layout, row, valid)

    carry = lax.fori_loop(jnp.minimum(lo, n_window_blocks), jnp.minimum(hi, n_window_blocks), window_body, carry)

    if compressed_ref is not None:

        def compressed_body(i, carry):
            item = i * block_kv + jnp.arange(block_kv)  # [N]: HCA entry id, or CSA top-k slot
            if topk_ref is None:
                entry = item
            else:
                entry = plgpu.load(topk_ref.at[item], mask=item < n_items, other=-1)
            valid = (item < n_items) & (entry >= 0) & (entry < count)
            entry = jnp.where(valid, entry, 0)
            page = plgpu.load(compressed_table_ref.at[lax.div(entry, compressed_page_size)], mask=valid, other=0)
            row = jnp.where(valid, page * compressed_page_size + lax.rem(entry, compressed_page_size), 0)
            return attend(carry, compressed_ref, compressed_scales_ref, compressed_rope_ref, compressed_scale_layout,
                          row, valid)  # fmt: skip

        start = jnp.maximum(lo, n_window_blocks) - n_window_blocks
        stop = jnp.maximum(hi, n_window_blocks) - n_window_blocks
        carry = lax.fori_loop(start, stop, compressed_body, carry)

    if has_rope:
        rope_acc_ref[...] = carry[1]
        carry = (carry[0], *carry[2:])
    acc, row_max, row_sum = carry
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


# ---------------------------------------------------------------------------------------------
# Public entry.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "ring_size", "block_sizes", "interpret",
                                             "impl"))  # fmt: skip
def paged_decode_attention(
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
    topk_indices: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    compressed_scales: jax.Array | None = None,
    kv_rope_pages: jax.Array | None = None,
    compressed_rope_pages: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    out_init: float | jax.Array | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Decode attention for a ragged batch over paged caches (layout: module docstring). → [B, H, D] in q.dtype.

    q:            [B, H, D]  one new token per request (bf16 / f16 / f32; D a power of two >= 16)
    kv_pages:     [P, page_size, D] window ring pages (q.dtype, or float8_e4m3fn with kv_scales)
    block_tables: [B, max_pages] int32, max_pages >= ceil(ring_size / page_size)
    seq_lens:     [B] int32 tokens per request including the new one (0 = empty slot)
    sinks:        [H] float32 per-head sink logit
    sliding_window: window length W; ring_size: ring slots per request (default W, must be >= W)
    scale:        logit scale
    compressed_pages [Pc, cps, D], compressed_block_tables [B, max_cpages] int32, compressed_lens [B] int32:
                  the compressed pool (HCA when topk_indices is None; CSA with topk_indices [B, K] int32)
    kv_scales / compressed_scales: float32 [D] (per channel) or [pages, page_size, D // 64] (per token, 64-tiles)
    kv_rope_pages [P, page_size, Dr] / compressed_rope_pages [Pc, cps, Dr]: split rows, as the cache's FP8 formats
                  store them (`dsv4.cache.layout.KVFormat`): the pages beside them hold the first D - Dr channels
                  in FP8, scaled over those channels ([D - Dr], or [pages, page_size, ceil((D - Dr) / 64)]), and
                  these the RoPE channels in bf16 / f16 / f32. Triton only (the Mosaic kernel takes whole rows).
    block_sizes:  tiles, split count and launch parameters (None: `default_block_sizes`, by whether the rows are
                  split or FP8); interpret: run in the Pallas interpreter (CPU).
    out_init:     testing hook; the kernel's partial buffers (acc, max, sum per split) start filled with this value
                  (aliased), so anything the kernel fails to write reaches the output (pass NaN to poison).
    impl:         "triton" (this file's kernel), "mgpu" (`dsv4.pallas.decode_mgpu`, the Mosaic GPU kernel: Hopper,
                  window / HCA layers, bf16 or f16 pages or FP8 ones with per-channel scales; ValueError otherwise)
                  or "auto": mgpu where it runs (a
                  Hopper GPU, not interpret, no out_init, inputs it takes; block_sizes.num_splits carries over),
                  else triton.

    Grid (B, H // block_h, num_splits); the splits are combined in jnp (O(B · num_splits · H · D)).
    """
    ring_size, kv_layout, compressed_layout = check_decode_inputs(
        q, kv_pages, block_tables, seq_lens, sinks, sliding_window=sliding_window, ring_size=ring_size,
        compressed_pages=compressed_pages, compressed_block_tables=compressed_block_tables,
        compressed_lens=compressed_lens, topk_indices=topk_indices, kv_scales=kv_scales,
        compressed_scales=compressed_scales, kv_rope_pages=kv_rope_pages, compressed_rope_pages=compressed_rope_pages,
    )  # fmt: skip
    if impl not in ("auto", "triton", "mgpu"):
        raise ValueError(f"impl={impl!r} must be 'auto', 'triton' or 'mgpu'")
    if block_sizes is None:
        fp8 = any(x is not None and x.dtype == FP8 for x in (kv_pages, compressed_pages))
        block_sizes = default_block_sizes(kv_rope_pages is not None or compressed_rope_pages is not None, fp8)
    if impl != "triton":
        config = dm.MgpuDecodeConfig(num_splits=block_sizes.num_splits)
        if kv_rope_pages is not None or compressed_rope_pages is not None:
            why = "split rows (kv_rope_pages / compressed_rope_pages): the Mosaic kernel takes whole rows only"
        else:
            why = dm.unsupported_reason(q, kv_pages, sliding_window=sliding_window, ring_size=ring_size,
                                        compressed_pages=compressed_pages, topk_indices=topk_indices,
                                        kv_scales=kv_scales, compressed_scales=compressed_scales,
                                        config=config)  # fmt: skip
        if impl == "mgpu" and why:
            raise ValueError(f"paged_decode_attention(impl='mgpu'): {why}")
        if impl == "mgpu" or (not why and not interpret and out_init is None and _is_hopper()):
            return dm.paged_decode_attention_mgpu(q, kv_pages, block_tables, seq_lens, sinks,
                                                  sliding_window=sliding_window, scale=scale, ring_size=ring_size,
                                                  compressed_pages=compressed_pages,
                                                  compressed_block_tables=compressed_block_tables,
                                                  compressed_lens=compressed_lens, kv_scales=kv_scales,
                                                  compressed_scales=compressed_scales, config=config)  # fmt: skip
    b, h, d = q.shape
    page_size = kv_pages.shape[1]
    why = unsupported_shape(h, d, block_sizes, compiled=not interpret)
    if why:
        raise ValueError(f"{why} (q.shape={q.shape})")
    block_h, block_kv = min(block_sizes.block_h, h), block_sizes.block_kv

    # Per-request bounds: (seq_len, window tokens visible, compressed items to scan, compressed entries present).
    seq_lens = jnp.maximum(seq_lens, 0)
    n_window = jnp.minimum(seq_lens, sliding_window)
    zeros = jnp.zeros_like(seq_lens)
    count, n_items, max_items, compressed_page_size = zeros, zeros, 0, 1
    if compressed_pages is not None:
        compressed_page_size = compressed_pages.shape[1]
        capacity = compressed_block_tables.shape[1] * compressed_page_size
        count = jnp.clip(compressed_lens, 0, capacity)
        if topk_indices is None:
            n_items, max_items = count, capacity
        else:  # scan up to the last listed slot
            k = topk_indices.shape[1]
            n_items, max_items = jnp.where(topk_indices >= 0, jnp.arange(1, k + 1), 0).max(axis=1), k
    meta = jnp.stack([seq_lens, n_window, n_items, count], axis=1).astype(jnp.int32)  # [B, 4]

    num_splits = block_sizes.num_splits
    if num_splits is None:
        max_blocks = pl.cdiv(sliding_window, block_kv) + pl.cdiv(max_items, block_kv)
        num_splits = default_num_splits(b * (h // block_h), max_blocks)
    grid = (b, h // block_h, num_splits)

    def flat(pages):  # [P, ps, X] → [P · ps, X]: rows gathered by page · ps + row
        return pages.reshape(pages.shape[0] * pages.shape[1], *pages.shape[2:])

    def scale_spec(layout, scales):
        return None if layout is None else pl.BlockSpec(scales.shape, lambda i, j, s: (0,) * scales.ndim)

    def full_spec(x):
        return None if x is None else pl.BlockSpec(x.shape, lambda i, j, s: (0,) * x.ndim)

    kv_flat, kv_scales_flat = flat(kv_pages), kv_scales if kv_layout != "tile" else flat(kv_scales)
    kv_rope_flat = None if kv_rope_pages is None else flat(kv_rope_pages)
    compressed_flat = compressed_scales_flat = compressed_rope_flat = None
    if compressed_pages is not None:
        compressed_flat = flat(compressed_pages)
        compressed_scales_flat = compressed_scales if compressed_layout != "tile" else flat(compressed_scales)
        compressed_rope_flat = None if compressed_rope_pages is None else flat(compressed_rope_pages)

    dr = next((r.shape[-1] for r in (kv_rope_pages, compressed_rope_pages) if r is not None), 0)
    acc_spec = pl.BlockSpec((None, None, block_h, d), lambda i, j, s: (i, s, j, 0))
    stat_spec = pl.BlockSpec((None, None, block_h), lambda i, j, s: (i, s, j))
    rope_spec = pl.BlockSpec((None, None, block_h, dr), lambda i, j, s: (i, s, j, 0)) if dr else None
    out_shape = (jax.ShapeDtypeStruct((b, num_splits, h, d), F32), jax.ShapeDtypeStruct((b, num_splits, h), F32),
                 jax.ShapeDtypeStruct((b, num_splits, h), F32),
                 jax.ShapeDtypeStruct((b, num_splits, h, dr), F32) if dr else None)  # fmt: skip
    out_specs = (acc_spec, stat_spec, stat_spec, rope_spec)
    inits = (None,) * 4
    if out_init is not None:
        inits = tuple(None if o is None else jnp.full(o.shape, out_init, F32) for o in out_shape)
    in_specs = [
        pl.BlockSpec((None, block_h, d), lambda i, j, s: (i, j, 0)),  # q
        pl.BlockSpec((None, 4), lambda i, j, s: (i, 0)),  # meta
        pl.BlockSpec((None, block_tables.shape[1]), lambda i, j, s: (i, 0)),  # block_tables
        pl.BlockSpec(kv_flat.shape, lambda i, j, s: (0, 0)),  # kv pages
        scale_spec(kv_layout, kv_scales_flat),
        full_spec(kv_rope_flat),
        None
        if compressed_pages is None
        else pl.BlockSpec((None, compressed_block_tables.shape[1]), lambda i, j, s: (i, 0)),  # fmt: skip
        None if compressed_pages is None else pl.BlockSpec(compressed_flat.shape, lambda i, j, s: (0, 0)),
        scale_spec(compressed_layout, compressed_scales_flat),
        full_spec(compressed_rope_flat),
        None if topk_indices is None else pl.BlockSpec((None, topk_indices.shape[1]), lambda i, j, s: (i, 0)),
        *(None if init is None else spec for init, spec in zip(inits, out_specs)),
    ]
    args = (q, meta, block_tables, kv_flat, kv_scales_flat, kv_rope_flat, compressed_block_tables, compressed_flat,
            compressed_scales_flat, compressed_rope_flat, topk_indices, *inits)  # fmt: skip
    n_args = sum(a is not None for a in args)  # pallas_call numbers inputs after dropping the Nones
    n_out = sum(o is not None for o in out_shape)
    kernel = functools.partial(
        paged_decode_attention_kernel, sliding_window=sliding_window, ring_size=ring_size, page_size=page_size,
        compressed_page_size=compressed_page_size, scale=float(scale), num_splits=num_splits,
        kv_scale_layout=kv_layout, compressed_scale_layout=compressed_layout, block_kv=block_kv,
    )  # fmt: skip
    num_warps = block_sizes.num_warps or (8 if d >= 256 else 4)
    acc, row_max, row_sum, rope_acc = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={} if out_init is None else {n_args - n_out + k: k for k in range(n_out)},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(*args)
    if dr:  # split rows' RoPE channels: their P·V lands in the last Dr columns (0 in acc for those rows)
        acc = acc.at[..., d - dr :].add(rope_acc)
    return combine_splits(acc, row_max, row_sum, sinks, q.dtype)
