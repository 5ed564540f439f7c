"""dsv4.pallas.decode_mgpu: the Mosaic GPU (Hopper) paged decode kernel against `paged_decode_attention_reference`.

Caches come from tests/test_pallas_decode.py's `make_cache`: histories written token by token into rings, random
page ids, NaN in every slot nobody wrote (unused pages, ring slots, the null page, compressed entries past the
count). The kernel reads whole 64-row tiles, so it does load unwritten rows at a window's edges and in a request's
last compressed tile; any of them reaching P·V turns the output NaN.

CPU (not gpu-marked):
- the tile bounds (`decode_meta`) against values worked out by hand, wrap-around included;
- lowering for an abstract H200 at V4 shapes (window only and HCA);
- the Mosaic GPU interpreter ("interpret" P·V form) on ragged batches: lengths 0, 1, page ± 1, past the window,
  ring wrap-around with a ring larger than the window, more splits than tiles (empty splits); the same with e4m3
  pages and per-channel scales (the entries' 3x the ring's), against float32 math on the same e4m3 values;
- unsupported inputs are refused with the reason.
GPU-marked: V4 shapes (H = 64, D = 512, window 128, pages of 64) against the reference, after a NaN-filled run of
the same shapes (so output buffers the kernel fails to write are likely to hold NaN); bf16 and FP8 pages.

Tolerance: bfloat16 at 3e-2 absolute, as tests/test_pallas_decode.py (P is rounded to bf16 for P·V against
different maxima, and the output is bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh
from test_pallas_decode import make_cache, quantize

from dsv4.pallas.decode import paged_decode_attention, paged_decode_attention_reference
from dsv4.pallas.decode_mgpu import MgpuDecodeConfig, decode_meta, mgpu_decode_supported, paged_decode_attention_mgpu

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU (Mosaic GPU kernel)")
TOL = 3e-2


def test_decode_meta_by_hand():
    """(window visits, first unwrapped slot, window slots, entries) for W = 128, ring R = 192, 64-row tiles."""
    lens = jnp.asarray([0, 1, 64, 65, 128, 500, 700], jnp.int32)
    got = np.asarray(decode_meta(lens, sliding_window=128, ring_size=192,
                                 compressed_lens=jnp.asarray([0, 0, 0, 1, 1, 125, 900]), capacity=640))  # fmt: skip
    want = [
        [0, 0, 0, 0],  # empty slot
        [1, 0, 1, 0],  # token 0 in slot 0
        [1, 0, 64, 0],  # slots 0..63: one whole tile
        [2, 0, 65, 1],  # slots 0..64
        [2, 0, 128, 1],  # slots 0..127
        [3, 180, 128, 125],  # tokens 372..499 → slots 180..307 (unwrapped): tiles at 128, 192 (= ring 0), 256 (= 64)
        [3, 188, 128, 640],  # tokens 572..699 → slots 188..315: tiles 128, 192 (= ring 0), 256 (= 64); count capped
    ]
    np.testing.assert_array_equal(got, np.asarray(want, np.int32))


@pytest.mark.parametrize("hca, fp8, config", [
    (False, False, MgpuDecodeConfig()), (True, False, MgpuDecodeConfig()),
    (True, False, MgpuDecodeConfig(auto_barriers=True)), (False, True, MgpuDecodeConfig()),
    (True, True, MgpuDecodeConfig()), (True, False, MgpuDecodeConfig(pv_chunks=4)),
    (True, False, MgpuDecodeConfig(pv_chunks=1)), (True, True, MgpuDecodeConfig(pv_chunks=1, auto_barriers=True)),
    (True, True, MgpuDecodeConfig(pv_chunks=4)), (True, True, MgpuDecodeConfig(fp8_layout="wgmma")),
    (True, True, MgpuDecodeConfig(fp8_layout="upcast4x")), (True, True, MgpuDecodeConfig(registers=(224, 56))),
])  # fmt: skip
def test_lowers_for_h200(hca, fp8, config):
    """V4 shapes (D = 512: the shared-memory plan is at its limit, FP8 pages included)."""
    b, h, d, ps = 8, 64, 512, 64
    sds = jax.ShapeDtypeStruct
    pages = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    args = [sds((b, h, d), jnp.bfloat16), sds((400, ps, d), pages), sds((b, 2), jnp.int32),
            sds((b,), jnp.int32), sds((h,), jnp.float32)]  # fmt: skip
    kw = {}
    if hca:
        kw.update(compressed_pages=sds((900, ps, d), pages), compressed_block_tables=sds((b, 100), jnp.int32),
                  compressed_lens=sds((b,), jnp.int32))  # fmt: skip
    if fp8:
        kw.update(kv_scales=sds((d,), jnp.float32), **(dict(compressed_scales=sds((d,), jnp.float32)) if hca else {}))
    names = tuple(kw)
    args += list(kw.values())

    def f(q, kv, tables, lens, sinks, *rest):
        return paged_decode_attention_mgpu(q, kv, tables, lens, sinks, sliding_window=128, scale=0.04,
                                           config=config,
                                           **dict(zip(names, rest)))  # fmt: skip

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def fp8_channel_cache(inputs):
    """make_cache's float32 inputs with both page pools in e4m3 and their own per-channel scales (NaN slots stay
    NaN), q in bf16."""
    out = dict(inputs, q=inputs["q"].astype(jnp.bfloat16))
    out["kv_pages"], out["kv_scales"] = quantize(inputs["kv_pages"].astype(jnp.float32), "channel")
    if "compressed_pages" in inputs:
        pages = inputs["compressed_pages"].astype(jnp.float32) * 3.0  # a scale unlike the ring's
        out["compressed_pages"], out["compressed_scales"] = quantize(pages, "channel")
    return out


def _run_interpreted(seq_lens, *, ring_size=None, num_splits=2, rate=4, fp8=False, pv_chunks=1, head_dim=128):
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    inputs, _ = make_cache(0, seq_lens, heads=64, head_dim=head_dim, window=128, page_size=64, ring_size=ring_size,
                           rate=rate, compressed_page_size=64, dtype=jnp.float32 if fp8 else jnp.bfloat16)  # fmt: skip
    if fp8:
        inputs = fp8_channel_cache(inputs)
    kw = dict(sliding_window=128, scale=head_dim**-0.5, ring_size=ring_size)
    config = MgpuDecodeConfig(pv_form="interpret", num_splits=num_splits, pv_chunks=pv_chunks)
    got = np.asarray(paged_decode_attention_mgpu(**inputs, **kw, config=config, interpret=InterpretGPUParams()),
                     np.float32)  # fmt: skip
    if fp8:  # the kernel runs in f16: measure it against float32 math on the same e4m3 values
        inputs = dict(inputs, q=inputs["q"].astype(jnp.float32))
    want = np.asarray(paged_decode_attention_reference(**inputs, **kw), np.float32)
    assert not np.isnan(want).any()
    assert not np.isnan(got).any(), "the kernel let an unwritten (NaN) cache row into the output"
    if fp8:
        # The entries are 3x the ring (outputs up to ~9): tolerances relative to the output's size. At these inputs
        # the kernel is 1.8e-3 from float32 (relative L2), the bf16 reference 3.5e-3.
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-3
        np.testing.assert_allclose(got, want, atol=TOL * max(1.0, np.abs(want).max() / 3), rtol=0)
    else:
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("seq_lens, ring_size, num_splits", [
    ([0, 1, 65, 300], None, 5),  # empty slot, one token, page + 1, HCA; 5 splits > tiles: some splits are empty
    ([127, 700, 1000], 192, 1),  # ring 192 > window: the window wraps inside a visit and across the ring's end;
    #                              one split: 7 tiles in one CTA through the two-slot ring
])  # fmt: skip
def test_interpreter_matches_reference(seq_lens, ring_size, num_splits):
    _run_interpreted(seq_lens, ring_size=ring_size, num_splits=num_splits)


def test_interpreter_pv_chunks_match_reference():
    """P·V in two column chunks per consumer (D = 256: 64 channels each), each chunk of a slot refilled by its own
    TMA as soon as its wgmma is done: one split walks 7 tiles through the two-slot ring, so every chunk barrier
    turns over several phases."""
    _run_interpreted([127, 700, 1000], ring_size=192, num_splits=1, pv_chunks=2, head_dim=256)


@pytest.mark.parametrize("seq_lens, ring_size, num_splits, rate", [
    ([0, 1, 65, 300], None, 5, 4),  # as above, FP8 pages: the ring and the entries with different scales
    ([127, 700, 1000], 192, 1, 4),
    ([3, 200], None, 2, None),  # window only
])  # fmt: skip
def test_interpreter_fp8_pages_match_reference(seq_lens, ring_size, num_splits, rate):
    """e4m3 pages with per-channel scales: each consumer converts its half of a tile to f16 in SMEM, times the
    scale (kept in SMEM), masked rows zeroed, before its matmuls."""
    _run_interpreted(seq_lens, ring_size=ring_size, num_splits=num_splits, rate=rate, fp8=True)


def _small(heads=64, head_dim=128, page_size=64, dtype=jnp.bfloat16):
    q = jnp.zeros((1, heads, head_dim), jnp.bfloat16)
    return q, jnp.zeros((4, page_size, head_dim), dtype)


@pytest.mark.parametrize("change, kw", [
    ({}, dict(topk_indices=jnp.zeros((1, 8), jnp.int32))),  # CSA
    (dict(dtype=jnp.float8_e4m3fn), dict(kv_scales=jnp.ones(128, jnp.float32))),  # FP8 ring, bf16 entries
    (dict(page_size=32), {}),
    ({}, dict(ring_size=160)),
])  # fmt: skip
def test_supported_says_no(change, kw):
    q, pages = _small(**change)
    assert mgpu_decode_supported(*_small(), sliding_window=128)
    assert not mgpu_decode_supported(q, pages, sliding_window=128, compressed_pages=_small()[1], **kw)


def test_fp8_pages_need_channel_scales_on_both_pools():
    from dsv4.pallas.decode_mgpu import unsupported_reason

    q, pages8 = _small(dtype=jnp.float8_e4m3fn)
    ch = jnp.ones(128, jnp.float32)
    assert mgpu_decode_supported(q, pages8, sliding_window=128, kv_scales=ch)
    assert mgpu_decode_supported(q, pages8, sliding_window=128, kv_scales=ch, compressed_pages=pages8,
                                 compressed_scales=ch)  # fmt: skip
    tile = jnp.ones((4, 64, 2), jnp.float32)
    why = unsupported_reason(q, pages8, sliding_window=128, kv_scales=tile, compressed_pages=pages8,
                             compressed_scales=ch)  # fmt: skip
    assert "per-channel kv_scales" in why and "(4, 64, 2)" in why
    why = unsupported_reason(q, pages8, sliding_window=128, kv_scales=ch, compressed_pages=pages8,
                             compressed_scales=tile)  # fmt: skip
    assert "compressed_scales" in why


@pytest.mark.parametrize("change, match", [
    (dict(page_size=32), "page_size=32"),
    (dict(heads=32), "num heads H=32 must be a multiple of 64"),
    (dict(head_dim=64), "head dim D=64"),
])  # fmt: skip
def test_refuses_what_it_cannot_run(change, match):
    q, pages = _small(**change)
    tables = jnp.ones((1, -(-128 // pages.shape[1])), jnp.int32)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_mgpu(q, pages, tables, jnp.ones(1, jnp.int32), jnp.zeros(q.shape[1], jnp.float32),
                                    sliding_window=128, scale=0.1)  # fmt: skip


def test_refuses_pv_chunks_narrower_than_a_swizzle_tile():
    q, pages = _small()  # D = 128: each consumer's half is one 64-channel tile
    with pytest.raises(ValueError, match="pv_chunks=2 needs D/2=64 to be a multiple of 128"):
        paged_decode_attention_mgpu(q, pages, jnp.ones((1, 2), jnp.int32), jnp.ones(1, jnp.int32),
                                    jnp.zeros(q.shape[1], jnp.float32), sliding_window=128, scale=0.1,
                                    config=MgpuDecodeConfig(pv_chunks=2))  # fmt: skip
    with pytest.raises(ValueError, match="pv_chunks=0"):
        MgpuDecodeConfig(pv_chunks=0)
    with pytest.raises(ValueError, match="registers=.240, 32.*504"):  # hangs in setmaxnreg on the GPU
        MgpuDecodeConfig(registers=(240, 32))


@gpu
@requires_gpu
@pytest.mark.parametrize("hca, config", [
    (False, MgpuDecodeConfig()), (True, MgpuDecodeConfig()), (True, MgpuDecodeConfig(num_splits=1)),
    (False, MgpuDecodeConfig(auto_barriers=True)), (True, MgpuDecodeConfig(pv_chunks=1, auto_barriers=True)),
    (False, MgpuDecodeConfig(pv_chunks=4)), (True, MgpuDecodeConfig(pv_chunks=4, num_splits=1)),
])  # fmt: skip
def test_gpu_matches_reference_at_v4_shapes(hca, config):
    seq_lens = [1, 63, 64, 65, 128, 129, 1000, 20_000, 0, 77_777]
    inputs, _ = make_cache(1, seq_lens, heads=64, head_dim=512, window=128, page_size=64,
                           rate=4 if hca else None, compressed_page_size=64, dtype=jnp.bfloat16)  # fmt: skip
    kw = dict(sliding_window=128, scale=512**-0.5)
    # A NaN-filled run of the same shapes first: its freed buffers are likely to be the kernel's outputs next.
    poison = {k: (jnp.full_like(v, jnp.nan) if k == "q" else v) for k, v in inputs.items()}
    jax.block_until_ready(paged_decode_attention_mgpu(**poison, **kw, config=config))
    got = np.asarray(paged_decode_attention_mgpu(**inputs, **kw, config=config), np.float32)
    want = np.asarray(paged_decode_attention_reference(**inputs, **kw), np.float32)
    assert not np.isnan(want).any()
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    if config == MgpuDecodeConfig():  # the public entry takes this kernel on Hopper by default
        np.testing.assert_array_equal(np.asarray(paged_decode_attention(**inputs, **kw), np.float32), got)


@gpu
@requires_gpu
@pytest.mark.parametrize("hca, config", [
    (False, MgpuDecodeConfig()), (True, MgpuDecodeConfig()), (True, MgpuDecodeConfig(pv_chunks=1, auto_barriers=True)),
    (True, MgpuDecodeConfig(fp8_layout="wgmma")), (True, MgpuDecodeConfig(fp8_layout="upcast4x")),
])  # fmt: skip
def test_gpu_fp8_pages_match_reference_at_v4_shapes(hca, config):
    seq_lens = [1, 63, 64, 65, 128, 129, 1000, 20_000, 0, 77_777]
    inputs, _ = make_cache(1, seq_lens, heads=64, head_dim=512, window=128, page_size=64,
                           rate=4 if hca else None, compressed_page_size=64, dtype=jnp.float32)  # fmt: skip
    inputs = fp8_channel_cache(inputs)
    kw = dict(sliding_window=128, scale=512**-0.5)
    poison = dict(inputs, q=jnp.full_like(inputs["q"], jnp.nan))
    jax.block_until_ready(paged_decode_attention_mgpu(**poison, **kw, config=config))
    got = np.asarray(paged_decode_attention_mgpu(**inputs, **kw, config=config), np.float32)
    want = np.asarray(paged_decode_attention_reference(**dict(inputs, q=inputs["q"].astype(jnp.float32)), **kw),
                      np.float32)  # fmt: skip
    assert not np.isnan(got).any()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-3
    np.testing.assert_allclose(got, want, atol=TOL * max(1.0, np.abs(want).max() / 3), rtol=0)
    if config == MgpuDecodeConfig():  # the public entry takes this kernel for FP8 channel-scaled pages on Hopper
        np.testing.assert_array_equal(np.asarray(paged_decode_attention(**inputs, **kw), np.float32), got)


def test_public_entry_dispatch():
    """`paged_decode_attention(impl=...)`: "mgpu" refuses what the Mosaic kernel cannot run, naming it; "auto" on
    CPU (interpret) is the Triton kernel, bit for bit."""
    inputs, _ = make_cache(2, [5, 70], heads=64, head_dim=128, window=128, page_size=64, rate=4,
                           compressed_page_size=64, dtype=jnp.bfloat16)  # fmt: skip
    kw = dict(sliding_window=128, scale=0.1)
    with pytest.raises(ValueError, match="topk_indices"):
        paged_decode_attention(**inputs, **kw, topk_indices=jnp.zeros((2, 8), jnp.int32), impl="mgpu")
    with pytest.raises(ValueError, match="impl="):
        paged_decode_attention(**inputs, **kw, impl="cuda")
    if jax.default_backend() != "gpu":
        auto = paged_decode_attention(**inputs, **kw, interpret=True)
        triton = paged_decode_attention(**inputs, **kw, interpret=True, impl="triton")
        np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(triton, np.float32))
