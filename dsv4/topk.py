"""Exact top-k over long rows by group maxima: the same answer as `lax.top_k`, sorting far fewer elements.

`lax.top_k` on XLA:GPU sorts the whole row for a k in the hundreds, so picking the indexer's 512 best of 128K
scores costs a 128K-element sort per query: at a 512K prompt, more than the CSA layer's FP8 scoring floor. `top_k`
below returns exactly what `lax.top_k(x, k)` returns — values and indices, best first, ties to the lower index —
while sorting only O(k · group) elements per row:

1. split the row into groups of `group` consecutive elements and take each group's maximum;
2. pick the top k groups by their maxima (recursively, the same way, while the maxima row is still long);
3. gather those k groups, in increasing group order, and `lax.top_k` the k · group candidates.

Why it is exact: order elements by (value descending, index ascending). A group's maximum, with ties to the
lower group, ranks groups by their best elements in that same order (groups are contiguous). If an element x of
the row's top k sat in a group outside the top k groups, those k groups would each hold an element ranked before
x, so x would rank k + 1 or later, a contradiction. Gathering the chosen groups in increasing order keeps the
candidates in increasing index order, so `lax.top_k`'s ties-to-the-lower-position are ties to the lower index.

-inf is an ordinary value here (the indexer masks invisible entries with it). NaN is not supported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["top_k"]


@functools.partial(jax.jit, static_argnames=("k", "group", "direct_max", "refine", "ordered"))
def top_k(x: jax.Array, k: int, *, group: int = 4, direct_max: int = 2048, refine: Callable | None = None,
          ordered: bool = True) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`lax.top_k(x, k)` for float rows, exactly. x [..., N] (k <= N) → (values [..., k], indices int32 [..., k]).

    group: elements per group (>= 2). direct_max: rows this long or shorter (or no longer than k · group, where
    grouping gains nothing) go to `lax.top_k` directly. refine: optional `refine(x, groups, group=, ordered=,
    group_max=)` → (values, indices), the k best elements of the chosen groups (any order of group ids, ties to the
    lower index; best first when ordered, else in any order; group_max: the chosen groups' maxima, in the order of
    `groups`), used at each level instead of the sort, gather and `lax.top_k` below
    (`dsv4.pallas.select.refine_top_k` does it in one kernel). ordered=False: with refine, the k best in any order
    (the inner levels ask for that: they only need the set of groups); without, ignored.
    """
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"top_k: k={k} must be in [1, N={n}] for x.shape={x.shape}")
    if group < 2:
        raise ValueError(f"top_k: group={group} must be >= 2")
    if n <= max(direct_max, k * group):
        return lax.top_k(x, k)
    n_groups = -(-n // group)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_groups * group - n)], constant_values=-jnp.inf)
    groups = padded.reshape(*x.shape[:-1], n_groups, group)  # padding: -inf at the highest indices, never preferred
    group_max, best_groups = top_k(groups.max(axis=-1), k, group=group, direct_max=direct_max, refine=refine,
                                   ordered=False)  # the set of the k best groups (by rank, unless refine reorders)
    if refine is not None:
        return refine(x, best_groups, group=group, ordered=ordered, group_max=group_max)
    best_groups = jnp.sort(best_groups, axis=-1)  # increasing index order (see the module docstring)
    candidates = jnp.take_along_axis(groups, best_groups[..., None], axis=-2)  # [..., k, group]
    values, pos = lax.top_k(candidates.reshape(*x.shape[:-1], k * group), k)
    indices = jnp.take_along_axis(best_groups, pos // group, axis=-1) * group + pos % group
    return values, indices.astype(jnp.int32)
