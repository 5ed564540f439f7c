"""`dsv4.pallas.mgpu_fp8`: the Vᵀ register fragments' addressing, on CPU.

The fragment builder emits MLIR (it runs only on a GPU: `scripts/probe_fp8_pv.py` and the decode kernel's GPU tests
check it there). Here the same offset formula (`vt_word_offset`, shared with the kernel) is run on numpy against an
independently built SMEM image: the tile tiled (8, 64) and then swizzled by XOR-ing each address's 16-byte unit
index with its bits 7–8 (Mosaic's 64-byte swizzle), every thread's words read from it, the byte pairs picked as the
kernel's `prmt` selectors pick them, and each register placed by the PTX wgmma A layout. The result must equal
`vt_fragments_reference` on the logical tile.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4.pallas.mgpu_fp8 import GROUPS, channel_of_row, vt_fragments_reference, vt_word_offset


def smem_image(tile, cw):
    """tile [64 keys, 256] uint8 → the bytes TMA writes for its nc = 256 / cw chunks of [64, cw], tiling (8, 64)
    and the 64-byte swizzle."""
    nc = 256 // cw
    img = np.zeros(64 * 256, np.uint8)
    for j in range(nc):
        chunk = tile[:, j * cw:(j + 1) * cw]
        tiled = chunk.reshape(8, 8, cw // 64, 64).transpose(0, 2, 1, 3).reshape(-1)  # (row tile, col tile, 8, 64)
        offs = np.arange(tiled.size)
        swz = offs ^ (((offs >> 7) & 3) << 4)
        img[j * 64 * cw + swz] = tiled
    return img


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on uint32: byte i of the result is byte sel[4i:4i+4] of {b, a}."""
    both = (np.uint64(b) << np.uint64(32)) | np.uint64(a)
    out = 0
    for i in range(4):
        k = (sel >> (4 * i)) & 0x7
        out |= ((int(both) >> (8 * k)) & 0xFF) << (8 * i)
    return out


@pytest.mark.parametrize("cw", [64, 128, 256])
def test_fragments_read_the_transposed_tile(cw):
    rng = np.random.default_rng(cw)
    tile = rng.integers(0, 256, (64, 256), dtype=np.uint8)
    img = smem_image(tile, cw)
    got = np.full((GROUPS, 64, 64), -1, np.int64)  # [group, row, key] of the byte each register slot holds
    for wi in range(4):
        for lane in range(32):
            for h in range(2):
                row = 16 * wi + 8 * h + lane // 4
                for kb in range(8):
                    w0, w1 = (int(img[o:o + 4].view(np.uint32)[0])
                              for o in (vt_word_offset(wi, lane, h, kb, t, cw=cw) for t in range(2)))  # fmt: skip
                    for mg in range(GROUPS):
                        pair = prmt(w0, w1, mg | ((4 + mg) << 4)) & 0xFFFF
                        key = 8 * kb + 2 * (lane % 4)  # the PTX layout: columns 8·kb + 2·(lane % 4) + {0, 1}
                        got[mg, row, key], got[mg, row, key + 1] = pair & 0xFF, pair >> 8
    want = vt_fragments_reference(tile.astype(np.float32), np.ones(256))
    np.testing.assert_array_equal(got, want.astype(np.int64))


def test_rows_cover_every_channel_once():
    assert sorted(channel_of_row(m) for m in range(256)) == list(range(256))
