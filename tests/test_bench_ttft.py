"""scripts/bench_ttft.py's variant table: every variant runs when asked for and builds the Kernels it says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dsv4 import Kernels

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_ttft", ROOT / "scripts" / "bench_ttft.py")
bench_ttft = importlib.util.module_from_spec(spec)
sys.modules["bench_ttft"] = bench_ttft  # its dataclasses look their module up
spec.loader.exec_module(bench_ttft)


def test_every_variant_is_run_in_order_and_tabled():
    """--variants keeps PRIORITY's order and the table TABLE_ORDER's, so a variant missing from either would be
    dropped without a word; each lists every variant once."""
    keys = sorted(bench_ttft.VARIANTS)
    assert sorted(bench_ttft.PRIORITY) == keys
    assert sorted(bench_ttft.TABLE_ORDER) == keys


@pytest.mark.parametrize("key, changed", [("chunked-dequant", {"dense": "jnp"}), ("chunked-4x", {}),
                                          ("chunked-w8a8", {"dense": "pallas", "indexer": "pallas-fp8"})])  # fmt: skip
def test_chunked_variants_change_only_what_they_name(key, changed):
    """Each variant's Kernels is the chunked path's (4) with the named fields changed, and nothing else."""
    def kernels(v):
        return bench_ttft.variant_kernels(v.attention, v.moe, v.indexer, v.sinkhorn_loop, **v.kernel_parts())

    base, v = kernels(bench_ttft.VARIANTS["chunked"]), bench_ttft.VARIANTS[key]
    got = kernels(v)
    assert isinstance(got, Kernels)
    assert {f: getattr(got, f) for f in changed} == changed
    assert {f: getattr(got, f) for f in vars(base) if f not in changed} == {
        f: getattr(base, f) for f in vars(base) if f not in changed}
    assert v.chunks_of == (4 if key == "chunked-4x" else 1)
