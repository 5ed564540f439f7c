"""DeepSeek-V4 mixture of experts: routed SwiGLU experts (learned or hash routing) plus one shared expert."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.config import Config
from dsv4.layers import F32, Buffer, param, project, project_shared, stackable_w8a8, stacked_on_rows
from dsv4.pallas._device import on_gpu
from dsv4.pallas.linear_fp8 import quantize_rows
from dsv4.pallas.moe import quantize_per_token_group, routed_experts
from dsv4.quantization import BlockQuantized, fp4_fits_fp8_blocks, fp4_to_fp8_blocks
from dsv4.sharding.expert_parallel import DEFAULT_CHUNK_TOKENS, ep_layout, routed_experts_ep
from dsv4.sharding.sequence import per_sequence_shard


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) · clip(up, ±limit): the clamp V4 puts on every expert, shared included."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def router_scores(logits: jax.Array, scoring_func: str) -> jax.Array:
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


def routed_experts_jnp(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, gate_up: jax.Array,
                       down: jax.Array, limit: float, out_dtype=None) -> jax.Array:  # fmt: skip
    """Dropless routed experts by sorting token-expert pairs and grouped matmuls (`lax.ragged_dot`).

    x: [N, D]; expert_ids, weights: [N, K]; gate_up: [E, 2I, D]; down: [E, D, I] → [N, D] in out_dtype (default
    x's). A pair whose id is outside [0, E) contributes nothing (expert parallelism: another shard's expert).
    """
    n, k = expert_ids.shape
    e, two_i, _ = gate_up.shape
    flat_ids = expert_ids.reshape(-1)
    flat_ids = jnp.where((flat_ids >= 0) & (flat_ids < e), flat_ids, e)  # sorts last; ragged_dot zeroes those rows
    order = jnp.argsort(flat_ids, stable=True)  # pairs grouped by expert
    token_of_pair = order // k
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    xs = x[token_of_pair]  # [N·K, D]
    h = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), group_sizes, preferred_element_type=F32)
    h = swiglu(h[:, : two_i // 2], h[:, two_i // 2 :], limit).astype(x.dtype)
    y = jax.lax.ragged_dot(h, jnp.swapaxes(down, 1, 2), group_sizes, preferred_element_type=F32)  # [N·K, D]
    y = y * weights.reshape(-1)[order][:, None].astype(F32)
    return jnp.zeros((n, x.shape[1]), F32).at[token_of_pair].add(y).astype(out_dtype or x.dtype)


def routed_experts_pallas(x, expert_ids, weights, gate_up, down, limit, out_dtype=None, **fp8):
    """The grouped-GEMM Pallas kernels (`dsv4/pallas/moe.py`); interpreted off-GPU. fp8: FP8 weights' block
    scales (gate_up_scales, down_scales), fp8_activations, pre-quantized tokens' x_scales."""
    return routed_experts(x, expert_ids, weights, gate_up, down, limit, out_dtype=out_dtype, interpret=not on_gpu(),
                          **fp8)  # fmt: skip


MOE_IMPLS = {"jnp": routed_experts_jnp, "pallas": routed_experts_pallas}


@functools.cache
def _ep_local_experts(impl: str, limit: float, fp8_activations: bool | None = None):
    """One function object per (impl, limit, W8A8 or W8A16 for FP8 weights): the expert-parallel program is cached
    on it."""
    extra = {} if fp8_activations is None else {"fp8_activations": fp8_activations}

    def local_experts(x, ids, weights, gate_up, down, **fp8):
        return MOE_IMPLS[impl](x, ids, weights, gate_up, down, limit, out_dtype=F32, **fp8, **extra)

    return local_experts


def kernel_ready_fp8(w) -> bool:
    """A kept-quantized weight the FP8 expert kernels take as it is: e4m3 values in DeepSeek's 128 × 128 blocks."""
    return (isinstance(w, BlockQuantized) and w.fmt == "fp8" and tuple(w.block) == (128, 128)
            and w.shape[-1] % 128 == 0 and w.shape[-2] % 128 == 0)  # fmt: skip


class MoE(nnx.Module):
    """Router (top-k over scores + a selection-only bias, or a fixed `tid2eid[token]` table) → experts."""

    def __init__(self, config: Config, mlp_type: str, *, rngs: nnx.Rngs, dtype, moe_impl: str = "jnp",
                 dense_impl: str = "jnp"):  # fmt: skip
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={moe_impl!r}; available: {sorted(MOE_IMPLS)}")
        self.moe_impl, self.dense_impl = moe_impl, dense_impl  # `Kernels.moe`, `Kernels.dense` (the shared expert)
        d, i, e = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
        self.is_hash = mlp_type == "hash_moe"
        gate = {"weight": param(rngs, (e, d), ("experts", "embed"), dtype=dtype)}
        if self.is_hash:
            gate["tid2eid"] = Buffer(jnp.zeros((config.vocab_size, config.num_experts_per_tok), jnp.int32),
                                     axes=("vocab", None))  # fmt: skip
        else:
            gate["e_score_correction_bias"] = Buffer(jnp.zeros((e,), F32), axes=("experts",))
        self.gate = nnx.Dict(gate)
        self.experts = nnx.Dict(
            gate_up_proj=param(rngs, (e, 2 * i, d), ("experts", "expert_mlp2", "embed"), dtype=dtype),
            down_proj=param(rngs, (e, d, i), ("experts", "embed", "expert_mlp"), dtype=dtype),
        )
        self.shared_experts = nnx.Dict(
            gate_proj=nnx.Dict(weight=param(rngs, (i, d), ("mlp", "embed"), dtype=dtype)),
            up_proj=nnx.Dict(weight=param(rngs, (i, d), ("mlp", "embed"), dtype=dtype)),
            down_proj=nnx.Dict(weight=param(rngs, (d, i), ("embed", "mlp"), dtype=dtype)),
        )
        self.top_k, self.scoring_func, self.limit = config.num_experts_per_tok, config.scoring_func, config.swiglu_limit
        self.scaling, self.norm_topk = config.routed_scaling_factor, config.norm_topk_prob
        # Under expert parallelism, tokens per step (bounds the per-step memory; dsv4/sharding/expert_parallel.py)
        self.ep_chunk_tokens = DEFAULT_CHUNK_TOKENS
        # ... the dtype the partial results travel in (float32: exact; bfloat16 halves those bytes), and the
        # schedule ("auto": on 2 devices "direct", each partial result straight home; on more "alltoall", each token
        # only to the devices owning one of its experts, in one all-to-all each way); docs/kernels/parallelism.md
        self.ep_combine_dtype = F32
        self.ep_schedule = "auto"
        # Experts loaded FP8 (`dsv4.load(keep_quantized=True)`, 128 × 128 blocks) or FP4 (re-blocked as FP8 each
        # step) with the Pallas MoE (`Kernels.moe`) run on the FP8 kernels: W8A8 (activations quantized per token
        # and 128-group, as DeepSeek does) or, with False, W8A16. Other weights, and the jnp path, read them
        # dequantized.
        self.fp8_activations = True

    def expert_weights(self) -> tuple[jax.Array, jax.Array, dict]:
        """(gate_up, down, scales): FP8 values and {"gate_up_scales", "down_scales"} when the experts are kept
        FP8 in 128 × 128 blocks, or FP4 that tiles into them, and the Pallas kernels run them; else the weights in
        the model's dtype (dequantized if kept quantized) and {}."""
        gu_var, dn_var = self.experts["gate_up_proj"], self.experts["down_proj"]
        gu, dn = gu_var.get_value(), dn_var.get_value()
        if self.moe_impl == "pallas":
            if fp4_fits_fp8_blocks(gu) and fp4_fits_fp8_blocks(dn):
                # FP4 experts: re-blocked as FP8 in this step (exact for ue8m0 scales; one pass over the FP4 bytes,
                # writing 1 B a weight, where reading them dequantized writes 2 B and runs the bf16 kernel).
                gu, dn = fp4_to_fp8_blocks(gu), fp4_to_fp8_blocks(dn)
            if kernel_ready_fp8(gu) and kernel_ready_fp8(dn):
                return gu.q, dn.q, {"gate_up_scales": gu.scale, "down_scales": dn.scale}
        return gu_var[...], dn_var[...], {}

    def route(self, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [N, D], token_ids: [N] → expert ids [N, K] int32, weights [N, K] float32."""
        logits = jnp.einsum("nd,ed->ne", x, self.gate["weight"][...], preferred_element_type=F32)
        scores = router_scores(logits, self.scoring_func)
        if self.is_hash:
            ids = self.gate["tid2eid"][...][token_ids].astype(jnp.int32)
        else:
            # The bias steers which experts are picked, never how much they weigh.
            _, ids = jax.lax.top_k(scores + self.gate["e_score_correction_bias"][...], self.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return ids, weights * self.scaling

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> jax.Array:
        """x: [B, S, D]; token_ids: [B, S] → [B, S, D]."""
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        ids, weights = self.route(flat, token_ids.reshape(-1))
        gate_up, down, scales = self.expert_weights()
        impl = MOE_IMPLS[self.moe_impl]
        sh, dense = self.shared_experts, self.dense_impl
        shared_gate_up = (sh["gate_proj"]["weight"], sh["up_proj"]["weight"])
        shared_h = None  # the shared expert's gate and up projections, where the routed path computes them
        # W8A8 experts (FP8 weights on the Pallas kernels) and a stackable shared gate | up: one quantized x for both
        same_x = None
        if scales and self.fp8_activations and x.dtype == jnp.bfloat16:
            same_x = stackable_w8a8(x, shared_gate_up, dense)
        layout = ep_layout(gate_up.shape[0])
        if layout is not None:
            # Expert parallelism: each device keeps its slice of the experts and the tokens are sent to them. Too
            # few tokens a row to split (a decode step's one per request): the batch's tokens as one row instead.
            rows, cols = (1, b * s) if s % layout[2] and b > 1 else (b, s)
            x_sent, x_scales = x.reshape(rows, cols, d), None
            if scales and self.fp8_activations:  # W8A8: quantized where the token lives, sent as 1-byte values
                xq, xs = quantize_per_token_group(flat)
                x_sent, x_scales = xq.reshape(rows, cols, d), xs.reshape(rows, cols, -1)
                if same_x is not None:  # the stacked shared gate | up on the same quantized rows
                    shared_h = stacked_on_rows(x, xq, xs, same_x)
            local = _ep_local_experts(self.moe_impl, self.limit, self.fp8_activations if scales else None)
            routed = routed_experts_ep(local, x_sent, ids.reshape(rows, cols, -1), weights.reshape(rows, cols, -1),
                                       gate_up, down, x_scales=x_scales, **scales, out_dtype=x.dtype,
                                       chunk_tokens=self.ep_chunk_tokens, schedule=self.ep_schedule,
                                       combine_dtype=self.ep_combine_dtype).reshape(b * s, d)  # fmt: skip
        elif self.moe_impl == "pallas":
            sharded, fill = [x, ids.reshape(b, s, -1), weights.reshape(b, s, -1)], [0, 0, 0.0]
            if same_x is not None:  # x quantized once, for the experts (per shard) and the stacked gate | up
                xq, xs = quantize_rows(x)  # [B, S, D], [B, S, D / 128]
                shared_h = stacked_on_rows(x, xq, xs, same_x)
                sharded, fill = [xq, *sharded[1:], xs], [*fill, 1.0]

            # A custom call: split it over the sequence shards by hand (experts gathered to every shard), else
            # XLA would gather the tokens and run every token's experts on every device.
            def local(x_, ids_, weights_, *rest):
                n = x_.shape[0] * x_.shape[1]
                xs_ = rest[0] if same_x is not None else None
                gate_up_, down_, *scales_ = rest[1:] if same_x is not None else rest
                kw = dict(zip(scales, scales_), fp8_activations=self.fp8_activations) if scales_ else {}
                if xs_ is not None:
                    kw.update(x_scales=xs_.reshape(n, -1), out_dtype=x.dtype)
                out = impl(x_.reshape(n, d), ids_.reshape(n, -1), weights_.reshape(n, -1), gate_up_, down_, self.limit,
                           **kw)  # fmt: skip
                return out.reshape(*x_.shape[:2], d)

            routed = per_sequence_shard(local, sharded, (gate_up, down, *scales.values()), fill=fill)
            routed = routed.reshape(b * s, d)
        else:
            routed = impl(flat, ids, weights, gate_up, down, self.limit)  # the jnp path: FP8 experts read dequantized
        if shared_h is None:
            shared_h = project_shared(x, shared_gate_up, dense)
        h = swiglu(*shared_h, self.limit)
        shared = project(h, sh["down_proj"]["weight"], dense)  # [B, S, D]: the sequence axis kept for its shards
        return (routed + shared.reshape(b * s, d)).reshape(b, s, d)
