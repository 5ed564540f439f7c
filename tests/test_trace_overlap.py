"""scripts/trace_overlap.py: communication / compute overlap from a profiler trace, on a trace written by hand."""

import gzip
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("trace_overlap", os.path.join(ROOT, "scripts", "trace_overlap.py"))
trace_overlap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_overlap)


def _event(pid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}


def test_overlap_by_hand(tmp_path):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
        # GPU 0: compute [0, 10) and [20, 30) µs (two kernels overlapping on [20, 25)), comm [5, 25) in two pieces
        _event(1, "grouped_gate_up", 0, 10), _event(1, "fusion.3", 20, 5), _event(1, "grouped_down", 22, 8),
        _event(1, "ncclDevKernel_SendRecv", 5, 12), _event(1, "ncclDevKernel_SendRecv", 15, 10),
        # GPU 1: only a transfer: all of it exposed
        _event(2, "ncclKernel_AllGather_RING", 100, 4),
        # host events are not device time
        _event(3, "ncclDevKernel_SendRecv", 0, 1000), _event(3, "PjitFunction", 0, 1000),
        {"ph": "i", "pid": 1, "name": "marker", "ts": 3},
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_overlap.overlap(str(tmp_path))  # the directory: the file is found under it
    assert set(got) == {"/device:GPU:0", "/device:GPU:1"}
    g0 = got["/device:GPU:0"]
    # comm = [5, 25) = 20 µs; compute = [0, 10) ∪ [20, 30) = 20 µs; overlap [5, 10) ∪ [20, 25) = 10 µs
    assert g0["comm_ms"] == pytest.approx(0.020)
    assert g0["compute_ms"] == pytest.approx(0.020)
    assert g0["hidden_ms"] == pytest.approx(0.010)
    assert g0["exposed_ms"] == pytest.approx(0.010)
    assert g0["span_ms"] == pytest.approx(0.030)
    assert (g0["comm_events"], g0["compute_events"]) == (2, 3)
    g1 = got["/device:GPU:1"]
    assert (g1["comm_ms"], g1["hidden_ms"], g1["exposed_ms"], g1["compute_ms"]) == pytest.approx((0.004, 0, 0.004, 0))


def test_missing_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="perfetto_trace.json.gz"):
        trace_overlap.overlap(str(tmp_path))


def test_kernel_table_by_hand(tmp_path):
    """Stream threads' kernels only (the module-level event on another thread of the same device is not counted
    again), summed by name; busy time is the union of their intervals."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 8, "name": "jit_step", "ts": 0, "dur": 100},
        {"ph": "X", "pid": 1, "tid": 7, "name": "decode", "ts": 10, "dur": 20},
        {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.1", "ts": 25, "dur": 10},  # overlaps decode by 5
        {"ph": "X", "pid": 1, "tid": 7, "name": "decode", "ts": 60, "dur": 30},
        {"ph": "X", "pid": 3, "tid": 1, "name": "decode", "ts": 0, "dur": 500},
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_overlap.kernel_table(str(path))
    assert set(got) == {"/device:GPU:0"}
    g = got["/device:GPU:0"]
    assert g["kernels"] == {"decode": [50.0, 2], "fusion.1": [10.0, 1]}
    assert g["busy_us"] == pytest.approx(25 + 30)  # [10, 35) ∪ [60, 90)
    assert g["span_us"] == pytest.approx(80)  # 10 .. 90
    rows, rest = trace_overlap.top_kernels(g, 1)
    assert rows == [dict(name="decode", ms=0.05, share=pytest.approx(50 / 55), calls=2, op="")]
    assert rest == dict(kernels=1, ms=0.01, share=pytest.approx(10 / 55))


def test_idle_gaps_by_hand(tmp_path):
    """Gaps between the union of a GPU's kernels, each charged to the kernel that ended last before it and the one
    that starts after it (a kernel that ends inside a longer one does not own the gap after the longer one)."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "scores", "ts": 0, "dur": 50},
        {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.1", "ts": 10, "dur": 5},  # inside scores
        {"ph": "X", "pid": 1, "tid": 7, "name": "select", "ts": 80, "dur": 10},  # 30 after scores
        {"ph": "X", "pid": 1, "tid": 7, "name": "scores", "ts": 90, "dur": 50},  # touching: no gap
        {"ph": "X", "pid": 1, "tid": 7, "name": "select", "ts": 160, "dur": 10},  # 20 after scores
        {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.1", "ts": 171, "dur": 1},  # 1 after select
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_overlap.idle_gaps(str(path), top=1)["/device:GPU:0"]
    assert got["idle_us"] == pytest.approx(30 + 20 + 1)
    assert got["gaps"] == 3
    assert got["top"] == [dict(after="scores", before="select", ms=pytest.approx(0.05), count=2)]


def test_kernels_of_one_name_split_by_op(tmp_path):
    """Mosaic kernels share a generic name: with op names, launches of one name from different JAX ops rank apart."""

    def launch(ts, dur, hlo_op):
        args = {"hlo_op": hlo_op} if hlo_op else {}
        return {"ph": "X", "pid": 1, "tid": 7, "name": "kernel_body", "ts": ts, "dur": dur, "args": args}

    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        *(launch(ts, dur, op) for ts, dur, op in ((0, 30, "custom-call.1"), (30, 20, "custom-call.2"),
                                                   (50, 25, "custom-call.2"), (75, 5, None))),
    ]  # fmt: skip
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    names = {"custom-call.1": "jit(step)/dsv4_hca/attn/mpmd_map", "custom-call.2": "jit(step)/dsv4_hca/ffn/mpmd_map"}
    gpu = trace_overlap.kernel_table(str(path), names)["/device:GPU:0"]
    rows, rest = trace_overlap.top_kernels(gpu, 2)
    ms = pytest.approx
    assert rows == [dict(name="kernel_body", ms=ms(0.045), share=ms(45 / 80), calls=2, op=names["custom-call.2"]),
                    dict(name="kernel_body", ms=ms(0.03), share=ms(30 / 80), calls=1, op=names["custom-call.1"])]
    assert rest == dict(kernels=1, ms=0.005, share=pytest.approx(5 / 80))
    assert trace_overlap.kernel_table(str(path))["/device:GPU:0"]["kernels"] == {"kernel_body": [80.0, 4]}


def test_host_table_by_hand(tmp_path):
    """The host's events by name, off every GPU device's process, with their threads; GPU events are left out."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": 3, "tid": 2, "name": "thread_name", "args": {"name": "pjrt"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "command_buffer::update", "ts": 0, "dur": 900},  # a GPU event
        {"ph": "X", "pid": 3, "tid": 1, "name": "PjitFunction(step)", "ts": 0, "dur": 40},
        {"ph": "X", "pid": 3, "tid": 2, "name": "command_buffer::update", "ts": 5, "dur": 30},
        {"ph": "X", "pid": 3, "tid": 2, "name": "command_buffer::update", "ts": 50, "dur": 20},
        {"ph": "X", "pid": 3, "tid": 9, "name": "cuGraphLaunch", "ts": 40, "dur": 3},  # a thread with no name
        {"ph": "i", "pid": 3, "tid": 1, "name": "marker", "ts": 3},
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_overlap.host_table(str(tmp_path))
    assert got == {"PjitFunction(step)": [40.0, 1, {"python"}], "command_buffer::update": [50.0, 2, {"pjrt"}],
                   "cuGraphLaunch": [3.0, 1, {"9"}]}  # fmt: skip


def test_breakdown_by_kind_and_scope_by_hand(tmp_path):
    """Kernels of one GPU's stream (the module event on another thread is not counted), times in µs:
        [0, 10)  compute, csa          [5, 15)  AllGather, csa: 5 hidden, 5 exposed
        [20, 30) SendRecv, hca          (idle [15, 20) ends at it: hca's)
        [25, 35) compute, hca: the SendRecv's [25, 30) hidden, [20, 25) exposed
        [40, 45) compute, no scope      (idle [35, 40): "other")
    The hca scope is named through the HLO dump's op_name of the kernel's hlo_op argument."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "X", "pid": 1, "tid": 8, "name": "jit_slot_step", "ts": 0, "dur": 45},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_fusion", "ts": 0, "dur": 10,
         "args": {"long_name": "jit(slot_step)/dsv4_csa/dot_general"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "ncclDevKernel_AllGather_RING_LL", "ts": 5, "dur": 10,
         "args": {"long_name": "jit(slot_step)/dsv4_csa/all_gather"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "ncclDevKernel_SendRecv", "ts": 20, "dur": 10,
         "args": {"hlo_op": "collective-permute-start.3"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 25, "dur": 10, "args": {"hlo_op": "fusion.9"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "head_fusion", "ts": 40, "dur": 5},
    ]  # fmt: skip
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    dump = tmp_path / "hlo"
    dump.mkdir()
    (dump / "module_0001.jit_slot_step.sm_9.0_gpu_after_optimizations.txt").write_text(
        '  %collective-permute-start.3 = (bf16[8]) collective-permute-start(x), metadata={op_type="ppermute" '
        'op_name="jit(slot_step)/dsv4_hca/ppermute"}\n'
        '  ROOT fusion.9 = bf16[8] fusion(y), kind=kCustom, '
        'metadata={op_name="jit(slot_step)/dsv4_hca/dot"}\n')  # fmt: skip
    (dump / "module_0002.jit_other.after_optimizations.txt").write_text(
        '  fusion.9 = bf16[8] fusion(y), metadata={op_name="jit(other)/dsv4_sliding/dot"}\n')  # fmt: skip
    names = trace_overlap.hlo_op_names(str(dump), "slot_step")
    assert names == {"collective-permute-start.3": "jit(slot_step)/dsv4_hca/ppermute",
                     "fusion.9": "jit(slot_step)/dsv4_hca/dot"}  # fmt: skip
    # both modules: fusion.9 is a different op in each, so it is left unattributed rather than given either
    assert trace_overlap.hlo_op_names(str(dump)) == {"collective-permute-start.3": "jit(slot_step)/dsv4_hca/ppermute"}
    assert trace_overlap.modules_run(str(path)) == ["jit_slot_step"]  # the GPU's "XLA Modules" thread
    # kernels by (name, op_name through the hlo_op argument); the module-level event on another thread is no kernel
    kernels = trace_overlap.kernel_table(str(path), names)["/device:GPU:0"]["kernels"]
    assert kernels == {("loop_fusion", ""): [10.0, 1], ("ncclDevKernel_AllGather_RING_LL", ""): [10.0, 1],
                       ("ncclDevKernel_SendRecv", "jit(slot_step)/dsv4_hca/ppermute"): [10.0, 1],
                       ("gemm", "jit(slot_step)/dsv4_hca/dot"): [10.0, 1], ("head_fusion", ""): [5.0, 1]}  # fmt: skip
    got = trace_overlap.breakdown(str(path), trace_overlap.scope_finder(r"dsv4_(\w+?)/", names))["/device:GPU:0"]
    ms = pytest.approx
    assert (got["span_ms"], got["busy_ms"], got["idle_ms"]) == ms((0.045, 0.035, 0.010))
    assert (got["compute_ms"], got["comm_ms"], got["exposed_ms"]) == ms((0.025, 0.020, 0.010))
    assert got["comm_kind_ms"] == ms({"gather": 0.010, "exchange": 0.010, "other": 0.0})
    assert got["exposed_kind_ms"] == ms({"gather": 0.005, "exchange": 0.005, "other": 0.0})
    assert got["attributed"] == ms(40 / 45)
    csa, hca, other = (got["scopes"][s] for s in ("csa", "hca", "other"))
    assert (csa["compute_ms"], csa["comm_kind_ms"]["gather"], csa["exposed_kind_ms"]["gather"]) == ms((.01, .01, .005))
    assert (csa["idle_ms"], csa["kernels"]) == (0.0, 2)
    assert (hca["compute_ms"], hca["exposed_kind_ms"]["exchange"], hca["idle_ms"]) == ms((0.010, 0.005, 0.005))
    assert (other["compute_ms"], other["idle_ms"], other["kernels"]) == ms((0.005, 0.005, 1))
    assert trace_overlap.comm_kind("ncclDevKernel_AllReduce_Sum_f32") == "other"
    assert trace_overlap.comm_kind("loop_fusion") is None
