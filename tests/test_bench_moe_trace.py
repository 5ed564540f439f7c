"""scripts/bench_moe.py's reading of a Mosaic GPU trace (`trace_phases`), on a trace written by hand in the format
`jax.experimental.mosaic.gpu.profiler.ProfilerSpec.dump` writes: B/E events, ts in µs, tid = 1 + warpgroup +
warpgroups · block."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # bench_moe imports bench_kernels
_spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(ROOT, "scripts", "bench_moe.py"))
bench_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_moe)


def _range(tid, name, begin, end):
    return [{"name": name, "ph": "B", "ts": begin, "pid": 1, "tid": tid},
            {"name": name, "ph": "E", "ts": end, "pid": 1, "tid": tid}]  # fmt: skip


def test_trace_phases_by_hand():
    events = []
    # block 0: consumers (tids 1, 2) run k_loop 10 µs then epilogue 2 µs, twice; the producer (tid 3) loads 9, 11 µs
    for tid in (1, 2):
        events += _range(tid, "k_loop", 0.0, 10.0) + _range(tid, "epilogue", 10.0, 12.0)
        events += _range(tid, "k_loop", 12.0, 22.0) + _range(tid, "epilogue", 22.0, 24.0)
    events += _range(3, "loads", 0.0, 9.0) + _range(3, "loads", 9.0, 20.0)
    # block 1 (tids 4, 5, 6): one item, slower; its two consumers' events interleaved as a trace can hold them
    a, b = _range(4, "k_loop", 1.0, 31.0), _range(5, "k_loop", 1.5, 31.5)
    events += [a[0], b[0], a[1], b[1]] + _range(4, "epilogue", 31.0, 38.0) + _range(5, "epilogue", 31.5, 38.5)
    events += _range(6, "loads", 1.0, 26.0)
    events.append({"name": "k_loop", "ph": "B", "ts": 40.0, "pid": 1, "tid": 4})  # truncated: opened, never closed
    got = bench_moe.trace_phases({"displayTimeUnit": "ns", "traceEvents": events})
    assert set(got) == {("consumer", "k_loop"), ("consumer", "epilogue"), ("producer", "loads")}
    # k_loop: 10, 10, 10, 10 (block 0) and 30, 30 (block 1) → median 10; epilogue: 2 × 4 and 7 × 2 → 2
    assert got["consumer", "k_loop"] == {"median_us": 10.0, "count": 6}
    assert got["consumer", "epilogue"] == {"median_us": 2.0, "count": 6}
    assert got["producer", "loads"] == {"median_us": 11.0, "count": 3}  # 9, 11, 25
