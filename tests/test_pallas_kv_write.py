"""dsv4.pallas.kv_write: the quantize-and-write kernel against its jnp reference (bytes equal), the reference against
the cache's own spec (`dsv4.cache.quant` through `KVStore.write`), and (DSV4_SLOW_TESTS=1) the model writing its cache
through the kernel.

Every page leaf starts as NaN (its scale leaf too, all-ones bytes for e8m0), so a row the kernel writes in the wrong
place, a row it should have dropped, or a row it leaves half-written shows up in a byte comparison of the whole pool.
Indices cover every drop rule: negative, past the request's capacity, and a block-table entry past the pool.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_mesh import abstract_gpu_mesh
from opt_in import slow_opt_in

from dsv4.cache import quant
from dsv4.cache.layout import KVFormat
from dsv4.cache.store import KVStore
from dsv4.pallas.kv_write import WriteBlocks, kv_write, kv_write_reference, pow2_ceil

FP8, E8M0, BF16, F32 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.bfloat16, jnp.float32
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")


def bytes_of(tree) -> list[np.ndarray]:
    """Every leaf as raw bytes: NaN payloads and -0.0 compare exactly."""
    return [np.atleast_1d(np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 else x))
            .view(np.uint8) for x in jax.tree.leaves(tree)]  # fmt: skip


def assert_same_bytes(got, want):
    got, want = bytes_of(got), bytes_of(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def make_write(seed, *, scaling, width, rope, batch=3, n=13, rows_per_page=4, max_pages=4, tile=64, e8m0=False,
               rows_dtype=BF16, values_dtype=BF16, spread=3.0):  # fmt: skip
    """Rows [B, n, width], distinct indices per request (some negative, some past the capacity), a permuted block
    table into a NaN-poisoned pool of pages (one entry past the pool), and per-array scales (one channel unset).
    → (positional args, keyword args) of `kv_write`."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 2
    capacity = max_pages * rows_per_page
    rows = jnp.asarray(rng.standard_normal((batch, n, width)) * spread, rows_dtype)
    index = np.stack([rng.permutation(np.arange(-3, capacity + 3))[:n] for _ in range(batch)])
    table = rng.permutation(np.arange(1, num_pages))[: batch * max_pages].reshape(batch, max_pages)
    table[-1, -1] = num_pages + 5  # a bad page id: its rows are dropped, never written out of bounds
    nope = width - rope
    if scaling == "none":
        pages = {"values": jnp.full((num_pages, rows_per_page, width), jnp.nan, values_dtype)}
    else:
        pages = {"nope": jnp.full((num_pages, rows_per_page, nope), jnp.nan, FP8)}
        if rope:
            pages["rope"] = jnp.full((num_pages, rows_per_page, rope), jnp.nan, BF16)
        if scaling == "tile":
            pages["scale"] = jnp.full((num_pages, rows_per_page, -(-nope // tile)), jnp.nan, E8M0 if e8m0 else F32)
    scales = None
    if scaling in ("tensor", "channel"):
        values = rng.uniform(0.005, 0.05, nope) if scaling == "channel" else np.full(nope, 0.02)
        values[1] = 0.0  # unset: divides by 1, as the reference does
        scales = jnp.asarray(values, F32)
    args = (rows, jnp.asarray(index, jnp.int32), jnp.asarray(table, jnp.int32), pages, scales)
    return args, dict(scaling=scaling, tile=tile)


CASES = [  # scaling, width, rope, e8m0, rows_dtype, blocks
    ("none", 40, 0, False, BF16, WriteBlocks(block_rows=4, block_cols=16)),  # 40 channels: 16 + 16 + a masked 8
    ("none", 24, 0, False, F32, WriteBlocks(block_rows=8, block_cols=32)),  # float32 rows into bf16 pages: rounded
    ("tensor", 40, 8, False, BF16, WriteBlocks(block_rows=4, block_cols=16)),
    ("channel", 40, 8, False, BF16, WriteBlocks(block_rows=4, block_cols=16)),
    ("channel", 90, 0, False, F32, WriteBlocks(block_rows=2, block_cols=64)),  # no RoPE channels: no rope leaf
    ("tile", 40, 8, False, BF16, WriteBlocks(block_rows=4)),  # 32 channels: one short tile
    ("tile", 80, 8, True, BF16, WriteBlocks(block_rows=16)),  # 72 channels: 64 + a short 8; e8m0 scales
    ("tile", 512, 64, True, BF16, WriteBlocks()),  # V4's row: 448 e4m3 channels in 7 tiles, 64 bf16 RoPE channels
    ("channel", 512, 64, False, BF16, WriteBlocks()),
]


@pytest.mark.parametrize("scaling, width, rope, e8m0, rows_dtype, blocks", CASES)
def test_kernel_writes_the_references_bytes(scaling, width, rope, e8m0, rows_dtype, blocks):
    args, kw = make_write(1, scaling=scaling, width=width, rope=rope, e8m0=e8m0, rows_dtype=rows_dtype)
    got, got_seen = kv_write(*args, **kw, blocks=blocks, interpret=True)
    want, want_seen = kv_write_reference(*args, **kw)
    assert_same_bytes(got, want)
    if scaling in ("tensor", "channel"):
        np.testing.assert_array_equal(np.asarray(got_seen), np.asarray(want_seen))
    else:
        assert got_seen is None and want_seen is None
    rows, index, table, pages, _ = args
    per_page = next(iter(pages.values())).shape[1]
    kept = sum(0 <= i < table.shape[1] * per_page and table[b, i // per_page] < len(next(iter(pages.values())))
               for b, request in enumerate(np.asarray(index)) for i in request)  # fmt: skip
    leaf = np.asarray(got["values" if scaling == "none" else "nope"].astype(F32))
    assert (~np.isnan(leaf).all(-1)).sum() == kept > 0  # each kept row written once, nothing else


def test_nan_zero_and_tiny_rows_match_the_reference():
    """A NaN in a row (its tile's scale is 1, the value NaN; the per-array amax NaN), a row of zeros (scale 1), and
    rows so small that their tile scales are float32 subnormals, below e8m0's 2^-127 (stored as byte 0)."""
    for scaling, e8m0 in (("tile", True), ("tile", False), ("channel", False)):
        args, kw = make_write(2, scaling=scaling, width=80, rope=8, e8m0=e8m0, rows_dtype=F32, n=6)
        rows, index, *rest = args
        rows = rows.at[0, 0, 3].set(jnp.nan).at[0, 1].set(0.0).at[1, 2].set(rows[1, 2] * 1e-40)
        rows = rows.at[2, 3, :64].set(jnp.float32(2.0**-140))
        index = index.at[:, :4].set(jnp.asarray([[0, 1, 2, 3]] * 3, jnp.int32))  # all four rows are kept
        got, got_seen = kv_write(rows, index, *rest, **kw, blocks=WriteBlocks(block_rows=4), interpret=True)
        want, want_seen = kv_write_reference(rows, index, *rest, **kw)
        assert_same_bytes(got, want)
        if scaling == "channel":
            assert np.isnan(np.asarray(got_seen)[3]) and np.isnan(np.asarray(want_seen)[3])
            np.testing.assert_array_equal(np.asarray(got_seen), np.asarray(want_seen))


def test_pow2_ceil_matches_the_caches_frexp_rule():
    """`pow2_ceil` (bits) against `dsv4.cache.quant._pow2_ceil` (frexp): powers of two stay, anything above one goes
    up; subnormals included, and 2^127 < x goes to inf."""
    rng = np.random.default_rng(3)
    exps = np.arange(-149, 128)
    spread = rng.uniform(0, 1, 1000) * 2.0 ** rng.integers(-149, 127, 1000)
    f32 = np.finfo(np.float32)
    x = np.concatenate([2.0**exps, 2.0**exps * 1.0000001, spread, [f32.max, f32.tiny]]).astype(np.float32)
    x = x[x > 0]
    np.testing.assert_array_equal(np.asarray(pow2_ceil(jnp.asarray(x))), np.asarray(quant._pow2_ceil(jnp.asarray(x))))


FORMATS = ["bf16", "fp8-tensor", "fp8-channel", "fp8-tile", "fp8-tile-e8m0"]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("paged", [True, False])
def test_store_write_through_the_kernel_equals_the_jnp_write(name, paged):
    """`KVStore.write(impl="pallas")` against the cache's spec (`quantize`, then XLA's scatter) over three writes:
    the same stored bytes and the same scale state, for scales calibrated by the first write (per-array formats:
    one channel stays zero until the second write) and for scales set from a bound."""
    fmt = KVFormat.named(name, rope_dim=8)
    rng = np.random.default_rng(4)
    b, n, d = 2, 7, 40
    bounds = [None, 3.0] if fmt.scaling in ("tensor", "channel") else [None]
    for bound in bounds:
        if paged:
            store = KVStore.paged_pool(9, 4, d, fmt, bound=bound)
            table = jnp.asarray([[3, 1, 5], [2, 8, 7]], jnp.int32)
        else:
            store = KVStore.dense(b, 12, d, fmt, bound=bound)
            table = None
        store = dataclasses.replace(store, stored=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), store.stored))
        write = jax.jit(lambda s, r, i, t: s.write(r, i, t, impl="pallas"))
        for step in range(3):
            rows = rng.standard_normal((b, n, d)) * (step + 1)
            if step == 0:
                rows[..., 5] = 0.0  # channel 5 has no data in the first write: its scale stays unset
            rows = jnp.asarray(rows, F32)
            index = jnp.asarray(np.stack([rng.permutation(np.arange(-2, 14))[:n] for _ in range(b)]), jnp.int32)
            want = store.write(rows, index, table)
            got = write(store, rows, index, table)
            assert_same_bytes(got, want)
            store = want
        if fmt.scaling == "channel" and bound is None:
            assert float(store.scale["scale"][5]) > 0  # set by the second write


@slow_opt_in("two models compiled in interpret mode, ~80 s on 2 cores, for an opt-in kernel (kv_write defaults "
             "to jnp)")
def test_model_cache_written_by_the_kernel_is_the_jnp_cache():
    """The model's chunked prefill and decode steps with every cache write on the kernel (window ring, compressed
    entries, indexer keys; paged FP8 with per-channel scales): the same cache bytes and the same logits as XLA's
    writes, step for step."""
    from flax import nnx

    import dsv4

    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    models = {impl: dsv4.load(os.path.join(fixtures, "tiny_long"), dtype=F32, kernels=f"kv_write={impl}")
              for impl in ("jnp", "pallas")}  # fmt: skip
    ids = np.asarray(np.load(os.path.join(fixtures, "tiny_long", "reference.npz"))["input_ids"][0])
    state = nnx.split(models["jnp"])[1]
    cache = models["jnp"].init_cache(2, max_len=112, page_tokens=16, num_pages=16, kv_format="fp8-channel")
    pages = jnp.asarray(np.random.default_rng(5).permutation(np.arange(1, 15)).reshape(2, 7))
    cache = jax.device_put(cache.replace(block_table=pages), jax.devices()[0])

    def stepper(model):
        graphdef = nnx.split(model)[0]
        return jax.jit(lambda c, t, v: nnx.merge(graphdef, state).forward_chunk(c, t, v))

    steps = {impl: stepper(model) for impl, model in models.items()}
    caches = {impl: cache for impl in steps}
    width = 32  # one chunk width, so each path compiles once: 32 + 20 tokens, 32 + 32, then one-token steps
    starts = [(0, [32, 20]), (32, [32, 32]), (64, [1, 1]), (65, [1, 1])]
    for start, valid in starts:
        tokens = jnp.asarray(np.stack([ids[start : start + width]] * 2))
        if start == 32:
            tokens = tokens.at[1].set(jnp.asarray(ids[20:52]))  # request 1 is 20 tokens in
        out = {impl: steps[impl](caches[impl], tokens, jnp.asarray(valid, jnp.int32)) for impl in steps}
        np.testing.assert_array_equal(np.asarray(out["pallas"][0]), np.asarray(out["jnp"][0]))
        caches = {impl: out[impl][1] for impl in out}
        assert_same_bytes(caches["pallas"], caches["jnp"])


def test_validation_names_the_tensor():
    args, kw = make_write(6, scaling="channel", width=40, rope=8)
    rows, index, table, pages, scales = args
    run = lambda *a, **over: kv_write(*a, **{**kw, **over}, interpret=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"scales must be float32 \[32\]"):
        run(rows, index, table, pages, None)
    with pytest.raises(ValueError, match="index must be integer"):
        run(rows, index[:, :5], table, pages, scales)
    with pytest.raises(ValueError, match="block_table must be integer"):
        run(rows, index, table[:2], pages, scales)
    with pytest.raises(ValueError, match=r"pages\['nope'\] \(32 channels\) \+ pages\['rope'\] \(8\)"):
        run(rows[..., :36], index, table, pages, scales)
    with pytest.raises(ValueError, match="pages must hold the leaves"):
        run(rows, index, table, {**pages, "scale": pages["rope"]}, scales)
    with pytest.raises(ValueError, match=r"pages\['rope'\].shape=\(14, 3, 8\)"):
        run(rows, index, table, {**pages, "rope": pages["rope"][:, :3]}, scales)
    with pytest.raises(ValueError, match="scaling='fp8'"):
        run(rows, index, table, pages, scales, scaling="fp8")
    with pytest.raises(ValueError, match="pages\\['scale'\\] must be float32 or float8_e8m0fnu"):
        run(rows, index, table, {**pages, "scale": pages["nope"][..., :1]}, None, scaling="tile")
    with pytest.raises(ValueError, match="addresses at most 2"):
        huge = {**pages, "nope": jax.ShapeDtypeStruct((2**20, 64, 32), FP8)}  # only shapes are read: no allocation
        kv_write_reference(rows, index, table, huge, scales, scaling="channel")
    with pytest.raises(ValueError, match="WriteBlocks.block_rows=6"):
        WriteBlocks(block_rows=6)
    with pytest.raises(ValueError, match="impl='triton'"):
        KVStore.dense(1, 4, 40, KVFormat.named("bf16", rope_dim=8)).write(rows[:1], index[:1], impl="triton")


def _lowered(scaling, e8m0=False):
    """V4's row (448 + 64 channels) from an 8K-token chunk of 2 requests into a pool of 4097 pages of 64 rows,
    lowered for an abstract H200. → (the Triton module, its grid)."""
    from dsv4.pallas._jax_compat import triton_lowering

    sds = jax.ShapeDtypeStruct
    b, n, p, r = 2, 8192, 4097, 64
    if scaling == "none":
        pages = {"values": sds((p, r, 512), BF16)}
    else:
        pages = {"nope": sds((p, r, 448), FP8), "rope": sds((p, r, 64), BF16)}
        if scaling == "tile":
            pages["scale"] = sds((p, r, 7), E8M0 if e8m0 else F32)
    scales = sds((448,), F32) if scaling in ("tensor", "channel") else None
    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module
    triton_lowering.lower_jaxpr_to_triton_module = lambda *a, **k: modules.append(original(*a, **k)) or modules[-1]
    try:
        with abstract_gpu_mesh():
            hlo = jax.jit(lambda *a: kv_write(*a, scaling=scaling)).trace(
                sds((b, n, 512), BF16), sds((b, n), jnp.int32), sds((b, 128), jnp.int32), pages, scales
            ).lower(lowering_platforms=("cuda",)).as_text()  # fmt: skip
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    assert "__gpu$xla.gpu.triton" in hlo
    [result] = modules
    return result


@pytest.mark.parametrize("scaling, e8m0, divisions", [("none", False, 0), ("channel", False, 4), ("tile", False, 7),
                                                      ("tile", True, 7)])  # fmt: skip
def test_lowers_to_triton_at_v4_shapes(scaling, e8m0, divisions):
    """The module verifies; grid (requests, row blocks); every division is the IEEE one (`div.rn.f32`, one per
    column tile: 4 tiles of 128 for 448 channels, 7 scale tiles), none left to Triton's approximate `/`; and every
    load and store carries a mask (a dropped row's destination is one past the pool: only its mask keeps it out)."""
    import re

    result = _lowered(scaling, e8m0)
    text = str(result.module)
    assert result.module.operation.verify()
    assert list(result.grid) == [2, 8192 // 16]
    assert text.count("div.rn.f32") == divisions
    assert "arith.divf" not in text
    accesses = re.findall(r"tt\.(load|store) (%[\w#]+(?:, %[\w#]+)*) :", text)
    assert len(accesses) > 4
    assert all(len(operands.split(", ")) == 3 for _, operands in accesses), accesses  # ptr, value / mask, mask / other


@gpu
@requires_gpu
@pytest.mark.parametrize("scaling, e8m0", [("none", False), ("tensor", False), ("channel", False), ("tile", False),
                                           ("tile", True)])  # fmt: skip
def test_gpu_writes_the_references_bytes_at_v4_shapes(scaling, e8m0):
    args, kw = make_write(7, scaling=scaling, width=512, rope=0 if scaling == "none" else 64, e8m0=e8m0, batch=4,
                          n=3001, rows_per_page=64, max_pages=60)  # fmt: skip
    got, got_seen = kv_write(*args, **kw)
    want, want_seen = kv_write_reference(*args, **kw)
    assert_same_bytes(got, want)
    if got_seen is not None:
        np.testing.assert_array_equal(np.asarray(got_seen), np.asarray(want_seen))
