#!/usr/bin/env python3
"""Sequence-parallel prefill of one prompt on a mesh of every device of every process (jax.distributed).

Start one copy per process (per host, or per GPU), all with the same coordinator:

    python scripts/launch.py --coordinator host0:1234 --num-processes 2 --process-id 0 --model DIR --prompt-len 131072
    python scripts/launch.py --coordinator host0:1234 --num-processes 2 --process-id 1 --model DIR --prompt-len 131072

On one machine without GPUs, `--cpu-devices 4` fakes host devices (how CI tests this). A checkpoint is streamed
onto the mesh (each device receives only its slice: the routed experts split, the rest replicated), so no single
device ever holds the whole model; with `--keep-quantized` its FP8 / FP4 weights stay quantized. Process 0 prints
the TTFT and a checksum of the last position's logits; `--save-logits FILE` writes them (.npy).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", help="host:port of process 0 (default $DSV4_COORDINATOR or auto-detect)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--cpu-devices", type=int, default=None, help="fake this many CPU devices per process")
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--token-ids-file", help=".npy of prompt ids [S] or [B, S] instead of a random prompt")
    p.add_argument("--attention", default="auto", choices=["auto", "sp", "sp-pallas"],
                   help="the sequence-parallel attention core: sp (jnp per shard, ring-passed entries), sp-pallas "
                        "(the Pallas kernels per shard), auto: sp-pallas on GPUs, sp elsewhere")
    p.add_argument("--moe-impl", default="auto", choices=["auto", "jnp", "pallas"],
                   help="routed experts (default auto: the Pallas grouped GEMMs on GPUs, expert-parallel over the "
                        "mesh; XLA elsewhere)")
    p.add_argument("--indexer-impl", default="auto", choices=["auto", "jnp", "pallas", "pallas-fp8"],
                   help="lightning indexer (default auto: the two-pass Pallas indexer on GPUs)")
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep a checkpoint's FP8 / FP4 weights quantized (FP8 experts then run W8A8 and their tokens "
                        "travel in FP8; needs --moe-impl pallas or auto on GPUs)")
    p.add_argument("--order", default="zigzag", choices=["zigzag", "contiguous"],
                   help="token order over the sequence shards (zigzag balances the causal work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-logits", help="process 0 writes the last position's logits here (.npy)")
    args = p.parse_args(argv)

    from dsv4 import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id, cpu_devices=args.cpu_devices)

    import dataclasses
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import dsv4
    from dsv4.sharding import SEQUENCE_PARALLEL, make_mesh, shard_model, use_mesh

    dtype = jnp.dtype(args.dtype)
    mesh = make_mesh()
    attention = args.attention
    if attention == "auto":
        attention = "sp-pallas" if jax.default_backend() == "gpu" else "sp"
    rules = dataclasses.replace(SEQUENCE_PARALLEL, seq_order=args.order)
    kernels = dsv4.Kernels(attention=attention, moe=args.moe_impl, indexer=args.indexer_impl)
    if os.path.isdir(args.model):  # streamed: each device reads and receives only its slice of each tensor
        model = dsv4.load(args.model, dtype=dtype, mesh=mesh, shardings=SEQUENCE_PARALLEL,
                          keep_quantized=args.keep_quantized, kernels=kernels)  # fmt: skip
    else:
        if args.keep_quantized:
            p.error(f"--keep-quantized: {args.model!r} is a preset (random weights); give a checkpoint directory")
        model = dsv4.init_random(args.model, args.seed, dtype=dtype, kernels=kernels)
        shard_model(model, mesh)
    if args.token_ids_file:
        ids = np.load(args.token_ids_file)
    else:
        ids = np.random.default_rng(args.seed).integers(0, model.config.vocab_size, (1, args.prompt_len))
    ids = np.atleast_2d(ids).astype(np.int32)
    with use_mesh(mesh, rules):
        model.logits(ids).block_until_ready()  # compile
        start = time.perf_counter()
        logits = model.logits(ids)
        logits.block_until_ready()
        ttft = time.perf_counter() - start
    last = np.asarray(multihost_utils.process_allgather(logits[:, -1], tiled=True))
    if jax.process_index() == 0:
        print(f"{jax.process_count()} processes, {len(jax.devices())} devices, attention {attention}, "
              f"experts {model.kernels.moe}, "
              f"order {args.order}, prompt {ids.shape}: "
              f"prefill {ttft * 1e3:.1f} ms; logits checksum {float(np.abs(last).sum()):.6f}")  # fmt: skip
        if args.save_logits:
            np.save(args.save_logits, last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
