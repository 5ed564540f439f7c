"""FP8 quantize-and-write: new cache rows quantized in the cache's format and stored into their pages through the
block table, in one Triton-lowered Pallas pass; with its jnp reference.

    stored[block_table[b, index[b, i] // R], index[b, i] % R] = quantize(rows[b, i])      for every kept row

R is the rows per page. A row is kept when 0 <= index[b, i] < max_pages · R and its page id is in [0, P); other rows
(padding, a ring slot a later row of the same chunk writes) are dropped and touch nothing. A dense per-slot store is
the special case R = rows per slot, block_table[b] = [b]. The stored leaves are the cache's (`dsv4.cache.layout.
KVFormat.row_leaves`), each [P, R, ·]:

- scaling "none":    `values` [P, R, D], the row cast to the leaf's dtype;
- "tensor" / "channel": `nope` [P, R, n] e4m3 = clip(row[:n] / scale, ±448), scale per array [n] (a per-tensor
                     scale broadcast; 0 means "not set" and divides by 1, as the reference does), and `rope`
                     [P, R, D - n] the RoPE channels in the leaf's dtype;
- "tile":            as above, with one scale per row per `tile` channels, computed from the row:
                     amax · (1/448) (1 where amax = 0), rounded up to a power of two for an e8m0 `scale` leaf,
                     stored in `scale` [P, R, ceil(n / tile)].

For per-array scales the kernel also returns the largest magnitude it stored per channel (kept rows only): the
cache's saturation watch (`quant.saturated`) is then one pass too. Calibrating an unset per-array scale needs that
maximum before the first row is quantized; the caller (`KVStore.write`) computes it in jnp in that case only.

The arithmetic is the reference's, operation for operation, so the stored bytes are equal:
- a float32 division per value (the scales multiply by 1/448: dsv4/cache/quant.py says why). Triton lowers `/` to
  PTX `div.full.f32` (2 ulp), which can put a quotient on the other side of an e4m3 rounding midpoint, so the
  compiled kernel divides with `div.rn.f32` (IEEE, as XLA's division is) by inline assembly; the interpreter
  divides with `/`;
- the clip as two selects, not min / max: Triton's float max is `maxnumf`, which drops NaN where XLA keeps it;
- a tile's amax is NaN when any of its values is (Triton's max reduction would skip them);
- the power of two above a scale from its bits (exact, subnormals included), not `frexp`.

Layout of this file (dsv4/pallas/README.md):
- `WriteBlocks`        tile sizes and launch parameters (frozen, validated).
- `kv_write_kernel`    one program = one request × `block_rows` rows, every channel.
- `kv_write`           the public jitted entry: checks shapes and dtypes, flattens the pages, calls `pl.pallas_call`.
- `kv_write_reference` the spec in jnp (quantize, then scatter), same arguments and results.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["SCALINGS", "WriteBlocks", "e8m0_bits", "kv_write", "kv_write_kernel", "kv_write_reference", "pow2_ceil"]

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALINGS = ("none", "tensor", "channel", "tile")
_LEAVES = {"none": ("values",), "tensor": ("nope", "rope"), "channel": ("nope", "rope"),
           "tile": ("nope", "rope", "scale")}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WriteBlocks:
    """block_rows: rows per program; block_cols: channels per column tile for whole rows and per-array scales (tile
    scales use the format's tile); both powers of two. num_warps: the launch's warps."""

    block_rows: int = 16
    block_cols: int = 128
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "block_cols", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"WriteBlocks.{name}={value} must be a power of two")


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------
# Exact arithmetic shared by the kernel and the reference.
# ---------------------------------------------------------------------------------------------
def _div(x: jax.Array, y: jax.Array, interpret: bool) -> jax.Array:
    """x / y in float32, correctly rounded (IEEE), on both backends (see the module docstring)."""
    if interpret:
        return x / y
    y = jnp.broadcast_to(y, x.shape)
    [q] = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F32)])  # fmt: skip
    return q


def _to_fp8(q: jax.Array) -> jax.Array:
    """clip(q, ±448) → e4m3, NaN kept (selects, not min / max: see the module docstring)."""
    q = jnp.where(q > FP8_MAX, FP8_MAX, jnp.where(q < -FP8_MAX, -FP8_MAX, q))
    return q.astype(FP8)


def pow2_ceil(x: jax.Array) -> jax.Array:
    """The smallest power of two >= x, for float32 x > 0 (subnormals included; inf above 2^127), from its bits."""
    tiny = x < 2.0**-126
    y = jnp.where(tiny, x * 2.0**64, x)  # a subnormal becomes normal; powers of two scale back exactly below
    bits = lax.bitcast_convert_type(y, jnp.int32)
    up = lax.bitcast_convert_type((bits + 0x7FFFFF) & jnp.int32(-(1 << 23)), F32)  # clear the mantissa, carry up
    return jnp.where(tiny, up * 2.0**-64, up)


def e8m0_bits(p: jax.Array) -> jax.Array:
    """A power of two p (float32) as its e8m0 byte: the biased exponent (0 for p <= 2^-127; 255 for inf), as
    `astype(float8_e8m0fnu)` rounds it."""
    return lax.shift_right_logical(lax.bitcast_convert_type(p, jnp.int32), jnp.int32(23)).astype(jnp.uint8)


def _tile_scale(amax: jax.Array, e8m0: bool) -> jax.Array:
    """A tile's scale from its amax (NaN in, 1 out, as the reference: `amax > 0` is false)."""
    scale = jnp.where(amax > 0, amax * (1.0 / FP8_MAX), 1.0)  # the cache's rule (dsv4/cache/quant.py INV_FP8_MAX)
    return pow2_ceil(scale) if e8m0 else scale


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------
def kv_write_kernel(
    rows_ref,  # [n, D]: the request's new rows
    index_ref,  # [n] int32: their row indices in the request's cache
    table_ref,  # [max_pages] int32: the request's block table
    scale_ref,  # [nope] f32 or None: per-array scales (0 = unset: divide by 1)
    pages_in,  # {leaf: [P · R, ·]}: the aliased page leaves, never read
    out,  # {leaf: [P · R, ·]} the same leaves as outputs, and for per-array scales "amax" [B · blocks, nope]
    *,
    scaling: str,
    block_rows: int,
    rows_per_page: int,
    num_pages: int,
    nope: int,
    col_tile: int,
    e8m0: bool,
    interpret: bool,
):
    """One program: rows [j · block_rows, +block_rows) of request b = pl.program_id(0), every channel, in column
    tiles of `col_tile` (the scale tile for "tile").

    Page leaves are flat [P · R, ·] and whole: a kept row goes to row page · R + index % R of each. A dropped row's
    destination is P · R, one past the end, and every access to it is masked (the interpreter drops it too).
    amax partials [B · blocks, nope]: row b · blocks + j holds the block's largest kept magnitude per channel.
    """
    del pages_in
    num_rows, width = rows_ref.shape
    t = pl.program_id(1) * block_rows + jnp.arange(block_rows)  # the block's rows of this request
    live = t < num_rows
    src = jnp.where(live, t, 0)
    index = plgpu.load(index_ref.at[src], mask=live, other=-1)
    keep = live & (index >= 0) & (index < table_ref.shape[0] * rows_per_page)
    safe = jnp.where(keep, index, 0)
    page = plgpu.load(table_ref.at[lax.div(safe, rows_per_page)], mask=keep, other=0)
    keep = keep & (page >= 0) & (page < num_pages)  # NOTE: a bad page id drops the row, never writes out of bounds
    dest = jnp.where(keep, page * rows_per_page + lax.rem(safe, rows_per_page), num_pages * rows_per_page)

    def load(first, count, limit):  # columns [first, first + count) of the rows, 0 where masked → (values, cols, ok)
        cols = first + jnp.arange(count)
        ok = cols < limit
        value = plgpu.load(rows_ref.at[src[:, None], cols[None, :]], mask=keep[:, None] & ok[None, :], other=0)
        return value, cols, ok

    def store(name, cols, ok, value, offset=0):  # leaf columns cols - offset of the kept rows
        plgpu.store(out[name].at[dest[:, None], (cols - offset)[None, :]], value.astype(out[name].dtype),
                    mask=keep[:, None] & ok[None, :])  # fmt: skip

    if scaling == "none":
        for first in range(0, width, col_tile):
            value, cols, ok = load(first, col_tile, width)
            store("values", cols, ok, value)
        return

    program = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    for k, first in enumerate(range(0, nope, col_tile)):
        x, cols, ok = load(first, col_tile, nope)
        x = x.astype(F32)
        nan = x != x
        if scaling == "tile":
            amax = jnp.max(jnp.abs(x), axis=1)
            amax = jnp.where(jnp.max(jnp.where(nan, 1.0, 0.0), axis=1) > 0, jnp.nan, amax)  # [br]
            scale = _tile_scale(amax, e8m0)
            q = _div(x, jnp.broadcast_to(scale[:, None], x.shape), interpret)
            stored = e8m0_bits(scale) if e8m0 else scale
            plgpu.store(out["scale"].at[dest, jnp.int32(k)], stored.astype(out["scale"].dtype), mask=keep)
        else:
            s = plgpu.load(scale_ref.at[cols], mask=ok, other=1.0)
            q = _div(x, jnp.broadcast_to(jnp.where(s > 0, s, 1.0)[None, :], x.shape), interpret)
            kept_nan = jnp.max(jnp.where(keep[:, None] & nan, 1.0, 0.0), axis=0) > 0
            col_max = jnp.max(jnp.where(keep[:, None], jnp.abs(x), 0.0), axis=0)
            plgpu.store(out["amax"].at[program, cols], jnp.where(kept_nan, jnp.nan, col_max), mask=ok)
        store("nope", cols, ok, _to_fp8(q))
    if width > nope:
        value, cols, ok = load(nope, _next_power_of_2(width - nope), width)
        store("rope", cols, ok, value, offset=nope)


# ---------------------------------------------------------------------------------------------
# Public entries.
# ---------------------------------------------------------------------------------------------
def _check_inputs(rows, index, block_table, pages, scales, scaling, tile) -> tuple[int, int, int, int]:
    """Validates shapes and dtypes (ValueError naming the tensor). → (P, R, nope, tiles)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} must be one of {SCALINGS}")
    if rows.ndim != 3 or not jnp.issubdtype(rows.dtype, jnp.floating):
        raise ValueError(f"rows must be floating [B, n, D], got {rows.dtype} {rows.shape}")
    b, n, d = rows.shape
    if index.shape != (b, n) or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"index must be integer {(b, n)} for rows.shape={rows.shape}, got {index.dtype} {index.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != b or not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must be integer [B={b}, max_pages], got {block_table.dtype} "
                         f"{block_table.shape}")  # fmt: skip
    want = _LEAVES[scaling]
    if set(pages) != set(want) - ({"rope"} if "rope" not in pages else set()):
        raise ValueError(f"pages must hold the leaves {list(want)} for scaling={scaling!r} ('rope' only when the "
                         f"format keeps RoPE channels), got {sorted(pages)}")  # fmt: skip
    first = pages[want[0]]
    if first.ndim != 3:
        raise ValueError(f"pages[{want[0]!r}] must be [P, R, ·], got shape {first.shape}")
    p, r, _ = first.shape
    for name, leaf in pages.items():
        if leaf.ndim != 3 or leaf.shape[:2] != (p, r):
            raise ValueError(f"pages[{name!r}].shape={leaf.shape} must be ({p}, {r}, ·) like pages[{want[0]!r}]")
        if leaf.size >= 2**31:  # NOTE: the kernel's offsets are int32
            raise ValueError(f"pages[{name!r}].shape={leaf.shape}: {leaf.size} elements, the kernel addresses at "
                             "most 2^31 - 1 per leaf; split the pool (fewer pages per array)")  # fmt: skip
    if scaling == "none":
        if first.shape[2] != d:
            raise ValueError(f"pages['values'].shape={first.shape} must hold rows of D = {d} channels")
        return p, r, d, 0
    nope = first.shape[2]
    if first.dtype != FP8:
        raise ValueError(f"pages['nope'] must be float8_e4m3fn, got {first.dtype}")
    rope = pages["rope"].shape[2] if "rope" in pages else 0
    if nope + rope != d:
        raise ValueError(f"pages['nope'] ({nope} channels) + pages['rope'] ({rope}) must hold rows of D = {d}")
    tiles = 0
    if scaling == "tile":
        if tile < 1 or tile & (tile - 1):
            raise ValueError(f"tile={tile} must be a power of two (one column tile a scale)")
        tiles = -(-nope // tile)
        sc = pages["scale"]
        if sc.shape[2] != tiles or sc.dtype not in (F32, E8M0):
            raise ValueError(f"pages['scale'] must be float32 or float8_e8m0fnu [P, R, {tiles}] (one per {tile} of "
                             f"{nope} channels), got {sc.dtype} {sc.shape}")  # fmt: skip
        if scales is not None:
            raise ValueError("scales are per row for scaling='tile' (computed here); pass scales=None")
    elif scales is None or scales.dtype != F32 or scales.shape != (nope,):
        got = None if scales is None else f"{scales.dtype} {scales.shape}"
        raise ValueError(f"scales must be float32 [{nope}] (per channel, or a per-tensor scale broadcast) for "
                         f"scaling={scaling!r}, got {got}")  # fmt: skip
    return p, r, nope, tiles


@functools.partial(jax.jit, static_argnames=("scaling", "tile", "blocks", "interpret"))
def kv_write(
    rows: jax.Array,
    index: jax.Array,
    block_table: jax.Array,
    pages: dict[str, jax.Array],
    scales: jax.Array | None = None,
    *,
    scaling: str,
    tile: int = 64,
    blocks: WriteBlocks = WriteBlocks(),
    interpret: bool = False,
) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """Quantizes rows [B, n, D] and writes row i of request b to page block_table[b, index[b, i] // R], row
    index[b, i] % R, of every leaf in `pages` (the module docstring has the leaves). → (the updated leaves,
    the largest kept magnitude per nope channel [nope] float32 for "tensor" / "channel", else None).

    The leaves are updated in place when the caller donates them (the model's step does); rows nobody writes keep
    their bytes. Grid (B, n / block_rows).
    """
    num_pages, per_page, nope, _ = _check_inputs(rows, index, block_table, pages, scales, scaling, tile)
    b, n, d = rows.shape
    names = [name for name in _LEAVES[scaling] if name in pages]
    if b * n == 0:
        return dict(pages), (jnp.zeros((nope,), F32) if scaling in ("tensor", "channel") else None)
    e8m0 = scaling == "tile" and pages["scale"].dtype == E8M0
    flat = {name: pages[name].reshape(num_pages * per_page, pages[name].shape[2]) for name in names}
    if e8m0:
        flat["scale"] = lax.bitcast_convert_type(flat["scale"], jnp.uint8)
    br = min(blocks.block_rows, _next_power_of_2(n))
    grid = (b, pl.cdiv(n, br))
    col_tile = tile if scaling == "tile" else min(blocks.block_cols, _next_power_of_2(nope))
    per_request = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j: (i,) + (0,) * len(shape))  # noqa: E731
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # noqa: E731
    out_shape = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in flat.items()}
    per_array = scaling in ("tensor", "channel")
    if per_array:
        out_shape["amax"] = jax.ShapeDtypeStruct((grid[0] * grid[1], nope), F32)
    in_specs = [per_request(n, d), per_request(n), per_request(block_table.shape[1]),
                None if scales is None else whole(scales), {name: whole(x) for name, x in flat.items()}]  # fmt: skip
    args = [rows, index.astype(jnp.int32), block_table.astype(jnp.int32), scales, flat]
    # Operands and results flatten as pytrees (None: no operand; a dict's keys in sorted order): alias each page
    # leaf to the result of the same name.
    first = 3 + (scales is not None)
    in_order, out_order = sorted(flat), sorted(out_shape)
    aliases = {first + i: out_order.index(name) for i, name in enumerate(in_order)}
    kernel = functools.partial(kv_write_kernel, scaling=scaling, block_rows=br, rows_per_page=per_page,
                               num_pages=num_pages, nope=nope, col_tile=col_tile, e8m0=e8m0, interpret=interpret)
    results = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs={name: whole(x) for name, x in out_shape.items()},
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name=f"kv_write_{scaling}",
    )(*args)
    new = {}
    for name in names:
        leaf = results[name]
        if name == "scale" and e8m0:
            leaf = lax.bitcast_convert_type(leaf, E8M0)
        new[name] = leaf.reshape(pages[name].shape)
    return new, (results["amax"].max(axis=0) if per_array else None)


def kv_write_reference(
    rows: jax.Array,
    index: jax.Array,
    block_table: jax.Array,
    pages: dict[str, jax.Array],
    scales: jax.Array | None = None,
    *,
    scaling: str,
    tile: int = 64,
) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """The spec of `kv_write` in jnp, same arguments and results: quantize every row (as
    `dsv4.cache.quant.quantize`), then scatter the kept ones (`.at[].set(mode="drop")`)."""
    num_pages, per_page, nope, tiles = _check_inputs(rows, index, block_table, pages, scales, scaling, tile)
    b, n, d = rows.shape
    capacity = block_table.shape[1] * per_page
    keep = (index >= 0) & (index < capacity)
    safe = jnp.where(keep, index, 0)
    page = jnp.take_along_axis(block_table, safe // per_page, axis=1)
    keep = keep & (page >= 0) & (page < num_pages)
    page = jnp.where(keep, page, num_pages)  # out of range: dropped
    offset = safe % per_page
    stored: dict[str, jax.Array] = {}
    seen = None
    if scaling == "none":
        stored["values"] = rows
    else:
        x = rows[..., :nope].astype(F32)
        if scaling == "tile":
            padded = jnp.pad(jnp.abs(x), [(0, 0), (0, 0), (0, tiles * tile - nope)])
            amax = padded.reshape(b, n, tiles, tile).max(-1)
            scale = jnp.where(amax > 0, amax * (1.0 / FP8_MAX), 1.0)
            if pages["scale"].dtype == E8M0:
                scale = pow2_ceil(scale)
            full = jnp.repeat(scale, tile, axis=-1)[..., :nope]
            stored["scale"] = scale
        else:
            full = jnp.where(scales > 0, scales, 1.0)
            seen = jnp.where(keep[..., None], jnp.abs(x), 0.0).max(axis=(0, 1)) if b * n else jnp.zeros((nope,), F32)
        stored["nope"] = jnp.clip(x / full, -FP8_MAX, FP8_MAX)
        if "rope" in pages:
            stored["rope"] = rows[..., nope:]
    new = {name: pages[name].at[page.reshape(-1), offset.reshape(-1)].set(
               stored[name].reshape(b * n, -1).astype(pages[name].dtype), mode="drop")
           for name in pages}  # fmt: skip
    return new, seen
