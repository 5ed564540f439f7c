"""dsv4.pallas.decode: the paged flash-decoding kernel against its jnp reference, and the reference against the
prefill reference (`v4_attention_reference`) on the same tokens laid out unpaged.

Caches are built the way a cache writer would: each request's whole token history is written token by token into
its ring (so long requests wrap several times and only the last `ring_size` tokens survive), page ids come from a
random permutation, and every slot nobody wrote — unused pages, unused ring slots, the null page that unused
block-table columns point to, compressed entries past a request's count — holds NaN. A row the kernel reads
without masking it therefore turns the output NaN. The kernel's partial buffers start as NaN too (`out_init`), so
a (request, head, split) it fails to write also shows up.

Tolerances as in tests/test_pallas_attention.py: float32 at 2e-5 (online softmax and exp2 vs one-shot exp, plus the
split combine, differ by float32 rounding only); bfloat16 at 3e-2 absolute (both sides round unnormalized
probabilities to bfloat16 for P·V, against different maxima, and the output is bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.pallas.attention import SCALE_TILE, v4_attention_reference
from dsv4.pallas.decode import BlockSizes, default_num_splits, paged_decode_attention, paged_decode_attention_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
SMALL = BlockSizes(block_kv=16, num_splits=3)

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")

# NOTE: interpret mode spends its time in XLA:CPU compiling the interpreted grid loop; these options halve that.
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
STATIC = ("sliding_window", "scale", "ring_size")


def _pages_for(rng, free, count):
    """Takes `count` page ids from the shuffled free list (in place)."""
    taken, free[:] = free[:count], free[count:]
    return taken


def make_cache(seed, seq_lens, *, heads=4, head_dim=32, window=16, page_size=8, ring_size=None, rate=None,
               compressed_page_size=4, dtype=jnp.float32, sink_scale=1.0):  # fmt: skip
    """Random q, sinks and per-request histories written into paged caches. → (kernel inputs, unpaged history).

    rate=None: window only. Otherwise also a compressed pool holding L // rate entries per request (random values,
    one per `rate` tokens). Unused block-table columns point at page 0, the NaN null page.
    """
    rng = np.random.default_rng(seed)
    ring_size = ring_size or window
    batch, d = len(seq_lens), head_dim
    ring_pages = -(-ring_size // page_size)
    num_pages = 1 + batch * ring_pages + 3  # + null page 0 + a few never used
    free = list(1 + rng.permutation(num_pages - 1))
    max_len = max(max(seq_lens), 1)
    history = rng.standard_normal((batch, max_len, d)).astype(np.float32)
    pages = np.full((num_pages, page_size, d), np.nan, np.float32)
    tables = np.zeros((batch, ring_pages + 1), np.int32)  # one spare column, never used: null page
    for b, length in enumerate(seq_lens):
        used = min(-(-min(length, ring_size) // page_size), ring_pages)
        tables[b, :used] = _pages_for(rng, free, used)
        for t in range(length):
            slot = t % ring_size
            pages[tables[b, slot // page_size], slot % page_size] = history[b, t]
    inputs = dict(q=rng.standard_normal((batch, heads, d)).astype(np.float32), kv_pages=pages, block_tables=tables,
                  seq_lens=np.asarray(seq_lens, np.int32),
                  sinks=(rng.standard_normal(heads) * sink_scale).astype(np.float32))  # fmt: skip
    extra = dict(history=history)
    if rate is not None:
        counts = [length // rate for length in seq_lens]
        max_entries = max(max(counts), 1)
        cpages_per_request = -(-max_entries // compressed_page_size) + 1  # one spare column
        entries = rng.standard_normal((batch, max_entries, d)).astype(np.float32)
        cpages = np.full((1 + batch * cpages_per_request, compressed_page_size, d), np.nan, np.float32)
        cfree = list(1 + rng.permutation(cpages.shape[0] - 1))
        ctables = np.zeros((batch, cpages_per_request), np.int32)
        for b, count in enumerate(counts):
            used = -(-count // compressed_page_size)
            ctables[b, :used] = _pages_for(rng, cfree, used)
            for c in range(count):
                cpages[ctables[b, c // compressed_page_size], c % compressed_page_size] = entries[b, c]
        inputs.update(compressed_pages=cpages, compressed_block_tables=ctables,
                      compressed_lens=np.asarray(counts, np.int32))  # fmt: skip
        extra["entries"] = entries
    inputs = {k: jnp.asarray(v, dtype if k in ("q", "kv_pages", "compressed_pages") else None)
              for k, v in inputs.items()}  # fmt: skip
    return inputs, extra


def make_topk(seed, counts, k):
    """CSA picks per request: distinct entries below the count in random slots, -1 elsewhere, plus one id at or past
    the count (must be ignored) where a slot is left."""
    rng = np.random.default_rng(seed + 1000)
    out = np.full((len(counts), k), -1, np.int32)
    for b, count in enumerate(np.asarray(counts)):
        picks = rng.permutation(count)[: rng.integers(0, min(count, k) + 1)]
        slots = rng.permutation(k)
        out[b, slots[: picks.size]] = picks
        if picks.size < k:
            out[b, slots[picks.size]] = count + rng.integers(0, 3)  # past the count: ignored
    return jnp.asarray(out)


def quantize(pages, layout):
    """pages [P, ps, D] f32 (NaN in unused slots) → (float8_e4m3fn pages, f32 scales) in the given scale layout."""
    finite = jnp.nan_to_num(pages, nan=0.0)
    if layout == "channel":
        scales = jnp.maximum(jnp.max(jnp.abs(finite), axis=(0, 1)), 1e-6) / 448.0  # [D]
        full = scales[None, None, :]
    else:
        p, ps, d = pages.shape
        tiles = finite.reshape(p, ps, d // SCALE_TILE, SCALE_TILE)
        scales = jnp.maximum(jnp.max(jnp.abs(tiles), axis=-1), 1e-6) / 448.0  # [P, ps, D // 64]
        full = jnp.repeat(scales, SCALE_TILE, axis=-1)
    return (pages / full).astype(jnp.float8_e4m3fn), scales.astype(jnp.float32)


def run_both(inputs, *, block_sizes=SMALL, **kw):
    """Kernel (interpreted, NaN-poisoned partial buffers) and reference on the same inputs."""
    dynamic = {k: v for k, v in kw.items() if k not in STATIC}
    lowered = paged_decode_attention.trace(**inputs, **kw, block_sizes=block_sizes, interpret=True,
                                           out_init=jnp.nan).lower()  # fmt: skip
    got = lowered.compile(compiler_options=FAST_CPU_COMPILE)(**inputs, **dynamic, out_init=jnp.nan)
    want = paged_decode_attention_reference(**inputs, **kw)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


def assert_close(got, want, dtype):
    assert not np.isnan(want).any(), "reference read a NaN (unwritten) cache slot"
    assert not np.isnan(got).any(), "kernel read an unwritten slot or left a partial unwritten (NaN)"
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)


# ---------------------------------------------------------------------------------------------
# Window ring only.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, seq_lens, ring_size, block_sizes, dtype",
    [
        # lengths 1, page - 1, page, page + 1, the window, window + 1 and long (the ring wraps 6 times)
        (0, [1, 7, 8, 9, 16, 17, 100], None, SMALL, jnp.float32),
        # a ring larger than the window (40 slots = 5 pages) wraps at a different point than the window ends
        (1, [3, 39, 41, 130], 40, BlockSizes(block_kv=16, num_splits=1), jnp.float32),
        (2, [1, 9, 250], None, BlockSizes(block_kv=16, num_splits=2), jnp.bfloat16),
    ],
)
def test_window_matches_reference(seed, seq_lens, ring_size, block_sizes, dtype):
    inputs, _ = make_cache(seed, seq_lens, ring_size=ring_size, dtype=dtype)
    got, want = run_both(inputs, sliding_window=16, scale=0.2, ring_size=ring_size, block_sizes=block_sizes)
    assert_close(got, want, dtype)


def test_empty_slots_and_extreme_sinks():
    """seq_len 0 (an empty batch slot) sees only its sink: output exactly 0, also for a -inf sink (not NaN). The
    default split count (heuristic) and block_h < H (two head blocks) are used here."""
    inputs, _ = make_cache(3, [0, 5, 30], heads=8, window=16)
    inputs["sinks"] = jnp.asarray([30.0, -30.0, 8.0, 0.0, -np.inf, 1e4, -1e4, 2.0], jnp.float32)
    got, want = run_both(inputs, sliding_window=16, scale=0.3, block_sizes=BlockSizes(block_h=4, block_kv=16))
    assert_close(got, want, jnp.float32)
    assert (got[0] == 0).all() and np.abs(got[1:, [0, 1, 2, 3, 4, 6, 7]]).min() > 0


# ---------------------------------------------------------------------------------------------
# Compressed pools: HCA and CSA.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, mode, seq_lens, block_sizes, dtype",
    [
        (4, "hca", [1, 8, 9, 77, 300], SMALL, jnp.float32),  # counts 0, 2, 2, 19, 75
        (5, "hca", [40, 150], BlockSizes(block_kv=16, num_splits=5), jnp.bfloat16),
        (6, "csa", [1, 33, 70, 300], SMALL, jnp.float32),
        (7, "csa", [12, 200], BlockSizes(block_kv=16, num_splits=1), jnp.bfloat16),
    ],
)
def test_compressed_matches_reference(seed, mode, seq_lens, block_sizes, dtype):
    inputs, _ = make_cache(seed, seq_lens, rate=4, dtype=dtype)
    kw = dict(sliding_window=16, scale=0.2)
    if mode == "csa":
        kw["topk_indices"] = make_topk(seed, inputs["compressed_lens"], k=24)
    got, want = run_both(inputs, block_sizes=block_sizes, **kw)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("mode, kv_layout, compressed_layout", [("hca", "tile", "channel"), ("csa", "channel", "tile")])
def test_fp8_matches_reference(mode, kv_layout, compressed_layout):
    # head_dim 128 = two 64-channel scale tiles per row: a tile scale applied to the wrong channels shows
    inputs, _ = make_cache(8, [5, 64, 200], head_dim=128, rate=4, dtype=jnp.float32)
    inputs["q"] = inputs["q"].astype(jnp.bfloat16)
    kw = dict(sliding_window=16, scale=128**-0.5)
    inputs["kv_pages"], kw["kv_scales"] = quantize(inputs["kv_pages"], kv_layout)
    inputs["compressed_pages"], kw["compressed_scales"] = quantize(inputs["compressed_pages"], compressed_layout)
    if mode == "csa":
        kw["topk_indices"] = make_topk(8, inputs["compressed_lens"], k=20)
    got, want = run_both(inputs, **kw)
    assert_close(got, want, jnp.bfloat16)


def split_rows(pages, layout, rope_dim):
    """pages [P, ps, D] f32 → the cache's split FP8 rows: (nope float8_e4m3fn [P, ps, n], f32 scales, rope bf16
    [P, ps, Dr]) with n = D - Dr, scales per channel [n] or per row and 64-channel tile [P, ps, ceil(n / 64)] (the
    last tile short when n is not a multiple of 64), as `dsv4.cache.quant.quantize` lays them out."""
    n = pages.shape[-1] - rope_dim
    nope, rope = pages[..., :n], pages[..., n:].astype(jnp.bfloat16)
    finite = jnp.abs(jnp.nan_to_num(nope, nan=0.0))
    if layout == "channel":
        scales = jnp.maximum(finite.max(axis=(0, 1)), 1e-6) / 448.0  # [n]
        full = scales
    else:
        tiles = -(-n // SCALE_TILE)
        padded = jnp.pad(finite, ((0, 0), (0, 0), (0, tiles * SCALE_TILE - n)))
        scales = jnp.maximum(padded.reshape(*finite.shape[:2], tiles, SCALE_TILE).max(-1), 1e-6) / 448.0
        full = jnp.repeat(scales, SCALE_TILE, axis=-1)[..., :n]
    return (nope / full).astype(jnp.float8_e4m3fn), scales.astype(jnp.float32), rope


def whole_rows(nope, scales, rope):
    """Split rows back to whole bf16 rows the way the cache reads them (`dsv4.cache.quant.dequantize`)."""
    from dsv4.cache.layout import KVFormat
    from dsv4.cache.quant import dequantize

    tile = scales.ndim == 3
    fmt = KVFormat("t", dtype="float8_e4m3fn", scaling="tile" if tile else "channel", rope_dim=rope.shape[-1])
    stored = dict(nope=nope, rope=rope, **({"scale": scales} if tile else {}))
    return dequantize(stored, fmt, None if tile else {"scale": scales}, jnp.bfloat16)


@pytest.mark.parametrize("mode, head_dim, rope_dim, kv_layout, compressed_layout", [
    ("hca", 128, 16, "tile", "channel"),  # n = 112: two scale tiles, the second 48 channels
    ("csa", 128, 64, "channel", "tile"),
    ("csa", 32, 8, "tile", "tile"),  # D < 64: each channel's tile scale gathered (the tiny models' shapes)
])  # fmt: skip
def test_split_fp8_rows_match_the_whole_rows_they_dequantize_to(mode, head_dim, rope_dim, kv_layout,
                                                               compressed_layout):  # fmt: skip
    """The cache's FP8 rows (nope channels e4m3 + scales, RoPE channels bf16 in their own pages): the kernel on the
    split rows equals the whole-row reference on the rows `dsv4.cache.quant.dequantize` gives back, and the reference
    on the split rows equals it too. NaN in every unwritten slot (the nope pages' NaN becomes e4m3 NaN)."""
    inputs, _ = make_cache(12, [5, 64, 200], head_dim=head_dim, rate=4, dtype=jnp.float32)
    inputs["q"] = inputs["q"].astype(jnp.bfloat16)
    kw = dict(sliding_window=16, scale=head_dim**-0.5)
    if mode == "csa":
        kw["topk_indices"] = make_topk(12, inputs["compressed_lens"], k=20)
    split = dict(inputs)
    split["kv_pages"], kv_scales, split["kv_rope_pages"] = split_rows(inputs["kv_pages"], kv_layout, rope_dim)
    split["compressed_pages"], c_scales, split["compressed_rope_pages"] = split_rows(
        inputs["compressed_pages"], compressed_layout, rope_dim)  # fmt: skip
    whole = dict(inputs, kv_pages=whole_rows(split["kv_pages"], kv_scales, split["kv_rope_pages"]),
                 compressed_pages=whole_rows(split["compressed_pages"], c_scales, split["compressed_rope_pages"]))
    got, want_split = run_both(split, kv_scales=kv_scales, compressed_scales=c_scales, **kw)
    want = np.asarray(paged_decode_attention_reference(**whole, **kw), np.float32)
    assert_close(got, want, jnp.bfloat16)
    assert_close(want_split, want, jnp.bfloat16)
    assert np.abs(want_split - want).max() < 1e-2  # the same rows, one rounding apart at most


# ---------------------------------------------------------------------------------------------
# The decode reference against the prefill reference (tokens unpaged, query at position L - 1).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
def test_reference_matches_prefill_reference(mode):
    seq_lens = [0, 1, 9, 16, 17, 123]
    inputs, extra = make_cache(9, seq_lens, rate=None if mode == "window" else 4)
    kw = dict(sliding_window=16, scale=0.2)
    lens = np.asarray(seq_lens)
    t = np.arange(extra["history"].shape[1])
    prefill = dict(q=inputs["q"][:, None], kv=jnp.asarray(extra["history"]),
                   q_pos=jnp.asarray(lens[:, None] - 1, jnp.int32),
                   kv_pos=jnp.asarray(np.where(t[None] < lens[:, None], t[None], -1), jnp.int32),
                   sinks=inputs["sinks"])  # fmt: skip
    if mode != "window":
        prefill.update(compressed=jnp.asarray(extra["entries"]), compress_rate=4)
    decode_kw = dict(kw)
    if mode == "csa":
        topk = make_topk(9, inputs["compressed_lens"], k=8)
        decode_kw["topk_indices"] = topk
        # the prefill reference ignores ids >= C (the array length) but not ids in [count, C): drop those here
        prefill["topk_indices"] = jnp.where(topk < jnp.asarray(lens[:, None] // 4), topk, -1)[:, None]
        assert (np.asarray(topk) >= lens[:, None] // 4).any() and (prefill["topk_indices"] >= 0).any()
    want = v4_attention_reference(**prefill, **kw)[:, 0]
    got = paged_decode_attention_reference(**inputs, **decode_kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


# ---------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_h=6), "block_h=6"),
        (dict(block_kv=8), "block_kv=8"),
        (dict(num_splits=0), "num_splits=0"),
        (dict(num_warps=3), "num_warps=3"),
        (dict(num_stages=0), "num_stages=0"),
    ],
)
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_input_validation_names_shapes():
    inputs, _ = make_cache(10, [3, 20], rate=4)
    call = dict(sliding_window=16, scale=0.1, interpret=True)
    window_only = {k: v for k, v in inputs.items() if not k.startswith("compressed")}
    with pytest.raises(ValueError, match=r"kv_pages.shape=\(\d+, 8, 16\)"):
        paged_decode_attention(**dict(window_only, kv_pages=inputs["kv_pages"][..., :16]), **call)
    with pytest.raises(ValueError, match=r"block_tables must be int32 \[B, >= ceil\(ring_size / page_size\)\]"):
        paged_decode_attention(**dict(window_only, block_tables=inputs["block_tables"][:, :1]), **call)
    with pytest.raises(ValueError, match="ring_size=8 must be an int >= sliding_window=16"):
        paged_decode_attention(**window_only, ring_size=8, **call)
    with pytest.raises(ValueError, match="kv_scales is required"):
        paged_decode_attention(**dict(window_only, kv_pages=inputs["kv_pages"].astype(jnp.float8_e4m3fn)), **call)
    with pytest.raises(ValueError, match=r"compressed_lens must be int32 \[B\] = \(2,\)"):
        paged_decode_attention(**dict(inputs, compressed_lens=None), **call)
    with pytest.raises(ValueError, match="without compressed_pages"):
        paged_decode_attention(**window_only, topk_indices=jnp.zeros((2, 4), jnp.int32), **call)
    with pytest.raises(ValueError, match=r"topk_indices must be int32 \[B, K >= 1\]"):
        paged_decode_attention(**inputs, topk_indices=jnp.zeros((3, 4), jnp.int32), **call)
    with pytest.raises(ValueError, match="does not divide num_heads=6"):
        paged_decode_attention(**make_cache(10, [3], heads=6)[0], **call, block_sizes=BlockSizes(block_h=4))
    nope, scales, rope = split_rows(inputs["kv_pages"], "channel", 8)
    split = dict(window_only, kv_pages=nope, kv_scales=scales, kv_rope_pages=rope)
    with pytest.raises(ValueError, match=r"kv_rope_pages.shape=\(\d+, 8, 4\) must be .* D = 32"):
        paged_decode_attention(**dict(split, kv_rope_pages=rope[..., :4]), **call)
    with pytest.raises(ValueError, match="kv_pages must hold the FP8 nope channels"):
        paged_decode_attention(**dict(split, kv_pages=inputs["kv_pages"][..., :24], kv_scales=None), **call)
    with pytest.raises(ValueError, match=r"kv_scales.shape=\(32,\) fits neither per-channel \(24,\)"):
        paged_decode_attention(**dict(split, kv_scales=jnp.ones(32, jnp.float32)), **call)
    with pytest.raises(ValueError, match="split rows .* whole rows only"):
        paged_decode_attention(**split, **call, impl="mgpu")
    with pytest.raises(ValueError, match="tile rows"):  # tl.dot needs >= 16 rows when compiled
        paged_decode_attention(**window_only, sliding_window=16, scale=0.1)


# ---------------------------------------------------------------------------------------------
# Triton lowering (runs on CPU: lowers for an abstract H200, builds and verifies the Triton module; no ptxas).
# ---------------------------------------------------------------------------------------------
def test_default_num_splits_fills_one_wave():
    # (programs, key blocks, SMs) → splits, worked out by hand: floor(SMs / programs), capped by the blocks
    assert default_num_splits(32, 66, 132) == 4  # 128 programs: one wave (5 splits would spill 28 into a second)
    assert default_num_splits(1, 66, 132) == 66  # one request: a split per key block
    assert default_num_splits(1, 2050, 132) == 132
    assert default_num_splits(200, 66, 132) == 1  # more programs than SMs: no split
    assert default_num_splits(8, 2, 132) == 2


@pytest.mark.parametrize("mode", ["window", "hca", "csa-fp8", "csa-fp8-split"])
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
    b, h, d, pages, page_size = 8, 64, 512, 300, 64  # V4-Flash heads and head dim; W = 128 = 2 pages
    dtype = jnp.float8_e4m3fn if "fp8" in mode else jnp.bfloat16
    dynamic = dict(q=sds((b, h, d), jnp.bfloat16), kv_pages=sds((pages, page_size, d), dtype),
                   block_tables=sds((b, 2), jnp.int32), seq_lens=sds((b,), jnp.int32),
                   sinks=sds((h,), jnp.float32))  # fmt: skip
    if mode != "window":
        dynamic.update(
            compressed_pages=sds((pages, page_size, d), dtype),
            compressed_block_tables=sds((b, 100), jnp.int32),
            compressed_lens=sds((b,), jnp.int32),
        )
    if mode.startswith("csa"):
        dynamic["topk_indices"] = sds((b, 512), jnp.int32)
    if mode == "csa-fp8":
        dynamic.update(kv_scales=sds((d,), jnp.float32),
                       compressed_scales=sds((pages, page_size, d // SCALE_TILE), jnp.float32))  # fmt: skip
    if mode == "csa-fp8-split":  # the cache's FP8 rows: 448 e4m3 channels (7 scale tiles) + 64 bf16 RoPE channels
        n = d - 64
        dynamic.update(kv_pages=sds((pages, page_size, n), dtype), compressed_pages=sds((pages, page_size, n), dtype),
                       kv_scales=sds((n,), jnp.float32), compressed_scales=sds((pages, page_size, 7), jnp.float32),
                       kv_rope_pages=sds((pages, page_size, 64), jnp.bfloat16),
                       compressed_rope_pages=sds((pages, page_size, 64), jnp.bfloat16))  # fmt: skip
    names = tuple(dynamic)

    def fn(*arrays):
        return paged_decode_attention(**dict(zip(names, arrays)), sliding_window=128, scale=d**-0.5)

    with abstract_gpu_mesh():
        hlo = jax.jit(fn).trace(*dynamic.values()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo
    [result] = modules
    assert result.module.operation.verify()
    # splits: min(132 SMs // 8 programs = 16, key blocks): window 2 blocks; HCA 2 + 6400 / 64; CSA 2 + 512 / 64;
    # split rows' tiles (SPLIT_ROW_BLOCK_SIZES) hold 32 keys: CSA 4 + 512 / 32
    assert list(result.grid) == [b, 1, {"window": 2, "hca": 16, "csa-fp8": 10, "csa-fp8-split": 16}[mode]]
    # two dots a step (Q·Kᵀ, P·V) per loop; split rows add one of each for their RoPE channels
    assert str(result.module).count("tt.dot") == {"window": 2, "hca": 4, "csa-fp8": 4, "csa-fp8-split": 8}[mode]


# ---------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernel at V4 shapes.
# ---------------------------------------------------------------------------------------------
@gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["window", "hca", "csa", "csa-fp8", "hca-fp8-split", "csa-fp8-split"])
def test_gpu_matches_reference_at_real_shapes(mode):
    seq_lens = [1, 63, 64, 65, 128, 129, 1000, 5000]
    inputs, _ = make_cache(11, seq_lens, heads=64, head_dim=512, window=128, page_size=64, compressed_page_size=64,
                           rate=None if mode == "window" else 4, dtype=jnp.bfloat16)  # fmt: skip
    kw = dict(sliding_window=128, scale=512**-0.5)
    if mode.startswith("csa"):
        kw["topk_indices"] = make_topk(11, inputs["compressed_lens"], k=512)
    if mode == "csa-fp8":
        inputs["kv_pages"], kw["kv_scales"] = quantize(inputs["kv_pages"].astype(jnp.float32), "channel")
        pages = inputs["compressed_pages"].astype(jnp.float32)
        inputs["compressed_pages"], kw["compressed_scales"] = quantize(pages, "tile")
    if mode.endswith("split"):  # the cache's rows: 448 e4m3 channels (7 scale tiles) + 64 bf16 RoPE channels
        inputs["kv_pages"], kw["kv_scales"], kw["kv_rope_pages"] = split_rows(
            inputs["kv_pages"].astype(jnp.float32), "channel", 64)  # fmt: skip
        inputs["compressed_pages"], kw["compressed_scales"], kw["compressed_rope_pages"] = split_rows(
            inputs["compressed_pages"].astype(jnp.float32), "tile", 64)  # fmt: skip
    got = np.asarray(paged_decode_attention(**inputs, **kw, out_init=jnp.nan), np.float32)
    want = np.asarray(paged_decode_attention_reference(**inputs, **kw), np.float32)
    assert_close(got, want, jnp.bfloat16)
