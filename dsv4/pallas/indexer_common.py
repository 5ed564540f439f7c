"""What the indexer kernels share: the dense Triton kernels (`indexer.py`), the Mosaic FP8 scores kernel
(`indexer_mgpu.py`), the paged scores kernel (`indexer_paged.py`) and the top-k refinement kernel (`select.py`).
Design notes: docs/kernels/indexer.md.

- input checks and scale folding (every scale of a whole (token, head) row folds into the head weight: ReLU
  commutes with a positive factor);
- causal visibility (entry c visible to position p iff c < (p + 1) // rate) and the top-k of masked scores.
The queries-per-step rule of the two-pass indexer lives in `indexer_slab.py` (no jax: the memory plan uses it).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv4.pallas.attention_common import check_page_scales, check_rope_pages

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
NEG_INF = float("-inf")
MAX_QUERIES = 16  # a paged scores call's queries per request (decode steps have one; the Triton kernel unrolls them)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_index_inputs(q, keys, weights, positions, *, rate, k, q_scale, k_scale) -> tuple[str | None, str | None]:
    """Raises ValueError (with shapes) on malformed inputs; → (q scale layout, k scale layout), each
    "tensor", "token_head" / "row", or None (not FP8)."""
    if q.ndim != 4 or keys.ndim != 3:
        raise ValueError(
            f"expected q [B, S, Hi, Di] and keys [B, C, Di], got q.shape={q.shape}, keys.shape={keys.shape}"
        )
    b, s, h, d = q.shape
    c = keys.shape[1]
    if keys.shape != (b, c, d) or c == 0:
        raise ValueError(f"keys.shape={keys.shape} must be (B, C >= 1, Di) = ({b}, C, {d}) for q.shape={q.shape}")
    if weights.shape != (b, s, h) or weights.dtype != F32:
        raise ValueError(f"weights must be float32 [B, S, Hi] = ({b}, {s}, {h}), got {weights.dtype} {weights.shape}")
    if positions.shape != (b, s) or positions.dtype != jnp.int32:
        raise ValueError(f"positions must be int32 [B, S] = ({b}, {s}), got {positions.dtype} {positions.shape}")
    for name, x in (("q", q), ("keys", keys)):
        if x.dtype not in (jnp.bfloat16, jnp.float16, F32, FP8):
            raise ValueError(f"{name}.dtype={x.dtype} must be bfloat16, float16, float32 or float8_e4m3fn")
    if q.dtype != keys.dtype and FP8 not in (q.dtype, keys.dtype):
        raise ValueError(f"q.dtype={q.dtype} and keys.dtype={keys.dtype} differ (only float8_e4m3fn may mix)")
    if not isinstance(rate, int) or rate < 1:
        raise ValueError(f"rate={rate!r} must be a positive int")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive int")

    def layout(name, scale, x, per_row_shape, per_row_name):
        if x.dtype != FP8:
            if scale is not None:
                raise ValueError(f"{name} given but the scaled input is {x.dtype}, not float8_e4m3fn")
            return None
        if scale is None:
            raise ValueError(f"{name} is required: its input is float8_e4m3fn {x.shape}")
        if scale.dtype != F32:
            raise ValueError(f"{name} must be float32, got {scale.dtype}")
        if scale.shape == ():
            return "tensor"
        if scale.shape == per_row_shape:
            return per_row_name
        raise ValueError(f"{name}.shape={scale.shape} fits neither per-tensor () nor {per_row_shape}")

    return layout("q_scale", q_scale, q, (b, s, h), "token_head"), layout("k_scale", k_scale, keys, (b, c), "row")


def visible_entries(positions, rate: int, num_entries: int):
    """→ int32 visible-entry count per query: min(max((p + 1) // rate, 0), C)."""
    return jnp.clip((positions + 1) // rate, 0, num_entries)


def fold_scales(weights, softmax_scale, q_scale, k_scale, q_layout, k_layout):
    """Everything that scales a whole (token, head) row folds into the weights (ReLU commutes with scales > 0).
    → (weights, per-entry k_scale or None)."""
    weights = weights * softmax_scale
    if q_layout is not None:
        weights = weights * q_scale  # () or [B, S, Hi]
    if k_layout == "tensor":
        weights, k_scale = weights * k_scale, None
    return weights, k_scale


def topk_of_scores(scores, visible, k: int, select):
    """Top-k indices of masked scores [B, S, C] (any k: padded with -inf past C) → int32 [B, S, k], -1 past the
    visible count. select: (x, k) → (values, indices), `lax.top_k` or `dsv4.topk.top_k`."""
    c = scores.shape[-1]
    if k > c:  # top-k needs k <= C; the padding is never visible
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, k - c)), constant_values=NEG_INF)
    values, idx = select(scores, k)  # [B, S, k]
    return jnp.where(jnp.isneginf(values) | (idx >= visible[..., None]), -1, idx).astype(jnp.int32)


def check_paged_inputs(q, weights, positions, key_pages, key_scales, key_rope_pages, block_table) -> str | None:
    """Validates shapes and dtypes (ValueError naming the tensor). → the scale layout: None, "channel" or "tile"."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, S, Hi, Di], got shape {q.shape}")
    b, s, h, d = q.shape
    if q.dtype not in (jnp.bfloat16, jnp.float16, F32):
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if s > MAX_QUERIES:
        raise ValueError(f"q.shape={q.shape}: at most {MAX_QUERIES} queries a request (decode steps, short chunks); "
                         "score longer chunks over dense keys (dsv4.pallas.indexer.index_topk_two_pass)")
    if weights.shape != (b, s, h):
        raise ValueError(f"weights must be {(b, s, h)} for q.shape={q.shape}, got {weights.shape}")
    if positions.shape != (b, s) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integer {(b, s)}, got {positions.dtype} {positions.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != b or not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must be integer [B={b}, max_pages], got {block_table.dtype} "
                         f"{block_table.shape}")  # fmt: skip
    if key_pages.ndim != 3:
        raise ValueError(f"key_pages must be [pages, rows_per_page, n], got shape {key_pages.shape}")
    n = key_pages.shape[-1]
    if key_pages.dtype != FP8 and (key_pages.dtype != q.dtype or n != d):
        raise ValueError(f"unquantized key_pages must be {q.dtype} [P, R, {d}] (q's dtype and Di), got "
                         f"{key_pages.dtype} {key_pages.shape}")  # fmt: skip
    if key_rope_pages is not None:
        check_rope_pages(key_rope_pages, key_pages, d, "key_rope_pages", "key_pages")
    elif n != d:
        raise ValueError(f"key_pages.shape={key_pages.shape} holds {n} of q's Di = {d} channels: the other "
                         f"{d - n} come as key_rope_pages")  # fmt: skip
    return check_page_scales("key_scales", key_scales, key_pages, "key_pages", mixed=key_rope_pages is not None)
