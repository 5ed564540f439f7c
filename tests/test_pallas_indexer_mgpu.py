"""dsv4.pallas.indexer_mgpu: the Mosaic GPU scores kernel (e4m3 or bf16 operands) against the indexer's jnp reference.

CPU (not gpu-marked):
- the kernel lowers for CUDA at V4 shapes (Hi = 64, Di = 128, 512 queries × 32K keys; e4m3 with per-row scales, and
  bf16) inside an abstract H200 mesh (Pallas/Mosaic lowering, layouts and the SMEM budget; not miscompiles);
- the model's bf16 route to it (`Kernels.indexer="pallas"`, the default) lowers as it runs on Hopper;
- the model's FP8 indexer path (`dsv4.attention.index_topk_fp8`) on CPU, where its scores come from the Triton
  kernel (whose FP8 path tests/test_pallas_indexer.py checks against the reference in the interpreter), and its
  plumbing through `Indexer.select` (`Kernels.indexer` "pallas-fp8" against "jnp");
- input errors.
GPU (`-m gpu`): Gaussian e4m3 inputs at full-range scales, and Gaussian bf16 inputs, against the reference, after a
NaN-input run of the same shape (so a recycled output buffer holds NaN where the kernel fails to write); the two-pass
top-k with this kernel.

NOTE: the Mosaic GPU interpreter is not a CI test here. `python tests/test_pallas_indexer_mgpu.py` runs
`_interpreter_case_bf16` (integer-valued bf16 inputs in one CTA of two consumers, so scores must equal the reference
bit for bit; on the 2-core CPU box it passed 2 runs of 3 and hung in the third, and passed with two queries a wgmma)
and `_interpreter_case` (integer-valued e4m3 inputs with power-of-two scales; 13 queries in CTAs of 4, 150 keys in
spans of 128). The e4m3 case hung there, with two warpgroup threads asleep in barrier waits and the third inside an
XLA call that never returned; a one-CTA case passed twice out of four, and a bf16 CTA of four consumers hung too
(docs/kernels/indexer.md; the attention kernel's interpreter run hung the same way).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh
from test_pallas_indexer import assert_true_top_k

from dsv4.pallas.indexer import index_scores_reference, index_topk_reference, index_topk_two_pass
from dsv4.pallas.indexer_mgpu import MgpuScoreConfig, index_scores_mgpu

FP8 = jnp.float8_e4m3fn
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU (Mosaic GPU kernel)")


def integer_inputs(seed, *, batch=2, seq=13, entries=150, offsets=(0, 500), span=3, rate=4):
    """Integer q [B, S, 64, 128] and keys [B, C, 128] in [-span, span] as e4m3, weights in [-2, 2], power-of-two
    scales (per (token, head) for q, per row for keys): every score is exact in float32."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-span, span + 1, (batch, seq, 64, 128))
    keys = rng.integers(-span, span + 1, (batch, entries, 128))
    weights = rng.integers(-2, 3, (batch, seq, 64)).astype(np.float32)
    q_scale = 2.0 ** rng.integers(-3, 2, (batch, seq, 64))
    k_scale = 2.0 ** rng.integers(-3, 2, (batch, entries))
    positions = (np.asarray(offsets)[:, None] + np.arange(seq)).astype(np.int32)
    return dict(q=jnp.asarray(q, FP8), keys=jnp.asarray(keys, FP8), weights=jnp.asarray(weights),
                positions=jnp.asarray(positions), q_scale=jnp.asarray(q_scale, jnp.float32),
                k_scale=jnp.asarray(k_scale, jnp.float32))  # fmt: skip


def _interpreter_case() -> None:
    """Run by hand (see the module docstring): exact scores and exact top-k in the Mosaic GPU interpreter."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    inputs = integer_inputs(0)
    kw = dict(rate=4, softmax_scale=0.25)
    config = MgpuScoreConfig(tokens=4, span=128, num_slots=2, consumers=2, queries_per_mma=1)
    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        got = np.asarray(index_scores_mgpu(**inputs, **kw, config=config, interpret=InterpretGPUParams()))
        picks = np.asarray(index_topk_two_pass(**inputs, **kw, k=20, interpret=True, scores_impl="mgpu",
                                               mgpu_config=config))  # fmt: skip
    want = np.asarray(index_scores_reference(**inputs, **kw))
    assert np.isneginf(want).any() and np.isfinite(want).any()  # the case has both
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(picks, np.asarray(index_topk_reference(**inputs, **kw, k=20)))
    print("interpreter case: OK")


def _interpreter_case_bf16() -> None:
    """Run by hand: bf16 operands, one CTA (4 queries at positions 300..303, 100 keys in one span, 75 or 76 of them
    visible), integer values, so the scores are exact."""
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    inputs = integer_inputs(1, batch=1, seq=4, entries=100, offsets=(300,))
    one = dict(q=inputs["q"].astype(jnp.bfloat16), keys=inputs["keys"].astype(jnp.bfloat16),
               weights=inputs["weights"], positions=inputs["positions"])  # fmt: skip
    kw = dict(rate=4, softmax_scale=0.25)
    config = MgpuScoreConfig(tokens=4, span=128, num_slots=2, consumers=2, queries_per_mma=1)
    with abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        got = np.asarray(index_scores_mgpu(**one, **kw, config=config, interpret=InterpretGPUParams()))
    want = np.asarray(index_scores_reference(**one, **kw))
    assert np.isneginf(want).any() and np.isfinite(want).any()
    np.testing.assert_array_equal(got, want)
    print("bf16 interpreter case: OK")


def test_model_indexer_with_pallas_fp8_keeps_what_jnp_keeps():
    """The model's `Indexer.select` with impl "pallas-fp8" (the FP8 path inside `per_sequence_shard`) against "jnp",
    on the tiny preset's indexer: positions 0..31 see at most 32 // 4 = 8 entries, its index_topk, so both keep
    every visible entry (as sets, -1 padded) and FP8 rounding cannot change which."""
    from flax import nnx

    from dsv4.attention import Indexer
    from dsv4.config import Config
    from dsv4.kernels import Kernels
    from dsv4.layers import Rope

    cfg = Config.preset("tiny")
    indexer = Indexer(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, kernels=Kernels().resolve(jnp.float32))
    rope = Rope.build(cfg.rope_compress, cfg.qk_rope_head_dim)
    rng = np.random.default_rng(2)
    b, s = 2, 32
    x = jnp.asarray(rng.standard_normal((b, s, cfg.hidden_size)), jnp.float32)
    q_residual = jnp.asarray(rng.standard_normal((b, s, cfg.q_lora_rank)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, s // 4, cfg.index_head_dim)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    assert cfg.index_topk >= s // 4
    picks = {}
    for impl in ("jnp", "pallas-fp8"):
        indexer.impl = impl
        picks[impl] = np.asarray(indexer.select(x, q_residual, positions, keys, rope))
    for row_jnp, row_fp8 in zip(picks["jnp"].reshape(b * s, -1), picks["pallas-fp8"].reshape(b * s, -1)):
        assert set(row_jnp) == set(row_fp8)
    assert (picks["jnp"] >= 0).any() and (picks["jnp"] == -1).any()


def test_fp8_indexer_picks_a_true_top_k_of_the_quantized_inputs():
    """`dsv4.attention.index_topk_fp8` (the model's `Kernels.indexer="pallas-fp8"`; on CPU its scores come from the
    Triton kernel, interpreted): q quantized per (token, head), keys per entry, and the picks are a true top-k of
    the float64 scores of those quantized values (rounding may only swap near-ties)."""
    from dsv4.attention import index_topk_fp8, quantize_rows_e4m3

    rng = np.random.default_rng(3)
    b, s, h, d, c, k = 2, 29, 16, 32, 60, 9
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((b, c, d)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)
    positions = jnp.asarray(np.stack([np.arange(s), 200 + np.arange(s)]), jnp.int32)
    got = np.asarray(index_topk_fp8(q, weights, positions, keys, rate=4, k=k, softmax_scale=d**-0.5, interpret=True))
    q8, q_scale = quantize_rows_e4m3(q)
    k8, k_scale = quantize_rows_e4m3(keys)
    assert np.abs(np.asarray(q8.astype(jnp.float32))).max() == 448.0  # amax scaling uses the whole e4m3 range
    qf = np.asarray(q8.astype(jnp.float32), np.float64) * np.asarray(q_scale, np.float64)[..., None]
    kf = np.asarray(k8.astype(jnp.float32), np.float64) * np.asarray(k_scale, np.float64)[..., None]
    scores = np.einsum("bqhc,bqh->bqc", np.maximum(np.einsum("bqhd,bcd->bqhc", qf, kf), 0) * d**-0.5,
                       np.asarray(weights, np.float64))  # fmt: skip
    visible = np.clip((np.asarray(positions) + 1) // 4, 0, c)
    assert_true_top_k(got, scores, visible, k)


@pytest.mark.parametrize("dtype, config", [
    (FP8, {}), (FP8, dict(consumers=2, queries_per_mma=1)), (FP8, dict(consumers=2, queries_per_mma=4)),
    (FP8, dict(tokens=12, consumers=3)), (FP8, dict(auto_barriers=True)),
    (jnp.bfloat16, None), (jnp.bfloat16, dict(tokens=8, consumers=2, queries_per_mma=4)),
    (jnp.bfloat16, dict(tokens=8, queries_per_mma=1, num_slots=4)),
])  # fmt: skip
def test_lowers_for_h200(dtype, config):
    b, s, c = 1, 512, 32768
    sds = jax.ShapeDtypeStruct
    args = (sds((b, s, 64, 128), dtype), sds((b, c, 128), dtype), sds((b, s, 64), jnp.float32), sds((b, s), jnp.int32),
            sds((b, s, 64), jnp.float32), sds((b, c), jnp.float32))  # fmt: skip
    scaled = dtype == FP8  # bf16 operands come unscaled, as the model's bf16 indexer has them

    def f(q, keys, weights, positions, q_scale, k_scale):
        return index_scores_mgpu(q, keys, weights, positions, rate=4, softmax_scale=0.1,
                                 q_scale=q_scale if scaled else None, k_scale=k_scale if scaled else None,
                                 config=None if config is None else MgpuScoreConfig(**config))  # fmt: skip

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((1, 8, 32, 128), FP8), weights=jnp.zeros((1, 8, 32), jnp.float32),
          q_scale=jnp.ones((1, 8, 32), jnp.float32)), "Hi = 64"),
    (dict(q=jnp.zeros((1, 8, 64, 128), jnp.bfloat16), q_scale=None), "bfloat16 q and keys of one dtype"),
    (dict(q=jnp.zeros((1, 8, 64, 128), jnp.float32), keys=jnp.zeros((1, 70, 128), jnp.float32), q_scale=None,
          k_scale=None), "got float32 and float32"),
    (dict(q=jnp.zeros((1, 8, 64, 96), jnp.bfloat16), keys=jnp.zeros((1, 70, 96), jnp.bfloat16), q_scale=None,
          k_scale=None), "a multiple of 64 for bfloat16"),
    (dict(q=jnp.zeros((1, 8, 64, 128), jnp.bfloat16), keys=jnp.zeros((1, 70, 128), jnp.bfloat16), q_scale=None,
          k_scale=None, config=MgpuScoreConfig()), "shared memory at Di=128 in bfloat16"),  # 16 queries' q rows
])  # fmt: skip
def test_input_errors(change, match):
    inputs = dict(q=jnp.zeros((1, 8, 64, 128), FP8), keys=jnp.zeros((1, 70, 128), FP8),
                  weights=jnp.zeros((1, 8, 64), jnp.float32), positions=jnp.arange(8, dtype=jnp.int32)[None],
                  q_scale=jnp.ones((1, 8, 64), jnp.float32), k_scale=jnp.ones((1, 70), jnp.float32))  # fmt: skip
    inputs.update(change)
    with pytest.raises(ValueError, match=match):
        index_scores_mgpu(**inputs, rate=4, softmax_scale=0.1)


def test_config_errors():
    with pytest.raises(ValueError, match="tokens=3"):
        MgpuScoreConfig(tokens=3)
    with pytest.raises(ValueError, match="span=100"):
        MgpuScoreConfig(span=100)
    with pytest.raises(ValueError, match="queries_per_mma=4"):
        MgpuScoreConfig(tokens=4, queries_per_mma=4)  # 1 query per consumer
    with pytest.raises(ValueError, match="tokens=16 must be a positive multiple of consumers=3"):
        MgpuScoreConfig(consumers=3)
    with pytest.raises(ValueError, match="consumers=5"):
        MgpuScoreConfig(tokens=20, consumers=5)
    with pytest.raises(ValueError, match="unknown flags"):
        MgpuScoreConfig(debug=("fast",))


@gpu
@requires_gpu
@pytest.mark.parametrize("seq, entries, offset, config", [
    (300, 4100, 16000, {}), (77, 1000, 0, {}), (300, 4100, 16000, dict(consumers=2, queries_per_mma=1)),
    (77, 1000, 0, dict(consumers=2, queries_per_mma=4)), (300, 4100, 16000, dict(queries_per_mma=1)),
    (77, 1000, 0, dict(tokens=12, consumers=3)), (300, 4100, 16000, dict(auto_barriers=True)),
    (77, 1000, 0, dict(consumers=2, queries_per_mma=1, auto_barriers=True)),
])  # fmt: skip
def test_gpu_matches_reference(seq, entries, offset, config):
    keys_ = jax.random.split(jax.random.key(seq), 4)
    q = jax.random.normal(keys_[0], (1, seq, 64, 128), jnp.float32)
    kv = jax.random.normal(keys_[1], (1, entries, 128), jnp.float32)
    q_scale = jnp.max(jnp.abs(q), axis=-1) / 448.0
    k_scale = jnp.max(jnp.abs(kv), axis=-1) / 448.0
    inputs = dict(q=(q / q_scale[..., None]).astype(FP8), keys=(kv / k_scale[..., None]).astype(FP8),
                  weights=jax.random.normal(keys_[2], (1, seq, 64), jnp.float32),
                  positions=(offset + jnp.arange(seq, dtype=jnp.int32) * 13)[None], q_scale=q_scale,
                  k_scale=k_scale)  # fmt: skip
    kw = dict(rate=4, softmax_scale=128**-0.5)
    config = MgpuScoreConfig(**config)
    jax.block_until_ready(index_scores_mgpu(**dict(inputs, weights=jnp.full_like(inputs["weights"], jnp.nan)), **kw,
                                            config=config))  # fmt: skip
    got = np.asarray(index_scores_mgpu(**inputs, **kw, config=config))
    want = np.asarray(index_scores_reference(**inputs, **kw))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert finite.any() and not np.isnan(got).any()
    # NOTE: Hopper's e4m3 wgmma accumulates with fewer than float32's bits (DeepSeek's FP8 indexer has the same);
    # measured 1.2e-3 of the largest score here, against ~1e-6 for float32 accumulation.
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=4e-3 * np.abs(want[finite]).max())


@gpu
@requires_gpu
@pytest.mark.parametrize("seq, entries, offset, config", [
    (300, 4100, 16000, None), (77, 1000, 0, None), (77, 1000, 0, dict(tokens=8, consumers=2, queries_per_mma=4)),
])  # fmt: skip
def test_gpu_bf16_matches_reference(seq, entries, offset, config):
    """bf16 operands (the model's default indexer precision): products exact in float32, sums in another order."""
    keys_ = jax.random.split(jax.random.key(seq + 1), 3)
    inputs = dict(q=jax.random.normal(keys_[0], (1, seq, 64, 128), jnp.bfloat16),
                  keys=jax.random.normal(keys_[1], (1, entries, 128), jnp.bfloat16),
                  weights=jax.random.normal(keys_[2], (1, seq, 64), jnp.float32),
                  positions=(offset + jnp.arange(seq, dtype=jnp.int32) * 13)[None])  # fmt: skip
    kw = dict(rate=4, softmax_scale=128**-0.5, config=None if config is None else MgpuScoreConfig(**config))
    jax.block_until_ready(index_scores_mgpu(**dict(inputs, weights=jnp.full_like(inputs["weights"], jnp.nan)), **kw))
    got = np.asarray(index_scores_mgpu(**inputs, **kw))
    want = np.asarray(index_scores_reference(**inputs, rate=4, softmax_scale=128**-0.5))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert finite.any() and not np.isnan(got).any()
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-5 * np.abs(want[finite]).max())


@gpu
@requires_gpu
def test_gpu_two_pass_with_mgpu_scores_picks_a_true_top_k():
    rng = np.random.default_rng(5)
    s, c, k = 200, 3000, 512
    inputs = dict(q=jnp.asarray(rng.integers(-4, 5, (1, s, 64, 128)), FP8),
                  keys=jnp.asarray(rng.integers(-4, 5, (1, c, 128)), FP8),
                  weights=jnp.asarray(rng.integers(-2, 3, (1, s, 64)), jnp.float32),
                  positions=jnp.asarray(11400 + np.arange(s) * 3, jnp.int32)[None],
                  q_scale=jnp.float32(0.5), k_scale=jnp.full((1, c), 0.25, jnp.float32))  # fmt: skip
    kw = dict(rate=4, k=k, softmax_scale=0.125)
    got = np.asarray(index_topk_two_pass(**inputs, **kw, scores_impl="mgpu"))
    # integer e4m3 values and power-of-two scales: every product and partial sum is an exact small integer
    # multiple of a power of two, so even the tensor core's narrower accumulator is exact and the picks must match
    np.testing.assert_array_equal(got, np.asarray(index_topk_reference(**inputs, **kw)))


def test_model_fp8_indexer_on_hopper_lowers_with_both_kernels(monkeypatch):
    """`dsv4.attention.index_topk_fp8` as it runs on a Hopper GPU (is_hopper patched true, lowered for an abstract
    H200): the Mosaic scores kernel and `dsv4.pallas.select`'s refinement kernel both in the module. 2304 keys:
    past top_k's direct 2048, so the grouped selection and its refinement run."""
    import dsv4.attention.indexer as indexer_module
    from dsv4.attention import index_topk_fp8

    monkeypatch.setattr(indexer_module, "is_hopper", lambda: True)
    b, s, c = 1, 64, 2304
    sds = jax.ShapeDtypeStruct
    args = (sds((b, s, 64, 128), jnp.bfloat16), sds((b, s, 64), jnp.float32), sds((b, s), jnp.int32),
            sds((b, c, 128), jnp.bfloat16))  # fmt: skip
    f = functools.partial(index_topk_fp8, rate=4, k=512, softmax_scale=0.1, interpret=False, selection="kernel")
    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "refine_top_k" in text


def test_model_bf16_mgpu_indexer_on_hopper_lowers_the_mosaic_kernel(monkeypatch):
    """`Kernels.indexer="pallas"` as `Indexer.select` runs it on a Hopper GPU (on_gpu and is_hopper patched
    true, lowered for an abstract H200): bf16 q and keys at V4's 64 heads × 128 take the Mosaic scores kernel; a
    float32 model (not bf16), and "pallas-triton", keep the Triton one."""
    import dataclasses

    from flax import nnx

    import dsv4.attention.indexer as indexer_module
    from dsv4.attention import Indexer
    from dsv4.config import Config
    from dsv4.kernels import Kernels
    from dsv4.layers import Rope

    monkeypatch.setattr(indexer_module, "is_hopper", lambda: True)
    monkeypatch.setattr(indexer_module, "on_gpu", lambda: True)
    cfg = dataclasses.replace(Config.preset("tiny"), index_n_heads=64, index_head_dim=128, index_topk=16)
    rope = Rope.build(cfg.rope_compress, cfg.qk_rope_head_dim)
    b, s = 1, 64
    texts = {}
    for dtype, impl in ((jnp.bfloat16, "pallas"), (jnp.float32, "pallas"), (jnp.bfloat16, "pallas-triton")):
        indexer = Indexer(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=Kernels(indexer=impl, topk_refine="jnp"))
        graphdef, state = nnx.split(indexer)

        def f(state, x, q_residual, positions, keys):
            return nnx.merge(graphdef, state).select(x, q_residual, positions, keys, rope)

        sds = jax.ShapeDtypeStruct
        args = (state, sds((b, s, cfg.hidden_size), dtype), sds((b, s, cfg.q_lora_rank), dtype),
                sds((b, s), jnp.int32), sds((b, s // 4, 128), dtype))  # fmt: skip
        with abstract_gpu_mesh():
            texts[dtype, impl] = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in texts[jnp.bfloat16, "pallas"]
    assert "mosaic_gpu" not in texts[jnp.float32, "pallas"] and "mosaic_gpu" not in texts[jnp.bfloat16, "pallas-triton"]


if __name__ == "__main__":
    _interpreter_case_bf16()
    _interpreter_case()
