"""dsv4.pallas.indexer_paged_mgpu: the Mosaic GPU paged scores kernel against the jnp reference
(`index_scores_paged_reference`: every listed row gathered, then scored).

CPU (not gpu-marked):
- the Mosaic GPU interpreter on integer-valued bf16 inputs (every score exact in float32, so the comparison is exact)
  in `make_inputs`' paged pool: a permuted block table, every row nobody wrote NaN, ragged visibility (0, 1 and 150
  keys), queries padded to the CTA's; the interpreter's buffers start as NaN, so a score the kernel fails to write
  shows. One case runs its race detector, whose barrier bookkeeping also fails any phase a waiter skips;
- the kernel lowers for CUDA at V4 shapes (64 heads × 128, 64-row pages, batch 32 × 128K context) inside an abstract
  H200 mesh, and the model's route (`index_topk_paged` with scores_impl "auto" on Hopper) picks it for bf16 pages
  and the Triton kernel for FP8 ones;
- input and configuration errors.
GPU (`-m gpu`): Gaussian bf16 inputs at V4 shapes against the reference after a NaN-input run of the same shape (a
recycled output buffer then holds NaN where the kernel fails to write), then the top-k.

NOTE: on a 2-core box the interpreter can hang (threads blocked inside XLA CPU calls that never return) on 4 queries
a CTA with two consumer warpgroups, and on three consumers (4 warpgroups) under pytest-xdist. The interpreter cases
keep to 3 warpgroups at most and to one consumer at 4 queries; the GPU runs the default two consumers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh
from test_pallas_indexer_paged import make_inputs

import dsv4.pallas.indexer_paged as indexer_paged
from dsv4.pallas.indexer import index_topk_reference
from dsv4.pallas.indexer_paged import index_scores_paged_reference, index_topk_paged
from dsv4.pallas.indexer_paged_mgpu import MgpuPagedConfig, index_scores_paged_mgpu

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU (Mosaic GPU kernel)")
SHAPE = dict(batch=3, heads=64, head_dim=64, rope_dim=0, rows=64, max_pages=4, entries=(0, 1, 150))


@pytest.mark.parametrize("queries, config, races", [
    (1, MgpuPagedConfig(span=256, slots=1), True),  # 4 tiles a CTA: each consumer's ring of one slot refilled
    (2, MgpuPagedConfig(span=64, slots=2), False),  # one tile a CTA: the second consumer has none; 4 spans a request
    (3, MgpuPagedConfig(consumers=1), False),  # 4 queries a CTA, one padded; the automatic span
])  # fmt: skip
def test_interpreter_matches_reference(queries, config, races):
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    inputs, kw, _ = make_inputs(11 + queries, fmt="whole", queries=queries, dtype=jnp.bfloat16, **SHAPE)
    got = index_scores_paged_mgpu(**inputs, **kw, config=config, interpret=InterpretGPUParams(detect_races=races))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(index_scores_paged_reference(**inputs, **kw)))
    if races:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

        assert not get_races().races_found


def test_topk_through_the_mosaic_kernel_interpreted():
    """`index_topk_paged(scores_impl="mgpu", interpret=True)` runs the Mosaic kernel in the interpreter: the picks of
    the dense reference on the same keys (integer inputs: exact scores)."""
    inputs, kw, dense_keys = make_inputs(21, fmt="whole", dtype=jnp.bfloat16, **SHAPE)
    picks = index_topk_paged(**inputs, **kw, k=40, interpret=True, scores_impl="mgpu")
    want = index_topk_reference(inputs["q"], dense_keys, inputs["weights"], inputs["positions"], k=40, **kw)
    np.testing.assert_array_equal(np.asarray(picks), np.asarray(want))


@pytest.mark.parametrize("queries", [1, 3, 16])
def test_lowers_for_h200_at_v4_shapes(queries):
    b, pages, rows = 32, 512, 64
    sds = jax.ShapeDtypeStruct
    args = (sds((b, queries, 64, 128), jnp.bfloat16), sds((b, queries, 64), jnp.float32), sds((b, queries), jnp.int32),
            sds((b * pages, rows, 128), jnp.bfloat16), sds((b, pages), jnp.int32))  # fmt: skip

    def f(*a):
        return index_scores_paged_mgpu(*a, rate=4, softmax_scale=0.1)

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("fmt, want", [("whole", "mosaic_gpu"), ("fp8-channel", "__gpu$xla.gpu.triton")])
def test_model_route_on_hopper_picks_mosaic_for_bf16_pages(monkeypatch, fmt, want):
    """`index_topk_paged(scores_impl="auto")` as the model calls it on a Hopper GPU: bf16 pages take the Mosaic
    kernel, FP8 split rows the Triton one; "triton" forces the Triton kernel."""
    monkeypatch.setattr(indexer_paged, "is_hopper", lambda: True)
    sds = jax.ShapeDtypeStruct
    b, h, d, rows, pages = 4, 64, 128, 64, 64
    args = dict(q=sds((b, 1, h, d), jnp.bfloat16), weights=sds((b, 1, h), jnp.float32),
                positions=sds((b, 1), jnp.int32), block_table=sds((b, pages), jnp.int32))  # fmt: skip
    if fmt == "whole":
        args["key_pages"] = sds((b * pages, rows, d), jnp.bfloat16)
    else:
        args.update(key_pages=sds((b * pages, rows, 64), jnp.float8_e4m3fn), key_scales=sds((64,), jnp.float32),
                    key_rope_pages=sds((b * pages, rows, 64), jnp.bfloat16))  # fmt: skip
    names = tuple(args)

    def lowered(impl):
        def fn(*arrays):
            return index_topk_paged(**dict(zip(names, arrays)), rate=4, k=512, softmax_scale=0.1, selection="xla",
                                    scores_impl=impl)  # fmt: skip

        with abstract_gpu_mesh():
            return jax.jit(fn).trace(*args.values()).lower(lowering_platforms=("cuda",)).as_text()

    auto = lowered("auto")
    assert want in auto
    assert ("mosaic_gpu" in auto) == (fmt == "whole")
    if fmt == "whole":
        assert "mosaic_gpu" not in lowered("triton")


def test_input_errors():
    inputs, kw, _ = make_inputs(3, fmt="whole", dtype=jnp.bfloat16, **SHAPE)
    with pytest.raises(ValueError, match="pages in q's dtype"):
        index_scores_paged_mgpu(**{**inputs, "q": inputs["q"][:, :, :32], "weights": inputs["weights"][:, :, :32]},
                                **kw)  # fmt: skip
    with pytest.raises(ValueError, match="a multiple of 64 rows"):
        index_scores_paged_mgpu(**{**inputs, "key_pages": inputs["key_pages"][:, :48]}, **kw)
    with pytest.raises(ValueError, match="block_table must be integer"):
        index_scores_paged_mgpu(**{**inputs, "block_table": inputs["block_table"][0]}, **kw)
    fp8, kw8, _ = make_inputs(3, fmt="fp8-channel", dtype=jnp.bfloat16, **{**SHAPE, "rope_dim": 32})
    with pytest.raises(ValueError, match="unquantized pages only"):
        index_topk_paged(**fp8, **kw8, k=8, scores_impl="mgpu")
    with pytest.raises(ValueError, match="scores_impl='cuda'"):
        index_topk_paged(**inputs, **kw, k=8, scores_impl="cuda")


def test_config_errors():
    with pytest.raises(ValueError, match="tokens=3"):
        MgpuPagedConfig(tokens=3)
    with pytest.raises(ValueError, match="span=100"):
        MgpuPagedConfig(span=100)
    with pytest.raises(ValueError, match="consumers=4"):
        MgpuPagedConfig(consumers=4)
    with pytest.raises(ValueError, match="slots=0"):
        MgpuPagedConfig(slots=0)
    # the automatic span by hand: 32 requests × 512 tiles over 2 × 132 CTAs → 63 tiles, capped at 2048 keys (32);
    # one request: 512 tiles / 264 → 2, raised to 4 tiles
    assert MgpuPagedConfig().span_for(32768, 32, 132) == 2048
    assert MgpuPagedConfig(max_span=8192).span_for(32768, 32, 132) == 63 * 64
    assert MgpuPagedConfig().span_for(32768, 1, 132) == 256
    assert MgpuPagedConfig().span_for(128, 1, 132) == 128  # never past the request's tiles


@gpu
@requires_gpu
@pytest.mark.parametrize("queries, config", [(1, None), (3, None), (2, MgpuPagedConfig(span=256, slots=1))])
def test_gpu_matches_reference_at_v4_shapes(queries, config):
    shape = dict(batch=4, heads=64, head_dim=128, rope_dim=0, rows=64, max_pages=40, entries=(0, 1, 1000, 2559))
    inputs, kw, dense_keys = make_inputs(7, fmt="whole", queries=queries, dtype=jnp.bfloat16, span=2, **shape)
    kw_config = {} if config is None else dict(config=config)
    nan = {**inputs, "q": jnp.full_like(inputs["q"], jnp.nan)}
    jax.block_until_ready(index_scores_paged_mgpu(**nan, **kw, **kw_config))  # leaves NaN in a recycled buffer
    rng = np.random.default_rng(queries)
    gauss = {**inputs, "q": jnp.asarray(rng.standard_normal(inputs["q"].shape), jnp.bfloat16)}
    got = np.asarray(index_scores_paged_mgpu(**gauss, **kw, **kw_config))
    want = np.asarray(index_scores_paged_reference(**gauss, **kw))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want[np.isfinite(want)]).max())
    picks = np.asarray(index_topk_paged(**inputs, **kw, k=512))  # integer inputs: exact scores, exact picks
    ref = index_topk_reference(inputs["q"], dense_keys, inputs["weights"], inputs["positions"], k=512, **kw)
    np.testing.assert_array_equal(picks, np.asarray(ref))
