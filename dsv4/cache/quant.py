"""Storage formats of cached KV rows: quantize rows into a format's stored pytree and back (pure-jnp reference).

A format (`KVFormat`, defined with its byte layout in `layout.py` and re-exported here) says how one row of
`width` channels is stored: bf16, or FP8 e4m3 nope channels + bf16 RoPE channels + scales. Every function here
is jit-friendly (static shapes; `KVFormat` is hashable, pass it as a static argument):

    storage = empty_storage((B, T, D), fmt)                  # dict of arrays, all with leading axes (B, T)
    state = init_scale_state(D, fmt, bound=rms_norm_bound(w)) # per-array scales (None for bf16 / tile)
    stored, state = quantize(rows, fmt, state)               # rows [..., D] → dict with leading axes [...]
    rows = dequantize(stored, fmt, state, dtype)             # → [..., D] in the compute dtype
    storage, state = write_rows(storage, rows, index, fmt, state)  # quantize + scatter (fused-kernel reference)

Every stored leaf has the row axes first, so a cache update written for one array (`where`, `take`,
`.at[].set`) applies leaf by leaf with `jax.tree.map`. Dequantization is `f32(fp8) · scale` rounded once to the
compute dtype, as the Pallas attention kernels do it (dsv4/pallas/attention_common.py `load_values`).

Scale policy
------------
"tensor" / "channel" scales are per array: one scale (vector) per layer and kind of row (window ring,
compressor entries, indexer keys), shared by every request and every page. That is the `[D]` layout the kernels
take, and what lets a kernel fold the scales into Q and into the output instead of dequantizing each tile
(docs/kernels/decode.md). The scales are fixed once set: a row, once written, is never rewritten. They are set
either way:

1. From a bound (recommended; `init_scale_state(..., bound=rms_norm_bound(norm_weight))`). Every row V4 caches
   is an RMSNorm output (`kv_norm` of the K=V projection or of a pooled window) with RoPE applied afterwards to
   the bf16 channels only, so each nope channel obeys |y_c| <= |w_c| · sqrt(D) exactly, whatever the input.
   scale_c = |w_c| · sqrt(D) / 448 can never saturate. Its cost is range, not precision: e4m3's error is
   relative (3 mantissa bits) everywhere above 2^-6, so the sqrt(512) ≈ 22.6× headroom only moves a typical
   value (|y_c| ≈ |w_c|) from the top of the range to about 20, still 10 binades above the subnormals.
2. From data (no bound given): the first write in which a channel is nonzero sets its scale to
   `fmt.headroom` · amax / 448 (per channel, or over the array for "tensor"); rows passed with `valid` False
   do not count. Later values beyond ±448 · scale saturate (clip); `amax` keeps the largest value seen, so
   `saturated(state)` tells the engine it happened. Model-agnostic, but the first request's first chunk then
   decides the range for every later request.

Not done: a running amax with re-quantization. The scale is shared by every request, so growing it means
re-reading and re-writing every row of the layer already stored (hundreds of MiB per layer at 512K tokens), with
double rounding, and fencing it against kernels reading those pages. A per-page scale would localize the
rewrite, at the price of a `[pages, D]` scale layout no kernel takes. With a hard bound available, neither pays.

"tile" scales (FlashMLA's V4 layout: one scale per row per 64 nope channels) are computed from each row as it
is written: no state, no calibration, no saturation; their cost is the scale bytes in every row (7 B with
power-of-two e8m0 scales, 28 B in float32, against 576 B of row) and a multiply per tile in the kernel.
The Pallas quantize-and-write kernel (`dsv4/pallas/kv_write.py`, through `KVStore.write(impl="pallas")`) stores
the same bytes as `quantize` followed by XLA's scatter.

NOTE: XLA on GPU may drop a convert pair (f32 → fp8 or bf16 → f32) inside one computation as "excess precision"
(`xla_allow_excess_precision`), so `dequantize(quantize(x))` within one jit can come back unrounded. Rows read
from a cache stored between steps are not affected; rows rounded in flight must pass the stored form through
`jax.lax.optimization_barrier` (`KVStore.round_trip` does), and scripts/fp8_kv_accuracy.py also turns the flag off.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsv4.cache.layout import DEFAULT_FP8_FORMAT, FORMAT_NAMES, FP8_E4M3_MAX, KVFormat

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
# NOTE: scales multiply by 1/448 (rounded to float32 once), never divide by 448: under jit XLA rewrites a division
# by a constant into that multiplication, while eager jnp divides, so `x / 448` gave other bits in and out of jit
# (1 ulp in half of all values). A multiplication is the same everywhere, the Pallas write kernel included.
INV_FP8_MAX = 1.0 / FP8_E4M3_MAX

StoredRows = dict[str, jax.Array]
ScaleState = dict[str, jax.Array] | None


def empty_storage(shape: tuple[int, ...], fmt: KVFormat) -> StoredRows:
    """Storage for rows of shape (*rows, width), all zero (tile scales one): dict of leaves (*rows, n)."""
    *rows, width = shape
    return {name: jnp.full((*rows, n), 1 if name == "scale" else 0, dtype)
            for name, (n, dtype) in fmt.row_leaves(width).items()}  # fmt: skip


def rms_norm_bound(norm_weight: jax.Array) -> jax.Array:
    """Per-channel bound |w_c| · sqrt(D) on the output of an RMSNorm with weight [D]: the normalized row has
    mean square x²/(x² + eps) <= 1, so no channel exceeds sqrt(D) before the weight."""
    w = jnp.abs(jnp.asarray(norm_weight, F32))
    return w * math.sqrt(w.shape[-1])


def init_scale_state(width: int, fmt: KVFormat, bound: jax.Array | float | None = None) -> ScaleState:
    """The scale state of one array of rows `width` wide; None for formats without one (bf16, tile).

    bound: None (scales calibrated on the first write, see the module docstring), a scalar, or per-channel
    [width] (the rope channels' entries are ignored) or [nope]: |value| <= bound, so scale = bound / 448.
    """
    leaves = fmt.state_leaves(width)
    if not leaves:
        return None
    n = fmt.nope_dim(width)
    amax = jnp.zeros(leaves["amax"][0], F32)
    if bound is None:
        return {"scale": jnp.zeros(leaves["scale"][0], F32), "amax": amax}
    bound = jnp.asarray(bound, F32)
    if bound.ndim == 1 and bound.shape[0] in (width, n):
        bound = bound[:n]
    elif bound.ndim != 0:
        raise ValueError(f"bound.shape={bound.shape} must be () or ({width},) or ({n},) for rows {width} wide "
                         f"with rope_dim={fmt.rope_dim}")  # fmt: skip
    bound = jnp.broadcast_to(bound, (n,))
    scale = bound.max() if fmt.scaling == "tensor" else bound
    return {"scale": (scale * INV_FP8_MAX).astype(F32), "amax": amax}


def saturated(state: ScaleState) -> jax.Array:
    """Whether any value seen exceeded the representable range ±448 · scale (it was clipped)."""
    if state is None:
        return jnp.asarray(False)
    return jnp.any(state["amax"] > FP8_E4M3_MAX * state["scale"])


def _pow2_ceil(x: jax.Array) -> jax.Array:
    """The smallest power of two >= x (x > 0), exactly (frexp, not log2)."""
    mantissa, exponent = jnp.frexp(x)  # x = mantissa · 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(x), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def _tile_scales(nope: jax.Array, fmt: KVFormat) -> jax.Array:
    """nope [..., n] float32 → one scale per `fmt.tile` channels [..., ceil(n / tile)] (last tile may be short)."""
    n = nope.shape[-1]
    tiles = -(-n // fmt.tile)
    padded = jnp.pad(jnp.abs(nope), [(0, 0)] * (nope.ndim - 1) + [(0, tiles * fmt.tile - n)])
    amax = padded.reshape(*nope.shape[:-1], tiles, fmt.tile).max(-1)
    scale = jnp.where(amax > 0, amax * INV_FP8_MAX, 1.0)
    return _pow2_ceil(scale) if fmt.scale_dtype == "float8_e8m0fnu" else scale


def _per_channel(scale: jax.Array, fmt: KVFormat, n: int) -> jax.Array:
    """Tile scales [..., tiles] → [..., n]; per-array scales pass through (they broadcast)."""
    return jnp.repeat(scale, fmt.tile, axis=-1)[..., :n] if fmt.scaling == "tile" else scale


def calibrate(nope: jax.Array, fmt: KVFormat, scale_state: ScaleState,
              valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Per-array ("tensor" / "channel") scales for a write of nope [..., n] float32: → (the scales, each unset one
    (0) calibrated once from this write, the largest kept magnitude `seen` per channel or over the tensor).
    valid [...] bool: rows outside it count for neither."""
    if scale_state is None:
        raise ValueError(f"KVFormat {fmt.name!r} (scaling={fmt.scaling!r}) needs a scale state: init_scale_state")
    magnitude = jnp.abs(nope)
    if valid is not None:
        magnitude = jnp.where(valid[..., None], magnitude, 0.0)
    axes = tuple(range(nope.ndim - 1)) if fmt.scaling == "channel" else None
    seen = magnitude.max(axis=axes) if nope.size else jnp.zeros_like(scale_state["amax"])
    scale = scale_state["scale"]
    return jnp.where(scale > 0, scale, seen * (fmt.headroom * INV_FP8_MAX)), seen


def quantize(rows: jax.Array, fmt: KVFormat, scale_state: ScaleState = None, *,
             valid: jax.Array | None = None) -> tuple[StoredRows, ScaleState]:  # fmt: skip
    """rows [..., D] → (stored leaves [..., n] per `fmt.row_leaves(D)`, updated scale state).

    valid [...] bool (optional): rows that will not be kept (padding, dropped writes) do not calibrate
    scales or count towards `amax`. Their stored values are still computed.
    """
    width = rows.shape[-1]
    if not fmt.quantized:
        return {"values": rows.astype(fmt.dtype)}, scale_state
    n = fmt.nope_dim(width)
    nope = rows[..., :n].astype(F32)
    stored: StoredRows = {}
    if fmt.scaling == "tile":
        scale = _tile_scales(nope, fmt)
        stored_scale = scale.astype(fmt.scale_dtype)
        new_state = scale_state
    else:
        scale, seen = calibrate(nope, fmt, scale_state, valid)
        new_state = {"scale": scale, "amax": jnp.maximum(scale_state["amax"], seen)}
    full = _per_channel(scale, fmt, n)
    # NOTE: clip first: float8_e4m3fn has no infinity, and an out-of-range cast gives NaN.
    stored["nope"] = jnp.clip(nope / jnp.where(full > 0, full, 1.0), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8)
    if fmt.rope_dim:
        stored["rope"] = rows[..., n:].astype(fmt.rope_dtype)
    if fmt.scaling == "tile":
        stored["scale"] = stored_scale
    return stored, new_state


def dequantize(stored: StoredRows, fmt: KVFormat, scale_state: ScaleState = None, dtype=jnp.bfloat16) -> jax.Array:
    """Stored leaves [..., n] → rows [..., D] in `dtype`: f32(fp8) · scale, rounded once."""
    if not fmt.quantized:
        return stored["values"].astype(dtype)
    nope = stored["nope"].astype(F32)
    if fmt.scaling == "tile":
        scale = stored["scale"].astype(F32)
    elif scale_state is None:
        raise ValueError(f"KVFormat {fmt.name!r} (scaling={fmt.scaling!r}) needs its scale state to dequantize")
    else:
        scale = scale_state["scale"]
    out = (nope * _per_channel(scale, fmt, nope.shape[-1])).astype(dtype)
    return jnp.concatenate([out, stored["rope"].astype(dtype)], axis=-1) if fmt.rope_dim else out


def write_rows(storage: StoredRows, rows: jax.Array, index: jax.Array, fmt: KVFormat,
               scale_state: ScaleState = None) -> tuple[StoredRows, ScaleState]:  # fmt: skip
    """Quantizes rows [B, n, D] and writes row i of slot b to storage[b, index[b, i]] (storage leaves [B, T, ·]).

    An index outside [0, T) drops the row (padding; a ring slot the same chunk writes again later) and keeps
    it out of scale calibration. Indices kept must be distinct per slot.
    """
    t = jax.tree.leaves(storage)[0].shape[1]
    keep = (index >= 0) & (index < t)
    index = jnp.where(keep, index, t)  # NOTE: a negative index would wrap, so map every dropped row to T
    stored, scale_state = quantize(rows, fmt, scale_state, valid=keep)
    put = jax.vmap(lambda store, i, new: store.at[i].set(new, mode="drop"))
    return jax.tree.map(lambda store, new: put(store, index, new), storage, stored), scale_state


__all__ = ["DEFAULT_FP8_FORMAT", "FORMAT_NAMES", "FP8_E4M3_MAX", "KVFormat", "ScaleState", "StoredRows",
           "calibrate", "dequantize", "empty_storage", "init_scale_state", "quantize", "rms_norm_bound", "saturated",
           "write_rows"]  # fmt: skip
