"""dsv4.pallas.attention: the Pallas kernel against its jnp reference, and the reference against the model's path.

Every kernel run starts from a NaN-filled output buffer (`out_init`, aliased), so an element the kernel fails to
write shows up as NaN. On CPU the kernel runs in the Pallas interpreter (`interpret=True`); shapes stay tiny
and block sizes small (16/32) so that several query, KV, compressed and top-k blocks are exercised.

Tolerances: float32 inputs compare at 2e-5 (the kernel's online softmax and exp2 differ from the reference's
one-shot exp only by float32 rounding). bfloat16 inputs compare at 3e-2 absolute: both sides round the
unnormalized probabilities to bfloat16 for P·V, but against different running maxima, and the output itself is
rounded to bfloat16 (relative step 2^-8 ≈ 4e-3 on values of order 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.pallas.attention import (
    FP8_BLOCK_SIZES,
    SCALE_TILE,
    BlockSizes,
    default_block_sizes,
    v4_attention,
    v4_attention_reference,
)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
SMALL = BlockSizes(block_q=4, block_h=4, block_kv=16, block_compressed=16, block_topk=16)

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")


def make_inputs(seed, *, batch=2, seq=37, heads=4, head_dim=32, window=16, offset=0, kv_len=None, holes=0.0,
                dtype=jnp.float32, sink_scale=1.0):  # fmt: skip
    """Random q, kv, sinks; q_pos = offset + arange(S); kv covers positions offset - (window - 1) .. offset + S - 1
    (a chunk plus its window history; rows before position 0 and a `holes` fraction are empty slots, -1),
    followed by empty capacity up to `kv_len` rows."""
    rng = np.random.default_rng(seed)
    history = min(window - 1, offset)
    positions = np.arange(offset - history, offset + seq)
    kv_len = kv_len or positions.size
    kv_pos = np.full((batch, kv_len), -1, np.int32)
    kv_pos[:, : positions.size] = positions
    kv_pos[rng.random(kv_pos.shape) < holes] = -1
    q = rng.standard_normal((batch, seq, heads, head_dim), np.float32)
    kv = rng.standard_normal((batch, kv_len, head_dim), np.float32)
    sinks = (rng.standard_normal(heads) * sink_scale).astype(np.float32)
    q_pos = np.broadcast_to(offset + np.arange(seq, dtype=np.int32), (batch, seq))
    return dict(q=jnp.asarray(q, dtype), kv=jnp.asarray(kv, dtype), q_pos=jnp.asarray(q_pos),
                kv_pos=jnp.asarray(kv_pos), sinks=jnp.asarray(sinks))  # fmt: skip


def make_compressed(seed, inputs, count, dtype=None):
    rng = np.random.default_rng(seed + 1000)
    b, _, _, d = inputs["q"].shape
    return jnp.asarray(rng.standard_normal((b, count, d), np.float32), dtype or inputs["q"].dtype)


def make_topk(seed, q_pos, *, count, rate, k):
    """CSA picks: each query lists distinct, causally visible entries (c < (p + 1) // rate) in random slots;
    the other slots are -1 (so k may exceed the visible count)."""
    rng = np.random.default_rng(seed + 2000)
    q_pos = np.asarray(q_pos)
    out = np.full((*q_pos.shape, k), -1, np.int32)
    for idx in np.ndindex(q_pos.shape):
        visible = min(count, (q_pos[idx] + 1) // rate)
        picks = rng.permutation(visible)[: rng.integers(0, k + 1)]
        slots = rng.permutation(k)[: picks.size]
        out[idx + (slots,)] = picks
    return jnp.asarray(out)


def quantize(x, layout):
    """x [B, N, D] f32 → (float8_e4m3fn values, f32 scales) in the given scale layout."""
    b, n, d = x.shape
    if layout == "channel":
        scales = jnp.max(jnp.abs(x), axis=(0, 1)) / 448.0  # [D]
        full = scales[None, None, :]
    else:
        tiles = x.reshape(b, n, d // SCALE_TILE, SCALE_TILE)
        scales = jnp.max(jnp.abs(tiles), axis=-1) / 448.0  # [B, N, D // 64]
        full = jnp.repeat(scales, SCALE_TILE, axis=-1)
    return (x / full).astype(jnp.float8_e4m3fn), scales.astype(jnp.float32)


# NOTE: interpret mode spends its time in XLA:CPU compiling the interpreted grid loop; these options halve that
# (the kernel's numerics do not depend on them: it is float32 arithmetic either way).
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
STATIC = ("sliding_window", "scale", "compress_rate")


def run_both(inputs, *, block_sizes=SMALL, **kw):
    """Kernel (interpreted, NaN-poisoned output buffer) and reference on the same inputs."""
    poison = jnp.full(inputs["q"].shape, jnp.nan, inputs["q"].dtype)
    dynamic = {k: v for k, v in kw.items() if k not in STATIC}
    lowered = v4_attention.trace(**inputs, **kw, block_sizes=block_sizes, interpret=True, out_init=poison).lower()
    got = lowered.compile(compiler_options=FAST_CPU_COMPILE)(**inputs, **dynamic, out_init=poison)
    want = v4_attention_reference(**inputs, **kw)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


def assert_close(got, want, dtype):
    assert not np.isnan(got).any(), "kernel left elements unwritten (NaN from the poisoned output)"
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)


# ---------------------------------------------------------------------------------------------
# Sliding window only.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, heads, head_dim, seq, window, block_sizes, dtype",
    [
        (0, 1, 32, 37, 16, BlockSizes(block_q=16, block_h=1, block_kv=16), jnp.float32),
        (1, 4, 32, 37, 16, BlockSizes(), jnp.float32),  # defaults: block_q = 64 // 4 = 16, block_kv = 64
        (2, 4, 64, 50, 8, BlockSizes(block_q=8, block_h=2, block_kv=32), jnp.float32),  # 2 head blocks
        (3, 16, 32, 29, 16, BlockSizes(block_q=1, block_h=16, block_kv=16), jnp.float32),  # 1 token × 16 heads
        (4, 16, 32, 33, 32, BlockSizes(block_q=2, block_h=8, block_kv=16), jnp.bfloat16),
    ],
)
def test_window_matches_reference(seed, heads, head_dim, seq, window, block_sizes, dtype):
    inputs = make_inputs(seed, heads=heads, head_dim=head_dim, seq=seq, window=window, dtype=dtype)
    got, want = run_both(inputs, sliding_window=window, scale=head_dim**-0.5, block_sizes=block_sizes)
    assert_close(got, want, dtype)


def test_many_heads_small_dim():
    inputs = make_inputs(6, batch=1, seq=9, heads=128, head_dim=16, window=4)
    got, want = run_both(inputs, sliding_window=4, scale=0.25, block_sizes=BlockSizes(block_q=1, block_kv=16))
    assert_close(got, want, jnp.float32)


def test_query_offset_with_history_and_holes():
    """A prefill chunk at positions 100.. with its window history before it, empty slots inside and unused
    capacity after it (kv rows sorted by position, -1 anywhere)."""
    inputs = make_inputs(7, seq=21, offset=100, window=16, holes=0.2, kv_len=48)
    assert int(inputs["kv_pos"].max()) == 120 and int(inputs["kv_pos"][0, -1]) == -1
    got, want = run_both(inputs, sliding_window=16, scale=0.2)
    assert_close(got, want, jnp.float32)


def test_unsorted_kv_falls_back_to_full_scan():
    """Shuffled kv rows break the band search's precondition; the wrapper must detect it and stay correct."""
    inputs = make_inputs(8, seq=24, offset=40, window=8)
    perm = np.random.default_rng(8).permutation(inputs["kv"].shape[1])
    inputs["kv"], inputs["kv_pos"] = inputs["kv"][:, perm], inputs["kv_pos"][:, perm]
    got, want = run_both(inputs, sliding_window=8, scale=0.2)
    assert_close(got, want, jnp.float32)


def test_rows_with_no_keys_and_extreme_sinks():
    """Batch row 1 has only empty kv slots and row 0's first queries have negative positions: their softmax is the
    sink alone, whose value is nothing, so the output is exactly 0 (and must still be written), also next to a
    -inf sink (0, not NaN). Large sinks soak up the mass (output → 0), small ones vanish (plain softmax)."""
    inputs = make_inputs(9, seq=20, heads=8, window=8)
    inputs["kv_pos"] = inputs["kv_pos"].at[1].set(-1)
    inputs["q_pos"] = inputs["q_pos"].at[0, :3].set(-5)
    inputs["sinks"] = jnp.asarray([30.0, -30.0, 8.0, 0.0, -np.inf, 1e4, -1e4, 2.0], jnp.float32)
    got, want = run_both(inputs, sliding_window=8, scale=0.3, block_sizes=BlockSizes(block_q=2, block_kv=16))
    assert_close(got, want, jnp.float32)
    assert (got[1] == 0).all() and (got[0, :3] == 0).all()
    assert np.abs(got[0, 3:, [0, 1, 2, 3, 4, 6, 7]]).min() > 0  # every finite sink but 1e4 lets the keys through


# ---------------------------------------------------------------------------------------------
# Compressed entries: HCA and CSA.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, rate, offset, block_sizes, dtype",
    [
        (11, 4, 0, SMALL, jnp.float32),
        (12, 8, 100, BlockSizes(block_q=8, block_h=2, block_kv=16, block_compressed=16), jnp.float32),
        (13, 4, 0, BlockSizes(block_q=1, block_h=16, block_kv=32, block_compressed=16), jnp.bfloat16),
    ],
)
def test_hca_matches_reference(seed, rate, offset, block_sizes, dtype):
    heads = 16 if block_sizes.block_h == 16 else 4
    inputs = make_inputs(seed, seq=45, heads=heads, offset=offset, window=16, dtype=dtype)
    count = (offset + 45) // rate  # every complete entry up to the chunk's end
    got, want = run_both(inputs, sliding_window=16, scale=0.2, compressed=make_compressed(seed, inputs, count),
                         compress_rate=rate, block_sizes=block_sizes)  # fmt: skip
    assert_close(got, want, dtype)


@pytest.mark.parametrize(
    "seed, k, block_sizes, dtype",
    [
        (14, 5, SMALL, jnp.float32),  # k < block_topk, many slots -1
        (15, 40, BlockSizes(block_q=2, block_h=4, block_kv=16, block_topk=16), jnp.float32),  # k > visible, 3 steps
        (16, 24, BlockSizes(block_q=1, block_h=16, block_kv=16, block_topk=16), jnp.bfloat16),  # no fold waste
    ],
)
def test_csa_matches_reference(seed, k, block_sizes, dtype):
    heads = 16 if block_sizes.block_h == 16 else 4
    inputs = make_inputs(seed, seq=41, heads=heads, window=8, dtype=dtype)
    count = 41 // 4
    topk = make_topk(seed, inputs["q_pos"], count=count, rate=4, k=k)
    topk = topk.at[1, 5:9].set(-1)  # some queries pick nothing
    assert (topk == -1).any() and (topk >= 0).any()
    got, want = run_both(inputs, sliding_window=8, scale=0.2, compressed=make_compressed(seed, inputs, count),
                         topk_indices=topk, compress_rate=4, block_sizes=block_sizes)  # fmt: skip
    assert_close(got, want, dtype)


def test_csa_with_no_keys_anywhere_outputs_zero():
    inputs = make_inputs(17, seq=18, window=8)
    inputs["kv_pos"] = jnp.full_like(inputs["kv_pos"], -1)
    topk = jnp.full((2, 18, 6), -1, jnp.int32)
    got, want = run_both(inputs, sliding_window=8, scale=0.2, compressed=make_compressed(17, inputs, 4),
                         topk_indices=topk)  # fmt: skip
    assert_close(got, want, jnp.float32)
    assert (got == 0).all()


@pytest.mark.parametrize("mode, dtype", [("window", jnp.float32), ("hca", jnp.bfloat16), ("csa", jnp.float32),
                                         ("csa", jnp.bfloat16)])  # fmt: skip
def test_q_scale_folds_into_the_logits(mode, dtype):
    """q_scale (q's inverse RMS, `Kernels.q_norm` "fold"): each (token, head)'s logits times its factor, the sink
    not. The reference with q_scale is checked against the spec's form, queries q · q_scale in float32, and the
    kernel against the reference; factors in [0.4, 2.5) so that a kernel ignoring them fails."""
    inputs = make_inputs(30, seq=23, window=8, offset=3, dtype=dtype)
    q_scale = jnp.asarray(np.random.default_rng(31).uniform(0.4, 2.5, inputs["q"].shape[:3]), jnp.float32)
    kw = dict(sliding_window=8, scale=0.2)
    if mode != "window":
        kw.update(compressed=make_compressed(30, inputs, 26 // 4), compress_rate=4)
    if mode == "csa":
        kw["topk_indices"] = make_topk(30, inputs["q_pos"], count=26 // 4, rate=4, k=5)
    if dtype == jnp.float32:
        scaled = dict(inputs, q=inputs["q"] * q_scale[..., None])
        np.testing.assert_allclose(np.asarray(v4_attention_reference(**inputs, **kw, q_scale=q_scale)),
                                   np.asarray(v4_attention_reference(**scaled, **kw)), atol=2e-6)  # fmt: skip
    got, want = run_both(inputs, **kw, q_scale=q_scale)
    assert_close(got, want, dtype)
    unscaled = np.asarray(v4_attention_reference(**inputs, **kw), np.float32)
    assert np.abs(got - unscaled).max() > 10 * TOL[dtype]


# ---------------------------------------------------------------------------------------------
# FP8 KV.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode, kv_layout, compressed_layout",
    [("hca", "channel", "tile"), ("csa", "tile", "channel"), ("csa", None, "tile")],
)
def test_fp8_matches_reference(mode, kv_layout, compressed_layout):
    inputs = make_inputs(18, seq=27, head_dim=64, window=16, dtype=jnp.bfloat16)
    count = 27 // 4
    compressed = make_compressed(18, inputs, count, jnp.float32)
    kw = dict(sliding_window=16, scale=0.125)
    if kv_layout:
        inputs["kv"], kw["kv_scales"] = quantize(inputs["kv"].astype(jnp.float32), kv_layout)
    if compressed_layout:
        compressed, kw["compressed_scales"] = quantize(compressed, compressed_layout)
    kw["compressed"] = compressed.astype(jnp.bfloat16) if compressed.dtype == jnp.float32 else compressed
    if mode == "hca":
        kw["compress_rate"] = 4
    else:
        kw["topk_indices"] = make_topk(18, inputs["q_pos"], count=count, rate=4, k=8)
    got, want = run_both(inputs, **kw)
    assert_close(got, want, jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# The reference against the model's own jnp path (dsv4/attention.py).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
def test_reference_matches_model_jnp_path(mode):
    from dsv4.attention import CompressedKeys, core_attention_jnp

    inputs = make_inputs(19, seq=33, offset=5, window=8, holes=0.1)
    kw, compressed = dict(sliding_window=8, scale=0.2), None
    if mode != "window":
        entries = make_compressed(19, inputs, 9)
        topk = make_topk(19, inputs["q_pos"], count=9, rate=4, k=6) if mode == "csa" else None
        compressed = CompressedKeys(entries, 4, topk)
        kw.update(compressed=entries, compress_rate=4, topk_indices=topk)
    model_path = jax.jit(core_attention_jnp, static_argnames=("sliding_window", "scale", "query_chunk"))
    model = model_path(**inputs, sliding_window=8, scale=0.2, compressed=compressed, query_chunk=16)
    np.testing.assert_allclose(np.asarray(v4_attention_reference(**inputs, **kw)), np.asarray(model), atol=2e-6)


# ---------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q=3), "block_q=3"),
        (dict(block_h=6), "block_h=6"),
        (dict(block_kv=8), "block_kv=8"),
        (dict(block_topk=48), "block_topk=48"),
        (dict(num_warps=3), "num_warps=3"),
        (dict(num_stages=0), "num_stages=0"),
    ],
)
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_input_validation_names_shapes():
    inputs = make_inputs(20, batch=1, seq=8, window=4)
    call = dict(sliding_window=4, scale=0.1, interpret=True)
    bad_kv = dict(inputs, kv=inputs["kv"][..., :16])
    with pytest.raises(ValueError, match=r"kv.shape=\(1, 8, 16\)"):
        v4_attention(**bad_kv, **call)
    with pytest.raises(ValueError, match="kv_scales is required"):
        v4_attention(**dict(inputs, kv=inputs["kv"].astype(jnp.float8_e4m3fn)), **call)
    with pytest.raises(ValueError, match=r"kv_scales.shape=\(16,\)"):
        v4_attention(**dict(inputs, kv=inputs["kv"].astype(jnp.float8_e4m3fn)), kv_scales=jnp.ones(16), **call)
    with pytest.raises(ValueError, match="needs compress_rate"):
        v4_attention(**inputs, compressed=make_compressed(20, inputs, 2), **call)
    with pytest.raises(ValueError, match=r"topk_indices must be int32 \[B, S, K\]"):
        v4_attention(**inputs, compressed=make_compressed(20, inputs, 2), topk_indices=jnp.zeros((1, 7, 2), jnp.int32),
                     **call)  # fmt: skip
    with pytest.raises(ValueError, match="does not divide num_heads=6"):
        v4_attention(**make_inputs(20, batch=1, seq=8, heads=6), **call, block_sizes=BlockSizes(block_h=4))
    with pytest.raises(ValueError, match=r"head dim D=24"):
        v4_attention(**make_inputs(20, batch=1, seq=8, head_dim=24), **call)
    with pytest.raises(ValueError, match=r"q_scale must be float32 \[B, S, H\] = \(1, 8, 4\)"):
        v4_attention(**inputs, q_scale=jnp.ones((1, 8, 4), jnp.bfloat16), **call)
    with pytest.raises(ValueError, match="tile rows"):  # tl.dot needs >= 16 rows when compiled
        v4_attention(**inputs, sliding_window=4, scale=0.1, block_sizes=BlockSizes(block_q=1))


# ---------------------------------------------------------------------------------------------
# Triton lowering (runs on CPU: lowers for an abstract H200, builds and verifies the Triton module; no ptxas).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["window", "hca", "csa-fp8-channel", "hca-fp8-tile", "csa-q-scale"])
def test_lowers_to_triton_at_real_shapes(mode, monkeypatch):
    from dsv4.pallas._jax_compat import triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
    sds = jax.ShapeDtypeStruct
    b, s, h, d, t, c, k = 1, 256, 64, 512, 384, 96, 48  # V4-Flash heads and head dim; T, C, K not powers of 2
    kv_dtype = jnp.float8_e4m3fn if "fp8" in mode else jnp.bfloat16
    dynamic = dict(q=sds((b, s, h, d), jnp.bfloat16), kv=sds((b, t, d), kv_dtype), q_pos=sds((b, s), jnp.int32),
                   kv_pos=sds((b, t), jnp.int32), sinks=sds((h,), jnp.float32))  # fmt: skip
    static = dict(sliding_window=128, scale=d**-0.5)
    if mode.startswith("hca"):
        dynamic["compressed"], static["compress_rate"] = sds((b, c, d), kv_dtype), 4
    if mode.startswith("csa"):
        dynamic["compressed"], dynamic["topk_indices"] = sds((b, c, d), kv_dtype), sds((b, s, k), jnp.int32)
    if "channel" in mode:
        dynamic["kv_scales"] = dynamic["compressed_scales"] = sds((d,), jnp.float32)
    if "tile" in mode:
        dynamic["kv_scales"] = sds((b, t, d // SCALE_TILE), jnp.float32)
        dynamic["compressed_scales"] = sds((b, c, d // SCALE_TILE), jnp.float32)
    if "q-scale" in mode:
        dynamic["q_scale"] = sds((b, s, h), jnp.float32)
    names = tuple(dynamic)

    def fn(*arrays):
        return v4_attention(**dict(zip(names, arrays)), **static)

    with abstract_gpu_mesh():
        hlo = jax.jit(fn).trace(*dynamic.values()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo
    [result] = modules
    assert result.module.operation.verify()
    assert list(result.grid) == [s, b, 1]  # 1 token × 64 heads per program by default
    text = str(result.module)
    assert text.count("tt.dot") == (2 if mode == "window" else 4)
    # FP8 inputs take the 64-row KV tiles by default: 128 rows asked 320 KiB of shared memory on an H200 (E15)
    rows = FP8_BLOCK_SIZES.block_kv if "fp8" in mode else BlockSizes().block_kv
    assert f"tensor<{rows}x{d}x" in text and f"tensor<{2 * rows}x{d}x" not in text


def test_default_block_sizes_follow_the_kv_dtype():
    fp8 = jnp.float8_e4m3fn
    assert default_block_sizes(jnp.bfloat16) == default_block_sizes(jnp.bfloat16, jnp.bfloat16) == BlockSizes()
    assert default_block_sizes(fp8) == default_block_sizes(jnp.bfloat16, fp8) == FP8_BLOCK_SIZES
    assert FP8_BLOCK_SIZES.block_kv == FP8_BLOCK_SIZES.block_compressed == FP8_BLOCK_SIZES.block_topk == 64


# ---------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernel at V4 shapes.
# ---------------------------------------------------------------------------------------------
@gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["window", "hca", "csa", "csa-fp8", "hca-fp8", "csa-q-scale"])
def test_gpu_matches_reference_at_real_shapes(mode):
    inputs = make_inputs(21, batch=1, seq=300, heads=64, head_dim=512, window=128, offset=1000, holes=0.05,
                         dtype=jnp.bfloat16)  # fmt: skip
    kw = dict(sliding_window=128, scale=512**-0.5)
    count = 1300 // 4
    compressed = make_compressed(21, inputs, count)
    if mode.startswith("hca"):
        kw.update(compressed=compressed, compress_rate=4)
    elif mode.startswith("csa"):
        kw.update(compressed=compressed, topk_indices=make_topk(21, inputs["q_pos"], count=count, rate=4, k=96))
    if mode == "csa-fp8":
        kw["compressed"], kw["compressed_scales"] = quantize(compressed.astype(jnp.float32), "tile")
        inputs["kv"], kw["kv_scales"] = quantize(inputs["kv"].astype(jnp.float32), "channel")
    if mode == "hca-fp8":  # the default tiles for FP8 (FP8_BLOCK_SIZES: the bf16 default's asked 320 KiB of SMEM)
        kw["compressed"], kw["compressed_scales"] = quantize(compressed.astype(jnp.float32), "channel")
        inputs["kv"], kw["kv_scales"] = quantize(inputs["kv"].astype(jnp.float32), "channel")
    if mode == "csa-q-scale":  # q's inverse RMS folded (`Kernels.q_norm` "fold")
        kw["q_scale"] = jnp.asarray(np.random.default_rng(22).uniform(0.4, 2.5, (1, 300, 64)), jnp.float32)
    poison = jnp.full(inputs["q"].shape, jnp.nan, jnp.bfloat16)
    got = np.asarray(v4_attention(**inputs, **kw, out_init=poison), np.float32)
    want = np.asarray(v4_attention_reference(**inputs, **kw), np.float32)
    assert_close(got, want, jnp.bfloat16)
