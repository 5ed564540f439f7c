"""dsv4.pallas.attention_mgpu: the Mosaic GPU (Hopper) attention core against the jnp reference.

CPU (not gpu-marked):
- the kernel lowers for CUDA at V4 shapes (B=1, S=1024, H=64, D=512; window and HCA; both variants) inside an
  abstract H200 mesh (no GPU, no ptxas: this catches Pallas/Mosaic lowering errors, layout and SMEM-budget
  failures, not miscompiles);
- the Mosaic GPU interpreter runs the "interpret" P·V form (P through SMEM, fresh accumulator: the interpreter's
  wgmma needs SMEM operands) at a small shape against the reference. It exercises the barriers, TMA indices,
  the partial-logit exchange and the masks of both variants;
- shape errors.
GPU (`-m gpu`): the real kernels against the reference on fresh random inputs, S not a multiple of any block,
HCA on/off, random sinks. Outputs are poisoned best-effort: a NaN-input run of the same shape goes first, so a
recycled output buffer holds NaNs where the kernel fails to write.

Tolerance: bf16 outputs, 3e-2 absolute (as tests/test_pallas_attention.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.attention.core import CompressedKeys
from dsv4.attention.pallas_core import core_attention_pallas, mosaic_takes_prefix, prefix_window_rows
from dsv4.pallas.attention import v4_attention_reference
from dsv4.pallas.attention_common import scale_queries
from dsv4.pallas.attention_mgpu import MgpuConfig, csa_operands, v4_attention_mgpu, window_tiles

TOL = 3e-2
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU (Mosaic GPU kernel)")


def make_inputs(seed, *, batch=1, seq=37, heads=64, head_dim=512, rate=None, offset=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
    kv = jnp.asarray(rng.standard_normal((batch, seq, head_dim)), dtype)
    q_pos = jnp.asarray(np.broadcast_to(offset + np.arange(seq, dtype=np.int32), (batch, seq)))
    sinks = jnp.asarray(rng.standard_normal(heads) * 2.0, jnp.float32)
    compressed = None
    if rate is not None:
        compressed = jnp.asarray(rng.standard_normal((batch, (offset + seq) // rate + 1, head_dim)), dtype)
    return q, kv, q_pos, sinks, compressed


def _config(variant, **kw):
    """"ws" (persistent: one CTA per SM looping over tokens, the default), "ws-per-token" (one CTA per token),
    "prefetch"; "-nobar" appended: without Pallas' automatic SMEM-store barriers."""
    if variant.endswith("-nobar"):
        return _config(variant.removesuffix("-nobar"), auto_barriers=False, **kw)
    if variant == "ws-per-token":
        return MgpuConfig(variant="ws", persistent=False, **kw)
    return MgpuConfig(variant=variant, **kw)


def _reference(q, kv, q_pos, sinks, compressed, *, window, scale, rate):
    return v4_attention_reference(q, kv, q_pos, q_pos, sinks, sliding_window=window, scale=scale,
                                  compressed=compressed, compress_rate=rate)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["ws", "ws-per-token", "prefetch", "ws-nobar"])
@pytest.mark.parametrize("hca", [False, True])
@pytest.mark.parametrize("s", [1024, 301])  # 301: T % 8 != 0 (the TMA's GMEM view tiles rows by 8: padded)
def test_lowers_for_cuda_at_real_shapes(variant, hca, s):
    b, h, d = 1, 64, 512
    args = (jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32),
            jax.ShapeDtypeStruct((b, s // 128, d), jnp.bfloat16) if hca else None)  # fmt: skip

    def f(q, kv, q_pos, sinks, compressed):
        return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=128, scale=d**-0.5, compressed=compressed,
                                 compress_rate=128 if hca else None, config=_config(variant),
                                 check_positions=hca)  # fmt: skip  # HCA cases also lower the Triton fallback

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("hca", [False, True])
def test_lowers_for_cuda_with_window_rows(hca):
    """The sequence-parallel form: a zigzag shard's [halo ‖ block] × 2 kv and each token's window rows."""
    b, h, d, s, t = 1, 64, 512, 1024, 1024 + 2 * 127
    args = (jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32),
            jax.ShapeDtypeStruct((b, 64, d), jnp.bfloat16) if hca else None,
            (jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32)))  # fmt: skip

    def f(q, kv, q_pos, sinks, compressed, window_rows):
        return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=128, scale=d**-0.5, compressed=compressed,
                                 compress_rate=128 if hca else None, check_positions=False,
                                 window_rows=window_rows)  # fmt: skip

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("variant", ["ws", "ws-per-token", "prefetch"])
def test_lowers_for_cuda_with_q_scale(variant):
    """q's inverse RMS folded into the logit scale (`q_scale`): one more input and its SMEM copy per consumer, with
    the Triton fallback taking it on q."""
    b, h, d, s = 1, 64, 512, 301
    args = (jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32),
            jax.ShapeDtypeStruct((b, s // 128, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, h), jnp.float32))

    def f(q, kv, q_pos, sinks, compressed, q_scale):
        return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=128, scale=d**-0.5, compressed=compressed,
                                 compress_rate=128, config=_config(variant), q_scale=q_scale)  # fmt: skip

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _row_scales(seed, q):
    """Random per-(token, head) factors in [0.4, 2.5): far enough from 1 that a kernel ignoring them fails."""
    return jnp.asarray(np.random.default_rng(seed).uniform(0.4, 2.5, q.shape[:3]), jnp.float32)


@pytest.mark.parametrize("window, bk", [(128, 64), (40, 32), (1, 64), (200, 64)])
def test_window_tiles_start_aligned_and_cover_the_window(window, bk):
    """TMA row starts must be multiples of 8 (an unaligned start reads garbage on the GPU; the interpreter cannot
    see it), and the tiles must cover [max(0, tok - W + 1), tok] without reaching past tok + bk - 1."""
    tok = np.arange(1000, dtype=np.int32)
    start, n = (np.asarray(x) for x in window_tiles(jnp.asarray(tok), window, bk))
    lo = np.maximum(tok - window + 1, 0)
    assert (start % 8 == 0).all() and (start <= lo).all() and (lo - start < 8).all()
    end = start + n * bk - 1
    assert (end >= tok).all() and (end - bk < tok).all()
    assert n.max() <= -(-(window + 7) // bk)


def _check_in_interpreter(config, q, kv, q_pos, sinks, compressed, *, window, rate, q_scale=None):
    """The kernel in the Mosaic GPU interpreter (head_dim 128) against the jnp reference (q_scale: on q there)."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        out = v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=window, scale=128**-0.5, compressed=compressed,
                                compress_rate=rate, config=config, check_positions=False,
                                interpret=InterpretGPUParams(), q_scale=q_scale)  # fmt: skip
        out = np.asarray(jax.block_until_ready(out), np.float32)
    q = scale_queries(q, q_scale)
    ref = np.asarray(_reference(q, kv, q_pos, sinks, compressed, window=window, scale=128**-0.5, rate=rate), np.float32)
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant, fold", [("prefetch", False), ("ws", False), ("ws", True)])
def test_interpreter_matches_reference(variant, fold, monkeypatch):
    """fold: the token grid axis folded into (inner, outer) with q padded, as past CUDA's 65535 grid limit (here
    made to happen at 16 tokens: 21 tokens become 2 × 16, 11 of them padding)."""
    import dsv4.pallas.attention_mgpu as mgpu

    if fold:
        monkeypatch.setattr(mgpu, "_GRID_DIM_MAX", 16)
        monkeypatch.setattr(mgpu, "_TOKEN_BLOCK", 16)
    window, rate, bk = 40, 4, 32  # window not a multiple of the block: 2 tiles, unaligned band starts
    q, kv, q_pos, sinks, compressed = make_inputs(1, seq=21, head_dim=128, rate=rate)
    config = MgpuConfig(variant=variant, block_kv=bk, pv_form="interpret")
    _check_in_interpreter(config, q, kv, q_pos, sinks, compressed, window=window, rate=rate)


@pytest.mark.parametrize("variant, num_ctas, bk", [("prefetch", 0, 32), ("ws", 3, 64)])
def test_interpreter_folds_q_scale_into_the_logits(variant, num_ctas, bk):
    """q_scale: each (token, head)'s logits times its factor, as the reference on q · q_scale (rounded to bf16 there),
    persistent CTAs included (the next item's factors load under the current item's last step, as its Q does)."""
    window, rate = 40, 4
    q, kv, q_pos, sinks, compressed = make_inputs(5, seq=21, head_dim=128, rate=rate)
    config = MgpuConfig(variant=variant, block_kv=bk, pv_form="interpret", persistent=num_ctas > 0, num_ctas=num_ctas)
    _check_in_interpreter(config, q, kv, q_pos, sinks, compressed, window=window, rate=rate,
                          q_scale=_row_scales(5, q))  # fmt: skip


@pytest.mark.parametrize("batch, heads, num_ctas, seq", [(1, 64, 3, 21), (2, 128, 5, 9)])
def test_interpreter_persistent(batch, heads, num_ctas, seq):
    """Persistent CTAs: each runs several items (token × 64 heads) back to back, the KV ring carrying over between
    them, the next item's Q loaded under the current item's last step, O staged in the last KV tile. Positions from
    100 at rate 1: 2 HCA tiles (101..121 entries) + 1 window tile per item, 7 items per CTA; the second case has 2
    batch rows × 2 head groups (items cross batch rows and head groups inside a CTA)."""
    window, rate, bk = 40, 1, 64
    q, kv, q_pos, sinks, compressed = make_inputs(4, batch=batch, heads=heads, seq=seq, head_dim=128, rate=rate,
                                                  offset=100)  # fmt: skip
    config = MgpuConfig(variant="ws", block_kv=bk, pv_form="interpret", persistent=True, num_ctas=num_ctas)
    _check_in_interpreter(config, q, kv, q_pos, sinks, compressed, window=window, rate=rate)


@pytest.mark.parametrize("variant", ["prefetch", "ws"])
def test_interpreter_with_a_halo_before_q(variant):
    """kv_offset: kv holds 13 rows (positions 37..49, a sequence shard's halo; 13 is not a multiple of the 8-row TMA
    tile) before q's 21 rows (positions 50..70): windows reach into the halo, HCA counts follow global positions."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    window, rate, bk, off, p0, seq = 40, 4, 32, 13, 50, 21
    q, _, q_pos, sinks, compressed = make_inputs(2, seq=seq, head_dim=128, rate=rate, offset=p0)
    kv = jnp.asarray(np.random.default_rng(3).standard_normal((1, off + seq, 128)), jnp.bfloat16)
    kv_pos = jnp.asarray(p0 - off + np.arange(off + seq, dtype=np.int32))[None]
    config = MgpuConfig(variant=variant, block_kv=bk, pv_form="interpret")
    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        out = v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=window, scale=128**-0.5, compressed=compressed,
                                compress_rate=rate, config=config, check_positions=False, kv_offset=off,
                                interpret=InterpretGPUParams())  # fmt: skip
        out = np.asarray(jax.block_until_ready(out), np.float32)
    ref = v4_attention_reference(q, kv, q_pos, kv_pos, sinks, sliding_window=window, scale=128**-0.5,
                                 compressed=compressed, compress_rate=rate)  # fmt: skip
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="kv_offset"):
        v4_attention_mgpu(q, kv[:, :-1], q_pos, sinks, sliding_window=window, scale=1.0, kv_offset=off)


@pytest.mark.parametrize("first_halo_empty, bk, num_ctas", [(False, 32, 0), (True, 32, 0), (True, 64, 3)])
def test_interpreter_with_window_rows_for_two_blocks(first_halo_empty, bk, num_ctas):
    """window_rows: a zigzag shard's layout, kv = [halo A ‖ block A ‖ halo B ‖ block B] (8-row halos = W - 1, 10-row
    blocks at positions 38.. and 78..) and q = [A ‖ B], in one call; each token's window rows given. first_halo_empty:
    shard 0, whose block A starts the sequence (its halo rows hold nothing: position -1, never in a window).
    bk = 64: the persistent launch (3 CTAs, about 7 tokens each)."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    window, rate, halo, rows = 9, 4, 8, 10
    starts = (38, 78)
    q_pos = np.concatenate([np.arange(p, p + rows) for p in starts]).astype(np.int32)[None]
    kv_pos = np.concatenate([np.arange(p - halo, p + rows) for p in starts]).astype(np.int32)[None]
    region = [0, rows + halo]
    if first_halo_empty:
        kv_pos[:, :halo] = -1
        region[0] = halo
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 2 * rows, 64, 128)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, kv_pos.shape[1], 128)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(64) * 2.0, jnp.float32)
    compressed = jnp.asarray(rng.standard_normal((1, 88 // rate + 1, 128)), jnp.bfloat16)
    t = np.arange(2 * rows)
    row = (t // rows) * (rows + halo) + halo + t % rows
    lo = np.maximum(row - (window - 1), np.asarray(region)[t // rows])
    window_rows = (jnp.asarray(lo, jnp.int32)[None], jnp.asarray(row + 1, jnp.int32)[None])
    config = MgpuConfig(variant="ws", block_kv=bk, pv_form="interpret", num_ctas=num_ctas)
    assert config.is_persistent == (bk == 64)
    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        out = v4_attention_mgpu(q, kv, jnp.asarray(q_pos), sinks, sliding_window=window, scale=128**-0.5,
                                compressed=compressed, compress_rate=rate, config=config, check_positions=False,
                                window_rows=window_rows, interpret=InterpretGPUParams())  # fmt: skip
        out = np.asarray(jax.block_until_ready(out), np.float32)
    ref = v4_attention_reference(q, kv, jnp.asarray(q_pos), jnp.asarray(kv_pos), sinks, sliding_window=window,
                                 scale=128**-0.5, compressed=compressed, compress_rate=rate)  # fmt: skip
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)


def test_mosaic_takes_prefix_by_hand():
    """Whether the Mosaic kernel takes a cached chunk (kv_prefix = W = 9 rows before q's 4) or the Triton one."""
    w = 9

    def takes(starts, prefixes, gap=False):
        q_pos = np.asarray([s + np.arange(4) for s in starts], np.int32)
        if gap:
            q_pos[:, 2:] += 1
        kv_pos = np.concatenate([np.asarray(prefixes, np.int32), q_pos], axis=1)
        return bool(mosaic_takes_prefix(jnp.asarray(q_pos), jnp.asarray(kv_pos), w))

    whole = list(range(11, 20))  # the 9 positions before 20
    first = [-1] * 9  # a prompt's first chunk: nothing before position 0
    partial = [-1] * 4 + list(range(5))  # q at 5: positions 0..4, rows before them empty
    assert takes([20], [whole])
    assert takes([0], [first])
    assert takes([5], [partial])
    assert takes([20, 0], [whole, first])
    assert not takes([20], [whole[:4] + [-1] + whole[5:]])  # a position that exists is missing
    assert not takes([5], [partial[:-1] + [7]])  # a row holding the wrong position
    assert not takes([20], [whole], gap=True)  # q's positions not one run
    # rows [lo, hi) = positions max(0, p - 8) .. p, row 9 + j holding position p = q_pos[j]
    lo, hi = prefix_window_rows(jnp.asarray([[0, 1, 2, 3], [5, 6, 7, 8], [20, 21, 22, 23]], jnp.int32), w, w)
    np.testing.assert_array_equal(hi, [[10, 11, 12, 13]] * 3)
    np.testing.assert_array_equal(lo, [[9, 9, 9, 9], [4, 4, 4, 4], [1, 2, 3, 4]])


@pytest.mark.parametrize("bk, num_ctas", [(32, 0), (64, 3)])
def test_interpreter_takes_a_first_chunk_by_window_rows(bk, num_ctas):
    """A cached chunk whose prefix is not all real: row 0 a prompt's first chunk (all 9 prefix
    rows empty), row 1 a chunk at position 5 (4 empty rows, then positions 0..4); 13 queries each, HCA entries.
    The kernel with `prefix_window_rows` equals the reference, which places rows by position (the empty rows
    hold large values: any of them in a window would show)."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    window, rate, seq = 9, 4, 13
    starts = np.asarray([0, 5], np.int32)
    q_pos = starts[:, None] + np.arange(seq, dtype=np.int32)[None]
    before = starts[:, None] - window + np.arange(window, dtype=np.int32)[None]
    kv_pos = np.concatenate([np.where(before >= 0, before, -1), q_pos], axis=1)
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((2, seq, 64, 128)), jnp.bfloat16)
    kv = rng.standard_normal((2, window + seq, 128))
    kv[kv_pos < 0] = 30.0
    kv = jnp.asarray(kv, jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(64) * 2.0, jnp.float32)
    compressed = jnp.asarray(rng.standard_normal((2, (5 + seq) // rate + 1, 128)), jnp.bfloat16)
    q_pos, kv_pos = jnp.asarray(q_pos), jnp.asarray(kv_pos)
    assert bool(mosaic_takes_prefix(q_pos, kv_pos, window))
    config = MgpuConfig(variant="ws", block_kv=bk, pv_form="interpret", num_ctas=num_ctas)
    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        out = v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=window, scale=128**-0.5, compressed=compressed,
                                compress_rate=rate, config=config, check_positions=False,
                                window_rows=prefix_window_rows(q_pos, window, window),
                                interpret=InterpretGPUParams())  # fmt: skip
        out = np.asarray(jax.block_until_ready(out), np.float32)
    ref = v4_attention_reference(q, kv, q_pos, kv_pos, sinks, sliding_window=window, scale=128**-0.5,
                                 compressed=compressed, compress_rate=rate)  # fmt: skip
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)


@pytest.mark.parametrize("kv_prefix", [0, 128])
def test_core_hands_q_scale_to_the_mosaic_kernel_on_hopper(kv_prefix, monkeypatch):
    """`core_attention_pallas` with q_scale, as the model calls it under `Kernels.q_norm="fold"` on a Hopper GPU
    (is_hopper patched true, lowered for an abstract H200): a whole sequence (kv aligned) and a cached chunk
    (kv_prefix rows first) reach the Mosaic kernel with the extra input, an HCA layer's entries too."""
    import dsv4.attention.pallas_core as pallas_core

    monkeypatch.setattr(pallas_core, "is_hopper", lambda: True)
    b, h, d, s, w = 1, 64, 512, 256, 128
    sds = jax.ShapeDtypeStruct
    args = (sds((b, s, h, d), jnp.bfloat16), sds((b, kv_prefix + s, d), jnp.bfloat16), sds((b, s), jnp.int32),
            sds((b, kv_prefix + s), jnp.int32), sds((h,), jnp.float32), sds((b, 4, d), jnp.bfloat16),
            sds((b, s, h), jnp.float32))  # fmt: skip

    def f(q, kv, q_pos, kv_pos, sinks, entries, q_scale):
        prefix = dict(kv_prefix=kv_prefix) if kv_prefix else dict(kv_aligned=True)
        return core_attention_pallas(q, kv, q_pos, kv_pos, sinks, sliding_window=w, scale=d**-0.5,
                                     compressed=CompressedKeys(entries, 128), q_scale=q_scale, **prefix)  # fmt: skip

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
    assert calls and all(f"tensor<{b}x{s}x{h}xf32>" in line.rsplit(" : (", 1)[1] for line in calls)


@pytest.mark.parametrize("kv_prefix", [0, 128])
@pytest.mark.parametrize("csa_mosaic", [True, False])
def test_core_takes_csa_to_the_mosaic_kernel_only_when_asked(kv_prefix, csa_mosaic, monkeypatch):
    """`core_attention_pallas` with a CSA layer's lists on a Hopper GPU (is_hopper patched true, lowered for an
    abstract H200): `csa_mosaic` (`Kernels.csa="pallas"`) sends a whole sequence and a cached chunk to the Mosaic
    kernel's CSA mode, its lists as an input; without it only the Triton kernel runs."""
    import dsv4.attention.pallas_core as pallas_core

    monkeypatch.setattr(pallas_core, "is_hopper", lambda: True)
    b, h, d, s, w, c, k = 1, 64, 512, 256, 128, 64, 512
    sds = jax.ShapeDtypeStruct
    args = (sds((b, s, h, d), jnp.bfloat16), sds((b, kv_prefix + s, d), jnp.bfloat16), sds((b, s), jnp.int32),
            sds((b, kv_prefix + s), jnp.int32), sds((h,), jnp.float32), sds((b, c, d), jnp.bfloat16),
            sds((b, s, k), jnp.int32))  # fmt: skip

    def f(q, kv, q_pos, kv_pos, sinks, entries, topk):
        prefix = dict(kv_prefix=kv_prefix) if kv_prefix else dict(kv_aligned=True)
        return core_attention_pallas(q, kv, q_pos, kv_pos, sinks, sliding_window=w, scale=d**-0.5,
                                     compressed=CompressedKeys(entries, 4, topk), csa_mosaic=csa_mosaic,
                                     **prefix)  # fmt: skip

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
    if not csa_mosaic:
        assert calls == []
    else:  # the lists reach the kernel as its rows operand, padded to whole 64-row tiles: [B, S, 512] int32
        assert calls and all(f"tensor<{b}x{s}x{k}xi32>" in line.rsplit(" : (", 1)[1] for line in calls)


def csa_lists(seed, *, batch, seq, k, num_entries):
    """Random CSA lists [B, S, k]: distinct ids, some past the entries (they list nothing), -1 anywhere, one token
    with nothing listed."""
    rng = np.random.default_rng(seed)
    topk = np.full((batch, seq, k), -1, np.int32)
    for b in range(batch):
        for t in range(1, seq):
            n = int(rng.integers(1, min(k, num_entries + 5) + 1))
            topk[b, t, :n] = rng.permutation(num_entries + 5)[:n]
            rng.shuffle(topk[b, t])
    return jnp.asarray(topk)


def test_csa_operands_by_hand():
    """Slots [3, -1, 7, 2] over 5 entries, 32-slot tiles: 7 lists nothing (outside [0, 5)); rows 3, 0, 0, 2 and 28
    padding slots of row 0; bits 0 and 3 set (9); one past the last listing slot: 4."""
    rows, bits, slots = csa_operands(jnp.asarray([[[3, -1, 7, 2]]], jnp.int32), 5, 32)
    assert np.asarray(rows).tolist() == [[[3, 0, 0, 2] + [0] * 28]]
    assert np.asarray(bits).tolist() == [[[9]]] and np.asarray(slots).tolist() == [[4]]
    rows, bits, slots = csa_operands(jnp.asarray([[[-1] * 31 + [4, 1]]], jnp.int32), 5, 32)  # the top bit, a 2nd word
    assert np.asarray(bits).tolist() == [[[-(2**31), 1]]] and np.asarray(slots).tolist() == [[33]]


@pytest.mark.parametrize("gather_batch, auto_barriers, warps", [(1, True, 1), (16, True, 1), (8, False, 1),
                                                                (8, True, 4), (16, False, 2)])  # fmt: skip
def test_interpreter_csa_matches_reference(gather_batch, auto_barriers, warps):
    """CSA (each listed entry's row gathered by its own TMA into a row-major tile, rewritten tiled in place): 2
    persistent CTAs walking 7 tokens, 100 slots (2 gathered 64-row tiles, the second part padding) with -1 anywhere,
    ids past the entries, a token with nothing listed; then the window tiles. Against the jnp reference; the row
    indices loaded one at a time, or 8 or 16 together (a batch that put a row in the wrong place fails); once with
    the producer's own barriers (the interpreter does not model races: this checks the values and that the form
    runs); and the TMAs issued by 2 or 4 warps, each its share of the rows (a share in the wrong rows, or a warp's
    arrivals miscounted, fails or hangs)."""
    topk = csa_lists(7, batch=1, seq=7, k=100, num_entries=45)
    _check_csa_interpreted(5, topk, MgpuConfig(variant="ws", block_kv=64, pv_form="interpret", num_ctas=2,
                                               gather_batch=gather_batch, auto_barriers=auto_barriers,
                                               csa_warps=warps))  # fmt: skip


def _check_csa_interpreted(seed, topk, config):
    """The Mosaic kernel's CSA mode in the interpreter against the jnp reference: 7 tokens, window 16, 45 entries
    of D = 128, lists topk [1, 7, K]."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    window, seq, c = 16, 7, 45
    q, kv, q_pos, sinks, _ = make_inputs(seed, seq=seq, head_dim=128)
    compressed = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((1, c, 128)), jnp.bfloat16)
    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        out = v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=window, scale=128**-0.5, compressed=compressed,
                                topk_indices=topk, config=config, check_positions=False,
                                interpret=InterpretGPUParams())  # fmt: skip
        out = np.asarray(jax.block_until_ready(out), np.float32)
    ref = v4_attention_reference(q, kv, q_pos, q_pos, sinks, sliding_window=window, scale=128**-0.5,
                                 compressed=compressed, topk_indices=topk)  # fmt: skip
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)


def test_interpreter_csa_contiguous_probe_reads_entries_in_slot_order():
    """The "csa_contiguous" timing probe (bench_attention.py --csa-debug) loads gathered step i as entries
    [64 i, 64 i + 64) by one TMA a half: exact where slot j lists entry j, so the probe runs the consumers on the
    rows it claims to (and its barrier protocol completes)."""
    slot = np.arange(100)[None, None, :]
    n = np.array([0, 1, 5, 20, 33, 44, 45])[None, :, None]  # entries listed by each token, in slot order
    topk = jnp.asarray(np.where(slot < n, slot, -1), jnp.int32)
    _check_csa_interpreted(8, topk, MgpuConfig(variant="ws", block_kv=64, pv_form="interpret", num_ctas=2,
                                               debug=("csa_contiguous",)))  # fmt: skip


@pytest.mark.parametrize("auto_barriers, debug, warps", [
    (True, (), 4), (False, (), 4), (True, (), 1), (False, (), 2), (True, ("csa_no_regroup",), 4),
    (True, ("csa_contiguous",), 4)])  # fmt: skip
def test_csa_lowers_for_cuda_at_real_shapes(auto_barriers, debug, warps):
    """CSA at V4 shapes (D = 512, 512 slots, persistent "ws"): the per-row TMAs into the row-major view, issued by
    the producer's 4 warps, 2, or one thread, and the 8-row regrouping through registers build for an abstract H200,
    with and without Pallas' automatic barriers (the check_positions fallback compiles Triton's); so do the timing
    probes."""
    b, s, h, d, c = 1, 1024, 64, 512, 256
    sds = jax.ShapeDtypeStruct
    args = (sds((b, s, h, d), jnp.bfloat16), sds((b, s, d), jnp.bfloat16), sds((b, s), jnp.int32),
            sds((h,), jnp.float32), sds((b, c, d), jnp.bfloat16), sds((b, s, 512), jnp.int32))  # fmt: skip

    def f(q, kv, q_pos, sinks, compressed, topk):
        return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=128, scale=d**-0.5, compressed=compressed,
                                 topk_indices=topk,
                                 config=MgpuConfig(auto_barriers=auto_barriers, debug=debug, csa_warps=warps))

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_csa_rejects_what_it_cannot_run():
    q, kv, q_pos, sinks, compressed = make_inputs(1, seq=8, head_dim=128, rate=4)
    topk = jnp.zeros((1, 8, 16), jnp.int32)
    kw = dict(sliding_window=16, scale=1.0, compressed=compressed, topk_indices=topk)
    with pytest.raises(ValueError, match="variant='ws'"):
        v4_attention_mgpu(q, kv, q_pos, sinks, config=MgpuConfig(variant="prefetch"), **kw)
    with pytest.raises(ValueError, match="no compress_rate"):
        v4_attention_mgpu(q, kv, q_pos, sinks, compress_rate=4, **kw)
    with pytest.raises(ValueError, match="topk_indices must be int32"):
        v4_attention_mgpu(q, kv, q_pos, sinks, **{**kw, "topk_indices": topk[:, :4]})
    with pytest.raises(ValueError, match="without compressed"):
        v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=16, scale=1.0, topk_indices=topk)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="gather_batch"):
            MgpuConfig(gather_batch=bad)
    for bad in (dict(csa_warps=3), dict(block_kv=192, csa_warps=4, gather_batch=32)):  # a share of 48 rows
        with pytest.raises(ValueError, match="csa_warps"):
            MgpuConfig(**bad)


@pytest.mark.parametrize(
    "shape, match",
    [((1, 8, 64, 576), "head dim"), ((1, 8, 32, 512), "multiple of 64"), ((1, 8, 96, 512), "multiple of 64")],
)
def test_rejects_unsupported_shapes(shape, match):
    b, s, h, d = shape
    q = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        v4_attention_mgpu(q, jnp.zeros((b, s, d), jnp.bfloat16), jnp.zeros((b, s), jnp.int32),
                          jnp.zeros((h,), jnp.float32), sliding_window=128, scale=1.0)  # fmt: skip


def test_rejects_bad_config():
    with pytest.raises(ValueError, match="block_kv"):
        MgpuConfig(block_kv=32)  # the P·V wgmma needs K % 64 == 0
    with pytest.raises(ValueError, match="variant"):
        MgpuConfig(variant="x")
    with pytest.raises(ValueError, match="persistent needs"):
        MgpuConfig(variant="prefetch", persistent=True)
    assert MgpuConfig().is_persistent and not MgpuConfig(variant="prefetch").is_persistent
    assert not MgpuConfig(block_kv=32, pv_form="interpret").is_persistent  # O is staged in a 64-row KV tile
    with pytest.raises(ValueError, match="num_ctas"):
        MgpuConfig(num_ctas=-1)
    with pytest.raises(ValueError, match="shared memory"):
        v4_attention_mgpu(jnp.zeros((1, 8, 64, 512), jnp.bfloat16), jnp.zeros((1, 8, 512), jnp.bfloat16),
                          jnp.zeros((1, 8), jnp.int32), jnp.zeros((64,), jnp.float32), sliding_window=128, scale=1.0,
                          config=MgpuConfig(num_slots=3))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
@gpu
@requires_gpu
@pytest.mark.parametrize("variant", ["ws", "ws-per-token", "prefetch", "ws-nobar", "ws-per-token-nobar"])
@pytest.mark.parametrize("hca", [False, True])
@pytest.mark.parametrize("seq", [37, 301])
def test_gpu_matches_reference(variant, hca, seq):
    _check_on_gpu(_config(variant), hca, seq)


@gpu
@requires_gpu
@pytest.mark.parametrize("num_ctas", [0, 7])
def test_gpu_persistent_batches_and_head_groups(num_ctas):
    """Persistent CTAs over 2 batch rows × 2 head groups × 301 tokens: one CTA per SM (0), or 7 CTAs running
    about 170 items each."""
    _check_on_gpu(_config("ws", num_ctas=num_ctas), True, 301, batch=2, heads=128)


@gpu
@requires_gpu
@pytest.mark.parametrize("variant", ["ws", "ws-per-token", "prefetch"])
def test_gpu_folds_q_scale_into_the_logits(variant):
    """q_scale (q's inverse RMS, `Kernels.q_norm` "fold") against the reference on q · q_scale."""
    _check_on_gpu(_config(variant), True, 301, fold=True)


def _check_on_gpu(config, hca, seq, fold=False, **shape):
    rate = 4 if hca else None  # small rate so that short sequences see several HCA tiles
    window, d = 128, 512
    kwargs = dict(sliding_window=window, scale=d**-0.5, compress_rate=rate, config=config)
    q, kv, q_pos, sinks, compressed = make_inputs(seq, seq=seq, rate=rate, **shape)
    if fold:
        kwargs["q_scale"] = _row_scales(seq, q)
    poison = jax.block_until_ready(v4_attention_mgpu(jnp.full_like(q, jnp.nan), kv, q_pos, sinks,
                                                     compressed=compressed, **kwargs))  # fmt: skip
    del poison
    out = np.asarray(v4_attention_mgpu(q, kv, q_pos, sinks, compressed=compressed, **kwargs), np.float32)
    q = scale_queries(q, kwargs.get("q_scale"))
    ref = np.asarray(_reference(q, kv, q_pos, sinks, compressed, window=window, scale=d**-0.5, rate=rate), np.float32)
    assert not np.isnan(out).any(), "kernel left elements unwritten (NaN)"
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@gpu
@requires_gpu
@pytest.mark.parametrize("num_ctas, gather_batch, auto_barriers, warps", [
    (0, 16, True, 4), (5, 8, False, 2), (0, 8, True, 1), (5, 8, True, 1), (0, 1, True, 1), (0, 64, True, 1),
    (5, 16, False, 1)])  # fmt: skip
@pytest.mark.parametrize("seq, k", [(301, 512), (37, 100)])
def test_gpu_csa_matches_reference(num_ctas, gather_batch, auto_barriers, warps, seq, k):
    """CSA on the GPU: V4's 512 slots (or 100: a partial gathered tile) over 2000 entries, -1 anywhere, ids past the
    entries; after a NaN-query run of the same shape. This is the check of the per-row TMAs (1-row boxes at any row
    start into the untransformed view, issued by 4 or 2 warps or one thread) and of the in-place regrouping on
    hardware."""
    window, d, c = 128, 512, 2000
    q, kv, q_pos, sinks, _ = make_inputs(11, seq=seq)
    compressed = jnp.asarray(np.random.default_rng(12).standard_normal((1, c, d)), jnp.bfloat16)
    topk = csa_lists(13, batch=1, seq=seq, k=k, num_entries=c)
    kwargs = dict(sliding_window=window, scale=d**-0.5, compressed=compressed, topk_indices=topk,
                  config=MgpuConfig(num_ctas=num_ctas, gather_batch=gather_batch, auto_barriers=auto_barriers,
                                    csa_warps=warps))  # fmt: skip
    jax.block_until_ready(v4_attention_mgpu(jnp.full_like(q, jnp.nan), kv, q_pos, sinks, **kwargs))  # poison
    out = np.asarray(v4_attention_mgpu(q, kv, q_pos, sinks, **kwargs), np.float32)
    ref = v4_attention_reference(q, kv, q_pos, q_pos, sinks, sliding_window=window, scale=d**-0.5,
                                 compressed=compressed, topk_indices=topk)  # fmt: skip
    assert not np.isnan(out).any(), "kernel left elements unwritten (NaN)"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)


@gpu
@requires_gpu
@pytest.mark.parametrize("check_positions, seq, off", [(False, 301, 127), (True, 301, 127), (False, 1, 128),
                                                       (True, 1, 128), (False, 3, 128)])  # fmt: skip
def test_gpu_with_a_halo_before_q(check_positions, seq, off):
    """A sequence shard as the sequence-parallel core hands it over: 127 halo rows (W - 1) before q's 301, q at global
    positions 1000.. (HCA entries visible by global position). check_positions=True compiles the Triton fallback
    too (its kv positions must include the halo's) and runs the persistent form, False one CTA per token. seq 1
    and 3 after 128 rows: a cached chunk's layout (`core_attention_pallas` kv_prefix = W) for one and three tokens
    (S = 1 included)."""
    window, rate, p0, d = 128, 4, 1000, 512
    q, _, q_pos, sinks, compressed = make_inputs(7, seq=seq, rate=rate, offset=p0)
    kv = jnp.asarray(np.random.default_rng(8).standard_normal((1, off + seq, d)), jnp.bfloat16)
    kv_pos = jnp.asarray(p0 - off + np.arange(off + seq, dtype=np.int32))[None]
    kwargs = dict(sliding_window=window, scale=d**-0.5, compressed=compressed, compress_rate=rate, kv_offset=off,
                  check_positions=check_positions, config=_config("ws" if check_positions else "ws-per-token"))
    jax.block_until_ready(v4_attention_mgpu(jnp.full_like(q, jnp.nan), kv, q_pos, sinks, **kwargs))  # poison
    out = np.asarray(v4_attention_mgpu(q, kv, q_pos, sinks, **kwargs), np.float32)
    ref = v4_attention_reference(q, kv, q_pos, kv_pos, sinks, sliding_window=window, scale=d**-0.5,
                                 compressed=compressed, compress_rate=rate)  # fmt: skip
    assert not np.isnan(out).any(), "kernel left elements unwritten (NaN)"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)


@gpu
@requires_gpu
def test_gpu_falls_back_when_positions_not_contiguous():
    q, kv, q_pos, sinks, _ = make_inputs(5, seq=64)
    q_pos = q_pos.at[:, 40:].add(3)  # a gap: not the aligned case, the Triton kernel must take it
    out = v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=128, scale=512**-0.5)
    ref = v4_attention_reference(q, kv, q_pos, q_pos, sinks, sliding_window=128, scale=512**-0.5)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL, rtol=0)


@gpu
@requires_gpu
@pytest.mark.parametrize("start", [0, 60, 300])
def test_gpu_core_takes_cached_chunks_of_every_prefix(start):
    """`core_attention_pallas` on a cached chunk's layout (kv_prefix = W = 128 rows, then 301 queries; HCA): a
    prompt's first chunk (start 0), one whose prefix is partly before the prompt (60) and a whole prefix (300), all
    on the Mosaic kernel with each token's window rows, each against the reference placing rows by position."""
    window, rate, seq, d = 128, 4, 301, 512
    q, _, q_pos, sinks, compressed = make_inputs(12, seq=seq, rate=rate, offset=start)
    before = start - window + np.arange(window, dtype=np.int32)
    kv_pos = jnp.asarray(np.concatenate([np.where(before >= 0, before, -1), start + np.arange(seq)]))[None]
    kv = jnp.asarray(np.random.default_rng(13).standard_normal((1, window + seq, d)), jnp.bfloat16)
    assert bool(mosaic_takes_prefix(q_pos, kv_pos, window))
    kwargs = dict(sliding_window=window, scale=d**-0.5, compressed=CompressedKeys(compressed, rate, None),
                  kv_prefix=window)
    jax.block_until_ready(core_attention_pallas(jnp.full_like(q, jnp.nan), kv, q_pos, kv_pos, sinks, **kwargs))
    out = np.asarray(core_attention_pallas(q, kv, q_pos, kv_pos, sinks, **kwargs), np.float32)
    ref = v4_attention_reference(q, kv, q_pos, kv_pos, sinks, sliding_window=window, scale=d**-0.5,
                                 compressed=compressed, compress_rate=rate)  # fmt: skip
    assert not np.isnan(out).any(), "kernel left elements unwritten (NaN)"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL, rtol=0)
