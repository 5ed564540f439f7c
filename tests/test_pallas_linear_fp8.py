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

from dsv4.layers import linear, project
from dsv4.pallas.linear_fp8 import linear_w8a8, linear_w8a8_reference
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
