"""dsv4.pallas.indexer: the streaming top-k kernel against its jnp reference, and the reference against the model's
`index_topk_jnp`.

Every kernel run starts from an output buffer filled with an impossible index (`out_init`, aliased), so an element
the kernel fails to write shows up. On CPU the kernel runs in the Pallas interpreter (`interpret=True`); shapes
stay tiny and blocks small (16) so that several query blocks, key sub-tiles and merge chunks are exercised.

NOTE: index sets are compared exactly, so most inputs are small integers (bf16 / f32 / e4m3 hold them exactly)
with power-of-two scales: every dot, weighted sum and scale is then exact in float32 in any summation order, the
kernel and the reference compute bit-identical scores, and ties are frequent (a strong test of the
lowest-index rule). One test uses Gaussian data and compares the picks' exact (float64) scores instead, since
there a near-tie at the k-th place may legitimately fall either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.pallas.indexer import (
    BlockSizes,
    ScoreBlocks,
    band_widths,
    index_scores,
    index_scores_reference,
    index_topk,
    index_topk_reference,
    index_topk_two_pass,
    one_band_per_call,
)

POISON = -7  # never a valid output (indices are >= -1)
SMALL = BlockSizes(block_q=4, block_c=16)

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")

# NOTE: interpret mode spends its time in XLA:CPU compiling the interpreted grid loop (the bitonic network is a few
# hundred ops); these options halve that and do not change integer / float32 results.
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
STATIC = ("rate", "k", "softmax_scale")


def make_inputs(seed, *, batch=2, seq=37, heads=4, head_dim=16, entries=30, offsets=(0, 90), span=3,
                dtype=jnp.bfloat16):  # fmt: skip
    """Integer-valued q [B, S, Hi, Di], keys [B, C, Di] in [-span, span], weights in [-2, 2]; batch row b has
    positions offsets[b] + arange(S), so rows see ragged, growing prefixes of the C entries."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-span, span + 1, (batch, seq, heads, head_dim))
    keys = rng.integers(-span, span + 1, (batch, entries, head_dim))
    weights = rng.integers(-2, 3, (batch, seq, heads)).astype(np.float32)
    positions = (np.asarray(offsets)[:, None] + np.arange(seq)).astype(np.int32)
    return dict(q=jnp.asarray(q, dtype), keys=jnp.asarray(keys, dtype), weights=jnp.asarray(weights),
                positions=jnp.asarray(positions))  # fmt: skip


def run_both(inputs, *, block_sizes=SMALL, **kw):
    """Kernel (interpreted, poisoned output buffer) and reference on the same inputs → int32 numpy arrays."""
    b, s = inputs["positions"].shape
    poison = jnp.full((b, s, kw["k"]), POISON, jnp.int32)
    dynamic = {k: v for k, v in kw.items() if k not in STATIC}
    lowered = index_topk.trace(**inputs, **kw, block_sizes=block_sizes, interpret=True, out_init=poison).lower()
    got = lowered.compile(compiler_options=FAST_CPU_COMPILE)(**inputs, **dynamic, out_init=poison)
    want = index_topk_reference(**inputs, **kw)
    return np.asarray(got), np.asarray(want)


def assert_same(got, want):
    assert (got != POISON).all(), "kernel left elements unwritten (poisoned output)"
    np.testing.assert_array_equal(got, want)


def model_topk(inputs, **kw):
    from dsv4.attention import index_topk_jnp

    return np.asarray(jax.jit(index_topk_jnp, static_argnames=STATIC + ("query_chunk",))(**inputs, **kw,
                                                                                          query_chunk=16))  # fmt: skip


def exact_scores(inputs, softmax_scale, q_scale=None, k_scale=None):
    """float64 scores [B, S, C] from the (dequantized) inputs."""
    q = np.asarray(inputs["q"].astype(jnp.float32), np.float64)
    keys = np.asarray(inputs["keys"].astype(jnp.float32), np.float64)
    if q_scale is not None:
        q = q * (np.asarray(q_scale, np.float64)[..., None] if np.ndim(q_scale) else float(q_scale))
    if k_scale is not None:
        keys = keys * (np.asarray(k_scale, np.float64)[..., None] if np.ndim(k_scale) else float(k_scale))
    dots = np.maximum(np.einsum("bqhd,bcd->bqhc", q, keys), 0) * softmax_scale
    return np.einsum("bqhc,bqh->bqc", dots, np.asarray(inputs["weights"], np.float64))


def assert_true_top_k(got, scores, visible, k, atol=1e-5):
    """Every row of got [B, S, k] lists min(k, visible) distinct visible entries (-1 after them) whose scores are the
    row's best (rounding may only swap near-ties). scores [B, S, C] float64, visible [B, S]."""
    for bi, si in np.ndindex(*got.shape[:2]):
        picks = got[bi, si][got[bi, si] >= 0]
        n = min(k, visible[bi, si])
        assert len(picks) == n and len(set(picks)) == n and (picks < visible[bi, si]).all()
        best = np.sort(scores[bi, si, : visible[bi, si]])[::-1][:n]
        np.testing.assert_allclose(np.sort(scores[bi, si, picks])[::-1], best, rtol=0, atol=atol)


def visible_counts(positions, rate, entries):
    return np.clip((np.asarray(positions) + 1) // rate, 0, entries)


# ---------------------------------------------------------------------------------------------
# Exact index sets (and order) against the reference and the model's jnp path.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, k, entries, heads, head_dim, block_sizes, dtype",
    [
        # K = 16 = block_c: two merge chunks over C = 30; most early queries see fewer than k entries
        (0, 5, 30, 4, 16, SMALL, jnp.bfloat16),
        # k = 20 → K = 32 = 2 sub-tiles of 16 per chunk, 4 chunks over C = 100; query blocks of 2
        (1, 20, 100, 4, 16, BlockSizes(block_q=2, block_c=16), jnp.bfloat16),
        # k = 40 > the visible count of row 0 (at most 9) but not of row 1; default block_q = 64 // 8 = 8; f32 inputs
        (2, 40, 50, 8, 32, BlockSizes(block_c=32), jnp.float32),
    ],
)
def test_matches_reference_and_model(seed, k, entries, heads, head_dim, block_sizes, dtype):
    inputs = make_inputs(seed, heads=heads, head_dim=head_dim, entries=entries, offsets=(0, 4 * entries - 40),
                         dtype=dtype)  # fmt: skip
    inputs["positions"] = inputs["positions"].at[1, -3:].set(-1)  # padding queries see nothing
    kw = dict(rate=4, k=k, softmax_scale=0.25)
    got, want = run_both(inputs, block_sizes=block_sizes, **kw)
    assert_same(got, want)
    visible = visible_counts(inputs["positions"], 4, entries)
    assert ((got >= 0).sum(-1) == np.minimum(visible, k)).all()
    assert (visible < k).any() and (visible >= k).any()
    if k <= entries:  # lax.top_k in the model's path needs k <= C
        np.testing.assert_array_equal(want, model_topk(inputs, **kw))


def test_exact_ties_go_to_the_lowest_index():
    """Keys repeat with period 5, so every distinct score appears up to 8 times and k = 12 cuts through tie groups;
    batch row 1 has only non-positive dots (every score is 0), so its picks are 0, 1, 2, ... Checked against the
    reference and, independently of lax.top_k, against a float64 (score desc, index asc) ordering."""
    inputs = make_inputs(3, entries=40, offsets=(100, 60))
    keys = np.asarray(inputs["keys"], np.float32)
    keys = keys[:, np.arange(40) % 5]
    keys[1] = np.abs(keys[1])
    inputs["keys"] = jnp.asarray(keys, jnp.bfloat16)
    inputs["q"] = inputs["q"].at[1].set(-jnp.abs(inputs["q"][1]))
    kw = dict(rate=4, k=12, softmax_scale=0.5)
    got, want = run_both(inputs, block_sizes=BlockSizes(block_q=4, block_c=16), **kw)
    assert_same(got, want)
    np.testing.assert_array_equal(want, model_topk(inputs, **kw))

    scores = exact_scores(inputs, 0.5)
    visible = visible_counts(inputs["positions"], 4, 40)
    for b, s in np.ndindex(visible.shape):
        n = min(12, visible[b, s])
        order = sorted(range(visible[b, s]), key=lambda c: (-scores[b, s, c], c))[:n]
        assert list(got[b, s, :n]) == order and (got[b, s, n:] == -1).all(), (b, s)
    assert (got[1, :, :1] == 0).all()
    cut_ties = [np.sort(scores[0, s, : visible[0, s]])[::-1][11:13] for s in range(37)]
    assert any(pair[0] == pair[1] for pair in cut_ties)  # some tie group straddles the k-th place


def test_chunks_that_cannot_improve_are_skipped_correctly():
    """Batch row 0: scores fall with the entry index, so after the first chunk no chunk beats the buffer (the
    `lax.cond` skip path). Row 1: scores rise, so every chunk replaces the whole buffer."""
    inputs = make_inputs(4, entries=70, offsets=(300, 300), heads=4, head_dim=16)
    ramp = np.zeros((2, 70, 16), np.float32)
    ramp[0, :, 0] = 70 - np.arange(70)
    ramp[1, :, 0] = 1 + np.arange(70)
    inputs["keys"] = jnp.asarray(ramp, jnp.bfloat16)
    inputs["q"] = jnp.ones_like(inputs["q"])
    inputs["weights"] = jnp.abs(inputs["weights"]) + 1.0
    kw = dict(rate=4, k=6, softmax_scale=0.125)
    got, want = run_both(inputs, **kw)  # K = 16: five chunks over 70 entries
    assert_same(got, want)
    assert (got[0] == np.arange(6)).all() and (got[1] == 69 - np.arange(6)).all()


# ---------------------------------------------------------------------------------------------
# FP8 q and keys with scales.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["per_row", "per_tensor"])
def test_fp8_matches_reference(layout):
    """Integers in [-8, 8] are exact in e4m3 and the scales are powers of two, so the kernel's folded scales (into
    the weights / score columns) give the same bits as the reference's dequantize-first."""
    rng = np.random.default_rng(5)
    inputs = make_inputs(5, entries=45, offsets=(0, 140), span=8, dtype=jnp.float8_e4m3fn)
    b, s, h, _ = inputs["q"].shape
    if layout == "per_row":
        q_scale = jnp.asarray(2.0 ** rng.integers(-2, 3, (b, s, h)), jnp.float32)
        k_scale = jnp.asarray(2.0 ** rng.integers(-2, 3, (b, 45)), jnp.float32)
    else:
        q_scale, k_scale = jnp.float32(0.5), jnp.float32(4.0)
    kw = dict(rate=4, k=10, softmax_scale=0.25)
    got, want = run_both(inputs, q_scale=q_scale, k_scale=k_scale, **kw)
    assert_same(got, want)
    dequantized = dict(
        inputs,
        q=inputs["q"].astype(jnp.float32) * (q_scale[..., None] if q_scale.ndim else q_scale),
        keys=inputs["keys"].astype(jnp.float32) * (k_scale[..., None] if k_scale.ndim else k_scale),
    )
    np.testing.assert_array_equal(want, model_topk(dequantized, **kw))


# ---------------------------------------------------------------------------------------------
# Gaussian data: same picks up to near-ties at the k-th place.
# ---------------------------------------------------------------------------------------------
def test_gaussian_inputs_pick_a_true_top_k():
    rng = np.random.default_rng(6)
    b, s, h, d, c, k = 2, 29, 4, 32, 60, 9
    inputs = dict(q=jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16),
                  keys=jnp.asarray(rng.standard_normal((b, c, d)), jnp.bfloat16),
                  weights=jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32),
                  positions=jnp.asarray(np.stack([np.arange(s), 200 + np.arange(s)]), jnp.int32))  # fmt: skip
    got, want = run_both(inputs, rate=4, k=k, softmax_scale=d**-0.5, block_sizes=BlockSizes(block_q=4, block_c=32))
    assert (got != POISON).all()
    scores, visible = exact_scores(inputs, d**-0.5), visible_counts(inputs["positions"], 4, c)
    assert_true_top_k(got, scores, visible, k)
    assert (got == want).mean() > 0.95  # rounding may only swap near-ties


# ---------------------------------------------------------------------------------------------
# Two passes: the scores kernel (both matmul orientations) and the grouped exact top-k.
# ---------------------------------------------------------------------------------------------
SCORE_TILINGS = [
    ScoreBlocks(block_q=4, block_c=16, span=32, rows="keys"),  # 2 live tiles per span, 3 spans over C = 70
    ScoreBlocks(block_q=2, block_c=16, span=16, rows="queries"),
    ScoreBlocks(block_q=1, block_c=16, span=64, rows="keys", q_transposed=True),
]


@pytest.mark.parametrize("blocks", SCORE_TILINGS, ids=lambda b: b.rows + ("-qT" if b.q_transposed else ""))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_scores_kernel_matches_reference(blocks, dtype):
    """Every element written (NaN-poisoned output), bit-identical scores on integer data, -inf exactly where an
    entry is not yet visible (ragged rows, padding queries, key tiles past the block's last visible entry)."""
    rng = np.random.default_rng(11)
    inputs = make_inputs(11, seq=37, entries=70, offsets=(0, 200), span=3, dtype=dtype)
    inputs["positions"] = inputs["positions"].at[1, -3:].set(-1)
    kw = dict(rate=4, softmax_scale=0.25)
    if dtype == jnp.float8_e4m3fn:
        kw["q_scale"] = jnp.asarray(2.0 ** rng.integers(-2, 3, (2, 37, 4)), jnp.float32)
        kw["k_scale"] = jnp.asarray(2.0 ** rng.integers(-2, 3, (2, 70)), jnp.float32)
    poison = jnp.full((2, 37, 70), jnp.nan, jnp.float32)
    got = np.asarray(index_scores(**inputs, **kw, blocks=blocks, interpret=True, out_init=poison))
    want = np.asarray(index_scores_reference(**inputs, **kw))
    assert not np.isnan(got).any(), "kernel left elements unwritten (poisoned output)"
    np.testing.assert_array_equal(got, want)
    visible = visible_counts(inputs["positions"], 4, 70)
    assert (np.isneginf(got) == (np.arange(70) >= visible[..., None])).all()
    finite = np.isfinite(got)
    np.testing.assert_allclose(got[finite], exact_scores(inputs, 0.25, kw.get("q_scale"), kw.get("k_scale"))[finite])


@pytest.mark.parametrize("k, chunk, group", [(9, 16, 2), (40, 37, 4), (80, 8, 2)])
def test_two_pass_matches_reference(k, chunk, group):
    """Same index rows (order included) as the reference: ties everywhere (integer data), k below, across and
    above the visible counts (k = 80 > C = 70), chunks that do or do not divide S, groups small enough that the
    grouped top-k recurses."""
    inputs = make_inputs(12, seq=37, entries=70, offsets=(30, 240))
    inputs["positions"] = inputs["positions"].at[0, :2].set(-1)
    kw = dict(rate=4, k=k, softmax_scale=0.25)
    got = np.asarray(index_topk_two_pass(**inputs, **kw, query_chunk=chunk, group=group, blocks=SCORE_TILINGS[0],
                                         interpret=True))  # fmt: skip
    np.testing.assert_array_equal(got, np.asarray(index_topk_reference(**inputs, **kw)))
    visible = visible_counts(inputs["positions"], 4, 70)
    assert ((got >= 0).sum(-1) == np.minimum(visible, k)).all()


@pytest.mark.parametrize("call_band, query_chunk", [(False, 8), (True, 8), (None, 36)])
def test_two_pass_width_bands(call_band, query_chunk):
    """Chunks scored over only the keys they can see (4 bands of C = 300: widths 128, 192, 256, 300): queries 30
    positions apart, so the 8-query chunks need widths from 64 up to all 300 and take four different branches (a
    band per chunk), or all take the widest (one band for the call, which `call_band=None` picks here: 37 queries
    at rate 4 span fewer entries than the narrowest band); per-row k scales are cut with the keys. The same index
    rows as the reference, and as one band. query_chunk 36 is evened out to two steps of 32 (whole 16-query tiles)."""
    rng = np.random.default_rng(14)
    inputs = make_inputs(14, seq=37, entries=300, span=8, dtype=jnp.float8_e4m3fn)
    inputs["positions"] = jnp.asarray(np.arange(37, dtype=np.int32)[None] * 30 + np.array([[0], [13]], np.int32))
    kw = dict(rate=4, k=24, softmax_scale=0.25, q_scale=jnp.float32(0.5),
              k_scale=jnp.asarray(2.0 ** rng.integers(-2, 3, (2, 300)), jnp.float32))  # fmt: skip
    assert band_widths(300, 4) == (128, 192, 256, 300)
    run = functools.partial(index_topk_two_pass, **inputs, **kw, group=2, blocks=SCORE_TILINGS[1], interpret=True)
    got = np.asarray(run(width_bands=4, call_band=call_band, query_chunk=query_chunk))
    np.testing.assert_array_equal(got, np.asarray(index_topk_reference(**inputs, **kw)))
    np.testing.assert_array_equal(got, np.asarray(run(width_bands=1, query_chunk=8)))
    with pytest.raises(ValueError, match="width_bands=0"):
        run(width_bands=0)


def test_band_widths():
    assert band_widths(131072, 4) == (32768, 65536, 98304, 131072)
    # one band a call: a 16K-token chunk at rate 4 spans 4096 entries, within the narrowest band (32K) of a 512K
    # prompt's keys; the whole 512K prompt (128K entries) does not; 131,076 entries: the narrowest band is 32,832
    assert one_band_per_call(16384, 4, 131072, 4) and not one_band_per_call(524288, 4, 131072, 4)
    assert one_band_per_call(4 * 32832, 4, 131076, 4) and not one_band_per_call(4 * 32832 + 1, 4, 131076, 4)
    assert band_widths(1000, 3) == (384, 704, 1000)  # rounded up to 64-key tiles
    assert band_widths(100, 4) == (64, 100)  # repeats dropped
    assert band_widths(70, 1) == (70,)


def test_two_pass_fp8_per_token_scales():
    rng = np.random.default_rng(13)
    inputs = make_inputs(13, seq=21, entries=45, offsets=(0, 140), span=8, dtype=jnp.float8_e4m3fn)
    kw = dict(rate=4, k=10, softmax_scale=0.25,
              q_scale=jnp.asarray(2.0 ** rng.integers(-2, 3, (2, 21, 4)), jnp.float32),
              k_scale=jnp.asarray(2.0 ** rng.integers(-2, 3, (2, 45)), jnp.float32))  # fmt: skip
    got = index_topk_two_pass(**inputs, **kw, query_chunk=8, group=2, blocks=SCORE_TILINGS[1], interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(index_topk_reference(**inputs, **kw)))


@pytest.mark.parametrize("kwargs, match", [(dict(block_q=3), "block_q=3"), (dict(span=8), "span=8"),
                                           (dict(rows="heads"), "rows='heads'"), (dict(num_warps=3), "num_warps=3"),
                                           (dict(rows="queries", q_transposed=True), "q_transposed")])
def test_score_blocks_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScoreBlocks(**kwargs)


# ---------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q=3), "block_q=3"),
        (dict(block_c=8), "block_c=8"),
        (dict(block_c=48), "block_c=48"),
        (dict(num_warps=3), "num_warps=3"),
        (dict(num_stages=0), "num_stages=0"),
    ],
)
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_input_validation_names_shapes():
    inputs = make_inputs(7, batch=1, seq=8, offsets=(0,))
    call = dict(rate=4, k=4, softmax_scale=0.25, interpret=True)
    with pytest.raises(ValueError, match=r"keys.shape=\(1, 30, 8\)"):
        index_topk(**dict(inputs, keys=inputs["keys"][..., :8]), **call)
    with pytest.raises(ValueError, match=r"weights must be float32 \[B, S, Hi\] = \(1, 8, 4\)"):
        index_topk(**dict(inputs, weights=inputs["weights"][..., :2]), **call)
    with pytest.raises(ValueError, match="positions must be int32"):
        index_topk(**dict(inputs, positions=inputs["positions"].astype(jnp.float32)), **call)
    with pytest.raises(ValueError, match="k_scale is required"):
        index_topk(**dict(inputs, keys=inputs["keys"].astype(jnp.float8_e4m3fn)), **call)
    with pytest.raises(ValueError, match=r"q_scale.shape=\(8,\) fits neither"):
        index_topk(**dict(inputs, q=inputs["q"].astype(jnp.float8_e4m3fn)), q_scale=jnp.ones(8), **call)
    with pytest.raises(ValueError, match="q_scale given"):
        index_topk(**inputs, q_scale=jnp.float32(1), **call)
    with pytest.raises(ValueError, match="differ"):
        index_topk(**dict(inputs, keys=inputs["keys"].astype(jnp.float32)), **call)
    with pytest.raises(ValueError, match="Hi must be a power of two"):
        index_topk(**make_inputs(7, batch=1, seq=8, heads=3, offsets=(0,)), **call)
    with pytest.raises(ValueError, match="matmul rows"):  # tl.dot needs >= 16 rows when compiled
        index_topk(**inputs, rate=4, k=4, softmax_scale=0.25, block_sizes=BlockSizes(block_q=1))
    with pytest.raises(ValueError, match="k=0"):
        index_topk(**inputs, rate=4, k=0, softmax_scale=0.25, interpret=True)


# ---------------------------------------------------------------------------------------------
# Triton lowering (runs on CPU: lowers for an abstract H200, builds and verifies the Triton module; no ptxas).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, k", [(jnp.bfloat16, 512), (jnp.float8_e4m3fn, 2048)])
def test_lowers_to_triton_at_real_shapes(dtype, k, monkeypatch):
    from dsv4.pallas._jax_compat import triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
    sds = jax.ShapeDtypeStruct
    b, s, h, d, c = 1, 256, 64, 128, 1000  # V4-Flash indexer heads and head dim; C not a power of two
    dynamic = dict(q=sds((b, s, h, d), dtype), keys=sds((b, c, d), dtype), weights=sds((b, s, h), jnp.float32),
                   positions=sds((b, s), jnp.int32))  # fmt: skip
    if dtype == jnp.float8_e4m3fn:
        dynamic.update(q_scale=sds((b, s, h), jnp.float32), k_scale=sds((b, c), jnp.float32))
    names = tuple(dynamic)

    def fn(*arrays):
        return index_topk(**dict(zip(names, arrays)), rate=4, k=k, softmax_scale=d**-0.5)

    with abstract_gpu_mesh():
        hlo = jax.jit(fn).trace(*dynamic.values()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo
    [result] = modules
    text = str(result.module)
    assert result.module.operation.verify()
    assert list(result.grid) == [s, b]  # 1 token × 64 heads per program by default
    assert text.count("tt.dot") == 1 and ("f8E4M3FN" in text) == (dtype == jnp.float8_e4m3fn)
    log_k = k.bit_length() - 1
    assert text.count("tt.split") == 2 * (log_k * (log_k + 1) // 2 + log_k)  # values + indices per bitonic stage


# ---------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernel at V4 shapes (integer data, so the comparison stays exact).
# ---------------------------------------------------------------------------------------------
def real_shape_inputs(seed, dtype, k, entries):
    """V4 indexer shapes (384 queries × 64 heads × 128, the last 200 positions of a 4·entries prompt), integer
    data; FP8 adds power-of-two per-(token, head) q and per-entry k scales. → (inputs, keyword arguments)."""
    rng = np.random.default_rng(seed)
    inputs = make_inputs(seed, batch=1, seq=384, heads=64, head_dim=128, entries=entries,
                         offsets=(4 * entries - 200,), span=2, dtype=dtype)  # fmt: skip
    kw = dict(rate=4, k=k, softmax_scale=2.0**-4)
    if dtype == jnp.float8_e4m3fn:
        kw["q_scale"] = jnp.asarray(2.0 ** rng.integers(-2, 3, (1, 384, 64)), jnp.float32)
        kw["k_scale"] = jnp.asarray(2.0 ** rng.integers(-2, 3, (1, entries)), jnp.float32)
    return inputs, kw


@gpu
@requires_gpu
@pytest.mark.parametrize("dtype, k, entries", [(jnp.bfloat16, 512, 2000), (jnp.float8_e4m3fn, 2048, 3000)])
def test_gpu_matches_reference_at_real_shapes(dtype, k, entries):
    inputs, kw = real_shape_inputs(8, dtype, k, entries)
    poison = jnp.full((1, 384, k), POISON, jnp.int32)
    got = np.asarray(index_topk(**inputs, **kw, out_init=poison))
    assert_same(got, np.asarray(index_topk_reference(**inputs, **kw)))


@gpu
@requires_gpu
@pytest.mark.parametrize("dtype, k, entries, rows", [(jnp.bfloat16, 512, 2000, "keys"),
                                                      (jnp.float8_e4m3fn, 2048, 3000, "keys"),
                                                      (jnp.float8_e4m3fn, 512, 3000, "queries")])  # fmt: skip
def test_gpu_two_pass_matches_reference_at_real_shapes(dtype, k, entries, rows):
    inputs, kw = real_shape_inputs(9, dtype, k, entries)
    blocks = ScoreBlocks(block_q=2, block_c=128, rows=rows, num_warps=4 if rows == "keys" else 8)
    poison = jnp.full((1, 384, entries), jnp.nan, jnp.float32)
    scales = {n: kw[n] for n in ("q_scale", "k_scale") if n in kw}
    scores = np.asarray(index_scores(**inputs, rate=4, softmax_scale=2.0**-4, **scales, blocks=blocks, out_init=poison))
    want_scores = np.asarray(index_scores_reference(**inputs, rate=4, softmax_scale=2.0**-4, **scales))
    assert not np.isnan(scores).any()
    np.testing.assert_array_equal(scores, want_scores)
    got = np.asarray(index_topk_two_pass(**inputs, **kw, query_chunk=128, blocks=blocks))
    np.testing.assert_array_equal(got, np.asarray(index_topk_reference(**inputs, **kw)))
