"""The `dsv4` command.

dsv4 generate --model tiny --prompt-len 4096 --max-new-tokens 8
dsv4 generate --model /path/to/checkpoint --token-ids 1,2,3 --max-new-tokens 16
dsv4 bench ttft --model tiny --lengths 1024,4096 --concurrency 1,4 --max-new-tokens 8
dsv4 plan --model v4-flash --context 512k --devices 8 --weights fp8
dsv4 info --model v4-flash
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

EXAMPLES = """\
examples:
  dsv4 generate --model tiny --prompt-len 4096 --max-new-tokens 8        # random weights, synthetic prompt
  dsv4 generate --model /path/to/checkpoint --prompt "Hello" --max-new-tokens 32
  dsv4 bench ttft --model tiny --lengths 1024,4096 --concurrency 1,4     # TTFT / TPOT / ITL percentiles
  dsv4 plan --model v4-flash --context 512k --devices 8 --weights fp8    # will it fit? per-device memory
  dsv4 info --model v4-flash                                             # the resolved config
"""


def parse_count(text: str) -> int:
    """'4096', '32k' / '32K' (× 1024), '1m' (× 1024²) → int."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 4096, 32k or 1m") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def parse_counts(text: str) -> list[int]:
    counts = [parse_count(part) for part in text.split(",") if part.strip()]
    if not counts:
        raise argparse.ArgumentTypeError(f"{text!r} holds no counts: give e.g. 1024,4096")
    return counts


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def temperature(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 (0 = greedy)")
    return value


def probability(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def token_ids(text: str) -> list[int]:
    """'1,2,3' → [1, 2, 3]; each must be an integer >= 0, and there must be at least one."""
    ids = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not an integer") from None
        if ids[-1] < 0:
            raise argparse.ArgumentTypeError(f"{ids[-1]} is negative; token ids are >= 0")
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r} holds no token ids: give e.g. 1,2,3")
    return ids


class UserError(ValueError):
    """A mistake in what the user asked for: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (no usage block) and exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _config_of(model: str):
    """The config of a preset or a checkpoint directory, or a UserError saying which it is not."""
    from dsv4.config import _PRESETS, Config

    if os.path.isdir(model):
        return Config.from_hf(model)
    if model in _PRESETS:
        return Config.preset(model)
    if os.sep in model or model.startswith((".", "~")) or os.path.exists(model):
        what = "is not a directory" if os.path.exists(model) else "does not exist"
        raise UserError(f"--model {model}: {what} (a checkpoint is a directory with config.json)")
    raise UserError(f"--model {model!r}: no such directory, and not a preset ({', '.join(_PRESETS)})")


# ----- shared options ------------------------------------------------------------------------------------


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="a preset (tiny, v4-flash, v4-pro: random weights) or a checkpoint directory "
        "(config.json + safetensors; tokenizer.json enables --prompt). Default: tiny",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights and activations (default: float32 for tiny, bfloat16 otherwise)",
    )
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed for random weights, synthetic prompts and sampling")  # fmt: skip


def _add_engine_args(p: argparse.ArgumentParser, *, slots_default: str) -> None:
    e = p.add_argument_group("engine", "how the engine batches and pads work (the defaults suit one long prompt)")
    e.add_argument("--max-slots", type=positive_int, default=None,
                   help=f"requests running at once (default: {slots_default})")  # fmt: skip
    e.add_argument(
        "--max-model-len",
        type=parse_count,
        default=None,
        help="longest prompt + new tokens, and each slot's cache length (default: just what is asked)",
    )
    e.add_argument(
        "--chunk-size",
        type=parse_count,
        default=None,
        help="prefill at most this many tokens of one prompt per step (default 32768 a device where the device has "
        "the room, else 16384; at most --max-model-len; dsv4 serve: 16384)",
    )
    e.add_argument(
        "--mixed-chunk-size",
        type=parse_count,
        default=None,
        help="while other requests are decoding, prefill at most this many tokens per step, so their inter-token "
        "latency stays near one such piece (default: the chunk size; dsv4 serve: a quarter of it)",
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=parse_count,
        default=None,
        help="token budget of one step, all requests together (default: chunk size + max slots)",
    )
    e.add_argument("--decode-steps", type=positive_int, default=1, metavar="K",
                   help="run up to K decode steps in one device call (sampling on the device) when every running "
                        "request is decoding and none waits: the host dispatches once for K tokens; tokens of one "
                        "call reach the client together (default 1)")  # fmt: skip
    e.add_argument(
        "--policy",
        default="prefill_priority",
        choices=["prefill_priority", "decode_priority", "fcfs"],
        help="who gets the step's budget first (default prefill_priority: a running long prefill "
        "keeps its whole chunk)",
    )
    e.add_argument(
        "--kv-format",
        default=None,
        choices=["float32", "bfloat16", "bf16", "fp8-tensor", "fp8-channel", "fp8-tile", "fp8-tile-e8m0"],
        help="KV cache storage: a dtype, or a storage format (fp8-channel: FP8 e4m3 with per-channel scales, RoPE "
        "channels bf16; see docs/BENCHMARKS.md for their accuracy). Default: the model's dtype",
    )
    e.add_argument(
        "--buckets",
        type=parse_counts,
        default=None,
        help="comma-separated chunk widths calls are padded to; each one used compiles once "
        "(default: powers of two up to the chunk size)",
    )
    e.add_argument(
        "--max-packed-width",
        type=positive_int,
        default=16,
        help="chunks up to this width share one [max-slots, width] call; wider ones run alone (default 16)",
    )
    e.add_argument("--devices", type=positive_int, default=1,
                   help="run on this many local devices (one mesh: each chunk's tokens split over them, the experts "
                        "expert-parallel, the cache replicated); default 1")  # fmt: skip
    e.add_argument("--no-chat-template", action="store_true",
                   help="encode --prompt as is, even if the tokenizer has a chat template")  # fmt: skip
    k = p.add_argument_group("kernels", "which implementation runs each part (docs/BENCHMARKS.md compares them)")
    k.add_argument("--kernels", type=_parse_kernels, default=None, metavar="SPEC",
                   help="auto (default: the fastest measured on this device), jnp, pallas, or part=impl pairs, e.g. "
                        "'indexer=pallas-fp8,decode=pallas'; parts: " + ", ".join(KERNEL_PARTS))  # fmt: skip
    k.add_argument("--keep-quantized", action="store_true",
                   help="keep a checkpoint's FP8 / FP4 weights quantized on the devices; with the Pallas MoE (a GPU's "
                        "default), FP8 experts in 128x128 blocks run on the FP8 kernels (W8A8)")
    k.add_argument("--fp4-experts", default="auto", choices=["auto", "fp4", "fp8"],
                   help="FP4 routed experts on the W8A8 kernels: fp8 re-blocks them once, at start-up (twice the "
                        "experts' FP4 memory, no per-step pass); fp4 keeps them as stored and re-blocks them in each "
                        "step; auto (default) fp8 where the device has the room, else fp4")  # fmt: skip
    r = p.add_argument_group("presets", "random weights for a preset model (tiny, v4-flash, v4-pro)")
    r.add_argument("--layer-types", type=_parse_layer_types, default=None, metavar="TYPES",
                   help="replace the preset's layers: one per entry of sliding / csa / hca, each with routed MoE "
                        "(e.g. sliding,csa,hca: the 3-layer benchmark model of docs/BENCHMARKS.md)")  # fmt: skip
    r.add_argument("--random-weights", default=None, choices=["bf16", "fp8", "fp8-fp4-experts"],
                   help="make the random weights on the devices (each its own slice), in this format: fp8 and "
                        "fp8-fp4-experts as V4 releases them, kept quantized (default: drawn on the host, unquantized)")


LAYER_TYPE_NAMES = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
                    "hca": "heavily_compressed_attention"}  # fmt: skip


def _parse_layer_types(text: str) -> tuple[str, ...]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    full = set(LAYER_TYPE_NAMES.values())
    bad = [t for t in names if t not in LAYER_TYPE_NAMES and t not in full]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of sliding, csa, hca")
    return tuple(LAYER_TYPE_NAMES.get(t, t) for t in names)


def _model_config(args):
    """The config the engine will run: the checkpoint's or preset's, with --layer-types applied to a preset."""
    cfg = _config_of(args.model)
    types = getattr(args, "layer_types", None)
    if types or getattr(args, "random_weights", None):
        if os.path.isdir(args.model):
            raise UserError(f"--layer-types / --random-weights make random weights for a preset; {args.model} is a "
                            "checkpoint directory")  # fmt: skip
    if types:
        cfg = cfg.replace(num_hidden_layers=len(types), layer_types=types, mlp_layer_types=("moe",) * len(types))
    return cfg


KERNEL_PARTS = ("attention", "decode", "indexer", "paged_indexer", "topk_refine", "moe", "dense", "kv_write",
                "sinkhorn", "q_norm", "csa")


def _parse_kernels(text: str):
    from dsv4.kernels import Kernels

    try:
        return Kernels.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _make_llm(args, *, max_slots: int, max_model_len: int):
    mesh = None
    if args.devices != 1:
        import jax

        from dsv4.sharding import make_mesh

        if not 1 <= args.devices <= len(jax.devices()):
            raise ValueError(f"--devices {args.devices}: this machine has {len(jax.devices())} device(s) "
                             f"({jax.devices()[0].platform})")  # fmt: skip
        mesh = make_mesh(args.devices)

    check_memory(args, max_slots=args.max_slots or max_slots, max_model_len=args.max_model_len or max_model_len)
    try:
        return _new_llm(args, max_slots=max_slots, max_model_len=max_model_len, mesh=mesh)
    except (ValueError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 -- an unreadable checkpoint: orbax / tensorstore errors of every kind
        if not os.path.isdir(args.model):
            raise
        raise UserError(f"--model {args.model}: reading the checkpoint failed (a corrupt or truncated file?): "
                        f"{type(e).__name__}: {_one_line(e)}") from e


def _new_llm(args, *, max_slots: int, max_model_len: int, mesh):
    from dsv4.engine import LLM

    model = args.model
    if getattr(args, "layer_types", None) or getattr(args, "random_weights", None):
        import jax.numpy as jnp

        from dsv4.random_weights import random_model

        dtype = args.dtype or ("float32" if args.model == "tiny" else "bfloat16")
        model = random_model(_model_config(args), args.seed, dtype=jnp.dtype(dtype), kernels=args.kernels,
                             weights=args.random_weights or "bf16", mesh=mesh)  # fmt: skip
    return LLM(model, max_slots=args.max_slots or max_slots, max_model_len=args.max_model_len or max_model_len,
               chunk_size=args.chunk_size, mixed_chunk_size=args.mixed_chunk_size,
               max_num_batched_tokens=args.max_num_batched_tokens, policy=args.policy,
               kv_format=args.kv_format, seed=args.seed, dtype=args.dtype, width_buckets=args.buckets,
               max_packed_width=args.max_packed_width, chat_template=not args.no_chat_template, kernels=args.kernels,
               keep_quantized=args.keep_quantized, mesh=mesh, warmup=False,
               decode_steps=args.decode_steps, fp4_experts=args.fp4_experts)  # fmt: skip


def _max_position_embeddings(model: str) -> int:
    return _config_of(model).max_position_embeddings


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(args, *, max_slots: int, max_model_len: int) -> None:
    """Before any weight is loaded: refuses (UserError) a model whose memory plan (`dsv4.memory_plan`) does not fit
    the devices (their memory as jax reports it) or, where the weights pass through the host (random weights of a
    preset, or a CPU backend), the host's available RAM (/proc/meminfo). Says what to change."""
    import jax

    from dsv4.memory_plan import GIB, default_chunk_size, plan_memory, suggestions

    cfg = _model_config(args)
    dtype = args.dtype or ("float32" if args.model == "tiny" else "bfloat16")
    weights = "fp8" if args.keep_quantized and cfg.quantization_config else "bf16"
    made_on_devices = getattr(args, "random_weights", None)
    if made_on_devices:
        weights = {"fp8-fp4-experts": "fp4-experts"}.get(made_on_devices, made_on_devices)
    weights = _planned_weights(weights, getattr(args, "fp4_experts", "fp4"))
    kv = args.kv_format if args.kv_format in ("bf16", "fp8-tensor", "fp8-channel", "fp8-tile", "fp8-tile-e8m0") else \
        "bf16"  # fmt: skip
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    host = _meminfo_bytes("MemAvailable")
    on_host = device.platform == "cpu"
    capacity = limit or (host if on_host else None)
    context = min(max_model_len, cfg.max_position_embeddings)
    # With no --chunk-size the short default: the engine takes the long one only where the device has the room.
    chunk = args.chunk_size or default_chunk_size(context, args.devices)
    plan = plan_memory(cfg, context=context, devices=args.devices, kv_format=kv, weights=weights,
                       chunk_size=min(chunk, context), device_memory_gib=(capacity or GIB) / GIB)  # fmt: skip
    scale = (4 if dtype == "float32" else 2) / 2  # the plan counts 2-byte weights and activations
    needed = plan.required_bytes * scale + plan.more_slots_bytes(max_slots)
    where = "host RAM available (MemAvailable)" if on_host and not limit else f"{device.platform} device memory"
    if capacity is not None and needed > capacity:
        hints = "; ".join(suggestions(plan)[:2]) or "a smaller --max-model-len or --max-slots"
        raise UserError(f"--model {args.model}: needs about {needed / GIB:.1f} GiB per device ({dtype} weights, "
                        f"{max_slots} slot(s) of {context} tokens), but this machine has {capacity / GIB:.1f} GiB of "
                        f"{where}. Change: {hints}; or use a machine with more memory (dsv4 plan shows the "
                        "ledger)")  # fmt: skip
    if not os.path.isdir(args.model) and not made_on_devices and not on_host and host is not None:
        weight_bytes = sum(line.bytes_per_device for line in plan.lines if line.name.startswith("weights")) * \
            args.devices * scale  # fmt: skip
        if weight_bytes > host:
            raise UserError(f"--model {args.model}: random weights are built in host memory, about "
                            f"{weight_bytes / GIB:.1f} GiB, but {host / GIB:.1f} GiB is available; use a checkpoint "
                            "directory (streamed to the devices) or a smaller preset")  # fmt: skip


# ----- generate ------------------------------------------------------------------------------------------


def cmd_generate(args) -> int:
    import numpy as np

    from dsv4.generate import SamplingParams

    t0 = time.perf_counter()
    config = _config_of(args.model)
    limit = config.max_position_embeddings
    if args.token_ids is not None:
        prompt: list[int] | str = args.token_ids
        bad = [t for t in prompt if t >= config.vocab_size]
        if bad:
            raise UserError(f"--token-ids: token id {bad[0]} is out of range [0, {config.vocab_size})")
        prompt_len = len(prompt)
    elif args.prompt is not None:
        from dsv4.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model) if os.path.isdir(args.model) else None
        if tokenizer is None:
            raise UserError(f"--prompt needs a tokenizer, and {args.model} has no tokenizer.json: use --token-ids")
        prompt = tokenizer.encode(args.prompt, chat_template=not args.no_chat_template)
        prompt_len = len(prompt)
    else:
        prompt_len = args.prompt_len or 4096
        prompt = None  # drawn once the vocabulary is known
    wanted_len = min(prompt_len + args.max_new_tokens, limit)
    llm = _make_llm(args, max_slots=1, max_model_len=max(wanted_len, 2))
    load_s = time.perf_counter() - t0
    cfg = llm.config
    if prompt is None:
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, prompt_len).tolist()
    ids = llm.encode(prompt)
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, loaded in {load_s:.1f} s",
          file=sys.stderr)  # fmt: skip
    print(f"prompt: {len(ids)} tokens; generating up to {args.max_new_tokens}", file=sys.stderr)
    compile_s = llm.warmup(prompt_lens=[len(ids)]) if len(ids) + args.max_new_tokens <= llm.max_model_len else 0.0
    print(f"compiled in {compile_s:.1f} s", file=sys.stderr)

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    stop = tuple(cfg.eos_token_ids) if args.stop_at_eos else ()
    request_id = llm.add_request(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, stop_token_ids=stop)
    show_progress = len(ids) > llm.chunk_size
    tty = sys.stderr.isatty()
    output = None
    while output is None:
        events = llm.step()
        progress = llm.progress(request_id)
        if show_progress and progress is not None and not events:
            done, total = progress
            print(f"{'\r' if tty else ''}prefill {done}/{total} tokens", end="" if tty else "\n", file=sys.stderr,
                  flush=True)  # fmt: skip
        for event in events:
            if show_progress:
                show_progress = False
                print(f"{'\r' if tty else ''}prefill {len(ids)}/{len(ids)} tokens", file=sys.stderr, flush=True)
            if not args.json:
                print(event.token_id, end=" " if event.finish_reason is None else "\n", flush=True)
            if event.output is not None:
                output = event.output
    metrics = output.metrics
    if output.finish_reason == "error":
        raise RuntimeError(output.error)
    compile_s += metrics.compile_s  # any shape the warm-up did not cover: not in TTFT either
    summary = {
        "prompt_tokens": len(ids), "generated_tokens": output.num_tokens, "token_ids": output.token_ids,
        "finish_reason": output.finish_reason, "ttft_s": round(metrics.ttft_s, 4), "compile_s": round(compile_s, 3),
        "tpot_s": None if metrics.tpot_s is None else round(metrics.tpot_s, 4),
        "prefill_tokens_per_s": round(len(ids) / metrics.ttft_s, 1),
    }  # fmt: skip
    if output.text is not None:
        summary["text"] = output.text
    if args.json:
        print(json.dumps(summary))
    else:
        if output.text is not None:
            print(output.text)
        print(f"TTFT {metrics.ttft_s * 1e3:.1f} ms for {len(ids)} prompt tokens "
              f"({summary['prefill_tokens_per_s']:.0f} tokens/s); compile {compile_s:.1f} s, not counted")  # fmt: skip
        if metrics.tpot_s is not None:
            print(f"TPOT {metrics.tpot_s * 1e3:.1f} ms (mean of {output.num_tokens - 1} steps, cached decode)")
    return 0


# ----- bench ---------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else None


def run_ttft_bench(llm, *, length: int, concurrency: int, max_new_tokens: int, seed: int) -> dict:
    """`concurrency` synthetic prompts of `length` tokens submitted at once; latency percentiles (seconds)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, llm.config.vocab_size, length).tolist() for _ in range(concurrency)]
    t0 = time.perf_counter()
    compile_before = llm.runner.compile_s
    outputs = llm.generate(prompts, max_new_tokens=max_new_tokens)
    wall = time.perf_counter() - t0
    compile_s = llm.runner.compile_s - compile_before
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise ValueError(errors[0])
    ttft = [o.metrics.ttft_s for o in outputs]
    tpot = [o.metrics.tpot_s for o in outputs if o.metrics.tpot_s is not None]
    itl = [gap for o in outputs for gap in o.metrics.itl_s]
    generated = sum(o.num_tokens for o in outputs)
    row = {
        "length": length,
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "wall_s": wall,
        "compile_s": compile_s,
        "output_tokens_per_s": generated / wall,
        "prefill_tokens_per_s": length * concurrency / max(ttft),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        row[f"{name}_p50_s"], row[f"{name}_p99_s"] = percentile(values, 50), percentile(values, 99)
    return row


def format_latency_table(rows: list[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.1f}"

    header = (f"{'length':>8} {'conc':>4} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT p50':>9} {'TPOT p99':>9} "
              f"{'ITL p50':>9} {'ITL p99':>9} {'out tok/s':>9} {'prefill tok/s':>13} {'compile s':>9}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['length']:>8} {r['concurrency']:>4} {ms(r['ttft_p50_s']):>10} {ms(r['ttft_p99_s']):>10} "
            f"{ms(r['tpot_p50_s']):>9} {ms(r['tpot_p99_s']):>9} {ms(r['itl_p50_s']):>9} "
            f"{ms(r['itl_p99_s']):>9} {r['output_tokens_per_s']:>9.1f} {r['prefill_tokens_per_s']:>13.0f} "
            f"{r.get('compile_s', 0.0):>9.1f}"
        )
    return "\n".join(lines) + ("\n(latencies in ms; p50 / p99 over requests, ITL over every gap between tokens; "
                                "compile s: one-time compilation in the measured run, left out of TTFT)")


def cmd_bench_ttft(args) -> int:
    limit = _max_position_embeddings(args.model)
    longest = max(args.lengths) + args.max_new_tokens
    if longest > limit:
        raise UserError(f"length {max(args.lengths)} + {args.max_new_tokens} new tokens exceeds the model's "
                         f"max_position_embeddings={limit}")  # fmt: skip
    t0 = time.perf_counter()
    llm = _make_llm(args, max_slots=max(args.concurrency), max_model_len=longest)
    print(f"model {args.model} loaded in {time.perf_counter() - t0:.1f} s; engine: {llm.runner.max_slots} slots of "
          f"{llm.max_model_len} tokens, chunk {llm.chunk_size}", file=sys.stderr)  # fmt: skip
    rows = []
    for length in args.lengths:
        for concurrency in args.concurrency:
            kwargs = dict(length=length, concurrency=concurrency, max_new_tokens=args.max_new_tokens, seed=args.seed)
            if not args.no_warmup:  # same shapes, not measured: compilation stays out of the numbers
                compile_before = llm.runner.compile_s
                run_ttft_bench(llm, **kwargs)
                print(f"warm-up length {length} × {concurrency}: compiled for "
                      f"{llm.runner.compile_s - compile_before:.1f} s", file=sys.stderr)  # fmt: skip
            rows.append(run_ttft_bench(llm, **kwargs))
            if rows[-1]["compile_s"] > 0:
                print(f"length {length} × {concurrency}: {rows[-1]['compile_s']:.1f} s of compilation during the "
                      "measured run (TTFT leaves it out)", file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps({"model": args.model, "chunk_size": llm.chunk_size, "max_slots": llm.runner.max_slots,
                          "rows": rows}))  # fmt: skip
    else:
        print(format_latency_table(rows))
    return 0


# ----- plan ----------------------------------------------------------------------------------------------


def _planned_weights(weights: str, fp4_experts: str) -> str:
    """The memory plan's weight format for a run: FP4 experts re-blocked once at build (`--fp4-experts fp8`) are held
    as FP8 experts are, and need no per-step re-blocking buffer; "auto" needs at least the FP4 form."""
    return "fp8" if weights == "fp4-experts" and fp4_experts == "fp8" else weights


def cmd_plan(args) -> int:
    from dsv4.memory_plan import format_plan, plan_memory, plan_to_dict

    cfg = _config_of(args.model)

    def plan_for(weights):
        return plan_memory(cfg, context=args.context, devices=args.devices, kv_format=args.kv_format, weights=weights,
                           chunk_size=args.chunk_size, device=args.device, device_memory_gib=args.device_memory_gib,
                           headroom=args.headroom)  # fmt: skip

    plan = plan_for(_planned_weights(args.weights, args.fp4_experts))
    if args.weights == "fp4-experts" and args.fp4_experts == "auto" and plan_for("fp8").fits:
        plan = plan_for("fp8")  # what the engine's "auto" does where the FP8 form fits (LLM.fp4_experts)
    print(json.dumps(plan_to_dict(plan)) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


# ----- info ----------------------------------------------------------------------------------------------


def cmd_info(args) -> int:

    cfg = _config_of(args.model)
    print(json.dumps(cfg.to_hf(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dsv4",
        description="dsv4: DeepSeek-V4 inference in JAX, built for long-prompt time to first token.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--verbose", action="store_true",
                        help="on an error, show the whole traceback (also accepted after the command)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate", help="prefill one prompt, stream the generated tokens, print TTFT",
        description="Prefill one prompt (random tokens unless --token-ids or --prompt is given) in chunks, "
                    "stream the generated token ids to stdout as they come, then print the time to first token "
                    "(TTFT) and time per output token (TPOT). Compilation happens first and is reported apart. "
                    "A prompt longer than one chunk shows 'prefill N/M tokens' progress on stderr.",
        epilog="examples:\n  dsv4 generate --model tiny --prompt-len 32k --max-new-tokens 8\n"
               "  dsv4 generate --model /ckpt --token-ids 1,2,3 --max-new-tokens 16 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _add_model_args(g)
    prompt = g.add_argument_group("prompt (at most one of)").add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-len",
        type=parse_count,
        default=None,
        help="length of a random synthetic prompt, e.g. 4096 or 32k (default 4096)",
    )
    prompt.add_argument("--token-ids", type=token_ids, default=None, help="comma-separated prompt token ids")
    prompt.add_argument("--prompt", default=None, help="prompt text (needs tokenizer.json in the checkpoint)")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=positive_int, default=8, help="tokens to generate (default 8)")
    s.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=probability, default=1.0,
                   help="keep the smallest set reaching this probability")  # fmt: skip
    s.add_argument("--stop-at-eos", action="store_true", help="stop at the config's eos_token_id")
    g.add_argument("--json", action="store_true", help="print one JSON summary line instead of text")
    _add_engine_args(g, slots_default="1")
    g.set_defaults(func=cmd_generate)  # fmt: skip

    b = sub.add_parser("bench", help="benchmarks (bench ttft, bench serve)",
                       description="Serving benchmarks on synthetic prompts.")  # fmt: skip
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bsub.add_parser(
        "ttft", help="TTFT / TPOT / ITL percentiles over prompt lengths × concurrency",
        description="For each prompt length and concurrency: submit that many random prompts at once, generate "
                    "--max-new-tokens each, and report p50 / p99 of TTFT (arrival → first token), TPOT (time per "
                    "output token after the first) and ITL (every gap between two tokens), plus throughput. Each "
                    "case runs once unmeasured first, so compilation stays out of the numbers.",
        epilog="example:\n  dsv4 bench ttft --model tiny --lengths 1024,4096 --concurrency 1,4 --max-new-tokens 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _add_model_args(t)
    t.add_argument("--lengths", type=parse_counts, default=[1024, 4096], help="prompt lengths (default 1024,4096)")
    t.add_argument("--concurrency", type=parse_counts, default=[1, 4], help="requests at once (default 1,4)")
    t.add_argument("--max-new-tokens", type=positive_int, default=8, help="tokens generated per request (default 8)")
    t.add_argument("--no-warmup", action="store_true", help="skip the unmeasured first run (numbers include compiles)")
    t.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _add_engine_args(t, slots_default="the largest concurrency")
    t.set_defaults(func=cmd_bench_ttft)

    from dsv4.memory_plan import DEFAULT_DEVICE, DEVICE_MIB, KV_FORMATS, WEIGHT_FORMATS

    p = sub.add_parser(
        "plan", help="per-device memory ledger for one long prompt; refuses a plan that does not fit",
        description="Adds up, per device, what one prompt of --context tokens needs as the engine lays it out on "
                    "--devices: weights (routed experts split over the devices, the rest replicated), the whole KV "
                    "cache replicated on every device as dsv4.cache.layout lays it out (compressed entries, every "
                    "layer's ring and open windows, FP8 scale state), one layer's all-gathered K=V rows of a chunk, "
                    "one chunk's activations (its tokens split over the devices) and the MoE exchange buffers; then "
                    "applies 1.2x headroom. Exits 1 if it does not fit the device, naming the changes that would make "
                    "it fit.",
        epilog="examples:\n  dsv4 plan --model v4-flash --context 512k --devices 8 --weights fp8\n"
               "  dsv4 plan --model v4-pro --context 512k --devices 8 --device h200 --weights fp4-experts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--model", default="v4-flash", help="a preset or a checkpoint directory (default v4-flash)")
    p.add_argument(
        "--context", type=parse_count, default=524288, help="prompt tokens, e.g. 524288 or 512k (default 512k)"
    )
    p.add_argument("--devices", type=positive_int, default=8,
                   help="devices (GPUs) the model is spread over (default 8)")  # fmt: skip
    p.add_argument(
        "--kv-format", default="fp8-channel", choices=KV_FORMATS,
        help="KV cache storage (dsv4.cache.layout formats; fp8 = fp8-channel; default fp8-channel)",
    )  # fmt: skip
    p.add_argument(
        "--weights", "--weights-dtype", dest="weights", default="bf16", choices=WEIGHT_FORMATS,
        help="weight storage (default bf16; fp8 = e4m3 with 128x128 block scales as released; fp4-experts = "
             "that with e2m1 routed experts, one scale per 32 columns)",
    )  # fmt: skip
    p.add_argument(
        "--fp4-experts", default="auto", choices=["auto", "fp4", "fp8"],
        help="with --weights fp4-experts, how the engine will hold them (as its --fp4-experts): fp4 as stored, fp8 "
             "re-blocked once at build (sized as --weights fp8), auto (default) fp8 where that fits, else fp4",
    )  # fmt: skip
    p.add_argument(
        "--device", default=DEFAULT_DEVICE, choices=sorted(DEVICE_MIB),
        help="device preset: its memory as the driver reports it (h20 95.6 GiB, h100/h800 79.6, h200 140.4; "
             f"default {DEFAULT_DEVICE}, the seed article's)",
    )  # fmt: skip
    p.add_argument(
        "--device-memory-gib", type=float, default=None, help="memory of one device in GiB (overrides --device)"
    )
    p.add_argument("--chunk-size", type=parse_count, default=8192,
                   help="prefill chunk (default 8192, the seed article's; the engine's own default is 16384 a device)")
    p.add_argument("--headroom", type=float, default=1.2, help="plan for this multiple of the peak (default 1.2)")
    p.add_argument("--json", action="store_true", help="print the ledger as one JSON object")
    p.set_defaults(func=cmd_plan)  # fmt: skip

    c = sub.add_parser("convert", help="convert a checkpoint (safetensors, FP8/FP4 too) to orbax",
                       description="Convert a checkpoint directory (safetensors in DeepSeek's or transformers' layout, "
                                   "plain or FP8/FP4) to a sharded orbax checkpoint + config.json, which dsv4.load / "
                                   "--model read onto any mesh.")  # fmt: skip
    c.add_argument("src", help="checkpoint directory to read")
    c.add_argument("dst", help="directory to write (must not hold a checkpoint yet)")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the stored weights (default bfloat16; norms and similar stay float32)")
    c.add_argument("--keep-quantized", action="store_true", help="store FP8/FP4 weights as they are, with their scales")
    c.add_argument("--devices", type=positive_int, default=1,
                   help="spread the model over this many local devices while converting (default 1)")
    c.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("info", help="print the resolved config of a preset or checkpoint")
    i.add_argument("--model", default="tiny", help="a preset or a checkpoint directory (default tiny)")
    i.set_defaults(func=cmd_info)
    from dsv4.serve import add_commands  # argparse only: aiohttp and JAX load when `serve` runs

    add_commands(sub, bsub, engine_args=_add_engine_args, make_llm=_make_llm)
    return parser


def cmd_convert(args) -> int:
    import jax.numpy as jnp

    from dsv4.api import convert
    from dsv4.sharding import make_mesh

    mesh = make_mesh(args.devices) if args.devices > 1 else None
    convert(args.src, args.dst, dtype=jnp.dtype(args.dtype), keep_quantized=args.keep_quantized, mesh=mesh,
            progress=not args.no_progress)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the command. A user error is one line on stderr and exit 2; any other failure one line and exit 1
    (`--verbose`: the traceback); Ctrl-C exit 130; a closed stdout pipe (`dsv4 info | head`) exit 0, quietly."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if verbose:
            raise
        print("dsv4: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing, and keep Python from complaining when it flushes stdout.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # noqa: BLE001 -- one line for a person; --verbose for the traceback
        if verbose:
            raise
        user = isinstance(e, (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError))
        message = _one_line(e) if user else f"{type(e).__name__}: {_one_line(e)} (--verbose shows the traceback)"
        print(f"dsv4: error: {message}", file=sys.stderr)
        return 2 if user else 1


def _one_line(error: BaseException) -> str:
    """The error's message on one line (the first non-empty line, at most 500 characters)."""
    text = str(error).strip() or type(error).__name__
    first = next((line.strip() for line in text.splitlines() if line.strip()), text)
    more = " ..." if first != text.replace("\n", " ").strip() and len(text.splitlines()) > 1 else ""
    return (first[:500] + ("..." if len(first) > 500 else "")) + more


if __name__ == "__main__":
    sys.exit(main())
