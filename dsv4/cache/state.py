"""The device cache as typed pytrees: what one compressor, one layer and the whole model keep between chunks.

Each class is a frozen dataclass registered with `jax.tree_util`, so a cache rides through `jit`, donation and
`jax.tree.map` like a dict of arrays, while its fields are named and checked. Update with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses

import jax

from dsv4.cache.store import KVStore


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressorCache:
    """entries: the pooled entries so far (dense per slot, or a shared page pool). open_kv / open_gate [B, rate, W]:
    the raw projections of the window not yet closed. prev_kv / prev_gate [B, rate, D] (CSA's overlap only): the
    last closed window's first half with its gate, which the next entry pools over too."""

    entries: KVStore
    open_kv: jax.Array
    open_gate: jax.Array
    prev_kv: jax.Array | None = None
    prev_gate: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """window [B, W rows]: a ring of the last `sliding_window` K=V rows (row = position % W); window_pos [B, W]: the
    position each row holds (-1: none). HCA and CSA layers add their compressor's state, CSA the indexer's too."""

    window: KVStore
    window_pos: jax.Array
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None

    @property
    def stores(self) -> list[KVStore]:
        return [self.window] + ([self.compressor.entries] if self.compressor is not None else [])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """num_tokens [B]: tokens cached per request slot. layers: one `LayerCache` per decoder layer. block_table
    [B, pages] int32 (paged caches only): each slot's token pages → page ids in every layer's pools."""

    num_tokens: jax.Array
    layers: tuple[LayerCache, ...]
    block_table: jax.Array | None = None

    def replace(self, **changes) -> ModelCache:
        return dataclasses.replace(self, **changes)
