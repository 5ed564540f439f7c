"""The `dsv4` command.

    dsv4 generate --model tiny --prompt-len 4096 --max-new-tokens 8
    dsv4 generate --model /path/to/checkpoint --token-ids 1,2,3 --max-new-tokens 16
    dsv4 info --model v4-flash
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="a preset (tiny, v4-flash, v4-pro: random weights) or a checkpoint directory (default: tiny)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weights and activations (default: float32 for tiny, bfloat16 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and synthetic prompts")  # fmt: skip


def _load_model(args):
    import jax.numpy as jnp

    import dsv4

    dtype = args.dtype or ("float32" if args.model == "tiny" else "bfloat16")
    if os.path.isdir(args.model):
        return dsv4.load(args.model, dtype=jnp.dtype(dtype))
    return dsv4.init_random(args.model, args.seed, dtype=jnp.dtype(dtype))


def cmd_generate(args) -> int:
    import numpy as np

    from dsv4.generate import SamplingParams, generate

    t0 = time.perf_counter()
    model = _load_model(args)
    load_s = time.perf_counter() - t0
    cfg = model.config
    if args.token_ids:
        prompt = [int(t) for t in args.token_ids.split(",") if t.strip()]
    else:
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    stop = tuple(cfg.eos_token_ids) if args.stop_at_eos else ()
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, loaded in {load_s:.1f} s",
          file=sys.stderr)  # fmt: skip
    print(f"prompt: {len(prompt)} tokens; generating up to {args.max_new_tokens}", file=sys.stderr)
    tokens = []

    def on_token(t):
        tokens.append(t)
        if not args.json:
            print(t, end=" " if len(tokens) < args.max_new_tokens else "\n", flush=True)

    result = generate(model, prompt, args.max_new_tokens, sampling, stop_token_ids=stop, on_token=on_token)
    if tokens and len(tokens) < args.max_new_tokens and not args.json:
        print()
    summary = {
        "prompt_tokens": len(prompt), "generated_tokens": len(result.token_ids), "token_ids": result.token_ids,
        "ttft_s": round(result.ttft_s, 4), "compile_s": round(result.compile_s, 2),
        "tpot_s": None if not result.step_s else round(result.tpot_s, 4),
        "prefill_tokens_per_s": round(len(prompt) / result.ttft_s, 1),
    }  # fmt: skip
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"TTFT {result.ttft_s * 1e3:.1f} ms for {len(prompt)} prompt tokens "
              f"({summary['prefill_tokens_per_s']:.0f} tokens/s; compile {result.compile_s:.1f} s, not counted)")
        if result.step_s:
            print(f"TPOT {result.tpot_s * 1e3:.1f} ms (median of {len(result.step_s)}; no KV cache yet: "
                  "each step re-runs the sequence)")  # fmt: skip
    return 0


def cmd_info(args) -> int:
    from dsv4.config import Config

    cfg = Config.from_hf(args.model) if os.path.isdir(args.model) else Config.preset(args.model)
    print(json.dumps(cfg.to_hf(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4",
        description="dsv4: DeepSeek-V4 inference in JAX, built for long-prompt time to first token.",
        epilog="Examples:\n  dsv4 generate --model tiny --prompt-len 4096 --max-new-tokens 8\n"
               "  dsv4 info --model v4-flash",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="prefill a prompt, generate tokens, print TTFT",
                       description="Prefill a prompt (synthetic random tokens unless --token-ids is given), "
                                   "generate tokens and report time to first token.")  # fmt: skip
    _add_model_args(g)
    g.add_argument("--prompt-len", type=int, default=4096, help="synthetic prompt length (default 4096)")
    g.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of a synthetic one")
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop-at-eos", action="store_true", help="stop at the config's eos_token_id")
    g.add_argument("--json", action="store_true", help="print one JSON summary line instead of text")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="print the resolved config of a preset or checkpoint")
    i.add_argument("--model", default="tiny")
    i.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv4: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
