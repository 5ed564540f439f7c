"""DeepSeek-V4 attention: shared-KV MQA with sinks, sliding window, and the CSA / HCA compressors.

One attention block per layer. All three layer types attend over a causal sliding window of raw
tokens; HCA layers add every causally complete entry of a 128:1 compressor, CSA layers add the
`index_topk` entries of a 4:1 overlapping compressor that a lightning indexer picks per query.

The core (softmax over window + compressed keys + sink) sits behind one function boundary with
interchangeable implementations (`ATTENTION_IMPLS`): "jnp" (`core_attention_jnp`, XLA), "pallas"
(`core_attention_pallas`: the Mosaic GPU kernel `dsv4/pallas/attention_mgpu.py` for window / HCA prefill on
Hopper, else the Triton-lowered one in `dsv4/pallas/attention.py`), "sp" (sequence parallel over a mesh,
`dsv4/sharding/context_parallel.py`) and "auto" (the default: Pallas for the prefill on a GPU, jnp elsewhere);
a model picks one by name. Decode steps (one-token chunks) can bypass the core: with "pallas" (or "auto" on a GPU
over an FP8 cache, with `AUTO_DECODE_KERNEL` set) they run the paged decode kernel (`dsv4/pallas/decode.py`) on
the cache as stored (`Attention._decode_kernel_applies`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.cache.layout import KVFormat
from dsv4.cache.quant import rms_norm_bound
from dsv4.cache.store import KVStore, resolve_format
from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.layers import F32, RMSNorm, Rope, apply_rope, linear, param, rms_normalize

NEG_INF = float("-inf")


class CompressedKeys(NamedTuple):
    """Compressed entries a layer's queries may attend to, with the rule that says which.

    entries: [B, C, D]. HCA: `topk_indices` is None and query at position p sees entry c iff
    c < (p + 1) // rate. CSA: `topk_indices` [B, S, K] lists the entries each query sees (-1 = none).
    """

    entries: jax.Array
    rate: int
    topk_indices: jax.Array | None = None


# ---------------------------------------------------------------------------------------------
# The core: softmax(scale · q·k) over window keys and compressed keys, plus a per-head sink logit.
# ---------------------------------------------------------------------------------------------
def core_attention_jnp(
    q: jax.Array,
    kv: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    sinks: jax.Array,
    *,
    sliding_window: int,
    scale: float,
    compressed: CompressedKeys | None = None,
    kv_aligned: bool = False,
    query_chunk: int = 512,
) -> jax.Array:
    """Pure-jnp V4 attention core, processed in query chunks so memory is O(chunk · keys).

    q: [B, S, H, D]; kv: [B, T, D] (K = V, one head); q_pos: [B, S]; kv_pos: [B, T] (-1 = empty slot);
    sinks: [H]. A query at p sees kv row j iff p - sliding_window < kv_pos[j] <= p. → [B, S, H, D].
    `kv_aligned` promises kv row i is query i's own token (T == S, kv_pos == q_pos, a full-sequence
    forward): each query chunk then only reads the rows its window can reach, not all T.
    """
    b, s, h, d = q.shape
    n_chunks = -(-s // query_chunk)
    chunk = -(-s // n_chunks)  # balanced chunks: no chunk is mostly padding
    pad = n_chunks * chunk - s

    def padded(x, value=0):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value) if pad else x

    def chunks(x):  # [B, S, ...] → [n_chunks, B, chunk, ...]
        return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

    xs = {"q": chunks(padded(q)), "pos": chunks(padded(q_pos))}
    if compressed is not None and compressed.topk_indices is not None:
        xs["topk"] = chunks(padded(compressed.topk_indices, -1))

    if kv_aligned:
        # Rows [start - (W - 1), start + chunk) cover every window of the chunk; pad in front for chunk 0.
        halo = min(sliding_window - 1, s)
        kv_band = jnp.pad(padded(kv), [(0, 0), (halo, 0), (0, 0)])
        pos_band = jnp.pad(padded(kv_pos, -1), [(0, 0), (halo, 0)], constant_values=-1)
        xs["start"] = jnp.arange(n_chunks) * chunk

    def one_chunk(x):
        qc, pos = x["q"], x["pos"]  # [B, Q, H, D], [B, Q]
        keys, key_pos = kv, kv_pos
        if kv_aligned:
            keys = jax.lax.dynamic_slice_in_dim(kv_band, x["start"], chunk + halo, axis=1)
            key_pos = jax.lax.dynamic_slice_in_dim(pos_band, x["start"], chunk + halo, axis=1)
        logits, values, masks = [], [], []
        logits.append(jnp.einsum("bqhd,btd->bqht", qc, keys, preferred_element_type=F32))
        values.append(("bqht,btd->bqhd", keys))
        masks.append((key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= pos[..., None])
                     & (key_pos[:, None, :] > pos[..., None] - sliding_window))  # fmt: skip
        if compressed is not None and compressed.topk_indices is None:  # HCA: causally complete entries
            entries = compressed.entries
            logits.append(jnp.einsum("bqhd,bcd->bqhc", qc, entries, preferred_element_type=F32))
            values.append(("bqhc,bcd->bqhd", entries))
            visible = (pos[..., None] + 1) // compressed.rate
            masks.append(jnp.arange(entries.shape[1])[None, None, :] < visible)
        elif compressed is not None:  # CSA: the indexer's picks
            idx = x["topk"]  # [B, Q, K]
            gathered = jax.vmap(lambda e, i: e[jnp.maximum(i, 0)])(compressed.entries, idx)  # [B, Q, K, D]
            logits.append(jnp.einsum("bqhd,bqkd->bqhk", qc, gathered, preferred_element_type=F32))
            values.append(("bqhk,bqkd->bqhd", gathered))
            masks.append(idx >= 0)
        logits = [jnp.where(m[:, :, None, :], lg * scale, NEG_INF) for lg, m in zip(logits, masks)]
        row_max = jnp.max(jnp.stack([lg.max(-1) for lg in logits]), axis=0)  # [B, Q, H]
        row_max = jnp.maximum(row_max, sinks.astype(F32))  # the sink joins the softmax
        probs = [jnp.exp(lg - row_max[..., None]) for lg in logits]
        denom = sum(p.sum(-1) for p in probs) + jnp.exp(sinks.astype(F32) - row_max)
        out = sum(jnp.einsum(eq, p.astype(v.dtype), v, preferred_element_type=F32) for p, (eq, v) in zip(probs, values))
        return (out / denom[..., None]).astype(q.dtype)

    out = jax.lax.map(one_chunk, xs) if n_chunks > 1 else one_chunk(jax.tree.map(lambda a: a[0], xs))[None]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * chunk, h, d)
    return out[:, :s]


# NOTE: one-token chunks on the Mosaic kernel: decode steps with attention_impl="pallas" whose cache the paged decode
# kernel does not take (`Attention._decode_kernel_applies`; every FP8-cache step until that kernel took split FP8
# rows). 2.2-11x the Triton kernel on an H200, its S = 1 tests pass, and inside the model each layer's output is as
# close to a float32 reference as jnp's (2.05e-3 against 2.08e-3). The model check's one miss (7.1e-2 at the first
# decode step) is that random model's sensitivity there: rounding-sized noise on jnp's own attention moves those
# logits by up to 7.1e-2 (docs/BENCHMARKS.md, "One-token chunks on the Mosaic kernel"). False sends them to Triton.
MOSAIC_ONE_TOKEN = True

# NOTE: True sends "auto" decode steps over an FP8 cache on a GPU to the paged decode kernel (the cache as stored)
# instead of the jnp route (a dequantized dense copy, then XLA). Off: in the model on an H200 the jnp step is as fast
# or faster, 1.42 against 1.50 ms (128K, batch 32) and 1.31 against 1.34 ms (512K, batch 2), measured once the step
# was no longer launch-bound (the mHC Sinkhorn kernel; docs/BENCHMARKS.md, "Where a decode step's time goes"). With
# the paged indexer the kernel route's GPU work is 707 against jnp's 883 us a step (128K, batch 32), but the timed
# steps were equal in two of three calls (1.07 / 1.09 ms; 512K, batch 2: 1.31 / 1.32; BENCHMARKS, "The decode step's
# indexer over its paged keys").
AUTO_DECODE_KERNEL = False

# NOTE: True lets a one-token step's indexer score its keys where the cache stores them, through the block table
# (`dsv4.pallas.indexer_paged.index_topk_paged`), whenever its top-k path is "pallas" ("auto" on a GPU for a 16-bit
# model): no dense copy of every listed key first (`KVStore.read`). False keeps the dense route for every step.
PAGED_INDEX_DECODE = True

# NOTE: True sends the cache writes of "auto" models on a GPU (window ring, compressed entries, indexer keys) to the
# quantize-and-write kernel (`dsv4.pallas.kv_write`) instead of XLA's quantize + scatter; attention_impl="pallas"
# takes the kernel everywhere (interpreted off a GPU). Off until `scripts/bench_kv_write.py` has timed it against
# XLA on a GPU: it was written in a session without one (KERNEL_NOTES, "FP8 quantize-and-write").
AUTO_KV_WRITE_KERNEL = False


def kv_write_impl(attention_impl: str) -> str:
    """`KVStore.write`'s impl for a model with this attention_impl: "pallas" for "pallas", and for "auto" on a GPU
    with `AUTO_KV_WRITE_KERNEL` set; "jnp" otherwise (the sequence-parallel cores keep XLA's writes, which GSPMD
    partitions)."""
    if attention_impl == "pallas" or (attention_impl == "auto" and AUTO_KV_WRITE_KERNEL
                                      and jax.default_backend() == "gpu"):  # fmt: skip
        return "pallas"
    return "jnp"


def core_attention_pallas(q, kv, q_pos, kv_pos, sinks, *, sliding_window: int, scale: float,
                          compressed: CompressedKeys | None = None, kv_aligned: bool = False,
                          query_chunk: int | None = None, kv_prefix: int = 0) -> jax.Array:  # fmt: skip
    """The blocked online-softmax Pallas kernel (`dsv4/pallas/attention.py`); interpreted off-GPU.

    kv_prefix: the layout of a cached chunk (`Attention.forward_chunk`): kv rows [0, kv_prefix) hold the
    kv_prefix positions just before q's first one, in order (-1 where there is none yet), and row kv_prefix + j
    holds query j's own token. On Hopper the Mosaic kernel then takes window and HCA chunks of more than one token
    whose prefix rows are all real (a run-time check; the Triton kernel otherwise, e.g. for a prompt's first
    chunk). One-token chunks too while `MOSAIC_ONE_TOKEN` is set (the default): there it is 2.2-11x the Triton
    kernel (docs/BENCHMARKS.md, "One-token chunks")."""
    from dsv4.pallas.attention import v4_attention

    del query_chunk  # the kernels find each query block's window band themselves
    sinks = sinks.astype(F32)
    entries = {} if compressed is None else dict(compressed=compressed.entries, compress_rate=compressed.rate)
    chunk = kv_prefix > 0 and (q.shape[1] > 1 or MOSAIC_ONE_TOKEN)
    if mosaic_applies(q, kv, compressed, kv_aligned or chunk):
        from dsv4.pallas.attention_mgpu import positions_are_aligned, v4_attention_mgpu

        if kv_aligned:
            # Hopper fast path (window and HCA, the full-sequence prefill). It checks at run time that positions
            # are contiguous and takes the Triton kernel otherwise.
            return v4_attention_mgpu(q, kv[:, : q.shape[1]], q_pos, sinks, sliding_window=sliding_window,
                                     scale=scale, **entries)  # fmt: skip
        whole = prefix_is_whole(q_pos, kv_pos, kv_prefix) & positions_are_aligned(q_pos)

        def mosaic(q, kv, q_pos, kv_pos):
            del kv_pos  # rows are placed by index: the prefix, then q's own tokens (padding rows only reach padding)
            return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=sliding_window, scale=scale,
                                     kv_offset=kv_prefix, check_positions=False, **entries)  # fmt: skip

        def triton(q, kv, q_pos, kv_pos):
            return v4_attention(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale, **entries)

        return jax.lax.cond(whole, mosaic, triton, q, kv, q_pos, kv_pos)
    if compressed is not None:
        entries["topk_indices"] = compressed.topk_indices
    return v4_attention(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale,
                        interpret=jax.default_backend() != "gpu", **entries)  # fmt: skip


def prefix_is_whole(q_pos: jax.Array, kv_pos: jax.Array, kv_prefix: int) -> jax.Array:
    """Whether every batch row's kv rows [0, kv_prefix) hold exactly the kv_prefix positions before its first
    query, in order (none missing: a prompt's first chunk has none yet). → bool scalar."""
    before = q_pos[:, :1] - kv_prefix + jnp.arange(kv_prefix, dtype=q_pos.dtype)[None]  # [B, prefix]
    return jnp.all(kv_pos[:, :kv_prefix] == before) & jnp.all(before >= 0)


def mosaic_applies(q, kv, compressed, layout_ok) -> bool:
    """Whether the Mosaic GPU kernel (dsv4/pallas/attention_mgpu.py) takes this call: on Hopper-class GPUs, for
    the prefill of window and HCA layers (kv aligned with q, or a cached chunk's prefix layout: `layout_ok`) in
    bf16/f16 with 64-head groups and D in 128..512."""
    csa = compressed is not None and compressed.topk_indices is not None
    if jax.default_backend() != "gpu" or not layout_ok or csa:
        return False
    if "H100" not in jax.devices()[0].device_kind and "H200" not in jax.devices()[0].device_kind:
        return False
    d = q.shape[-1]
    same = kv.dtype == q.dtype and (compressed is None or compressed.entries.dtype == q.dtype)
    return q.dtype in (jnp.bfloat16, jnp.float16) and same and q.shape[2] % 64 == 0 and d % 128 == 0 and d <= 512


def core_attention_sp(*args, **kwargs) -> jax.Array:
    """Sequence-parallel core over the active mesh's "sp" axis: halo exchange and ring-passed compressed entries
    (dsv4/sharding/context_parallel.py); the jnp core when no such mesh is active or outside the full prefill."""
    from dsv4.sharding.context_parallel import core_attention_sp as sp_core

    return sp_core(*args, **kwargs)


def core_attention_sp_pallas(*args, **kwargs) -> jax.Array:
    """As "sp", with the Triton Pallas kernel for each shard's own attention (entries all-gathered instead of
    ring-passed; context_parallel.py docstring (d)). Correct on CPU (interpreted) and on 2 H200s
    (scripts/check_sp_gpu.py)."""
    from dsv4.sharding.context_parallel import core_attention_sp as sp_core

    return sp_core(*args, local_core="pallas", **kwargs)


def core_attention_auto(q, kv, q_pos, kv_pos, sinks, *, kv_aligned: bool = False, kv_prefix: int = 0,
                        **kwargs) -> jax.Array:  # fmt: skip
    """The default: the Pallas kernels for the bf16 / f16 prefill on a GPU, the full sequence or a cached chunk
    of more than one token (the Mosaic kernel for window / HCA layers on Hopper, 1.5-1.9x the Triton one, which
    takes CSA; both beat XLA, docs/BENCHMARKS.md), and the jnp core everywhere else (CPU, float32 models, decode
    steps; with `AUTO_DECODE_KERNEL` set, a decode step over an FP8 cache on a GPU skips the core for the paged
    decode kernel, `Attention._decode_kernel_applies`)."""
    prefill = kv_aligned or (kv_prefix > 0 and q.shape[1] > 1)
    if jax.default_backend() == "gpu" and prefill and q.dtype in (jnp.bfloat16, jnp.float16):
        return core_attention_pallas(q, kv, q_pos, kv_pos, sinks, kv_aligned=kv_aligned, kv_prefix=kv_prefix,
                                     **kwargs)  # fmt: skip
    return core_attention_jnp(q, kv, q_pos, kv_pos, sinks, kv_aligned=kv_aligned, **kwargs)


AttentionFn = Callable[..., jax.Array]
ATTENTION_IMPLS: dict[str, AttentionFn] = {"auto": core_attention_auto, "jnp": core_attention_jnp,
                                           "pallas": core_attention_pallas, "sp": core_attention_sp,
                                           "sp-pallas": core_attention_sp_pallas}  # fmt: skip


def register_attention_impl(name: str, fn: AttentionFn) -> None:
    """Makes `fn` (same signature as `core_attention_jnp`) selectable as `attention_impl=name`."""
    ATTENTION_IMPLS[name] = fn


def get_attention_impl(name: str) -> AttentionFn:
    try:
        return ATTENTION_IMPLS[name]
    except KeyError:
        raise ValueError(f"attention_impl={name!r}; available: {sorted(ATTENTION_IMPLS)}") from None


# ---------------------------------------------------------------------------------------------
# Compressors: pool `rate` tokens into one entry with a softmax gate per channel.
# ---------------------------------------------------------------------------------------------
def pool_windows(kv: jax.Array, gate: jax.Array, position_bias: jax.Array, rate: int, *, overlap: bool,
                 head_dim: int, prev_kv: jax.Array | None = None,
                 prev_gate: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """Softmax-gated pooling of complete windows.

    kv, gate: [B, S, W] with W = head_dim (no overlap) or 2·head_dim (overlap); only the first
    (S // rate) · rate tokens are used. position_bias: [rate, W]. → [B, S // rate, head_dim].
    With overlap (CSA), entry w pools 2·rate slots: window w-1's first half-channels ("Ca") and
    window w's second half-channels ("Cb"). Entry 0 takes its Ca slots from `prev_kv` / `prev_gate`
    ([B, rate, head_dim], the gate with its position bias already added), or none (gate -inf).
    """
    b, s, width = kv.shape
    n = s // rate
    if n == 0:
        return jnp.zeros((b, 0, head_dim), kv.dtype)
    kv = kv[:, : n * rate].reshape(b, n, rate, width)
    gate = gate[:, : n * rate].reshape(b, n, rate, width).astype(F32) + position_bias.astype(F32)
    if overlap:
        if prev_kv is None:
            prev_kv = jnp.zeros((b, rate, head_dim), kv.dtype)
            prev_gate = jnp.full((b, rate, head_dim), NEG_INF, F32)
        prev_kv = jnp.concatenate([prev_kv[:, None].astype(kv.dtype), kv[:, :-1, :, :head_dim]], axis=1)
        prev_gate = jnp.concatenate([prev_gate[:, None].astype(F32), gate[:, :-1, :, :head_dim]], axis=1)
        kv = jnp.concatenate([prev_kv, kv[..., head_dim:]], axis=2)  # [B, n, 2·rate, D]
        gate = jnp.concatenate([prev_gate, gate[..., head_dim:]], axis=2)
    weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
    return jnp.sum(kv * weights, axis=2)


def pool_windows_zigzag(kv: jax.Array, gate: jax.Array, position_bias: jax.Array, rate: int, n: int, *,
                        overlap: bool, head_dim: int) -> jax.Array:  # fmt: skip
    """`pool_windows` of a sequence held in zigzag order over n shards (dsv4/sharding/context_parallel.py, "Whole-model
    zigzag"): kv, gate [B, S, W] are 2n blocks of L rows (L a multiple of `rate`), slot j holding sequence block
    `zigzag_order(n)[j]`. → entries [B, S // rate, head_dim] in *sequence* order.

    Each block is pooled on its own; with overlap (CSA) a block's first entry takes its Ca half from the last window
    of the block before it in sequence order (a [B, rate, head_dim] slice per block), the first block's from none.
    """
    from dsv4.sharding.context_parallel import zigzag_order, zigzag_permute

    b, s, width = kv.shape
    blocks = 2 * n
    rows = s // blocks
    if rows * blocks != s or rows % rate:
        raise ValueError(f"zigzag pooling needs S = 2N · L with L a multiple of the rate {rate}; got S={s}, N={n}")
    order = zigzag_order(n)
    kv_b, gate_b = kv.reshape(b, blocks, rows, width), gate.reshape(b, blocks, rows, width)

    def pool(k, g, *prev):
        return pool_windows(k, g, position_bias, rate, overlap=overlap, head_dim=head_dim, prev_kv=prev[0] if prev
                            else None, prev_gate=prev[1] if prev else None)  # fmt: skip

    operands = [kv_b, gate_b]
    if overlap:
        slot = {g: j for j, g in enumerate(order)}
        before = jnp.asarray([slot[max(g - 1, 0)] for g in order])  # the slot of the block before, in sequence order
        first = jnp.asarray([g == 0 for g in order])[None, :, None, None]
        tail_gate = gate_b[:, :, rows - rate :, :head_dim].astype(F32) + position_bias[:, :head_dim].astype(F32)
        operands.append(jnp.take(kv_b[:, :, rows - rate :, :head_dim], before, axis=1))
        operands.append(jnp.where(first, NEG_INF, jnp.take(tail_gate, before, axis=1)))
    pooled = jax.vmap(pool, in_axes=1, out_axes=1)(*operands)  # [B, 2n, L // rate, head_dim], zigzag order
    return zigzag_permute(pooled.reshape(b, s // rate, head_dim), n, inverse=True)


class Compressor(nnx.Module):
    """Turns hidden states into compressed entries: project, pool windows, RMSNorm, RoPE at the window start.

    Used three ways: HCA (rate 128, no overlap, head_dim), CSA (rate 4, overlapping, head_dim) and the
    CSA indexer's own keys (rate 4, overlapping, index_head_dim).
    """

    def __init__(self, config: Config, *, rate: int, head_dim: int, overlap: bool, rngs: nnx.Rngs, dtype):
        width = 2 * head_dim if overlap else head_dim
        d = config.hidden_size
        self.kv_proj = nnx.Dict(weight=param(rngs, (width, d), ("kv_width", "embed"), dtype=dtype))
        self.gate_proj = nnx.Dict(weight=param(rngs, (width, d), ("kv_width", "embed"), dtype=dtype))
        self.position_bias = param(rngs, (rate, width), (None, "kv_width"), dtype=F32, init="zeros")
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps, axis_name="head_dim", rngs=rngs)
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap

    def __call__(self, x: jax.Array, rope: Rope, first_position: int | jax.Array = 0) -> jax.Array:
        """x: [B, S, hidden] → entries [B, S // rate, head_dim] for the complete windows (in sequence order, also
        when x is in zigzag order under a zigzag layout)."""
        kv = linear(x, self.kv_proj["weight"][...])
        gate = linear(x, self.gate_proj["weight"][...])
        from dsv4.sharding.context_parallel import zigzag_shards

        n = zigzag_shards()  # a sequence in zigzag order (whole-model zigzag): pool per block
        if n is None:
            pooled = pool_windows(kv, gate, self.position_bias[...], self.rate, overlap=self.overlap,
                                  head_dim=self.head_dim)  # fmt: skip
        else:
            pooled = pool_windows_zigzag(kv, gate, self.position_bias[...], self.rate, n, overlap=self.overlap,
                                         head_dim=self.head_dim)  # fmt: skip
        entries = self.kv_norm(pooled.astype(x.dtype))
        positions = (first_position + self.rate * jnp.arange(entries.shape[1]))[None]  # [1, C]
        cos, sin = rope.cos_sin(positions)
        return apply_rope(entries, cos.astype(x.dtype), sin.astype(x.dtype))

    def init_state(self, batch: int, capacity: int, dtype, fmt: KVFormat | None = None,
                   pages: tuple[int, int] | None = None) -> dict:  # fmt: skip
        """Per-slot compressor state: the entries so far (a `KVStore` in `fmt`, default unquantized `dtype`),
        the open window's raw projections, and (CSA) the last closed window's Ca half with its gate (bias
        added), which the next entry overlaps.

        Entries live per slot (`capacity` per request) or, with `pages=(num_pages, page_tokens)`, in a pool
        of `num_pages` pages of `page_tokens // rate` entries shared by all slots, which the request's
        token block table maps into. FP8 scales are set from the RMSNorm bound of `kv_norm` (quant.py)."""
        fmt = resolve_format(fmt, dtype, 0)
        width = 2 * self.head_dim if self.overlap else self.head_dim
        bound = rms_norm_bound(self.kv_norm.weight[...]) if fmt.quantized else None
        if pages is None:
            entries = KVStore.dense(batch, capacity, self.head_dim, fmt, bound=bound)
        else:
            num_pages, page_tokens = pages
            entries = KVStore.paged_pool(num_pages, page_tokens // self.rate, self.head_dim, fmt, bound=bound)
        state = {
            "entries": entries,
            "open_kv": jnp.zeros((batch, self.rate, width), dtype),
            "open_gate": jnp.zeros((batch, self.rate, width), dtype),
        }
        if self.overlap:
            state["prev_kv"] = jnp.zeros((batch, self.rate, self.head_dim), dtype)
            state["prev_gate"] = jnp.full((batch, self.rate, self.head_dim), NEG_INF, F32)
        return state

    @staticmethod
    def read(state: dict, dtype, block_table: jax.Array | None = None) -> jax.Array:
        """All entry slots of each request, dequantized to `dtype`: [B, capacity, hd] (entry c at index c;
        unwritten ones are never visible: attention and the indexer only look below the causal count)."""
        return state["entries"].read(dtype, block_table)

    def extend(self, state: dict[str, jax.Array], x: jax.Array, start: jax.Array, valid: jax.Array,
               rope: Rope, block_table: jax.Array | None = None, *,
               write_impl: str = "jnp") -> dict[str, jax.Array]:  # fmt: skip
        """Feeds the chunk x [B, n, hidden] of tokens at positions start[b] + [0, valid[b]) into the state;
        its closed windows' entries are stored with `KVStore.write(impl=write_impl)`.

        Windows are aligned to absolute positions, so the open window holds tokens
        [start - start % rate, start). Every window the chunk closes becomes an entry at index
        position // rate; the unfinished tail becomes the new open window.
        """
        b, n, _ = x.shape
        r = self.rate
        kv = linear(x, self.kv_proj["weight"][...])  # [B, n, width]
        gate = linear(x, self.gate_proj["weight"][...])
        span = -(-(r + n) // r) * r  # the open window plus the chunk, in whole windows
        held = start % r  # tokens already in the open window
        j = jnp.arange(span)
        from_open = j[None, :] < held[:, None]  # [B, span]
        chunk_idx = jnp.clip(j[None, :] - held[:, None], 0, n - 1)

        def lay_out(open_part, chunk_part):  # [B, r, w], [B, n, w] → [B, span, w] in absolute-position order
            open_part = jnp.pad(open_part, [(0, 0), (0, span - r), (0, 0)])
            return jnp.where(from_open[..., None], open_part, jnp.take_along_axis(chunk_part, chunk_idx[..., None], 1))

        ext_kv, ext_gate = lay_out(state["open_kv"], kv), lay_out(state["open_gate"], gate)
        prev = (state["prev_kv"], state["prev_gate"]) if self.overlap else (None, None)
        pooled = pool_windows(ext_kv, ext_gate, self.position_bias[...], r, overlap=self.overlap,
                              head_dim=self.head_dim, prev_kv=prev[0], prev_gate=prev[1])  # fmt: skip
        entries = self.kv_norm(pooled.astype(x.dtype))  # [B, span / r, hd]
        first = (start - held) // r  # entry index of the open window
        n_windows = span // r
        cos, sin = rope.cos_sin((first[:, None] + jnp.arange(n_windows)[None]) * r)
        entries = apply_rope(entries, cos.astype(x.dtype), sin.astype(x.dtype))

        closed = (held + valid) // r  # windows completed by this chunk
        w = jnp.arange(n_windows)
        new = dict(state)
        target = jnp.where(w[None] < closed[:, None], first[:, None] + w[None], -1)  # -1: not closed, dropped
        new["entries"] = state["entries"].write(entries, target, block_table, impl=write_impl)
        windows_kv = ext_kv.reshape(b, n_windows, r, -1)
        windows_gate = ext_gate.reshape(b, n_windows, r, -1)
        pick = lambda a, i: jnp.take_along_axis(a, i[:, None, None, None], 1)[:, 0]  # noqa: E731
        new["open_kv"], new["open_gate"] = pick(windows_kv, closed), pick(windows_gate, closed)
        if self.overlap:
            last = jnp.maximum(closed - 1, 0)
            has_closed = (closed > 0)[:, None, None]
            bias = self.position_bias[...][:, : self.head_dim]
            ca_gate = pick(windows_gate, last)[..., : self.head_dim].astype(F32) + bias
            new["prev_kv"] = jnp.where(has_closed, pick(windows_kv, last)[..., : self.head_dim], state["prev_kv"])
            new["prev_gate"] = jnp.where(has_closed, ca_gate, state["prev_gate"])
        return new


class Indexer(Compressor):
    """Lightning indexer: scores Σ_h w_h · ReLU(q_h · k_s) over its own compressed keys, keeps the top k.

    Its keys come from its own overlapping compressor at `index_head_dim` (hence the base class).
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs, dtype):
        rate = config.compress_rate(CSA)
        super().__init__(config, rate=rate, head_dim=config.index_head_dim, overlap=True, rngs=rngs, dtype=dtype)
        self.q_b_proj = nnx.Dict(weight=param(
            rngs, (config.index_n_heads * config.index_head_dim, config.q_lora_rank), ("index_heads", "q_lora"),
            dtype=dtype))  # fmt: skip
        self.scorer = nnx.Dict(weights_proj=nnx.Dict(weight=param(
            rngs, (config.index_n_heads, config.hidden_size), ("index_n_heads", "embed"), dtype=dtype)))
        self.n_heads, self.topk = config.index_n_heads, config.index_topk
        self.impl = "jnp"  # the top-k path (INDEXER_IMPLS); set by Attention's indexer_impl

    def keys(self, x: jax.Array, rope: Rope) -> jax.Array:
        return self(x, rope)

    def _queries(self, x: jax.Array, q_residual: jax.Array, positions: jax.Array, rope: Rope):
        """→ (q [B, S, Hi, Di] with RoPE, head weights [B, S, Hi] float32)."""
        b, s, _ = x.shape
        q = linear(q_residual, self.q_b_proj["weight"][...]).reshape(b, s, self.n_heads, self.head_dim)
        cos, sin = rope.cos_sin(positions)
        q = apply_rope(q, cos.astype(q.dtype), sin.astype(q.dtype))
        return q, linear(x, self.scorer["weights_proj"]["weight"][...]).astype(F32) * self.n_heads**-0.5

    def select(self, x: jax.Array, q_residual: jax.Array, positions: jax.Array, keys: jax.Array, rope: Rope,
               query_chunk: int = 512) -> jax.Array:  # fmt: skip
        """→ topk_indices [B, S, min(index_topk, C)] int32, -1 where fewer entries are visible."""
        n_keys = keys.shape[1]
        q, weights = self._queries(x, q_residual, positions, rope)
        k = min(self.topk, n_keys)
        impl = resolve_indexer_impl(self.impl, q.dtype)
        kw = dict(rate=self.rate, k=k, softmax_scale=self.head_dim**-0.5)
        if impl in ("pallas", "pallas-fp8"):
            from dsv4.pallas.indexer import index_topk_two_pass
            from dsv4.sharding.context_parallel import per_sequence_shard

            interpret = jax.default_backend() != "gpu"

            def local(q_, weights_, positions_, keys_):  # this shard's queries against all keys
                return index_topk_two_pass(q_, keys_, weights_, positions_, **kw, interpret=interpret)

            if impl == "pallas-fp8":
                local = functools.partial(index_topk_fp8, **kw, interpret=interpret)
            return per_sequence_shard(local, (q, weights, positions), (keys,), fill=(0, 0, -1))
        if impl == "pallas-stream":
            from dsv4.pallas.indexer import index_topk

            return index_topk(q, keys, weights, positions, **kw, interpret=jax.default_backend() != "gpu")
        return index_topk_jnp(q, keys, weights, positions, **kw, query_chunk=query_chunk)

    def paged_select_applies(self, store: KVStore, block_table: jax.Array | None, num_queries: int, dtype) -> bool:
        """Whether `select_paged` serves this step (static): `PAGED_INDEX_DECODE`, a one-token step, the "pallas"
        top-k path, a store with room for entries, and keys stored in a form the paged kernel takes (unquantized in
        the compute dtype, or FP8 split rows with scales per tensor, per channel or per row and 64-channel tile),
        with the compiled kernel's shapes on a GPU."""
        from dsv4.pallas.attention import SCALE_TILE

        if not (PAGED_INDEX_DECODE and num_queries == 1 and resolve_indexer_impl(self.impl, dtype) == "pallas"):
            return False
        if store.capacity(block_table if store.paged else None) == 0:
            return False
        if store.fmt.quantized:
            if store.fmt.scaling == "tile" and store.fmt.tile != SCALE_TILE:
                return False
            rope = store.fmt.rope_dim
            if rope & (rope - 1) or (jax.default_backend() == "gpu" and store.fmt.nope_dim(self.head_dim) < 16):
                return False  # RoPE channels load as one Triton tile (a power of two), interpreted or not
        elif store.stored["values"].dtype != dtype:
            return False
        heads = self.n_heads
        return jax.default_backend() != "gpu" or (heads >= 16 and not heads & (heads - 1))

    def select_paged(self, x: jax.Array, q_residual: jax.Array, positions: jax.Array, store: KVStore,
                     block_table: jax.Array | None, rope: Rope) -> jax.Array:  # fmt: skip
        """`select` with the keys scored where the cache stores them (`index_topk_paged`: the stored rows gathered
        through the block table, a dense store's slot b as page b), instead of a dense dequantized copy first.
        → topk_indices [B, S, min(index_topk, capacity)] int32."""
        from dsv4.pallas.indexer_paged import index_topk_paged

        q, weights = self._queries(x, q_residual, positions, rope)
        b = q.shape[0]
        table = block_table if store.paged else jnp.arange(b, dtype=jnp.int32)[:, None]
        rows = Attention._kernel_rows(store)
        return index_topk_paged(q, weights, positions, rows["pages"], table, rate=self.rate,
                                k=min(self.topk, store.capacity(block_table)), softmax_scale=self.head_dim**-0.5,
                                key_scales=rows["scales"], key_rope_pages=rows["rope"],
                                interpret=jax.default_backend() != "gpu")  # fmt: skip


def quantize_rows_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., Di] → (e4m3 [..., Di], float32 scale [...]): one scale per row, amax / 448 (all-zero rows: 1)."""
    amax = jnp.max(jnp.abs(x.astype(F32)), axis=-1)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (x.astype(F32) / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def index_topk_fp8(q, weights, positions, keys, *, rate: int, k: int, softmax_scale: float, interpret: bool):
    """The lightning indexer in FP8 (as DeepSeek-V3.2's inference code runs it; the transformers V4 spec uses bf16):
    q quantized per (token, head), keys per entry (e4m3, amax scales), scores by the Mosaic FP8 kernel on a Hopper
    GPU (`index_scores_mgpu`) or the Triton kernel elsewhere, then the exact grouped top-k. Arguments as
    `index_topk_jnp` (q, weights, positions first: the per-shard function of `per_sequence_shard`).
    On the Mosaic path each query chunk is scored over one of 4 width bands (`index_topk_two_pass(width_bands=4)`:
    one H200, 512K tokens, 1140 → 1087 ms; 128K 102.5 → 95.8 ms; docs/KERNEL_NOTES.md IX13b, IX16); on Hopper the
    top-k's refinement levels run as one kernel each (`index_topk_two_pass`'s selection "auto"). → [B, S, k] int32."""
    from dsv4.pallas._device import is_hopper
    from dsv4.pallas.indexer import index_topk_two_pass

    q8, q_scale = quantize_rows_e4m3(q)
    k8, k_scale = quantize_rows_e4m3(keys)
    mgpu = not interpret and is_hopper() and q.shape[2] == 64
    return index_topk_two_pass(q8, k8, weights, positions, rate=rate, k=k, softmax_scale=softmax_scale,
                               q_scale=q_scale, k_scale=k_scale, interpret=interpret,
                               scores_impl="mgpu" if mgpu else "triton", width_bands=4 if mgpu else 1)  # fmt: skip


def index_topk_jnp(q, keys, weights, positions, *, rate: int, k: int, softmax_scale: float, query_chunk: int = 512):
    """Pure-jnp lightning indexer: q [B, S, Hi, Di], keys [B, C, Di], weights [B, S, Hi] → [B, S, k] int32.

    Entry c is visible to the query at position p iff c < (p + 1) // rate. Picks beyond the visible
    count come back as -1. Ties go to the lower index (lax.top_k is stable).
    """
    b, s = positions.shape
    entries = jnp.arange(keys.shape[1])

    def one_chunk(args):
        qc, wc, pc = args
        dots = jnp.einsum("bqhd,bcd->bqhc", qc, keys, preferred_element_type=F32)
        scores = jnp.einsum("bqhc,bqh->bqc", jax.nn.relu(dots) * softmax_scale, wc)
        visible = entries[None, None, :] < ((pc + 1) // rate)[..., None]
        values, idx = jax.lax.top_k(jnp.where(visible, scores, NEG_INF), k)
        return jnp.where(jnp.isneginf(values) | (idx >= ((pc + 1) // rate)[..., None]), -1, idx).astype(jnp.int32)

    n_chunks = -(-s // query_chunk)
    if n_chunks == 1:
        return one_chunk((q, weights, positions))
    chunk = -(-s // n_chunks)
    pad = n_chunks * chunk - s

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(one_chunk, (split(q), split(weights), split(positions)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * chunk, k)[:, :s]


INDEXER_IMPLS = ("auto", "jnp", "pallas", "pallas-fp8", "pallas-stream")


def resolve_indexer_impl(impl: str, dtype) -> str:
    """The indexer's top-k path. "jnp": XLA (einsum → ReLU → weighted sum → `lax.top_k`, [chunk, Hi, C] dots
    materialized); "pallas": two passes per query chunk (the Pallas scores kernel, then the exact grouped top-k of
    `dsv4.topk`); "pallas-fp8": the same with q and keys quantized to e4m3 (`index_topk_fp8`; the Mosaic FP8 scores
    kernel on Hopper), opt-in since it changes the scores by FP8 rounding; "pallas-stream": the one-kernel
    streaming bitonic top-k; "auto": "pallas" for 16-bit / FP8 queries on a GPU, "jnp" otherwise (a float32 model
    keeps XLA's full-precision dots).
    On one H200 at 32K / 128K / 512K (docs/BENCHMARKS.md): jnp 90 / 1443 ms / ~22 s, pallas 15 / 143 / 1737 ms,
    pallas-stream 564 ms / - / -."""
    if impl not in INDEXER_IMPLS:
        raise ValueError(f"indexer_impl={impl!r}; available: {list(INDEXER_IMPLS)}")
    if impl != "auto":
        return impl
    fast = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))
    return "pallas" if fast and jax.default_backend() == "gpu" else "jnp"


# ---------------------------------------------------------------------------------------------
# The attention block.
# ---------------------------------------------------------------------------------------------
class Attention(nnx.Module):
    """q LoRA → per-head unweighted RMSNorm → RoPE; one shared K=V head; sinks; grouped output projection."""

    def __init__(self, config: Config, layer_type: str, *, rngs: nnx.Rngs, dtype, attention_impl: str = "auto",
                 indexer_impl: str = "auto"):  # fmt: skip
        d, h, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        g, r = config.o_groups, config.o_lora_rank
        self.q_a_proj = nnx.Dict(weight=param(rngs, (config.q_lora_rank, d), ("q_lora", "embed"), dtype=dtype))
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, axis_name="q_lora", rngs=rngs)
        self.q_b_proj = nnx.Dict(weight=param(rngs, (h * hd, config.q_lora_rank), ("q_heads", "q_lora"), dtype=dtype))
        self.kv_proj = nnx.Dict(weight=param(rngs, (hd, d), ("head_dim", "embed"), dtype=dtype))
        self.kv_norm = RMSNorm(hd, config.rms_norm_eps, axis_name="head_dim", rngs=rngs)
        self.o_a_proj = nnx.Dict(weight=param(rngs, (g * r, h * hd // g), ("o_groups_rank", "o_group_in"), dtype=dtype))
        self.o_b_proj = nnx.Dict(weight=param(rngs, (d, g * r), ("embed", "o_groups_rank"), dtype=dtype))
        self.sinks = param(rngs, (h,), ("heads",), dtype=F32, init="zeros")
        if layer_type == HCA:
            self.compressor = Compressor(config, rate=config.compress_rate(HCA), head_dim=hd, overlap=False,
                                         rngs=rngs, dtype=dtype)  # fmt: skip
        elif layer_type == CSA:
            self.compressor = Compressor(config, rate=config.compress_rate(CSA), head_dim=hd, overlap=True,
                                         rngs=rngs, dtype=dtype)  # fmt: skip
            self.compressor.indexer = Indexer(config, rngs=rngs, dtype=dtype)
            resolve_indexer_impl(indexer_impl, dtype)  # validates the name
            self.compressor.indexer.impl = indexer_impl
        self.layer_type = layer_type
        rope = config.rope_main if layer_type == SLIDING else config.rope_compress
        self.rope = Rope.build(rope, config.qk_rope_head_dim)
        self.n_heads, self.head_dim, self.o_groups = h, hd, g
        self.sliding_window, self.eps = config.sliding_window, config.rms_norm_eps
        get_attention_impl(attention_impl)  # an unknown name fails here, not mid-trace
        self.attention_impl = attention_impl

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Full-sequence (stateless) attention. x: [B, S, hidden]; positions: [B, S] → [B, S, hidden]."""
        b, s, _ = x.shape
        cos, sin = self.rope.cos_sin(positions)
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        q_residual = self.q_a_norm(linear(x, self.q_a_proj["weight"][...]))
        q = linear(q_residual, self.q_b_proj["weight"][...]).reshape(b, s, self.n_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.eps), cos, sin)  # [B, S, H, D]
        kv = apply_rope(self.kv_norm(linear(x, self.kv_proj["weight"][...])), cos, sin)  # [B, S, D]

        compressed = None
        if self.layer_type != SLIDING:
            entries = self.compressor(x, self.rope)  # [B, S // rate, D]
            topk = None
            if self.layer_type == CSA and entries.shape[1] > 0:
                indexer = self.compressor.indexer
                topk = indexer.select(x, q_residual, positions, indexer.keys(x, self.rope), self.rope)
            if entries.shape[1] > 0:
                compressed = CompressedKeys(entries, self.compressor.rate, topk)

        out = get_attention_impl(self.attention_impl)(
            q, kv, positions, positions, self.sinks[...], sliding_window=self.sliding_window,
            scale=self.head_dim**-0.5, compressed=compressed, kv_aligned=True,
        )  # fmt: skip
        return self.project_out(out, cos, sin)

    # ---- incremental (cached) path ----------------------------------------------------------
    def init_state(self, batch: int, max_len: int, dtype, kv_format: KVFormat | None = None,
                   index_format: KVFormat | None = None, pages: tuple[int, int] | None = None) -> dict:  # fmt: skip
        """This layer's cache for `batch` request slots of up to `max_len` tokens.

        window / window_pos: a per-slot ring of the last `sliding_window` tokens' K=V rows (row = position
        % W; position -1 = empty), stored in `kv_format` (default: unquantized `dtype`). CSA / HCA add their
        compressor's state, CSA also the indexer's (its keys are its entries, in `index_format`, default
        `kv_format`). `pages=(num_pages, page_tokens)` pages the entries (see `Compressor.init_state`). FP8
        scales come from the RMSNorm bounds of the rows' `kv_norm`, so they are fixed and never saturate.
        """
        kv_format = resolve_format(kv_format, dtype, 0)
        index_format = kv_format if index_format is None else index_format
        w = self.sliding_window
        bound = rms_norm_bound(self.kv_norm.weight[...]) if kv_format.quantized else None
        state = {"window": KVStore.dense(batch, w, self.head_dim, kv_format, bound=bound),
                 "window_pos": jnp.full((batch, w), -1, jnp.int32)}  # fmt: skip
        if self.layer_type != SLIDING:
            state["compressor"] = self.compressor.init_state(batch, max_len // self.compressor.rate, dtype,
                                                             kv_format, pages)  # fmt: skip
        if self.layer_type == CSA:
            indexer = self.compressor.indexer
            state["indexer"] = indexer.init_state(batch, max_len // indexer.rate, dtype, index_format, pages)
        return state

    def forward_chunk(self, x: jax.Array, start: jax.Array, valid: jax.Array, state: dict,
                      block_table: jax.Array | None = None) -> tuple[jax.Array, dict]:  # fmt: skip
        """Attention for a chunk x [B, n, hidden] of tokens at positions start[b] + [0, n), of which the
        first valid[b] are real; reads and extends `state` (paged entries through the request's token
        `block_table` [B, pages]). → ([B, n, hidden], new state).

        The chunk's own K=V rows are used as the cache would give them back (`KVStore.round_trip`), so an
        FP8 cache gives the same result whatever the chunking, as a bf16 one does. With attention_impl="pallas" a
        one-token chunk (a decode step) runs the paged decode kernel on the cache itself, bf16 or FP8
        (`_decode_paged`), instead of reading every entry out densely."""
        b, n, _ = x.shape
        positions = start[:, None] + jnp.arange(n)[None]  # [B, n] global positions (RoPE angles in float32)
        real = jnp.arange(n)[None] < valid[:, None]
        cos, sin = self.rope.cos_sin(positions)
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        q_residual = self.q_a_norm(linear(x, self.q_a_proj["weight"][...]))
        q = linear(q_residual, self.q_b_proj["weight"][...]).reshape(b, n, self.n_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(linear(x, self.kv_proj["weight"][...])), cos, sin)  # [B, n, D]

        new = dict(state)
        write_impl = kv_write_impl(self.attention_impl)
        decode_kernel = n == 1 and self._decode_kernel_applies(state, x.dtype)
        compressed = topk = None
        if self.layer_type != SLIDING:
            new["compressor"] = self.compressor.extend(state["compressor"], x, start, valid, self.rope, block_table,
                                                       write_impl=write_impl)  # fmt: skip
            if self.layer_type == CSA:
                indexer = self.compressor.indexer
                new["indexer"] = indexer.extend(state["indexer"], x, start, valid, self.rope, block_table,
                                                write_impl=write_impl)  # fmt: skip
                store = new["indexer"]["entries"]
                if indexer.paged_select_applies(store, block_table, n, x.dtype):
                    topk = indexer.select_paged(x, q_residual, positions, store, block_table, self.rope)
                else:
                    keys = Compressor.read(new["indexer"], x.dtype, block_table)
                    topk = indexer.select(x, q_residual, positions, keys, self.rope)
            if not decode_kernel:  # the kernel reads the entries through the block table instead
                entries = Compressor.read(new["compressor"], x.dtype, block_table)
                if entries.shape[1] > 0:
                    compressed = CompressedKeys(entries, self.compressor.rate, topk)

        # The ring keeps positions [end - W, end) at row position % W: of this chunk, its last W real tokens.
        w = self.sliding_window
        end = start + valid
        window = state["window"]
        kv_stored, scale = window.round_trip(kv, real)
        window = dataclasses.replace(window, scale=scale)  # NOTE: calibrated scales: the write must use these
        kept = real & (positions >= end[:, None] - w)
        new["window"] = window.write(kv, jnp.where(kept, positions % w, -1), impl=write_impl)
        if decode_kernel:
            out = self._decode_paged(q, end, valid, new, block_table, topk)
        else:
            # The ring read out in position order: row i holds position start - W + i (ring row (start + i) % W),
            # -1 where there is none yet, then the chunk's own rows. The Pallas cores take that layout as is
            # (`kv_prefix`); the others mask by position and do not mind the order.
            order = (start[:, None] + jnp.arange(w)[None]) % w  # [B, W]
            ring = jnp.take_along_axis(window.read(x.dtype), order[..., None], axis=1)
            keys = jnp.concatenate([ring, kv_stored], axis=1)  # [B, W + n, D]
            key_pos = jnp.concatenate([jnp.take_along_axis(state["window_pos"], order, axis=1),
                                       jnp.where(real, positions, -1)], axis=1)  # fmt: skip
            prefix = {"kv_prefix": w} if self.attention_impl in ("auto", "pallas") else {}
            out = get_attention_impl(self.attention_impl)(
                q, keys, positions, key_pos, self.sinks[...], sliding_window=self.sliding_window,
                scale=self.head_dim**-0.5, compressed=compressed, **prefix,
            )  # fmt: skip

        slot = jnp.arange(w)[None]
        wanted = end[:, None] - w + (slot - (end[:, None] - w)) % w  # [B, W]: the position ring row s holds
        new["window_pos"] = jnp.where(wanted >= start[:, None], wanted, state["window_pos"])
        return self.project_out(out, cos, sin), new

    def _decode_kernel_applies(self, state: dict, dtype) -> bool:
        """Whether a one-token step runs `dsv4.pallas.decode.paged_decode_attention` (static): every store it
        reads in a form the kernel takes (unquantized in the compute dtype, or FP8: its nope channels e4m3 beside
        bf16 RoPE channels, scales per tensor, per channel or per row and 64-channel tile), and either
        attention_impl="pallas", or "auto" with `AUTO_DECODE_KERNEL` set, on a GPU, for FP8 stores in a 16-bit
        model."""
        from dsv4.pallas.attention import SCALE_TILE

        stores = [state["window"]] + ([state["compressor"]["entries"]] if self.layer_type != SLIDING else [])
        if self.attention_impl == "auto":
            if not (AUTO_DECODE_KERNEL and jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
                    and all(st.fmt.quantized for st in stores) and self._decode_kernel_compiles()):  # fmt: skip
                return False
        elif self.attention_impl != "pallas":
            return False

        def takes(st) -> bool:
            if not st.fmt.quantized:
                return st.stored["values"].dtype == dtype
            return st.fmt.scaling != "tile" or st.fmt.tile == SCALE_TILE

        return all(takes(st) for st in stores)

    def _decode_kernel_compiles(self) -> bool:
        """Whether this layer's heads fit the compiled decode kernel's default tiles (`paged_decode_attention`
        refuses the rest with a ValueError)."""
        from dsv4.pallas.decode import unsupported_shape

        return unsupported_shape(self.n_heads, self.head_dim) is None

    @staticmethod
    def _kernel_rows(store) -> dict[str, jax.Array | None]:
        """A store's leaves as the decode kernel takes them: pages [P, R, ·] (page axis first: a dense store's
        request slots are its pages), FP8 scales in float32 ([n] per channel, or [P, R, tiles]), RoPE pages."""
        if not store.fmt.quantized:
            return dict(pages=store.stored["values"], scales=None, rope=None)
        nope = store.stored["nope"]
        if store.fmt.scaling == "tile":  # NOTE: e8m0 scales are widened here, a pass over 1 byte per 64 values
            scales = store.stored["scale"].astype(F32)
        else:  # per tensor or per channel: one state for the whole array
            scales = jnp.broadcast_to(store.scale["scale"].astype(F32), nope.shape[-1:])
        return dict(pages=nope, scales=scales, rope=store.stored.get("rope"))

    def _decode_paged(self, q: jax.Array, end: jax.Array, valid: jax.Array, new: dict,
                      block_table: jax.Array | None, topk: jax.Array | None) -> jax.Array:  # fmt: skip
        """The one-token step by the paged decode kernel, straight from the cache: the ring (the new token already
        written) as one page per slot, the compressed entries through the request's block table (each token page
        holds page_tokens / rate entries), HCA every complete entry, CSA the indexer's picks; FP8 stores as they
        are (split rows: e4m3 nope channels, bf16 RoPE channels). → [B, 1, H, D]."""
        from dsv4.pallas.decode import paged_decode_attention

        b = q.shape[0]
        per_slot = jnp.arange(b, dtype=jnp.int32)[:, None]  # slot b's dense rows are "page" b
        seq_lens = jnp.where(valid > 0, end, 0).astype(jnp.int32)  # 0: an idle slot (output 0, dropped)
        ring = self._kernel_rows(new["window"])
        kw = dict(kv_scales=ring["scales"], kv_rope_pages=ring["rope"])
        if self.layer_type != SLIDING:
            entries = new["compressor"]["entries"]
            if entries.capacity(block_table) > 0:
                rows = self._kernel_rows(entries)
                kw.update(compressed_pages=rows["pages"], compressed_scales=rows["scales"],
                          compressed_rope_pages=rows["rope"],
                          compressed_block_tables=block_table if entries.paged else per_slot,
                          compressed_lens=seq_lens // self.compressor.rate,
                          topk_indices=None if topk is None else topk[:, 0])  # fmt: skip
        out = paged_decode_attention(q[:, 0], ring["pages"], per_slot, seq_lens, self.sinks[...],
                                     sliding_window=self.sliding_window, scale=self.head_dim**-0.5,
                                     interpret=jax.default_backend() != "gpu", **kw)  # fmt: skip
        return out[:, None]

    def project_out(self, out: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Undo RoPE on the output's rope channels (V = K carried it), then the grouped low-rank projection."""
        b, s = out.shape[:2]
        out = apply_rope(out, cos, -sin).reshape(b, s, self.o_groups, -1)  # [B, S, G, H·D/G]
        w_a = self.o_a_proj["weight"][...]
        w_a = w_a.reshape(self.o_groups, -1, w_a.shape[-1])  # [G, R, H·D/G]
        grouped = jnp.einsum("bsgi,gri->bsgr", out, w_a, preferred_element_type=F32).astype(out.dtype)
        return linear(grouped.reshape(b, s, -1), self.o_b_proj["weight"][...])
