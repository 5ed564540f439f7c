"""`dsv4 serve` (an OpenAI-compatible HTTP server over `dsv4.LLM`) and `dsv4 bench serve` (a load generator for any
OpenAI-compatible endpoint).

This module only defines their command-line arguments (argparse, nothing heavy), so `dsv4 --help` stays fast; the
server (`server`: aiohttp, the engine thread in `worker`, formats in `protocol`, `detokenize`, `metrics`) and the
benchmark (`bench`) are imported when a command runs. They need the `serve` extra: `pip install -e '.[serve]'`.
"""

from __future__ import annotations

import argparse


def add_commands(sub, bench_sub, *, engine_args, make_llm) -> None:
    """Adds `serve` to the `dsv4` subparsers `sub` and `serve` to the `dsv4 bench` subparsers `bench_sub`.
    engine_args(parser, slots_default=...) adds the engine options; make_llm(args, max_slots, max_model_len)
    builds the engine from them (both from dsv4.cli, passed in so this package does not import the CLI)."""
    s = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve MODEL over HTTP with the OpenAI API: POST /v1/completions and /v1/chat/completions "
        "(whole or streamed as server-sent events), GET /v1/models, /health and /metrics (Prometheus). "
        "One engine thread runs the engine's continuous batching; SIGTERM drains in-flight requests "
        "(up to --shutdown-timeout) and exits 0.",
        epilog="examples:\n  dsv4 serve /path/to/checkpoint --port 8000\n"
        "  dsv4 serve /path/to/checkpoint --devices 8 --max-slots 16 --max-model-len 128k\n"
        '  curl localhost:8000/v1/completions -d \'{"prompt": "Hello", "max_tokens": 16}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "model",
        metavar="MODEL",
        help="a checkpoint directory (tokenizer.json enables text prompts and "
        "chat) or a preset (tiny, v4-flash, v4-pro: random weights)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, logged)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL's basename)")
    s.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights and activations (default: float32 for tiny, bfloat16 otherwise)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed for random weights (presets)")
    s.add_argument("--no-warmup", action="store_true", help="compile chunk widths on first use, not at start-up")
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before cancelling them (default 30)",
    )
    engine_args(s, slots_default="8")
    s.set_defaults(func=_cmd_serve, make_llm=make_llm)

    b = bench_sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server: TTFT / TPOT / ITL percentiles, throughput, goodput",
        description="Send --num-prompts streaming completion requests to a running server (dsv4 serve or any "
        "OpenAI-compatible one), arriving as a Poisson process at --request-rate per second (inf: all at "
        "once), with prompt lengths uniform around --input-len; optionally one --long-prompt-len prompt "
        "at the start (measured alone first). Reports TTFT, TPOT and ITL at p50 / p90 / p99, throughput "
        "and goodput under --slo-ttft-ms / --slo-tpot-ms, as a table and JSON (--json-out).",
        epilog="examples:\n  dsv4 bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4\n"
        "  dsv4 bench serve --input-len 1024 --input-len-range 0.5 --output-len 64 --request-rate inf\n"
        "  dsv4 bench serve --long-prompt-len 131072 --num-prompts 100 --request-rate 2 --slo-ttft-ms 500",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from dsv4.serve.bench import add_arguments  # argparse only

    add_arguments(b)
    b.set_defaults(func=_cmd_bench_serve)


def _cmd_serve(args) -> int:
    from dsv4.serve.server import cmd_serve

    return cmd_serve(args)


def _cmd_bench_serve(args) -> int:
    from dsv4.serve.bench import main

    return main(args)
