"""dsv4.pallas.select.refine_top_k: one refinement level of the grouped exact top-k (interpreted on CPU) against
its jnp reference, and `dsv4.topk.top_k` / `index_topk_two_pass` with it against `lax.top_k` / themselves without.

Kernel runs start from poisoned output buffers (`out_init`, aliased: NaN values, index -7), so an element the
kernel does not write keeps its poison. Rows are integer-valued (ties everywhere) with -inf entries (masked
indexer scores), widths not multiples of the group, and k · group not a power of two (the kernel pads).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsv4.pallas.select import SelectBlocks, chosen_candidates, refine_top_k, refine_top_k_reference
from dsv4.topk import top_k

gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton-compiled kernel)")


def tied_rows(shape, seed, minus_inf=0.2):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, shape).astype(np.float32)
    x[rng.random(shape) < minus_inf] = -np.inf
    return jnp.asarray(x)


def chosen_groups(lead, n_groups, k, seed):
    rng = np.random.default_rng(seed)
    rows = int(np.prod(lead))
    return jnp.asarray(np.stack([rng.permutation(n_groups)[:k] for _ in range(rows)]).reshape(*lead, k), jnp.int32)


@pytest.mark.parametrize("lead, n, k, group, blocks", [
    ((5,), 101, 8, 4, SelectBlocks(block_rows=2)),  # a partial last group, rows overhang the last program
    ((3,), 37, 6, 3, SelectBlocks()),  # k · group = 18: padded to 32
    ((2, 2), 64, 16, 4, SelectBlocks(block_rows=4)),  # leading axes pass through
    ((1,), 40, 10, 4, SelectBlocks()),  # every group chosen
])  # fmt: skip
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("bounded", [False, True])
def test_matches_reference(lead, n, k, group, blocks, ordered, bounded):
    """Tied rows with -inf: the index search runs, and the maxima (bounded) straddle the sign."""
    x = tied_rows((*lead, n), seed=n + k)
    groups = chosen_groups(lead, -(-n // group), k, seed=n)
    check_against_reference(x, groups, group, blocks, ordered, interpret=True,
                            group_max=group_maxima(x, groups, group) if bounded else None)  # fmt: skip


def group_maxima(x, groups, group):
    """Each chosen group's maximum over x (-inf past N), as `top_k` hands them to the kernel."""
    values, _ = chosen_candidates(x, groups, group=group)
    return values.reshape(*groups.shape, group).max(-1)


@pytest.mark.parametrize("values", ["positive", "negative", "wide", "signs", "equal", "top-ties"])
def test_bounded_search_matches_reference(values):
    """With the chosen groups' maxima given, the threshold search runs between the smallest and the largest of them:
    distinct scores within a factor of 3 (positive or negative), spread over 12 decades, of both signs (no common
    sign: the full search), rows of one value (the maxima equal: nothing to search, every candidate a tie), and
    rows whose k-th best is their maximum (values 1 or 2, about 29 twos among 96 candidates for k = 24: the search
    ends at the top of its range) paired in a program with rows of a much wider range. 6 rows of 300, 24 groups
    of 4 chosen."""
    rng = np.random.default_rng(len(values))
    shape = (6, 300)
    top_ties = np.where(rng.random(shape) < 0.3, 2.0, 1.0)
    top_ties[1::2] = 10.0 ** rng.uniform(-6, 6, (3, 300))
    x = {"positive": rng.uniform(1.0, 3.0, shape), "negative": -rng.uniform(1.0, 3.0, shape),
         "wide": 10.0 ** rng.uniform(-6, 6, shape), "signs": rng.standard_normal(shape),
         "equal": np.full(shape, 2.5), "top-ties": top_ties}[values]  # fmt: skip
    x = jnp.asarray(x, jnp.float32)
    groups = chosen_groups((6,), 75, 24, seed=3)
    for ordered in (True, False):
        check_against_reference(x, groups, 4, SelectBlocks(block_rows=2), ordered, interpret=True,
                                group_max=group_maxima(x, groups, 4))  # fmt: skip


def test_highest_bit_is_an_upper_bound_within_one():
    from dsv4.pallas.select import highest_bit

    x = np.asarray([0, 1, 2, 3, 255, 256, 2**24 - 1, 2**24 + 1, 2**30, 2**31 - 1], np.int32)
    got = np.asarray(highest_bit(jnp.asarray(x)))
    true = np.asarray([int(v).bit_length() - 1 for v in x])
    assert got[0] == -1 and ((got == true) | (got == true + 1)).all(), (got, true)
    assert (got[:6] == true[:6]).all()  # exact where float32 holds x exactly


def by_index(values, indices):
    """(values, indices) rows reordered by increasing index: the unordered kernel output's set, comparable."""
    order = np.argsort(indices, axis=-1, kind="stable")
    return np.take_along_axis(values, order, -1), np.take_along_axis(indices, order, -1)


def check_against_reference(x, groups, group, blocks, ordered, *, interpret, group_max=None):
    lead, k = groups.shape[:-1], groups.shape[-1]
    poison = (jnp.full((*lead, k), jnp.nan, jnp.float32), jnp.full((*lead, k), -7, jnp.int32))
    values, indices = refine_top_k(x, groups, group=group, ordered=ordered, blocks=blocks, interpret=interpret,
                                   group_max=group_max, out_init=poison)  # fmt: skip
    want_values, want_indices = map(np.asarray, refine_top_k_reference(x, groups, group=group))
    values, indices = np.asarray(values), np.asarray(indices)
    assert not np.isnan(values).any() and (indices != -7).all(), "kernel left elements unwritten (poisoned output)"
    if not ordered:
        assert not (np.diff(np.sort(indices, -1), axis=-1) == 0).any(), "an index taken twice"
        (values, indices), (want_values, want_indices) = by_index(values, indices), by_index(want_values, want_indices)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)


def test_order_key_orders_like_floats():
    """order_key (the kernel's int32 keys) sorts -inf, negatives, -0.0, +0.0, positives, +inf as floats do, with
    -0.0 below +0.0 (lax.top_k's order)."""
    from dsv4.pallas.select import order_key

    x = np.asarray([-np.inf, -3e38, -2.5, -1.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 2.5, 3e38, np.inf], np.float32)
    keys = np.asarray(order_key(jnp.asarray(x)))
    assert (np.diff(keys) > 0).all(), keys


def test_reference_by_hand():
    """Groups of 2 of [5, 1, | 3, 5, | 0, -inf, | 5], groups 3 and 1 chosen (in that order): candidates 5 (index 6),
    -inf (7, past N), 3 (2), 5 (3) → best first, ties to the lower index: 5@3, 5@6, 3@2."""
    x = jnp.asarray([[5.0, 1.0, 3.0, 5.0, 0.0, -np.inf, 5.0]])
    values, indices = refine_top_k_reference(x, jnp.asarray([[3, 1]], jnp.int32), group=2)
    assert np.asarray(indices).tolist() == [[3, 6]] and np.asarray(values).tolist() == [[5.0, 5.0]]
    values, indices = refine_top_k(x, jnp.asarray([[3, 1]], jnp.int32), group=2, interpret=True)
    assert np.asarray(indices).tolist() == [[3, 6]] and np.asarray(values).tolist() == [[5.0, 5.0]]
    # unordered: in the chosen groups' order, group 3 (index 6) before group 1 (index 3)
    values, indices = refine_top_k(x, jnp.asarray([[3, 1]], jnp.int32), group=2, ordered=False, interpret=True)
    assert np.asarray(indices).tolist() == [[6, 3]] and np.asarray(values).tolist() == [[5.0, 5.0]]


@pytest.mark.parametrize("n, k, group, direct_max", [(1000, 7, 4, 16), (777, 12, 3, 8)])
def test_top_k_with_the_kernel_equals_lax_top_k(n, k, group, direct_max):
    """Several levels of recursion, each refined by the kernel: exactly lax.top_k's values and indices."""
    x = tied_rows((3, n), seed=n)

    def refine(x, groups, *, group, ordered, group_max):
        return refine_top_k(x, groups, group=group, ordered=ordered, group_max=group_max, interpret=True)

    values, indices = top_k(x, k, group=group, direct_max=direct_max, refine=refine)
    want_values, want_indices = lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_index_topk_two_pass_with_the_kernel_picks_the_same():
    """The two-pass indexer with selection="kernel" returns exactly what selection="xla" returns, on widths past
    2048 keys (so the selection groups) in two width bands; with ordered=False, the same picks per query in another
    order."""
    from dsv4.pallas.indexer import index_topk_two_pass

    rng = np.random.default_rng(7)
    b, s, h, d, c, k = 1, 24, 4, 32, 2600, 16
    inputs = dict(q=jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32),
                  keys=jnp.asarray(rng.standard_normal((b, c, d)), jnp.float32),
                  weights=jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32),
                  positions=jnp.asarray(4 * c - 2000 + 80 * np.arange(s), jnp.int32)[None])  # fmt: skip
    kw = dict(rate=4, k=k, softmax_scale=d**-0.5, interpret=True, width_bands=2, query_chunk=12)
    got = np.asarray(index_topk_two_pass(**inputs, **kw, selection="kernel"))
    want = np.asarray(index_topk_two_pass(**inputs, **kw, selection="xla"))
    np.testing.assert_array_equal(got, want)
    assert (want >= 2048).any()  # picks past the first 2048 keys: the grouped path ran
    unordered = np.asarray(index_topk_two_pass(**inputs, **kw, selection="kernel", ordered=False))
    np.testing.assert_array_equal(np.sort(unordered, -1), np.sort(want, -1))
    assert (unordered != want).any()  # not best first: the unordered selection ran


@pytest.mark.parametrize("call, match", [
    (lambda: refine_top_k(jnp.zeros((2, 10), jnp.int32), jnp.zeros((2, 2), jnp.int32), group=4), "float x"),
    (lambda: refine_top_k(jnp.zeros((2, 10)), jnp.zeros((3, 2), jnp.int32), group=4), "groups must be int32"),
    (lambda: refine_top_k(jnp.zeros((2, 10)), jnp.zeros((2, 4), jnp.int32), group=4), "k=4 chosen groups"),
    (lambda: refine_top_k(jnp.zeros((2, 10)), jnp.zeros((2, 2), jnp.int32), group=4,
                          out_init=(jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32))), "out_init must be"),
    (lambda: refine_top_k(jnp.zeros((2, 10)), jnp.zeros((2, 2), jnp.int32), group=4,
                          group_max=jnp.zeros((2, 3))), "group_max must be"),
    (lambda: SelectBlocks(block_rows=3), "block_rows=3"),
])  # fmt: skip
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        jax.block_until_ready(call())


def test_lowers_to_triton_at_v4_shapes():
    """The kernel lowers for CUDA at the indexer's shapes (512 queries, a 512K prompt's 131136 keys, k = 512 of
    2048 candidates) inside an abstract H200 mesh (Pallas' Triton lowering: shapes, gathers, the searches), with
    and without the groups' maxima (the searches' dynamic trip counts)."""
    from gpu_mesh import abstract_gpu_mesh

    sds = jax.ShapeDtypeStruct
    args = (sds((1, 512, 131136), jnp.float32), sds((1, 512, 512), jnp.int32), sds((1, 512, 512), jnp.float32))
    with abstract_gpu_mesh():
        for f in (lambda x, g, m: refine_top_k(x, g, group=4), lambda x, g, m: refine_top_k(x, g, group=4,
                                                                                            group_max=m)):
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            assert "triton" in lowered.as_text().lower()


@gpu
@requires_gpu
@pytest.mark.parametrize("blocks", [SelectBlocks(), SelectBlocks(block_rows=2, num_warps=8)])
def test_gpu_matches_reference(blocks):
    """Compiled: the small tied cases above (with and without the groups' maxima), then top_k with the kernel at
    each level (given the maxima) equals lax.top_k at the indexer's shapes (64 queries over a 512K prompt's 131136
    keys, ragged -inf tails as causal masking makes)."""
    for lead, n, k, group in (((5,), 101, 8, 4), ((3,), 37, 6, 3), ((2, 2), 64, 16, 4)):
        x = tied_rows((*lead, n), seed=n + k)
        groups = chosen_groups(lead, -(-n // group), k, seed=n)
        for ordered, bounded in itertools.product((True, False), (False, True)):
            check_against_reference(x, groups, group, blocks, ordered, interpret=False,
                                    group_max=group_maxima(x, groups, group) if bounded else None)  # fmt: skip
    rng = np.random.default_rng(11)
    n, rows = 131136, 64
    x = rng.standard_normal((1, rows, n)).astype(np.float32)
    x[0, :, :] = np.where(np.arange(n)[None, :] < (n - 400 * np.arange(rows))[:, None], x[0], -np.inf)
    x = jnp.asarray(x)
    refine = functools.partial(refine_top_k, blocks=blocks)
    values, indices = jax.jit(lambda x: top_k(x, 512, refine=refine))(x)
    want_values, want_indices = lax.top_k(x, 512)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
