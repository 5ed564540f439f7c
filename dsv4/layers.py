"""Small building blocks shared by the attention and MoE blocks: parameters, norms, RoPE, hyper-connections.

Every weight is declared once, here or in the block that owns it, with its shape in the checkpoint's
(transformers') layout, its dtype class and its logical axes; random init, abstract shapes, sharding
and checkpoint loading are all derived from those declarations (see `dsv4/weights.py`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.config import Config, RopeConfig
from dsv4.pallas import sinkhorn as sk
from dsv4.pallas._device import is_hopper, on_gpu
from dsv4.pallas.linear_fp8 import (
    linear_w8a8,
    linear_w8a8_stacked,
    quantize_rows,
    stacked_w8a8_unsupported,
    w8a8_unsupported,
)
from dsv4.quantization import BlockQuantized
from dsv4.sharding.sequence import per_sequence_shard

F32 = jnp.float32


class Buffer(nnx.Variable):
    """A loaded, never-trained tensor (`tid2eid`, `e_score_correction_bias`)."""


def param(rngs: nnx.Rngs | np.random.Generator, shape, axes, *, dtype, init: str = "normal",
          std: float = 0.02) -> nnx.Param:  # fmt: skip
    """Declares one weight: `shape` in checkpoint layout ([out, in] for linears), logical `axes`.

    `rngs` is an `nnx.Rngs` (under `nnx.eval_shape`, to build abstract shapes for the loader) or a
    numpy Generator (concrete random init: host-side, so no per-shape device compilation).
    """
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif isinstance(rngs, np.random.Generator):
        value = jnp.asarray((std * rngs.standard_normal(shape, np.float32)).astype(jnp.dtype(dtype)))
    else:
        value = (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes))


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """`x @ weight.T` for a [out, in] weight, accumulating in float32, rounded once to x's dtype."""
    return matmul_in_dtype("...i,oi->...o", x, weight)


def _fp8_blocks(value) -> bool:
    """A weight kept FP8 in DeepSeek's 128 × 128 blocks: what the W8A8 linear layers read as stored."""
    return isinstance(value, BlockQuantized) and value.fmt == "fp8" and tuple(value.block) == (128, 128)


def project(x: jax.Array, weight: nnx.Variable, impl: str = "jnp") -> jax.Array:
    """`linear(x, weight[...])` for a weight variable, x [B, S, in].

    impl="pallas" (`Kernels.dense`) with the weight kept FP8 in 128 × 128 blocks (`dsv4.load(keep_quantized=True)`):
    W8A8, x quantized per token and 128-group and the FP8 GEMM run on the stored values (`linear_w8a8`), as
    DeepSeek's FP8 linear layers do, on each sequence shard. Any other weight is read dequantized.
    """
    value = weight.get_value()
    if impl == "pallas" and _fp8_blocks(value) and not w8a8_unsupported(value.q, value.scale):
        return per_sequence_shard(lambda x_, q_, s_: linear_w8a8(x_, q_, s_), (x,), (value.q, value.scale),
                                  fill=(0,))  # fmt: skip
    return linear(x, weight[...])


# Rows from which `project_shared` stacks its weights: below it (decode steps) copying the weights into one stack
# each call costs about what quantizing x once more does.
STACK_MIN_ROWS = 1024


def stackable_w8a8(x: jax.Array, weights, impl: str) -> list[tuple[jax.Array, jax.Array]] | None:
    """The (values, scales) of weight variables that read the same x [B, S, in] when they should run as one stacked
    W8A8 GEMM (`linear_w8a8_stacked`): impl "pallas", every weight FP8 in 128 × 128 blocks over one K, and at least
    `STACK_MIN_ROWS` rows of x. Else None."""
    if impl != "pallas" or math.prod(x.shape[:-1]) < STACK_MIN_ROWS:
        return None
    values = [w.get_value() for w in weights]
    if not all(map(_fp8_blocks, values)):
        return None
    pairs = [(v.q, v.scale) for v in values]
    return None if stacked_w8a8_unsupported(pairs) else pairs


def project_shared(x: jax.Array, weights, impl: str = "jnp") -> tuple[jax.Array, ...]:
    """`tuple(project(x, w, impl) for w in weights)` for weight variables that read the same x [B, S, in]: one W8A8
    GEMM over the weights stacked along N where `stackable_w8a8` says so (x quantized once; bit-equal results)."""
    pairs = stackable_w8a8(x, weights, impl)
    if pairs is None:
        return tuple(project(x, w, impl) for w in weights)
    return stacked_on_rows(x, *quantize_rows(x), pairs)


def stacked_on_rows(x: jax.Array, xq: jax.Array, xs: jax.Array, pairs) -> tuple[jax.Array, ...]:
    """`linear_w8a8_stacked` of x [B, S, D] over (q, scale) pairs on x already quantized (`quantize_rows(x)`: xq
    [B, S, D] or [B·S, D], xs [..., D / 128]), per sequence shard. → each weight's output [B, S, N_i]."""
    b, s, d = x.shape
    n = len(pairs)

    def local(x_, xq_, xs_, *flat):
        return linear_w8a8_stacked(x_, list(zip(flat[:n], flat[n:], strict=True)), x_q=(xq_, xs_))

    y = per_sequence_shard(local, (x, xq.reshape(b, s, d), xs.reshape(b, s, -1)),
                           (*(q for q, _ in pairs), *(sc for _, sc in pairs)), fill=(0, 0, 1.0))  # fmt: skip
    return tuple(jnp.split(y, np.cumsum([q.shape[0] for q, _ in pairs])[:-1], axis=-1))


def matmul_in_dtype(spec: str, x: jax.Array, weight: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, weight)` accumulated in float32 and returned in x's dtype.

    NOTE: where x and the weight share a dtype the dot returns that dtype itself (GPU GEMMs accumulate bf16 in
    float32 either way). A float32 result cast afterwards makes XLA write the float32 product and read it back in a
    separate pass: 3.2 GB more traffic for a 16K-token chunk's [16K, 64 × 512] queries (docs/BENCHMARKS.md).
    """
    if x.dtype == weight.dtype and x.dtype != F32:
        return jnp.einsum(spec, x, weight, preferred_element_type=x.dtype)
    return jnp.einsum(spec, x, weight, preferred_element_type=F32).astype(x.dtype)


def inverse_rms(x32: jax.Array, eps: float) -> jax.Array:
    """1 / RMS over the last axis (keepdims) of a float32 array."""
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Unweighted RMSNorm over the last axis, in float32, cast back to x's dtype."""
    x32 = x.astype(F32)
    return (x32 * inverse_rms(x32, eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Weighted RMSNorm; the weight stays float32 as in the reference (multiply in float32, cast once)."""

    def __init__(self, dim: int, eps: float, *, axis_name: str, rngs: nnx.Rngs):
        self.weight = param(rngs, (dim,), (axis_name,), dtype=F32, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(F32)
        return (self.weight[...] * (x32 * inverse_rms(x32, self.eps))).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Rotary embeddings: interleaved pairs (x[2i], x[2i+1]) on the trailing `rope_dim` channels.
# ---------------------------------------------------------------------------------------------
def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> tuple[np.ndarray, float]:
    """One inverse frequency per interleaved pair, and the cos/sin scale, for `rope`.

    NOTE: float32 arithmetic on purpose, in the reference's order (`1 / base ** (2i / dim)`), so the
    frequencies agree to the last bit instead of to float64 rounding.
    YaRN blends interpolated (÷ factor) and extrapolated frequencies with a linear ramp over the pair
    index between the correction dims of `beta_fast` and `beta_slow` rotations.
    """
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    pos_freqs = np.float32(rope.rope_theta) ** exponents
    inv_extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.rope_type == "default":
        return inv_extrapolation, 1.0
    factor = float(rope.factor)
    inv_interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rope_dim * math.log(turns) / (2 * math.log(rope.rope_theta))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)  # weight of the extrapolated (unscaled) frequency
    inv_freq = (inv_interpolation * (1 - keep) + inv_extrapolation * keep).astype(np.float32)
    if rope.attention_factor is not None:
        scale = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        scale = (0.1 * rope.mscale * math.log(factor) + 1) / (0.1 * rope.mscale_all_dim * math.log(factor) + 1)
    else:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(scale)


@dataclasses.dataclass(frozen=True)
class Rope:
    """cos/sin tables on demand for one RoPE setting. Positions are float32 (exact up to 2^24).

    Frozen and compared by value: it is static module state, so two models with the same config
    must hash alike or every loaded model would recompile.
    """

    inv_freq: tuple[float, ...]
    scale: float
    rope_dim: int

    @classmethod
    def build(cls, rope: RopeConfig, rope_dim: int) -> Rope:
        inv_freq, scale = rope_inv_freq(rope, rope_dim)
        return cls(tuple(float(f) for f in inv_freq), scale, rope_dim)

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions: [...] int → cos, sin: [..., rope_dim // 2] float32."""
        freqs = positions.astype(F32)[..., None] * jnp.asarray(self.inv_freq, F32)
        return jnp.cos(freqs) * self.scale, jnp.sin(freqs) * self.scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the trailing `2 * cos.shape[-1]` channels of x pairwise; the rest passes through.

    x: [..., S, (H,) D]; cos/sin: [..., S, rope_dim/2] broadcast over any head axis between.
    Pass `-sin` to undo a rotation (used on the attention output, since V = K carries RoPE).
    """
    rope_dim = 2 * cos.shape[-1]
    while cos.ndim < x.ndim:  # insert head axes: cos is [..., S, R], x is [..., S, H, D]
        cos, sin = cos[..., None, :], sin[..., None, :]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(F32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape)
    # NOTE: a concatenate, not an in-place update of the rope channels: XLA's CPU backend ran
    # dynamic_update_slice(x, rotate(x[..., -R:])) in place and read partners it had already overwritten.
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)


def apply_rope_in_place(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`apply_rope(x, cos, sin)` as an update of x's rope channels alone, for a large 16-bit x read once afterwards
    (the attention output: 1 GiB for a 16K-token chunk, of which the rope channels are an eighth).

    NOTE: each rotated pair is one uint32 (two 16-bit values, even channel in the low half), so the update is
    elementwise: read at the offset it writes, which XLA can run in place. `apply_rope`'s concatenate rewrites all of
    x (0.8 ms a layer on an H100), and an update that reads partner channels is not safe in place (XLA's CPU backend
    ran one in place and read partners it had already overwritten)."""
    if jnp.dtype(x.dtype).itemsize != 2:
        return apply_rope(x, cos, sin)
    while cos.ndim < x.ndim:  # head axes, as in apply_rope
        cos, sin = cos[..., None, :], sin[..., None, :]
    half = cos.shape[-1]  # pairs
    words = jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, 2), jnp.uint32)  # [..., D / 2]
    start = words.shape[-1] - half
    pairs = jax.lax.dynamic_slice_in_dim(words, start, half, axis=-1)

    def unpack(bits):
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), x.dtype).astype(F32)

    def pack(value):
        return jax.lax.bitcast_convert_type(value.astype(x.dtype), jnp.uint16).astype(jnp.uint32)

    even, odd = unpack(pairs & 0xFFFF), unpack(pairs >> 16)
    rotated = pack(even * cos - odd * sin) | (pack(odd * cos + even * sin) << 16)
    words = jax.lax.dynamic_update_slice_in_dim(words, rotated, start, axis=-1)
    return jax.lax.bitcast_convert_type(words, x.dtype).reshape(x.shape)


def rope_in_place_with_scale(x: jax.Array, cos: jax.Array, sin: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """→ (`apply_rope_in_place(x, cos, sin)`, x's inverse RMS [..., 1] float32 taken before the rotation: YaRN's cos
    and sin carry a magnitude factor, so the rotated rows' RMS differs).

    NOTE: the barrier orders the RMS's read of x before the update of x's rope channels. Unordered, XLA's GPU backend
    copies all of x so the update can run in place beside a reduce that may still read the old channels: 1 GiB, 0.73
    ms a layer for a 16K-token chunk's queries on an H100."""
    scale = inverse_rms(x.astype(F32), eps)
    x, scale = jax.lax.optimization_barrier((x, scale))
    return apply_rope_in_place(x, cos, sin), scale


def normalize_and_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, eps: float) -> jax.Array:
    """`apply_rope(rms_normalize(x, eps), cos, sin)` with one rounding: the rotation is linear, so x's factor (its
    RMS taken before rotating: YaRN's cos and sin also scale) is applied after it.

    NOTE: in that order XLA reads x twice (the RMS, then the rotation) and writes once; normalizing first writes the
    normalized x and reads it back for the rotation (1 GiB each way for a 16K-token chunk's queries)."""
    x32 = x.astype(F32)
    return (apply_rope(x32, cos, sin) * inverse_rms(x32, eps)).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Manifold-constrained hyper-connections (mHC).
# ---------------------------------------------------------------------------------------------
SINKHORN_MGPU_CONFIG = sk.MgpuSinkhornConfig(reciprocal=True, approx_math=True)
"""The Mosaic GPU Sinkhorn as `impl="pallas"` runs it on Hopper, at every token count: each row or column sum
inverted once by an approximate reciprocal and the entries multiplied by it (within about 2.5 ulp of the quotient,
the class of the Triton lowering's approximate division); by GPU time the fastest form measured at a decode step's
32 tokens and at a 16K-token chunk, ahead of the Triton kernel at both (docs/BENCHMARKS.md, "mHC Sinkhorn")."""


def sinkhorn_normalize(comb: jax.Array, iters: int, eps: float, impl: str = "jnp") -> jax.Array:
    """comb [B, S, hc, hc] (positive) → doubly stochastic, float32: columns first, then (iters - 1) rounds of rows
    and columns, as in the reference. impl="pallas": one kernel launch (per sequence shard under a
    sequence-parallel layout; interpreted off a GPU) instead of XLA's host-driven loop: on Hopper the Mosaic GPU
    kernel (`SINKHORN_MGPU_CONFIG`), elsewhere the Triton one (hc a power of two); "pallas-triton": the Triton
    kernel; "pallas-mgpu": the Mosaic GPU kernel with its default config (the Mosaic GPU interpreter off a GPU),
    any hc."""
    hc = comb.shape[-1]
    gpu = on_gpu()
    if impl == "pallas-mgpu" or (impl == "pallas" and gpu and is_hopper()):
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

        config = SINKHORN_MGPU_CONFIG if impl == "pallas" else sk.MgpuSinkhornConfig()
        interpret = None if gpu else InterpretGPUParams()
        return per_sequence_shard(lambda c: sk.sinkhorn_mgpu(c, iters, eps, config=config, interpret=interpret),
                                  (comb,), fill=(1.0,))  # fmt: skip
    if impl in ("pallas", "pallas-triton") and hc & (hc - 1) == 0:
        return per_sequence_shard(lambda c: sk.sinkhorn(c, iters, eps, interpret=not gpu), (comb,), fill=(1.0,))
    return sk.sinkhorn_reference(comb, iters, eps)


class HyperConnection(nnx.Module):
    """Mixes the `hc_mult` residual copies into one block input and back out.

    From the copies it predicts `pre` (collapse weights), `post` (expand weights) and `comb` (an
    hc×hc mixing matrix made doubly stochastic by Sinkhorn steps, so the residual norm cannot grow).
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs, sinkhorn: str = "jnp"):
        hc, d = config.hc_mult, config.hidden_size
        n_out = (2 + hc) * hc
        self.sinkhorn = sinkhorn  # `Kernels.sinkhorn`
        self.fn = param(rngs, (n_out, hc * d), ("hc_out", "hc_embed"), dtype=F32)
        self.base = param(rngs, (n_out,), ("hc_out",), dtype=F32, init="zeros")
        self.scale = param(rngs, (3,), (None,), dtype=F32, init="ones")
        self.hc_mult, self.iters = hc, config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def __call__(self, streams: jax.Array,
                 mean_square: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
        """streams: [B, S, hc, D] → post [B, S, hc], comb [B, S, hc, hc] (float32), collapsed [B, S, D].
        mean_square: the copies' mean square per token [B, S, 1] float32 where the merge that made them gave it
        (`hc_merge(with_mean_square=True)`), else computed here."""
        with jax.named_scope("mhc"):  # its kernels named so in a profile (dsv4.model.LAYER_SCOPES)
            return self._mix(streams, mean_square)

    def _mix(self, streams: jax.Array, mean_square: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        hc, eps = self.hc_mult, self.hc_eps
        mixes = normalized_mixes(streams, self.fn[...], self.norm_eps, mean_square)
        pre_w, post_w, comb_w = mixes[..., :hc], mixes[..., hc : 2 * hc], mixes[..., 2 * hc :]
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(pre_w * scale[0] + base[:hc]) + eps
        post = 2 * jax.nn.sigmoid(post_w * scale[1] + base[hc : 2 * hc])
        comb_logits = comb_w.reshape(*comb_w.shape[:-1], hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
        comb = sinkhorn_normalize(jax.nn.softmax(comb_logits, axis=-1) + eps, self.iters, eps, self.sinkhorn)
        collapsed = jnp.einsum("bsj,bsjd->bsd", pre, streams.astype(F32)).astype(streams.dtype)
        return post, comb, collapsed


def normalized_mixes(streams: jax.Array, fn: jax.Array, eps: float, mean_square: jax.Array | None = None) -> jax.Array:
    """RMSNorm(the copies flattened) · fnᵀ in float32: streams [B, S, hc, D], fn [n, hc·D] → [B, S, n].
    mean_square [B, S, 1]: the flattened copies' mean square, if known (saves a pass over the copies).

    NOTE: the norm's per-token factor is applied to the n mixes, not to the hc·D inputs, so the normalized float32
    copies (1 GiB for a 16K-token chunk) are never written: the GEMM reads the streams as they are."""
    flat = streams.reshape(*streams.shape[:2], -1).astype(F32)
    if mean_square is None:
        factor = inverse_rms(flat, eps)
    else:
        factor = jax.lax.rsqrt(mean_square + eps)
    return jnp.einsum("bsi,oi->bso", flat, fn, preferred_element_type=F32) * factor


def hc_merge(block_output: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array, *,
             with_mean_square: bool = False):  # fmt: skip
    """New copies: post_k · output + Σ_j comb[j, k] · stream_j (comb is applied transposed), in float32, rounded
    once to the streams' dtype. with_mean_square: → (copies, their mean square per token [B, S, 1] float32, of the
    rounded values), the next `HyperConnection`'s norm taken in the same pass as the merge."""
    with jax.named_scope("mhc_merge"):
        # NOTE: hc (4) products summed elementwise, one pass over the copies; XLA runs a batched dot of k = 4 as a
        # GEMM kernel, 1.5× slower at a 16K-token chunk (docs/BENCHMARKS.md, "Where a chunk's time goes").
        out = post.astype(F32)[..., None] * block_output.astype(F32)[:, :, None, :]
        comb = comb.astype(F32)
        for j in range(streams.shape[2]):
            out = out + comb[:, :, j, :, None] * streams[:, :, j, None, :].astype(F32)
        rounded = out if streams.dtype == F32 else out.astype(streams.dtype)
        if not with_mean_square:
            return rounded if streams.dtype == F32 else jax.lax.optimization_barrier(rounded)
        mean_square = jnp.mean(jnp.square(exact_float32(rounded)), axis=(-2, -1))[..., None]
        if streams.dtype == F32:
            return rounded, mean_square
        # NOTE: the barrier keeps the rounding to the streams' dtype. Without it XLA's GPU backend drops the
        # round trip to float32 in the next reader (excess precision) and carries the copies in float32 from merge
        # to merge: twice the bytes in every pass over them (1 GiB against 0.5 for a 16K-token chunk).
        return jax.lax.optimization_barrier((rounded, mean_square))


def exact_float32(x: jax.Array) -> jax.Array:
    """x's values in float32, by bits for bfloat16 (its 16 bits are a float32's top half): XLA's excess-precision
    pass may drop a convert pair f32 → bf16 → f32, and with it the rounding a convert would keep."""
    if x.dtype != jnp.bfloat16:
        return x.astype(F32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, F32)


class HyperHead(nnx.Module):
    """Final collapse of the hc copies into one hidden state (no post / comb)."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        hc, d = config.hc_mult, config.hidden_size
        self.hc_fn = param(rngs, (hc, hc * d), ("hc", "hc_embed"), dtype=F32)
        self.hc_base = param(rngs, (hc,), ("hc",), dtype=F32, init="zeros")
        self.hc_scale = param(rngs, (1,), (None,), dtype=F32, init="ones")
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def __call__(self, streams: jax.Array, mean_square: jax.Array | None = None) -> jax.Array:
        mixes = normalized_mixes(streams, self.hc_fn[...], self.norm_eps, mean_square)
        pre = jax.nn.sigmoid(mixes * self.hc_scale[...] + self.hc_base[...]) + self.hc_eps
        return jnp.einsum("bsj,bsjd->bsd", pre, streams.astype(F32)).astype(streams.dtype)
