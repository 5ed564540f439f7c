"""Which loads and stores of a Pallas kernel can touch memory past its arrays once lowered to Triton.

A `BlockSpec` block that overhangs its array (the last block along a dimension the block does not divide) is
loaded and stored by the Triton lowering without any mask of its own: an unmasked `ref[...]` of that block reads
past the array and writes past it. On the GPU those writes land in whatever follows (the Sinkhorn kernel's last
block once overwrote the next rows). The CPU interpreter slices exactly and drops out-of-bounds
writes, so only the lowered module shows it. `unmasked_overhangs` lowers a function for an abstract H200 and
reports, per Pallas call, every load or store that reaches an overhanging block's pointer without a mask.

How: the jaxpr's `pallas_call` equations give each operand's block and array shapes (inputs, then outputs: the
order of the Triton function's pointer arguments); each `tt.load` / `tt.store` of the module is followed back
through its pointer's defining ops (addptr, splat, broadcast, ...; loop-carried pointers to the loop's initial
value) to the function argument it offsets.
"""

from __future__ import annotations

import jax
from gpu_mesh import abstract_gpu_mesh
from jax._src import core


def pallas_calls(jaxpr: core.Jaxpr):
    """Every `pallas_call` equation in a jaxpr, nested jaxprs included, in trace order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, core.ClosedJaxpr):
                    yield from pallas_calls(item.jaxpr)
                elif isinstance(item, core.Jaxpr):
                    yield from pallas_calls(item)


def overhanging_operands(eqn) -> dict[int, list[tuple[int, int, int]]]:
    """{operand index: [(dim, array size, block size), ...]} for the operands whose blocks overhang their arrays."""
    out = {}
    for i, mapping in enumerate(eqn.params["grid_mapping"].block_mappings):
        over = []
        for dim, (block, size) in enumerate(zip(mapping.block_shape, mapping.array_aval.shape)):
            block = getattr(block, "block_size", block)
            if isinstance(block, int) and block > 0 and size % block:
                over.append((dim, size, block))
        if over:
            out[i] = over
    return out


def _pointer_argument(value) -> int | None:
    """The function argument a pointer value offsets, or None (a pointer loaded from memory, say)."""
    from jax._src.lib.mlir import ir

    while True:
        value = value.maybe_downcast()
        if isinstance(value, ir.BlockArgument):
            arg = value
            parent = arg.owner.owner
            name = parent.name if hasattr(parent, "name") else parent.operation.name
            if name == "tt.func":
                return arg.arg_number
            if name == "scf.for" and arg.arg_number >= 1:  # iter_arg i+1 starts as the for's operand 3 + i
                value = parent.operands[3 + arg.arg_number - 1]
                continue
            return None
        op = value.owner
        op = op.operation if hasattr(op, "operation") else op
        if op.name in ("tt.load",) or not op.operands:
            return None
        value = op.operands[0]


def _memory_ops(op):
    op = op.operation if hasattr(op, "operation") else op
    if op.name in ("tt.load", "tt.store"):
        yield op
    for region in op.regions:
        for block in region:
            for inner in block:
                yield from _memory_ops(inner)


def unmasked_overhangs(fn, *args) -> tuple[list[str], int, int]:
    """Lowers `fn(*args)` (ShapeDtypeStructs) for an abstract H200. → (one line for each load or store of an
    overhanging block that carries no mask, the number of loads and stores of overhanging blocks checked, the
    number of operands whose blocks overhang, over every Pallas call). Also
    checks that a Triton module was built for each Pallas call, with one pointer argument per Pallas operand."""
    from dsv4.pallas._jax_compat import triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        modules.append(original(*a, **k))
        return modules[-1]

    triton_lowering.lower_jaxpr_to_triton_module = keep
    try:
        with abstract_gpu_mesh():
            traced = jax.jit(fn).trace(*args)
            traced.lower(lowering_platforms=("cuda",))
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    eqns = list(pallas_calls(traced.jaxpr.jaxpr))
    assert modules and len(modules) == len(eqns), (len(modules), len(eqns))
    problems, checked, overhanging = [], 0, 0
    for eqn, result in zip(eqns, modules):
        name = eqn.params.get("name", "?")
        over = overhanging_operands(eqn)
        overhanging += len(over)
        [func] = [op for op in result.module.body.operations if op.operation.name == "tt.func"]
        operands = len(eqn.params["grid_mapping"].block_mappings)
        pointers = [a for a in func.regions[0].blocks[0].arguments if "ptr" in str(a.type)]
        assert len(pointers) == operands, f"{name}: {len(pointers)} pointer arguments for {operands} operands"
        for op in _memory_ops(func):
            arg = _pointer_argument(op.operands[0])
            masked = len(op.operands) >= (2 if op.name == "tt.load" else 3)  # load(ptr, mask, ..); store(ptr, v, mask)
            checked += arg in over
            if arg in over and not masked:
                problems.append(f"{name}: unmasked {op.name} of operand {arg}, whose block overhangs: {over[arg]}")
    return problems, checked, overhanging
