"""Routed experts of one V4-Flash MoE layer: the Triton grouped GEMMs against the Mosaic GPU ones, side by side.

    PYTHONPATH=. python3 scripts/bench_moe.py --out $OUT/moe                 # one H200 (~3 min)
    PYTHONPATH=. python3 scripts/bench_moe.py --smoke                        # CPU: tiny shapes, Mosaic interpreter
    PYTHONPATH=. python3 scripts/bench_moe.py --tokens 16k --modes w8a8 --no-triton --mosaic-trace $OUT/trace
                                                          # + each kernel's phases per item (Mosaic's trace)

Shapes and routing are scripts/bench_kernels.py's MoE section's: D = 4096, I = 2048, E = 256 (`--experts`), top-6,
the shared expert excluded; random weights (bf16, and DeepSeek's fp8 with 128 × 128 block scales for w8a8); expert
popularity ∝ (rank + 1)^-0.3 (`--zipf`). Per token count (`--tokens`, default 8k,64k) and mode (`--modes` bf16,w8a8):

    e2e      `moe.routed_experts(impl=...)` end to end: sort / layout, gather, both GEMMs, quantize (w8a8), combine
    gate_up  the gate_up kernel alone, on inputs already in its layout (Triton: sorted rows; Mosaic: padded rows)
    down     the down kernel alone, likewise (Mosaic: y stored in bf16, as `routed_experts` has it); the Mosaic
             rows also give the time of a K step of a CTA, the same work in both kernels
    gather   Mosaic, default variant: the row gather in front of gate_up (`moe_mgpu.gather_rows`, rows moved as
             uint32 words), and `gather_el` the same gather as XLA runs it on the elements; bytes moved a second

Useful FLOPs = 2 · 3 · D · I · N · top-k for e2e (gate_up: 2/3 of it, down: 1/3), the same for every row.
"% mm" is against the same rounds' matmul of that precision through XLA (bf16: `a @ b`; w8a8: e4m3 × e4m3 → f32,
which XLA may run as a Triton GEMM), at 16384³; w8a8 rows also give "% lt", against the e4m3 dot compiled with Triton
GEMMs off, so that it is cuBLASLt's FP8 matmul (the compiled call is checked). The ceilings are rows of the rounds,
first in each. Per token count and mode, every row's function is called once (compile, warm-up, the outputs compared
below), then timed in `--reps` interleaved rounds (each round calls every row once, synchronized, in the rows'
order), so no variant is favoured by when it ran (run one after another, the first variant ran up to 11% slower than
the same configuration timed later); each row gives its median. The first call of each Mosaic e2e row is compared
with the Triton e2e output of the same mode (relative L2; both dropless, independent code paths).

Mosaic variants (`--variants`, applied to every mode): `name:sl=3,form=per_step,ctas=132,acc8=promote` (num_slots,
acc_form, num_ctas, fp8_acc of `MgpuMoeConfig`). The first variant is the default config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

if "--smoke" in sys.argv:
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import Rounds, make_routing, parse_lengths, quantize_weight_blocks, randn  # noqa: E402

import dsv4.pallas.moe as pm  # noqa: E402
import dsv4.pallas.moe_mgpu as mm  # noqa: E402
from dsv4.pallas._device import sm_count  # noqa: E402

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
KEYS = {"sl": ("num_slots", int), "form": ("acc_form", str), "ctas": ("num_ctas", int), "acc8": ("fp8_acc", str)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=None, help="token counts (default 8k,64k; smoke 40)")
    p.add_argument("--modes", default="bf16,w8a8")
    p.add_argument("--variants", default="default", help="Mosaic variants, ';'-separated name:key=value,...")
    p.add_argument("--experts", type=int, default=256,
                   help="routed experts E (default V4-Flash's 256; E / n is what one of n expert-parallel devices "
                        "holds); tokens pick top-6 of them")  # fmt: skip
    p.add_argument("--zipf", type=float, default=0.3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-triton", action="store_true", help="skip the Triton rows")
    p.add_argument("--no-parts", action="store_true", help="skip the per-kernel rows")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, the Mosaic interpreter, Triton interpreted")
    p.add_argument("--out", default=None, help="folder for moe.json")
    p.add_argument("--mosaic-trace", default=None, metavar="DIR",
                   help="after each variant's part rows, run its gate_up and down once more with Mosaic GPU's trace "
                        "on (MgpuMoeConfig.profile_dir = DIR/<tokens>_<mode>_<variant>_<part>) and print each "
                        "phase's median per item (GPU only)")  # fmt: skip
    a = p.parse_args()
    a.tokens = parse_lengths(a.tokens or ("40" if a.smoke else "8k,64k"))
    a.modes = [m for m in a.modes.split(",") if m]
    a.variants = [parse_variant(v) for v in a.variants.split(";") if v]
    return a


def parse_variant(text: str):
    name, _, rest = text.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        field, cast = KEYS[key]
        kw[field] = cast(value)
    return name, kw


CEILING_N = 16384
CUBLASLT_FP8 = "__cublas$lt$matmul$f8"


def matmul_ceilings(mode: str):
    """The matmul ceilings of a mode at CEILING_N³, as (name, call) pairs for the same interleaved rounds as the
    kernels: bf16 through XLA; for w8a8 the e4m3 dot (f32 out) through XLA's default (which may pick a Triton GEMM)
    and through cuBLASLt alone (Triton GEMMs off; the compiled call must be a `__cublas$lt$matmul$f8`)."""
    n = CEILING_N
    k1, k2 = jax.random.split(jax.random.key(7))
    a, b = randn(k1, (n, n), BF16), randn(k2, (n, n), BF16)
    if mode == "bf16":
        fn = jax.jit(lambda a, b: a @ b)
        return [("xla", lambda: fn(a, b))]
    a, b = a.astype(FP8), b.astype(FP8)
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32))
    lt = fn.lower(a, b).compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    if CUBLASLT_FP8 not in lt.as_text():
        raise RuntimeError(f"the cuBLAS-only FP8 dot did not compile to {CUBLASLT_FP8}")
    return [("xla", lambda: fn(a, b)), ("cublaslt", lambda: lt(a, b))]


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    args = parse_args()
    smoke = args.smoke
    d, i, e, k = (256, 128, 4, 2) if smoke else (4096, 2048, args.experts, 6)
    limit = 10.0
    interp_t = True if smoke else False
    interp_m = None
    if smoke:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interp_m = InterpretGPUParams()
    rows, log = [], []

    def say(text):
        print(text, flush=True)
        log.append(text)

    dev = jax.devices()[0]
    say(f"device {dev.device_kind}, jax {jax.__version__}, D={d} I={i} E={e} top-{k}, zipf {args.zipf}, "
        f"tokens {args.tokens}, modes {args.modes}, variants {args.variants}")  # fmt: skip
    ceil = {}  # (tokens, mode) → {"xla": TF/s, "cublaslt": TF/s}, timed in that group's rounds
    k1, k2 = jax.random.split(jax.random.key(777))
    weights = {"bf16": dict(gate_up=(randn(k1, (e, 2 * i, d), F32) * d**-0.5).astype(BF16),
                            down=(randn(k2, (e, d, i), F32) * i**-0.5).astype(BF16))}  # fmt: skip
    if "w8a8" in args.modes:
        gu8, gus = quantize_weight_blocks(weights["bf16"]["gate_up"])
        dn8, dns = quantize_weight_blocks(weights["bf16"]["down"])
        weights["w8a8"] = dict(gate_up=gu8, down=dn8, gate_up_scales=gus, down_scales=dns)

    def record(n, mode, impl, variant, part, ms, flops, note=""):
        tf = flops / (ms * 1e-3) / 1e12
        c = ceil.get((n, mode), {})
        pct = 100 * tf / c["xla"] if "xla" in c else float("nan")
        pct_lt = 100 * tf / c["cublaslt"] if "cublaslt" in c else None
        rows.append(dict(tokens=n, mode=mode, impl=impl, variant=variant, part=part, ms=ms, tflops=tf, pct_mm=pct,
                         pct_cublaslt=pct_lt, note=note))  # fmt: skip
        lt = f" {pct_lt:5.1f}% lt" if pct_lt is not None else ""
        say(f"{n:>7} {mode:5} {impl:6} {variant:10} {part:8} {ms:9.3f} ms {tf:7.1f} TF/s {pct:5.1f}% mm{lt}  {note}")

    def record_ceiling(n, mode, name, ms):
        tf = 2.0 * CEILING_N**3 / (ms * 1e-3) / 1e12
        ceil.setdefault((n, mode), {})[name] = tf
        say(f"{n:>7} {mode:5} matmul {name:10} {CEILING_N}^3 {ms:9.3f} ms {tf:7.1f} TF/s (ceiling, same rounds)")

    for n in args.tokens:
        kx, kr = jax.random.split(jax.random.key(1000 + n))
        x = randn(kx, (n, d), BF16)
        ids, w = make_routing(kr, tokens=n, experts=e, k=k, zipf=args.zipf)
        counts = np.asarray(jnp.bincount(ids.reshape(-1), length=e))
        say(f"N={n}: pairs/expert mean {n * k / e:.0f}, max {counts.max()}, min {counts.min()}")
        flops = 2.0 * 3 * d * i * n * k
        for mode in args.modes:
            wts = weights[mode]
            base = None
            rounds = Rounds()
            if not smoke:  # first in each round, so their medians are recorded before the rows that use them
                for name, call in matmul_ceilings(mode):
                    rounds.add(call, lambda ms, n=n, mode=mode, name=name: record_ceiling(n, mode, name, ms))
            if not args.no_triton:
                try:
                    fn = jax.jit(lambda x, ids, w, wts: pm.routed_experts(x, ids, w, **wts, limit=limit, impl="triton",
                                                                          interpret=interp_t))  # fmt: skip
                    base = rounds.add(lambda fn=fn: fn(x, ids, w, wts),
                                      lambda ms: record(n, mode, "triton", "default", "e2e", ms, flops))
                    if not args.no_parts:
                        triton_parts(n, mode, x, ids, wts, limit, interp_t, rounds, flops, record)
                except Exception:
                    say(f"ERROR triton {mode} N={n}:\n{traceback.format_exc()}")
            for vname, vkw in args.variants:
                config = mm.MgpuMoeConfig(**vkw)
                try:
                    fn = jax.jit(lambda x, ids, w, wts, config=config: mm.routed_experts_mgpu(
                        x, ids, w, wts["gate_up"], wts["down"], limit, gate_up_scales=wts.get("gate_up_scales"),
                        down_scales=wts.get("down_scales"), config=config, interpret=interp_m))  # fmt: skip
                    notes = []
                    out = rounds.add(lambda fn=fn: fn(x, ids, w, wts),
                                     lambda ms, vname=vname, notes=notes: record(n, mode, "mgpu", vname, "e2e", ms,
                                                                                 flops, notes[0]))  # fmt: skip
                    note = "" if base is None else f"rel L2 vs triton {rel_l2(out, base):.2e}"
                    notes.append(note + (" NaN!" if bool(jnp.isnan(out).any()) else ""))
                    if not args.no_parts:
                        trace = args.mosaic_trace and not smoke and Path(args.mosaic_trace) / f"{n}_{mode}_{vname}"
                        mgpu_parts(n, mode, x, ids, wts, limit, config, interp_m, rounds, flops, record, vname,
                                   trace=trace, say=say)  # fmt: skip
                except Exception:
                    say(f"ERROR mgpu {vname} {mode} N={n}:\n{traceback.format_exc()}")
            try:
                rounds.run(args.reps)
            except Exception:
                say(f"ERROR timing {mode} N={n}:\n{traceback.format_exc()}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        ceilings = [dict(tokens=n, mode=mode, n=CEILING_N, **rates) for (n, mode), rates in ceil.items()]
        (out / "moe.json").write_text(json.dumps(dict(device=dev.device_kind, jax=jax.__version__, ceilings=ceilings,
                                                      rows=rows, log=log), indent=1))  # fmt: skip


def triton_parts(n, mode, x, ids, wts, limit, interpret, rounds, flops, record):
    """The Triton kernels alone on sorted rows (W8A8: quantized x and h, as routed_experts passes them)."""
    e = wts["gate_up"].shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // ids.shape[1]]
    kw, hkw = {}, {}
    if mode == "w8a8":
        xs, sc = pm.quantize_per_token_group(xs)
        kw = dict(x_scales=sc, gate_up_scales=wts["gate_up_scales"])
    gu = jax.jit(lambda xs, g, sizes, kw: pm.grouped_gate_up(xs, g, sizes, limit=limit, interpret=interpret, **kw))
    h = rounds.add(lambda: gu(xs, wts["gate_up"], sizes, kw),
                   lambda ms: record(n, mode, "triton", "default", "gate_up", ms, flops * 2 / 3))
    if mode == "w8a8":
        h, hs = pm.quantize_per_token_group(h)
        hkw = dict(h_scales=hs, down_scales=wts["down_scales"])
    dn = jax.jit(lambda h, dw, sizes, kw: pm.grouped_down(h, dw, sizes, out_dtype=F32, interpret=interpret, **kw))
    rounds.add(lambda: dn(h, wts["down"], sizes, hkw), lambda ms: record(n, mode, "triton", "default", "down", ms,
                                                                          flops / 3))  # fmt: skip


def mgpu_parts(n, mode, x, ids, wts, limit, config, interpret, rounds, flops, record, vname, trace=None,
               say=print):  # fmt: skip
    """The Mosaic kernels alone on padded rows; with `trace` (a folder prefix), each once more with Mosaic's trace
    on, summarized by `trace_phases`."""
    e = wts["gate_up"].shape[0]
    src, _, tiles = mm.padded_layout(ids.reshape(-1), e)
    xp = x[src // ids.shape[1]]
    kw, hkw = {}, {}
    if mode == "w8a8":  # as routed_experts_mgpu: gate_up quantizes h in its epilogue
        xp, sc = pm.quantize_per_token_group(xp)
        kw = dict(x_scales=sc, gate_up_scales=wts["gate_up_scales"])

    def gate_up(cfg):  # the kernel entries are jitted already (config static)
        return mm.grouped_gate_up_mgpu(xp, wts["gate_up"], tiles, limit=limit, quantize_out=mode == "w8a8", config=cfg,
                                       interpret=interpret, **kw)  # fmt: skip

    def down(cfg):  # y in bf16, as routed_experts_mgpu stores it
        return mm.grouped_down_mgpu(h, wts["down"], tiles, config=cfg, interpret=interpret, out_dtype=jnp.bfloat16,
                                    **hkw)  # fmt: skip

    # A K step of a CTA: the kernel's time over each CTA's share of (used tiles' items × K steps). Both kernels do
    # the same work a step (128 rows × 256 weight rows × 128 bytes of K), so the two are directly comparable.
    used, d, i = int((tiles >= 0).sum()), xp.shape[1], wts["down"].shape[2]
    bk = 128 // jnp.dtype(xp.dtype).itemsize

    def per_step(ms, n_tiles, k):
        items = used * n_tiles
        ctas = min(config.num_ctas or sm_count(), items)
        return f"K step {ms * 1e3 * ctas / items / (k // bk):.2f} µs a CTA"

    if vname == "default":  # the row gather in front of gate_up, as routed_experts_mgpu runs it and elementwise
        xq = x if mode == "bf16" else pm.quantize_per_token_group(x)[0]
        rows_idx = src // ids.shape[1]
        moved = 2 * rows_idx.shape[0] * d * jnp.dtype(xq.dtype).itemsize  # bytes read and written
        for name, fn in (("gather", jax.jit(mm.gather_rows)), ("gather_el", jax.jit(lambda a, r: a[r]))):
            rounds.add(lambda fn=fn: fn(xq, rows_idx),
                       lambda ms, name=name: record(n, mode, "mgpu", vname, name, ms, 0.0,
                                                   f"{moved / (ms * 1e-3) / 1e12:.2f} TB/s moved"))  # fmt: skip
    h = rounds.add(lambda: gate_up(config), lambda ms: record(n, mode, "mgpu", vname, "gate_up", ms, flops * 2 / 3,
                                                               per_step(ms, i // mm.PART_N, d)))  # fmt: skip
    if mode == "w8a8":
        h, hs = h
        hkw = dict(h_scales=hs, down_scales=wts["down_scales"])
    rounds.add(lambda: down(config), lambda ms: record(n, mode, "mgpu", vname, "down", ms, flops / 3,
                                                       per_step(ms, d // (2 * mm.PART_N), i)))  # fmt: skip
    if not trace:
        return
    for part, run in (("gate_up", gate_up), ("down", down)):
        folder = Path(f"{trace}_{part}")
        folder.mkdir(parents=True, exist_ok=True)
        try:
            jax.block_until_ready(run(dataclasses.replace(config, profile_dir=str(folder))))
            jax.effects_barrier()  # the trace is written by a host callback
            files = sorted(folder.glob("*-trace.json"))
            phases = trace_phases(json.loads(files[-1].read_text()))
            say(f"  trace {n} {mode} {vname} {part}: " + "; ".join(
                f"{role} {name} {v['median_us']:.2f} µs × {v['count']}" for (role, name), v in sorted(phases.items())))
        except Exception:
            say(f"ERROR trace {n} {mode} {vname} {part}:\n{traceback.format_exc()}")


def trace_phases(trace: dict, warpgroups: int = 3) -> dict:
    """Mosaic GPU trace (Perfetto JSON: B/E events, ts in µs, tid = 1 + warpgroup + warpgroups · block) → {(role,
    name): {"median_us", "count"}} over every range of every CTA; role "consumer" for warpgroups below the last,
    "producer" for the last (the kernel's layout)."""
    open_at, spans = {}, {}
    for ev in trace["traceEvents"]:
        wg = (ev["tid"] - 1) % warpgroups
        role = "producer" if wg == warpgroups - 1 else "consumer"
        key = (ev["tid"], ev["name"])
        if ev["ph"] == "B":
            open_at[key] = ev["ts"]
        elif key in open_at:
            spans.setdefault((role, ev["name"]), []).append(ev["ts"] - open_at.pop(key))
    return {k: {"median_us": statistics.median(v), "count": len(v)} for k, v in spans.items()}


if __name__ == "__main__":
    main()
