"""Every Triton kernel masks the loads and stores of a block that overhangs its array (tests/triton_masks.py says
how this is read off the lowered module). The lowering masks nothing by itself, the interpreter drops
out-of-bounds writes, and on the GPU an unmasked overhanging store writes into whatever follows the array
(the Sinkhorn kernel's last block once overwrote the next rows). Each kernel is lowered for an abstract
H200 at shapes that its blocks do not divide, with tiles chosen so that blocks overhang where the kernel allows it;
kernels whose wrappers pad to whole blocks are checked to have no overhanging block at all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from triton_masks import unmasked_overhangs

from dsv4.pallas import attention, decode, indexer, indexer_paged, kv_write, moe, select, sinkhorn

sds = jax.ShapeDtypeStruct
FP8, BF16, F32, I32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32


def _toy(masked: bool):
    """x [300] → 2x in blocks of 256: the second block overhangs by 212 elements."""

    def kernel(x_ref, o_ref):
        if masked:
            valid = pl.program_id(0) * 256 + jnp.arange(256) < 300
            plgpu.store(o_ref, plgpu.load(x_ref, mask=valid, other=0.0) * 2, mask=valid)
        else:
            o_ref[...] = x_ref[...] * 2

    spec = pl.BlockSpec((256,), lambda i: (i,))
    return pl.pallas_call(kernel, out_shape=sds((300,), F32), grid=(2,), in_specs=[spec], out_specs=spec, name="toy")


def test_the_check_finds_an_unmasked_overhanging_block():
    """A store to a ref lowers to a swap: it loads the old value too, so the output is loaded and stored."""
    problems, checked, overhanging = unmasked_overhangs(_toy(masked=False), sds((300,), F32))
    assert overhanging == 2 and checked == 3  # x and the output; x loaded, the output loaded and stored
    assert sorted(line.split(" of ")[0] for line in problems) == ["toy: unmasked tt.load"] * 2 + [
        "toy: unmasked tt.store"]  # fmt: skip
    assert all("overhangs: [(0, 300, 256)]" in line for line in problems)
    assert any("tt.load of operand 0" in line for line in problems)
    assert any("tt.store of operand 1" in line for line in problems)
    assert unmasked_overhangs(_toy(masked=True), sds((300,), F32)) == ([], 3, 2)


def _attention(mode):
    b, s, h, d, t, c = 1, 301, 64, 512, 429, 107  # no length a block multiple
    kv_dtype = FP8 if "fp8" in mode else BF16
    args = dict(q=sds((b, s, h, d), BF16), kv=sds((b, t, d), kv_dtype), q_pos=sds((b, s), I32),
                kv_pos=sds((b, t), I32), sinks=sds((h,), F32))  # fmt: skip
    static = dict(
        sliding_window=128,
        scale=d**-0.5,
        block_sizes=attention.BlockSizes(block_q=2, block_h=32, block_kv=32, block_compressed=32, block_topk=32),
    )  # 2 tokens a program: the last block overhangs
    if mode.startswith("hca"):
        args["compressed"], static["compress_rate"] = sds((b, c, d), kv_dtype), 4
    if mode.startswith("csa"):
        args["compressed"], args["topk_indices"] = sds((b, c, d), kv_dtype), sds((b, s, 48), I32)
    if "fp8" in mode:
        args["kv_scales"] = args["compressed_scales"] = sds((d,), F32)
    names = tuple(args)
    return (lambda *a: attention.v4_attention(**dict(zip(names, a)), **static)), args


def _indexer(entry):
    s, h, d, c = 301, 64, 128, 1001
    args = dict(q=sds((1, s, h, d), BF16), keys=sds((1, c, d), BF16), weights=sds((1, s, h), F32),
                positions=sds((1, s), I32))  # fmt: skip
    names = tuple(args)
    if entry == "index_topk":  # 2 tokens a program
        return (lambda *a: indexer.index_topk(**dict(zip(names, a)), rate=4, k=512, softmax_scale=0.1,
                                              block_sizes=indexer.BlockSizes(block_q=2))), args  # fmt: skip
    return (lambda *a: indexer.index_scores(**dict(zip(names, a)), rate=4, softmax_scale=0.1)), args


def _paged_indexer():
    b, h, d, rows, pages = 3, 64, 128, 64, 37  # 37 pages of 64 keys: the last 1024-key span overhangs
    args = dict(q=sds((b, 1, h, d), BF16), weights=sds((b, 1, h), F32), positions=sds((b, 1), I32),
                block_table=sds((b, pages), I32), key_pages=sds((b * pages, rows, d), BF16))  # fmt: skip
    names = tuple(args)
    return (lambda *a: indexer_paged.index_topk_paged(**dict(zip(names, a)), rate=4, k=512, softmax_scale=0.1,
                                                      selection="xla")), args  # fmt: skip


def _refine(bounded=False):
    blocks = select.SelectBlocks(block_rows=2)  # 301 rows in pairs
    args = dict(x=sds((1, 301, 10001), F32), groups=sds((1, 301, 512), I32))
    if not bounded:
        return (lambda x, g: select.refine_top_k(x, g, group=4, blocks=blocks)), args
    args["group_max"] = sds((1, 301, 512), F32)  # as the model's top-k calls it
    return (lambda x, g, m: select.refine_top_k(x, g, group=4, blocks=blocks, group_max=m)), args


def _sinkhorn():
    return (lambda c: sinkhorn.sinkhorn(c, 20, 1e-6)), dict(comb=sds((300, 1, 4, 4), F32))  # 256 + 44 tokens


def _decode(mode):
    b, h, d, pages, page_size = 5, 64, 512, 301, 64
    dtype = FP8 if "fp8" in mode else BF16
    args = dict(q=sds((b, h, d), BF16), kv_pages=sds((pages, page_size, d), dtype), block_tables=sds((b, 2), I32),
                seq_lens=sds((b,), I32), sinks=sds((h,), F32))  # fmt: skip
    if mode != "window":
        args.update(compressed_pages=sds((pages, page_size, d), dtype), compressed_block_tables=sds((b, 99), I32),
                    compressed_lens=sds((b,), I32))  # fmt: skip
    if mode == "csa-fp8":
        args.update(topk_indices=sds((b, 509), I32), kv_scales=sds((d,), F32), compressed_scales=sds((d,), F32))
    names = tuple(args)
    return (lambda *a: decode.paged_decode_attention(**dict(zip(names, a)), sliding_window=128, scale=d**-0.5)), args


def _moe(entry):
    experts, hidden, inter, rows = 16, 512, 256, 6003  # rows not a multiple of any block
    if entry == "gate_up":
        args = dict(x_sorted=sds((rows, hidden), BF16), gate_up=sds((experts, 2 * inter, hidden), BF16),
                    group_sizes=sds((experts,), I32))  # fmt: skip
        return (lambda x, w, g: moe.grouped_gate_up(x, w, g, limit=10.0)), args
    args = dict(h=sds((rows, inter), BF16), down=sds((experts, hidden, inter), BF16), group_sizes=sds((experts,), I32),
                row_weights=sds((rows,), F32))  # fmt: skip
    return (lambda x, w, g, r: moe.grouped_down(x, w, g, row_weights=r)), args


def _kv_write(scaling):
    b, n, pages, rows = 3, 301, 67, 64  # 301 rows a request: the last of 19 row blocks holds 13
    leaves = {"values": sds((pages, rows, 512), BF16)} if scaling == "none" else {
        "nope": sds((pages, rows, 448), FP8), "rope": sds((pages, rows, 64), BF16)}  # fmt: skip
    if scaling == "tile":
        leaves["scale"] = sds((pages, rows, 7), jnp.float8_e8m0fnu)
    args = dict(rows=sds((b, n, 512), BF16), index=sds((b, n), I32), block_table=sds((b, 22), I32), pages=leaves,
                scales=sds((448,), F32) if scaling == "channel" else None)  # fmt: skip
    names = tuple(args)
    return (lambda *a: kv_write.kv_write(**dict(zip(names, a)), scaling=scaling)), args


OVERHANGING = {  # kernels whose last block overhangs at these shapes: every load and store of it must be masked
    "attention-window": lambda: _attention("window"),
    "attention-hca": lambda: _attention("hca"),
    "attention-csa": lambda: _attention("csa"),
    "attention-hca-fp8": lambda: _attention("hca-fp8"),
    "index_topk": lambda: _indexer("index_topk"),
    "index_scores": lambda: _indexer("index_scores"),
    "index_scores_paged": _paged_indexer,
    "refine_top_k": _refine,
    "refine_top_k-bounded": lambda: _refine(bounded=True),
    "sinkhorn": _sinkhorn,
}
WHOLE_BLOCKS = {  # kernels whose wrappers give every operand whole blocks, whatever the lengths
    "decode-window": lambda: _decode("window"),
    "decode-hca": lambda: _decode("hca"),
    "decode-csa-fp8": lambda: _decode("csa-fp8"),
    "moe-gate_up": lambda: _moe("gate_up"),
    "moe-down": lambda: _moe("down"),
    # whole arrays: rows, pages and scales are reached by explicit, masked gathers and scatters only
    "kv_write-none": lambda: _kv_write("none"),
    "kv_write-channel": lambda: _kv_write("channel"),
    "kv_write-tile": lambda: _kv_write("tile"),
}


@pytest.mark.parametrize("case", sorted(OVERHANGING))
def test_overhanging_blocks_are_masked(case):
    fn, args = OVERHANGING[case]()
    problems, checked, overhanging = unmasked_overhangs(fn, *args.values())
    assert overhanging > 0 and checked > 0, "no overhanging block at these shapes: the case checks nothing"
    assert problems == []


@pytest.mark.parametrize("case", sorted(WHOLE_BLOCKS))
def test_no_block_overhangs(case):
    fn, args = WHOLE_BLOCKS[case]()
    assert unmasked_overhangs(fn, *args.values()) == ([], 0, 0)
