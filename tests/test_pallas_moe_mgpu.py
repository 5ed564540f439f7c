"""dsv4.pallas.moe_mgpu: the Mosaic GPU (Hopper) grouped expert GEMMs against the jnp references.

CPU (not gpu-marked):
- `padded_layout` against values worked out by hand (empty experts, a group of exactly one tile, dropped ids);
- lowering for an abstract H200 at V4-Flash shapes, bf16 and W8A8;
- the Mosaic GPU interpreter, whose buffers start as NaN (InterpretGPUParams.uninitialized_memory = "nan"), so a
  row the kernel fails to write stays NaN: both kernels on skewed loads (empty experts, one expert over several
  tiles, a group of one row), three CTAs walking many items through a two-slot ring; bf16 in both accumulation
  forms and W8A8 (whose gate_up epilogue quantizes h: bit for bit `quantize_per_token_group`); then
  `routed_experts(impl="mgpu")` end to end with dropped ids, against
  `routed_experts_reference`;
- refusals name the reason.
GPU-marked: `routed_experts` with the default impl (the Mosaic kernels on Hopper) against the reference, bf16 and
W8A8, at shapes with several column tiles and K steps.

Tolerances are tests/test_pallas_moe.py's: bf16 outputs rtol 2^-7 + atol 1e-4 (f32 products of the same operands
summed in another order, one bf16 rounding); float32 outputs (down) 1e-4 relative to the largest value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh
from test_pallas_moe import LIMIT, make_routing, make_weights, quantize_weights

from dsv4.pallas.moe import (
    grouped_down_reference,
    grouped_gate_up_reference,
    quantize_per_token_group,
    routed_experts,
    routed_experts_reference,
)
from dsv4.pallas.moe_mgpu import (
    TILE_M,
    MgpuMoeConfig,
    default_num_slots,
    grouped_down_mgpu,
    grouped_gate_up_mgpu,
    padded_layout,
    routed_experts_mgpu,
)

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU (Mosaic GPU kernel)")


def _interpret():
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    return InterpretGPUParams()


def test_padded_layout_by_hand():
    """E = 4, tiles of 4 rows. Pairs (p: id): 0:2 1:0 2:2 3:-1 4:2 5:2 6:0 7:4 8:2 → expert 0 has pairs 1, 6; expert
    1 none; expert 2 pairs 0, 2, 4, 5, 8 (two tiles); expert 3 none; -1 and 4 are dropped."""
    ids = jnp.asarray([2, 0, 2, -1, 2, 2, 0, 4, 2], jnp.int32)
    src, row_of_pair, tiles = (np.asarray(a) for a in padded_layout(ids, 4, block_m=4))
    # T = (9 + 4·3) // 4 = 5 tiles, Mp = 20 rows: expert 0 in rows 0..3 (2 used), expert 2 in rows 4..11 (5 used)
    assert tiles.tolist() == [0, 2, 2, -1, -1]
    np.testing.assert_array_equal(src[[0, 1, 4, 5, 6, 7, 8]], [1, 6, 0, 2, 4, 5, 8])
    np.testing.assert_array_equal(row_of_pair, [4, 0, 5, 20, 6, 7, 1, 20, 8])
    assert src.shape == (20,) and (src[[2, 3, 9, 10, 11]] == 0).all()  # pad rows hold pair 0
    # Fewer pairs than experts: T = (3 + 3·3) // 4 = 3 tiles (not (3 + 4·3) // 4 = 3 + E-sized padding)
    src, row_of_pair, tiles = (np.asarray(a) for a in padded_layout(jnp.asarray([3, 1, 3], jnp.int32), 4, 4))
    assert tiles.tolist() == [1, 3, -1] and row_of_pair.tolist() == [4, 0, 5] and src[[0, 4, 5]].tolist() == [1, 0, 2]


@pytest.mark.parametrize("w8a8", [False, True])
def test_lowers_for_h200(w8a8):
    n, k, e, d, i = 8192, 6, 256, 4096, 2048
    sds = jax.ShapeDtypeStruct
    wd = FP8 if w8a8 else jnp.bfloat16
    args = [sds((n, d), jnp.bfloat16), sds((n, k), jnp.int32), sds((n, k), F32), sds((e, 2 * i, d), wd),
            sds((e, d, i), wd)]  # fmt: skip
    kw = {}
    if w8a8:
        kw = dict(gate_up_scales=sds((e, 2 * i // 128, d // 128), F32), down_scales=sds((e, d // 128, i // 128), F32))

    def f(*a, **kw):
        return routed_experts(*a, 7.0, impl="mgpu", **kw)

    with abstract_gpu_mesh():
        text = jax.jit(f).trace(*args, **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2
    if not w8a8:
        return
    rows = n * k // 128 * 128
    down_args = (sds((rows, i), FP8), sds((e, d, i), FP8), sds((rows // 128,), jnp.int32), sds((rows, i // 128), F32),
                 kw["down_scales"])  # fmt: skip

    def lower_down(**config):
        def down(h, w, tiles, hs, ws):
            return grouped_down_mgpu(h, w, tiles, h_scales=hs, down_scales=ws, out_dtype=jnp.bfloat16,
                                     config=MgpuMoeConfig(**config))  # fmt: skip

        with abstract_gpu_mesh():
            return jax.jit(down).trace(*down_args).lower(lowering_platforms=("cuda",)).as_text()

    # down with bf16 y: a fourth ring slot still fits an H200's shared memory (227 KiB); a fifth does not, and says so
    assert "mosaic_gpu" in lower_down(num_slots=4)
    assert "mosaic_gpu" in lower_down(fp8_acc="promote")  # the default rescale form lowers above
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower_down(num_slots=5)


def test_default_ring_depth_by_regime():
    """The measured depths (docs/kernels/moe.md, "Ring depth"): a 16K-token chunk, top-6, is 864 row tiles; over 256
    experts that is 3.4 tiles each (FP8 down: 2 slots under the promote accumulation, 3 under the default rescale),
    over 32 experts 27 each (3). gate_up: 4 in FP8, 3 in bf16."""
    few, many = dict(m_tiles=864, experts=256), dict(m_tiles=864, experts=32)
    promote = dict(fp8_acc="promote")
    assert default_num_slots(gate_up=False, fp8=True, **few, **promote) == 2
    assert default_num_slots(gate_up=False, fp8=True, **many, **promote) == 3
    assert default_num_slots(gate_up=False, fp8=True, m_tiles=8 * 256, experts=256, **promote) == 3  # threshold: 8
    assert default_num_slots(gate_up=False, fp8=True, **few) == 3  # the rescale form (the default): 3 at 3.4 each
    assert default_num_slots(gate_up=False, fp8=False, **few) == 3
    assert [default_num_slots(gate_up=True, fp8=fp8, **regime) for fp8 in (True, False) for regime in (few, many)] \
        == [4, 4, 3, 3]


def _skewed_layout(experts, top_k=2):
    """Routing with empty experts, one expert over several 128-row tiles and one expert with a single pair."""
    tokens = 3 * TILE_M // 2 + 5
    ids = np.zeros((tokens, top_k), np.int32)
    ids[:, 0] = 1  # expert 1: every token (two tiles)
    ids[:, 1] = 3  # expert 3: all but one token
    ids[7, 1] = 0  # expert 0: one pair; expert 2 and the rest: none
    return jnp.asarray(ids)


@pytest.mark.parametrize("mode, form", [("bf16", "in_place"), ("bf16", "per_step"), ("w8a8", "promote"),
                                        ("w8a8", "rescale")])  # fmt: skip
def test_kernels_interpreted(mode, form):
    experts, hidden, inter = 5, 256, 256  # gate_up: 2 column tiles; down: 1; K steps: 4 (bf16) or 2 (fp8)
    ids = _skewed_layout(experts)
    src, _, tiles = padded_layout(ids.reshape(-1), experts)
    used = np.asarray(tiles) >= 0
    x = make_weights(3, (ids.shape[0], hidden), jnp.bfloat16, 1.0)[src // ids.shape[1]]
    gate_up = make_weights(4, (experts, 2 * inter, hidden), F32, 0.1)
    down = make_weights(5, (experts, hidden, inter), F32, 0.1)
    # Per padded row tile: the reference over "groups" = the used tiles' rows (contiguous, in expert order)
    sizes = jnp.bincount(jnp.where(tiles >= 0, tiles, experts), length=experts) * TILE_M
    config = MgpuMoeConfig(num_slots=2, num_ctas=3, **({"fp8_acc": form} if mode == "w8a8" else {"acc_form": form}))
    kw, ref_kw = {}, {}
    if mode == "w8a8":
        (gate_up, gs), (down, ds) = quantize_weights(gate_up), quantize_weights(down)
        x, xs = quantize_per_token_group(x)
        kw = dict(x_scales=xs, gate_up_scales=gs)
        ref_kw = dict(x_scales=xs, gate_up_scales=gs)
    else:
        gate_up, down = gate_up.astype(jnp.bfloat16), down.astype(jnp.bfloat16)
    h = grouped_gate_up_mgpu(x, gate_up, tiles, limit=LIMIT, config=config, interpret=_interpret(), **kw)
    h = np.asarray(h, F32)
    assert np.isnan(h[~np.repeat(used, TILE_M)]).all(), "the interpreter no longer poisons unwritten rows"
    h_want = np.asarray(grouped_gate_up_reference(x, gate_up, sizes, limit=LIMIT, **ref_kw), F32)
    rows = np.repeat(used, TILE_M)
    assert not np.isnan(h[rows]).any(), "gate_up left rows of a used tile unwritten"
    np.testing.assert_allclose(h[rows], h_want[rows], atol=1e-4, rtol=2**-7)

    h_in = jnp.asarray(np.where(rows[:, None], h, 0.0), jnp.bfloat16)
    dkw = {}
    if mode == "w8a8":
        h_in, hs = quantize_per_token_group(h_in)
        dkw = dict(h_scales=hs, down_scales=ds)
        # the epilogue's quantization of h: bit for bit quantize_per_token_group of the kernel's own bf16 h
        hq, hqs = grouped_gate_up_mgpu(x, gate_up, tiles, limit=LIMIT, quantize_out=True, config=config,
                                       interpret=_interpret(), **kw)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(hq[rows], F32), np.asarray(h_in[rows], F32))
        np.testing.assert_array_equal(np.asarray(hqs)[rows], np.asarray(hs)[rows])
    y = np.asarray(grouped_down_mgpu(h_in, down, tiles, config=config, interpret=_interpret(), **dkw), F32)
    y_want = np.asarray(grouped_down_reference(h_in, down, sizes, out_dtype=F32, **dkw), F32)
    assert not np.isnan(y[rows]).any(), "down left rows of a used tile unwritten"
    np.testing.assert_allclose(y[rows], y_want[rows], atol=1e-4 * np.abs(y_want).max(), rtol=0)
    if form != "in_place":  # y stored in bf16 (routed_experts' form): the same float32 sums, rounded once
        y_bf16 = np.asarray(jnp.asarray(y[rows]).astype(jnp.bfloat16), F32)
        y16 = grouped_down_mgpu(h_in, down, tiles, config=config, interpret=_interpret(), out_dtype=jnp.bfloat16,
                                **dkw)  # fmt: skip
        assert y16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y16, F32)[rows], y_bf16)


def test_rescale_takes_zero_weight_blocks():
    """A weight block stored as zeros with scale 0 (a checkpoint may hold one): the rescale form floors that step's
    scale, so its totals pass through the step finite and exact up to rounding; the first K step (part A) and the
    last (part B) of expert 1's gate_up, against the reference on the same stored values."""
    experts, hidden, inter = 4, 256, 128
    ids = _skewed_layout(experts)
    src, _, tiles = padded_layout(ids.reshape(-1), experts)
    rows = np.repeat(np.asarray(tiles) >= 0, TILE_M)
    x, xs = quantize_per_token_group(make_weights(8, (ids.shape[0], hidden), jnp.bfloat16, 1.0)[src // 2])
    q, scales = quantize_weights(make_weights(9, (experts, 2 * inter, hidden), F32, 0.1))
    q = q.at[1, :128, :128].set(0).at[1, 128:, 128:].set(0)  # gate rows, K block 0; up rows, K block 1
    scales = scales.at[1, 0, 0].set(0.0).at[1, 1, 1].set(0.0)
    sizes = jnp.bincount(jnp.where(tiles >= 0, tiles, experts), length=experts) * TILE_M
    config = MgpuMoeConfig(fp8_acc="rescale", num_ctas=2)
    h = np.asarray(grouped_gate_up_mgpu(x, q, tiles, limit=LIMIT, x_scales=xs, gate_up_scales=scales, config=config,
                                        interpret=_interpret()), F32)[rows]  # fmt: skip
    want = np.asarray(grouped_gate_up_reference(x, q, sizes, limit=LIMIT, x_scales=xs, gate_up_scales=scales), F32)
    assert np.isfinite(h).all()
    np.testing.assert_allclose(h, want[rows], atol=1e-4, rtol=2**-7)


@pytest.mark.parametrize("mode, tokens", [("bf16", 50), ("w8a8", 50), ("bf16", 1)])  # 1: a decode step, P < E
def test_routed_experts_interpreted(mode, tokens):
    experts, hidden, inter, top_k = 6, 256, 128, 3
    ids, weights = make_routing(11, tokens, top_k, experts)
    if tokens > 9:
        ids = ids.at[3, 0].set(-1).at[9, 2].set(experts)  # another shard's experts: dropped
    x = make_weights(12, (tokens, hidden), jnp.bfloat16, 1.0)
    gate_up = make_weights(13, (experts, 2 * inter, hidden), F32, 0.1)
    down = make_weights(14, (experts, hidden, inter), F32, 0.1)
    kw = {}
    if mode == "w8a8":
        (gate_up, kw["gate_up_scales"]), (down, kw["down_scales"]) = quantize_weights(gate_up), quantize_weights(down)
    else:
        gate_up, down = gate_up.astype(jnp.bfloat16), down.astype(jnp.bfloat16)
    got = np.asarray(routed_experts(x, ids, weights, gate_up, down, LIMIT, impl="mgpu", interpret=True, **kw), F32)
    want = np.asarray(routed_experts_reference(x, ids, weights, gate_up, down, LIMIT, **kw), F32)
    assert not np.isnan(got).any()
    # h is rounded to bf16 (and to fp8 in W8A8) from f32 sums taken in another order; with this seed one h value of
    # token 46 flips a bf16 step on both kernel paths (the Triton one too), moving its outputs by up to 0.06 of 11.
    np.testing.assert_allclose(got, want, atol=2**-7 * np.abs(want).max(), rtol=2**-7)
    if mode == "w8a8":  # tokens quantized by the caller (expert parallelism's FP8 dispatch): the same result
        xq, xs = quantize_per_token_group(x)
        pre = routed_experts(xq, ids, weights, gate_up, down, LIMIT, impl="mgpu", interpret=True, x_scales=xs,
                             out_dtype=jnp.bfloat16, **kw)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(pre, F32), got)


@pytest.mark.parametrize("change, match", [
    (dict(hidden=128), "D=128 must be a multiple of 256"),
    (dict(inter=64), "I=64"),
    (dict(fp8_activations=False), "W8A16"),
    (dict(x_dtype=F32), "float32"),
])  # fmt: skip
def test_mgpu_refuses_what_it_cannot_run(change, match):
    hidden, inter, experts = change.get("hidden", 256), change.get("inter", 128), 4
    wd = FP8 if "fp8_activations" in change else change.get("x_dtype", jnp.bfloat16)
    x = jnp.zeros((8, hidden), change.get("x_dtype", jnp.bfloat16))
    ids, weights = jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2), F32)
    kw = {}
    if wd == FP8:
        kw = dict(gate_up_scales=jnp.ones((experts, 2 * inter // 128, hidden // 128), F32),
                  down_scales=jnp.ones((experts, hidden // 128, inter // 128), F32), fp8_activations=False)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        routed_experts(x, ids, weights, jnp.zeros((experts, 2 * inter, hidden), wd),
                       jnp.zeros((experts, hidden, inter), wd), LIMIT, impl="mgpu", **kw)  # fmt: skip
    if wd == FP8:  # a wrong scale shape is named, not read out of bounds
        kw = dict(kw, fp8_activations=True, down_scales=kw["down_scales"][:, :1])
        with pytest.raises(ValueError, match="down_scales float32"):
            routed_experts(x, ids, weights, jnp.zeros((experts, 2 * inter, hidden), wd),
                           jnp.zeros((experts, hidden, inter), wd), LIMIT, impl="mgpu", **kw)  # fmt: skip
    with pytest.raises(ValueError, match="impl='cuda'"):
        routed_experts(x, ids, weights, jnp.zeros((experts, 2 * inter, hidden), wd),
                       jnp.zeros((experts, hidden, inter), wd), LIMIT, impl="cuda", **kw)  # fmt: skip


def _gpu_problem(seed, w8a8: bool):
    """The GPU tests' layer: 32 experts, hidden 1024, intermediate 512 (gate_up 4 column tiles, down 2; 16 / 8 K
    steps in bf16), 700 tokens top-6. → (x, ids, weights, gate_up, down, kw: the weights' block scales for W8A8)."""
    experts, hidden, inter, tokens, top_k = 32, 1024, 512, 700, 6
    ids, weights = make_routing(seed, tokens, top_k, experts)
    x = make_weights(seed, (tokens, hidden), jnp.bfloat16, 1.0)
    gate_up = make_weights(seed + 1, (experts, 2 * inter, hidden), F32, 0.05)
    down = make_weights(seed + 2, (experts, hidden, inter), F32, 0.05)
    if not w8a8:
        return x, ids, weights, gate_up.astype(jnp.bfloat16), down.astype(jnp.bfloat16), {}
    (gate_up, gs), (down, ds) = quantize_weights(gate_up), quantize_weights(down)
    return x, ids, weights, gate_up, down, dict(gate_up_scales=gs, down_scales=ds)


@gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["bf16", "w8a8"])
def test_gpu_routed_experts_default_impl(mode):
    """On Hopper the default impl is the Mosaic path: 4 column tiles of gate_up, 2 of down, 16 / 8 K steps."""
    x, ids, weights, gate_up, down, kw = _gpu_problem(19, mode == "w8a8")
    got = np.asarray(routed_experts(x, ids, weights, gate_up, down, LIMIT, **kw), F32)
    mgpu = np.asarray(routed_experts(x, ids, weights, gate_up, down, LIMIT, impl="mgpu", **kw), F32)
    np.testing.assert_array_equal(got, mgpu)
    want = np.asarray(routed_experts_reference(x, ids, weights, gate_up, down, LIMIT, **kw), F32)
    assert not np.isnan(got).any()
    if mode == "w8a8":  # as tests/test_pallas_moe.py's GPU test: h re-quantized after another summation order
        assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 1e-2
        assert np.mean(np.abs(got - want) > 2**-5 * np.abs(want).max()) < 1e-3
    else:
        np.testing.assert_allclose(got, want, atol=2**-5 * np.abs(want).max(), rtol=0)


@gpu
@requires_gpu
def test_gpu_w8a8_four_slots():
    """down with a fourth ring slot (bf16 y) compiles on Hopper and gives the default's result: the same sums."""
    x, ids, weights, gate_up, down, kw = _gpu_problem(22, w8a8=True)

    def run(config):
        return np.asarray(routed_experts_mgpu(x, ids, weights, gate_up, down, LIMIT, config=config, **kw), F32)

    np.testing.assert_array_equal(run(MgpuMoeConfig(num_slots=4)), run(MgpuMoeConfig()))


@gpu
@requires_gpu
@pytest.mark.parametrize("slots", [None, 3])
def test_gpu_w8a8_rescale_matches_reference(slots):
    """The rescale accumulation (the default: both parts' wgmmas in place, the totals rescaled between steps)
    against the reference, as the routed experts are held, and close to the promote form's result (the same sums,
    rounded differently); after a run whose x is NaN, so rows it fails to write show."""
    x, ids, weights, gate_up, down, kw = _gpu_problem(25, w8a8=True)

    def run(config, x=x):
        return np.asarray(routed_experts_mgpu(x, ids, weights, gate_up, down, LIMIT, config=config, **kw), F32)

    rescale = MgpuMoeConfig(fp8_acc="rescale", num_slots=slots)
    run(rescale, jnp.full_like(x, jnp.nan))
    got, promote = run(rescale), run(MgpuMoeConfig(fp8_acc="promote"))
    want = np.asarray(routed_experts_reference(x, ids, weights, gate_up, down, LIMIT, **kw), F32)
    assert not np.isnan(got).any()
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 1e-2
    assert np.mean(np.abs(got - want) > 2**-5 * np.abs(want).max()) < 1e-3
    assert np.sqrt(np.mean((got - promote) ** 2) / np.mean(promote**2)) < 1e-2


@pytest.mark.parametrize("dtype, d", [(jnp.float8_e4m3fn, 4096), (jnp.float8_e4m3fn, 132), (jnp.bfloat16, 130),
                                      (jnp.bfloat16, 7), (jnp.float32, 12), (jnp.float8_e4m3fn, 6)])  # fmt: skip
def test_gather_rows_is_the_plain_gather(dtype, d):
    """`gather_rows` (rows moved as uint32 words where the width allows, else the plain gather) equals x[rows]
    bit for bit, NaN and negative-zero payloads included, rows repeated and out of order."""
    from dsv4.pallas.moe_mgpu import gather_rows

    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.standard_normal((37, d)) * 100, jnp.float32).astype(dtype)
    x = x.at[3, :2].set(jnp.nan).at[5, 1].set(-0.0)
    rows = jnp.asarray(rng.integers(0, 37, 101), jnp.int32)
    got, want = gather_rows(x, rows), x[rows]
    assert got.dtype == x.dtype and got.shape == (101, d)
    bits = jnp.uint8 if x.dtype.itemsize == 1 else (jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint32)
    np.testing.assert_array_equal(np.asarray(got.view(bits)), np.asarray(want.view(bits)))
