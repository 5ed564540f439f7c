"""Probe: one warpgroup computes Oᵀ = Vᵀ · Pᵀ with Vᵀ built in registers from an e4m3 tile (`dsv4.pallas.mgpu_fp8`).

The decode kernel's `fp8_mma="regs"` mode rests on `vt_fragments`; this checks it alone on the GPU against numpy,
on random e4m3 bytes (NaN-free), random f16 scales and a random f16 P, and times the fragment build in a loop.

    PYTHONPATH=. python3 scripts/probe_fp8_pv.py            # on a Hopper GPU
    PYTHONPATH=. python3 scripts/probe_fp8_pv.py --lower    # CPU: lower for an abstract H200 only
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4.pallas.mgpu_fp8 import GROUPS, vt_fragments, vt_fragments_reference

CW = 128  # channels per chunk (the decode kernel's pv_chunks = 2 at D = 512)
NC = 2


def _tiled(minor, itemsize):
    return plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(minor * itemsize)


def probe(v8, scales, p, *, reps: int = 1):
    """v8 [64, 256] e4m3, scales [256] f16, p [64 heads, 64 keys] f16 → Oᵀ [256, 64] f32 (reps > 1: the build and
    products repeated, accumulating, for timing)."""

    def body(v_ref, s_ref, p_ref, out_ref, v_smem, s_smem, p_smem, o_smem, bar):
        for j in range(NC):
            plgpu.copy_gmem_to_smem(v_ref.at[:, pl.ds(j * CW, CW)], v_smem.at[j], bar)
        plgpu.copy_gmem_to_smem(s_ref, s_smem, bar)
        plgpu.copy_gmem_to_smem(p_ref, p_smem, bar)
        plgpu.barrier_wait(bar)

        def step(_, acc):
            frags = vt_fragments(v_smem, s_smem, cw=CW)

            def pv(acc_ref):
                for mg in range(GROUPS):
                    plgpu.wgmma(acc_ref.at[pl.ds(64 * mg, 64)], frags[mg], p_smem.transpose((1, 0)))
                plgpu.wgmma_wait(0)

            return pl.run_state(pv)(plgpu.ACC.init(acc))

        acc = plgpu.layout_cast(jnp.zeros((256, 64), jnp.float32), plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, reps, step, acc)
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((256, 64), jnp.float32),
        scratch_types=[
            plgpu.SMEM((NC, 64, CW), jnp.float8_e4m3fn, transforms=_tiled(64, 1)),
            plgpu.SMEM((256,), jnp.float16),
            plgpu.SMEM((64, 64), jnp.float16, transforms=_tiled(64, 2)),
            plgpu.SMEM((256, 64), jnp.float32, transforms=_tiled(32, 4)),
            plgpu.Barrier(num_arrivals=NC + 2),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(v8, scales, p)


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((64, 256)).astype(np.float32) * 40
    v8 = jnp.asarray(v).astype(jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.uniform(0.01, 0.1, 256), jnp.float16)
    p = jnp.asarray(rng.uniform(0, 1, (64, 64)), jnp.float16)
    return v8, scales, p


def expected(v8, scales, p):
    frags = vt_fragments_reference(np.asarray(v8.astype(jnp.float32)),
                                   np.asarray(scales.astype(jnp.float32)))  # [G, 64 r, 64 k] fmt: skip
    frags = frags.astype(np.float16).astype(np.float32)  # v · scale rounded to f16, as the kernel
    pt = np.asarray(p.astype(jnp.float32)).T  # [keys, heads]
    return np.concatenate([frags[mg] @ pt for mg in range(GROUPS)], axis=0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lower", action="store_true", help="CPU: lower for an abstract H200, nothing runs")
    ap.add_argument("--reps", type=int, default=4096, help="builds + products per kernel in the timing")
    args = ap.parse_args(argv)
    v8, scales, p = make_inputs()
    if args.lower:
        sys.path.insert(0, "tests")
        from gpu_mesh import abstract_gpu_mesh

        with abstract_gpu_mesh():
            text = jax.jit(probe).trace(v8, scales, p).lower(lowering_platforms=("cuda",)).as_text()
        print("lowered:", "mosaic_gpu" in text)
        return 0
    out = np.asarray(jax.block_until_ready(probe(v8, scales, p)))
    want = expected(v8, scales, p)
    err = np.max(np.abs(out - want)) / np.max(np.abs(want))
    print(f"Oᵀ against numpy: max abs {np.max(np.abs(out - want)):.3e}, relative to max {err:.2e}")
    ok = err < 2e-3
    print("PASS" if ok else "FAIL")
    if not ok:
        bad = np.argwhere(np.abs(out - want) > 2e-3 * np.max(np.abs(want)))
        print("first bad (row, head):", bad[:8].tolist())
        return 1
    f = jax.jit(lambda *a: probe(*a, reps=args.reps))
    jax.block_until_ready(f(v8, scales, p))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(v8, scales, p))
        ts.append(time.perf_counter() - t0)
    t = sorted(ts)[2] / args.reps
    print(f"build + 4 wgmma (one warpgroup, one CTA): {t * 1e9:.0f} ns a tile (median of 5, {args.reps} reps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
