"""The attention block of a V4 layer: q LoRA, one shared K=V head, per-head sinks, a causal sliding window, and for
HCA / CSA layers the compressed entries (CSA: those its lightning indexer picks). The full-sequence forward and the
cached chunk (`forward_chunk`: chunked prefill and decode steps over a `LayerCache`) share the projections; the core
runs behind `dispatch.attention_core`, and decode steps may take the paged decode kernel on the cache as stored."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.attention.compressor import Compressor
from dsv4.attention.core import CompressedKeys
from dsv4.attention.dispatch import PREFIX_LAYOUT, attention_core
from dsv4.attention.indexer import Indexer
from dsv4.attention.sequence_parallel import chunk_core_per_shard
from dsv4.cache.layout import KVFormat
from dsv4.cache.quant import rms_norm_bound
from dsv4.cache.state import LayerCache
from dsv4.cache.store import KVStore, resolve_format
from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.kernels import Kernels
from dsv4.layers import (
    F32,
    RMSNorm,
    Rope,
    apply_rope,
    apply_rope_in_place,
    matmul_in_dtype,
    normalize_and_rope,
    param,
    project,
    project_shared,
    rope_in_place_with_scale,
)
from dsv4.pallas._device import on_gpu
from dsv4.pallas.attention import SCALE_TILE
from dsv4.pallas.decode import paged_decode_attention, unsupported_shape

# the core a cached chunk runs on each sequence shard, for the sequence-parallel cores of the full forward
CHUNK_CORES = {"sp": "jnp", "sp-pallas": "pallas"}


class Attention(nnx.Module):
    """q LoRA → per-head unweighted RMSNorm → RoPE; one shared K=V head; sinks; grouped output projection."""

    def __init__(self, config: Config, layer_type: str, *, rngs: nnx.Rngs, dtype, kernels: Kernels = Kernels()):
        kernels = kernels if kernels.resolved else kernels.resolve(dtype)
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
            self.compressor.indexer = Indexer(config, rngs=rngs, dtype=dtype, kernels=kernels)
        self.layer_type = layer_type
        rope = config.rope_main if layer_type == SLIDING else config.rope_compress
        self.rope = Rope.build(rope, config.qk_rope_head_dim)
        self.n_heads, self.head_dim, self.o_groups = h, hd, g
        self.sliding_window, self.eps = config.sliding_window, config.rms_norm_eps
        self.kernels = kernels

    def project_qkv(self, x: jax.Array, positions: jax.Array, fold: bool = False):
        """The projections of x [B, S, hidden] at positions [B, S] (global; RoPE angles in float32).
        → (q [B, S, H, D] normalized and rotated, kv [B, S, D] normed and rotated, q_residual [B, S, q_lora_rank]
        (the indexer's input), cos and sin [B, S, rope_dim / 2] in x's dtype, q_scale). fold: q rotated only, and
        q_scale [B, S, H] float32 its inverse RMS, for the core to apply (`Kernels.q_norm` "fold"); else None."""
        b, s, _ = x.shape
        cos, sin = self.rope.cos_sin(positions)
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        dense = self.kernels.dense
        q_a, kv = project_shared(x, (self.q_a_proj["weight"], self.kv_proj["weight"]), dense)
        q_residual = self.q_a_norm(q_a)
        q = project(q_residual, self.q_b_proj["weight"], dense).reshape(b, s, self.n_heads, self.head_dim)
        q_scale = None
        if fold:
            q, q_scale = rope_in_place_with_scale(q, cos, sin, self.eps)
            q_scale = q_scale[..., 0]
        else:
            q = normalize_and_rope(q, cos, sin, self.eps)
        kv = apply_rope(self.kv_norm(kv), cos, sin)
        return q, kv, q_residual, cos, sin, q_scale

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Full-sequence (stateless) attention. x: [B, S, hidden]; positions: [B, S] → [B, S, hidden]."""
        q, kv, q_residual, cos, sin, q_scale = self.project_qkv(x, positions, fold=self.kernels.q_norm == "fold")

        compressed = None
        if self.layer_type != SLIDING:
            entries = self.compressor(x, self.rope)  # [B, S // rate, D]
            topk = None
            if self.layer_type == CSA and entries.shape[1] > 0:
                indexer = self.compressor.indexer
                topk = indexer.select(x, q_residual, positions, indexer.keys(x, self.rope), self.rope)
            if entries.shape[1] > 0:
                compressed = CompressedKeys(entries, self.compressor.rate, topk)

        out = attention_core(self.kernels.attention)(
            q, kv, positions, positions, self.sinks[...], sliding_window=self.sliding_window,
            scale=self.head_dim**-0.5, compressed=compressed, kv_aligned=True, q_scale=q_scale,
            **self._csa_route(self.kernels.attention),
        )  # fmt: skip
        return self.project_out(out, cos, sin)

    # ---- incremental (cached) path ----------------------------------------------------------
    def init_state(self, batch: int, max_len: int, dtype, kv_format: KVFormat | None = None,
                   index_format: KVFormat | None = None,
                   pages: tuple[int, int] | None = None) -> LayerCache:  # fmt: skip
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
        compressor = indexer = None
        if self.layer_type != SLIDING:
            compressor = self.compressor.init_state(batch, max_len // self.compressor.rate, dtype, kv_format, pages)
        if self.layer_type == CSA:
            index = self.compressor.indexer
            indexer = index.init_state(batch, max_len // index.rate, dtype, index_format, pages)
        return LayerCache(KVStore.dense(batch, w, self.head_dim, kv_format, bound=bound),
                          jnp.full((batch, w), -1, jnp.int32), compressor, indexer)  # fmt: skip

    def forward_chunk(self, x: jax.Array, start: jax.Array, valid: jax.Array, state: LayerCache,
                      block_table: jax.Array | None = None) -> tuple[jax.Array, LayerCache]:  # fmt: skip
        """Attention for a chunk x [B, n, hidden] of tokens at positions start[b] + [0, n), of which the
        first valid[b] are real; reads and extends `state` (paged entries through the request's token
        `block_table` [B, pages]). → ([B, n, hidden], new state).

        The chunk's own K=V rows are used as the cache would give them back (`KVStore.round_trip`), so an
        FP8 cache gives the same result whatever the chunking, as a bf16 one does. With `Kernels.decode="pallas"` a
        one-token chunk (a decode step) runs the paged decode kernel on the cache itself, bf16 or FP8
        (`_decode_paged`), instead of reading every entry out densely."""
        b, n, _ = x.shape
        positions = start[:, None] + jnp.arange(n)[None]  # [B, n] global positions
        real = jnp.arange(n)[None] < valid[:, None]
        decode_kernel = n == 1 and self._decode_kernel_applies(state, x.dtype)
        one_token_jnp = n == 1 and self.kernels.decode == "jnp"
        # one-token steps take q normalized (their cores are not the prefill kernel that folds the factor)
        fold = self.kernels.q_norm == "fold" and not (decode_kernel or one_token_jnp)
        q, kv, q_residual, cos, sin, q_scale = self.project_qkv(x, positions, fold=fold)

        new = state
        write_impl = self.kernels.kv_write
        compressed = topk = None
        if self.layer_type != SLIDING:
            new = dataclasses.replace(new, compressor=self.compressor.extend(
                state.compressor, x, start, valid, self.rope, block_table, write_impl=write_impl))  # fmt: skip
            if self.layer_type == CSA:
                indexer = self.compressor.indexer
                new = dataclasses.replace(new, indexer=indexer.extend(
                    state.indexer, x, start, valid, self.rope, block_table, write_impl=write_impl))  # fmt: skip
                store = new.indexer.entries
                if indexer.paged_select_applies(store, block_table, n, x.dtype):
                    topk = indexer.select_paged(x, q_residual, positions, store, block_table, self.rope)
                else:
                    keys = Compressor.read(new.indexer, x.dtype, block_table)
                    topk = indexer.select(x, q_residual, positions, keys, self.rope)
            if not decode_kernel:  # the kernel reads the entries through the block table instead
                entries = Compressor.read(new.compressor, x.dtype, block_table)
                if entries.shape[1] > 0:
                    compressed = CompressedKeys(entries, self.compressor.rate, topk)

        # The ring keeps positions [end - W, end) at row position % W: of this chunk, its last W real tokens.
        w = self.sliding_window
        end = start + valid
        window = state.window
        kv_stored, scale = window.round_trip(kv, real)
        window = dataclasses.replace(window, scale=scale)  # NOTE: calibrated scales: the write must use these
        kept = real & (positions >= end[:, None] - w)
        new = dataclasses.replace(new, window=window.write(kv, jnp.where(kept, positions % w, -1), impl=write_impl))
        if decode_kernel:
            out = self._decode_paged(q, end, valid, new, block_table, topk)
        else:
            # The ring read out in position order: row i holds position start - W + i (ring row (start + i) % W),
            # -1 where there is none yet, then the chunk's own rows. The Pallas cores take that layout as is
            # (`kv_prefix`); the others mask by position and do not mind the order.
            order = (start[:, None] + jnp.arange(w)[None]) % w  # [B, W]
            ring = jnp.take_along_axis(window.read(x.dtype), order[..., None], axis=1)
            keys = jnp.concatenate([ring, kv_stored], axis=1)  # [B, W + n, D]
            key_pos = jnp.concatenate([jnp.take_along_axis(state.window_pos, order, axis=1),
                                       jnp.where(real, positions, -1)], axis=1)  # fmt: skip
            # One-token steps not on the decode kernel take the jnp core unless decode steps are on the kernels. A
            # cached chunk is split over the sequence axis here, so the sequence-parallel cores run their local one.
            core = "jnp" if one_token_jnp else self.kernels.attention
            core = CHUNK_CORES.get(core, core)
            prefix = {"kv_prefix": w} if core in PREFIX_LAYOUT else {}
            out = chunk_core_per_shard(attention_core(core), q, keys, positions, key_pos, self.sinks[...],
                                       sliding_window=self.sliding_window, scale=self.head_dim**-0.5,
                                       compressed=compressed, q_scale=q_scale, **prefix,
                                       **self._csa_route(core))  # fmt: skip

        slot = jnp.arange(w)[None]
        wanted = end[:, None] - w + (slot - (end[:, None] - w)) % w  # [B, W]: the position ring row s holds
        new = dataclasses.replace(new, window_pos=jnp.where(wanted >= start[:, None], wanted, state.window_pos))
        return self.project_out(out, cos, sin), new

    def _csa_route(self, core: str) -> dict:
        """The Pallas core's CSA kernel choice (`Kernels.csa`), for the cores that take one."""
        mosaic = core == "pallas" and self.layer_type == CSA and self.kernels.csa == "pallas"
        return {"csa_mosaic": True} if mosaic else {}

    def _decode_kernel_applies(self, state: LayerCache, dtype) -> bool:
        """Whether a one-token step runs `dsv4.pallas.decode.paged_decode_attention` (static): decode steps on the
        kernels (`Kernels.decode`), this layer's heads in the compiled kernel's tiles on a GPU, and every store it
        reads in a form the kernel takes (unquantized in the compute dtype, or FP8: its nope channels e4m3 beside
        bf16 RoPE channels, scales per tensor, per channel or per row and 64-channel tile)."""
        if self.kernels.decode != "pallas" or (on_gpu() and unsupported_shape(self.n_heads, self.head_dim)):
            return False
        stores = state.stores

        def takes(st) -> bool:
            if not st.fmt.quantized:
                return st.stored["values"].dtype == dtype
            return st.fmt.scaling != "tile" or st.fmt.tile == SCALE_TILE

        return all(takes(st) for st in stores)

    def _decode_paged(self, q: jax.Array, end: jax.Array, valid: jax.Array, new: LayerCache,
                      block_table: jax.Array | None, topk: jax.Array | None) -> jax.Array:  # fmt: skip
        """The one-token step by the paged decode kernel, straight from the cache: the ring (the new token already
        written) as one page per slot, the compressed entries through the request's block table (each token page
        holds page_tokens / rate entries), HCA every complete entry, CSA the indexer's picks; FP8 stores as they
        are (split rows: e4m3 nope channels, bf16 RoPE channels). → [B, 1, H, D]."""
        b = q.shape[0]
        per_slot = jnp.arange(b, dtype=jnp.int32)[:, None]  # slot b's dense rows are "page" b
        seq_lens = jnp.where(valid > 0, end, 0).astype(jnp.int32)  # 0: an idle slot (output 0, dropped)
        ring = new.window.kernel_operands()
        kw = dict(kv_scales=ring["scales"], kv_rope_pages=ring["rope"])
        if self.layer_type != SLIDING:
            entries = new.compressor.entries
            if entries.capacity(block_table) > 0:
                rows = entries.kernel_operands()
                kw.update(compressed_pages=rows["pages"], compressed_scales=rows["scales"],
                          compressed_rope_pages=rows["rope"],
                          compressed_block_tables=block_table if entries.paged else per_slot,
                          compressed_lens=seq_lens // self.compressor.rate,
                          topk_indices=None if topk is None else topk[:, 0])  # fmt: skip
        out = paged_decode_attention(q[:, 0], ring["pages"], per_slot, seq_lens, self.sinks[...],
                                     sliding_window=self.sliding_window, scale=self.head_dim**-0.5,
                                     interpret=not on_gpu(), **kw)  # fmt: skip
        return out[:, None]

    def project_out(self, out: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Undo RoPE on the output's rope channels (V = K carried it), then the grouped low-rank projection."""
        b, s = out.shape[:2]
        out = apply_rope_in_place(out, cos, -sin).reshape(b, s, self.o_groups, -1)  # [B, S, G, H·D/G]
        w_a = self.o_a_proj["weight"][...]
        w_a = w_a.reshape(self.o_groups, -1, w_a.shape[-1])  # [G, R, H·D/G]
        grouped = matmul_in_dtype("bsgi,gri->bsgr", out, w_a)
        return project(grouped.reshape(b, s, -1), self.o_b_proj["weight"], self.kernels.dense)
