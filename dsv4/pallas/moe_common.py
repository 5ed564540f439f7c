"""What the MoE kernels share: the Triton grouped GEMMs (`moe.py`) and the Mosaic GPU ones (`moe_mgpu.py`).
Design notes: docs/kernels/moe.md.

DeepSeek's FP8 formats: weights float8_e4m3fn with one float32 scale per 128 × 128 block, activations
float8_e4m3fn with one float32 scale per token and 128-channel group (`quantize_per_token_group`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["AMAX_FLOOR", "FP8", "FP8_MAX", "QUANT_BLOCK", "dequantize_blocks", "quantize_per_token_group"]

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
QUANT_BLOCK = 128  # DeepSeek's FP8 block: 128 × 128 weight blocks, 1 × 128 activation groups
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # as DeepSeek's act_quant: an all-zero group gets a finite scale


def quantize_per_token_group(x: jax.Array, *, pow2_scale: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [..., K] (K % 128 == 0) → (float8_e4m3fn [..., K], float32 scales [..., K // 128]), x ≈ fp8 · scale.

    DeepSeek's `act_quant`: scale = max(amax of the group, 1e-4) / 448, fp8 = x / scale rounded to nearest even.
    pow2_scale rounds the scale up to a power of two (the "ue8m0" scale format of DeepSeek-V3.1 and later).
    """
    *lead, k = x.shape
    if k % QUANT_BLOCK:
        raise ValueError(f"quantize_per_token_group: x.shape={x.shape} needs K % {QUANT_BLOCK} == 0")
    groups = x.astype(F32).reshape(*lead, k // QUANT_BLOCK, QUANT_BLOCK)
    scale = jnp.maximum(jnp.abs(groups).max(-1), AMAX_FLOOR) / FP8_MAX  # [..., K // 128]
    if pow2_scale:
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    values = (groups / scale[..., None]).astype(FP8).reshape(*lead, k)
    return values, scale


def dequantize_blocks(values: jax.Array, scales: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    """values [..., A, B] · scales [..., A // a, B // b] repeated over (a, b) = block_shape → float32 [..., A, B]."""
    full = scales.astype(F32)
    for i, size in enumerate(block_shape):
        full = jnp.repeat(full, size, axis=values.ndim - len(block_shape) + i)
    return values.astype(F32) * full
