"""Compressors: pool every `rate` tokens into one entry with a softmax gate per channel, then RMSNorm and RoPE at
the window's start. HCA (128:1), CSA (4:1 over overlapping windows of 8) and the CSA indexer's keys use them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.attention.core import NEG_INF
from dsv4.cache.layout import KVFormat
from dsv4.cache.quant import rms_norm_bound
from dsv4.cache.state import CompressorCache
from dsv4.cache.store import KVStore, resolve_format
from dsv4.config import Config
from dsv4.layers import F32, RMSNorm, Rope, apply_rope, linear, param
from dsv4.sharding.sequence import zigzag_order, zigzag_permute, zigzag_shards


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
    """`pool_windows` of a sequence held in zigzag order over n shards (`dsv4.attention.sequence_parallel`,
    "Whole-model zigzag"): kv, gate [B, S, W] are 2n blocks of L rows (L a multiple of `rate`), slot j holding
    sequence block `zigzag_order(n)[j]`. → entries [B, S // rate, head_dim] in *sequence* order.

    Each block is pooled on its own; with overlap (CSA) a block's first entry takes its Ca half from the last window
    of the block before it in sequence order (a [B, rate, head_dim] slice per block), the first block's from none.
    """
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
                   pages: tuple[int, int] | None = None) -> CompressorCache:  # fmt: skip
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
        prev = {}
        if self.overlap:
            prev = dict(prev_kv=jnp.zeros((batch, self.rate, self.head_dim), dtype),
                        prev_gate=jnp.full((batch, self.rate, self.head_dim), NEG_INF, F32))  # fmt: skip
        return CompressorCache(entries, jnp.zeros((batch, self.rate, width), dtype),
                               jnp.zeros((batch, self.rate, width), dtype), **prev)  # fmt: skip

    @staticmethod
    def read(state: CompressorCache, dtype, block_table: jax.Array | None = None) -> jax.Array:
        """All entry slots of each request, dequantized to `dtype`: [B, capacity, hd] (entry c at index c;
        unwritten ones are never visible: attention and the indexer only look below the causal count)."""
        return state.entries.read(dtype, block_table)

    def extend(self, state: CompressorCache, x: jax.Array, start: jax.Array, valid: jax.Array,
               rope: Rope, block_table: jax.Array | None = None, *,
               write_impl: str = "jnp") -> CompressorCache:  # fmt: skip
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

        ext_kv, ext_gate = lay_out(state.open_kv, kv), lay_out(state.open_gate, gate)
        prev = (state.prev_kv, state.prev_gate) if self.overlap else (None, None)
        pooled = pool_windows(ext_kv, ext_gate, self.position_bias[...], r, overlap=self.overlap,
                              head_dim=self.head_dim, prev_kv=prev[0], prev_gate=prev[1])  # fmt: skip
        entries = self.kv_norm(pooled.astype(x.dtype))  # [B, span / r, hd]
        first = (start - held) // r  # entry index of the open window
        n_windows = span // r
        cos, sin = rope.cos_sin((first[:, None] + jnp.arange(n_windows)[None]) * r)
        entries = apply_rope(entries, cos.astype(x.dtype), sin.astype(x.dtype))

        closed = (held + valid) // r  # windows completed by this chunk
        w = jnp.arange(n_windows)
        target = jnp.where(w[None] < closed[:, None], first[:, None] + w[None], -1)  # -1: not closed, dropped
        new_entries = state.entries.write(entries, target, block_table, impl=write_impl)
        windows_kv = ext_kv.reshape(b, n_windows, r, -1)
        windows_gate = ext_gate.reshape(b, n_windows, r, -1)
        pick = lambda a, i: jnp.take_along_axis(a, i[:, None, None, None], 1)[:, 0]  # noqa: E731
        new = CompressorCache(new_entries, pick(windows_kv, closed), pick(windows_gate, closed))
        if self.overlap:
            last = jnp.maximum(closed - 1, 0)
            has_closed = (closed > 0)[:, None, None]
            bias = self.position_bias[...][:, : self.head_dim]
            ca_gate = pick(windows_gate, last)[..., : self.head_dim].astype(F32) + bias
            new = dataclasses.replace(
                new, prev_kv=jnp.where(has_closed, pick(windows_kv, last)[..., : self.head_dim], state.prev_kv),
                prev_gate=jnp.where(has_closed, ca_gate, state.prev_gate))  # fmt: skip
        return new
