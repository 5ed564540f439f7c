#!/usr/bin/env python3
"""The engine on a mesh of every device of every process (jax.distributed): chunked prefill, then generated tokens.

Start one copy per process (per host, or per GPU), all with the same coordinator:

    python scripts/launch.py --coordinator host0:1234 --num-processes 2 --process-id 0 --model DIR --prompt-len 131072
    python scripts/launch.py --coordinator host0:1234 --num-processes 2 --process-id 1 --model DIR --prompt-len 131072

Requests enter at process 0 (a prompt file, token ids or a random prompt) and are broadcast; then every process
runs the same `dsv4.LLM` steps (SPMD: the scheduler is deterministic given the same requests, and the logits it
samples from are replicated, so every process samples the same tokens with the same seeded generator). A
checkpoint is streamed onto the mesh, each device reading only its slice. Process 0 prints the tokens, TTFT and
TPOT; `--save-tokens FILE` writes them as JSON. A peer that dies makes the others fail within about
`--heartbeat-timeout` seconds instead of hanging. On one machine without GPUs, `--cpu-devices 4` fakes host
devices (how CI tests this).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", help="host:port of process 0 (default $DSV4_COORDINATOR or auto-detect)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--cpu-devices", type=int, default=None, help="fake this many CPU devices per process")
    p.add_argument("--heartbeat-timeout", type=int, default=30, help="seconds before a silent peer counts as dead")
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=4096, help="random prompt of this length (default 4096)")
    p.add_argument("--token-ids-file", help=".npy or .json of prompt ids: one prompt [S] or several [[...], ...]")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk (default the engine's: 16384 a device)")
    p.add_argument("--kv-format", default=None, help="cache storage: a dtype or a dsv4.cache.layout format")
    p.add_argument("--kernels", default=None, help="dsv4.Kernels spec (default: auto)")
    p.add_argument("--keep-quantized", action="store_true", help="keep a checkpoint's FP8 / FP4 weights quantized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-tokens", help="process 0 writes the generated tokens here (JSON)")
    args = p.parse_args(argv)

    from dsv4 import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id, cpu_devices=args.cpu_devices,
                           heartbeat_timeout_s=args.heartbeat_timeout)  # fmt: skip

    import jax
    import numpy as np

    import dsv4
    from dsv4.sharding import make_mesh

    print(f"joined: process {jax.process_index()} of {jax.process_count()}", flush=True)

    prompts = None
    if jax.process_index() == 0:
        if args.token_ids_file:
            if args.token_ids_file.endswith(".json"):
                with open(args.token_ids_file) as f:
                    loaded = json.load(f)
            else:
                loaded = np.load(args.token_ids_file).tolist()
            prompts = loaded if loaded and isinstance(loaded[0], list) else [loaded]
        else:
            vocab = dsv4.Config.preset(args.model).vocab_size if not args.model.startswith(("/", ".")) else None
            rng = np.random.default_rng(args.seed)
            prompts = [rng.integers(0, vocab or 1024, args.prompt_len).tolist()]
    prompts = distributed.broadcast_prompts(prompts)

    mesh = make_mesh()
    llm = dsv4.LLM(args.model, mesh=mesh, dtype=args.dtype, max_slots=len(prompts), chunk_size=args.chunk_size,
                   max_model_len=max(map(len, prompts)) + args.max_new_tokens, kv_format=args.kv_format,
                   kernels=args.kernels, keep_quantized=args.keep_quantized, seed=args.seed)  # fmt: skip
    compile_s = llm.warmup([len(p) for p in prompts], widths=[1])
    outputs = llm.generate(prompts, max_new_tokens=args.max_new_tokens)
    if jax.process_index() == 0:
        for o in outputs:
            m = o.metrics
            print(f"{jax.process_count()} processes, {len(jax.devices())} devices; "
                  f"prompt {len(o.prompt_token_ids)} tokens: "
                  f"TTFT {m.ttft_s * 1e3:.1f} ms, TPOT {(m.tpot_s or 0) * 1e3:.2f} ms (compile {compile_s:.1f} s, "
                  f"kernels {llm.model.kernels}); tokens {o.token_ids}")  # fmt: skip
        if args.save_tokens:
            with open(args.save_tokens, "w") as f:
                json.dump([o.token_ids for o in outputs], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
