"""What `dsv4 serve` costs over the engine, and what one long prompt costs the short requests' streams.

Starts `dsv4 serve MODEL` as a subprocess and builds the same engine in this process, then runs rounds of:

    engine       the workload fed to `dsv4.LLM` here: each request added at its arrival time (between steps, as the
                 server's engine thread does), TTFT and ITL from the engine's own request metrics
    http         the same prompts at the same arrival times through `dsv4 bench serve`'s client and the server
    http+long    (with --long-prompt-len) the same plus one long prompt at t = 0
    engine+long  (with --long-prompt-len) that, fed to the engine here

Both engines are built by the same code from the same engine options (`dsv4.serve.server.build_llm`, defaults
included). Only one side runs at a time, so on a small CPU box the two processes never compete, and the sides
alternate within every round, so a slow spell of the machine hits both. Reported: the median over rounds of each
side's TTFT p50 and mean and ITL p50 / p99, and the ratios http / engine (the HTTP layer's cost) and with / without
the long prompt (interference). The http sides also read the server's own TTFT histogram from /metrics: its mean
against the engine's says whether the engine runs slower inside the server, and the client's mean minus it is what
HTTP itself adds to a request (receiving and parsing the body, the first chunk's way back). Both processes share a
persistent JAX compilation cache, so each shape compiles once.

    python scripts/bench_serve_overhead.py --model tiny --engine-args "--max-slots 16 --chunk-size 256 \\
        --max-model-len 9000" --num-prompts 100 --request-rate 10 --input-len 64 --output-len 32 \\
        --long-prompt-len 8192 --rounds 3

With --num-prompts 0 only the long prompt runs (engine+long against http+long): its TTFT through HTTP against the
engine's, as on a GPU with a 128K prompt. The engine here then compiles only the widths that prompt and the warm-up
request use; add --no-warmup to --engine-args to let the server compile them on first use too (its warm-up request
and the long prompt's lone run come before any measured one). GPU memory is allocated on demand in both processes
(no preallocation), so the two fit one device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv4.serve import bench  # noqa: E402  (after the path)

STATS = ("ttft_p50_ms", "ttft_mean_ms", "server_ttft_mean_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
         "long_ttft_ms", "server_long_ttft_ms")  # fmt: skip
SERVER_TTFT = "dsv4_time_to_first_token_seconds"
LONG_PREFILL_LINE = r"prefill of {} tokens done, first token after ([0-9.]+) s"
"""The server's log line for a prompt longer than a chunk (dsv4.serve.worker): its own TTFT, to the millisecond."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory (default tiny)")
    p.add_argument("--engine-args", default="--max-slots 16 --chunk-size 256 --max-model-len 9000",
                   help="engine options of both engines, as dsv4 serve takes them (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=10.0)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--input-len-range", type=float, default=0.0)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--long-prompt-len", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def engine_options(args) -> list[str]:
    return shlex.split(args.engine_args)


class Server:
    def __init__(self, args, env: dict, log_path: pathlib.Path) -> None:
        cmd = [sys.executable, "-m", "dsv4.cli", "serve", args.model, "--port", str(args.port), *engine_options(args)]
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            text = log_path.read_text()
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", text)
            if match:
                self.url = match.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"the server did not start:\n{log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bench_args(args, url: str, *, long: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args([
        "--base-url", url, "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
        "--input-len", str(args.input_len), "--input-len-range", str(args.input_len_range),
        "--output-len", str(args.output_len), "--seed", str(args.seed), "--quiet",
        *(["--long-prompt-len", str(args.long_prompt_len)] if long else []),
    ])  # fmt: skip


def engine_round(llm, work: bench.Workload, bargs, *, long: bool) -> dict:
    """The workload through `llm` in this process: requests added at their arrival times, between steps."""
    from dsv4.generate import SamplingParams

    greedy = SamplingParams()
    llm.add_request(work.warm_prompt, max_new_tokens=bargs.output_len, sampling=greedy)  # as the client's warm-up
    while llm.has_unfinished_requests():
        llm.step()
    arrivals, at = [], 0.0
    for gap in work.gaps:
        at += gap
        arrivals.append(at)
    t0 = time.perf_counter()
    ids, long_id, i = [], None, 0
    if long:
        long_id = llm.add_request(work.long_prompt, max_new_tokens=bargs.output_len, sampling=greedy, arrival_time=t0)
    while i < len(work.prompts) or llm.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(work.prompts) and t0 + arrivals[i] <= now:
            ids.append(llm.add_request(work.prompts[i], max_new_tokens=bargs.output_len, sampling=greedy,
                                       arrival_time=t0 + arrivals[i]))  # fmt: skip
            i += 1
        if llm.has_unfinished_requests():
            llm.step()
        elif i < len(work.prompts):
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
    duration = time.perf_counter() - t0
    results = []
    for index, request_id in enumerate(ids):
        out = llm.pop_output(request_id)
        m = out.metrics
        results.append(bench.Result(index, len(work.prompts[index]), sent=m.arrival_time,
                                    ok=out.finish_reason != "error", ttft=m.ttft_s, e2e=m.e2e_s,
                                    output_tokens=len(out.token_ids), chunk_times=list(m.token_times)))  # fmt: skip
    summary = bench.summarize(results, duration, bargs)
    if long_id is not None:
        summary["long_prompt"] = {"ttft_loaded_ms": llm.pop_output(long_id).metrics.ttft_s * 1e3}
    return summary


def server_ttft_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's own TTFT histogram: each request's arrival at the engine to its first token."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    totals = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (f"{SERVER_TTFT}_sum", f"{SERVER_TTFT}_count"):
            totals[name] = float(value)
    return totals[f"{SERVER_TTFT}_sum"], totals[f"{SERVER_TTFT}_count"]


def http_round(bargs) -> dict:
    """The client's numbers, and the server's mean TTFT over the same requests (its clock starts once the body is
    parsed, and stops when the engine has the token), so client mean - server mean is what HTTP itself costs."""
    sum0, count0 = server_ttft_totals(bargs.base_url)
    summary = asyncio.run(bench.run(bargs))["summary"]
    sum1, count1 = server_ttft_totals(bargs.base_url)
    # The client's warm-up request is in the server's count too: one short prompt on an idle engine. With a long
    # prompt (run alone first, then among the others) the mean would mix it in: its own line is read instead.
    if bargs.long_prompt_len is None and count1 > count0:
        summary["server_ttft_mean_ms"] = (sum1 - sum0) / (count1 - count0) * 1e3
    return summary


def nan_if_none(value) -> float:
    return math.nan if value is None else value


def json_safe(x):
    """NaN (a side without that number) as null: strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return [json_safe(v) for v in x] if isinstance(x, list) else x


def main(argv=None) -> int:
    args = parse_args(argv)
    cache = tempfile.mkdtemp(prefix="dsv4_jax_cache_")
    env = {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # fmt: skip
    os.environ.update(env)  # before JAX starts here; the server inherits it
    from dsv4.cli import build_parser
    from dsv4.serve.server import build_llm

    server = Server(args, os.environ.copy(), pathlib.Path(cache) / "server.log")
    try:
        engine_args = build_parser().parse_args(["serve", args.model, *engine_options(args)])
        llm = build_llm(engine_args)  # what the server built: same options, same defaults
        if args.num_prompts:  # short prompts of spread lengths, batched decodes: every width
            llm.warmup(widths=llm.runner.width_buckets)
        else:  # the long prompt alone, after the short warm-up request: only their widths (minutes less on a GPU)
            llm.warmup(prompt_lens=[args.long_prompt_len, args.input_len])
        mixed = engine_args.mixed_chunk_size
        sides = ["engine", "http"] if args.num_prompts else []
        if args.long_prompt_len:
            sides += ["http+long", "engine+long"]
        if not sides:
            raise SystemExit("nothing to run: give --num-prompts > 0 or --long-prompt-len")
        rounds: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                long = side.endswith("+long")
                bargs = bench_args(args, server.url, long=long)
                if side.startswith("http"):
                    summary = http_round(bargs)
                else:
                    work = bench.make_workload(bargs, llm.config.vocab_size, chat=False)
                    summary = engine_round(llm, work, bargs, long=long)
                if summary["failed"] or summary.get("long_prompt_error"):
                    error = summary.get("first_error") or summary.get("long_prompt_error")
                    raise RuntimeError(f"{side}: {summary['failed']} requests failed: {error}")
                summary["long_ttft_ms"] = (summary.get("long_prompt") or {}).get("ttft_loaded_ms")
                if side == "http+long":  # the loaded run's line comes last
                    found = re.findall(LONG_PREFILL_LINE.format(args.long_prompt_len), server.log_path.read_text())
                    summary["server_long_ttft_ms"] = float(found[-1]) * 1e3 if found else None
                row = {k: nan_if_none(summary.get(k)) for k in STATS}
                rounds[side].append(row)
                print(f"round {r + 1} {side:<12} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()),
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        server.stop()

    med = {side: {k: statistics.median(row[k] for row in rows) for k in STATS} for side, rows in rounds.items()}
    print(f"\n{args.model} ({args.engine_args}, mixed-step prefill {mixed}): {args.num_prompts} prompts of "
          f"{args.input_len} tokens at {args.request_rate}/s, {args.output_len} new"
          f"{f', one {args.long_prompt_len}-token prompt' if args.long_prompt_len else ''}; "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(f"{'side':<12} {'TTFT p50':>9} {'mean':>7} {'server':>7} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} "
          f"{'long TTFT':>10} {'server':>7}   (ms; server: the server's own TTFT)")  # fmt: skip
    for side, row in med.items():
        print(f"{side:<12} {row['ttft_p50_ms']:>9.1f} {row['ttft_mean_ms']:>7.1f} {row['server_ttft_mean_ms']:>7.1f} "
              f"{row['itl_p50_ms']:>8.1f} {row['itl_p99_ms']:>8.1f} {row['tpot_p50_ms']:>9.1f} "
              f"{row['long_ttft_ms']:>10.1f} {row['server_long_ttft_ms']:>7.1f}")  # fmt: skip
    ratios = {}
    if args.num_prompts:
        ratios["http_over_engine_ttft_p50"] = med["http"]["ttft_p50_ms"] / med["engine"]["ttft_p50_ms"]
        ratios["http_over_engine_ttft_mean"] = med["http"]["ttft_mean_ms"] / med["engine"]["ttft_mean_ms"]
        ratios["server_over_engine_ttft_mean"] = med["http"]["server_ttft_mean_ms"] / med["engine"]["ttft_mean_ms"]
        http_layer = [r["ttft_mean_ms"] - r["server_ttft_mean_ms"] for r in rounds["http"]]
        ratios["http_layer_ms"] = statistics.median(http_layer)
        print(f"\nTTFT through HTTP / the engine's: p50 {ratios['http_over_engine_ttft_p50']:.3f}, mean "
              f"{ratios['http_over_engine_ttft_mean']:.3f}; the server's own TTFT / the engine's (mean): "
              f"{ratios['server_over_engine_ttft_mean']:.3f}; HTTP itself (client - server mean): "
              f"{ratios['http_layer_ms']:.2f} ms a request")  # fmt: skip
    if args.long_prompt_len:
        ratios["http_over_engine_long_ttft"] = med["http+long"]["long_ttft_ms"] / med["engine+long"]["long_ttft_ms"]
        server_long = med["http+long"]["server_long_ttft_ms"]
        ratios["server_over_engine_long_ttft"] = server_long / med["engine+long"]["long_ttft_ms"]
        ratios["http_layer_long_ms"] = statistics.median(r["long_ttft_ms"] - r["server_long_ttft_ms"]
                                                         for r in rounds["http+long"])  # fmt: skip
        print(f"long prompt's TTFT through HTTP / the engine's: {ratios['http_over_engine_long_ttft']:.3f}; the "
              f"server's own / the engine's: {ratios['server_over_engine_long_ttft']:.3f}; HTTP itself (client - "
              f"server): {ratios['http_layer_long_ms']:.1f} ms")  # fmt: skip
        if args.num_prompts:
            for base in ("http", "engine"):
                key = f"{base}_itl_p99_long_over_alone"
                ratios[key] = med[f"{base}+long"]["itl_p99_ms"] / med[base]["itl_p99_ms"]
                print(f"ITL p99 with the long prompt / without ({base}): {ratios[key]:.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            report = {"args": vars(args) | {"mixed_chunk_size": mixed}, "rounds": rounds, "median": med,
                      "ratios": ratios}
            json.dump(json_safe(report), f, indent=2, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
