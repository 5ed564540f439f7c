"""dsv4.pallas.group_max: every level of group maxima in one pass (interpreted on CPU) against its jnp reference,
and `dsv4.topk.top_k` / `index_topk_two_pass` fed with those levels against themselves without.

Every kernel run starts from NaN-poisoned output buffers (`out_init`, aliased), so an element the kernel does not
write stays NaN. Inputs are fresh random rows, partly -inf (as masked indexer scores), with widths that are not
multiples of the program's columns nor of the groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsv4.pallas.group_max import GroupMaxBlocks, group_maxima, group_maxima_reference, level_widths
from dsv4.topk import top_k


def random_rows(shape, seed, minus_inf=0.3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < minus_inf] = -np.inf
    return jnp.asarray(x)


@pytest.mark.parametrize("shape, group, levels, blocks", [
    ((3, 2, 1000), 4, 3, GroupMaxBlocks(block_rows=2, block_cols=256)),  # rows overhang the last program
    ((5, 70), 4, 2, GroupMaxBlocks(block_rows=4, block_cols=64)),  # one program's columns = group ** levels
    ((2, 4097), 4, 4, GroupMaxBlocks()),  # one element past a whole program
    ((1, 3, 333), 2, 5, GroupMaxBlocks(block_cols=128)),
    ((4, 1000), 8, 2, GroupMaxBlocks(block_rows=2, block_cols=512)),
])  # fmt: skip
def test_matches_reference(shape, group, levels, blocks):
    x = random_rows(shape, seed=sum(shape) + group)
    widths = level_widths(shape[-1], group, levels)
    poison = tuple(jnp.full((*shape[:-1], w), jnp.nan, jnp.float32) for w in widths)
    got = group_maxima(x, group=group, levels=levels, blocks=blocks, interpret=True, out_init=poison)
    want = group_maxima_reference(x, group=group, levels=levels)
    assert [g.shape for g in got] == [w.shape for w in want] == [(*shape[:-1], w) for w in widths]
    for level, (g, w) in enumerate(zip(got, want), 1):
        g = np.asarray(g)
        assert not np.isnan(g).any(), f"level {level}: kernel left elements unwritten (poisoned output)"
        np.testing.assert_array_equal(g, np.asarray(w), err_msg=f"level {level}")


def test_reference_is_the_max_of_each_span():
    """The reference itself, worked by hand: level l of element i is the max of x[i·g^l : (i+1)·g^l]."""
    x = jnp.asarray([[3.0, -1.0, 7.0, 2.0, 5.0, -np.inf, 0.0, 1.0, 9.0, 4.0]])  # N = 10, group 2
    l1, l2, l3 = group_maxima_reference(x, group=2, levels=3)
    np.testing.assert_array_equal(np.asarray(l1), [[3.0, 7.0, 5.0, 1.0, 9.0]])
    np.testing.assert_array_equal(np.asarray(l2), [[7.0, 5.0, 9.0]])
    np.testing.assert_array_equal(np.asarray(l3), [[7.0, 9.0]])


@pytest.mark.parametrize("n, k, levels", [(5000, 10, 3), (3001, 40, 1), (2500, 7, 4)])
def test_top_k_with_kernel_levels_equals_lax_top_k(n, k, levels):
    """top_k given (some of) its levels from the kernel returns exactly lax.top_k's values and indices, ties
    included (integer-valued rows tie everywhere)."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.integers(0, 50, (3, n)).astype(np.float32)).at[:, ::3].set(-jnp.inf)
    given = group_maxima(x, group=4, levels=levels, blocks=GroupMaxBlocks(block_cols=256), interpret=True)
    values, indices = top_k(x, k, group=4, direct_max=16, levels=given)
    want_values, want_indices = lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_index_topk_two_pass_with_kernel_maxima_picks_the_same():
    """The two-pass indexer with maxima="kernel" (every selection level from the kernel; widths past 2048 keys,
    so the selection recurses) returns exactly what maxima="xla" returns, in two width bands."""
    from dsv4.pallas.indexer import index_topk_two_pass, selection_levels

    rng = np.random.default_rng(7)
    b, s, h, d, c, k = 1, 24, 4, 32, 2600, 16
    assert selection_levels(c, k, 4) == 1 and selection_levels(10_000, k, 4) == 2 and selection_levels(1344, k, 4) == 0
    inputs = dict(q=jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32),
                  keys=jnp.asarray(rng.standard_normal((b, c, d)), jnp.float32),
                  weights=jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32),
                  positions=jnp.asarray(4 * c - 2000 + 80 * np.arange(s), jnp.int32)[None])  # fmt: skip
    kw = dict(rate=4, k=k, softmax_scale=d**-0.5, interpret=True, width_bands=2, query_chunk=12)
    got = np.asarray(index_topk_two_pass(**inputs, **kw, maxima="kernel"))
    want = np.asarray(index_topk_two_pass(**inputs, **kw, maxima="xla"))
    np.testing.assert_array_equal(got, want)
    assert (want >= 2048).any()  # picks beyond the first 2048 keys: the grouped path ran


@pytest.mark.parametrize("call, match", [
    (lambda: group_maxima(jnp.zeros((2, 10), jnp.int32)), "float array"),
    (lambda: group_maxima(jnp.zeros((2, 10)), group=3), "group=3"),
    (lambda: group_maxima(jnp.zeros((2, 10)), levels=7), "block_cols a multiple of group \\*\\* levels = 16384"),
    (lambda: group_maxima(jnp.zeros((2, 10)), out_init=(jnp.zeros((2, 4)),)), "out_init must be"),
    (lambda: GroupMaxBlocks(block_cols=1000), "block_cols=1000"),
    (lambda: top_k(jnp.zeros((2, 5000)), 8, levels=(jnp.zeros((2, 1000)),)), "levels\\[0\\].shape=\\(2, 1000\\)"),
])  # fmt: skip
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        jax.block_until_ready(call())
