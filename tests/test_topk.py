"""dsv4.topk.top_k: exactly `lax.top_k` (values, indices, order, ties to the lower index) on rows long enough for
the grouped path, with group sizes and thresholds small enough that the recursion runs several levels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsv4.topk import top_k


def rows(kind, shape, rng):
    if kind == "gaussian":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":  # five distinct values: every cut at the k-th place splits a tie group
        return rng.integers(0, 5, shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)  # mostly -inf, as masked indexer scores
    x[rng.random(shape) < 0.8] = -np.inf
    return x


@pytest.mark.parametrize("kind", ["gaussian", "ties", "masked"])
@pytest.mark.parametrize("n, k, group, direct_max", [
    (1000, 7, 4, 16),     # three levels: 1000 → 250 → 63 → 16 candidates
    (777, 50, 3, 8),      # n not a multiple of the group (padding), an odd group
    (4096, 300, 8, 64),   # k · group = 2400 < n: one grouped level
    (129, 129, 2, 4),     # k = n: straight to lax.top_k
])  # fmt: skip
def test_equals_lax_top_k(kind, n, k, group, direct_max):
    rng = np.random.default_rng(n + k)
    x = jnp.asarray(rows(kind, (3, 2, n), rng))  # leading batch axes pass through
    values, indices = top_k(x, k, group=group, direct_max=direct_max)
    want_values, want_indices = lax.top_k(x, k)
    assert indices.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_all_minus_inf_rows_pick_the_lowest_indices():
    x = jnp.full((2, 500), -jnp.inf).at[1, 400].set(1.0)
    _, idx = top_k(x, 5, group=4, direct_max=8)
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1, 2, 3, 4], [400, 0, 1, 2, 3]])


@pytest.mark.parametrize("kw, match", [(dict(k=0), "k=0"), (dict(k=11), "k=11"), (dict(k=2, group=1), "group=1")])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        top_k(jnp.zeros((2, 10)), **kw)
