#!/usr/bin/env python3
"""How much of the communication in a profiler trace overlaps with compute, per GPU.

    python3 scripts/trace_overlap.py TRACE_DIR_OR_perfetto_trace.json.gz

Reads the Perfetto / Chrome JSON that `jax.profiler.trace(dir, create_perfetto_trace=True)` writes. It takes every
complete event ("ph": "X") of a GPU device's process ("/device:GPU:i" in its process name) and calls it
communication if its name has one of COMM_MARKERS (NCCL's kernels: ncclDevKernel_SendRecv, ncclKernel_…), else
compute. Per GPU it reports:
    comm_ms       the union of the communication intervals
    hidden_ms     the part of it during which some compute kernel also ran (the overlap)
    exposed_ms    comm_ms - hidden_ms: link time with the tensor cores idle
    compute_ms    the union of the compute intervals
    span_ms       first kernel start to last kernel end
The same measure as bench_moe_ep's "exposed" (ring time minus no-link time), taken from the timeline instead of
from two runs; the two should roughly agree. `breakdown` splits a GPU's kernel time further: compute, communication
by kind (all-gathers vs the MoE's sends and receives), each one's exposed part, and idle time, overall and per named
scope (e.g. per layer type, found in the events' arguments or through the HLO dump's op names, `hlo_op_names`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

COMM_MARKERS = ("nccl", "SendRecv", "AllGather", "AllReduce", "ReduceScatter", "AllToAll")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def find_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    hits = [os.path.join(root, f) for root, _, files in os.walk(path) for f in files if f == "perfetto_trace.json.gz"]
    if not hits:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
    return max(hits, key=os.path.getmtime)


def _complete_events(path: str):
    """The trace's complete events ("ph": "X") with their process and thread names.
    → iterator of (process name, thread name, event)."""
    path = find_trace(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pnames = {e["pid"]: e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    tnames = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            yield pnames.get(e.get("pid"), ""), tnames.get((e.get("pid"), e.get("tid"))), e


def _gpu_events(path: str):
    """The complete events on GPU devices ("/device:GPU:i" in the process name).
    → iterator of (process name, thread name, event)."""
    for pname, tname, e in _complete_events(path):
        if "/device:GPU" in pname:
            yield pname, tname or "", e


def _host_events(path: str):
    """The complete events off the GPU devices: the host's threads (Python, the runtime's dispatch, the driver's
    API calls). → iterator of (thread name, or the thread id where it has none, event)."""
    for pname, tname, e in _complete_events(path):
        if "/device:GPU" not in pname:
            yield tname if tname is not None else str(e.get("tid")), e


def host_table(path: str) -> dict[str, list]:
    """The host's events of a trace by name (nested events are each counted, so totals overlap): where the host's
    time to dispatch a program goes. → {name: [total_us, count, thread names]}."""
    out: dict[str, list] = {}
    for tname, e in _host_events(path):
        row = out.setdefault(e.get("name", "?"), [0.0, 0, set()])
        row[0] += e["dur"]
        row[1] += 1
        row[2].add(tname)
    return out


def overlap(path: str) -> dict[str, dict[str, float]]:
    """→ {process name: {comm_ms, hidden_ms, exposed_ms, compute_ms, span_ms, comm_events, compute_events}}."""
    per: dict[str, dict[str, list]] = {}
    for pname, _, e in _gpu_events(path):
        kind = "comm" if any(m.lower() in e.get("name", "").lower() for m in COMM_MARKERS) else "compute"
        per.setdefault(pname, {"comm": [], "compute": []})[kind].append((float(e["ts"]), float(e["ts"]) + e["dur"]))
    out = {}
    for pname, kinds in sorted(per.items()):
        comm, compute = _union(kinds["comm"]), _union(kinds["compute"])
        hidden = _intersection(comm, compute)
        everything = _union(kinds["comm"] + kinds["compute"])
        out[pname] = dict(comm_ms=_length(comm) / 1e3, hidden_ms=hidden / 1e3,
                          exposed_ms=(_length(comm) - hidden) / 1e3, compute_ms=_length(compute) / 1e3,
                          span_ms=(everything[-1][1] - everything[0][0]) / 1e3 if everything else 0.0,
                          comm_events=len(kinds["comm"]), compute_events=len(kinds["compute"]))  # fmt: skip
    return out


def _kernel_events(path: str) -> dict[str, list[dict]]:
    """Per GPU (process name, sorted), its kernels: the events of its stream threads ("Stream #…"), or every complete
    event of the device's process when it has none, so that module-level and op-level events are not counted twice."""
    per: dict[str, dict[str, list]] = {}
    for pname, tname, e in _gpu_events(path):
        per.setdefault(pname, {"stream": [], "other": []})["stream" if tname.lower().startswith("stream") else
                                                           "other"].append(e)  # fmt: skip
    return {pname: kinds["stream"] or kinds["other"] for pname, kinds in sorted(per.items())}


def _event_ops(e, op_names: dict[str, str]):
    """The op_names (`hlo_op_names`) of the event's arguments that name an HLO instruction, in argument order."""
    return (op_names[v] for v in (e.get("args") or {}).values() if isinstance(v, str) and v in op_names)


def _event_op(e, op_names: dict[str, str]) -> str:
    """The first of `_event_ops`, or ""."""
    return next(_event_ops(e, op_names), "")


def command_buffers() -> str:
    """"off" where XLA_FLAGS turns XLA's command buffers (CUDA graphs) off, so every kernel event carries its HLO op,
    else "on": what a profile records beside its kernel table."""
    return "off" if "xla_gpu_enable_command_buffer=" in os.environ.get("XLA_FLAGS", "") else "on"


def kernel_table(path: str, op_names: dict[str, str] | None = None) -> dict[str, dict]:
    """Per GPU of a trace: the kernels by name (`_kernel_events`), or with `op_names` (`hlo_op_names`) by (name, the
    JAX op that made each launch): Mosaic kernels all carry a few generic names, so only the op tells them apart.
    → {process name: {busy_us (union of the kernels' intervals), span_us, kernels: {key: [total_us, count]}}}."""
    out = {}
    for pname, chosen in _kernel_events(path).items():
        kernels: dict = {}
        for e in chosen:
            name = e.get("name", "?")
            row = kernels.setdefault(name if op_names is None else (name, _event_op(e, op_names)), [0.0, 0])
            row[0] += e["dur"]
            row[1] += 1
        busy = _union([(float(e["ts"]), float(e["ts"]) + e["dur"]) for e in chosen])
        out[pname] = dict(busy_us=_length(busy), span_us=(busy[-1][1] - busy[0][0]) if busy else 0.0, kernels=kernels)
    return out


def top_kernels(gpu: dict, top: int) -> tuple[list[dict], dict]:
    """One GPU's `kernel_table` entry ranked by total time. → (the `top` kernels as rows {name, ms, share (of the busy
    time), calls, op (the JAX op that made it, with `op_names`, else "")}, the others summed as {kernels, ms,
    share})."""
    busy = gpu["busy_us"] or 1.0
    ranked = sorted(gpu["kernels"].items(), key=lambda kv: -kv[1][0])
    rows = []
    for key, (total, count) in ranked[:top]:
        name, op = key if isinstance(key, tuple) else (key, "")
        rows.append(dict(name=name, ms=total / 1e3, share=total / busy, calls=count, op=op))
    rest = sum(total for _, (total, _) in ranked[top:])
    return rows, dict(kernels=len(ranked[top:]), ms=rest / 1e3, share=rest / busy)


def idle_gaps(path: str, top: int = 10) -> dict[str, dict]:
    """Per GPU of a trace: where it sat idle between its first and last kernel, by the pair of kernels around each
    gap (the kernel that ended last before it, the one that started it): a host sync (a conditional's or a loop's
    predicate read by the host) shows as a gap before the kernels launched after it.
    → {process name: {idle_us, gaps (count), top: [{after, before, ms, count}] (the `top` pairs by total idle)}}."""
    out = {}
    for pname, chosen in _kernel_events(path).items():
        pairs: dict[tuple[str, str], list] = {}
        end, last, idle, count = None, "", 0.0, 0
        for e in sorted(chosen, key=lambda e: float(e["ts"])):
            ts, name = float(e["ts"]), e.get("name", "?")
            if end is not None and ts > end:
                row = pairs.setdefault((last, name), [0.0, 0])
                row[0] += ts - end
                row[1] += 1
                idle += ts - end
                count += 1
            if end is None or ts + e["dur"] >= end:
                end, last = ts + e["dur"], name
        ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
        out[pname] = dict(idle_us=idle, gaps=count, top=[dict(after=a, before=b, ms=t / 1e3, count=n)
                                                         for (a, b), (t, n) in ranked])  # fmt: skip
    return out


COMM_KINDS = (("gather", ("allgather", "all-gather", "all_gather")),
              ("exchange", ("sendrecv", "alltoall", "all-to-all", "collective-permute", "permute")))  # fmt: skip
"""Communication kernels by what they move: "gather" (all-gathers: a chunk's K=V rows and the compressed entries,
gathered by GSPMD), "exchange" (sends and receives: the expert-parallel MoE's permutes); anything else "other"."""


def comm_kind(name: str) -> str | None:
    """A communication kernel's kind ("gather", "exchange" or "other"; `COMM_MARKERS`), None for a compute kernel."""
    low = name.lower()
    if not any(m.lower() in low for m in COMM_MARKERS):
        return None
    return next((kind for kind, marks in COMM_KINDS if any(m in low for m in marks)), "other")


_HLO_OP = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"')


def hlo_op_names(dump_dir: str, module_pattern: str = "") -> dict[str, str]:
    """{HLO instruction name: its op_name metadata (the JAX name stack, named scopes included)} from the optimized
    HLO text XLA dumps (`--xla_dump_to=DIR --xla_dump_hlo_as_text`), of the modules whose file name matches
    `module_pattern`: how a GPU kernel event's `hlo_op` argument is traced back to the code that made it.

    NOTE: XLA numbers instructions per module, so one name can be two different ops in two matched modules; such a
    name is left out (its kernels stay unattributed) rather than given the op of whichever module was read last."""
    out: dict[str, str] = {}
    clashes: set[str] = set()
    if not os.path.isdir(dump_dir):
        return out
    for name in sorted(os.listdir(dump_dir)):
        if not name.endswith("after_optimizations.txt") or not re.search(module_pattern, name):
            continue
        with open(os.path.join(dump_dir, name)) as f:
            for line in f:
                m = _HLO_OP.match(line)
                if m:
                    if out.setdefault(m.group(1), m.group(2)) != m.group(2):
                        clashes.add(m.group(1))
    return {k: v for k, v in out.items() if k not in clashes}


def modules_run(path: str) -> list[str]:
    """The XLA modules a trace ran on its GPUs (the events of the devices' "XLA Modules" threads), e.g.
    ["jit_slot_step"], sorted: the dumps whose op names apply to its kernels."""
    names = {re.split(r"[\s(]", e.get("name", ""))[0] for _, tname, e in _gpu_events(path)
             if tname.lower().startswith("xla modules")}  # fmt: skip
    return sorted(n for n in names if n)


def _event_text(e) -> str:
    """The event's name and every string argument (where profilers put the op name and the name stack)."""
    args = e.get("args") or {}
    return " ".join([e.get("name", "")] + [v for v in args.values() if isinstance(v, str)])


def scope_finder(pattern: str, op_names: dict[str, str] | None = None):
    """`scope_of(event) → str | None`: the first group of regex `pattern` in the event's name or arguments, or else in
    the op_name (`hlo_op_names`) of an argument that names an HLO instruction."""
    regex = re.compile(pattern)
    op_names = op_names or {}

    def scope_of(e) -> str | None:
        m = regex.search(_event_text(e))
        if m:
            return m.group(1)
        for op in _event_ops(e, op_names):
            m = regex.search(op)
            if m:
                return m.group(1)
        return None

    return scope_of


def breakdown(path: str, scope_of=None) -> dict[str, dict]:
    """Per GPU of a trace, from its kernels (stream threads' events, as `kernel_table`): where the time goes.
    → {process name: {span_ms, busy_ms, compute_ms, comm_ms, exposed_ms, idle_ms, comm_kind_ms: {kind: ms},
    exposed_kind_ms: {kind: ms}, attributed: fraction of kernel time with a scope, scopes: {scope: {compute_ms,
    comm_kind_ms, exposed_kind_ms, idle_ms, kernels}}}}.

    exposed: communication (of that kind) while no compute kernel runs; idle: no kernel at all, from the first
    kernel's start to the last one's end. Per scope (`scope_of(event)`, e.g. `scope_finder(...)`; None: "other"), a
    kernel's time goes to its own scope and each idle gap to the scope of the kernel that ends it (the one the device
    waited for), so the scopes' idle times sum to the GPU's.
    """
    out = {}
    for pname, chosen in _kernel_events(path).items():
        events = sorted(((float(e["ts"]), float(e["ts"]) + e["dur"], e) for e in chosen),
                        key=lambda x: (x[0], x[1]))  # fmt: skip
        scoped: dict[str, dict[str, list]] = {}
        for a, b, e in events:
            scope = (scope_of(e) if scope_of else None) or "other"
            kind = comm_kind(e.get("name", "")) or "compute"
            scoped.setdefault(scope, {}).setdefault(kind, []).append((a, b))
        everything = {k: _union([iv for s in scoped.values() for iv in s.get(k, [])]) for k in
                      ("compute", "gather", "exchange", "other")}  # fmt: skip
        compute = everything["compute"]

        def split(kinds_: dict[str, list], compute_: list) -> dict:
            comm = {k: _union(kinds_.get(k, [])) for k in ("gather", "exchange", "other")}
            return dict(compute_ms=_length(_union(kinds_.get("compute", []))) / 1e3,
                        comm_kind_ms={k: _length(v) / 1e3 for k, v in comm.items()},
                        exposed_kind_ms={k: (_length(v) - _intersection(v, compute_)) / 1e3
                                         for k, v in comm.items()})  # fmt: skip
        # idle gaps, each to the scope of the kernel that ends it
        idle: dict[str, float] = {}
        reach = events[0][1] if events else 0.0
        for a, b, e in events[1:]:
            if a > reach:
                scope = (scope_of(e) if scope_of else None) or "other"
                idle[scope] = idle.get(scope, 0.0) + a - reach
            reach = max(reach, b)
        all_comm = _union(everything["gather"] + everything["exchange"] + everything["other"])
        busy = _union(compute + all_comm)
        span = (busy[-1][1] - busy[0][0]) if busy else 0.0
        total = sum(b - a for a, b, _ in events)
        attributed = sum(b - a for a, b, e in events if scope_of and scope_of(e)) / total if total else 0.0
        row = split(everything, compute)
        row.update(span_ms=span / 1e3, busy_ms=_length(busy) / 1e3, comm_ms=_length(all_comm) / 1e3,
                   exposed_ms=(_length(all_comm) - _intersection(all_comm, compute)) / 1e3,
                   idle_ms=(span - _length(busy)) / 1e3, attributed=attributed,
                   scopes={s: {**split(k, compute), "idle_ms": idle.get(s, 0.0) / 1e3,
                               "kernels": sum(len(v) for v in k.values())}
                           for s, k in sorted(scoped.items())})  # fmt: skip
        out[pname] = row
    return out


def profile(fn, args, trace_dir: str, indent: str = "  ") -> dict[str, dict[str, float]]:
    """One call of `fn(*args)` under `jax.profiler.trace` (Perfetto JSON too), then `overlap` of that trace, printed
    per GPU. For the benchmark scripts' --trace. → `overlap`'s rows ({} when the trace has no GPU kernels)."""
    import jax

    jax.block_until_ready(fn(*args))  # warm: the profiled call is a steady-state one
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    try:
        rows = overlap(trace_dir)
    except FileNotFoundError as exc:
        print(f"{indent}trace: {exc}", flush=True)
        return {}
    for pname, r in rows.items():
        print(f"{indent}trace {pname}: comm {r['comm_ms']:.2f} ms in {r['comm_events']} kernels, {r['hidden_ms']:.2f} "
              f"hidden behind compute, {r['exposed_ms']:.2f} exposed; compute {r['compute_ms']:.2f}, span "
              f"{r['span_ms']:.2f} ms", flush=True)  # fmt: skip
    if not rows:
        print(f"{indent}trace: no GPU kernels in the trace (CPU run?)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a perfetto_trace.json.gz, or the directory jax.profiler.trace wrote")
    args = p.parse_args()
    rows = overlap(args.trace)
    if not rows:
        print("no GPU device events in the trace", file=sys.stderr)
    for pname, r in rows.items():
        print(f"{pname}: comm {r['comm_ms']:.2f} ms ({r['comm_events']} kernels), hidden {r['hidden_ms']:.2f}, "
              f"exposed {r['exposed_ms']:.2f}; compute {r['compute_ms']:.2f} ms; span {r['span_ms']:.2f} ms")


if __name__ == "__main__":
    main()
