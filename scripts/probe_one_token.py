"""One-token chunks (a decode step over a dense cache): the Triton kernel against the Mosaic prefill kernel.

`core_attention_pallas` sends one-token steps to the Triton kernel on Hopper unless `dsv4.attention.MOSAIC_ONE_TOKEN`
is set; the Mosaic kernel runs them correctly (`test_gpu_with_a_halo_before_q`, S = 1 after a full 128-row prefix).
This times both on the layout `Attention.forward_chunk` passes: kv rows [0, W) the W positions before the token, row
W its own, HCA entries for a context of L tokens (results: docs/BENCHMARKS.md, "One-token chunks").

    PYTHONPATH=. python3 scripts/probe_one_token.py [--contexts 32768,524288] [--batches 1,32]

Each timing is the median over --iters runs of one jit that calls the kernel 8 times on 8 different queries (as a
model step calls its layers), divided by 8. Prints a table: µs per call, Mosaic's speed-up over Triton, max abs
difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.pallas.attention import v4_attention
from dsv4.pallas.attention_mgpu import v4_attention_mgpu

W, H, D, RATE, CALLS = 128, 64, 512, 128, 8


def inputs(batch, context, hca, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q8 = jax.random.normal(ks[0], (CALLS, batch, 1, H, D), jnp.bfloat16)
    kv = jax.random.normal(ks[1], (batch, W + 1, D), jnp.bfloat16)
    sinks = jax.random.normal(ks[2], (H,), jnp.float32)
    pos = context - 1
    q_pos = jnp.full((batch, 1), pos, jnp.int32)
    kv_pos = jnp.broadcast_to(jnp.arange(pos - W, pos + 1, dtype=jnp.int32), (batch, W + 1))
    comp = jax.random.normal(ks[3], (batch, context // RATE, D), jnp.bfloat16) if hca else None
    return q8, kv, sinks, q_pos, kv_pos, comp


def runners(q8, kv, sinks, q_pos, kv_pos, comp):
    kw = dict(sliding_window=W, scale=D**-0.5, compressed=comp, compress_rate=RATE if comp is not None else None)

    def triton(q):
        return v4_attention(q, kv, q_pos, kv_pos, sinks, **kw)

    def mosaic(q):
        return v4_attention_mgpu(q, kv, q_pos, sinks, kv_offset=W, check_positions=False, **kw)

    return {name: jax.jit(lambda q8, f=f: jax.lax.map(f, q8)) for name, f in (("triton", triton), ("mosaic", mosaic))}


def median_us(fn, q8, iters):
    jax.block_until_ready(fn(q8))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(q8))
        times.append(time.perf_counter() - t)
    return statistics.median(times) / CALLS * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="32768,524288")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    print(f"{'layer':6} {'context':>8} {'B':>3} {'triton us':>10} {'mosaic us':>10} {'mosaic speed-up':>15} "
          f"{'max diff':>9}")  # fmt: skip
    for hca in (False, True):
        for context in (int(x) for x in args.contexts.split(",")):
            if not hca and context != int(args.contexts.split(",")[0]):
                continue  # a window layer's work does not depend on the context
            for batch in (int(x) for x in args.batches.split(",")):
                data = inputs(batch, context, hca)
                fns = runners(*data)
                outs = {k: np.asarray(f(data[0]), np.float32) for k, f in fns.items()}
                diff = float(np.abs(outs["mosaic"] - outs["triton"]).max())
                t = {k: median_us(f, data[0], args.iters) for k, f in fns.items()}
                print(f"{'HCA' if hca else 'window':6} {context:8d} {batch:3d} {t['triton']:10.1f} {t['mosaic']:10.1f} "
                      f"{t['triton'] / t['mosaic']:14.2f}x {diff:9.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
