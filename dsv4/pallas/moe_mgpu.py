"""Grouped expert GEMMs for Hopper: Mosaic GPU (wgmma, TMA ring, warp specialization), bf16 and W8A8.

The same functions as `moe.py`'s Triton kernels (`grouped_gate_up`, `grouped_down`, `routed_experts`), laid out
for the tensor core instead of for masked loads:

    tokens ──sort by expert──▶ padded rows: each expert's rows start on a TILE_M boundary; tile t has one expert
    x_pad [Mp, D] ──gate_up──▶ h [Mp, I] = silu(min(x·Wgᵀ, L)) · clip(x·Wuᵀ, ±L)      (SwiGLU fused)
    h     [Mp, I] ──down─────▶ y [Mp, D] = h·Wdᵀ  (bf16 in `routed_experts_mgpu`; the routing weight is applied in
                                                      the combine, in f32)

NOTE (padding in memory, unlike the Triton kernels): a TMA store writes whole boxes, so a CTA tile must not end
inside another expert's rows. Each expert's group is padded to a multiple of TILE_M = 128 rows in the sorted
layout (`padded_layout`): at most min(E, pairs) · 127 extra rows, 8% at 64K tokens top-6 over 256 experts, and the
same work the Triton kernel's tiles do anyway. Pad rows gather token 0 (finite values); their outputs are never
read.

One kernel body serves both GEMMs. A CTA tile is 128 rows × two 128-row "parts" of one expert's weight: gate and
up (gate_up, columns c·128 of h), or the two halves of 256 output columns (down). Per K step one TMA brings the x
tile [128, bk] and one each part [128, bk] (K-major, as the checkpoint stores them) into a ring slot:

    producer warpgroup:  for each work item (m tile, n tile) of this CTA, for each K step: wait slot free → 3 TMAs
    consumer wg w=0,1:   rows w·64..w·64+63: wgmma(acc_a, x, partAᵀ), wgmma(acc_b, x, partBᵀ) → release slot
                         epilogue: registers → SMEM → TMA store (overlaps the producer's next tile)

The grid is persistent: min(#SMs, items) CTAs walk the items c, c + G, c + 2G, ... in n-fastest order, so the CTAs
of one wave share x tiles and one expert's weights in L2. Items whose m tile is past the used tiles are skipped
by both sides (their expert id is -1).

FP8 (W8A8, DeepSeek's format): x fp8 with per-token 128-group scales, weights fp8 with 128 × 128 block scales. bk =
128 = one scale block with scale s_k = x_scale[row] · w_scale[block]. By default ("rescale") the f32 totals are kept
in units of s_k: a step multiplies them by s_(k-1) / s_k and both parts' wgmmas accumulate into them in place; the
epilogue multiplies by the last s_k. ("promote", DeepGEMM's form: each step's wgmma into a fresh accumulator,
`total += part · s_k`, one part after the other; `MgpuMoeConfig.fp8_acc`.) The step's x scales travel with the x
tile through the ring (one [128] f32 TMA); the weight scale is one scalar load.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4.pallas._device import sm_count
from dsv4.pallas.moe_common import AMAX_FLOOR, FP8, FP8_MAX, QUANT_BLOCK, quantize_per_token_group

__all__ = [
    "PART_N",
    "TILE_M",
    "MgpuMoeConfig",
    "default_num_slots",
    "gather_rows",
    "grouped_down_mgpu",
    "grouped_gate_up_mgpu",
    "mgpu_moe_unsupported",
    "padded_layout",
    "routed_experts_mgpu",
]

F32 = jnp.float32
TILE_M = 128  # rows per CTA tile: two consumer warpgroups × 64 (one wgmma M)
PART_N = 128  # weight rows per part; a CTA tile reads two parts
_ACC_FORMS = ("in_place", "per_step")
_FP8_ACCS = ("promote", "rescale")
# The rescale form's floor on a step's combined scale, so that the ratio of two steps' scales stays finite; a block
# whose weight scale is 0 holds zero weights, whose product is 0 at any scale.
_RESCALE_FLOOR = 2.0**-64
# The promote form's FP8 down ring is 2 slots deep below this many row tiles an expert, 3 above: on an H100, with
# 256 experts at 3.4 tiles each (a 16K-token chunk, top-6) 2 slots ran 1.56x faster than 3; with 32 experts at 27
# tiles each, 3 ran 1.05x faster than 2 (docs/kernels/moe.md, "Ring depth"). The threshold lies between them. The
# rescale form's down ran faster with 3 slots at 3.4 tiles too (1.19x), so it takes 3.
FEW_TILES_PER_EXPERT = 8


def default_num_slots(*, gate_up: bool, fp8: bool, m_tiles: int, experts: int, fp8_acc: str = "rescale") -> int:
    """The ring depth `MgpuMoeConfig(num_slots=None)` takes (docs/kernels/moe.md, "Ring depth"): gate_up 4 in FP8,
    3 in bf16 (1.06-1.13x faster than 4 on an H200 at 8K-64K tokens, 1.63x on an H100 at 16K); down 3, but 2 in FP8
    under the promote accumulation when its m_tiles row tiles give each of the experts fewer than
    `FEW_TILES_PER_EXPERT`."""
    if gate_up:
        return 4 if fp8 else 3
    return 2 if fp8 and fp8_acc == "promote" and m_tiles < FEW_TILES_PER_EXPERT * experts else 3


@dataclasses.dataclass(frozen=True)
class MgpuMoeConfig:
    """Launch parameters of the Mosaic grouped GEMMs.

    num_slots: ring stages (each holds x [128, bk] and two weight parts [128, bk]: 48 KiB for bf16 at bk = 64 and
               for fp8 at bk = 128). None: `default_num_slots`, the depths measured fastest: gate_up 4 in FP8, 3 in
               bf16; down 3 (y staging up to 64 KiB; with bf16 y, 4 fit too, and measured slower), but 2 for a
               promote-form FP8 down whose rows give each expert fewer than `FEW_TILES_PER_EXPERT` row tiles.
    num_ctas:  persistent CTAs (None: the device's SM count).
    acc_form:  bf16 only. "in_place" (the default): the wgmma accumulates over all K steps in its accumulator;
               "per_step": a fresh accumulator per step, added in registers: the form the fp8 path always uses
               (it scales each step), kept for bf16 as the slower alternative measured (docs/kernels/moe.md).
               Both run in the CPU Mosaic interpreter.
    fp8_acc:   FP8 only: how each K step's block scales enter the float32 total. "rescale" (the default): the
               totals are kept in units of the current step's scale s_k (x's row scale times the part's weight block
               scale), so a step multiplies them by s_(k-1) / s_k in registers and both parts' wgmmas accumulate into
               them in place, issued back to back; the epilogue multiplies by the last s_k. "promote" (DeepGEMM's
               form): each part's wgmma into a fresh accumulator, waited for and added as part · scale into the
               total, one part after the other. The same sum, rounded differently (one multiply a step instead of
               one multiply-add); rescale measured 1.16x the promote form on a 16K-token chunk's experts (H100,
               docs/kernels/moe.md, "Rescaled accumulation"). The CPU interpreter runs the in-place wgmmas as a
               fresh accumulator plus an add.
    profile_dir: measurement switch, off ("") in use: a folder for Mosaic GPU's trace of each warpgroup's phases,
               one JSON a launch (`*-trace.json`; `scripts/bench_moe.py --mosaic-trace` writes and reads them).
               The consumers record each item's "k_loop" and "epilogue", the producer each item's "loads" (issuing
               its TMAs, waiting for free slots). The trace lives in shared memory: profile_ranges ranges a
               warpgroup (16 B each) are kept, the rest dropped, so it covers each CTA's first items.
    """

    num_slots: int | None = None
    num_ctas: int | None = None
    acc_form: str = "in_place"
    fp8_acc: str = "rescale"
    profile_dir: str = ""
    profile_ranges: int = 256

    def __post_init__(self):
        if self.num_slots is not None and not 2 <= self.num_slots <= 6:
            raise ValueError(f"MgpuMoeConfig.num_slots={self.num_slots} must be in 2..6")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"MgpuMoeConfig.num_ctas={self.num_ctas} must be >= 1")
        if self.acc_form not in _ACC_FORMS:
            raise ValueError(f"MgpuMoeConfig.acc_form={self.acc_form!r} must be one of {_ACC_FORMS}")
        if self.fp8_acc not in _FP8_ACCS:
            raise ValueError(f"MgpuMoeConfig.fp8_acc={self.fp8_acc!r} must be one of {_FP8_ACCS}")
        if self.profile_ranges < 1:
            raise ValueError(f"MgpuMoeConfig.profile_ranges={self.profile_ranges} must be >= 1")


def _tiled(minor: int, itemsize: int):
    return plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(minor * itemsize)


# ---------------------------------------------------------------------------------------------
# Layout: expert groups padded to TILE_M rows.
# ---------------------------------------------------------------------------------------------
def padded_layout(flat_ids: jax.Array, num_experts: int, block_m: int = TILE_M):
    """Pairs → padded sorted rows. flat_ids [P] int32 (ids outside [0, E) are dropped: no row).

    → (src_pair [Mp] int32: the pair each padded row holds (pad rows: pair 0),
       row_of_pair [P] int32: the padded row of each pair (Mp for a dropped pair),
       tile_expert [T] int32: the expert of row tile t, -1 past the used tiles),
    with T = (P + min(E, P) · (block_m - 1)) // block_m static and Mp = T · block_m: at most min(E, P) groups are
    non-empty, so sum_e ceil(g_e / bm) ≤ T (a decode step's 6 pairs take 6 tiles, not E).
    """
    p = flat_ids.shape[0]
    e = num_experts
    ids = jnp.where((flat_ids >= 0) & (flat_ids < e), flat_ids, e).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)  # sorted row r holds pair order[r]
    sorted_ids = ids[order]
    sizes = jnp.bincount(ids, length=e).astype(jnp.int32)  # [E]; id E (dropped) is not counted
    padded = (sizes + block_m - 1) // block_m * block_m
    pad_end = jnp.cumsum(padded)
    pad_start, start = pad_end - padded, jnp.cumsum(sizes) - sizes
    num_tiles = (p + min(e, p) * (block_m - 1)) // block_m
    mp = num_tiles * block_m
    ec = jnp.minimum(sorted_ids, e - 1)
    prow = jnp.where(sorted_ids < e, pad_start[ec] + jnp.arange(p, dtype=jnp.int32) - start[ec], mp)  # [P] by row
    src_pair = jnp.zeros((mp,), jnp.int32).at[prow].set(order, mode="drop")
    row_of_pair = jnp.zeros((p,), jnp.int32).at[order].set(prow.astype(jnp.int32))
    t0 = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    tile_expert = jnp.where(t0 < pad_end[-1], jnp.searchsorted(pad_end, t0, side="right"), -1).astype(jnp.int32)
    return src_pair, row_of_pair, tile_expert


# ---------------------------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------------------------
def _grouped_call(x, w, tile_expert, x_scales_t, w_scales, *, gate_up: bool, limit, out_dtype,
                  config: MgpuMoeConfig, interpret, quantize_out: bool = False):  # fmt: skip
    """x [Mp, K] (bf16 / f16, or fp8 with x_scales_t [K // 128, Mp]); w [E, N_all, K] (x's dtype, or fp8 with
    w_scales [E, N_all // 128, K // 128]); tile_expert [Mp // 128]. → [Mp, N_out] (gate_up: N_out = N_all / 2).
    quantize_out (gate_up): → (fp8 [Mp, N_out], scales_t [N_out // 128, Mp] f32), quantized per row and 128-group
    as `quantize_per_token_group` does to h rounded to out_dtype."""
    mp, k = x.shape
    n_all = w.shape[1]
    fp8 = x.dtype == FP8
    itemsize = jnp.dtype(x.dtype).itemsize
    bk = 128 // itemsize  # one 128-byte swizzle row: 64 bf16, 128 fp8 (= one scale block)
    k_steps = k // bk
    half_n = n_all // 2
    n_out = half_n if gate_up else n_all
    n_tiles = n_out // PART_N if gate_up else n_out // (2 * PART_N)
    m_tiles = mp // TILE_M
    items = m_tiles * n_tiles
    num_ctas = max(1, min(config.num_ctas or sm_count(), items))
    slots = config.num_slots or default_num_slots(gate_up=gate_up, fp8=fp8, m_tiles=m_tiles, experts=w.shape[0],
                                                      fp8_acc=config.fp8_acc)  # fmt: skip
    per_step = fp8 or config.acc_form == "per_step"
    store_dtype = FP8 if quantize_out else out_dtype
    out_itemsize = jnp.dtype(store_dtype).itemsize
    half_rows = TILE_M // 2
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = wgmma_layout.reduce(1)

    def part_rows(nt):
        """First weight rows of part A and part B of n tile nt."""
        if gate_up:
            return nt * PART_N, half_n + nt * PART_N
        return nt * 2 * PART_N, nt * 2 * PART_N + PART_N

    def body(te_ref, x_ref, w_ref, xs_ref, ws_ref, out_ref, os_ref, x_smem, a_smem, b_smem, xs_smem, o_smem, os_smem,
             full_bar, consumed_bar):  # fmt: skip
        c, wg = lax.axis_index("c"), lax.axis_index("wg")
        n_mine = lax.div(jnp.int32(items) - c + (num_ctas - 1), jnp.int32(num_ctas))

        def item_at(j):
            item = c + j * num_ctas
            mt, nt = lax.div(item, jnp.int32(n_tiles)), lax.rem(item, jnp.int32(n_tiles))
            return mt, nt, te_ref[mt]

        def consumer(wi):
            plgpu.set_max_registers(232, action="increase")
            rows = pl.ds(wi * half_rows, half_rows)

            def row_bcast(v):  # a [64] row vector over a part's [64, 128] columns
                return lax.broadcast_in_dim(v, (half_rows, PART_N), [0])

            def zeros():  # a part's [64, 128] f32 total, empty
                return plgpu.layout_cast(jnp.zeros((half_rows, PART_N), F32), wgmma_layout)

            def weight_scale(e, row0, ks):  # the block scale of expert e's weight rows row0.. at K step ks (GMEM)
                return ws_ref[e, lax.div(row0, QUANT_BLOCK), ks]

            def step_scales(slot, w_a, w_b):
                """The rescale form's combined scale of a step for each part: x's row scales × the part's weight
                block scale, floored (`_RESCALE_FLOOR`)."""
                xs = plgpu.load(xs_smem.at[slot, rows], layout=row_layout)  # [64] this step's x scales
                return jnp.maximum(xs * w_a, _RESCALE_FLOOR), jnp.maximum(xs * w_b, _RESCALE_FLOOR)

            def wait_step(s):
                slot = lax.rem(s, jnp.int32(slots))
                plgpu.barrier_wait(full_bar.at[slot])
                return slot

            def mma(slot, acc_a, acc_b):
                xt = x_smem.at[slot].at[rows]
                plgpu.wgmma(acc_a, xt, a_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(acc_b, xt, b_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed_bar.at[slot])

            def fresh(slot, smem):
                def run(acc_ref):
                    plgpu.wgmma(acc_ref, x_smem.at[slot].at[rows], smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                return pl.run_scoped(run, plgpu.ACC((half_rows, PART_N), F32))

            def accumulate(slot, tot_a, tot_b):
                """tot_a + x · partAᵀ, tot_b + x · partBᵀ: both wgmmas in place, issued back to back, then waited."""
                xt = x_smem.at[slot].at[rows]
                if interpret is not None:  # the CPU interpreter's wgmma takes a fresh accumulator only
                    return tot_a + fresh(slot, a_smem), tot_b + fresh(slot, b_smem)

                def run(accs):
                    acc_a, acc_b = accs
                    plgpu.wgmma(acc_a, xt, a_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(acc_b, xt, b_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma_wait(0)

                return pl.run_state(run)((plgpu.ACC.init(tot_a), plgpu.ACC.init(tot_b)))

            def rescaled_totals(step, e, a0, b0):
                """`MgpuMoeConfig.fp8_acc="rescale"`: the K loop with the totals in units of the step's scale."""
                def k_body(ks, carry):
                    tot_a, tot_b, s_a, s_b = carry
                    slot = wait_step(step + ks)
                    new_a, new_b = step_scales(slot, weight_scale(e, a0, ks), weight_scale(e, b0, ks))
                    tot_a, tot_b = accumulate(slot, tot_a * row_bcast(s_a / new_a), tot_b * row_bcast(s_b / new_b))
                    plgpu.barrier_arrive(consumed_bar.at[slot])
                    return tot_a, tot_b, new_a, new_b

                one = plgpu.layout_cast(jnp.ones((half_rows,), F32), row_layout)
                tot_a, tot_b, s_a, s_b = lax.fori_loop(0, k_steps, k_body, (zeros(), zeros(), one, one))
                return tot_a * row_bcast(s_a), tot_b * row_bcast(s_b)

            def tile_result(step, e, nt):
                """The K loop of one item → (part A, part B) [64, 128] f32 in registers."""
                if not per_step:

                    def run(acc_a, acc_b):
                        @pl.loop(0, k_steps)
                        def _(ks):
                            mma(wait_step(step + ks), acc_a, acc_b)

                        return acc_a[...], acc_b[...]

                    return pl.run_scoped(run, plgpu.ACC((half_rows, PART_N), F32),
                                         plgpu.ACC((half_rows, PART_N), F32))  # fmt: skip
                a0, b0 = part_rows(nt)
                if fp8 and config.fp8_acc == "rescale":
                    return rescaled_totals(step, e, a0, b0)

                def k_body(ks, totals):
                    tot_a, tot_b = totals
                    slot = wait_step(step + ks)
                    part_a = fresh(slot, a_smem)
                    if fp8:
                        xs = plgpu.load(xs_smem.at[slot, rows], layout=row_layout)  # [64] this step's x scales

                        def promote(total, part, w_row0):
                            row_scale = xs * weight_scale(e, w_row0, ks)  # [64]
                            return total + part * row_bcast(row_scale)

                        tot_a = promote(tot_a, part_a, a0)
                    else:
                        tot_a = tot_a + part_a
                    part_b = fresh(slot, b_smem)
                    plgpu.barrier_arrive(consumed_bar.at[slot])
                    if fp8:
                        tot_b = promote(tot_b, part_b, b0)
                    else:
                        tot_b = tot_b + part_b
                    return tot_a, tot_b

                return lax.fori_loop(0, k_steps, k_body, (zeros(), zeros()))

            def store(value, mt, col):
                """value [64, 128] f32 → out rows of this warpgroup, columns col.. (fp8 + scales if quantize_out),
                through this warpgroup's staging buffer, once the last store has read it."""
                out_rows = pl.ds(mt * TILE_M + wi * half_rows, half_rows)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if quantize_out:  # quantize_per_token_group of the out_dtype-rounded row group
                    value = value.astype(out_dtype).astype(F32)
                    scale = jnp.maximum(jnp.abs(value).max(axis=1), AMAX_FLOOR) / FP8_MAX  # [64]
                    value = value / lax.broadcast_in_dim(scale, value.shape, [0])
                    os_smem[wi] = scale
                o_smem[wi] = value.astype(store_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wi], out_ref.at[out_rows, pl.ds(col, PART_N)])
                if quantize_out:
                    plgpu.copy_smem_to_gmem(os_smem.at[wi], os_ref.at[lax.div(col, PART_N), out_rows])

            def item_fn(j, step):
                mt, nt, e = item_at(j)

                @pl.when(e >= 0)
                def _():
                    with jax.named_scope("k_loop"):  # named scopes: ranges of the trace (config.profile_dir)
                        part_a, part_b = tile_result(step, e, nt)
                    with jax.named_scope("epilogue"):
                        if gate_up:
                            g = jnp.minimum(part_a, limit)
                            store(g / (1.0 + jnp.exp(-g)) * jnp.clip(part_b, -limit, limit), mt, nt * PART_N)
                        else:
                            store(part_a, mt, nt * 2 * PART_N)
                            store(part_b, mt, nt * 2 * PART_N + PART_N)

                return step + jnp.where(e >= 0, k_steps, 0)

            lax.fori_loop(0, n_mine, item_fn, jnp.int32(0))
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

            def item_fn(j, step):
                mt, nt, e = item_at(j)
                a0, b0 = part_rows(nt)

                @pl.when(e >= 0)
                @jax.named_scope("loads")
                def _():
                    @pl.loop(0, k_steps)
                    def _(ks):
                        s = step + ks
                        slot = lax.rem(s, jnp.int32(slots))

                        @pl.when(s >= slots)
                        def _():
                            plgpu.barrier_wait(consumed_bar.at[slot])

                        cols = pl.ds(ks * bk, bk)
                        bar = full_bar.at[slot]
                        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(mt * TILE_M, TILE_M), cols], x_smem.at[slot], bar)
                        plgpu.copy_gmem_to_smem(w_ref.at[e, pl.ds(a0, PART_N), cols], a_smem.at[slot], bar)
                        plgpu.copy_gmem_to_smem(w_ref.at[e, pl.ds(b0, PART_N), cols], b_smem.at[slot], bar)
                        if fp8:
                            plgpu.copy_gmem_to_smem(xs_ref.at[ks, pl.ds(mt * TILE_M, TILE_M)], xs_smem.at[slot], bar)

                return step + jnp.where(e >= 0, k_steps, 0)

            total = lax.fori_loop(0, n_mine, item_fn, jnp.int32(0))

            @pl.loop(jnp.maximum(total - slots, 0), total)  # observe the consumers' last releases
            def _(s):
                plgpu.barrier_wait(consumed_bar.at[lax.rem(s, jnp.int32(slots))])

    tiled_in = _tiled(bk, itemsize)
    out_minor = 128 // out_itemsize
    copies = 4 if fp8 else 3
    scratch = [
        plgpu.SMEM((slots, TILE_M, bk), x.dtype, transforms=tiled_in),
        plgpu.SMEM((slots, PART_N, bk), w.dtype, transforms=tiled_in),
        plgpu.SMEM((slots, PART_N, bk), w.dtype, transforms=tiled_in),
        plgpu.SMEM((2, half_rows, PART_N), store_dtype, transforms=_tiled(out_minor, out_itemsize)),
        plgpu.Barrier(num_arrivals=copies, num_barriers=slots),  # slot full: every TMA of the step has landed
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # slot consumed by both consumer warpgroups
    ]
    # Only the buffers this build uses: every buffer is aligned to 1 KiB, and with a stub down's fourth ring slot
    # (bf16 y) missed an H200's shared memory by 64 bytes.
    if fp8:
        scratch.append(plgpu.SMEM((slots, TILE_M), F32))  # x scales of the step
    if quantize_out:
        scratch.append(plgpu.SMEM((2, half_rows), F32))  # the quantized output's row scales

    def kernel_body(te_ref, x_ref, w_ref, *rest):
        xs_ref, ws_ref, rest = (rest[0], rest[1], rest[2:]) if fp8 else (None, None, rest)
        out_ref, os_ref, scr = (rest[0], rest[1], rest[2:]) if quantize_out else (rest[0], None, rest[1:])
        x_smem, a_smem, b_smem, o_smem, full_bar, consumed_bar, *extra = scr
        xs_smem = extra.pop(0) if fp8 else None
        os_smem = extra.pop(0) if quantize_out else None
        return body(te_ref, x_ref, w_ref, xs_ref, ws_ref, out_ref, os_ref, x_smem, a_smem, b_smem, xs_smem, o_smem,
                    os_smem, full_bar, consumed_bar)  # fmt: skip

    args = (tile_expert, x, w) + ((x_scales_t, w_scales) if fp8 else ())
    profile = {}
    if config.profile_dir:
        profile = dict(profile_space=config.profile_ranges, profile_dir=config.profile_dir, profile_bounds_check=True)
    out_type = jax.ShapeDtypeStruct((mp, n_out), store_dtype)
    if quantize_out:
        out_type = (out_type, jax.ShapeDtypeStruct((n_out // QUANT_BLOCK, mp), F32))
    return plgpu.kernel(
        kernel_body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("c",),
        num_threads=3,
        thread_name="wg",
        # NOTE: exact math: the quantizing epilogue divides by the scale exactly as quantize_per_token_group does.
        compiler_params=plgpu.CompilerParams(approx_math=False, lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             **profile),
        interpret=interpret,
    )(*args)


# ---------------------------------------------------------------------------------------------
# Public entries.
# ---------------------------------------------------------------------------------------------
def mgpu_moe_unsupported(d: int, i: int, *, w_dtype, x_dtype, fp8_activations: bool = True) -> str:
    """Why the Mosaic path cannot run these shapes / dtypes ("" when it can)."""
    if d % (2 * PART_N) or i % PART_N:
        return f"hidden size D={d} must be a multiple of {2 * PART_N} and I={i} of {PART_N}"
    if w_dtype == FP8:
        if not fp8_activations:
            return "FP8 weights with bf16 activations (W8A16) are Triton-only"
        return ""
    if w_dtype != x_dtype or w_dtype not in (jnp.bfloat16, jnp.float16):
        return f"weights {jnp.dtype(w_dtype)} with activations {jnp.dtype(x_dtype)}: bf16 / f16 (same) or FP8 weights"
    return ""


def _check_weights(x, w, w_scales, name):
    if x.ndim != 2 or w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"{name}: expected x [Mp, K] and weights [E, N, K], got {x.shape} and {w.shape}")
    if x.shape[0] % TILE_M:
        raise ValueError(f"{name}: rows Mp={x.shape[0]} must be a multiple of {TILE_M} (padded_layout)")
    if (x.dtype == FP8) != (w.dtype == FP8) or (w.dtype == FP8) != (w_scales is not None):
        raise ValueError(f"{name}: FP8 needs fp8 x with x scales and fp8 weights with block scales, got x {x.dtype}, "
                         f"weights {w.dtype}, scales {'given' if w_scales is not None else 'none'}")  # fmt: skip


@functools.partial(jax.jit, static_argnames=("limit", "quantize_out", "config", "interpret"))
def grouped_gate_up_mgpu(x_pad, gate_up, tile_expert, *, limit: float, x_scales=None, gate_up_scales=None,
                         quantize_out: bool = False, config: MgpuMoeConfig = MgpuMoeConfig(),
                         interpret=None):  # fmt: skip
    """h = silu(min(x·Wgᵀ, limit)) · clip(x·Wuᵀ, ±limit) per padded row tile's expert. → [Mp, I] bf16 (x's dtype).

    x_pad [Mp, D] in `padded_layout` order (bf16 / f16, or fp8 with x_scales [Mp, D // 128] f32); gate_up
    [E, 2I, D] (x's dtype, or fp8 with gate_up_scales [E, 2I // 128, D // 128]); tile_expert [Mp // 128] int32.
    Rows of tiles whose expert is -1 are not written. quantize_out: → (float8_e4m3fn [Mp, I], f32 scales
    [Mp, I // 128]) = `quantize_per_token_group` of that h, computed in the epilogue (W8A8's input to down).
    """
    _check_weights(x_pad, gate_up, gate_up_scales, "grouped_gate_up_mgpu")
    out_dtype = jnp.bfloat16 if x_pad.dtype == FP8 else x_pad.dtype
    xs_t = None if x_scales is None else x_scales.T
    out = _grouped_call(x_pad, gate_up, tile_expert, xs_t, gate_up_scales, gate_up=True, limit=float(limit),
                        out_dtype=out_dtype, config=config, interpret=interpret, quantize_out=quantize_out)  # fmt: skip
    return (out[0], out[1].T) if quantize_out else out


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def grouped_down_mgpu(h_pad, down, tile_expert, *, h_scales=None, down_scales=None,
                      config: MgpuMoeConfig = MgpuMoeConfig(), interpret=None, out_dtype=F32):  # fmt: skip
    """y = h·Wdᵀ per padded row tile's expert, accumulated in float32 and stored as out_dtype (float32, or bf16 /
    f16: half the bytes written and read back by the combine). → [Mp, D]. Arguments as `grouped_gate_up_mgpu`."""
    _check_weights(h_pad, down, down_scales, "grouped_down_mgpu")
    if jnp.dtype(out_dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"grouped_down_mgpu: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    xs_t = None if h_scales is None else h_scales.T
    return _grouped_call(h_pad, down, tile_expert, xs_t, down_scales, gate_up=False, limit=None,
                         out_dtype=jnp.dtype(out_dtype), config=config, interpret=interpret)  # fmt: skip


def gather_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x[rows] for x [N, D] of 1- or 2-byte elements, gathered as uint32 words: XLA's gather moves one element a
    thread, so fp8 rows go 4× wider: 0.438 against 0.767 ms for a 16K-token chunk's rows on an H100
    (docs/kernels/moe.md)."""
    n, d = x.shape
    per_word = 4 // x.dtype.itemsize
    if x.dtype.itemsize >= 4 or d % per_word:
        return x[rows]
    words = lax.bitcast_convert_type(x.reshape(n, d // per_word, per_word), jnp.uint32)  # [N, D / per_word]
    return lax.bitcast_convert_type(words[rows], x.dtype).reshape(rows.shape[0], d)


@functools.partial(jax.jit, static_argnames=("limit", "config", "interpret", "out_dtype"))
def routed_experts_mgpu(x, expert_ids, weights, gate_up, down, limit: float, *, gate_up_scales=None, down_scales=None,
                        x_scales=None, config: MgpuMoeConfig = MgpuMoeConfig(), interpret=None,
                        out_dtype=None):  # fmt: skip
    """`moe.routed_experts` on the Mosaic kernels (bf16 / f16, or W8A8 with FP8 weights). → [N, D].

    Checks are `moe.routed_experts`'s (call that with impl="mgpu" for them); this is the composition:
    padded_layout → gather (quantized per token first for W8A8, unless x comes quantized with x_scales) → gate_up
    (W8A8: h quantized in its epilogue) → down → combine. down stores y in bf16 (x's dtype for bf16 / f16 weights),
    as the reference's experts return theirs; the combine gathers each pair's row of y through row_of_pair, scales
    it by the routing weight in f32 and sums a token's pairs; a dropped pair (id outside [0, E)) adds 0.
    """
    n, k = expert_ids.shape
    d = x.shape[1]
    flat_ids = expert_ids.reshape(-1)
    src_pair, row_of_pair, tile_expert = padded_layout(flat_ids, gate_up.shape[0])
    src_token = src_pair // k
    w8a8 = gate_up.dtype == FP8
    if w8a8:
        xq, xs = (x, x_scales) if x_scales is not None else quantize_per_token_group(x)
        hq, hs = grouped_gate_up_mgpu(gather_rows(xq, src_token), gate_up, tile_expert, limit=limit,
                                      x_scales=xs[src_token], gate_up_scales=gate_up_scales, quantize_out=True,
                                      config=config, interpret=interpret)  # fmt: skip
        y = grouped_down_mgpu(hq, down, tile_expert, h_scales=hs, down_scales=down_scales, config=config,
                              interpret=interpret, out_dtype=jnp.bfloat16)  # fmt: skip
    else:
        h = grouped_gate_up_mgpu(gather_rows(x, src_token), gate_up, tile_expert, limit=limit, config=config,
                                 interpret=interpret)  # fmt: skip
        y = grouped_down_mgpu(h, down, tile_expert, config=config, interpret=interpret, out_dtype=x.dtype)
    kept = (flat_ids >= 0) & (flat_ids < gate_up.shape[0])
    rows = y[jnp.minimum(row_of_pair, y.shape[0] - 1)].astype(F32)  # [P, D]
    rows = jnp.where(kept[:, None], rows * weights.reshape(-1, 1).astype(F32), 0.0)
    return rows.reshape(n, k, d).sum(1).astype(out_dtype or x.dtype)
