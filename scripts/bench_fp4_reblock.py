"""FP4 experts re-blocked as FP8 (`dsv4.quantization.fp4_to_fp8_blocks`, what the MoE does each step for the W8A8
kernels) against dequantizing them to bf16 and against a copy kernel of the same shapes, one V4-Flash layer's experts.

    python3 scripts/bench_fp4_reblock.py [--experts 256] [--reps 10]

Random e2m1 codes and power-of-two scales (one per row and 32 columns) at [E, 2I, D] (gate_up) and [E, D, I] (down);
each form jitted, run once, then timed --reps times back to back; medians. "copy" reads an fp8 array of the output's
shape and writes one (plus a column of the inputs, so it cannot be folded away): the bandwidth this pass could reach.
GB/s counts what the re-blocking reads and writes (½ B a weight, its float32 scales, 1 B a weight out).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def median_s(fn, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from dsv4.quantization import BlockQuantized, fp4_to_fp8_blocks

    e, d, i = args.experts, args.hidden, args.intermediate
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; medians of {args.reps}")
    print(f"{'weight':>18} {'re-block ms':>11} {'GB/s':>6} {'bf16 dequant ms':>15} {'copy ms':>8}")
    reblock = jax.jit(lambda w: fp4_to_fp8_blocks(w).q)
    dequant = jax.jit(lambda w: w.dequantize())
    copy = jax.jit(lambda q, s, x: (x.view(jnp.uint8) + q[..., :1] + s[..., :1].astype(jnp.uint8)).view(x.dtype))
    for name, (rows, cols) in (("gate_up", (2 * i, d)), ("down", (d, i))):
        key = jax.random.key(0)
        q = jax.random.randint(key, (e, rows, cols // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        s = jnp.exp2(jax.random.randint(key, (e, rows, cols // 32), -12, 0).astype(jnp.float32))
        w = BlockQuantized(q, s, "fp4", (1, 32), (e, rows, cols), "bfloat16")
        x = jnp.zeros((e, rows, cols), jnp.float8_e4m3fn)
        t_re = median_s(reblock, w, reps=args.reps)
        t_bf = median_s(dequant, w, reps=args.reps)
        t_cp = median_s(copy, q, s, x, reps=args.reps)
        gb = (q.size + s.size * 4 + e * rows * cols) / 1e9
        label = f"{name} [{e},{rows},{cols}]"
        print(f"{label:>18} {t_re * 1e3:11.2f} {gb / t_re:6.0f} {t_bf * 1e3:15.2f} {t_cp * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
