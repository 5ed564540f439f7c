"""dsv4.pallas.moe: the grouped expert GEMMs against their jnp references, and routed_experts against the model's path.

Every standalone kernel run starts from a NaN-filled output buffer (`out_init`, aliased), so a row the kernel fails to
write shows up as NaN. On CPU the kernels run in the Pallas interpreter (`interpret=True`) with 16-row tiles, so
several row tiles per expert, several column tiles and several K steps are exercised.

Tolerances (each side computes exact products of the same operand values in float32, in a different order):
- float32 everywhere: 3e-5 absolute on values of order 1-10 (float32 summation order over K <= 256 terms).
- bfloat16 outputs: rtol 2^-7 (one bf16 ulp: f32 results that differ in the last bits can round to neighbouring
  bf16 values) plus atol 1e-4 for values near 0. The same holds for FP8 weights (W8A16: the kernel multiplies
  x by the exact fp8 values and scales the partial sums; the reference scales first, both exact in f32) and for
  W8A8 given the same quantized x (fp8 × fp8 products are exact in f32).
- routed_experts in W8A8 against the reference that quantizes identically: the same bf16 tolerance. h is rounded to
  bf16 and then to fp8 on both sides from f32 values that differ in the last bits, so a bf16 flip of h could move one
  fp8 value by one fp8 step (2^-3 relative); on these seeded inputs none happens (measured: max error 5e-5 of the
  largest output). The GPU test, larger and with another summation order, allows 2^-5 of the largest output.
  Against the unquantized bf16 path the error is the quantization itself: e4m3 rounds to 3 mantissa bits (relative
  error up to 2^-4, rms 2^-4/√3 ≈ 3.6% per value), nearly independent over the summed terms, applied to x and to h:
  expected relative rms error ≈ 5% (measured 4.3%); bound 10%. W8A16 differs from that path only by the bf16
  rounding of the dequantized weights (measured 0.4%); bound 1%.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.pallas.moe import (
    QUANT_BLOCK,
    BlockSizes,
    dequantize_blocks,
    grouped_down,
    grouped_down_reference,
    grouped_gate_up,
    grouped_gate_up_reference,
    quantize_per_token_group,
    routed_experts,
    routed_experts_reference,
    tile_map,
)

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
SMALL = BlockSizes(block_m=16, block_n=16, block_k=16)
FP8_BLOCKS = BlockSizes(block_m=16, block_n=64, block_k=64)  # divide 128: one weight scale per tile and K step
LIMIT = 3.0  # small enough that the SwiGLU clamp bites on these random values

# NOTE: interpret mode spends its time in XLA:CPU compiling the interpreted grid loop; these options halve that
# (the numerics do not depend on them).
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# XLA:GPU folds chains of float converts (f32 → fp8 → f32, f32 → bf16 → f32) by default (SimplifyFPConversions under
# `xla_allow_excess_precision`); XLA:CPU runs that pass only with its oneDNN rewriting on. Compiling a jnp function
# with these options shows on CPU what XLA:GPU makes of it (it put the W8A8 GPU test off: docs/kernels/moe.md).
FOLD_FP_CONVERSIONS = {"xla_cpu_experimental_onednn_custom_call": True}

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")


def make_group_sizes(kind, experts, rows, seed=0):
    """Expert loads that sum to `rows` (or less for "tail": the last rows belong to no expert)."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        sizes = rng.multinomial(rows, np.ones(experts) / experts)
    elif kind == "skewed":  # empty experts, one expert with most rows, a group of 1
        sizes = np.zeros(experts, np.int64)
        sizes[1], sizes[3], sizes[-1] = rows - 13, 1, 12
    elif kind == "one":  # every row to one expert
        sizes = np.zeros(experts, np.int64)
        sizes[experts // 2] = rows
    elif kind == "tail":  # rows past the last group must come out 0
        sizes = rng.multinomial(rows - 9, np.ones(experts) / experts)
        sizes[0] = 0
    else:
        raise ValueError(kind)
    return jnp.asarray(sizes, jnp.int32)


def make_weights(seed, shape, dtype=F32, scale=0.2):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def quantize_weights(w):
    """w [E, O, I] f32 → (float8_e4m3fn, float32 scales [E, O // 128, I // 128]): DeepSeek's weight_scale_inv."""
    e, o, i = w.shape
    blocks = w.reshape(e, o // QUANT_BLOCK, QUANT_BLOCK, i // QUANT_BLOCK, QUANT_BLOCK)
    scales = jnp.abs(blocks).max(axis=(2, 4)) / 448.0  # [E, O // 128, I // 128]
    full = jnp.repeat(jnp.repeat(scales, QUANT_BLOCK, 1), QUANT_BLOCK, 2)
    return (w / full).astype(FP8), scales.astype(F32)


def compile_folding_fp_conversions(fn, *args, **static):
    """fn (jitted) traced with args and static keyword arguments, compiled for CPU as XLA:GPU would fold its float
    convert chains (FOLD_FP_CONVERSIONS). Skips if this XLA:CPU does not run the pass."""
    probe = jax.jit(lambda v: v.astype(FP8).astype(F32))
    value = jnp.float32(0.3)  # not an e4m3 value: the round trip gives 0.3125 unless folded
    if float(probe.trace(value).lower().compile(compiler_options=FOLD_FP_CONVERSIONS)(value)) != float(value):
        pytest.skip("this XLA:CPU does not fold float convert chains (no oneDNN rewriting)")
    return fn.trace(*args, **static).lower().compile(compiler_options=FOLD_FP_CONVERSIONS)


def run_kernel(entry, arrays, static, out_shape, out_dtype):
    """Runs a kernel entry interpreted, from a NaN-poisoned output buffer. → float32 numpy."""
    poison = jnp.full(out_shape, jnp.nan, out_dtype)
    lowered = entry.trace(**arrays, **static, interpret=True, out_init=poison).lower()
    got = lowered.compile(compiler_options=FAST_CPU_COMPILE)(**arrays, out_init=poison)
    assert got.dtype == out_dtype
    return np.asarray(got, np.float32)


def assert_close(got, want, dtype):
    assert not np.isnan(got).any(), "kernel left rows unwritten (NaN from the poisoned output)"
    want = np.asarray(want, np.float32)
    if dtype == F32:
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=0)
    else:
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=2**-7)


# ---------------------------------------------------------------------------------------------
# Tile map.
# ---------------------------------------------------------------------------------------------
def test_tile_map_never_straddles_experts():
    """Groups [5, 0, 40, 0, 3] in 50 rows, 16-row tiles: 1 + 3 + 1 tiles, then the zero group (rows 48-49), then
    empty tiles up to the static bound (50 + 15 · 6) // 16 = 8."""
    got = np.asarray(tile_map(jnp.asarray([5, 0, 40, 0, 3], jnp.int32), num_rows=50, block_m=16))
    want = [[0, 0, 5], [2, 5, 21], [2, 21, 37], [2, 37, 45], [4, 45, 48], [5, 48, 50], [5, 0, 0], [5, 0, 0]]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["random", "skewed", "one", "tail"])
def test_tile_map_covers_every_row_once(kind):
    rows, block_m = 203, 16
    sizes = make_group_sizes(kind, 9, rows, seed=1)
    tiles = np.asarray(tile_map(sizes, num_rows=rows, block_m=block_m))
    expert_of_row = np.repeat(np.arange(10), np.append(sizes, rows - int(sizes.sum())))
    covered = np.zeros(rows, np.int64)
    for expert, start, end in tiles:
        assert 0 <= end - start <= block_m
        assert (expert_of_row[start:end] == expert).all()
        covered[start:end] += 1
    np.testing.assert_array_equal(covered, 1)


# ---------------------------------------------------------------------------------------------
# The kernels against their references.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, kind, rows, dtype, block_sizes",
    [
        (0, "skewed", 77, F32, SMALL),  # M not a multiple of block_m: the last tile hangs past M
        (1, "one", 50, F32, BlockSizes(block_m=32, block_n=16, block_k=32)),
        (2, "tail", 61, jnp.bfloat16, BlockSizes(block_m=16, block_n=32, block_k=16)),
    ],
)
def test_gate_up_matches_reference(seed, kind, rows, dtype, block_sizes):
    experts, hidden, inter = 6, 64, 32
    sizes = make_group_sizes(kind, experts, rows, seed)
    arrays = dict(x_sorted=make_weights(seed, (rows, hidden), dtype, 1.0), group_sizes=sizes,
                  gate_up=make_weights(seed + 100, (experts, 2 * inter, hidden), dtype))  # fmt: skip
    got = run_kernel(grouped_gate_up, arrays, dict(limit=LIMIT, block_sizes=block_sizes), (rows, inter), dtype)
    want = grouped_gate_up_reference(**arrays, limit=LIMIT)
    assert_close(got, want, dtype)
    assert np.abs(np.asarray(want)).max() > 0.5 * LIMIT  # values reach the clamp's range
    if kind == "tail":
        assert (got[int(sizes.sum()) :] == 0).all()


@pytest.mark.parametrize(
    "seed, kind, rows, dtype, weighted",
    [(3, "random", 70, F32, True), (4, "skewed", 45, jnp.bfloat16, False)],
)
def test_down_matches_reference(seed, kind, rows, dtype, weighted):
    experts, hidden, inter = 6, 64, 32
    arrays = dict(h=make_weights(seed, (rows, inter), dtype, 1.0), group_sizes=make_group_sizes(kind, experts, rows),
                  down=make_weights(seed + 100, (experts, hidden, inter), dtype))  # fmt: skip
    if weighted:
        arrays["row_weights"] = jnp.asarray(np.random.default_rng(seed).random(rows), F32)
    got = run_kernel(grouped_down, arrays, dict(block_sizes=SMALL), (rows, hidden), dtype)
    assert_close(got, grouped_down_reference(**arrays), dtype)


@pytest.mark.parametrize("kernel, activations", [("gate_up", "fp8"), ("gate_up", "bf16"), ("down", "fp8")])
def test_fp8_weights_match_dequantized_reference(kernel, activations):
    """FP8 e4m3 weights with 128 × 128 block scales; activations bf16 (W8A16) or fp8 with per-token 128-group
    scales (W8A8). The reference dequantizes the same fp8 values in f32, so only summation order differs."""
    experts, hidden, inter, rows = 4, 256, 128, 70
    rng_seed = {"gate_up": 5, "down": 6}[kernel]
    sizes = make_group_sizes("skewed", experts, rows)
    width = hidden if kernel == "gate_up" else inter
    x = make_weights(rng_seed, (rows, width), jnp.bfloat16, 1.0)
    shape = (experts, 2 * inter, hidden) if kernel == "gate_up" else (experts, hidden, inter)
    weight, scales = quantize_weights(make_weights(rng_seed + 100, shape, F32, 0.1))
    if kernel == "gate_up":
        entry, reference, static = grouped_gate_up, grouped_gate_up_reference, dict(limit=LIMIT)
        arrays = dict(gate_up=weight, gate_up_scales=scales, group_sizes=sizes)
        names, out_shape = ("x_sorted", "x_scales"), (rows, inter)
    else:
        entry, reference, static = grouped_down, grouped_down_reference, {}
        arrays = dict(down=weight, down_scales=scales, group_sizes=sizes,
                      row_weights=jnp.linspace(0.1, 1.0, rows, dtype=F32))  # fmt: skip
        names, out_shape = ("h", "h_scales"), (rows, hidden)
    if activations == "fp8":
        arrays[names[0]], arrays[names[1]] = quantize_per_token_group(x)
    else:
        arrays[names[0]] = x
    got = run_kernel(entry, arrays, dict(static, block_sizes=FP8_BLOCKS), out_shape, jnp.bfloat16)
    assert_close(got, reference(**arrays, **static), jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# routed_experts: sort → kernels → combine, against dsv4.moe.routed_experts_jnp and the reference.
# ---------------------------------------------------------------------------------------------
def make_routing(seed, tokens, top_k, experts, kind="random"):
    rng = np.random.default_rng(seed)
    if kind == "random":
        ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)])
    elif kind == "skewed":  # expert 1 in every token's top-k, experts 0 and 4.. never
        others = np.stack([rng.permutation([2, 3])[: top_k - 1] for _ in range(tokens)])
        ids = np.concatenate([np.ones((tokens, 1), np.int64), others], axis=1)
    else:
        raise ValueError(kind)
    weights = rng.random((tokens, top_k)) * 2.5  # routed_scaling_factor-sized
    return jnp.asarray(ids, jnp.int32), jnp.asarray(weights, F32)


def run_routed(x, ids, weights, gate_up, down, **kw):
    static = dict(limit=LIMIT, block_sizes=SMALL, interpret=True)
    static.update({k: kw.pop(k) for k in ("block_sizes", "fp8_activations", "out_dtype") if k in kw})
    args = dict(x=x, expert_ids=ids, weights=weights, gate_up=gate_up, down=down, **kw)
    compiled = routed_experts.trace(**args, **static).lower().compile(compiler_options=FAST_CPU_COMPILE)
    return np.asarray(compiled(**args), np.float32)


@pytest.mark.parametrize(
    "seed, tokens, kind, dtype",
    [(7, 45, "skewed", F32), (8, 37, "random", jnp.bfloat16)],  # M = 90 and 74 rows: not multiples of 16
)
def test_routed_experts_matches_model_path(seed, tokens, kind, dtype):
    from dsv4.moe import routed_experts_jnp

    experts, hidden, inter, top_k = 8, 64, 32, 2
    ids, weights = make_routing(seed, tokens, top_k, experts, kind)
    x = make_weights(seed, (tokens, hidden), dtype, 1.0)
    gate_up = make_weights(seed + 1, (experts, 2 * inter, hidden), dtype)
    down = make_weights(seed + 2, (experts, hidden, inter), dtype)
    got = run_routed(x, ids, weights, gate_up, down)
    assert_close(got, routed_experts_jnp(x, ids, weights, gate_up, down, LIMIT), dtype)
    assert_close(got, routed_experts_reference(x, ids, weights, gate_up, down, LIMIT), dtype)


def test_routed_experts_all_to_one_expert_and_invalid_ids():
    """Every token picks expert 5 (twice: the top-k slots need not be distinct here), except ids -1 and E, which
    sort past every group and contribute nothing."""
    experts, hidden, inter, tokens = 8, 64, 32, 21
    ids = jnp.full((tokens, 2), 5, jnp.int32).at[3, 1].set(-1).at[7, 0].set(experts)
    weights = jnp.asarray(np.random.default_rng(9).random((tokens, 2)), F32)
    x = make_weights(9, (tokens, hidden), F32, 1.0)
    gate_up, down = make_weights(10, (experts, 2 * inter, hidden)), make_weights(11, (experts, hidden, inter))
    got = run_routed(x, ids, weights, gate_up, down, block_sizes=BlockSizes(block_m=16, block_n=32, block_k=64))
    assert_close(got, routed_experts_reference(x, ids, weights, gate_up, down, LIMIT), F32)
    only_slot = routed_experts_reference(x[3:4], ids[3:4, :1], weights[3:4, :1], gate_up, down, LIMIT)
    np.testing.assert_allclose(got[3:4], np.asarray(only_slot), atol=3e-5)


@pytest.mark.parametrize("fp8_activations", [True, False])
def test_routed_experts_fp8(fp8_activations):
    experts, hidden, inter, tokens, top_k = 4, 256, 128, 29, 3
    ids, weights = make_routing(12, tokens, top_k, experts)
    x = make_weights(12, (tokens, hidden), jnp.bfloat16, 1.0)
    gate_up, gate_up_scales = quantize_weights(make_weights(13, (experts, 2 * inter, hidden), F32, 0.1))
    down, down_scales = quantize_weights(make_weights(14, (experts, hidden, inter), F32, 0.1))
    scales = dict(gate_up_scales=gate_up_scales, down_scales=down_scales)
    got = run_routed(x, ids, weights, gate_up, down, **scales, fp8_activations=fp8_activations,
                     block_sizes=FP8_BLOCKS)  # fmt: skip
    want = np.asarray(routed_experts_reference(x, ids, weights, gate_up, down, LIMIT, **scales,
                                               fp8_activations=fp8_activations), np.float32)  # fmt: skip
    assert_close(got, want, jnp.bfloat16)
    if fp8_activations:  # x quantized by the caller (expert parallelism sends it so): the same GEMM inputs
        xq, xs = quantize_per_token_group(x)
        pre = run_routed(xq, ids, weights, gate_up, down, **scales, x_scales=xs, block_sizes=FP8_BLOCKS,
                         out_dtype=jnp.bfloat16)  # fmt: skip
        np.testing.assert_array_equal(pre, got)
    # The reference compiled as XLA:GPU compiles it (float convert chains folded) must still round x and h as the
    # kernel path does: without the barriers in it, W8A8 is 4 % off here, as on H200 (the 4.48 % of M9).
    args = (x, ids, weights, gate_up, down)
    folded = compile_folding_fp_conversions(routed_experts_reference, *args, LIMIT, **scales,
                                            fp8_activations=fp8_activations)  # fmt: skip
    assert_close(got, np.asarray(folded(*args, **scales), np.float32), jnp.bfloat16)
    # Against the unquantized path on the dequantized weights: the error is the activation quantization.
    w1 = dequantize_blocks(gate_up, gate_up_scales, (QUANT_BLOCK, QUANT_BLOCK)).astype(jnp.bfloat16)
    w2 = dequantize_blocks(down, down_scales, (QUANT_BLOCK, QUANT_BLOCK)).astype(jnp.bfloat16)
    plain = np.asarray(routed_experts_reference(x, ids, weights, w1, w2, LIMIT), np.float32)
    relative_rms = np.linalg.norm(got - plain) / np.linalg.norm(plain)
    assert relative_rms < (0.10 if fp8_activations else 0.01), relative_rms


# ---------------------------------------------------------------------------------------------
# References and formats.
# ---------------------------------------------------------------------------------------------
def test_reference_matches_model_jnp_path():
    from dsv4.moe import routed_experts_jnp

    experts, hidden, inter = 8, 64, 32
    ids, weights = make_routing(15, 30, 3, experts)
    x = make_weights(15, (30, hidden), F32, 1.0)
    gate_up, down = make_weights(16, (experts, 2 * inter, hidden)), make_weights(17, (experts, hidden, inter))
    model = routed_experts_jnp(x, ids, weights, gate_up, down, LIMIT)
    np.testing.assert_allclose(np.asarray(routed_experts_reference(x, ids, weights, gate_up, down, LIMIT)),
                               np.asarray(model), atol=3e-5)  # fmt: skip


def test_quantize_per_token_group():
    x = make_weights(18, (5, 256), F32, 3.0).at[2, 128:].set(0.0)  # one all-zero group
    values, scales = quantize_per_token_group(x)
    assert values.dtype == FP8 and scales.shape == (5, 2) and np.isfinite(np.asarray(scales)).all()
    back = np.asarray(dequantize_blocks(values, scales, (1, QUANT_BLOCK)))
    np.testing.assert_allclose(back, np.asarray(x), rtol=2**-4, atol=1e-6)  # e4m3: 3 mantissa bits, half a step
    assert (back[2, 128:] == 0).all()
    amax = np.abs(np.asarray(x)).reshape(5, 2, 128).max(-1)
    np.testing.assert_allclose(np.abs(back).reshape(5, 2, 128).max(-1), amax, rtol=1e-6)  # amax ↦ 448 exactly
    _, pow2 = quantize_per_token_group(x, pow2_scale=True)
    np.testing.assert_array_equal(np.log2(np.asarray(pow2)) % 1, 0)


# ---------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(block_m=8), "block_m=8"), (dict(block_n=48), "block_n=48"), (dict(block_k=0), "block_k=0"),
     (dict(num_warps=3), "num_warps=3"), (dict(num_stages=0), "num_stages=0")],
)  # fmt: skip
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_input_validation_names_shapes():
    x, sizes = jnp.zeros((10, 64), F32), jnp.asarray([4, 6], jnp.int32)
    gate_up, down = jnp.zeros((2, 64, 64), F32), jnp.zeros((2, 64, 32), F32)
    with pytest.raises(ValueError, match=r"gate_up.shape=\(2, 64, 48\) does not fit x_sorted.shape=\(10, 64\)"):
        grouped_gate_up(x, jnp.zeros((2, 64, 48), F32), sizes, limit=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes must be int32 \[E\] = \(2,\)"):
        grouped_gate_up(x, gate_up, jnp.asarray([10], jnp.int32), limit=1.0, interpret=True)
    with pytest.raises(ValueError, match="x_sorted.dtype=bfloat16 and gate_up.dtype=float32 differ"):
        grouped_gate_up(x.astype(jnp.bfloat16), gate_up, sizes, limit=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"needs N and K multiples of 128"):
        grouped_down(jnp.zeros((10, 32), jnp.bfloat16), down.astype(FP8), sizes, interpret=True)
    fp8_down = jnp.zeros((2, 128, 128), FP8)
    with pytest.raises(ValueError, match=r"needs float32 scales \(2, 1, 1\), got None"):
        grouped_down(jnp.zeros((10, 128), jnp.bfloat16), fp8_down, sizes, interpret=True)
    with pytest.raises(ValueError, match=r"per-token scales \(10, 1\)"):
        grouped_down(jnp.zeros((10, 128), FP8), fp8_down, sizes, down_scales=jnp.ones((2, 1, 1)), interpret=True)
    with pytest.raises(ValueError, match="block_n=128 and block_k=256 to divide 128"):
        grouped_down(jnp.zeros((10, 256), jnp.bfloat16), jnp.zeros((2, 128, 256), FP8), sizes,
                     down_scales=jnp.ones((2, 1, 2)), block_sizes=BlockSizes(block_k=256), interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"output width 48 and reduction width 64 must be multiples"):
        grouped_down(jnp.zeros((10, 64), F32), jnp.zeros((2, 48, 64), F32), sizes, interpret=True)
    with pytest.raises(ValueError, match=r"down.shape=\(2, 64, 16\) must be \(E, D, I\) = \(2, 64, 32\)"):
        routed_experts(x, jnp.zeros((10, 2), jnp.int32), jnp.ones((10, 2)), gate_up, jnp.zeros((2, 64, 16)), 1.0)
    ids2, w2 = jnp.zeros((10, 2), jnp.int32), jnp.ones((10, 2))
    xq, gq, dq = jnp.zeros((10, 128), FP8), jnp.zeros((2, 256, 128), FP8), jnp.zeros((2, 128, 128), FP8)
    fp8 = dict(gate_up_scales=jnp.ones((2, 2, 1)), down_scales=jnp.ones((2, 1, 1)), out_dtype=F32)
    with pytest.raises(ValueError, match=r"pre-quantized x needs x_scales float32 \(10, 1\), got None"):
        routed_experts(xq, ids2, w2, gq, dq, 1.0, **fp8)
    with pytest.raises(ValueError, match=r"only W8A8 takes .* fp8_activations=False"):
        routed_experts(xq, ids2, w2, gq, dq, 1.0, **fp8, x_scales=jnp.ones((10, 1)), fp8_activations=False)
    with pytest.raises(ValueError, match="x_scales given but x is bfloat16"):
        routed_experts(xq.astype(jnp.bfloat16), ids2, w2, gq, dq, 1.0, **fp8, x_scales=jnp.ones((10, 1)))


# ---------------------------------------------------------------------------------------------
# Triton lowering (runs on CPU: lowers for an abstract H200, builds and verifies the Triton module; no ptxas).
# ---------------------------------------------------------------------------------------------
I32_OFFSETS_MAX_ELEMENTS = 2**31  # i32 element offsets (signed) address at most this many elements


def addptr_offset_bits(module_text):
    """→ {kernel argument index: set of bit widths of the offsets that `tt.addptr` adds to that argument's pointer}.

    Every addptr must start from an argument, directly or through `tt.splat` (the lowering's pattern), so a changed
    pattern fails here instead of escaping the check."""
    splat_of = dict(re.findall(r"(%\w+) = tt\.splat %arg(\d+) ", module_text))
    widths = {}
    adds = re.findall(r"tt\.addptr (%\w+), %\w+ : \S+, (?:tensor<[\dx]*)?i(\d+)>?", module_text)
    assert adds and len(adds) == module_text.count("tt.addptr")
    for base, bits in adds:
        arg = int(base[4:]) if base.startswith("%arg") else int(splat_of[base])
        widths.setdefault(arg, set()).add(int(bits))
    return widths


@pytest.mark.parametrize("mode", ["bf16", "w8a16", "w8a8", "w8a8-long"])
def test_lowers_to_triton_at_v4_shapes(mode, monkeypatch):
    """Both kernels lower for an abstract H200 at V4-Flash expert shapes, with 2 / 1 `tt.dot`, fp8 × fp8 only in
    W8A8, and i64 offsets for every operand of more than 2^31 elements.

    The last check is the GPU fault of W8A8 at these shapes (docs/kernels/moe.md): the fp8 gate_up
    [256, 4096, 4096] is 2^32 elements in 2^32 bytes, which JAX's lowering addressed with i32 offsets (it switches
    to i64 only above 2^32 *bytes*), so experts >= 128 read below the array. "w8a8-long" (100K tokens) puts the fp8
    activations x [600K, 4096] past 2^31 elements too."""
    from dsv4.pallas._jax_compat import triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(jaxpr, grid_mapping, *args, **kwargs):
        result = original(jaxpr, grid_mapping, *args, **kwargs)
        modules.append((result, [bm.array_aval for bm in grid_mapping.block_mappings]))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
    sds = jax.ShapeDtypeStruct
    tokens = 100_000 if mode == "w8a8-long" else 1000
    mode = mode.removesuffix("-long")
    experts, hidden, inter, rows = 256, 4096, 2048, 6 * tokens  # V4-Flash experts, top-6
    weight_dtype = jnp.bfloat16 if mode == "bf16" else FP8
    act_dtype = FP8 if mode == "w8a8" else jnp.bfloat16
    block_sizes = BlockSizes()  # block_k 64 for bf16 weights, 128 for fp8
    gate_up = dict(x_sorted=sds((rows, hidden), act_dtype), gate_up=sds((experts, 2 * inter, hidden), weight_dtype),
                   group_sizes=sds((experts,), jnp.int32))  # fmt: skip
    down = dict(h=sds((rows, inter), act_dtype), down=sds((experts, hidden, inter), weight_dtype),
                group_sizes=sds((experts,), jnp.int32), row_weights=sds((rows,), F32))  # fmt: skip
    if mode != "bf16":
        gate_up["gate_up_scales"] = sds((experts, 2 * inter // 128, hidden // 128), F32)
        down["down_scales"] = sds((experts, hidden // 128, inter // 128), F32)
    if mode == "w8a8":
        gate_up["x_scales"], down["h_scales"] = sds((rows, hidden // 128), F32), sds((rows, inter // 128), F32)

    for entry, arrays, static in [(grouped_gate_up, gate_up, dict(limit=10.0)), (grouped_down, down, {})]:
        names = tuple(arrays)

        def fn(*values, entry=entry, names=names, static=static):
            return entry(**dict(zip(names, values)), **static, block_sizes=block_sizes)

        with abstract_gpu_mesh():
            hlo = jax.jit(fn).trace(*arrays.values()).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in hlo
    tiles = (rows + 63 * (experts + 1)) // 64  # the static tile bound at block_m = 64
    [(gate_up_module, gate_up_avals), (down_module, down_avals)] = modules
    wide = []
    for result, avals, col_tiles, dots in [(gate_up_module, gate_up_avals, inter // 128, 2),
                                           (down_module, down_avals, hidden // 128, 1)]:  # fmt: skip
        assert result.module.operation.verify()
        assert list(result.grid) == [tiles * col_tiles]
        text = str(result.module)
        assert text.count("tt.dot") == dots
        assert ("xf8E4M3FN> * tensor" in text) == (mode == "w8a8")  # fp8 × fp8 tensor-core dot only in W8A8
        # fp8 × fp8 dots accumulate a whole K step in the tensor core (BlockSizes.fp8_fast_accum)
        assert text.count("maxNumImpreciseAcc = 1073741824") == (dots if mode == "w8a8" else 0)
        if mode != "bf16":  # fp8 weights: one 128-wide K step per weight-scale block
            assert f"tensor<128x{QUANT_BLOCK}x!tt.ptr<f8E4M3FN>>" in text
        for arg, bits in addptr_offset_bits(text).items():
            if math.prod(avals[arg].shape) > I32_OFFSETS_MAX_ELEMENTS:
                wide.append(avals[arg])
                assert bits == {64}, f"{avals[arg]} (argument {arg}) addressed with i{min(bits)} offsets"
    assert any(a.shape == (experts, 2 * inter, hidden) for a in wide)  # the check ran on the weights
    if tokens > 87_381:  # 6 · tokens · 4096 > 2^31
        assert any(a.shape == (rows, hidden) for a in wide)


@pytest.mark.parametrize("fast", [True, False])
def test_fp8_fast_accum_only_on_this_files_fp8_dots(fast, monkeypatch):
    """BlockSizes.fp8_fast_accum sets maxNumImpreciseAcc = 2^30 on the W8A8 dot (Triton's sm90 default for
    `tl.dot`), False keeps Pallas's 0; other Pallas kernels (here a plain fp8 matmul) keep 0."""
    from jax.experimental import pallas as pl

    from dsv4.pallas._jax_compat import triton_lowering

    texts = {}
    original = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(*args, **kwargs):
        result = original(*args, **kwargs)
        texts[str(result.module.operation.attributes["sym_name"]).strip('"')] = str(result.module)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
    sds = jax.ShapeDtypeStruct
    rows, experts, hidden, inter = 128, 4, 256, 128
    arrays = dict(h=sds((rows, inter), FP8), h_scales=sds((rows, 1), F32), group_sizes=sds((experts,), jnp.int32),
                  down=sds((experts, hidden, inter), FP8), down_scales=sds((experts, 2, 1), F32))  # fmt: skip

    def other_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=F32)

    def fn(h, h_scales, group_sizes, down, down_scales):
        y = grouped_down(h, down, group_sizes, h_scales=h_scales, down_scales=down_scales,
                         block_sizes=BlockSizes(fp8_fast_accum=fast))  # fmt: skip
        other = pl.pallas_call(other_kernel, out_shape=sds((64, 64), F32), name="other")(h[:64, :64], h[64:, :64].T)
        return y, other

    with abstract_gpu_mesh():
        jax.jit(fn).trace(*arrays.values()).lower(lowering_platforms=("cuda",))
    down_text = texts["grouped_down" if fast else "grouped_down_fp8_promote32"]
    assert down_text.count("xf8E4M3FN> * tensor") == 1
    assert down_text.count("maxNumImpreciseAcc = 1073741824") == (1 if fast else 0)
    assert "xf8E4M3FN> * tensor" in texts["other"] and "maxNumImpreciseAcc" not in texts["other"]


# ---------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernels at moderate V4-like shapes (the dense reference is E× the work).
# ---------------------------------------------------------------------------------------------
@gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["bf16", "w8a16", "w8a8"])
def test_gpu_routed_experts_matches_reference(mode):
    experts, hidden, inter, tokens, top_k = 32, 1024, 512, 700, 6
    ids, weights = make_routing(19, tokens, top_k, experts)
    x = make_weights(19, (tokens, hidden), jnp.bfloat16, 1.0)
    gate_up = make_weights(20, (experts, 2 * inter, hidden), F32, 0.05)
    down = make_weights(21, (experts, hidden, inter), F32, 0.05)
    kw = dict(block_sizes=BlockSizes(block_k=128 if mode != "bf16" else 64))
    if mode == "bf16":
        gate_up, down = gate_up.astype(jnp.bfloat16), down.astype(jnp.bfloat16)
    else:
        (gate_up, kw["gate_up_scales"]), (down, kw["down_scales"]) = quantize_weights(gate_up), quantize_weights(down)
        kw["fp8_activations"] = mode == "w8a8"
    got = np.asarray(routed_experts(x, ids, weights, gate_up, down, LIMIT, **kw), np.float32)
    kw.pop("block_sizes")
    want = np.asarray(routed_experts_reference(x, ids, weights, gate_up, down, LIMIT, **kw), np.float32)
    assert not np.isnan(got).any()
    if mode == "w8a8":
        # h is re-quantized to fp8 between the GEMMs; the compiled kernel's accumulation order differs from
        # the reference's, so an h value near an fp8 rounding boundary can land one fp8 step away, which moves
        # a few outputs by a whole step (seen on H200: 342 of 716,800, by ~1.06). Judge it statistically.
        assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 1e-2
        assert np.mean(np.abs(got - want) > 2**-5 * np.abs(want).max()) < 1e-3
    else:
        np.testing.assert_allclose(got, want, atol=2**-5 * np.abs(want).max(), rtol=0)


@gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_gpu_gate_up_v4_flash_weights_past_2_31_elements(mode):
    """The GPU fault (docs/kernels/moe.md): the real V4-Flash fp8 gate_up [256, 4096, 4096] (2^32
    elements), rows routed to experts on both sides of 128 (expert · 2^24 crosses 2^31 there). The reference runs on
    the used experts' slices only, so it does not do the 256× dense work."""
    experts, hidden, inter = 256, 4096, 2048
    used = np.array([0, 127, 128, 200, 255])
    sizes = np.zeros(experts, np.int32)
    sizes[used] = [40, 17, 64, 33, 50]
    rows = int(sizes.sum())
    # fp8 bits with the exponent's top bit cleared: |w| < 2, never NaN; built on the device (4 GiB)
    bits = jax.random.bits(jax.random.key(22), (experts, 2 * inter, hidden), jnp.uint8) & jnp.uint8(0xBF)
    gate_up = jax.lax.bitcast_convert_type(bits, FP8)
    del bits
    scales = jax.random.uniform(jax.random.key(23), (experts, 2 * inter // 128, hidden // 128), F32, 0.005, 0.02)
    x = make_weights(24, (rows, hidden), jnp.bfloat16, 1.0)
    arrays = dict(x_sorted=x, group_sizes=jnp.asarray(sizes), gate_up=gate_up, gate_up_scales=scales)
    if mode == "w8a8":
        arrays["x_sorted"], arrays["x_scales"] = quantize_per_token_group(x)
    got = np.asarray(grouped_gate_up(**arrays, limit=LIMIT), np.float32)
    small = dict(arrays, group_sizes=jnp.asarray(sizes[used]), gate_up=gate_up[used], gate_up_scales=scales[used])
    want = np.asarray(grouped_gate_up_reference(**small, limit=LIMIT), np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=2**-6 * np.abs(want).max(), rtol=2**-6)
