"""Block-scaled FP8 and FP4 weights: the formats DeepSeek-V4 checkpoints ship, and a pytree that keeps them.

Formats (what `dsv4/weights.py` reads; docs/CHECKPOINTS.md has the sources):

- FP8: `float8_e4m3fn` values `q [..., out, in]` and one scale per `block = (rows, cols)` tile
  (`weight_block_size`, [128, 128] in the releases): `scale [..., ceil(out/rows), ceil(in/cols)]`, and
  `w = q * scale` (the scale is the dequantization multiplier: DeepSeek calls it `<name>.scale`,
  transformers `weight_scale_inv`). `scale_fmt: "ue8m0"` means every scale is a power of two, stored as
  `float8_e8m0fnu` (or float32 holding powers of two).
- FP4 (routed experts when `expert_dtype == "fp4"`): e2m1 values packed two per byte, the even column in
  the low nibble: `packed [..., out, in/2]` as int8/uint8, and one scale per row and 32 columns:
  `scale [..., out, ceil(in/32)]` (MXFP4 grouping), `w = e2m1(packed) * scale`.

`BlockQuantized` holds `q` and `scale` as a JAX pytree; stored as an `nnx.Param`'s value, `param[...]`
dequantizes on the fly, so a model loaded with `keep_quantized=True` runs unchanged (and holds 1 or 0.5
bytes per weight) until a kernel reads `q`/`scale` directly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
FP4_GROUP = 32  # FP4 scales: one per row and 32 input columns
# e2m1 code → value; bit 3 is the sign (the same order as ml_dtypes.float4_e2m1fn and torch's float4_e2m1fn_x2).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)  # fmt: skip
# Every float8_e4m3fn bit pattern → float32 (NaN for 0x7F / 0xFF): a table lookup beats a per-element cast.
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_CHUNK_ELEMENTS = 1 << 24  # host dequantization works through 16M-element slices (64 MiB of float32)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale grid of an FP8 weight [..., out, in] with `block` = (rows, cols) tiles."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def fp4_scale_shape(shape: tuple[int, ...], group: int = FP4_GROUP) -> tuple[int, ...]:
    """Scale grid of an FP4 weight of logical shape [..., out, in]: one per row and `group` columns."""
    *lead, rows, cols = shape
    return (*lead, rows, math.ceil(cols / group))


def scale_to_float32(scale: np.ndarray) -> np.ndarray:
    """Stored scales (float32/bfloat16/float16, float8_e8m0fnu, or uint8 e8m0 exponent bytes) → float32."""
    if scale.dtype == np.uint8:  # raw e8m0 exponents: 2 ** (byte - 127)
        return scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return scale.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Host (numpy) decoding, used by the loader: writes straight into an array of the compute dtype.
# ---------------------------------------------------------------------------------------------
def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """int8/uint8 [..., n] (two e2m1 codes per byte, low nibble first) → float32 [..., 2n]."""
    codes = packed.view(np.uint8)
    out = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.float32)
    out[..., 0::2] = E2M1_VALUES[codes & 0xF]
    out[..., 1::2] = E2M1_VALUES[codes >> 4]
    return out


def _expand(scale: np.ndarray, rows: tuple[int, int], row_block: int, col_block: int, cols: int) -> np.ndarray:
    """The per-element scale for rows [r0, r1) of a [.., R, cols] weight: [.., r1 - r0, cols]."""
    r0, r1 = rows
    s = scale[..., r0 // row_block : (r1 - 1) // row_block + 1, :]
    s = np.repeat(s, row_block, axis=-2)[..., r0 % row_block : r0 % row_block + (r1 - r0), :]
    return np.repeat(s, col_block, axis=-1)[..., :cols]


def dequantize_np(q: np.ndarray, scale: np.ndarray, fmt: str, block: tuple[int, int], dtype) -> np.ndarray:
    """One stored weight → its values in `dtype` ([..., out, in]; FP4 input is packed [..., out, in/2]).

    Works through row slices so the float32 intermediates stay small next to the output.
    """
    scale = scale_to_float32(scale)
    if fmt == "fp8":
        rows, cols = q.shape[-2:]
        row_block, col_block = block
    else:
        rows, cols = q.shape[-2], 2 * q.shape[-1]
        row_block, col_block = 1, block[1]
    lead = q.shape[:-2]
    out = np.empty((*lead, rows, cols), dtype)
    q3 = q.reshape(-1, *q.shape[-2:])
    s3 = scale.reshape(-1, *scale.shape[-2:])
    o3 = out.reshape(-1, rows, cols)
    step = max(row_block, (_CHUNK_ELEMENTS // max(cols, 1)) // row_block * row_block)
    for i in range(q3.shape[0]):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            if fmt == "fp8":
                values = E4M3_VALUES[q3[i, r0:r1].view(np.uint8)]
            else:
                values = unpack_fp4(q3[i, r0:r1])
            values *= _expand(s3[i], (r0, r1), row_block, col_block, cols)
            o3[i, r0:r1] = values.astype(dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Quantizing (tests, writing quantized checkpoints): round to nearest, ue8m0 scales rounded up.
# ---------------------------------------------------------------------------------------------
def _block_scales(amax: np.ndarray, top: float, scale_fmt: str | None) -> np.ndarray:
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    if scale_fmt == "ue8m0":  # a power of two at least amax / top, so nothing clips
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    return scale


def quantize_fp8(w: np.ndarray, block: tuple[int, int],
                 scale_fmt: str | None = "ue8m0") -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """w [..., out, in] → (q float8_e4m3fn [..., out, in], scale float32 [..., ceil(out/b0), ceil(in/b1)])."""
    w = np.asarray(w, np.float32)
    *lead, rows, cols = w.shape
    b0, b1 = block
    pr, pc = -rows % b0, -cols % b1
    padded = np.pad(w, [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
    tiles = padded.reshape(*lead, (rows + pr) // b0, b0, (cols + pc) // b1, b1)
    scale = _block_scales(np.abs(tiles).max(axis=(-3, -1)), FP8_MAX, scale_fmt)
    scaled = tiles / scale[..., :, None, :, None]
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).reshape(padded.shape)[..., :rows, :cols].astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def quantize_fp4(w: np.ndarray, group: int = FP4_GROUP,
                 scale_fmt: str | None = "ue8m0") -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """w [..., out, in] (in even) → (packed int8 [..., out, in/2], scale float32 [..., out, ceil(in/group)])."""
    w = np.asarray(w, np.float32)
    *lead, rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dim ({cols}) must be even")
    pc = -cols % group
    groups = np.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, pc)]).reshape(*lead, rows, (cols + pc) // group, group)
    scale = _block_scales(np.abs(groups).max(axis=-1), FP4_MAX, scale_fmt)
    scaled = np.clip(groups / scale[..., None], -FP4_MAX, FP4_MAX).reshape(*lead, rows, cols + pc)[..., :cols]
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale


# ---------------------------------------------------------------------------------------------
# Device side: a quantized weight as a pytree.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockQuantized:
    """A block-scaled weight kept quantized on the device.

    q: FP8 `float8_e4m3fn [..., out, in]`, or FP4 packed `uint8 [..., out, in/2]`;
    scale: float32, `[..., ceil(out/block[0]), ceil(in/block[1])]` (FP8) or `[..., out, ceil(in/32)]` (FP4).
    `shape`/`dtype` are the logical (dequantized) ones; `x[...]` dequantizes (so `nnx.Param(x)[...]` works).
    """

    q: jax.Array
    scale: jax.Array
    fmt: str  # "fp8" | "fp4"
    block: tuple[int, int]  # FP4: (1, 32)
    shape: tuple[int, ...]
    dtype_name: str

    @property
    def dtype(self) -> np.dtype:
        return jnp.dtype(self.dtype_name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self) -> jax.Array:
        if self.fmt == "fp8":
            values = self.q.astype(jnp.float32)
        else:
            codes = self.q.view(jnp.uint8) if self.q.dtype != jnp.uint8 else self.q
            table = jnp.asarray(E2M1_VALUES)
            values = jnp.stack([table[codes & 0xF], table[codes >> 4]], axis=-1).reshape(self.shape)
        rows, cols = self.shape[-2:]
        s = jnp.repeat(self.scale, self.block[0], axis=-2)[..., :rows, :]
        s = jnp.repeat(s, self.block[1], axis=-1)[..., :cols]
        return (values * s).astype(self.dtype)

    def __getitem__(self, index) -> jax.Array:
        full = self.dequantize()
        return full if index is Ellipsis else full[index]


jax.tree_util.register_dataclass(
    BlockQuantized, data_fields=["q", "scale"], meta_fields=["fmt", "block", "shape", "dtype_name"]
)


# ---------------------------------------------------------------------------------------------
# FP4 → FP8 blocks on the device: FP4 experts on the W8A8 kernels.
# ---------------------------------------------------------------------------------------------
FP8_BLOCK = (128, 128)
# Block scale = the block's largest group scale / 64, so a group's values land in e4m3 at up to 6 · 64 = 384 < 448.
_FP4_IN_FP8_HEADROOM = 64.0


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """e2m1 codes (uint8, 0..15; bit 3 the sign) → float32, by assembling the float32's bits (integer ops only, no
    gather or exp2): exponent field e = 0 is the subnormal 0 / 0.5, else (1 + m / 2) · 2^(e − 1), whose float32
    exponent field is e + 126 and whose mantissa's top bit is m."""
    codes = codes.astype(jnp.uint32)
    e, m = (codes >> 1) & 3, codes & 1
    bits = jnp.where(e == 0, m * jnp.uint32(0x3F000000), ((e + 126) << 23) | (m << 22)) | ((codes & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def fp4_fits_fp8_blocks(w) -> bool:
    """An FP4 `BlockQuantized` weight whose rows and columns tile into `FP8_BLOCK`s (V4's expert widths do)."""
    return (isinstance(w, BlockQuantized) and w.fmt == "fp4" and w.ndim >= 2
            and w.shape[-2] % FP8_BLOCK[0] == 0 and w.shape[-1] % FP8_BLOCK[1] == 0)  # fmt: skip


def fp4_to_fp8_blocks(w: BlockQuantized) -> BlockQuantized:
    """An FP4 weight (per-row, 32-column scales) as FP8 e4m3 in 128 × 128 blocks, for the FP8 (W8A8) kernels.

    Each block's scale is its largest group scale / 64; each value becomes e2m1 · (group scale / block scale) in
    e4m3. With power-of-two scales (ue8m0, as V4 ships) that is exact wherever a group's scale is at least 2^-14 of
    its block's largest (e4m3 holds e2m1 · 2^k for k in [−8, 6]); a smaller group rounds to e4m3's subnormal steps,
    an absolute error of at most 2^-16 of the block's largest group scale. Other scales round each value to e4m3 (3
    mantissa bits: a relative error ≤ 2^-4). Runs on the device (jittable), in one pass over the weight.
    """
    if not fp4_fits_fp8_blocks(w):
        raise ValueError(f"fp4_to_fp8_blocks: needs an FP4 BlockQuantized weight whose [out, in] tiles into "
                         f"{FP8_BLOCK}; got {w.fmt if isinstance(w, BlockQuantized) else type(w).__name__} "
                         f"{getattr(w, 'shape', None)}")  # fmt: skip
    *lead, rows, cols = w.shape
    b0, b1 = FP8_BLOCK
    per_block = b1 // FP4_GROUP
    groups = w.scale.astype(jnp.float32).reshape(*lead, rows // b0, b0, cols // b1, per_block)
    top = groups.max(axis=(-3, -1))
    block_scale = jnp.where(top > 0, top / _FP4_IN_FP8_HEADROOM, 1.0)
    ratio = (groups / block_scale[..., :, None, :, None]).reshape(*lead, rows, cols // FP4_GROUP, 1)
    # Work on the packed bytes ([.., group, 16]): each byte's two e2m1 codes become two e4m3 bytes, joined into
    # one uint16 (low code in the low byte: the even column first in memory) and bitcast back to bytes, so the
    # whole conversion is one elementwise pass with no float32 copy of the weight.
    codes = (w.q.view(jnp.uint8) if w.q.dtype != jnp.uint8 else w.q).reshape(*lead, rows, cols // FP4_GROUP, -1)

    def e4m3_bits(c):
        return (e2m1_decode(c) * ratio).astype(jnp.float8_e4m3fn).view(jnp.uint8).astype(jnp.uint16)

    pairs = e4m3_bits(codes & 0xF) | (e4m3_bits(codes >> 4) << 8)
    q = jax.lax.bitcast_convert_type(pairs, jnp.uint8).reshape(w.shape).view(jnp.float8_e4m3fn)
    return BlockQuantized(q, block_scale, "fp8", FP8_BLOCK, tuple(w.shape), w.dtype_name)


def _fp4_expert_vars(model):
    """The variables of `model` holding FP4 weights that tile into `FP8_BLOCK`s (the routed experts)."""
    from flax import nnx

    return [var for _, var in nnx.iter_graph(model)
            if isinstance(var, nnx.Variable) and fp4_fits_fp8_blocks(var.get_value())]  # fmt: skip


def fp4_reblock_extra_bytes(model, device) -> tuple[int, int]:
    """What `reblock_fp4_experts(model)` would do: → (how many weights it would convert, the bytes it would add on
    `device`: its shards of them once more, an e4m3 byte a weight where FP4 packs two; the block scales are smaller
    than the group scales they replace)."""
    found = _fp4_expert_vars(model)
    extra = 0
    for var in found:
        q = var.get_value().q
        shards = getattr(q, "addressable_shards", None)
        extra += sum(s.data.nbytes for s in shards if s.device == device) if shards else q.nbytes
    return len(found), extra


def reblock_fp4_experts(model) -> int:
    """Re-blocks every FP4 expert weight of `model` (that tiles into `FP8_BLOCK`s) as FP8, once and in place, on the
    devices where it lives: the W8A8 kernels then read it as stored, with no pass in each step (a decode step's
    would read every expert of every layer), for twice the FP4 bytes (1 B a weight + block scales, as FP8 weights).
    → the number of weights converted. Layer by layer, so the transient is one weight's FP8 copy."""
    convert = jax.jit(fp4_to_fp8_blocks)
    found = _fp4_expert_vars(model)
    for var in found:
        var.set_value(convert(var.get_value()))
    return len(found)
