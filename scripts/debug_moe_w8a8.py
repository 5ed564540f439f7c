#!/usr/bin/env python3
"""W8A8 MoE on GPU: is the 4.48 % of `test_gpu_routed_experts_matches_reference[w8a8]` the reference's? (M9)

    PYTHONPATH=. python scripts/debug_moe_w8a8.py          # one H200, well under 2 minutes
    PYTHONPATH=. python scripts/debug_moe_w8a8.py --cpu    # smoke run: small shapes, Pallas interpreter

Hypothesis (reproduced on CPU): XLA:GPU's SimplifyFPConversions (on by default, `xla_allow_excess_precision`)
folds the reference's in-jit f32 → fp8 → f32 round trip (and h's f32 → bf16 → f32), so the old reference never
quantized the activations, while the kernel path (fp8 operands are pallas_call inputs) does. On CPU, compiling
the old reference with that pass on (`xla_cpu_experimental_onednn_custom_call`) moves it by 0.04482 (rel. L2) at
the GPU test's shapes; the GPU measured 0.04480 / 0.04479. The fixed reference (`_fake_quantize`: an optimization
barrier on the fp8 values) is bit-identical with and without the pass on CPU.

At the GPU test's shapes (E 32, D 1024, I 512, 700 tokens, top-6, block_k 128) this prints the relative L2 error
of the compiled kernel (fast accumulation on and off) against
  - "fixed":      routed_experts_reference as it is now (barriers): expect < 1e-2 (a few 1e-3 at most);
  - "old":        the reference without the barriers (as before the fix): expect ~0.0448 if the hypothesis holds;
  - "no-quant":   the reference with fp8_activations=False (activations never quantized): expect ~0.0448 too;
and how many f8e4m3fn converts survive in each reference's optimized GPU HLO (old: expect 0 fp8 round trips).
If "fixed" is still ~4 % off, the hypothesis is wrong and the kernel (or its quantization) is at fault.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_pallas_moe import LIMIT, make_routing, make_weights, quantize_weights  # noqa: E402

from dsv4.pallas import moe  # noqa: E402

F32 = jnp.float32


@jax.jit
def old_reference(x, expert_ids, weights, gate_up, down, gate_up_scales, down_scales):
    """routed_experts_reference (W8A8) as it was before the fix: quantize / dequantize with no barrier."""
    n, k = expert_ids.shape
    inter, e = gate_up.shape[1] // 2, gate_up.shape[0]
    ids = expert_ids.reshape(-1)
    ids = jnp.where((ids >= 0) & (ids < e), ids, e)
    xf = moe.dequantize_blocks(*moe.quantize_per_token_group(x), (1, moe.QUANT_BLOCK))
    w1 = moe.dequantize_blocks(gate_up, gate_up_scales, (moe.QUANT_BLOCK, moe.QUANT_BLOCK))
    w2 = moe.dequantize_blocks(down, down_scales, (moe.QUANT_BLOCK, moe.QUANT_BLOCK))
    h = moe._per_row_expert_matmul(jnp.repeat(xf, k, axis=0), w1, ids)
    h = moe._swiglu(h[:, :inter], h[:, inter:], LIMIT).astype(x.dtype)
    hf = moe.dequantize_blocks(*moe.quantize_per_token_group(h), (1, moe.QUANT_BLOCK))
    y = moe._per_row_expert_matmul(hf, w2, ids) * weights.reshape(-1, 1).astype(F32)
    return y.reshape(n, k, -1).sum(1).astype(x.dtype)


def rel_l2(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def main():
    t0 = time.time()
    cpu = "--cpu" in sys.argv[1:]
    print(jax.devices()[0].device_kind, jax.__version__)
    experts, hidden, inter, tokens, top_k = (4, 256, 128, 29, 3) if cpu else (32, 1024, 512, 700, 6)
    ids, weights = make_routing(19, tokens, top_k, experts)
    x = make_weights(19, (tokens, hidden), jnp.bfloat16, 1.0)
    gate_up, gate_up_scales = quantize_weights(make_weights(20, (experts, 2 * inter, hidden), F32, 0.05))
    down, down_scales = quantize_weights(make_weights(21, (experts, hidden, inter), F32, 0.05))
    args = (x, ids, weights, gate_up, down)
    scales = dict(gate_up_scales=gate_up_scales, down_scales=down_scales)

    refs = {
        "fixed": moe.routed_experts_reference(*args, LIMIT, **scales, fp8_activations=True),
        "old": old_reference(*args, gate_up_scales, down_scales),
        "no-quant": moe.routed_experts_reference(*args, LIMIT, **scales, fp8_activations=False),
    }
    refs = {name: np.asarray(r, np.float32) for name, r in refs.items()}
    hlo = {
        "fixed": moe.routed_experts_reference.lower(*args, LIMIT, **scales, fp8_activations=True).compile().as_text(),
        "old": old_reference.lower(*args, gate_up_scales, down_scales).compile().as_text(),
    }
    for name, text in hlo.items():
        print(f"reference {name:8s}: f8e4m3fn mentions in optimized HLO: {text.count('f8e4m3fn')}")
    print(f"old vs fixed reference: {rel_l2(refs['old'], refs['fixed']):.5f}   "
          f"no-quant vs fixed: {rel_l2(refs['no-quant'], refs['fixed']):.5f}")  # fmt: skip

    for fast in (True, False):
        bs = moe.BlockSizes(block_m=16 if cpu else 64, block_k=128, fp8_fast_accum=fast)
        got = moe.routed_experts(*args, LIMIT, **scales, block_sizes=bs, fp8_activations=True, interpret=cpu)
        got = np.asarray(got, np.float32)
        errs = "  ".join(f"{name} {rel_l2(got, r):.5f}" for name, r in refs.items())
        big = np.mean(np.abs(got - refs["fixed"]) > 2**-5 * np.abs(refs["fixed"]).max())
        print(f"kernel fp8_fast_accum={fast!s:5s}: rel L2 vs {errs}   (frac > 2^-5 max vs fixed: {big:.2e})")

    print(f"done in {time.time() - t0:.0f} s. Verdict: the bug was the reference's if 'fixed' < 0.01 and 'old' ~ 0.045")


if __name__ == "__main__":
    main()
