"""e4m3 key tiles as transposed f16 wgmma A operands, built in registers (Mosaic GPU, Hopper).

The decode kernel's FP8 pages hold V as [64 keys, channels] rows, channels contiguous. P·V needs V with its keys
contiguous (the wgmma B operand of an FP8 or f16 product must be K-major, and TMA cannot transpose), and Pallas in
jax 0.11.2 cannot store an 8-bit array through a transposed SMEM view on Hopper (docs/KERNEL_NOTES.md, decode next
step 2). So this module computes the product transposed, Oᵀ [channels, heads] = Vᵀ · Pᵀ, with Vᵀ as the A operand
*in registers*: a register fragment can be assembled from any loads, so the transpose costs no SMEM pass.

One consumer warpgroup owns 256 channels (half of D = 512). Its Oᵀ has 256 rows as four 64-row wgmma groups;
group `mg` row `r` is channel 4r + mg. So one 32-bit SMEM load (4 channels of one key) feeds the same row of all
four groups: a thread loads the words of its 2 × 8 (row, key pair) cells, two keys at a time, and a byte permute
(`prmt`) takes byte mg of each pair into group mg's register (2 keys of one channel). e4m3 → f16 is exact
(Mosaic's conversion), and the pool's per-channel scale is multiplied in f16 on the way, as the SMEM conversion did.

Register layout (PTX "wgmma 64N16 A", Mosaic's WGMMA layout, f16 pairs): in warpgroup warp `wi`, lane `l`,
register (kb, h) holds row 16·wi + 8·h + l // 4 at columns (keys) 8·kb + 2·(l % 4) + {0, 1}.

SMEM layout of a half-slot (what TMA writes): [nc, 64 keys, cw] e4m3 with tiling (8, 64) and the 64-byte swizzle:
the byte at (key k, column c) of chunk j is at j·64·cw + ((k // 8)·(cw / 64) + c // 64)·512 + (k % 8)·64 + s,
s = (c % 64) XOR (((k % 8) // 2) · 16) (Mosaic's swizzle: the 16-byte unit index XOR bits 7–8 of the offset).

`vt_word_offset` is written once over int-like operands, so the CPU tests run the same formula on numpy that the
kernel emits as MLIR.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["GROUPS", "vt_word_offset", "vt_fragments", "vt_fragments_reference", "channel_of_row"]

GROUPS = 4  # 64-row wgmma groups of one warpgroup's Oᵀ (256 channels)
KEYS = 64  # keys (rows) of a tile: the A operand's K
_SWIZZLE = 64  # bytes: the e4m3 ring's swizzle (one 64-channel tile row)


def channel_of_row(m):
    """Oᵀ row m (0 .. 255) of a warpgroup → its channel within the warpgroup's 256."""
    return 4 * (m % 64) + m // 64


def vt_word_offset(wi, lane, h, kb, t, *, cw: int):
    """Byte offset in a [nc, 64, cw] e4m3 half-slot (module docstring) of the 32-bit word holding channels
    4r .. 4r + 3 (r = 16·wi + 8·h + lane // 4) of key 8·kb + 2·(lane % 4) + t. wi, lane: ints, numpy arrays or
    `_V` values; h, kb, t: ints."""
    r = wi * 16 + (lane // 4 + h * 8)
    col = r * 4
    j, cc = col // cw, col % cw
    q = lane % 4
    r8 = q * 2 + t
    return j * (KEYS * cw) + (cc // 64 + kb * (cw // 64)) * 512 + r8 * 64 + ((cc % 64) ^ (q * 16))


def vt_fragments_reference(half, scales):
    """numpy twin of `vt_fragments` on the *logical* half tile: half [64 keys, 256] float, scales [256] →
    [GROUPS, 64 rows, 64 keys]: group mg, row r, key k = half[k, 4r + mg] · scales[4r + mg]."""
    ch = np.array([[channel_of_row(64 * mg + r) for r in range(64)] for mg in range(GROUPS)])
    v = np.asarray(half, np.float32) * np.asarray(scales, np.float32)[None, :]
    return np.transpose(v[:, ch], (1, 2, 0))


class _V:
    """An i32 MLIR value with the integer operators `vt_word_offset` uses (constants as Python ints)."""

    def __init__(self, v):
        self.v = v

    @staticmethod
    def _c(x):
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir

        return x.v if isinstance(x, _V) else utils.c(int(x), ir.IntegerType.get_signless(32))

    def _op(self, other, name, swap=False):
        from jaxlib.mlir.dialects import arith

        a, b = self.v, self._c(other)
        return _V(getattr(arith, name)(*((b, a) if swap else (a, b))))

    def __add__(self, o):
        return self._op(o, "addi")

    __radd__ = __add__

    def __mul__(self, o):
        return self._op(o, "muli")

    __rmul__ = __mul__

    def __floordiv__(self, o):
        return self._op(o, "divui")

    def __mod__(self, o):
        return self._op(o, "remui")

    def __xor__(self, o):
        return self._op(o, "xori")


def vt_fragments(half_ref, scales_ref, *, cw: int, groups=tuple(range(GROUPS))):
    """In a consumer warpgroup: half_ref an e4m3 [nc, 64, cw] SMEM half-slot (tiling (8, 64), 64-byte swizzle),
    scales_ref its f16 [256] channel scales → GROUPS f16 [64, 64] arrays in the WGMMA layout, group mg holding
    (row r, key k) = half[k, 4r + mg] · scales[4r + mg] (module docstring). The loads are plain `ld.shared`: the
    caller orders them after the tile's TMA (its barrier wait) and before any refill (it releases the slot after).
    groups: build only these groups (→ that many arrays): fewer live registers, the same words loaded again."""
    groups = tuple(groups)
    sds = plgpu.ShapeDtypeStruct((64, KEYS), jnp.float16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=(plgpu.TilingTransform((8, 64)),
                                                             plgpu.SwizzleTransform(_SWIZZLE))),
                                  plgpu.RefType()),
                       return_type=tuple([sds] * len(groups)))  # fmt: skip
    def build(ctx, half, scales):
        del ctx
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, vector

        i8, i16, i32 = (ir.IntegerType.get_signless(n) for n in (8, 16, 32))
        f16 = ir.F16Type.get()
        v2f8 = ir.VectorType.get((2,), ir.Float8E4M3FNType.get())
        v2f16, v4f16 = ir.VectorType.get((2,), f16), ir.VectorType.get((4,), f16)
        tid = arith.remui(utils.thread_idx(), utils.c(128, i32))
        wi, lane = _V(arith.divui(tid, utils.c(32, i32))), _V(arith.remui(tid, utils.c(32, i32)))
        base, sbase = utils.memref_ptr(half), utils.memref_ptr(scales)
        layout = fa.WGMMA_LAYOUT
        reg_shape = layout.registers_shape((64, KEYS))  # (1, kb, 1, 1, h, 1, 1, 1, 1)
        regs8 = [np.empty(reg_shape, dtype=object) for _ in range(GROUPS)]
        scale = {}
        for h in range(2):
            r = wi * 16 + (lane // 4 + h * 8)
            sc4 = llvm.load(v4f16, utils.getelementptr(sbase, [(r * 4).v], f16))  # channels 4r .. 4r + 3
            for mg in groups:
                scale[mg, h] = vector.broadcast(v2f16, vector.extract(sc4, dynamic_position=[],
                                                                      static_position=[mg]))  # fmt: skip
            for kb in range(KEYS // 8):
                w0, w1 = (llvm.load(i32, utils.getelementptr(base, [vt_word_offset(wi, lane, h, kb, t, cw=cw).v], i8))
                          for t in range(2))  # fmt: skip
                for mg in groups:
                    pair = utils.prmt(w0, w1, utils.c(mg | ((4 + mg) << 4), i32))  # byte mg of w0, then of w1
                    regs8[mg][0, kb, 0, 0, h, 0, 0, 0, 0] = utils.bitcast(arith.trunci(i16, pair), v2f8)
        out = []
        for mg in groups:
            x16 = mgpu.FragmentedArray(_registers=regs8[mg], _layout=layout, _is_signed=None).astype(f16)
            regs16 = x16.registers.copy()
            for idx in np.ndindex(reg_shape):
                regs16[idx] = arith.mulf(regs16[idx], scale[mg, idx[4]])
            out.append(mgpu.FragmentedArray(_registers=regs16, _layout=layout, _is_signed=None))
        return tuple(out)

    return build(half_ref, scales_ref)
