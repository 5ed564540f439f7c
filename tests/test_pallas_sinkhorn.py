"""dsv4/pallas/sinkhorn.py: the mHC Sinkhorn kernel against its jnp reference (interpret mode on CPU, compiled on a
GPU), its Triton lowering for an abstract H200, and the reference against a float64 numpy Sinkhorn written here.
The Mosaic GPU form (`sinkhorn_mgpu`) runs in the Mosaic GPU interpreter, whose buffers start as NaN (so a token the
kernel does not write stays NaN), and lowers for an abstract H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.pallas.sinkhorn import MgpuSinkhornConfig, SinkhornBlocks, sinkhorn, sinkhorn_mgpu, sinkhorn_reference

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")
EPS = 1e-6


def random_comb(seed: int, shape, hc: int) -> jax.Array:
    """Positive matrices as the model makes them: softmax over the last axis of scaled logits, plus eps."""
    logits = jax.random.normal(jax.random.key(seed), (*shape, hc, hc)) * 3.0
    return jax.nn.softmax(logits, axis=-1) + EPS


def numpy_sinkhorn(comb: np.ndarray, iters: int, eps: float) -> np.ndarray:
    c = comb.astype(np.float64)
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c


@pytest.mark.parametrize("iters", [1, 20])
def test_reference_is_sinkhorn(iters):
    comb = random_comb(0, (2, 5), 4)
    got = np.asarray(sinkhorn_reference(comb, iters, EPS))
    np.testing.assert_allclose(got, numpy_sinkhorn(np.asarray(comb), iters, EPS), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got.sum(axis=-2), 1.0, atol=1e-5)  # every round ends on the columns


@pytest.mark.parametrize("shape, hc, iters, block_tokens", [
    ((3, 37), 4, 3, 32),    # 111 tokens: 4 blocks, the last one masked
    ((1, 5), 4, 6, 256),    # fewer tokens than a block (V4's 20 iterations: the GPU tests; ~1.5 s each here)
    ((2, 9), 2, 4, 8),      # another hc
])  # fmt: skip
def test_kernel_matches_reference(shape, hc, iters, block_tokens):
    comb = random_comb(hash((shape, hc)) % 1000, shape, hc)
    want = np.asarray(sinkhorn_reference(comb, iters, EPS))
    got = np.asarray(sinkhorn(comb, iters, EPS, blocks=SinkhornBlocks(block_tokens), interpret=True))
    assert got.shape == comb.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_kernel_writes_every_token():
    """NaN inputs everywhere but the real tokens cannot leak: every output is the token's own normalization (a
    kernel that skipped a block or a lane would leave zeros or copy the wrong token, and fail the comparison)."""
    comb = random_comb(3, (67,), 4)
    comb = comb.at[::7].set(jnp.nan)  # these tokens' outputs are NaN, the others must not be
    got = np.asarray(sinkhorn(comb, 2, EPS, blocks=SinkhornBlocks(16), interpret=True))
    want = np.asarray(sinkhorn_reference(comb, 2, EPS))
    nan_rows = np.zeros(67, bool)
    nan_rows[::7] = True
    assert np.isnan(got[nan_rows]).all() and not np.isnan(got[~nan_rows]).any()
    np.testing.assert_allclose(got[~nan_rows], want[~nan_rows], rtol=1e-6, atol=1e-7)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"\[\.\.\., hc, hc\]"):
        sinkhorn(jnp.ones((3, 4, 2)), 2, EPS, interpret=True)
    with pytest.raises(ValueError, match="block_tokens=24"):
        SinkhornBlocks(block_tokens=24)
    with pytest.raises(ValueError, match="iters=0"):
        sinkhorn(jnp.ones((3, 4, 4)), 0, EPS, interpret=True)


def test_lowers_to_triton_for_h200(monkeypatch):
    """Lowered for an abstract H200 with a last block that overhangs the tokens (300 = 256 + 44): every one of the
    hc² loads and stores carries a mask. The Triton lowering does not mask an overhanging block by itself, and the
    interpreter drops out-of-bounds writes, so this is the one check a CPU box can make (unmasked, one H200 run of
    16387 tokens came back with NaN in the first block: the last block's stores ran into the next rows)."""
    import re

    from dsv4.pallas._jax_compat import triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module
    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module",
                        lambda *a, **k: modules.append(original(*a, **k)) or modules[-1])  # fmt: skip
    comb = jax.ShapeDtypeStruct((300, 1, 4, 4), jnp.float32)
    with abstract_gpu_mesh():
        hlo = jax.jit(lambda c: sinkhorn(c, 20, EPS)).trace(comb).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "mhc_sinkhorn" in hlo
    text = str(modules[0].module)
    stores, loads = re.findall(r"tt\.store ([^:]*):", text), re.findall(r"tt\.load ([^:]*):", text)
    assert len(stores) == 16 and len(loads) >= 16
    assert all(len(op.split(",")) >= 3 for op in stores + loads), "an unmasked load or store"  # pointer, value / mask


def _mgpu_interpret():
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    return InterpretGPUParams(uninitialized_memory="nan")  # the output buffer starts poisoned


@pytest.mark.parametrize("shape, hc, iters, block_tokens, reciprocal", [
    ((3, 100), 4, 2, 128, False),  # 300 tokens: 3 blocks, the last one padded
    ((1, 5), 3, 3, 256, False),    # fewer tokens than a block, an hc that is not a power of two
    ((2, 33), 4, 20, 128, True),   # a decode step's few tokens, V4's 20 rounds, sums inverted once
])  # fmt: skip
def test_mgpu_interpreter_matches_reference(shape, hc, iters, block_tokens, reciprocal):
    comb = random_comb(hash((shape, hc, "mgpu")) % 1000, shape, hc)
    want = np.asarray(sinkhorn_reference(comb, iters, EPS))
    config = MgpuSinkhornConfig(block_tokens, reciprocal=reciprocal)
    got = np.asarray(sinkhorn_mgpu(comb, iters, EPS, config=config, interpret=_mgpu_interpret()))
    assert got.shape == comb.shape and got.dtype == np.float32 and not np.isnan(got).any()
    # a product by an IEEE reciprocal is within 1.5 ulp of the division: the Triton kernel's tolerance
    np.testing.assert_allclose(got, want, rtol=2e-6 if reciprocal else 1e-6, atol=1e-7)
    if reciprocal:
        exact = np.asarray(sinkhorn_mgpu(comb, iters, EPS, config=MgpuSinkhornConfig(block_tokens),
                                         interpret=_mgpu_interpret()))  # fmt: skip
        assert not np.array_equal(got, exact), "the reciprocal form must round differently somewhere"


@pytest.mark.parametrize("tokens, config", [(16387, MgpuSinkhornConfig()),
                                            (32, MgpuSinkhornConfig(approx_math=True, reciprocal=True))])
def test_mgpu_lowers_for_h200(tokens, config):
    """The Mosaic GPU module builds for an abstract H200 at a prefill chunk's token count (not a block multiple) and
    at a decode step's in the reciprocal form; two rounds suffice, every round lowers the same primitives."""
    comb = jax.ShapeDtypeStruct((tokens, 1, 4, 4), jnp.float32)
    with abstract_gpu_mesh():
        hlo = (jax.jit(lambda c: sinkhorn_mgpu(c, 2, EPS, config=config)).trace(comb)
               .lower(lowering_platforms=("cuda",)).as_text())  # fmt: skip
    assert "mosaic_gpu" in hlo


def test_mgpu_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"\[\.\.\., hc, hc\]"):
        sinkhorn_mgpu(jnp.ones((3, 4, 2)), 2, EPS, interpret=_mgpu_interpret())
    with pytest.raises(ValueError, match="iters=0"):
        sinkhorn_mgpu(jnp.ones((3, 4, 4)), 0, EPS, interpret=_mgpu_interpret())
    with pytest.raises(ValueError, match="block_tokens=192"):
        MgpuSinkhornConfig(block_tokens=192)


@gpu
@requires_gpu
@pytest.mark.parametrize("shape", [(32, 1), (1, 16384 + 3)])
@pytest.mark.parametrize("approx_math, reciprocal", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_mgpu_matches_reference(shape, approx_math, reciprocal):
    """Compiled on Hopper, after a NaN-input run of the same shape (a recycled output buffer then holds NaN wherever
    the kernel fails to write). Approximate divisions get the Triton kernel's tolerance."""
    config = MgpuSinkhornConfig(approx_math=approx_math, reciprocal=reciprocal)
    comb = random_comb(8, shape, 4)
    jax.block_until_ready(sinkhorn_mgpu(jnp.full_like(comb, jnp.nan), 20, EPS, config=config))
    want = np.asarray(sinkhorn_reference(comb, 20, EPS))
    got = np.asarray(sinkhorn_mgpu(comb, 20, EPS, config=config))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


@gpu
@requires_gpu
@pytest.mark.parametrize("shape", [(32, 1), (1, 16384 + 3)])
def test_gpu_matches_reference(shape):
    comb = random_comb(7, shape, 4)
    want = np.asarray(sinkhorn_reference(comb, 20, EPS))
    got = np.asarray(sinkhorn(comb, 20, EPS))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_hyper_connection_takes_the_kernel_when_asked(monkeypatch):
    """A HyperConnection with `Kernels.sinkhorn="pallas"` normalizes by the kernel (interpreted off a GPU) and with
    "jnp" by the reference; its comb is the same either way. "auto" resolves to the kernel on a GPU only."""
    import dsv4.layers as layers
    import dsv4.pallas.sinkhorn as sk
    from dsv4.config import Config

    cfg = Config.preset("tiny").replace(hc_sinkhorn_iters=3)
    from dsv4.kernels import Kernels

    hcs = {impl: layers.HyperConnection(cfg, rngs=np.random.default_rng(0), sinkhorn=impl)
           for impl in ("jnp", "pallas")}  # fmt: skip
    streams = jax.random.normal(jax.random.key(2), (2, 5, cfg.hc_mult, cfg.hidden_size))
    calls, kernel = [], sk.sinkhorn

    def counted(comb, iters, eps, **kw):
        calls.append((comb.shape, kw.get("interpret")))
        return kernel(comb, iters, eps, **kw)

    monkeypatch.setattr(sk, "sinkhorn", counted)
    _, want, _ = hcs["jnp"](streams)
    assert calls == []
    _, got, _ = hcs["pallas"](streams)
    assert calls == [((2, 5, cfg.hc_mult, cfg.hc_mult), jax.default_backend() != "gpu")]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert Kernels().resolve(jnp.float32, gpu=True).sinkhorn == "pallas"
    assert Kernels().resolve(jnp.float32, gpu=False).sinkhorn == "jnp"


def test_sinkhorn_normalize_takes_the_mosaic_kernel_when_asked(monkeypatch):
    """`Kernels.sinkhorn="pallas-mgpu"` reaches `sinkhorn_mgpu` through the model's `sinkhorn_normalize` (the Mosaic
    GPU interpreter off a GPU), with the reference's result."""
    import dsv4.layers as layers
    import dsv4.pallas.sinkhorn as sk
    from dsv4.kernels import Kernels

    comb = random_comb(4, (1, 5), 4)
    calls, kernel = [], sk.sinkhorn_mgpu

    def counted(comb, iters, eps, **kw):
        calls.append(comb.shape)
        return kernel(comb, iters, eps, **kw)

    monkeypatch.setattr(sk, "sinkhorn_mgpu", counted)
    got = layers.sinkhorn_normalize(comb, 2, EPS, "pallas-mgpu")
    assert calls == [(1, 5, 4, 4)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(sinkhorn_reference(comb, 2, EPS)), rtol=1e-6, atol=1e-7)
    assert Kernels().resolve(jnp.bfloat16, gpu=True, hopper=True).sinkhorn == "pallas"
    assert Kernels.parse("sinkhorn=pallas-mgpu").resolve(jnp.bfloat16, gpu=True).sinkhorn == "pallas-mgpu"


@pytest.mark.parametrize("impl, hopper, want", [("pallas", True, "mgpu"), ("pallas", False, "triton"),
                                                ("pallas-triton", True, "triton")])  # fmt: skip
def test_sinkhorn_normalize_picks_the_form_by_device(monkeypatch, impl, hopper, want):
    """On a GPU, "pallas" (the default) runs the Mosaic GPU form on Hopper at any token count (a decode step's too),
    in `layers.SINKHORN_MGPU_CONFIG`'s reciprocal form, and the Triton kernel on other GPUs; "pallas-triton" keeps
    Triton on Hopper. The kernels are stood in for by the reference (no GPU here); what is checked is the pick."""
    import dsv4.layers as layers
    import dsv4.pallas.sinkhorn as sk

    calls = []
    monkeypatch.setattr(layers, "on_gpu", lambda: True)
    monkeypatch.setattr(layers, "is_hopper", lambda: hopper)
    monkeypatch.setattr(sk, "sinkhorn_mgpu", lambda c, it, e, config=None, **kw: calls.append(("mgpu", config))
                        or sinkhorn_reference(c, it, e))  # fmt: skip
    monkeypatch.setattr(sk, "sinkhorn", lambda c, it, e, **kw: calls.append(("triton", kw.get("interpret")))
                        or sinkhorn_reference(c, it, e))  # fmt: skip
    comb = random_comb(5, (32, 1), 4)
    got = layers.sinkhorn_normalize(comb, 3, EPS, impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(sinkhorn_reference(comb, 3, EPS)), rtol=1e-6)
    assert calls == [("mgpu", layers.SINKHORN_MGPU_CONFIG) if want == "mgpu" else ("triton", False)]
    if want == "mgpu":
        assert layers.SINKHORN_MGPU_CONFIG.reciprocal
