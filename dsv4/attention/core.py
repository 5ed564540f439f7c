"""The attention core in jnp: softmax(scale · q·k) over a causal window of raw rows and the compressed entries a
layer may see, plus a per-head sink logit. The spec the Pallas and sequence-parallel cores are tested against."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv4.layers import F32

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
    q_scale: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp V4 attention core, processed in query chunks so memory is O(chunk · keys).

    q: [B, S, H, D]; kv: [B, T, D] (K = V, one head); q_pos: [B, S]; kv_pos: [B, T] (-1 = empty slot);
    sinks: [H]. A query at p sees kv row j iff p - sliding_window < kv_pos[j] <= p. → [B, S, H, D].
    `kv_aligned` promises kv row i is query i's own token (T == S, kv_pos == q_pos, a full-sequence
    forward): each query chunk then only reads the rows its window can reach, not all T.
    `q_scale` [B, S, H] float32: each (query, head)'s logits also times q_scale (q's inverse RMS, folded).
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
    if q_scale is not None:
        xs["q_scale"] = chunks(padded(q_scale))
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
        row_scale = scale if q_scale is None else scale * x["q_scale"][..., None]  # [B, Q, H, 1]
        logits = [jnp.where(m[:, :, None, :], lg * row_scale, NEG_INF) for lg, m in zip(logits, masks)]
        row_max = jnp.max(jnp.stack([lg.max(-1) for lg in logits]), axis=0)  # [B, Q, H]
        row_max = jnp.maximum(row_max, sinks.astype(F32))  # the sink joins the softmax
        probs = [jnp.exp(lg - row_max[..., None]) for lg in logits]
        denom = sum(p.sum(-1) for p in probs) + jnp.exp(sinks.astype(F32) - row_max)
        out = sum(jnp.einsum(eq, p.astype(v.dtype), v, preferred_element_type=F32) for p, (eq, v) in zip(probs, values))
        return (out / denom[..., None]).astype(q.dtype)

    out = jax.lax.map(one_chunk, xs) if n_chunks > 1 else one_chunk(jax.tree.map(lambda a: a[0], xs))[None]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * chunk, h, d)
    return out[:, :s]
