"""Where one prefill chunk's GPU time goes: the kernels of a long prompt's last chunk, by GPU time.

    python3 scripts/profile_chunk.py --model v4-flash --length 512k --top 10 --out $OUT --engine-args \
        "--layer-types sliding,csa,hca --random-weights fp8 --chunk-size 16384 --kernels indexer=pallas-fp8"

Builds the engine from --engine-args as `dsv4 serve` does (the CLI's engine options, defaults included), compiles
the prompt's chunk widths, prefills every chunk of a --length prompt but the last, then runs the last one (the chunk
that attends to the whole context, and the first token) under `jax.profiler.trace`. Prints the first GPU's busy time
(the union of its kernels), the wall time of that step, and the --top kernels by GPU time with their share of the
busy time (`trace_overlap.kernel_table`): the Pallas kernels and the cuBLAS GEMMs beside XLA's own fusions, the glue
between them, each with the JAX op that made it (its op_name in the optimized HLO of the programs the traced step
ran, dumped for the purpose and deleted after; --no-op-names skips it). Launches are ranked by kernel and op
together: every Mosaic kernel is named after its body function, so only the op tells the attention's apart from the
MoE's. Kernels that XLA replays from a command buffer (a CUDA graph: the straight-line stretches of the step) carry
no HLO op in the trace; run with XLA_FLAGS=--xla_gpu_enable_command_buffer= to name every kernel (kernel times stay;
the gaps between launches grow, so busy time is the measure, not the span). The JSON says which way it ran. --out
DIR: the trace and profile_chunk.json (and, with --keep-hlo, the optimized HLO). On a CPU the trace has no GPU
kernels, and the table says so.

--whole traces a whole prompt instead (kernels unnamed, command buffers as XLA_FLAGS leave them): its GPU busy time
against its wall time, and the idle gaps inside its span by the kernels around them, which is where the host held the
GPU up (a conditional's predicate or a loop's trip read back, a dispatch that fell behind); profile_prompt.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def parse_args(argv=None):
    from dsv4.cli import parse_count

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory (default tiny)")
    p.add_argument("--engine-args", default="", help="engine options, as dsv4 serve takes them")
    p.add_argument("--length", type=parse_count, default=256, help="prompt tokens, e.g. 512k (default 256)")
    p.add_argument("--top", type=int, default=10, help="kernels to list (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=None, help="directory for the trace and profile_chunk.json")
    p.add_argument("--no-op-names", action="store_true",
                   help="skip the HLO dump through which each kernel is named by the JAX op that made it")
    p.add_argument("--whole", action="store_true",
                   help="trace the whole prompt instead of its last chunk: its GPU busy time against its wall time, "
                        "and where the GPU sat idle (after the same prefill of another prompt, untraced)")
    p.add_argument("--keep-hlo", action="store_true",
                   help="keep the step programs' optimized HLO (gzipped) under --out/hlo, to read the fusions")
    return p.parse_args(argv)


def _short_op(op_name: str, keep: int = 70) -> str:
    """An op_name without its jit(...) wrappers, cut to its last `keep` characters (the layer and the op)."""
    parts = [p for p in op_name.split("/") if not p.startswith("jit(")]
    text = "/".join(parts) or op_name
    return text if len(text) <= keep else "…" + text[-keep:]


def main(argv=None) -> int:
    args = parse_args(argv)
    dump = None
    if not (args.no_op_names or args.whole):  # before the backend starts: the step programs' HLO, for op names
        dump = tempfile.mkdtemp(prefix="dsv4_chunk_hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text "
                                   "--xla_dump_hlo_module_re=step").strip()  # fmt: skip
    import jax
    import numpy as np
    from trace_overlap import command_buffers, hlo_op_names, kernel_table, modules_run, top_kernels

    from dsv4.cli import build_parser

    engine = build_parser().parse_args(["serve", args.model, *shlex.split(args.engine_args)])
    llm = engine.make_llm(engine, max_slots=1, max_model_len=args.length + 1)
    compile_s = llm.warmup(prompt_lens=[args.length])
    if args.whole:
        return whole_prompt(args, llm, compile_s)
    prompt = np.random.default_rng(args.seed).integers(0, llm.config.vocab_size, args.length).tolist()
    request = llm.add_request(prompt, max_new_tokens=1)
    last = args.length - (args.length - 1) % llm.chunk_size - 1  # where the last chunk starts
    t0 = time.perf_counter()
    while llm.progress(request)[0] < last:
        llm.step()
    jax.block_until_ready(llm.runner.cache)
    before_s = time.perf_counter() - t0
    trace_dir = str(args.out / "trace") if args.out else tempfile.mkdtemp(prefix="dsv4_chunk_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        events = llm.step()
        jax.block_until_ready(llm.runner.cache)
        wall_s = time.perf_counter() - t0
    if not any(e.request_id == request for e in events):
        raise RuntimeError("the traced step did not finish the prompt: it was not its last chunk")

    ran = modules_run(trace_dir)  # name kernels by these modules' dumps only: others reuse instruction names
    pattern = "|".join(rf"\.{re.escape(m)}\." for m in ran) or "step"
    table = kernel_table(trace_dir, hlo_op_names(dump, pattern) if dump else None)
    report = dict(model=args.model, engine_args=args.engine_args, length=args.length, chunk_size=llm.chunk_size,
                  chunk_start=last, chunk_tokens=args.length - last, compile_s=compile_s, modules=ran,
                  chunks_before_s=before_s, wall_ms=wall_s * 1e3, devices=sorted(table), kernels=[],
                  command_buffers=command_buffers())  # fmt: skip
    print(f"{args.model} {args.engine_args}: the last chunk of a {args.length}-token prompt (tokens {last}.."
          f"{args.length - 1}): wall {wall_s * 1e3:.1f} ms under the profiler")  # fmt: skip
    if not table:
        print("no GPU kernels in the trace (a CPU run): nothing to rank")
    else:
        gpu = table[sorted(table)[0]]
        rows, rest = top_kernels(gpu, args.top)
        calls = sum(count for _, count in gpu["kernels"].values())
        report.update(busy_ms=gpu["busy_us"] / 1e3, span_ms=gpu["span_us"] / 1e3, kernel_count=calls, kernels=rows,
                      rest_ms=rest["ms"])  # fmt: skip
        print(f"{sorted(table)[0]}: busy {gpu['busy_us'] / 1e3:.1f} ms over a {gpu['span_us'] / 1e3:.1f} ms span, "
              f"{len(gpu['kernels'])} distinct kernels, {calls} launches")  # fmt: skip
        print(f"{'ms':>9} {'share':>6} {'calls':>5}  kernel  [the JAX op that made it]")
        for row in rows:
            op = f"  [{_short_op(row['op'])}]" if row["op"] else ""
            print(f"{row['ms']:9.2f} {row['share']:6.1%} {row['calls']:5d}  {row['name'][:60]}{op}")
        print(f"{rest['ms']:9.2f} {rest['share']:6.1%}        the other {rest['kernels']} kernels")
    if args.out:
        (args.out / "profile_chunk.json").write_text(json.dumps(report, indent=2))
    if dump and args.keep_hlo and args.out:
        import gzip

        (args.out / "hlo").mkdir(parents=True, exist_ok=True)
        for path in pathlib.Path(dump).glob("*after_optimizations.txt"):
            (args.out / "hlo" / (path.name + ".gz")).write_bytes(gzip.compress(path.read_bytes()))
    if dump:
        shutil.rmtree(dump, ignore_errors=True)
    return 0


def whole_prompt(args, llm, compile_s: float) -> int:
    """--whole: one prompt prefilled untraced (its wall time is the TTFT without the profiler's cost), then another
    under the trace: the first GPU's busy time (the union of its kernels) against the traced wall time, and the idle
    gaps inside its span by the kernels around them (`trace_overlap.idle_gaps`)."""
    import jax
    import numpy as np
    from trace_overlap import command_buffers, idle_gaps, kernel_table, top_kernels

    def prefill(seed: int) -> float:
        prompt = np.random.default_rng(seed).integers(0, llm.config.vocab_size, args.length).tolist()
        request = llm.add_request(prompt, max_new_tokens=1)
        t0 = time.perf_counter()
        while llm.has_unfinished_requests():
            llm.step()
        jax.block_until_ready(llm.runner.cache)
        wall = time.perf_counter() - t0
        out = llm.pop_output(request)
        if out is None or out.error:
            raise RuntimeError(f"the prompt failed: {None if out is None else out.error}")
        return wall

    untraced_s = prefill(args.seed + 1)
    trace_dir = str(args.out / "trace") if args.out else tempfile.mkdtemp(prefix="dsv4_prompt_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        traced_s = prefill(args.seed)
    print(f"{args.model} {args.engine_args}: a {args.length}-token prompt, {llm.chunk_size}-token chunks: wall "
          f"{untraced_s * 1e3:.1f} ms, {traced_s * 1e3:.1f} ms under the profiler")  # fmt: skip
    report = dict(model=args.model, engine_args=args.engine_args, length=args.length, chunk_size=llm.chunk_size,
                  compile_s=compile_s, wall_ms=untraced_s * 1e3, traced_wall_ms=traced_s * 1e3,
                  command_buffers=command_buffers())  # fmt: skip
    table = kernel_table(trace_dir)
    if not table:
        print("no GPU kernels in the trace (a CPU run): nothing to measure")
    else:
        device = sorted(table)[0]
        gpu, gaps = table[device], idle_gaps(trace_dir, args.top)[device]
        rows, _ = top_kernels(gpu, args.top)
        report.update(device=device, busy_ms=gpu["busy_us"] / 1e3, span_ms=gpu["span_us"] / 1e3,
                      idle_ms=gaps["idle_us"] / 1e3, gaps=gaps["gaps"], top_gaps=gaps["top"], kernels=rows)
        print(f"{device}: busy {gpu['busy_us'] / 1e3:.1f} ms over a {gpu['span_us'] / 1e3:.1f} ms span "
              f"({gpu['busy_us'] / max(traced_s * 1e6, 1.0):.1%} of the traced wall); idle inside the span "
              f"{gaps['idle_us'] / 1e3:.1f} ms in {gaps['gaps']} gaps, by the kernels around them:")  # fmt: skip
        print(f"{'ms':>9} {'gaps':>6}  after → before")
        for row in gaps["top"]:
            print(f"{row['ms']:9.2f} {row['count']:6d}  {row['after'][:50]} → {row['before'][:50]}")
        print(f"{'ms':>9} {'share':>6} {'calls':>5}  kernel")
        for row in rows:
            print(f"{row['ms']:9.2f} {row['share']:6.1%} {row['calls']:5d}  {row['name'][:60]}")
    if args.out:
        (args.out / "profile_prompt.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
