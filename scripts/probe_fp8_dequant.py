"""Probe for #6's FP8 decode (docs/KERNEL_NOTES.md, the queue): can one warpgroup dequantize e4m3 KV tiles straight
from GMEM into the bf16, 128-byte-swizzled SMEM tiles the decode kernel's wgmmas read, and how fast?

Each CTA (one warpgroup) walks `--tiles` [64, D] e4m3 tiles with one float32 scale per row and 64-channel tile
(the decode benchmark's FP8 page format): per 64-column block it loads the e4m3 values from GMEM in the WGMMA
layout, multiplies by the row's scale, rounds to bf16 and stores into a swizzled SMEM tile; the last tile goes back
to GMEM (so the work is not dead) and is checked against a jnp reference.

    PYTHONPATH=. python3 scripts/probe_fp8_dequant.py --mode lower      # CPU: lowers for an abstract H200
    PYTHONPATH=. python3 scripts/probe_fp8_dequant.py --mode interpret  # CPU: Mosaic interpreter, exact check
    PYTHONPATH=. python3 scripts/probe_fp8_dequant.py --mode time       # GPU: GB/s of e4m3 read, against a copy

Also (sixteenth session's queue item 2, #6's remaining road) two SMEM → SMEM forms, timed in `--mode time`:
- `staged_call`: e4m3 tiles by TMA into SMEM, converted to f16 SMEM tiles (a f16 wgmma operand);
- `transpose_call`: e4m3 tiles by TMA into SMEM, transposed into [D, 64] e4m3 tiles (an e4m3 P·V wgmma's V).

The rate to compare: the decode kernel's 64-row step takes ≈ 2.8 µs (DC12); an FP8 tile of 64 × 512 is 32 KiB, so
one producer warpgroup per SM has to dequantize ≥ 32 KiB / 2.8 µs ≈ 11.7 GB/s, i.e. ≈ 1.5 TB/s over 132 SMs, to
keep up, and 70% of copy (≈ 3 TB/s) to reach #6's bar.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

ROWS, TILE = 64, 64


def dequant_call(x, scales, *, interpret=None):
    """x [N, 64, D] e4m3, scales [N, 64, D // 64] f32 → the last tile of each CTA's walk, dequantized, [G, 64, D]
    bf16 (grid G = N // tiles_per_cta, set by the caller through x's leading shape [G, T, 64, D])."""
    g, t, rows, d = x.shape

    def kernel(x_ref, s_ref, o_ref, smem):
        cta = jax.lax.axis_index("cta")

        @pl.loop(0, t)
        def _(i):
            for c in range(d // TILE):
                v = plgpu.load(x_ref.at[cta, i, :, pl.ds(c * TILE, TILE)], layout=plgpu.Layout.WGMMA, optimized=False)
                sc = plgpu.load(s_ref.at[cta, i, :, c], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                y = v.astype(jnp.float32) * jax.lax.broadcast_in_dim(sc, (rows, TILE), [0])
                smem.at[:, pl.ds(c * TILE, TILE)][...] = y.astype(jnp.bfloat16)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_ref.at[cta])
        plgpu.wait_smem_to_gmem(0)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kw = {} if interpret is None else dict(interpret=interpret)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((g, rows, d), jnp.bfloat16),
                        scratch_types=[plgpu.SMEM((rows, d), jnp.bfloat16, transforms=swizzled)],
                        grid=(g,), grid_names=("cta",), num_threads=1, thread_name="wg", **kw)(x, scales)  # fmt: skip


STAGED_FORMS = ("tma_only", "infer", "WGMMA", "WGMMA_UPCAST_2X")


def _walk_tiles(x, dst, slots, on_tile, interpret):
    """One CTA per x[cta] ([G, T, 64, D] e4m3) walks its T tiles through `slots` 128-byte-swizzled SMEM slots by
    TMA, `slots - 1` ahead: on_tile(i, slot, stage, dst) once tile i has landed (its slot is refilled in iteration
    i + 1, after it returns). Then the SMEM buffer `dst` (a plgpu.SMEM) goes out: → [G, *dst.shape]."""
    g, t, rows, d = x.shape

    def kernel(x_ref, o_ref, stage, dst_ref, bars):
        cta = jax.lax.axis_index("cta")
        for k in range(min(slots - 1, t)):
            plgpu.copy_gmem_to_smem(x_ref.at[cta, k], stage.at[k], bars.at[k])

        @pl.loop(0, t)
        def _(i):
            ahead = i + slots - 1  # its slot's tile was handled in iteration i - 1: free

            @pl.when(ahead < t)
            def _():
                plgpu.copy_gmem_to_smem(x_ref.at[cta, ahead], stage.at[ahead % slots], bars.at[ahead % slots])

            plgpu.barrier_wait(bars.at[i % slots])
            on_tile(i, i % slots, stage, dst_ref)

        plgpu.copy_smem_to_gmem(dst_ref, o_ref.at[cta])
        plgpu.wait_smem_to_gmem(0)

    kw = {} if interpret is None else dict(interpret=interpret)
    sw8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((g, *dst.shape), dst.dtype),
                        scratch_types=[plgpu.SMEM((slots, rows, d), jnp.float8_e4m3fn, transforms=sw8), dst,
                                       plgpu.Barrier(num_barriers=slots)],
                        grid=(g,), grid_names=("cta",), num_threads=1, thread_name="wg", **kw)(x)  # fmt: skip


def staged_call(x, *, form="infer", slots=2, interpret=None):
    """x [G, T, 64, D] e4m3 → [G, 64, D] f16, the last tile of each CTA's walk. Each CTA streams its T tiles through
    `slots` 128-byte-swizzled e4m3 SMEM slots by TMA (tiles i + 1 .. i + slots - 1 load while tile i converts) and
    converts each into a 128-byte-swizzled f16 SMEM tile (the layout a f16 wgmma reads), 128 columns at a time,
    registers in `form`'s layout ("infer": Mosaic's choice; "tma_only": no conversion, the loads alone). f16, not
    bf16: e4m3 → f16 is one instruction for two values on Hopper (e4m3 ⊂ f16, exact); Mosaic refuses e4m3 → bf16
    without an f32 step. The scales are left out (the decode kernel's FP8 form multiplies them in here, DC17)."""
    t, rows, d = x.shape[1:]

    def convert(slot, stage, dst):
        for c in range(d // 128):
            src = stage.at[slot, :, pl.ds(c * 128, 128)]
            v = src[...] if form in ("infer", "tma_only") else plgpu.load(src, layout=getattr(plgpu.Layout, form))
            dst.at[:, pl.ds(c * 128, 128)][...] = v.astype(jnp.float16)
        plgpu.commit_smem()

    def on_tile(i, slot, stage, dst):
        if form != "tma_only":
            convert(slot, stage, dst)
        else:  # keep the loads live: the last tile converted once

            @pl.when(i == t - 1)
            def _():
                convert(slot, stage, dst)

    sw16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return _walk_tiles(x, plgpu.SMEM((rows, d), jnp.float16, transforms=sw16), slots, on_tile, interpret)


def transpose_call(x, *, slots=3, interpret=None):
    """x [G, T, 64, D] e4m3 → [G, D, 64] e4m3, the last tile of each CTA's walk transposed: the V operand an e4m3
    P·V wgmma needs (keys contiguous: fp8 wgmma takes no transposed operands). As `staged_call`, but each tile is
    loaded from SMEM 128 columns at a time in the 8-bit WGMMA layout and stored through a transposed view into a
    64-byte-swizzled [D, 64] tile (Mosaic has no 8-bit ldmatrix / stmatrix .trans before Blackwell). Exact in the
    CPU interpreter; jax 0.11.2 does not compile it for Hopper (docs/BENCHMARKS.md, "FP8 pages: the SMEM → SMEM
    forms")."""
    rows, d = x.shape[2:]

    def on_tile(i, slot, stage, dst):
        for c in range(d // 128):
            v = plgpu.load(stage.at[slot, :, pl.ds(c * 128, 128)], layout=plgpu.Layout.WGMMA_8BIT)
            dst.at[pl.ds(c * 128, 128), :].transpose((1, 0))[...] = v
        plgpu.commit_smem()

    sw64 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    return _walk_tiles(x, plgpu.SMEM((d, rows), jnp.float8_e4m3fn, transforms=sw64), slots, on_tile, interpret)


def _patch_arch_query():
    """jax 0.11.2's Mosaic asks for the architecture from an insertion point outside any module when it plans an
    8-bit transfer through a transposed SMEM view, and fails ("Cannot retrieve the architecture: no module found",
    on an H200 too: the seventeenth session's call 7). For this probe only: fall back to the device's own
    architecture, as Mosaic itself does when there is no insertion point at all."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    if getattr(mgpu_utils.get_arch, "_probe_patched", False):
        return
    original = mgpu_utils.get_arch

    def get_arch():
        try:
            return original()
        except ValueError:
            return mgpu_utils.Arch(*mgpu_utils._infer_arch())

    get_arch._probe_patched = True
    mgpu_utils.get_arch = get_arch


def reference(x, scales):
    last = x[:, -1].astype(jnp.float32) * jnp.repeat(scales[:, -1], TILE, axis=-1)
    return last.astype(jnp.bfloat16)


def inputs(g, t, d, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((g, t, ROWS, d)) * 8, jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (g, t, ROWS, d // TILE)), jnp.float32)
    return x, scales


def median_s(fn, iters):
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("lower", "interpret", "time"), default="lower")
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--tiles", type=int, default=64, help="tiles per CTA (time mode)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if args.mode == "lower":
        from gpu_mesh import abstract_gpu_mesh

        x = jax.ShapeDtypeStruct((args.ctas, 2, ROWS, args.dim), jnp.float8_e4m3fn)
        s = jax.ShapeDtypeStruct((args.ctas, 2, ROWS, args.dim // TILE), jnp.float32)
        with abstract_gpu_mesh():
            text = jax.jit(dequant_call).trace(x, s).lower(lowering_platforms=("cuda",)).as_text()
            print("GMEM form lowered for an abstract H200:", "mosaic_gpu" in text)
            for form in STAGED_FORMS:
                f = jax.jit(functools.partial(staged_call, form=form))
                text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
                print(f"staged form {form} lowered for an abstract H200:", "mosaic_gpu" in text)
        return
    if args.mode == "interpret":
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        x, s = inputs(2, 2, 128)
        out = dequant_call(x, s, interpret=InterpretGPUParams())
        diff = float(jnp.abs(out.astype(jnp.float32) - reference(x, s).astype(jnp.float32)).max())
        print(f"interpreter: GMEM form, max abs difference against the reference {diff:.3g}")
        x3, _ = inputs(2, 3, 256)
        out = transpose_call(x3, interpret=InterpretGPUParams())
        d = float(jnp.abs(out.astype(jnp.float32) - jnp.swapaxes(x3[:, -1], 1, 2).astype(jnp.float32)).max())
        print(f"interpreter: transposed form, max abs difference against the input {d:.3g}")
        diff = max(diff, d)
        for form, slots in [(f, 2) for f in STAGED_FORMS] + [("infer", 3)]:
            out = staged_call(x3, form=form, slots=slots, interpret=InterpretGPUParams())
            d = float(jnp.abs(out.astype(jnp.float32) - x3[:, -1].astype(jnp.float32)).max())
            print(f"interpreter: staged form {form}, {slots} slots, max abs difference against the input {d:.3g}")
            diff = max(diff, d)
        sys.exit(0 if diff == 0 else 1)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    x, s = inputs(args.ctas, args.tiles, args.dim)
    f = jax.jit(dequant_call)
    out = f(x, s)
    diff = float(jnp.abs(out.astype(jnp.float32) - reference(x, s).astype(jnp.float32)).max())
    t = median_s(lambda: f(x, s), args.iters)
    read = x.size + s.size * 4
    copy_src = jnp.zeros((1 << 30,), jnp.uint32)
    cp = jax.jit(lambda a: a ^ 1)
    t_copy = median_s(lambda: cp(copy_src), args.iters)
    copy_rate = 2 * copy_src.size * 4 / t_copy
    print(f"{args.ctas} CTAs x {args.tiles} tiles of {ROWS} x {args.dim} e4m3: {t * 1e6:.1f} us, "
          f"{read / t / 1e9:.1f} GB/s read ({read / t / copy_rate:.1%} of the same-run copy, "
          f"{copy_rate / 1e12:.2f} TB/s); {t * 1e6 / args.tiles:.2f} us a tile per CTA; "
          f"max diff {diff:.3g}")  # fmt: skip
    rate_at_70 = 0.7 * copy_rate / args.ctas  # bytes a second one SM must stream for #6's bar
    print(f"| form | us | GB/s of e4m3 | % of copy | us a tile per CTA | max diff |  (70% of copy: "
          f"{x[0, 0].size / rate_at_70 * 1e6:.2f} us a tile)")  # fmt: skip
    for slots in (3, 4):  # first: the step a GPU might refuse to compile (see _patch_arch_query)
        _patch_arch_query()
        try:
            ft = jax.jit(functools.partial(transpose_call, slots=slots))
            out = ft(x)
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            print(f"| transposed, {slots} slots | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
            break
        d = float(jnp.abs(out.astype(jnp.float32) - jnp.swapaxes(x[:, -1], 1, 2).astype(jnp.float32)).max())
        ts = median_s(lambda: ft(x), args.iters)
        print(f"| transposed, {slots} slots | {ts * 1e6:.1f} | {x.size / ts / 1e9:.0f} | "
              f"{x.size / ts / copy_rate:.1%} | {ts * 1e6 / args.tiles:.2f} | {d:.3g} |", flush=True)  # fmt: skip
    for form, slots in [(f, n) for n in (2, 3, 4) for f in STAGED_FORMS if n == 2 or f in ("tma_only", "infer")]:
        fs = jax.jit(functools.partial(staged_call, form=form, slots=slots))
        out = fs(x)
        d = float(jnp.abs(out.astype(jnp.float32) - x[:, -1].astype(jnp.float32)).max())
        ts = median_s(lambda: fs(x), args.iters)
        print(f"| staged {form}, {slots} slots | {ts * 1e6:.1f} | {x.size / ts / 1e9:.0f} | "
              f"{x.size / ts / copy_rate:.1%} | {ts * 1e6 / args.tiles:.2f} | {d:.3g} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
