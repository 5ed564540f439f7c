"""scripts/bench_mhc.py's merge forms compute the model's merge: each against a numpy sum written out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_mhc", ROOT / "scripts" / "bench_mhc.py")
bench_mhc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_mhc)


@pytest.mark.parametrize("name", list(bench_mhc.MERGES))
def test_merge_forms_compute_the_merge(name):
    block_output, copies, post, comb = bench_mhc.merge_inputs(2, 5, 4, 24, dtype=jnp.float32)
    bo, x, p, c = (np.asarray(a, np.float64) for a in (block_output, copies, post, comb))
    want = np.zeros_like(x)
    for k in range(4):  # new_k = post_k · output + Σ_j comb[j, k] · copy_j
        want[:, :, k] = p[:, :, k, None] * bo + sum(c[:, :, j, k, None] * x[:, :, j] for j in range(4))
    d_major = name == "d-major"
    got = bench_mhc.MERGES[name](block_output, jnp.swapaxes(copies, 2, 3) if d_major else copies, post, comb)
    if name == "with-norm":  # and the new copies' mean square per token
        got, mean_square = got
        np.testing.assert_allclose(np.asarray(mean_square)[..., 0], (want**2).mean(axis=(2, 3)), rtol=1e-5)
    got = np.asarray(jnp.swapaxes(got, 2, 3) if d_major else got, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
