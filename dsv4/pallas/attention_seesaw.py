"""The "seesaw" schedule of the Mosaic GPU prefill kernel (`MgpuConfig(schedule="seesaw")`, docs/KERNEL_NOTES.md
E18): the same attention as `attention_mgpu.py` (read its module docstring first), with the two consumer warpgroups
splitting the key tiles instead of the head dim.

The split-D schedule (the default) has each warpgroup compute half of every S = Q·Kᵀ, exchange the f32 partials
through SMEM (16 KiB a step each way) and run the same softmax twice; DC12 put that exchange and softmax at half of
a step, with the tensor core idle. Here (facts from FlashMLA's SM90 kernels, no code carried over):
- warpgroup 0 takes the even tiles a = 0, 2, ..., warpgroup 1 the odd ones b = 1, 3, ...; each computes its tile's
  whole S over all of D (Q's two halves both in SMEM, read by both) and its softmax, once;
- each still owns half of O's columns, O_w [64, D/2] f32: its own P multiplies its half of its tile's V from
  registers, the other's P (bf16, through SMEM) its half of the other's tile's V;
- what crosses per tile is P (bf16 [64, 64], 8 KiB) and the row max ([64] f32), not f32 logits.
Per pair (a, b), with m the running max both share (E18 v2; v1, each warpgroup's softmax after the other's, at
commit a9ca906, ran at 0.75x of split-D):
  both:  S_own (wg0: tile a, wg1: tile b); swap row maxima: m' = max(m, rowmax S_a, rowmax S_b)
         O_w, l_w rescaled by 2^(m - m'); P_own = 2^(S_own - m'); publish P_own (bf16, SMEM)
         O_w += P_own · V_own,w (registers); wait the other's P; O_w += P_other · V_other,w (SMEM)
Each softmax runs once, not twice, and only [64] maxima and bf16 P cross, not f32 logits. Each tile's slot has one
TMA barrier and one "free" barrier per D half: a half is released by the warpgroup whose P·V reads it last (a.L and
b.L by wg0, a.R and b.R by wg1), and the producer refills halves in the order they free (a.L, b.R, a.R, b.L);
warpgroup 0 starts its next Q·Kᵀ on the L half, warpgroup 1 on the R half. Row sums stay per warpgroup (the sink in
wg0's) and are added at the end.

One CTA per (token, 64 heads), not persistent; two ring slots (even tiles in slot 0, odd in slot 1). SMEM at D = 512:
Q 64 KiB + 2 tiles 128 KiB + 2 P tiles 16 KiB ≈ 209 KiB (no exchange buffer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
HEADS_PER_CTA = 64


def seesaw_kernel_call(q, kv, compressed, n_visible, sinks_log2, *, s_inner, s_outer, sliding_window, logit_scale,
                       kv_offset, config, interpret):  # fmt: skip
    """q [B, S_pad, H, D] (S_pad = s_inner · s_outer), kv and compressed padded as `v4_attention_mgpu_kernel_call`
    prepares them; n_visible [B, S_pad] int32 (ignored without compressed). → [B, S_pad, H, D]."""
    from dsv4.pallas.attention_mgpu import (
        _M_FLOOR,
        _SEMANTICS,
        pv_with_p_in_smem,
        swap_with_other,
        window_tiles,
    )

    b, s, h, d = q.shape
    hg = h // HEADS_PER_CTA
    dtype = q.dtype
    dh = d // 2
    bk = config.block_kv
    hca = compressed is not None
    interp_pv = config.pv_form == "interpret"
    compute_only = "compute_only" in config.debug  # timing form: tiles loaded for the first pair only

    def wait_loaded(step, bar):
        if compute_only:
            @pl.when(step < 2)
            def _():
                plgpu.barrier_wait(bar)
        else:
            plgpu.barrier_wait(bar)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(q_ref, kv_ref, comp_ref, nvis_ref, sinks_ref, o_ref, q_smem, kv_smem, p_smem, m_smem, l_smem, sink_smem,
             q_bar, sink_bar, kv_bar, free_bar, pub_bar, read_bar, mx_written, mx_read, l_written, l_read):  # fmt: skip
        wg = lax.axis_index("wg")
        tok = lax.axis_index("so") * s_inner + lax.axis_index("s")
        bh = lax.axis_index("bh")
        bi = lax.div(bh, jnp.int32(hg))
        h0 = lax.rem(bh, jnp.int32(hg)) * HEADS_PER_CTA
        n_vis = nvis_ref[bi, tok] if hca else jnp.int32(0)
        n_hca = lax.div(n_vis + (bk - 1), jnp.int32(bk))
        row = tok + kv_offset
        win_start, n_win = window_tiles(row, sliding_window, bk)
        n = n_hca + n_win  # >= 1 (every token has its own row)
        n_pairs = lax.div(n, jnp.int32(2))  # full (a, b) pairs; a lone a at the end when n is odd

        def half_of(step, half):  # (ring index, TMA barrier, free barrier) of step's tile half: slot = step % 2
            k = lax.rem(step, jnp.int32(2)) * 2 + half
            return kv_smem.at[k], kv_bar.at[k], free_bar.at[k]

        def issue(step, half):
            dst, bar, _ = half_of(step, half)
            cols = pl.ds(half * dh, dh)
            if hca:
                @pl.when(step < n_hca)
                def _():
                    plgpu.copy_gmem_to_smem(comp_ref.at[bi, pl.ds(step * bk, bk), cols], dst, bar)

                @pl.when(step >= n_hca)
                def _():
                    start = win_start + (step - n_hca) * bk
                    plgpu.copy_gmem_to_smem(kv_ref.at[bi, pl.ds(start, bk), cols], dst, bar)
            else:
                plgpu.copy_gmem_to_smem(kv_ref.at[bi, pl.ds(win_start + step * bk, bk), cols], dst, bar)

        def bounds(step):
            is_hca = step < n_hca
            base = jnp.where(is_hca, step * bk, win_start + (step - n_hca) * bk)
            lo = jnp.where(is_hca, 0, row - (sliding_window - 1))
            hi = jnp.where(is_hca, n_vis, row + 1)
            return base, lo, hi

        def consumer(w):
            plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[bi, tok, pl.ds(h0, HEADS_PER_CTA), pl.ds(w * dh, dh)], q_smem.at[w],
                                    q_bar.at[w])  # fmt: skip
            plgpu.copy_gmem_to_smem(sinks_ref.at[pl.ds(h0, HEADS_PER_CTA)], sink_smem.at[w], sink_bar.at[w])
            plgpu.barrier_wait(sink_bar.at[w])
            sink = plgpu.load(sink_smem.at[w], layout=row_layout)
            m = jnp.maximum(sink, _M_FLOOR)
            lsum = jnp.exp2(sink - m) * (1.0 if w == 0 else 0.0)  # the sink counted once, in wg0's sum (layout kept)
            acc = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, dh), F32), wgmma_layout)
            plgpu.barrier_wait(q_bar.at[0])
            plgpu.barrier_wait(q_bar.at[1])
            first, second = (0, 1) if w == 0 else (1, 0)  # wg0 starts Q·Kᵀ on the L half, wg1 on the R half

            def scores(step):
                def qk(acc_ref):
                    for half in (first, second):
                        kv_half, bar, _ = half_of(step, half)
                        wait_loaded(step, bar)
                        plgpu.wgmma(acc_ref, q_smem.at[half], kv_half.transpose((1, 0)))
                    return acc_ref[...]

                return pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, bk), F32))

            def tile_pair(k, a, b_, carry, *, has_b: bool):
                """Pair k: warpgroup 0's tile a and warpgroup 1's tile b_ (none in the lone tail, has_b False).
                Each scores its own tile, the two swap row maxima (one rendezvous), each takes exp2 against the
                common max, publishes its P, multiplies it into its O half from registers, then the other's P from
                SMEM; each frees the halves of V it read."""
                acc, m, lsum = carry
                own = w == 0 or has_b  # static
                if own:
                    step = a if w == 0 else b_
                    base, lo, hi = bounds(step)
                    col = plgpu.broadcasted_iota(jnp.int32, (HEADS_PER_CTA, bk), 1, layout=wgmma_layout) + base
                    logits = jnp.where((col >= lo) & (col < hi), scores(step) * logit_scale, -jnp.inf)
                    mine = jnp.maximum(m, logits.max(axis=1))
                else:
                    mine = m
                m_new = jnp.maximum(mine, swap_with_other(m_smem, w, mine, mx_written, mx_read, layout=row_layout,
                                                          wait_read=k > 0))  # fmt: skip
                alpha = jnp.exp2(m - m_new)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                lsum = lsum * alpha
                if own:
                    p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                    lsum = lsum + p.sum(axis=1)
                    p16 = p.astype(dtype)

                    @pl.when(k > 0)
                    def _():
                        plgpu.barrier_wait(read_bar.at[w])  # the other has multiplied our previous P

                    p_smem[w] = p16
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(pub_bar.at[w])
                    kv_half, _, free = half_of(step, w)
                    if interp_pv:
                        acc = pv_with_p_in_smem(acc, p_smem.at[w], kv_half, in_place=False)
                    else:
                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, p16, kv_half)

                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(free)
                if w == 1 or has_b:  # the other's tile
                    kv_half, bar, free = half_of(b_ if w == 0 else a, w)
                    plgpu.barrier_wait(pub_bar.at[1 - w])
                    wait_loaded(b_ if w == 0 else a, bar)
                    acc = pv_with_p_in_smem(acc, p_smem.at[1 - w], kv_half, in_place=not interp_pv)
                    plgpu.barrier_arrive(read_bar.at[1 - w])
                    plgpu.barrier_arrive(free)
                return acc, m_new, lsum

            carry = lax.fori_loop(0, n_pairs, lambda k, c: tile_pair(k, 2 * k, 2 * k + 1, c, has_b=True),
                                  (acc, m, lsum))  # fmt: skip
            acc, m, lsum = lax.cond(lax.rem(n, jnp.int32(2)) == 1,  # n odd: the last tile, warpgroup 0's, alone
                                    lambda c: tile_pair(n_pairs, n - 1, n, c, has_b=False), lambda c: c, carry)
            plgpu.barrier_wait(mx_read)  # the last maxima swap's phase (barrier discipline)
            # Observe the last phase of the barrier the other arrives on after reading our P (barrier discipline;
            # warpgroup 1 has no tile when n = 1).
            @pl.when((n_pairs > 0) if w == 1 else True)
            def _():
                plgpu.barrier_wait(read_bar.at[w])

            lsum = lsum + swap_with_other(l_smem, w, lsum, l_written, l_read, layout=row_layout)
            plgpu.barrier_wait(l_read)
            # Both warpgroups are past every Q·Kᵀ (each arrived on l_written after its last): Q's buffers are free.
            inv = jnp.where(lsum > 0, 1.0 / lsum, 0.0)
            q_smem[w] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[w], o_ref.at[bi, tok, pl.ds(h0, HEADS_PER_CTA), pl.ds(w * dh, dh)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 0)
        def _():
            consumer(0)

        @pl.when(wg == 1)
        def _():
            consumer(1)

        @pl.when(wg == 2)
        def _():
            plgpu.set_max_registers(40, action="decrease")

            def refill(step, half):
                @pl.when(step < n)
                def _():
                    @pl.when(step >= 2)
                    def _():
                        plgpu.barrier_wait(half_of(step, half)[2])

                    if compute_only:
                        @pl.when(step < 2)
                        def _():
                            issue(step, half)
                    else:
                        issue(step, half)

            @pl.loop(0, n_pairs + 1)
            def _(k):  # in the order the halves free (each warpgroup's own first): a.L, b.R, a.R, b.L
                a, b_ = 2 * k, 2 * k + 1
                refill(a, 0)
                refill(b_, 1)
                refill(a, 1)
                refill(b_, 0)

            # Drain: observe the last release of every half that was loaded.
            for step in (n - 1, n - 2):
                @pl.when(step >= 0)
                def _():
                    for half in range(2):
                        plgpu.barrier_wait(half_of(step, half)[2])

    def tiled(minor, itemsize=jnp.dtype(dtype).itemsize):
        return plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(minor * itemsize)

    minor = 128 // jnp.dtype(dtype).itemsize
    scratch = [
        plgpu.SMEM((2, HEADS_PER_CTA, dh), dtype, transforms=tiled(minor)),  # Q halves, then O halves
        plgpu.SMEM((4, bk, dh), dtype, transforms=tiled(minor)),  # KV ring: [slot · 2 + half], slot = tile % 2
        plgpu.SMEM((2, HEADS_PER_CTA, bk), dtype, transforms=tiled(min(bk, minor))),  # P of each warpgroup's tile
        plgpu.SMEM((2, HEADS_PER_CTA), F32),  # each warpgroup's row maxima of the pair
        plgpu.SMEM((2, HEADS_PER_CTA), F32),  # row sums, swapped at the end
        plgpu.SMEM((2, HEADS_PER_CTA), F32),  # sinks (log2 domain), one copy per consumer
        plgpu.Barrier(num_barriers=2),  # q halves
        plgpu.Barrier(num_barriers=2),  # sinks
        plgpu.Barrier(num_barriers=4),  # kv halves full
        plgpu.Barrier(num_arrivals=1, num_barriers=4),  # kv halves free
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # (m, P) of warpgroup w published
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # P of warpgroup w read by the other
        plgpu.Barrier(num_arrivals=2),  # row maxima written
        plgpu.Barrier(num_arrivals=2),  # row maxima read
        plgpu.Barrier(num_arrivals=2),  # row sums written
        plgpu.Barrier(num_arrivals=2),  # row sums read
    ]
    args = (q, kv, *((compressed, n_visible) if hca else ()), sinks_log2)

    def kernel_body(*refs):
        if hca:
            q_ref, kv_ref, comp_ref, nvis_ref, sinks_ref, o_ref, *scr = refs
        else:
            (q_ref, kv_ref, sinks_ref, o_ref, *scr), comp_ref, nvis_ref = refs, None, None
        return body(q_ref, kv_ref, comp_ref, nvis_ref, sinks_ref, o_ref, *scr)

    return plgpu.kernel(
        kernel_body,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=scratch,
        grid=(s_inner, s_outer, b * hg),
        grid_names=("s", "so", "bh"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math,
                                             reduction_scratch_bytes=config.reduction_scratch_bytes,
                                             lowering_semantics=_SEMANTICS[config.semantics],
                                             unsafe_no_auto_barriers=not config.auto_barriers),
        interpret=interpret,
    )(*args)
