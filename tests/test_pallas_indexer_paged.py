"""dsv4.pallas.indexer_paged: the indexer's scores over its paged key cache against the jnp reference (gather every
listed row, dequantize, score), and its top-k against `index_topk_reference` on the same keys laid out densely.

Every kernel run starts from an output buffer of NaN (`out_init`, aliased), so a score the kernel fails to write
shows up. Every page row nobody wrote is NaN too (also FP8 rows and their tile scales), so a wrong page or a wrong
row within a page that reaches a visible score is caught. Data are small integers with power-of-two scales: every
dot and weighted sum is exact in float32 in any order, so the comparisons are exact, ties are frequent, and the
lowest-index rule is tested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh

from dsv4.pallas.indexer import index_topk_reference
from dsv4.pallas.indexer_paged import (
    PagedScoreBlocks,
    index_scores_paged,
    index_scores_paged_reference,
    index_topk_paged,
)

FP8 = jnp.float8_e4m3fn
SMALL = PagedScoreBlocks(block_c=16, span=32)
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")


def make_inputs(seed, *, fmt="whole", batch=3, queries=1, heads=4, head_dim=16, rope_dim=4, rows=5, max_pages=7,
                entries=(0, 13, 31), dtype=jnp.float32, span=3):  # fmt: skip
    """Integer-valued q [B, S, Hi, Di], weights, and a paged key pool holding request b's first entries[b] keys in
    pages a permuted block table lists (page 0 the null page). Query s of request b sits at the position that sees
    entries[b] - (S - 1 - s) keys (fewer for earlier queries; position -1 for a request with none).
    fmt: "whole" (whole rows in q's dtype), "fp8-channel" or "fp8-tile" (e4m3 channels + RoPE channels in bf16 +
    power-of-two scales). Unwritten rows, and their tile scales, are NaN. → (inputs, keyword arguments, keys
    [B, C, Di] as the cache would give them back, for the dense reference)."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 1
    q = rng.integers(-span, span + 1, (batch, queries, heads, head_dim))
    weights = rng.integers(-2, 3, (batch, queries, heads)).astype(np.float32)
    counts = np.asarray(entries)
    visible = counts[:, None] - (queries - 1 - np.arange(queries))[None]
    positions = np.where(visible > 0, 4 * visible - 1, -1).astype(np.int32)  # rate 4: the first to see them
    table = rng.permutation(np.arange(1, num_pages))[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    values = rng.integers(-span, span + 1, (batch, max_pages * rows, head_dim)).astype(np.float32)
    written = np.arange(max_pages * rows)[None] < counts[:, None]  # [B, C]
    n = head_dim if fmt == "whole" else head_dim - rope_dim
    kw, kw_pages = dict(rate=4, softmax_scale=0.25), {}
    dense = values.copy()
    if fmt == "whole":
        stored = [values]
    else:
        stored = [values[..., :n], values[..., n:]]
        if fmt == "fp8-channel":
            scale = 2.0 ** rng.integers(-2, 3, (n,))
            kw_pages["key_scales"] = jnp.asarray(scale, jnp.float32)
            dense[..., :n] *= scale
        else:
            tiles = -(-n // 64)
            scale = 2.0 ** rng.integers(-2, 3, (batch, max_pages * rows, tiles))
            dense[..., :n] *= np.repeat(scale, 64, -1)[..., :n]
            stored.append(scale)
    pools = []
    for leaf in stored:  # [B, C, w] → pool [P, R, w] through the table, NaN wherever nothing was written
        pool = np.full((num_pages, rows, leaf.shape[-1]), np.nan, np.float32)
        flat = np.where(written[..., None], leaf, np.nan).reshape(batch, max_pages, rows, -1)
        pool[table] = flat
        pools.append(pool)
    if fmt == "whole":
        kw_pages.update(key_pages=jnp.asarray(pools[0], dtype))
    else:
        kw_pages.update(key_pages=jnp.asarray(pools[0], FP8), key_rope_pages=jnp.asarray(pools[1], jnp.bfloat16))
        if fmt == "fp8-tile":
            kw_pages["key_scales"] = jnp.asarray(pools[2], jnp.float32)
    inputs = dict(q=jnp.asarray(q, dtype), weights=jnp.asarray(weights), positions=jnp.asarray(positions),
                  block_table=jnp.asarray(table), **kw_pages)  # fmt: skip
    return inputs, kw, jnp.asarray(np.where(written[..., None], dense, 0.0), dtype)


def poisoned(inputs):
    b, s = inputs["positions"].shape
    return jnp.full((b, s, inputs["block_table"].shape[1] * inputs["key_pages"].shape[1]), jnp.nan, jnp.float32)


CASES = [  # fmt, queries, heads, head_dim, rope_dim, rows per page, max_pages, blocks
    ("whole", 1, 4, 16, 0, 5, 7, SMALL),
    ("whole", 3, 1, 16, 0, 4, 9, SMALL),  # one head; three queries of ragged visibility; capacity 36 > span
    ("fp8-channel", 1, 4, 16, 4, 5, 7, SMALL),  # 12 e4m3 channels: a masked 16-wide tile
    ("fp8-channel", 2, 8, 32, 16, 8, 5, PagedScoreBlocks(block_c=16, span=16)),  # 16 + 16: both parts whole
    ("fp8-tile", 1, 4, 16, 4, 5, 7, SMALL),
    ("fp8-tile", 2, 4, 80, 8, 3, 11, SMALL),  # 72 e4m3 channels: two scale tiles, the second partial
    ("fp8-channel", 1, 64, 128, 64, 16, 4, PagedScoreBlocks(block_c=32, span=64)),  # V4's indexer heads and dims
]


@pytest.mark.parametrize("fmt, queries, heads, head_dim, rope_dim, rows, max_pages, blocks", CASES)
def test_scores_match_reference(fmt, queries, heads, head_dim, rope_dim, rows, max_pages, blocks):
    entries = (0, 13, rows * max_pages - 2)  # none; a page boundary ± 1 away; all but the last two rows
    inputs, kw, _ = make_inputs(1, fmt=fmt, queries=queries, heads=heads, head_dim=head_dim, rope_dim=rope_dim,
                                rows=rows, max_pages=max_pages, entries=entries,
                                dtype=jnp.bfloat16 if fmt != "whole" else jnp.float32)  # fmt: skip
    got = np.asarray(index_scores_paged(**inputs, **kw, blocks=blocks, interpret=True, out_init=poisoned(inputs)))
    want = np.asarray(index_scores_paged_reference(**inputs, **kw))
    assert not np.isnan(got).any(), "scores left unwritten (NaN poison) or NaN rows read"
    np.testing.assert_array_equal(got, want)
    assert np.isneginf(got[0]).all()  # a request with no visible key: -inf everywhere
    assert np.isfinite(got[2, -1, : entries[2]]).all() and np.isneginf(got[2, -1, entries[2] :]).all()


@pytest.mark.parametrize("fmt", ["whole", "fp8-channel", "fp8-tile"])
@pytest.mark.parametrize("k", [5, 40])  # 40 > C = 35: -1 past every request's visible count
def test_topk_matches_the_dense_reference(fmt, k):
    inputs, kw, dense_keys = make_inputs(2, fmt=fmt, queries=2, entries=(1, 17, 33),
                                         dtype=jnp.bfloat16 if fmt != "whole" else jnp.float32)  # fmt: skip
    got = np.asarray(index_topk_paged(**inputs, **kw, k=k, blocks=SMALL, interpret=True))
    want = np.asarray(index_topk_reference(inputs["q"], dense_keys, inputs["weights"], inputs["positions"], k=k,
                                           **kw))  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert (got[0, 0] == -1).all() and (got[0, 1, 1:] == -1).all()  # request 0 sees 0, then 1 key


def test_dense_slots_as_pages():
    """A dense per-slot store is a pool whose page b is slot b: block_table [[0], [1], ...] (as the model passes)."""
    inputs, kw, dense_keys = make_inputs(3, rows=35, max_pages=1, entries=(4, 0, 35))
    b = dense_keys.shape[0]
    pages = jnp.asarray(dense_keys)  # [B, C, Di]: slot b's rows
    inputs.update(key_pages=pages, block_table=jnp.arange(b, dtype=jnp.int32)[:, None])
    got = np.asarray(index_topk_paged(**inputs, **kw, k=6, blocks=SMALL, interpret=True))
    want = np.asarray(index_topk_reference(inputs["q"], dense_keys, inputs["weights"], inputs["positions"], k=6,
                                           **kw))  # fmt: skip
    np.testing.assert_array_equal(got, want)


def test_unordered_picks_are_the_same_set():
    """ordered=False with the refinement kernel (interpreted): each query's picks are the ordered call's, in another
    order. Over 2048 visible keys, so the selection groups and refines."""
    inputs, kw, _ = make_inputs(5, batch=2, queries=2, rows=64, max_pages=34, entries=(2100, 2170))
    run = functools.partial(index_topk_paged, **inputs, **kw, k=64, interpret=True, selection="kernel")
    ordered, unordered = np.asarray(run()), np.asarray(run(ordered=False))
    np.testing.assert_array_equal(np.sort(unordered, -1), np.sort(ordered, -1))
    assert (unordered != ordered).any() and (ordered >= 0).all()


def test_validation_names_the_tensor():
    inputs, kw, _ = make_inputs(4, fmt="fp8-channel", dtype=jnp.bfloat16)
    run = lambda **over: index_scores_paged(**{**inputs, **over}, **kw, interpret=True)  # noqa: E731
    with pytest.raises(ValueError, match="key_scales is required"):
        run(key_scales=None)
    with pytest.raises(ValueError, match="key_scales.shape=.* fits neither per-channel"):
        run(key_scales=inputs["key_scales"][:5])
    with pytest.raises(ValueError, match="holds 12 of q's Di = 16 channels"):
        run(key_rope_pages=None)
    with pytest.raises(ValueError, match="weights must be"):
        run(weights=inputs["weights"][:, :, :2])
    with pytest.raises(ValueError, match="block_table must be integer"):
        run(block_table=inputs["block_table"][:2])
    with pytest.raises(ValueError, match="at most 16 queries"):
        q = jnp.zeros((3, 17, 4, 16), jnp.bfloat16)
        run(q=q, weights=jnp.zeros((3, 17, 4)), positions=jnp.zeros((3, 17), jnp.int32))
    with pytest.raises(ValueError, match="unquantized key_pages must be"):
        run(key_pages=jnp.zeros((4, 5, 12), jnp.bfloat16), key_scales=None, key_rope_pages=None)
    with pytest.raises(ValueError, match="needs Hi a power of two >= 16"):
        index_scores_paged(**inputs, **kw)  # compiled (not interpreted): 4 heads are below tl.dot's 16 rows
    with pytest.raises(ValueError, match="PagedScoreBlocks.block_c=24"):
        PagedScoreBlocks(block_c=24)
    with pytest.raises(ValueError, match="span=16 must be >= block_c=32"):
        PagedScoreBlocks(block_c=32, span=16)


@pytest.mark.parametrize("fmt", ["whole", "fp8-channel", "fp8-tile"])
def test_lowers_to_triton_at_v4_shapes(fmt, monkeypatch):
    """V4's indexer (64 heads × 128, 64 RoPE channels) over 256-token pages (64 entries each), 512 pages a
    request: lowered for an abstract H200, the Triton module verifies; 2 dots a tile for split rows, 1 for whole."""
    from dsv4.pallas._jax_compat import triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module
    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module",
                        lambda *a, **k: modules.append(original(*a, **k)) or modules[-1])  # fmt: skip
    sds = jax.ShapeDtypeStruct
    b, h, d, rows, pages = 4, 64, 128, 64, 512
    args = dict(q=sds((b, 1, h, d), jnp.bfloat16), weights=sds((b, 1, h), jnp.float32),
                positions=sds((b, 1), jnp.int32), block_table=sds((b, pages), jnp.int32))  # fmt: skip
    if fmt == "whole":
        args["key_pages"] = sds((b * pages, rows, d), jnp.bfloat16)
    else:
        args.update(key_pages=sds((b * pages, rows, 64), FP8), key_rope_pages=sds((b * pages, rows, 64), jnp.bfloat16),
                    key_scales=sds((64,) if fmt == "fp8-channel" else (b * pages, rows, 1), jnp.float32))  # fmt: skip
    names = tuple(args)

    def fn(*arrays):
        return index_topk_paged(**dict(zip(names, arrays)), rate=4, k=512, softmax_scale=d**-0.5, selection="xla")

    with abstract_gpu_mesh():
        hlo = jax.jit(fn).trace(*args.values()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo
    [result] = modules
    assert result.module.operation.verify()
    assert list(result.grid) == [pages * rows // 1024, b]
    assert str(result.module).count("tt.dot") == (1 if fmt == "whole" else 2)


@gpu
@requires_gpu
@pytest.mark.parametrize("fmt", ["whole", "fp8-channel", "fp8-tile"])
def test_gpu_matches_reference_at_v4_shapes(fmt):
    shape = dict(batch=4, heads=64, head_dim=128, rope_dim=64, rows=64, max_pages=40, entries=(0, 1, 1000, 2559))
    inputs, kw, dense_keys = make_inputs(5, fmt=fmt, dtype=jnp.bfloat16, span=2, **shape)
    got = np.asarray(index_scores_paged(**inputs, **kw, out_init=poisoned(inputs)))
    np.testing.assert_array_equal(got, np.asarray(index_scores_paged_reference(**inputs, **kw)))
    picks = np.asarray(index_topk_paged(**inputs, **kw, k=512))
    want = index_topk_reference(inputs["q"], dense_keys, inputs["weights"], inputs["positions"], k=512, **kw)
    np.testing.assert_array_equal(picks, np.asarray(want))
