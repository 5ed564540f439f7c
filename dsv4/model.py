"""The DeepSeek-V4 causal LM in Flax NNX.

Module and attribute names mirror transformers' `DeepseekV4ForCausalLM` state dict
(`layers.3.self_attn.compressor.indexer.q_b_proj.weight`, ...), so a checkpoint tensor's name *is*
its path in this module tree (`dsv4/weights.py` relies on that).

The residual stream is `hc_mult` copies wide ([B, S, hc, D]); hyper-connections collapse it into each
block's input and expand the block's output back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.attention import Attention
from dsv4.cache.layout import KVFormat
from dsv4.cache.state import ModelCache
from dsv4.cache.store import resolve_format
from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.kernels import Kernels
from dsv4.layers import F32, HyperConnection, HyperHead, RMSNorm, hc_merge, param
from dsv4.moe import MoE
from dsv4.sharding.rules import active, constrain, use_mesh
from dsv4.sharding.sequence import sequence_shards, zigzag_model_rows, zigzag_permute, zigzag_shards

STREAM_AXES = ("batch", "seq", None, "embed")  # the residual copies [B, S, hc, D]
MEAN_SQUARE_AXES = ("batch", "seq", None)  # their mean square per token [B, S, 1]


LAYER_SCOPES = {SLIDING: "dsv4_sliding", CSA: "dsv4_csa", HCA: "dsv4_hca"}
"""Each layer runs in a named scope of its type ("attn" and "ffn" within), so the op_name of every HLO instruction, and
so every kernel of a profile (scripts/profile_chunk.py, trace_overlap), says which layer type and block made it."""


class DecoderLayer(nnx.Module):
    def __init__(self, config: Config, layer_idx: int, *, rngs: nnx.Rngs, dtype, kernels: Kernels):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attn_hc = HyperConnection(config, rngs=rngs, sinkhorn=kernels.sinkhorn)
        self.input_layernorm = RMSNorm(d, eps, axis_name="embed", rngs=rngs)
        self.self_attn = Attention(config, config.layer_types[layer_idx], rngs=rngs, dtype=dtype, kernels=kernels)
        self.ffn_hc = HyperConnection(config, rngs=rngs, sinkhorn=kernels.sinkhorn)
        self.post_attention_layernorm = RMSNorm(d, eps, axis_name="embed", rngs=rngs)
        self.mlp = MoE(config, config.mlp_layer_types[layer_idx], rngs=rngs, dtype=dtype, moe_impl=kernels.moe,
                       dense_impl=kernels.dense)

    def __call__(self, streams: jax.Array, positions: jax.Array, token_ids: jax.Array) -> jax.Array:
        """streams: [B, S, hc, D] → [B, S, hc, D]."""
        return self.run(streams, None, positions, token_ids)[0]

    def run(self, streams, mean_square, positions, token_ids):
        """As `__call__`, with the copies' mean square per token [B, S, 1] float32 (None: computed) in and out: each
        merge takes the next mixes' norm in its own pass over the copies (`hc_merge(with_mean_square=True)`)."""
        with jax.named_scope(LAYER_SCOPES[self.self_attn.layer_type]):
            with jax.named_scope("attn"):
                post, comb, collapsed = self.attn_hc(streams, mean_square)
                attn = self.self_attn(self.input_layernorm(collapsed), positions)
                streams, mean_square = hc_merge(attn, streams, post, comb, with_mean_square=True)
            with jax.named_scope("ffn"):
                post, comb, collapsed = self.ffn_hc(streams, mean_square)
                out = self.mlp(self.post_attention_layernorm(collapsed), token_ids)
                return hc_merge(out, streams, post, comb, with_mean_square=True)

    def forward_chunk(self, streams, start, valid, token_ids, state, block_table=None):
        streams, _, state = self.run_chunk(streams, None, start, valid, token_ids, state, block_table)
        return streams, state

    def run_chunk(self, streams, mean_square, start, valid, token_ids, state, block_table=None):
        """`forward_chunk` with the copies' mean square in and out, as `run`. → (streams, mean square, state)."""
        with jax.named_scope(LAYER_SCOPES[self.self_attn.layer_type]):
            with jax.named_scope("attn"):
                post, comb, collapsed = self.attn_hc(streams, mean_square)
                attn, state = self.self_attn.forward_chunk(self.input_layernorm(collapsed), start, valid, state,
                                                           block_table)  # fmt: skip
                streams, mean_square = hc_merge(attn, streams, post, comb, with_mean_square=True)
            with jax.named_scope("ffn"):
                post, comb, collapsed = self.ffn_hc(streams, mean_square)
                out = self.mlp(self.post_attention_layernorm(collapsed), token_ids)
                return *hc_merge(out, streams, post, comb, with_mean_square=True), state


class DeepseekV4(nnx.Module):
    """DeepSeek-V4 causal LM. `dtype` is the weights' and activations' dtype; norms, sinks, biases and
    hyper-connection weights stay float32 as in the reference. `kernels` says which implementation runs each part;
    its "auto" fields are resolved here, once, for this dtype and the default device."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, kernels: Kernels = Kernels()):
        d, v = config.hidden_size, config.vocab_size
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.kernels = kernels.resolve(self.dtype)
        self.embed_tokens = nnx.Dict(weight=param(rngs, (v, d), ("vocab", "embed"), dtype=dtype))
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs, dtype=dtype, kernels=self.kernels)
                                for i in range(config.num_hidden_layers)])  # fmt: skip
        self.hc_head = HyperHead(config, rngs=rngs)
        self.norm = RMSNorm(d, config.rms_norm_eps, axis_name="embed", rngs=rngs)
        self.lm_head = nnx.Dict(weight=param(rngs, (v, d), ("vocab", "embed"), dtype=dtype))

    # ---- pure forward pieces (traced under jit) ----------------------------------------------
    def hidden_states(self, token_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """token_ids: [B, S] → final normed hidden states [B, S, D] (full-sequence, no cache).

        Under a layout with `seq_order="zigzag"` the layers run on the sequence in zigzag order (padded to 2N
        blocks; `dsv4.attention.sequence_parallel`, "Whole-model zigzag"); the result is in sequence order."""
        b, s = token_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        n = zigzag_shards()
        if n is None:
            return self._layers_forward(token_ids, positions)
        return self._zigzag_forward(token_ids, positions, n)

    def _layers_forward(self, token_ids: jax.Array, positions: jax.Array) -> jax.Array:
        b, s = token_ids.shape
        x = self.embed_tokens["weight"][...][token_ids]  # [B, S, D]
        streams = jnp.broadcast_to(x[:, :, None, :], (b, s, self.config.hc_mult, x.shape[-1]))
        streams = constrain(streams, STREAM_AXES)  # sequence parallel when a mesh is active
        mean_square = None
        for layer in self.layers:
            streams, mean_square = layer.run(streams, mean_square, positions, token_ids)
            streams, mean_square = constrain(streams, STREAM_AXES), constrain(mean_square, MEAN_SQUARE_AXES)
        return self.norm(self.hc_head(streams, mean_square))

    def _zigzag_forward(self, token_ids: jax.Array, positions: jax.Array, n: int) -> jax.Array:
        """The layers over the sequence in zigzag order over n shards. Padding tokens (id 0) go after the last
        real token at the following positions: causally invisible to every real token (window, compressed
        entries and indexer keys only look back), so the real tokens' results are exact."""
        if not self.kernels.sequence_parallel:
            raise ValueError(f"seq_order='zigzag' needs a sequence-parallel attention core ('sp', 'sp-pallas'); "
                             f"this model has Kernels.attention={self.kernels.attention!r}")  # fmt: skip
        b, s = token_ids.shape
        pad = 2 * n * zigzag_model_rows(self.config, s, n) - s
        if pad:
            token_ids = jnp.pad(token_ids, [(0, 0), (0, pad)])
            after = positions[:, -1:] + 1 + jnp.arange(pad, dtype=positions.dtype)[None]
            positions = jnp.concatenate([positions, after], axis=1)
        h = self._layers_forward(zigzag_permute(token_ids, n), zigzag_permute(positions, n))
        return zigzag_permute(h, n, inverse=True)[:, :s]

    def lm_logits(self, h: jax.Array) -> jax.Array:
        """Final hidden states [..., D] → logits [..., vocab] float32."""
        return jnp.einsum("...d,vd->...v", h, self.lm_head["weight"][...], preferred_element_type=F32)

    def __call__(self, token_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """token_ids: [B, S] → logits [B, S, vocab] float32."""
        return self.lm_logits(self.hidden_states(token_ids, positions))

    # ---- incremental: chunked prefill and decode over the cache -------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=None, *, kv_format: KVFormat | str | None = None,
                   index_format: KVFormat | str | None = None, page_tokens: int | None = None,
                   num_pages: int | None = None) -> ModelCache:  # fmt: skip
        """An empty cache for `batch` request slots of up to `max_len` tokens each.

        kv_format: how K=V rows and compressed entries are stored: a `KVFormat`, a name from
            `dsv4.cache.layout.FORMAT_NAMES` ("bf16", "fp8-channel", ...), or None: unquantized in `dtype`
            (default: the model's dtype). index_format: the indexer keys' (default: `kv_format`).
        page_tokens, num_pages: page the compressed entries. Every layer's entries then live in a pool of
            `num_pages` pages, each holding `page_tokens` tokens' worth (`page_tokens // rate` entries), and
            `cache.block_table` [batch, ceil(max_len / page_tokens)] int32 maps each slot's token pages to
            page ids; the host (`dsv4.cache.KVCacheManager` with `PageSpec.tokens(page_tokens)`) fills it
            before a chunk runs. Page 0 is the null page. Without them, entries are dense per slot.
        The sliding-window ring and the compressors' open windows are per slot either way (fixed size).
        """
        dtype = jnp.dtype(dtype or self.dtype)
        rope_dim = self.config.qk_rope_head_dim
        kv_format = resolve_format(kv_format, dtype, rope_dim)
        index_format = kv_format if index_format is None else resolve_format(index_format, dtype, rope_dim)
        pages = None
        if page_tokens is not None or num_pages is not None:
            rates = sorted({self.config.compress_rate(t) for t in self.config.layer_types if t != SLIDING})
            if page_tokens is None or num_pages is None or num_pages < 2 or page_tokens < 1:
                raise ValueError(f"a paged cache needs page_tokens >= 1 and num_pages >= 2; got page_tokens="
                                 f"{page_tokens}, num_pages={num_pages}")  # fmt: skip
            bad = [r for r in rates if page_tokens % r]
            if bad:
                raise ValueError(f"page_tokens={page_tokens} must be a multiple of every compress rate {rates} "
                                 f"(a page holds whole entries); not of {bad}")  # fmt: skip
            pages = (num_pages, page_tokens)
        layers = tuple(layer.self_attn.init_state(batch, max_len, dtype, kv_format, index_format, pages)
                       for layer in self.layers)  # fmt: skip
        table = None if pages is None else jnp.zeros((batch, -(-max_len // page_tokens)), jnp.int32)
        return ModelCache(jnp.zeros((batch,), jnp.int32), layers, table)

    def forward_chunk(self, cache: ModelCache, token_ids: jax.Array, valid: jax.Array | None = None):
        """Runs the next chunk of each slot: token_ids [B, n], of which the first valid[b] are real
        (default all; 0 leaves a slot untouched). Positions continue from cache.num_tokens.
        → (logits [B, vocab] float32 at each slot's last real token, new cache)."""
        b, n = token_ids.shape
        if valid is None:
            valid = jnp.full((b,), n, jnp.int32)
        start = cache.num_tokens
        x = self.embed_tokens["weight"][...][token_ids]
        streams = jnp.broadcast_to(x[:, :, None, :], (b, n, self.config.hc_mult, x.shape[-1]))
        # Under a mesh the chunk's tokens are split over the sequence axis (contiguously: a chunk sits after the
        # cached context, so its queries see nearly equal numbers of entries), positions kept global.
        split = n % sequence_shards() == 0
        layout = (lambda s: constrain(s, STREAM_AXES)) if split else (lambda s: s)  # noqa: E731
        layout_mean_square = (lambda m: constrain(m, MEAN_SQUARE_AXES)) if split else (lambda m: m)  # noqa: E731
        streams = layout(streams)
        states = []
        table = cache.block_table
        mean_square = None
        for layer, state in zip(self.layers, cache.layers):
            streams, mean_square, state = layer.run_chunk(streams, mean_square, start, valid, token_ids, state, table)
            streams, mean_square = layout(streams), layout_mean_square(mean_square)
            states.append(state)
        last = jnp.take_along_axis(streams, jnp.maximum(valid - 1, 0)[:, None, None, None], axis=1)  # [B, 1, hc, D]
        h = self.norm(self.hc_head(last))[:, 0]
        logits = self.lm_logits(h)
        return logits, cache.replace(num_tokens=start + valid, layers=tuple(states))

    def prefill_chunk(self, cache: ModelCache, token_ids, valid=None):
        """The next prompt chunk of each slot (any length, any split of the prompt): `forward_chunk`, compiled.

        token_ids: int [B, n] with B the cache's batch, each id in [0, vocab_size); valid: int [B] in [0, n]
        (default all n). Checked on the host (ValueError naming the problem), then run as one compiled program,
        cached per shape (the cache is not donated: the caller's `cache` stays valid). Inside a caller's own
        `jax.jit` it is traced inline as `forward_chunk`."""
        if _traced(self, cache, token_ids, valid):
            return self.forward_chunk(cache, token_ids, valid)
        ids = _check_chunk_ids(token_ids, cache, self.config.vocab_size, ndim=2, name="prefill_chunk")
        n = ids.shape[1]
        if valid is None:
            valid = np.full((ids.shape[0],), n, np.int32)
        else:
            valid = np.asarray(valid)
            if valid.shape != (ids.shape[0],) or not np.issubdtype(valid.dtype, np.integer):
                raise ValueError(f"prefill_chunk: valid must be int [{ids.shape[0]}]; got {valid.dtype}"
                                 f"{list(valid.shape)}")  # fmt: skip
            if valid.size and (valid.min() < 0 or valid.max() > n):
                raise ValueError(f"prefill_chunk: valid lengths {valid.tolist()} must be in [0, {n}]")
        graphdef, state = nnx.split(self)
        return _jitted_chunk(graphdef, state, cache, ids.astype(np.int32), valid.astype(np.int32), active())

    def decode(self, cache: ModelCache, token_ids, active=None):
        """One generated token per slot: token_ids int [B] → (logits [B, vocab], new cache), compiled and checked
        as `prefill_chunk`. `active` [B] bool (default all): inactive slots are left untouched."""
        if _traced(self, cache, token_ids, active):
            valid = None if active is None else jnp.asarray(active).astype(jnp.int32)
            return self.forward_chunk(cache, jnp.asarray(token_ids)[:, None], valid)
        ids = _check_chunk_ids(token_ids, cache, self.config.vocab_size, ndim=1, name="decode")
        valid = None
        if active is not None:
            valid = np.asarray(active)
            if valid.shape != ids.shape:
                raise ValueError(f"decode: active must be bool [{ids.shape[0]}]; got {list(valid.shape)}")
            valid = valid.astype(np.int32)
        return self.prefill_chunk(cache, ids[:, None], valid)

    # ---- user-facing, jitted ------------------------------------------------------------------
    def logits(self, token_ids) -> jax.Array:
        """Full-sequence logits for token ids [S] or [B, S] (int) → [..., S, vocab] float32."""
        ids = jnp.asarray(token_ids)
        squeeze = ids.ndim == 1
        if squeeze:
            ids = ids[None]
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"token_ids must be int [S] or [B, S]; got {ids.dtype}{list(ids.shape)}")
        check_token_ids(ids, self.config.vocab_size)
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")  # fmt: skip
        graphdef, state = nnx.split(self)
        out = _jitted_logits(graphdef, state, ids.astype(jnp.int32), active())
        return out[0] if squeeze else out


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jitted_logits(graphdef, state, ids, layout):
    """`layout` (the active mesh and rules, or None) is static: a different layout is a different program."""
    if layout is None:
        return nnx.merge(graphdef, state)(ids)
    with use_mesh(*layout):
        return nnx.merge(graphdef, state)(ids)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _jitted_chunk(graphdef, state, cache, ids, valid, layout):
    """`prefill_chunk` / `decode` compiled: one program per model graph, layout and shapes (jit's own cache)."""
    if layout is None:
        return nnx.merge(graphdef, state).forward_chunk(cache, ids, valid)
    with use_mesh(*layout):
        return nnx.merge(graphdef, state).forward_chunk(cache, ids, valid)


def _traced(model, *args) -> bool:
    """Whether we are inside a caller's trace (its jit): any argument or the weights are tracers."""
    leaves = jax.tree.leaves(args) + [model.embed_tokens["weight"][...]]
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def _check_chunk_ids(token_ids, cache: ModelCache, vocab_size: int, *, ndim: int, name: str):
    """Token ids for a cached call, checked on the host: integers, `ndim` dims with the cache's batch, in range."""
    ids = np.asarray(token_ids)
    batch = cache.num_tokens.shape[0]
    shape = f"[{batch}]" if ndim == 1 else f"[{batch}, n]"
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name}: token ids must be integers {shape}; got dtype {ids.dtype}")
    if ids.ndim != ndim or ids.shape[0] != batch or (ndim == 2 and ids.shape[1] < 1):
        raise ValueError(f"{name}: token ids must be int {shape} (the cache has {batch} slots); got shape "
                         f"{list(ids.shape)}")  # fmt: skip
    check_token_ids(ids, vocab_size)
    return ids


def check_token_ids(ids, vocab_size: int) -> None:
    """Raises ValueError naming the first out-of-range token id and its position."""
    host = np.asarray(ids)
    bad = np.argwhere((host < 0) | (host >= vocab_size))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise ValueError(f"token id {int(host[where])} at position {where} is out of range [0, {vocab_size})")
