"""V4's dense FP8 matrices shape by shape: the dequantized route against W8A8 on the stored values (the default on
Hopper), and both against the same shape's matmul ceilings, in interleaved rounds on one GPU.

    PYTHONPATH=. python3 scripts/bench_dense.py --out $OUT                 # one Hopper GPU (~2 min)
    PYTHONPATH=. python3 scripts/bench_dense.py --tokens 16k,32k --variants "default;promote:acc8=promote"
    PYTHONPATH=. python3 scripts/bench_dense.py --smoke                    # CPU: two small shapes, Mosaic interpreted

Why: which of V4's dense matrices W8A8 (`Kernels.dense="pallas"`, the default on Hopper) runs faster than the
dequantized route, and what the activations' quantization costs (docs/BENCHMARKS.md, "Dense layers in FP8"). The
matrices a release stores in FP8 outside the experts (`dsv4.weights.RELEASED_FP8`), at `Config.preset("v4-flash")`'s
widths, [N, K]: attention wq_a [1024, 4096], wq_b [32768, 1024], wkv [512, 4096], wo_b [4096, 8192]; the indexer's
wq_b [8192, 1024]; the shared expert's w1 / w3 [2048, 4096] and w2 [4096, 2048]. Then the GEMMs the model runs where
weights of one x are stacked (`dsv4.layers.project_shared`, prefill chunks): wq_a + wkv [1536, 4096] and w1 + w3
[4096, 4096] (timed as one matrix of that shape: the model's stacking copy of the weights is not in it). x is [M, K]
bf16, M = a prefill chunk's tokens.

Rows of one shape, each the median of --reps interleaved rounds:
    dequant   the dequantized route (`Kernels.dense="jnp"`): `BlockQuantized.dequantize()` to bf16 inside the step, then
              XLA's dot (`dsv4.layers.linear`'s einsum)
    bf16      the same dot on a weight already bf16: what that route would take if dequantization were free
    w8a8      `linear_w8a8`: x quantized per token and 128-group, then the Mosaic grouped `down` kernel with one
              group (one row per --variants entry, `MgpuMoeConfig` keys as in bench_moe.py)
    kernel    that kernel alone on x already quantized (w8a8 less the activation quantization)
    lt-fp8    ceiling: the e4m3 dot of the same [M, K] × [K, N] through cuBLASLt (f32 out, Triton GEMMs off)
The bf16 row is also the bf16 ceiling of the shape. TFLOP/s count 2·M·N·K; "% lt" is against the lt-fp8 row, "%
bf16" against the bf16 row. Before timing, each W8A8 row's output is compared with `linear_w8a8_reference` (relative
L2) and the dequant row's with the bf16 row's (the same weights, so equal up to the dot's rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_kernels import Rounds, parse_lengths, randn  # noqa: E402
from bench_moe import CUBLASLT_FP8, parse_variant, rel_l2  # noqa: E402

from dsv4.config import Config  # noqa: E402
from dsv4.layers import linear  # noqa: E402
from dsv4.pallas.linear_fp8 import linear_w8a8, linear_w8a8_reference, w8a8_gemm_mgpu  # noqa: E402
from dsv4.pallas.moe_common import quantize_per_token_group  # noqa: E402
from dsv4.pallas.moe_mgpu import MgpuMoeConfig  # noqa: E402
from dsv4.quantization import BlockQuantized  # noqa: E402
from dsv4.random_weights import quantize_fp8  # noqa: E402

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def dense_shapes(cfg: Config) -> list[tuple[str, int, int]]:
    """(name, N, K) of each dense matrix a V4 release stores in FP8, from the config's widths."""
    d, heads, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    inter = cfg.moe_intermediate_size
    return [("wq_a", cfg.q_lora_rank, d), ("wq_b", heads * hd, cfg.q_lora_rank), ("wkv", hd, d),
            ("wo_b", d, cfg.o_groups * cfg.o_lora_rank),
            ("indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            ("shared.w1|w3", inter, d), ("shared.w2", d, inter),
            ("stacked.wq_a+wkv", cfg.q_lora_rank + hd, d), ("stacked.w1+w3", 2 * inter, d)]  # fmt: skip


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=None, help="x rows M (default 16k; smoke 150: not a whole 128-row tile)")
    p.add_argument("--shapes", default=None, help="comma-separated names to keep (default every one)")
    p.add_argument("--variants", default="default", help="W8A8 kernel variants, ';'-separated name:key=value,...")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU: two small shapes, the Mosaic kernel interpreted")
    p.add_argument("--out", default=None, help="folder for dense.json")
    a = p.parse_args()
    a.tokens = parse_lengths(a.tokens or ("150" if a.smoke else "16k"))
    a.variants = [parse_variant(v) for v in a.variants.split(";") if v]
    return a


def main():
    args = parse_args()
    smoke = args.smoke
    on_gpu = jax.devices()[0].platform == "gpu"
    if not smoke and not on_gpu:
        sys.exit("bench_dense: needs a GPU (or --smoke)")
    shapes = dense_shapes(Config.preset("v4-flash"))
    if smoke:  # two of the roles at small shapes of whole 128 × 128 blocks (the interpreter is slow)
        shapes = [(name, 256 * (1 + i % 2), 128 * (1 + i % 3)) for i, (name, _, _) in enumerate(shapes)][:2]
    if args.shapes:
        keep = set(args.shapes.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    interp = dict(impl="mgpu", interpret=True) if smoke else {}  # smoke: the Mosaic kernel in its interpreter
    rows, log = [], []

    def say(text):
        print(text, flush=True)
        log.append(text)

    say(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, tokens {args.tokens}, reps {args.reps}, "
        f"variants {[v for v, _ in args.variants]}")  # fmt: skip
    say(f"{'M':>6} {'matrix':16} {'N':>6} {'K':>5} {'row':12} {'ms':>9} {'TF/s':>7} {'% lt':>6} {'% bf16':>6}  check")
    for m in args.tokens:
        for name, n, k in shapes:
            kx, kw = jax.random.split(jax.random.key(zlib.crc32(f"{m} {name}".encode())))
            x = randn(kx, (m, k), BF16)
            q, scale = quantize_fp8(randn(kw, (n, k), F32) * k**-0.5)
            stored = BlockQuantized(q, scale, "fp8", (128, 128), (n, k), "bfloat16")
            w16 = stored.dequantize()
            flops = 2.0 * m * n * k
            rounds, got = Rounds(), {}

            def add(row, fn, _got=got):  # → fn's first output; its median ms lands in got[row]
                return rounds.add(fn, lambda ms, row=row: _got.__setitem__(row, ms))

            dequant = jax.jit(lambda x, s: linear(x, s.dequantize()))
            bf16 = jax.jit(linear)
            ref16 = add("bf16", lambda: bf16(x, w16))
            checks = {"dequant": rel_l2(add("dequant", lambda: dequant(x, stored)), ref16)}
            want = linear_w8a8_reference(x, q, scale)
            for vname, vkw in args.variants:
                cfg_v = MgpuMoeConfig(**vkw)
                fn = jax.jit(lambda x, q, s, c=cfg_v: linear_w8a8(x, q, s, config=c, **interp))
                checks[f"w8a8 {vname}"] = rel_l2(add(f"w8a8 {vname}", lambda fn=fn: fn(x, q, scale)), want)
            if on_gpu:  # the kernel alone and the cuBLASLt ceiling: GPU only (the kernel is Hopper's Mosaic one)
                xq, xs = quantize_per_token_group(x)
                kern = jax.jit(lambda xq, xs, q, s: w8a8_gemm_mgpu(xq, xs, q, s, out_dtype=BF16))
                add("kernel", lambda: kern(xq, xs, q, scale))
                a8, b8 = x.astype(FP8), q.T
                lt = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32)).lower(a8, b8).compile(
                    compiler_options={"xla_gpu_enable_triton_gemm": False})  # fmt: skip
                if CUBLASLT_FP8 in lt.as_text():
                    add("lt-fp8", lambda: lt(a8, b8))
                else:
                    say(f"  {name}: the FP8 dot did not compile to {CUBLASLT_FP8}; no lt-fp8 row")
            rounds.run(2 if smoke else args.reps)
            tf = {row: flops / (ms * 1e-3) / 1e12 for row, ms in got.items()}
            for row, ms in got.items():
                pct_lt = 100 * tf[row] / tf["lt-fp8"] if "lt-fp8" in tf else float("nan")
                pct16 = 100 * tf[row] / tf["bf16"]
                check = f"rel L2 {checks[row]:.1e}" if row in checks else ""
                if row.startswith("w8a8"):
                    check += f"  {got['dequant'] / ms:.2f}x dequant"
                rows.append(dict(tokens=m, matrix=name, n=n, k=k, row=row, ms=ms, tflops=tf[row], pct_lt=pct_lt,
                                 pct_bf16=pct16, rel_l2=checks.get(row)))  # fmt: skip
                say(f"{m:>6} {name:16} {n:>6} {k:>5} {row:12} {ms:9.3f} {tf[row]:7.1f} {pct_lt:6.1f} {pct16:6.1f}  "
                    f"{check}")  # fmt: skip
            bad = {row: v for row, v in checks.items() if not v < 2e-2}
            if bad:
                say(f"  {name}: outputs off their references: {bad}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dense.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                                                        argv=sys.argv[1:], rows=rows, log=log), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
