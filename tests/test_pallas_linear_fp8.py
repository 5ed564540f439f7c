"""dsv4.pallas.linear_fp8 (W8A8 linear layers on the grouped-GEMM kernels with one group) and its route in the model
(`dsv4.layers.project`, `Kernels.dense`), against `linear_w8a8_reference`.

CPU: the Triton kernel interpreted (rows not a multiple of its tiles, leading batch axes); the Mosaic GPU kernel in
its interpreter, whose buffers start as NaN, on rows padded to its 128-row tiles; the lowering for an abstract H200 at
V4-Flash's q_b shape; `project` choosing the route by the weight's form; refusals. GPU-marked: the default route on
Hopper. Tolerance: bf16 outputs of float32 sums taken in another order, rtol 2^-7 + atol 1e-3 of the largest value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gpu_mesh import abstract_gpu_mesh
from test_pallas_moe import make_weights, quantize_weights

import dsv4.layers as layers
from dsv4.layers import linear, project, project_shared
from dsv4.pallas.linear_fp8 import (
    linear_w8a8,
    linear_w8a8_reference,
    linear_w8a8_stacked,
    quantize_rows,
    stacked_w8a8_unsupported,
)
from dsv4.quantization import BlockQuantized, quantize_fp4

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32


def _case(seed, rows_shape, n, k):
    x = make_weights(seed, (*rows_shape, k), jnp.bfloat16, 1.0)
    q, scale = quantize_weights(make_weights(seed + 1, (1, n, k), F32, 0.05))
    return x, q[0], scale[0]


def _assert_close(got, want):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-3 * np.abs(want).max())


def test_triton_interpreted_matches_reference():
    x, q, scale = _case(0, (2, 37), 384, 256)  # 74 rows: not a multiple of the 64-row tiles; N 384: Triton only
    got = linear_w8a8(x, q, scale, impl="triton", interpret=True)
    assert got.shape == (2, 37, 384) and got.dtype == jnp.bfloat16
    _assert_close(got, linear_w8a8_reference(x, q, scale))


def test_mgpu_interpreted_matches_reference():
    x, q, scale = _case(3, (1, 150), 256, 384)  # 150 rows padded to two 128-row tiles; 3 K steps
    got = linear_w8a8(x, q, scale, impl="mgpu", interpret=True)
    assert got.shape == (1, 150, 256)
    _assert_close(got, linear_w8a8_reference(x, q, scale))


def test_reference_is_w8a8():
    """The reference quantizes x (per token and 128-group): it differs from the dequantized weight's bf16 product by
    about e4m3's rounding, and equals it where x is exactly representable."""
    x, q, scale = _case(5, (9,), 128, 256)
    w = BlockQuantized(q, scale, "fp8", (128, 128), (128, 256), "bfloat16")[...]
    # amax 7 in every group: scale 7 / 448 = 2^-6, and x · 2^6 in {0, ±32, ±64, ±128, ±256, ±448} is exact in e4m3
    values = np.array([0, 0.5, -0.5, 1, -1, 2, -2, 4, -4, 7, -7], np.float32)
    exact = np.random.default_rng(6).choice(values, x.shape)
    exact[:, ::128] = 7.0
    exact = jnp.asarray(exact, jnp.bfloat16)
    want = np.asarray(linear(exact, w), F32)
    np.testing.assert_allclose(np.asarray(linear_w8a8_reference(exact, q, scale), F32), want, rtol=2**-7,
                               atol=2**-7 * np.abs(want).max())  # fmt: skip
    far = np.abs(np.asarray(linear_w8a8_reference(x, q, scale), F32) - np.asarray(linear(x, w), F32)).max()
    assert 0 < far < 0.1 * np.abs(np.asarray(linear(x, w), F32)).max()


def test_lowers_for_h200_at_v4_shape():
    """V4-Flash's q_b: [16384, 1024] · [32768, 1024]ᵀ on the Mosaic GPU kernel."""
    sds = jax.ShapeDtypeStruct
    args = (sds((1, 16384, 1024), jnp.bfloat16), sds((32768, 1024), FP8), sds((256, 8), F32))
    with abstract_gpu_mesh():
        text = jax.jit(lambda x, q, s: linear_w8a8(x, q, s, impl="mgpu", interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()  # fmt: skip
    assert "mosaic_gpu" in text


def test_project_routes_by_weight_form():
    x, q, scale = _case(7, (1, 20), 256, 128)
    fp8 = nnx.Param(BlockQuantized(q, scale, "fp8", (128, 128), (256, 128), "bfloat16"))
    dequantized = fp8[...]
    np.testing.assert_array_equal(np.asarray(project(x, fp8, "jnp")), np.asarray(linear(x, dequantized)))
    _assert_close(project(x, fp8, "pallas"), linear_w8a8_reference(x, q, scale))
    # weights in the compute dtype, and FP4 ones, take the dot on the dequantized values
    plain = nnx.Param(dequantized)
    np.testing.assert_array_equal(np.asarray(project(x, plain, "pallas")), np.asarray(linear(x, dequantized)))
    packed, s4 = quantize_fp4(np.asarray(dequantized, np.float32))
    fp4 = nnx.Param(BlockQuantized(jnp.asarray(packed), jnp.asarray(s4), "fp4", (1, 32), (256, 128), "bfloat16"))
    np.testing.assert_array_equal(np.asarray(project(x, fp4, "pallas")), np.asarray(linear(x, fp4[...])))


@pytest.mark.parametrize("impl, rows, ns, k", [("triton", (2, 37), (128, 384), 256),
                                               ("mgpu", (1, 150), (256, 512), 384)])  # fmt: skip
def test_stacked_weights_give_each_weight_alone_bit_for_bit(impl, rows, ns, k):
    """One GEMM over weights stacked along N (x quantized once) writes each weight's own W8A8 output in its columns,
    bit for bit: every output column is the same K sum in the same order."""
    x = make_weights(20, (*rows, k), jnp.bfloat16, 1.0)
    weights = [tuple(a[0] for a in quantize_weights(make_weights(21 + i, (1, n, k), F32, 0.05)))
               for i, n in enumerate(ns)]  # fmt: skip
    got = np.asarray(linear_w8a8_stacked(x, weights, impl=impl, interpret=True), F32)
    assert got.shape == (*rows, sum(ns)) and not np.isnan(got).any()
    alone = [np.asarray(linear_w8a8(x, q, s, impl=impl, interpret=True), F32) for q, s in weights]
    np.testing.assert_array_equal(got, np.concatenate(alone, -1))


def test_project_shared_stacks_fp8_weights_of_one_x_from_enough_rows(monkeypatch):
    """`project_shared` (wq_a with wkv, the shared expert's w1 with w3) runs one stacked GEMM where every weight is FP8
    in 128-blocks and x has `STACK_MIN_ROWS` rows, with `project`'s outputs; else one `project` a weight."""
    x = make_weights(30, (1, 40, 256), jnp.bfloat16, 1.0)
    fp8 = []
    for i, n in enumerate((384, 128)):
        q, scale = quantize_weights(make_weights(31 + i, (1, n, 256), F32, 0.05))
        fp8.append(nnx.Param(BlockQuantized(q[0], scale[0], "fp8", (128, 128), (n, 256), "bfloat16")))
    calls = []
    count = lambda *a, **kw: calls.append(1) or linear_w8a8_stacked(*a, **kw)  # noqa: E731
    monkeypatch.setattr(layers, "linear_w8a8_stacked", count)
    alone = [np.asarray(project(x, w, "pallas")) for w in fp8]

    def run(weights, impl="pallas"):
        calls.clear()
        return [np.asarray(y) for y in project_shared(x, weights, impl)], len(calls)

    monkeypatch.setattr(layers, "STACK_MIN_ROWS", 40)
    got, stacked = run(fp8)
    assert stacked == 1 and [y.shape for y in got] == [(1, 40, 384), (1, 40, 128)]
    for g, a in zip(got, alone, strict=True):
        np.testing.assert_array_equal(g, a)
    assert run(fp8, "jnp")[1] == 0  # the dequantized route: one dot a weight
    plain = [fp8[0], nnx.Param(fp8[1][...])]  # one weight not FP8: each on its own route
    got, stacked = run(plain)
    assert stacked == 0
    np.testing.assert_array_equal(got[1], np.asarray(linear(x, fp8[1][...])))
    monkeypatch.setattr(layers, "STACK_MIN_ROWS", 41)  # fewer rows (decode steps): no stacking copy
    got, stacked = run(fp8)
    assert stacked == 0
    for g, a in zip(got, alone, strict=True):
        np.testing.assert_array_equal(g, a)


def _fp8_moe(d: int, i: int, e: int, k: int, *, seed: int):
    """A bf16 MoE on the Pallas kernels with every weight FP8 in 128-blocks (routed experts, shared w1, w3, w2), W8A8
    dense layers."""
    from dsv4.config import Config
    from dsv4.moe import MoE

    cfg = Config.preset("tiny").replace(hidden_size=d, moe_intermediate_size=i, n_routed_experts=e,
                                        num_experts_per_tok=k, swiglu_limit=7.0)  # fmt: skip
    moe = MoE(cfg, "moe", rngs=nnx.Rngs(1), dtype=jnp.bfloat16, moe_impl="pallas", dense_impl="pallas")
    sh = moe.shared_experts
    parts = ((moe.experts, "gate_up_proj", (e, 2 * i, d)), (moe.experts, "down_proj", (e, d, i)),
             (sh["gate_proj"], "weight", (1, i, d)), (sh["up_proj"], "weight", (1, i, d)),
             (sh["down_proj"], "weight", (1, d, i)))  # fmt: skip
    for n, (holder, name, shape) in enumerate(parts):
        q, scale = quantize_weights(make_weights(seed + n, shape, F32, 0.1 * (256 / d) ** 0.5))
        if shape[0] == 1:
            q, scale, shape = q[0], scale[0], shape[1:]
        holder[name].set_value(BlockQuantized(q, scale, "fp8", (128, 128), shape, "bfloat16"))
    return moe


def test_moe_quantizes_x_once_for_its_w8a8_experts_and_stacked_shared_expert(monkeypatch):
    """With W8A8 routed experts and FP8 shared gate and up projections, the MoE quantizes x once for the experts and
    one stacked shared GEMM (`project_shared`'s), and its output is the one of each quantizing x on its own, bit for
    bit; with too few rows each quantizes its own x."""
    import dsv4.moe as moe_module

    d = 256
    moe = _fp8_moe(d, 128, 8, 3, seed=40)
    x = make_weights(44, (1, 29, d), jnp.bfloat16, 1.0)
    tokens = jnp.arange(29, dtype=jnp.int32)[None]
    quantized = []
    monkeypatch.setattr(moe_module, "quantize_rows", lambda x_: quantized.append(1) or quantize_rows(x_))

    monkeypatch.setattr(layers, "STACK_MIN_ROWS", 30)  # 29 rows: each quantizes its own x
    separate = np.asarray(moe(x, tokens), F32)
    assert quantized == []
    monkeypatch.setattr(layers, "STACK_MIN_ROWS", 29)
    once = np.asarray(moe(x, tokens), F32)
    assert quantized == [1] and not np.isnan(once).any()
    np.testing.assert_array_equal(once, separate)


def test_stacking_refusals_name_the_problem():
    w = lambda n, k: (jnp.zeros((n, k), FP8), jnp.ones((n // 128, k // 128), F32))  # noqa: E731
    assert stacked_w8a8_unsupported([w(256, 256), w(512, 256)]) == ""
    assert "different K" in stacked_w8a8_unsupported([w(256, 256), w(256, 384)])
    assert "multiples of 256" in stacked_w8a8_unsupported([w(256, 256), w(128, 256)])  # 256 alone runs on Mosaic
    assert stacked_w8a8_unsupported([w(128, 256), w(128, 256)]) == ""  # neither alone does; 256 together does
    assert "fewer than two" in stacked_w8a8_unsupported([w(256, 256)])
    with pytest.raises(ValueError, match="different K"):
        linear_w8a8_stacked(jnp.zeros((4, 256), jnp.bfloat16), [w(256, 256), w(256, 384)], interpret=True)


def test_dense_resolves_to_w8a8_on_hopper_for_16_bit_models():
    """`Kernels.dense="auto"` runs W8A8 where it was measured faster (the Mosaic kernel, Hopper) for bf16 / f16
    models; a float32 model, another GPU, or the CPU keeps the dequantized weights' dot; an explicit choice stays."""
    from dsv4 import Kernels

    assert Kernels().resolve(jnp.bfloat16, gpu=True, hopper=True).dense == "pallas"
    assert Kernels().resolve(jnp.float16, gpu=True, hopper=True).dense == "pallas"
    assert Kernels().resolve(jnp.float32, gpu=True, hopper=True).dense == "jnp"
    assert Kernels().resolve(jnp.bfloat16, gpu=True, hopper=False).dense == "jnp"
    assert Kernels().resolve(jnp.bfloat16, gpu=False).dense == "jnp"
    assert Kernels(dense="jnp").resolve(jnp.bfloat16, gpu=True, hopper=True).dense == "jnp"


@pytest.mark.parametrize("args, match", [
    (dict(n=200), "multiples of 128"),
    (dict(impl="mgpu", n=384), "N a multiple of 256"),
    (dict(impl="cuda"), "impl='cuda'"),
    (dict(k_x=128), r"x \[..., 128\] does not fit"),
    (dict(x_dtype=F32), "bfloat16 or float16"),
    (dict(scale_shape=(2, 1)), "float32 \\(2, 2\\)"),
])  # fmt: skip
def test_refusals_name_the_problem(args, match):
    n, k = args.get("n", 256), 256
    x = jnp.zeros((4, args.get("k_x", k)), args.get("x_dtype", jnp.bfloat16))
    q = jnp.zeros((n, k), FP8)
    scale = jnp.ones(args.get("scale_shape", (-(-n // 128), k // 128)), F32)
    with pytest.raises(ValueError, match=match):
        linear_w8a8(x, q, scale, impl=args.get("impl", "auto"), interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_default_route_matches_reference():
    """The default route (Mosaic on Hopper) at a shape with several row, column and K tiles and a partial row tile."""
    x, q, scale = _case(11, (700,), 512, 1024)
    _assert_close(linear_w8a8(x, q, scale), linear_w8a8_reference(x, q, scale))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_stacked_projections_and_shared_quantization_equal_separate(monkeypatch):
    """At V4-Flash's widths and a 2048-token chunk on the default route: wq_a with wkv stacked (N = 1024 + 512), and
    the MoE's x quantized once for W8A8 experts and the stacked shared w1 | w3, equal the separate calls bit for bit."""
    d = 4096
    x = make_weights(50, (1, 2048, d), jnp.bfloat16, 1.0)
    ws = []
    for i, n in enumerate((1024, 512)):
        q, scale = quantize_weights(make_weights(51 + i, (1, n, d), F32, 0.05))
        ws.append(nnx.Param(BlockQuantized(q[0], scale[0], "fp8", (128, 128), (n, d), "bfloat16")))
    stacked = project_shared(x, ws, "pallas")
    for got, w in zip(stacked, ws, strict=True):
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(project(x, w, "pallas"), F32))

    moe = _fp8_moe(d, 2048, 8, 4, seed=60)
    tokens = jnp.arange(2048, dtype=jnp.int32)[None]
    once = np.asarray(moe(x, tokens), F32)
    monkeypatch.setattr(layers, "STACK_MIN_ROWS", 1 << 30)
    separate = np.asarray(moe(x, tokens), F32)
    assert np.isfinite(once).all()
    np.testing.assert_array_equal(once, separate)
