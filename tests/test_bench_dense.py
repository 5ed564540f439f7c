"""scripts/bench_dense.py: the shapes it times are V4-Flash's dense FP8 matrices, and its smoke run checks each
route's output against its reference."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from dsv4.config import Config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_dense", ROOT / "scripts" / "bench_dense.py")
bench_dense = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_dense)


def test_shapes_are_v4_flash_dense_fp8_matrices():
    """[N, K] as DeepSeek-V4-Flash stores them (hidden 4096, q LoRA 1024, 64 heads × 512, 8 output groups × 1024,
    indexer 64 × 128, shared expert 2048), worked out from the released config by hand, and the two stacks of
    weights that read one x."""
    got = {name: (n, k) for name, n, k in bench_dense.dense_shapes(Config.preset("v4-flash"))}
    assert got == {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
                   "indexer.wq_b": (8192, 1024), "shared.w1|w3": (2048, 4096), "shared.w2": (4096, 2048),
                   "stacked.wq_a+wkv": (1536, 4096), "stacked.w1+w3": (4096, 4096)}  # fmt: skip


def test_smoke_times_every_route_and_checks_it(tmp_path):
    """The CPU smoke (the Mosaic kernel interpreted, 150 rows: a partial row tile): each W8A8 variant within e4m3's
    rounding of `linear_w8a8_reference`, the dequant route equal to the bf16 dot on the same weight."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_dense.py"), "--smoke", "--shapes", "wq_a",
                          "--variants", "default;promote:acc8=promote", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "dense.json").read_text())["rows"]
    by_row = {r["row"]: r for r in rows}
    assert set(by_row) == {"bf16", "dequant", "w8a8 default", "w8a8 promote"}
    assert by_row["dequant"]["rel_l2"] == 0.0
    assert all(by_row[r]["rel_l2"] < 1e-3 for r in ("w8a8 default", "w8a8 promote"))
    assert all(r["ms"] > 0 and r["n"] == 256 and r["k"] == 128 for r in rows)
