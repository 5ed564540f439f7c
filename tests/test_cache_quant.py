"""KV storage formats (dsv4/cache/quant.py): stored layout, round-trip error bounds, scale policies, the write path.

Error bounds are e4m3's own: 3 mantissa bits, so a value in the normal range (>= 2^-6 · scale) comes back
within 2^-4 of itself relatively (half an ulp), and a subnormal one within 2^-10 · scale absolutely (half the
smallest step). Anything looser would hide a wrong scale; anything tighter would test the rounding mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.cache import quant
from dsv4.cache.layout import ITEMSIZE, KVFormat
from dsv4.cache.quant import FORMAT_NAMES, FP8_E4M3_MAX, empty_storage, init_scale_state, rms_norm_bound, saturated

# Jitted once per shape and format: far fewer compiles than running the ops eagerly one by one.
quantize = jax.jit(quant.quantize, static_argnums=1)
dequantize = jax.jit(quant.dequantize, static_argnums=(1, 3))
write_rows = jax.jit(quant.write_rows, static_argnums=3)

FP8_FORMATS = [name for name in FORMAT_NAMES if name != "bf16"]
SHAPE = (2, 8)  # leading row axes: one shape for most tests, so each format's functions compile once


def rows(seed, shape, spread=1.0):
    """Gaussian rows with per-channel magnitudes spread over exp(±spread), so channels differ in range."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    magnitude = jnp.exp(spread * jax.random.uniform(k2, shape[-1:], minval=-1, maxval=1))
    return jax.random.normal(k1, shape) * magnitude


def fmt_and_state(name, width, rope_dim, x=None, bound=None):
    fmt = KVFormat.named(name, rope_dim=rope_dim)
    return fmt, init_scale_state(width, fmt, bound=bound)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("width, rope_dim", [(512, 64), (100, 4)])  # 100: a short last tile
def test_stored_leaves_match_the_declared_layout(name, width, rope_dim):
    fmt, state = fmt_and_state(name, width, rope_dim)
    stored, _ = quantize(rows(0, (*SHAPE, width)), fmt, state)
    empty = empty_storage((*SHAPE, width), fmt)
    declared = fmt.row_leaves(width)
    assert set(stored) == set(empty) == set(declared)
    for leaf, (n, dtype) in declared.items():
        assert stored[leaf].shape == empty[leaf].shape == (*SHAPE, n)
        assert stored[leaf].dtype == empty[leaf].dtype == jnp.dtype(dtype)
    assert sum(leaf.nbytes for leaf in stored.values()) == 16 * fmt.row_bytes(width)
    if state is not None:
        assert sum(leaf.nbytes for leaf in state.values()) == fmt.state_bytes(width)
    assert np.all(np.asarray(dequantize(empty, fmt, state, jnp.float32)) == 0)


def test_v4_row_bytes():
    """448 fp8 nope + 64 bf16 rope channels (+ 7 tile scales) per 512-wide row; FlashMLA's V4 row is 584 padded."""
    expected = {"bf16": 1024, "fp8-tensor": 576, "fp8-channel": 576, "fp8-tile": 604, "fp8-tile-e8m0": 583}
    assert {name: KVFormat.named(name, rope_dim=64).row_bytes(512) for name in FORMAT_NAMES} == expected
    assert KVFormat.named("fp8-channel", rope_dim=64).row_bytes(128) == 64 + 128  # an indexer key
    assert KVFormat.named("fp8-tile", rope_dim=64).num_tiles(512) == 7


@pytest.mark.parametrize("name, policy", [("fp8-tensor", "calibrated"), ("fp8-tensor", "bound"),
                                          ("fp8-channel", "calibrated"), ("fp8-channel", "bound"),
                                          ("fp8-tile", None), ("fp8-tile-e8m0", None)])  # fmt: skip
def test_round_trip_is_within_half_an_fp8_ulp(name, policy):
    width, rope_dim = 512, 64
    x = rows(1, (*SHAPE, width), spread=3.0)
    bound = jnp.abs(x).max(axis=(0, 1)) * 1.5 if policy == "bound" else None
    fmt, state = fmt_and_state(name, width, rope_dim, bound=bound)
    stored, state = quantize(x, fmt, state)
    y = np.asarray(dequantize(stored, fmt, state, jnp.float32))
    x = np.asarray(x)
    n = width - rope_dim
    np.testing.assert_array_equal(y[..., n:], np.asarray(jnp.asarray(x[..., n:]).astype(jnp.bfloat16), np.float32))
    scale = np.asarray(stored["scale"].astype(jnp.float32)).repeat(64, -1) if fmt.scaling == "tile" \
        else np.broadcast_to(np.asarray(state["scale"]), (n,))  # fmt: skip
    err = np.abs(y[..., :n] - x[..., :n])
    assert np.all(err <= 2.0**-4 * np.abs(x[..., :n]) + 2.0**-10 * scale)
    assert not bool(saturated(state))
    rel = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert 0.005 < rel < 0.04  # e4m3's RMS error is ~2-3 %; far below means the values never went through fp8


def test_bf16_format_is_a_cast():
    fmt = KVFormat.named("bf16", rope_dim=64)
    x = rows(2, (*SHAPE, 512))
    stored, state = quantize(x, fmt)
    assert state is None
    want = x.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(dequantize(stored, fmt, dtype=jnp.float32), want)


@pytest.mark.parametrize("name", FP8_FORMATS)
def test_requantizing_dequantized_rows_changes_nothing(name):
    """A cache emulated as quantize→dequantize between chunks re-quantizes old rows: their values must not move.

    (The representation may: an e8m0 tile whose maximum rounded down to 224 · s comes back with scale s / 2.)
    NOTE: float32 tile scales are recomputed from the tile's amax, which bf16 output rounds, so for that format
    only a float32 round trip is a no-op.
    """
    fmt, state = fmt_and_state(name, 512, 64)
    stored, state = quantize(rows(3, (*SHAPE, 512)), fmt, state)
    for dtype in (jnp.float32,) if name == "fp8-tile" else (jnp.float32, jnp.bfloat16):
        once = dequantize(stored, fmt, state, dtype)
        again, state2 = quantize(once, fmt, state)
        np.testing.assert_allclose(np.asarray(dequantize(again, fmt, state2, dtype), np.float32),
                                   np.asarray(once, np.float32), rtol=2e-7 if name == "fp8-tile" else 0)  # fmt: skip


def test_tile_scales_map_each_tile_amax_to_the_fp8_maximum():
    x = rows(4, (5, 100), spread=2.0)  # rope 4 → 96 nope channels: one full tile of 64 and a short one of 32
    for scale_dtype in ("float32", "float8_e8m0fnu"):
        fmt = KVFormat("t", dtype="float8_e4m3fn", scaling="tile", rope_dim=4, scale_dtype=scale_dtype)
        stored, _ = quantize(x, fmt)
        amax = np.stack([np.abs(x[:, :64]).max(-1), np.abs(x[:, 64:96]).max(-1)], -1)
        scale = np.asarray(stored["scale"].astype(jnp.float32))
        if scale_dtype == "float32":
            np.testing.assert_allclose(scale, amax / FP8_E4M3_MAX, rtol=2e-7)
        else:  # the smallest power of two that keeps the tile in range
            assert np.all(np.log2(scale) == np.round(np.log2(scale)))
            assert np.all((amax / scale <= FP8_E4M3_MAX) & (amax / scale > FP8_E4M3_MAX / 2))


def test_first_write_calibrates_channel_scales_then_they_stay_and_saturation_is_reported():
    fmt = KVFormat("c", dtype="float8_e4m3fn", scaling="channel", rope_dim=4, headroom=2.0)
    state = init_scale_state(13, fmt)  # 9 nope channels
    first = jnp.zeros((3, 13)).at[0, :8].set(jnp.arange(1.0, 9.0)).at[2].set(1000.0)  # channel 8: zero
    _, state = quantize(first, fmt, state, valid=jnp.array([True, True, False]))  # row 2 is padding
    expected = np.r_[2.0 * np.arange(1.0, 9.0) / FP8_E4M3_MAX, 0.0]
    np.testing.assert_allclose(state["scale"], expected, rtol=1e-7)
    assert not bool(saturated(state))

    later = jnp.full((1, 13), 100.0)
    stored, state = quantize(later, fmt, state)
    np.testing.assert_allclose(state["scale"][:8], expected[:8], rtol=1e-7)  # frozen once set
    assert state["scale"][8] == pytest.approx(2 * 100.0 / FP8_E4M3_MAX)  # channel 8 calibrates on its first value
    assert bool(saturated(state))
    back = np.asarray(dequantize(stored, fmt, state, jnp.float32))[0]
    np.testing.assert_allclose(back[:8], 2.0 * np.arange(1.0, 9.0), rtol=1e-6)  # clipped at ±448 · scale, no NaN
    assert back[8] == pytest.approx(100.0, rel=2**-4)


@pytest.mark.parametrize("scaling", ["channel", "tensor"])
def test_rms_norm_bound_never_saturates(scaling):
    """Worst case for an RMSNorm output: all of a row's energy in one channel (a one-hot input)."""
    d = 64
    weight = jnp.exp(jax.random.normal(jax.random.key(5), (d,)))
    one_hot = jnp.eye(d) * 7.0
    normed = weight * one_hot * jax.lax.rsqrt(jnp.mean(one_hot**2, -1, keepdims=True) + 1e-6)
    fmt = KVFormat("b", dtype="float8_e4m3fn", scaling=scaling, rope_dim=8)
    state = init_scale_state(d, fmt, bound=rms_norm_bound(weight))
    stored, state = quantize(normed, fmt, state)
    assert not bool(saturated(state))
    assert np.all(np.isfinite(np.asarray(stored["nope"], np.float32)))
    assert float(jnp.abs(stored["nope"].astype(jnp.float32)).max()) <= FP8_E4M3_MAX


def test_write_rows_scatters_quantized_rows_and_drops_out_of_range_indices():
    fmt = KVFormat.named("fp8-channel", rope_dim=8)
    storage = empty_storage((2, 6, 32), fmt)
    state = init_scale_state(32, fmt)
    x = rows(6, (2, 3, 32))
    index = jnp.array([[4, 0, 6], [-1, 5, 2]])  # 6 and -1 are dropped (and must not calibrate)
    big = x.at[0, 2].multiply(1e3).at[1, 0].multiply(1e3)
    storage, state = write_rows(storage, big, index, fmt, state)
    back = np.asarray(dequantize(storage, fmt, state, jnp.float32))
    want = np.zeros((2, 6, 32), np.float32)
    for b, i, row in [(0, 4, 0), (0, 0, 1), (1, 5, 1), (1, 2, 2)]:
        stored, _ = quantize(x[b, row], fmt, state)
        want[b, i] = np.asarray(dequantize(stored, fmt, state, jnp.float32))
    np.testing.assert_array_equal(back, want)
    np.testing.assert_allclose(state["amax"], jnp.abs(x[jnp.array([0, 0, 1, 1]), jnp.array([0, 1, 1, 2]), :24]).max(0))


def test_quantize_under_jit_matches_eager():
    fmt = KVFormat.named("fp8-tile-e8m0", rope_dim=64)
    x = rows(7, (*SHAPE, 512)).astype(jnp.bfloat16)
    eager, _ = quant.quantize(x, fmt)
    jitted, _ = quantize(x, fmt)
    for leaf in eager:
        np.testing.assert_array_equal(np.asarray(eager[leaf], np.float32), np.asarray(jitted[leaf], np.float32))
    assert dequantize(jitted, fmt).dtype == jnp.bfloat16


def test_bad_formats_and_arguments_raise_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="scaling='block'"):
        KVFormat("x", dtype="float8_e4m3fn", scaling="block")
    with pytest.raises(ValueError, match="dtype='float8_e4m3fn' needs a scaling"):
        KVFormat("x", dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="scale_dtype"):
        KVFormat("x", dtype="float8_e4m3fn", scaling="channel", scale_dtype="float8_e8m0fnu")
    with pytest.raises(ValueError, match="unknown KV format 'fp4'"):
        KVFormat.named("fp4", rope_dim=64)
    fmt = KVFormat.named("fp8-channel", rope_dim=64)
    with pytest.raises(ValueError, match="rope_dim=64 must be < row width 64"):
        fmt.row_bytes(64)
    with pytest.raises(ValueError, match="needs a scale state"):
        quant.quantize(jnp.ones((1, 512)), fmt, None)
    with pytest.raises(ValueError, match=r"bound.shape=\(3,\)"):
        init_scale_state(512, fmt, bound=jnp.ones(3))
    assert set(ITEMSIZE) >= {"bfloat16", "float8_e4m3fn", "float8_e8m0fnu", "float32"}
