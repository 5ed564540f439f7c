"""Group maxima of long rows, several levels in one pass, as a Triton-lowered Pallas kernel, with its jnp reference.

`dsv4.topk.top_k` picks the k best of a row by group maxima: the maxima of groups of `group` consecutive elements,
then (recursively) the maxima of groups of those, down to a row short enough for `lax.top_k`. XLA computes each
level as a reduction over a minor dimension of 4, at about 1 TB/s on an H200: at a 512K prompt the first level
alone is 0.31 ms of a query chunk's 0.76 ms selection (docs/KERNEL_NOTES.md IX17, IX21). This kernel reads the row
once and writes every level:

    level 1 [..., ceil(N / g)]:    max of x[i·g : (i+1)·g]
    level 2 [..., ceil(N / g²)]:   max of level 1 over groups of g  (= max of x[i·g² : (i+1)·g²])
    ...

with the row padded by -inf to whole groups, exactly as `top_k` pads it, so `top_k(x, k, levels=...)` returns
bit for bit what it returns without them. NaN is not supported (as in `top_k`).

Layout: one program = `block_rows` rows × `block_cols` columns (a multiple of g ** levels, so no group straddles
two programs); each level's block is a reshape and a max in registers. Rows and columns past the array are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["GroupMaxBlocks", "group_maxima", "group_maxima_kernel", "group_maxima_reference"]

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class GroupMaxBlocks:
    """Tile of one program: block_rows × block_cols elements (powers of two; block_cols a multiple of
    group ** levels); num_warps for the launch."""

    block_rows: int = 1
    block_cols: int = 4096
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "block_cols", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GroupMaxBlocks.{name}={value} must be a positive power of two")


def level_widths(n: int, group: int, levels: int) -> list[int]:
    """Row lengths of the levels: ceil(n / group), then ceil of that / group, ..."""
    widths = []
    for _ in range(levels):
        n = -(-n // group)
        widths.append(n)
    return widths


def group_maxima_kernel(x_ref, *out_refs, n_rows: int, group: int, block_cols: int):
    """x_ref [block_rows, N] (this program's rows, every column); out_refs[l] [block_rows, width_l]. The program
    reads columns [j · block_cols, (j + 1) · block_cols) and writes level l's block_cols / group ** l columns."""
    block_rows, n = x_ref.shape
    j = pl.program_id(1)
    row_ok = pl.program_id(0) * block_rows + jnp.arange(block_rows) < n_rows
    cols = j * block_cols + jnp.arange(block_cols)
    x = plgpu.load(x_ref.at[:, pl.ds(j * block_cols, block_cols)], mask=row_ok[:, None] & (cols < n)[None, :],
                   other=NEG_INF)  # fmt: skip  # [block_rows, block_cols]; -inf past N pads the last group
    width = block_cols
    for o_ref in out_refs:
        width //= group
        x = x.reshape(block_rows, width, group).max(axis=2)  # [block_rows, width]
        in_row = j * width + jnp.arange(width) < o_ref.shape[1]
        plgpu.store(o_ref.at[:, pl.ds(j * width, width)], x, mask=row_ok[:, None] & in_row[None, :])


@functools.partial(jax.jit, static_argnames=("group", "levels", "blocks", "interpret"))
def group_maxima(
    x: jax.Array,
    *,
    group: int = 4,
    levels: int = 3,
    blocks: GroupMaxBlocks = GroupMaxBlocks(),
    interpret: bool = False,
    out_init: tuple[jax.Array, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """x [..., N] float → `levels` arrays [..., ceil(N / group ** l)], l = 1 .. levels (see the module docstring).

    interpret: run the kernel in the Pallas interpreter (CPU). out_init: testing hook, the output buffers start
    as these arrays (aliased, same shapes and dtype as the outputs), so an element the kernel fails to write
    keeps its poison."""
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"group_maxima needs a float array [..., N], got {x.dtype}{list(x.shape)}")
    if group < 2 or group & (group - 1):
        raise ValueError(f"group={group} must be a power of two >= 2")
    if levels < 1:
        raise ValueError(f"levels={levels} must be >= 1")
    span = group**levels
    if blocks.block_cols % span:
        raise ValueError(f"{blocks} needs block_cols a multiple of group ** levels = {span}")
    *lead, n = x.shape
    rows = math.prod(lead)
    flat = x.reshape(rows, n)
    widths = level_widths(n, group, levels)
    grid = (pl.cdiv(rows, blocks.block_rows), pl.cdiv(n, blocks.block_cols))
    out_specs = [pl.BlockSpec((blocks.block_rows, w), lambda i, j: (i, 0)) for w in widths]
    inits = ()
    if out_init is not None:
        want = [(*lead, w) for w in widths]
        if [tuple(a.shape) for a in out_init] != want or any(a.dtype != x.dtype for a in out_init):
            raise ValueError(f"out_init must be {x.dtype} arrays of shapes {want}, got "
                             f"{[(a.dtype, a.shape) for a in out_init]}")  # fmt: skip
        inits = tuple(a.reshape(rows, w) for a, w in zip(out_init, widths))

    def kernel(x_ref, *refs):  # aliased init buffers come after x and are never read
        group_maxima_kernel(x_ref, *refs[len(inits):], n_rows=rows, group=group, block_cols=blocks.block_cols)

    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, w), x.dtype) for w in widths],
        grid=grid,
        in_specs=[pl.BlockSpec((blocks.block_rows, n), lambda i, j: (i, 0)), *out_specs[: len(inits)]],
        out_specs=out_specs,
        input_output_aliases={1 + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="group_maxima",
    )(flat, *inits)
    return tuple(o.reshape(*lead, w) for o, w in zip(outs, widths))


def group_maxima_reference(x: jax.Array, *, group: int = 4, levels: int = 3) -> tuple[jax.Array, ...]:
    """The same levels in plain jnp: pad with -inf to whole groups, reshape, max; repeat on the result."""
    out = []
    for _ in range(levels):
        n = x.shape[-1]
        pad = -(-n // group) * group - n
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=NEG_INF)
        x = x.reshape(*x.shape[:-1], -1, group).max(axis=-1)
        out.append(x)
    return tuple(out)
