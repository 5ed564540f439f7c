"""`KVStore`: one array of cached rows on the device (a window ring, compressed entries, indexer keys), stored in
a `KVFormat`, dense per request slot or paged through a block table.

    store = KVStore.dense(batch, rows, width, fmt, bound=...)         # rows [batch, rows, ·]
    store = KVStore.paged_pool(num_pages, rows_per_page, width, fmt, ...)  # rows [num_pages, rows_per_page, ·]
    store = store.write(new_rows, index, block_table)                 # quantize + scatter; index < 0 drops
    store = store.write(new_rows, index, block_table, impl="pallas")  # the same in one kernel (dsv4/pallas/kv_write.py)
    rows  = store.read(dtype, block_table)                            # dequantized [B, capacity, width]

A store is a pytree (`jax.tree_util.register_dataclass`): its arrays are leaves, its format and layout are static,
so it rides through `jit`, `donate_argnums` and `jax.tree.map` like any dict of arrays. `stored` holds the
format's leaves (`KVFormat.row_leaves`: "values", or "nope" / "rope" / "scale"), each with the row axes first;
`scale` is the per-array scale state (`quant.init_scale_state`; None for bf16 and tile formats), shared by every
request and page of the array.

Paged: row r of request b lives at `stored[block_table[b, r // rows_per_page], r % rows_per_page]`. The engine's
block table maps *token* pages (`page_tokens` tokens each) to page ids, and an array of compressed entries at
rate R puts `page_tokens // R` entries in each page, so one table serves every layer and every rate, and a page
id holds the same token span in every layer's pool: no pool has ids it never uses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv4.cache.layout import KVFormat
from dsv4.cache.quant import ScaleState, calibrate, dequantize, empty_storage, init_scale_state, quantize

WRITE_IMPLS = ("jnp", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVStore:
    stored: dict[str, jax.Array]
    scale: ScaleState
    fmt: KVFormat = dataclasses.field(metadata=dict(static=True))
    paged: bool = dataclasses.field(metadata=dict(static=True))

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def dense(cls, batch: int, rows: int, width: int, fmt: KVFormat, *, bound=None) -> KVStore:
        """`rows` rows per request slot. `bound`: see `quant.init_scale_state` (per-array formats only)."""
        return cls(empty_storage((batch, rows, width), fmt), init_scale_state(width, fmt, bound), fmt, False)

    @classmethod
    def paged_pool(cls, num_pages: int, rows_per_page: int, width: int, fmt: KVFormat, *, bound=None) -> KVStore:
        """A pool of `num_pages` pages of `rows_per_page` rows, shared by every slot (page 0: the null page)."""
        if num_pages < 2 or rows_per_page < 1:
            raise ValueError(f"a paged store needs num_pages >= 2 and rows_per_page >= 1; got {num_pages}, "
                             f"{rows_per_page}")  # fmt: skip
        return cls(empty_storage((num_pages, rows_per_page, width), fmt), init_scale_state(width, fmt, bound), fmt,
                   True)  # fmt: skip

    # ---- shape -------------------------------------------------------------------------------------------
    @property
    def _leaf(self) -> jax.Array:
        return next(iter(self.stored.values()))

    @property
    def rows_per_page(self) -> int:
        return self._leaf.shape[1]

    @property
    def width(self) -> int:
        return sum(leaf.shape[-1] for name, leaf in self.stored.items() if name != "scale")

    def capacity(self, block_table: jax.Array | None = None) -> int:
        """Rows one request can hold: the dense row count, or table length × rows per page."""
        return self._leaf.shape[1] * (block_table.shape[1] if self.paged else 1)

    def _check_table(self, block_table):
        if self.paged and block_table is None:
            raise ValueError("a paged KVStore needs the request's block table")

    # ---- access ------------------------------------------------------------------------------------------
    def kernel_operands(self) -> dict[str, jax.Array | None]:
        """The leaves as the paged kernels take them: pages [P, R, ·] (a dense store's request slots are its pages),
        FP8 scales in float32 ([width] per array, or [P, R, tiles] per row), and the bf16 RoPE pages."""
        if not self.fmt.quantized:
            return dict(pages=self.stored["values"], scales=None, rope=None)
        nope = self.stored["nope"]
        if self.fmt.scaling == "tile":  # e8m0 scales widen here: a pass over 1 byte per 64 values
            scales = self.stored["scale"].astype(jnp.float32)
        else:
            scales = jnp.broadcast_to(self.scale["scale"].astype(jnp.float32), nope.shape[-1:])
        return dict(pages=nope, scales=scales, rope=self.stored.get("rope"))

    def read(self, dtype, block_table: jax.Array | None = None) -> jax.Array:
        """Every row slot of each request, dequantized: [B, capacity, width] (unwritten slots: zeros or stale
        rows of a reused page; callers mask them by count, as attention and the indexer do)."""
        self._check_table(block_table)
        stored = self.stored
        if self.paged:
            def gather(leaf):  # [P, R, n] → [B, pages · R, n]
                pages = leaf[block_table]
                return pages.reshape(pages.shape[0], -1, pages.shape[-1])

            stored = {name: gather(leaf) for name, leaf in stored.items()}
        return dequantize(stored, self.fmt, self.scale, dtype)

    def round_trip(self, rows: jax.Array, valid: jax.Array | None = None) -> tuple[jax.Array, ScaleState]:
        """rows as this store would give them back after a write (quantized with the current scales, then
        dequantized), and the scale state the write would leave. For rows used in flight before being stored,
        so a chunk's own keys look exactly like the cached keys of an earlier chunk."""
        stored, scale = quantize(rows, self.fmt, self.scale, valid=valid)
        # NOTE: XLA on GPU may fold a convert pair (f32 → fp8 → f32, f32 → bf16 → f32) away as "excess precision";
        # the barrier keeps the stored form real, so in-flight rows are rounded exactly as cached ones.
        stored = jax.lax.optimization_barrier(stored)
        return dequantize(stored, self.fmt, scale, rows.dtype), scale

    def write(self, rows: jax.Array, index: jax.Array, block_table: jax.Array | None = None, *,
              impl: str = "jnp") -> KVStore:  # fmt: skip
        """Quantizes rows [B, n, width] and stores row i of request b at its row index[b, i] (< 0 or beyond
        the capacity: dropped, and not counted by scale calibration). Kept indices must be distinct per request.

        impl: "jnp" (quantize, then XLA's scatter) or "pallas" (`dsv4.pallas.kv_write`: both in one kernel, the
        same bytes and the same scale state; interpreted off a GPU)."""
        if impl not in WRITE_IMPLS:
            raise ValueError(f"KVStore.write: impl={impl!r}; available: {WRITE_IMPLS}")
        self._check_table(block_table)
        if impl == "pallas":
            return self._write_kernel(rows, index, block_table)
        capacity = self.capacity(block_table)
        keep = (index >= 0) & (index < capacity)
        stored_rows, scale = quantize(rows, self.fmt, self.scale, valid=keep)
        if self.paged:
            num_pages, per_page = self._leaf.shape[:2]
            safe = jnp.where(keep, index, 0)
            page = jnp.take_along_axis(block_table, safe // per_page, axis=1)
            page = jnp.where(keep, page, num_pages)  # NOTE: num_pages is out of range: mode="drop" skips it
            offset = safe % per_page

            def put(leaf, new):
                return leaf.at[page.reshape(-1), offset.reshape(-1)].set(
                    new.reshape(-1, new.shape[-1]).astype(leaf.dtype), mode="drop")

        else:
            target = jnp.where(keep, index, capacity)  # NOTE: a negative index would wrap; map drops past the end

            def put(leaf, new):
                return jax.vmap(lambda s, t, v: s.at[t].set(v.astype(s.dtype), mode="drop"))(leaf, target, new)

        stored = {name: put(leaf, stored_rows[name]) for name, leaf in self.stored.items()}
        return dataclasses.replace(self, stored=stored, scale=scale)

    def _write_kernel(self, rows: jax.Array, index: jax.Array, block_table: jax.Array | None) -> KVStore:
        """`write` through `dsv4.pallas.kv_write`: a dense store is a pool whose page b is slot b. Per-array scales
        not yet set are calibrated first, from the kept rows' amax in jnp, exactly as `quantize` does (an extra
        read of the rows, skipped by `lax.cond` once every scale is set); the new amax comes from the kernel."""
        from dsv4.pallas.kv_write import kv_write

        if rows.shape[0] * rows.shape[1] == 0:
            return self  # as `quantize` has it: nothing stored, the scales and their amax unchanged
        fmt = self.fmt
        table = block_table if self.paged else jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
        interpret = jax.default_backend() != "gpu"
        if fmt.scaling not in ("tensor", "channel"):
            stored, _ = kv_write(rows, index, table, self.stored, scaling=fmt.scaling, tile=fmt.tile,
                                 interpret=interpret)  # fmt: skip
            return dataclasses.replace(self, stored=stored)
        n = fmt.nope_dim(rows.shape[-1])

        def calibrated():  # quantize's rule, on the rows this write keeps
            keep = (index >= 0) & (index < self.capacity(block_table))
            return calibrate(rows[..., :n].astype(jnp.float32), fmt, self.scale, keep)[0]

        scale = self.scale["scale"]
        scale = jax.lax.cond(jnp.all(scale > 0), lambda: scale, calibrated)
        stored, seen = kv_write(rows, index, table, self.stored, jnp.broadcast_to(scale, (n,)), scaling=fmt.scaling,
                                interpret=interpret)  # fmt: skip
        if fmt.scaling == "tensor":
            seen = seen.max()
        state = {"scale": scale, "amax": jnp.maximum(self.scale["amax"], seen)}
        return dataclasses.replace(self, stored=stored, scale=state)


def per_slot_mask(tree):
    """A pytree of bools matching `tree`'s leaves: True where the leaf has a leading request-slot axis (dense
    stores, block tables, counters), False where it is shared by all slots (page pools, scale states)."""

    def mark(node):
        if isinstance(node, KVStore):
            return KVStore(jax.tree.map(lambda _: not node.paged, node.stored),
                           jax.tree.map(lambda _: False, node.scale), node.fmt, node.paged)  # fmt: skip
        return jax.tree.map(lambda _: True, node)

    return jax.tree.map(mark, tree, is_leaf=lambda x: isinstance(x, KVStore))


def resolve_format(kv_format: KVFormat | str | None, dtype, rope_dim: int) -> KVFormat:
    """A `KVFormat`, a format name (`FORMAT_NAMES`; `rope_dim` trailing channels kept bf16), or None: rows
    kept unquantized in `dtype`."""
    if kv_format is None:
        name = jnp.dtype(dtype).name
        return KVFormat(name, dtype=name)
    if isinstance(kv_format, KVFormat):
        return kv_format
    if isinstance(kv_format, str):
        return KVFormat.named(kv_format, rope_dim=rope_dim)
    raise TypeError(f"kv_format must be a KVFormat, a format name or None; got {type(kv_format).__name__}")
