"""What one request's DeepSeek-V4 KV cache holds, in bytes: storage formats and the per-layer cache layout.

Two things live here, both plain Python (no JAX, so the engine and the memory planner can size pools without
a device, and `tests/test_block_pool.py` imports this module with JAX blocked):

- `KVFormat`: how one cached row (a K=V row, a compressed entry, an indexer key) is stored: bf16, or FP8 e4m3
  with per-tensor, per-channel or per-token-tile scales, RoPE channels kept in bf16. The jnp math that
  quantizes and dequantizes rows is in `dsv4/cache/quant.py`; this file only describes the bytes.
- `CacheLayout`: for a model config and a format, every array of a request's cache per layer (sliding-window
  ring, compressed entries, indexer keys, compressor state), with its row count as a function of the token
  count. It mirrors `Attention.init_state` array for array (a test checks it against `jax.eval_shape` of
  `DeepseekV4.init_cache`), so "bytes per token" has one definition.

The config is read duck-typed (`layer_types`, `head_dim`, `index_head_dim`, `sliding_window`, `compress_rate`):
`cache/` does not import the model package, as in `manager.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# transformers' `layer_types` values (config.json vocabulary, stable across releases).
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e8m0fnu": 1, "int32": 4}
SCALINGS = ("none", "tensor", "channel", "tile")
SCALE_DTYPES = ("float32", "float8_e8m0fnu")


@dataclass(frozen=True)
class KVFormat:
    """How one cached row of `width` channels is stored. Frozen and hashable: a static argument under jit.

    scaling:
      "none"     the whole row in `dtype` (bf16): one leaf `values [..., width]`.
      "tensor"   FP8 nope channels, one float32 scale for the whole array (layer × kind), held in a scale state.
      "channel"  FP8 nope channels, one float32 scale per nope channel of the array, held in a scale state.
      "tile"     FP8 nope channels, one scale per row per `tile` channels, stored next to the row (FlashMLA's
                 V4 layout with tile 64: 448 = 7 × 64 nope channels per 512-wide row).
    The trailing `rope_dim` channels carry RoPE and stay in `rope_dtype` (bf16): their rotation spreads a
    position-dependent range over them that a fixed FP8 scale fits badly, and they are only 1/8 of the row.
    Quantized formats store leaves `nope [..., width - rope_dim]` (FP8), `rope [..., rope_dim]` and, for
    "tile", `scale [..., ceil(nope / tile)]` in `scale_dtype` ("float8_e8m0fnu": power-of-two scales, 1 byte).

    `headroom` applies only to "tensor" / "channel" scales calibrated from data (no bound given to
    `quant.init_scale_state`): scale = headroom · amax(first write) / 448. See quant.py for the policy.
    """

    name: str
    dtype: str = "bfloat16"
    scaling: str = "none"
    rope_dim: int = 0
    rope_dtype: str = "bfloat16"
    tile: int = 64
    scale_dtype: str = "float32"
    headroom: float = 2.0

    def __post_init__(self) -> None:
        def fail(field: str, why: str) -> None:
            raise ValueError(f"KVFormat {self.name!r}: {field}={getattr(self, field)!r} {why}")

        if self.scaling not in SCALINGS:
            fail("scaling", f"must be one of {SCALINGS}")
        if self.dtype not in ITEMSIZE:
            fail("dtype", f"must be one of {sorted(ITEMSIZE)}")
        if self.scaling == "none" and self.dtype == "float8_e4m3fn":
            fail("dtype", "needs a scaling (tensor, channel or tile)")
        if self.scaling != "none" and self.dtype != "float8_e4m3fn":
            fail("dtype", f"must be float8_e4m3fn with scaling={self.scaling!r}")
        if self.rope_dim < 0:
            fail("rope_dim", "must be >= 0")
        if self.rope_dtype not in ("bfloat16", "float16", "float32"):
            fail("rope_dtype", "must be bfloat16, float16 or float32")
        if self.tile < 1:
            fail("tile", "must be >= 1")
        if self.scale_dtype not in SCALE_DTYPES:
            fail("scale_dtype", f"must be one of {SCALE_DTYPES}")
        if self.scale_dtype != "float32" and self.scaling != "tile":
            fail("scale_dtype", "other than float32 is only for scaling='tile' (tensor/channel scales are per array)")
        if not self.headroom >= 1.0:
            fail("headroom", "must be >= 1")

    @classmethod
    def named(cls, name: str, *, rope_dim: int) -> KVFormat:
        """One of `FORMAT_NAMES`; `rope_dim` = the config's `qk_rope_head_dim` (64 for V4)."""
        presets = {
            "bf16": dict(),
            "fp8-tensor": dict(dtype="float8_e4m3fn", scaling="tensor"),
            "fp8-channel": dict(dtype="float8_e4m3fn", scaling="channel"),
            "fp8-tile": dict(dtype="float8_e4m3fn", scaling="tile"),
            "fp8-tile-e8m0": dict(dtype="float8_e4m3fn", scaling="tile", scale_dtype="float8_e8m0fnu"),
        }
        if name not in presets:
            raise ValueError(f"unknown KV format {name!r}; known: {list(presets)}")
        return cls(name, rope_dim=0 if name == "bf16" else rope_dim, **presets[name])

    @property
    def quantized(self) -> bool:
        return self.scaling != "none"

    def nope_dim(self, width: int) -> int:
        """Channels stored in FP8 (all of them for an unquantized format)."""
        if self.quantized and not 0 <= self.rope_dim < width:
            raise ValueError(f"KVFormat {self.name!r}: rope_dim={self.rope_dim} must be < row width {width}")
        return width - self.rope_dim if self.quantized else width

    def num_tiles(self, width: int) -> int:
        return -(-self.nope_dim(width) // self.tile)

    def row_leaves(self, width: int) -> dict[str, tuple[int, str]]:
        """Per-row leaves of the stored pytree: name → (trailing length, dtype name)."""
        if not self.quantized:
            return {"values": (width, self.dtype)}
        leaves = {"nope": (self.nope_dim(width), self.dtype)}
        if self.rope_dim:
            leaves["rope"] = (self.rope_dim, self.rope_dtype)
        if self.scaling == "tile":
            leaves["scale"] = (self.num_tiles(width), self.scale_dtype)
        return leaves

    def row_bytes(self, width: int) -> int:
        """Bytes of one stored row (unpadded: FlashMLA pads its 583-byte fp8-tile-e8m0 V4 row to 584)."""
        return sum(n * ITEMSIZE[dtype] for n, dtype in self.row_leaves(width).values())

    def state_leaves(self, width: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Leaves of the per-array scale state (shared by every row of the array): name → (shape, dtype)."""
        if self.scaling == "tensor":
            return {"scale": ((), "float32"), "amax": ((), "float32")}
        if self.scaling == "channel":
            n = self.nope_dim(width)
            return {"scale": ((n,), "float32"), "amax": ((n,), "float32")}
        return {}

    def state_bytes(self, width: int) -> int:
        return sum(_prod(shape) * ITEMSIZE[dtype] for shape, dtype in self.state_leaves(width).values())


FORMAT_NAMES = ("bf16", "fp8-tensor", "fp8-channel", "fp8-tile", "fp8-tile-e8m0")
# The default FP8 format is chosen by measurement: docs/BENCHMARKS.md, "FP8 KV cache accuracy".
DEFAULT_FP8_FORMAT = "fp8-channel"


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


# ---------------------------------------------------------------------------------------------
# The per-request layout of a model's cache.
# ---------------------------------------------------------------------------------------------
class V4ConfigLike(Protocol):
    layer_types: tuple[str, ...]
    head_dim: int
    index_head_dim: int
    sliding_window: int

    def compress_rate(self, layer_type: str) -> int: ...


@dataclass(frozen=True)
class CachedArray:
    """One array of a layer's per-request cache, at its path in `Attention.init_state`'s dict.

    Rows per request: `rows` (fixed: the window ring, a compressor's open window) plus, when
    `tokens_per_row` > 0, one per `tokens_per_row` tokens (compressed entries). `rounding` says how a partial
    group counts: "ceil" (the paged cache: an entry's slot exists from the group's first token, as
    `PageGroup` counts) or "floor" (the dense cache of `init_cache(max_len)`: complete entries only).
    """

    path: str
    row_bytes: int
    rows: int = 0
    tokens_per_row: int = 0

    def num_rows(self, num_tokens: int, rounding: str = "ceil") -> int:
        if self.tokens_per_row == 0:
            return self.rows
        if rounding == "ceil":
            return self.rows + -(-num_tokens // self.tokens_per_row)
        if rounding == "floor":
            return self.rows + num_tokens // self.tokens_per_row
        raise ValueError(f"rounding={rounding!r} must be 'ceil' or 'floor'")

    def bytes(self, num_tokens: int, rounding: str = "ceil") -> int:
        return self.num_rows(num_tokens, rounding) * self.row_bytes


@dataclass(frozen=True)
class LayerLayout:
    """A layer's per-request arrays, and the per-layer bytes shared by all requests (FP8 scale states)."""

    layer_type: str
    arrays: tuple[CachedArray, ...]
    shared_bytes: int = 0

    def bytes_per_request(self, num_tokens: int, rounding: str = "ceil") -> int:
        return sum(a.bytes(num_tokens, rounding) for a in self.arrays)

    def breakdown(self, num_tokens: int, rounding: str = "ceil") -> dict[str, int]:
        """Bytes per request by array path."""
        return {a.path: a.bytes(num_tokens, rounding) for a in self.arrays}

    @property
    def growth_bytes_per_token(self) -> float:
        """Bytes each further token adds once the ring is full (compressed entries only)."""
        return sum(a.row_bytes / a.tokens_per_row for a in self.arrays if a.tokens_per_row)


def layer_layout(config: V4ConfigLike, layer_type: str, kv_format: KVFormat, index_format: KVFormat | None = None,
                 *, state_dtype: str = "bfloat16") -> LayerLayout:  # fmt: skip
    """The arrays `Attention.init_state` allocates for one layer, with `kv_format` for the K=V rows and the
    compressed entries, `index_format` (default: `kv_format`) for the indexer keys, and `state_dtype` (the
    model's compute dtype) for the compressor's raw open-window projections."""
    index_format = kv_format if index_format is None else index_format
    d, w = config.head_dim, config.sliding_window
    item = ITEMSIZE[state_dtype]
    arrays = [CachedArray("window", kv_format.row_bytes(d), rows=w), CachedArray("window_pos", 4, rows=w)]
    shared = kv_format.state_bytes(d)

    def compressor(prefix: str, fmt: KVFormat, rate: int, head_dim: int, overlap: bool) -> None:
        nonlocal shared
        width = 2 * head_dim if overlap else head_dim
        arrays.append(CachedArray(f"{prefix}.entries", fmt.row_bytes(head_dim), tokens_per_row=rate))
        # The open window: raw kv / gate projections of up to `rate` tokens, in the compute dtype.
        arrays.append(CachedArray(f"{prefix}.open_kv", width * item, rows=rate))
        arrays.append(CachedArray(f"{prefix}.open_gate", width * item, rows=rate))
        if overlap:  # CSA: the last closed window's Ca half and its gate (bias added, float32)
            arrays.append(CachedArray(f"{prefix}.prev_kv", head_dim * item, rows=rate))
            arrays.append(CachedArray(f"{prefix}.prev_gate", head_dim * 4, rows=rate))
        shared += fmt.state_bytes(head_dim)

    if layer_type == HCA:
        compressor("compressor", kv_format, config.compress_rate(HCA), d, overlap=False)
    elif layer_type == CSA:
        rate = config.compress_rate(CSA)
        compressor("compressor", kv_format, rate, d, overlap=True)
        compressor("indexer", index_format, rate, config.index_head_dim, overlap=True)
    elif layer_type != SLIDING:
        raise ValueError(f"layer type {layer_type!r} is none of {(SLIDING, CSA, HCA)}")
    return LayerLayout(layer_type, tuple(arrays), shared)


@dataclass(frozen=True)
class CacheLayout:
    """Every layer's cache layout for one model config and storage format.

    `bytes_per_request(N)`: one request of N tokens, all layers (plus its 4-byte token count).
    `dense_cache_bytes(batch, max_len)`: what `DeepseekV4.init_cache(batch, max_len)` allocates in total
    (floor rounding: the dense cache has `max_len // rate` entry slots), scale states included.
    """

    layers: tuple[LayerLayout, ...]
    kv_format: KVFormat
    index_format: KVFormat

    @classmethod
    def from_config(cls, config: V4ConfigLike, kv_format: KVFormat, index_format: KVFormat | None = None, *,
                    state_dtype: str = "bfloat16") -> CacheLayout:  # fmt: skip
        index_format = kv_format if index_format is None else index_format
        layers = tuple(layer_layout(config, t, kv_format, index_format, state_dtype=state_dtype)
                       for t in config.layer_types)  # fmt: skip
        return cls(layers, kv_format, index_format)

    def bytes_per_request(self, num_tokens: int, rounding: str = "ceil") -> int:
        return 4 + sum(layer.bytes_per_request(num_tokens, rounding) for layer in self.layers)

    def bytes_per_token(self, num_tokens: int) -> float:
        """Amortized: a request's bytes at `num_tokens` tokens divided by `num_tokens`."""
        return self.bytes_per_request(num_tokens) / num_tokens

    @property
    def shared_bytes(self) -> int:
        return sum(layer.shared_bytes for layer in self.layers)

    def dense_cache_bytes(self, batch: int, max_len: int) -> int:
        return batch * self.bytes_per_request(max_len, rounding="floor") + self.shared_bytes

    def by_layer_type(self, num_tokens: int) -> dict[str, dict[str, float]]:
        """Per layer type: number of layers, bytes per request of one such layer, of all of them, and one
        layer's amortized bytes per token (per-request bytes / num_tokens)."""
        out: dict[str, dict[str, float]] = {}
        for layer in self.layers:
            entry = out.setdefault(layer.layer_type, {"layers": 0, "per_layer": 0, "total": 0})
            entry["layers"] += 1
            entry["per_layer"] = layer.bytes_per_request(num_tokens)  # identical for every layer of a type
            entry["total"] += layer.bytes_per_request(num_tokens)
        for entry in out.values():
            entry["per_layer_per_token"] = entry["per_layer"] / num_tokens
        return out

    def page_entry_bytes(self) -> dict[str, int]:
        """Bytes one entry of each `PageSpec.deepseek_v4` page group holds over all layers that keep it
        ("sliding_window": a ring slot of every layer; "compressed_R": the entries of rate R, with CSA's
        indexer key in the same slot), so `entries_per_page` can be picked for equal page sizes."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for a in layer.arrays:
                if a.path == "window":  # NOTE: window_pos is not paged: a slot's position follows from the length
                    out["sliding_window"] = out.get("sliding_window", 0) + a.row_bytes
                elif a.tokens_per_row:
                    key = f"compressed_{a.tokens_per_row}"
                    out[key] = out.get(key, 0) + a.row_bytes
        return out


__all__ = ["CSA", "DEFAULT_FP8_FORMAT", "FORMAT_NAMES", "FP8_E4M3_MAX", "HCA", "SLIDING", "CacheLayout", "CachedArray",
           "KVFormat", "LayerLayout", "layer_layout"]  # fmt: skip
