"""The lightning indexer of CSA layers: scores Σ_h w_h · ReLU(q_h · k_c) over its own compressed keys and keeps the
`index_topk` best entries per query, exactly (ties to the lower index, as `lax.top_k`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.attention.compressor import Compressor
from dsv4.attention.core import NEG_INF
from dsv4.cache.store import KVStore
from dsv4.config import CSA, Config
from dsv4.kernels import Kernels
from dsv4.layers import F32, Rope, apply_rope, linear, param, project
from dsv4.pallas._device import is_hopper, on_gpu
from dsv4.pallas.attention import SCALE_TILE
from dsv4.pallas.indexer import index_topk, index_topk_two_pass, one_band_per_call
from dsv4.pallas.indexer_paged import index_topk_paged
from dsv4.sharding.sequence import per_sequence_shard

# Kernels.topk_refine → the kernels' `selection` argument
_SELECTION = {"jnp": "xla", "pallas": "kernel"}
# The FP8 indexer's width bands on the Mosaic path (`index_topk_two_pass(width_bands=...)`, docs/kernels/indexer.md)
FP8_WIDTH_BANDS = 4


class Indexer(Compressor):
    """Lightning indexer: scores Σ_h w_h · ReLU(q_h · k_s) over its own compressed keys, keeps the top k.

    Its keys come from its own overlapping compressor at `index_head_dim` (hence the base class).
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs, dtype, kernels: Kernels):
        rate = config.compress_rate(CSA)
        super().__init__(config, rate=rate, head_dim=config.index_head_dim, overlap=True, rngs=rngs, dtype=dtype)
        self.q_b_proj = nnx.Dict(weight=param(
            rngs, (config.index_n_heads * config.index_head_dim, config.q_lora_rank), ("index_heads", "q_lora"),
            dtype=dtype))  # fmt: skip
        self.scorer = nnx.Dict(weights_proj=nnx.Dict(weight=param(
            rngs, (config.index_n_heads, config.hidden_size), ("index_n_heads", "embed"), dtype=dtype)))
        self.n_heads, self.topk = config.index_n_heads, config.index_topk
        # static choices (`Kernels`): the scores and top-k path, the one-token steps' route, the top-k refinement
        self.impl, self.paged, self.selection = kernels.indexer, kernels.paged_indexer, _SELECTION[kernels.topk_refine]
        self.dense = kernels.dense

    def keys(self, x: jax.Array, rope: Rope) -> jax.Array:
        return self(x, rope)

    def _queries(self, x: jax.Array, q_residual: jax.Array, positions: jax.Array, rope: Rope):
        """→ (q [B, S, Hi, Di] with RoPE, head weights [B, S, Hi] float32)."""
        b, s, _ = x.shape
        q = project(q_residual, self.q_b_proj["weight"], self.dense).reshape(b, s, self.n_heads, self.head_dim)
        cos, sin = rope.cos_sin(positions)
        q = apply_rope(q, cos.astype(q.dtype), sin.astype(q.dtype))
        return q, linear(x, self.scorer["weights_proj"]["weight"][...]).astype(F32) * self.n_heads**-0.5

    def select(self, x: jax.Array, q_residual: jax.Array, positions: jax.Array, keys: jax.Array, rope: Rope,
               query_chunk: int = 512) -> jax.Array:  # fmt: skip
        """→ topk_indices [B, S, min(index_topk, C)] int32, -1 where fewer entries are visible; on the Pallas paths
        in no particular order (the attention takes them as a set: `index_topk_two_pass(ordered=False)`)."""
        n_keys = keys.shape[1]
        q, weights = self._queries(x, q_residual, positions, rope)
        k = min(self.topk, n_keys)
        impl = self.impl
        kw = dict(rate=self.rate, k=k, softmax_scale=self.head_dim**-0.5)
        if impl in ("pallas", "pallas-triton", "pallas-fp8"):
            interpret = not on_gpu()
            # One width band for the call when the whole call's positions fit one band (a prefill chunk): judged
            # on the global S, since a sequence shard of a zigzag layout holds two blocks far apart.
            one_band = one_band_per_call(q.shape[1], self.rate, n_keys, FP8_WIDTH_BANDS)
            # "pallas": bf16 scores on the Mosaic kernel where it runs (a Hopper GPU, 64 heads, bf16 q and keys;
            # 1.37x the Triton scores kernel), with the FP8 path's width bands; the Triton kernel elsewhere
            mgpu = (impl == "pallas" and not interpret and is_hopper() and q.shape[2] == 64
                    and q.dtype == keys.dtype == jnp.bfloat16)  # fmt: skip
            scores = dict(scores_impl="mgpu", width_bands=FP8_WIDTH_BANDS, call_band=one_band) if mgpu else {}

            def local(q_, weights_, positions_, keys_):  # this shard's queries against all keys
                return index_topk_two_pass(q_, keys_, weights_, positions_, **kw, interpret=interpret,
                                           selection=self.selection, ordered=False, **scores)  # fmt: skip

            if impl == "pallas-fp8":
                local = functools.partial(index_topk_fp8, **kw, interpret=interpret, selection=self.selection,
                                          call_band=one_band, ordered=False)  # fmt: skip
            return per_sequence_shard(local, (q, weights, positions), (keys,), fill=(0, 0, -1))
        if impl == "pallas-stream":
            return index_topk(q, keys, weights, positions, **kw, interpret=not on_gpu())
        return index_topk_jnp(q, keys, weights, positions, **kw, query_chunk=query_chunk)

    def paged_select_applies(self, store: KVStore, block_table: jax.Array | None, num_queries: int, dtype) -> bool:
        """Whether `select_paged` serves this step (static): the paged route chosen (`Kernels.paged_indexer`), a
        one-token step, a store with room for entries, and keys stored in a form the paged kernel takes (unquantized in
        the compute dtype, or FP8 split rows with scales per tensor, per channel or per row and 64-channel tile),
        with the compiled kernel's shapes on a GPU."""
        if not (self.paged in ("pallas", "pallas-triton") and num_queries == 1):
            return False
        if store.capacity(block_table if store.paged else None) == 0:
            return False
        if store.fmt.quantized:
            if store.fmt.scaling == "tile" and store.fmt.tile != SCALE_TILE:
                return False
            rope = store.fmt.rope_dim
            if rope & (rope - 1) or (on_gpu() and store.fmt.nope_dim(self.head_dim) < 16):
                return False  # RoPE channels load as one Triton tile (a power of two), interpreted or not
        elif store.stored["values"].dtype != dtype:
            return False
        heads = self.n_heads
        return not on_gpu() or (heads >= 16 and not heads & (heads - 1))

    def select_paged(self, x: jax.Array, q_residual: jax.Array, positions: jax.Array, store: KVStore,
                     block_table: jax.Array | None, rope: Rope) -> jax.Array:  # fmt: skip
        """`select` with the keys scored where the cache stores them (`index_topk_paged`: the stored rows gathered
        through the block table, a dense store's slot b as page b), instead of a dense dequantized copy first.
        → topk_indices [B, S, min(index_topk, capacity)] int32."""
        q, weights = self._queries(x, q_residual, positions, rope)
        b = q.shape[0]
        table = block_table if store.paged else jnp.arange(b, dtype=jnp.int32)[:, None]
        rows = store.kernel_operands()
        return index_topk_paged(q, weights, positions, rows["pages"], table, rate=self.rate,
                                k=min(self.topk, store.capacity(block_table)), softmax_scale=self.head_dim**-0.5,
                                key_scales=rows["scales"], key_rope_pages=rows["rope"], interpret=not on_gpu(),
                                selection=self.selection, ordered=False,
                                scores_impl="triton" if self.paged == "pallas-triton" else "auto")  # fmt: skip


def quantize_rows_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., Di] → (e4m3 [..., Di], float32 scale [...]): one scale per row, amax / 448 (all-zero rows: 1)."""
    amax = jnp.max(jnp.abs(x.astype(F32)), axis=-1)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (x.astype(F32) / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def index_topk_fp8(q, weights, positions, keys, *, rate: int, k: int, softmax_scale: float, interpret: bool,
                   selection: str = "auto", call_band: bool | None = None, ordered: bool = True):  # fmt: skip
    """The lightning indexer in FP8 (as DeepSeek-V3.2's inference code runs it; the transformers V4 spec uses bf16):
    q quantized per (token, head), keys per entry (e4m3, amax scales), scores by the Mosaic FP8 kernel on a Hopper
    GPU (`index_scores_mgpu`) or the Triton kernel elsewhere, then the exact grouped top-k. Arguments as
    `index_topk_jnp` (q, weights, positions first: the per-shard function of `per_sequence_shard`).
    On the Mosaic path each query chunk is scored over one of `FP8_WIDTH_BANDS` width bands (`index_topk_two_pass`,
    docs/kernels/indexer.md; `call_band` and `ordered` as there). → [B, S, k] int32."""
    q8, q_scale = quantize_rows_e4m3(q)
    k8, k_scale = quantize_rows_e4m3(keys)
    mgpu = not interpret and is_hopper() and q.shape[2] == 64
    return index_topk_two_pass(q8, k8, weights, positions, rate=rate, k=k, softmax_scale=softmax_scale,
                               q_scale=q_scale, k_scale=k_scale, interpret=interpret, selection=selection,
                               scores_impl="mgpu" if mgpu else "triton", width_bands=FP8_WIDTH_BANDS if mgpu else 1,
                               call_band=call_band, ordered=ordered)  # fmt: skip


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
