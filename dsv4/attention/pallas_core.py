"""The attention core on the Pallas kernels: the Mosaic GPU kernel (`dsv4.pallas.attention_mgpu`) for window and HCA
layers on Hopper (and CSA layers under `Kernels.csa="pallas"`), the Triton-lowered one (`dsv4.pallas.attention`) for
CSA and elsewhere, interpreted off a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.attention.core import CompressedKeys
from dsv4.layers import F32
from dsv4.pallas._device import is_hopper, on_gpu
from dsv4.pallas.attention import v4_attention
from dsv4.pallas.attention_mgpu import positions_are_aligned, v4_attention_mgpu


def core_attention_pallas(q, kv, q_pos, kv_pos, sinks, *, sliding_window: int, scale: float,
                          compressed: CompressedKeys | None = None, kv_aligned: bool = False,
                          query_chunk: int | None = None, kv_prefix: int = 0,
                          q_scale: jax.Array | None = None, csa_mosaic: bool = False) -> jax.Array:  # fmt: skip
    """The blocked online-softmax Pallas kernel (`dsv4/pallas/attention.py`); interpreted off-GPU.

    kv_prefix: the layout of a cached chunk (`Attention.forward_chunk`): kv rows [0, kv_prefix) hold the
    kv_prefix positions just before q's first one, in order (-1 where there is none yet), and row kv_prefix + j
    holds query j's own token. On Hopper the Mosaic kernel then takes window and HCA chunks, one-token ones too,
    with each token's window rows given (`prefix_window_rows`), whenever the prefix holds what it should
    (`mosaic_takes_prefix`, a run-time choice); the Triton kernel, which places rows by position, otherwise.
    q_scale [B, S, H] float32 (q's inverse RMS, `Kernels.q_norm` "fold"): both kernels fold it into their logit
    scale.
    csa_mosaic: CSA layers on the Mosaic kernel too on Hopper (`Kernels.csa` "pallas"), else on the Triton kernel."""
    del query_chunk  # the kernels find each query block's window band themselves
    sinks = sinks.astype(F32)
    entries = {} if compressed is None else dict(compressed=compressed.entries, compress_rate=compressed.rate)
    if compressed is not None and compressed.topk_indices is not None:
        entries["topk_indices"] = compressed.topk_indices
    if mosaic_applies(q, kv, compressed, kv_aligned or kv_prefix > 0, csa=csa_mosaic):
        mosaic_entries = dict(entries)
        if "topk_indices" in entries:  # the Mosaic kernel's CSA mode takes the lists in place of the rate
            del mosaic_entries["compress_rate"]
        if kv_aligned:
            # Hopper fast path (the full-sequence prefill). It checks at run time that positions are contiguous and
            # takes the Triton kernel otherwise.
            return v4_attention_mgpu(q, kv[:, : q.shape[1]], q_pos, sinks, sliding_window=sliding_window,
                                     scale=scale, q_scale=q_scale, **mosaic_entries)  # fmt: skip
        # Rows are placed by index: each token's window rows, then the entries (padding rows only reach padding).
        # NOTE: one Mosaic form for every cached chunk: a second one (the window by row offset, for chunks whose
        # prefix is all real) ran no faster and added its compile time to every layer.
        def mosaic(q, kv, q_pos, kv_pos):
            del kv_pos
            rows = prefix_window_rows(q_pos, kv_prefix, sliding_window)
            return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=sliding_window, scale=scale,
                                     check_positions=False, window_rows=rows, q_scale=q_scale,
                                     **mosaic_entries)  # fmt: skip

        def triton(q, kv, q_pos, kv_pos):
            return v4_attention(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale,
                                q_scale=q_scale, **entries)  # fmt: skip

        return jax.lax.cond(mosaic_takes_prefix(q_pos, kv_pos, kv_prefix), mosaic, triton, q, kv, q_pos, kv_pos)
    return v4_attention(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale, q_scale=q_scale,
                        interpret=not on_gpu(), **entries)  # fmt: skip


def mosaic_takes_prefix(q_pos: jax.Array, kv_pos: jax.Array, kv_prefix: int) -> jax.Array:
    """Whether the Mosaic kernel can take a cached chunk (`core_attention_pallas`'s run-time choice), bool scalar:
    every batch row's kv rows [0, kv_prefix) hold the kv_prefix positions before its first query, in order, with -1
    in the rows before the prompt's start (a prompt's first chunk has no prefix yet), and q's positions are one run
    per row. Otherwise the Triton kernel takes it: it places rows by position."""
    before = q_pos[:, :1] - kv_prefix + jnp.arange(kv_prefix, dtype=q_pos.dtype)[None]  # [B, prefix]
    return jnp.all((kv_pos[:, :kv_prefix] == before) | (before < 0)) & positions_are_aligned(q_pos)


def prefix_window_rows(q_pos: jax.Array, kv_prefix: int, sliding_window: int) -> tuple[jax.Array, jax.Array]:
    """Token j's window in a cached chunk's kv rows, (lo, hi) int32 [B, S]: rows [lo, hi) hold positions
    max(0, p - W + 1) .. p (p = q_pos[b, j], row kv_prefix + j its own), so rows of positions before the prompt's
    start are never reached."""
    own = kv_prefix + jnp.arange(q_pos.shape[1], dtype=jnp.int32)[None]  # [1, S]
    hi = jnp.broadcast_to(own + 1, q_pos.shape)
    return hi - 1 - jnp.minimum(q_pos.astype(jnp.int32), sliding_window - 1), hi


def mosaic_applies(q, kv, compressed, layout_ok, *, csa: bool = False) -> bool:
    """Whether the Mosaic GPU kernel (dsv4/pallas/attention_mgpu.py) takes this call: on Hopper GPUs, for
    the prefill of window and HCA layers, and of CSA layers where `csa` asks for it (kv aligned with q, or a cached
    chunk's prefix layout: `layout_ok`), in bf16/f16 with 64-head groups and D in 128..512."""
    listed = compressed is not None and compressed.topk_indices is not None
    if not (layout_ok and (csa or not listed) and is_hopper()):
        return False
    d = q.shape[-1]
    same = kv.dtype == q.dtype and (compressed is None or compressed.entries.dtype == q.dtype)
    return q.dtype in (jnp.bfloat16, jnp.float16) and same and q.shape[2] % 64 == 0 and d % 128 == 0 and d <= 512
