"""Every use of jax's private API (`jax._src`) in dsv4.pallas, checked against the jax versions it was written for.

What lives here:
- `install_wide_offsets`: the Pallas Triton lowering addresses arrays of more than 2^31 elements with i64 element
  offsets (it picks i32 below 2^32 *bytes*, which wraps for 1-byte dtypes). docs/kernels/moe.md has the fault.
- `install_fp8_fast_accum`: named Triton kernels get maxNumImpreciseAcc = 2^30 on their fp8 × fp8 `tt.dot`s
  (Pallas emits 0, which splits every fp8 dot into 32-wide wgmmas with a promotion after each).
- `triton_lowering`: the private module both patch (tests wrap its `lower_jaxpr_to_triton_module` to read the
  lowered modules).
The Mosaic GPU interpreter's `InterpretGPUParams` is public (`jax.experimental.pallas.mosaic_gpu`): no patch needed.

Guard policy: on a jax version not in `SUPPORTED_JAX_VERSIONS`, importing this module warns once and the lowering
patches are not installed (the install functions return False). That is safer than raising: the patches wrap
private functions whose meaning may have changed, so they must not run unread, while without them every kernel
still lowers as jax does by itself: the fp8 dots accumulate with more promotions (slower, not wrong), and the MoE
kernels refuse (ValueError, `moe._check_offsets_fit`) the > 2^31-element operands that would fault. Raising
instead would stop the whole model from importing on a new jax. tests/test_jax_compat.py fails on such a version,
and checks that the private symbols still have the shapes the patches rely on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp

__all__ = ["JAX_VERSION_SUPPORTED", "SUPPORTED_JAX_VERSIONS", "I32_OFFSETS_MAX_ELEMENTS", "install_fp8_fast_accum",
           "install_wide_offsets", "set_fp8_fast_accum", "triton_lowering"]  # fmt: skip

# The jax releases whose private API below was read. To add one: check the patched functions against its source
# and run tests/test_jax_compat.py.
SUPPORTED_JAX_VERSIONS = ("0.11.2",)
JAX_VERSION_SUPPORTED = jax.__version__ in SUPPORTED_JAX_VERSIONS
if not JAX_VERSION_SUPPORTED:
    warnings.warn(
        f"dsv4.pallas: jax {jax.__version__} is not one of {SUPPORTED_JAX_VERSIONS}, the versions whose private "
        "lowering API dsv4.pallas._jax_compat was written for; its Triton lowering patches stay off (wide offsets "
        "for > 2^31-element arrays, fp8 fast accumulation). Run tests/test_jax_compat.py.",
        RuntimeWarning,
        stacklevel=2,
    )

try:
    from jax._src.pallas.triton import lowering as triton_lowering
except ImportError:  # no Triton lowering in this jax
    triton_lowering = None

I32_OFFSETS_MAX_ELEMENTS = 2**31  # i32 element offsets reach every element of an array at most this large
_NO_IMPRECISE_ACC_LIMIT = 2**30  # Triton's own `tl.dot` default on sm90: no split of the fp8 accumulation


def _patchable(name: str) -> bool:
    return JAX_VERSION_SUPPORTED and triton_lowering is not None and hasattr(triton_lowering, name)


def install_wide_offsets() -> bool:
    """Makes the Pallas Triton lowering use i64 element offsets for arrays of > 2^31 elements. → installed?

    A Pallas ref index cannot carry the fix (a ref's `.at[...]` and BlockSpec starts are still offsets into the whole
    array, in the width the lowering picked), so this wraps the lowering's choice: an array of more than 2^31
    elements is presented to the size check with a 4-byte dtype (only its itemsize is read there), which makes the
    lowering pick i64. Arrays of at most 2^31 elements are untouched.
    """
    if not _patchable("_compute_offsets_from_indices") or not hasattr(triton_lowering, "BlockInfo"):
        return False
    original = triton_lowering._compute_offsets_from_indices
    if getattr(original, "_dsv4_wide_offsets", False):
        return True

    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if math.prod(full.shape) > I32_OFFSETS_MAX_ELEMENTS and jnp.dtype(full.dtype).itemsize < 4:
            block_info = dataclasses.replace(block_info, full_shape_dtype=jax.core.ShapedArray(full.shape, jnp.float32))
        return original(block_info, nd_indexer)

    compute_offsets._dsv4_wide_offsets = True
    triton_lowering._compute_offsets_from_indices = compute_offsets
    return True


# pallas_call names whose fp8 × fp8 dots get the fast accumulation (`install_fp8_fast_accum`).
_FP8_FAST_ACCUM_KERNELS: set[str] = set()


def set_fp8_fast_accum(module) -> int:
    """Sets maxNumImpreciseAcc = 2^30 on the fp8 × fp8 `tt.dot`s of a Triton module. → how many were set."""
    from jax._src.lib.mlir import ir

    count = 0

    def visit(op):
        nonlocal count
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "tt.dot":
                        a_type = ir.RankedTensorType(inner.operation.operands[0].type)
                        if "f8" in str(a_type.element_type).lower():
                            inner.operation.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(
                                ir.IntegerType.get_signless(32), _NO_IMPRECISE_ACC_LIMIT)  # fmt: skip
                            count += 1
                    visit(inner.operation)

    with module.context:
        visit(module.operation)
    return count


def install_fp8_fast_accum(kernel_names) -> bool:
    """Wraps the Pallas Triton module lowering so that the pallas_calls named `kernel_names` (added to those of
    earlier calls) get `set_fp8_fast_accum`; other kernels are left as lowered. → installed?"""
    if not _patchable("lower_jaxpr_to_triton_module"):
        return False
    _FP8_FAST_ACCUM_KERNELS.update(kernel_names)
    original = triton_lowering.lower_jaxpr_to_triton_module
    if getattr(original, "_dsv4_fp8_fast_accum", False):
        return True

    @functools.wraps(original)
    def lower(*args, **kwargs):
        result = original(*args, **kwargs)
        name = str(result.module.operation.attributes["sym_name"]).strip('"')
        if name in _FP8_FAST_ACCUM_KERNELS:
            set_fp8_fast_accum(result.module)
        return result

    lower._dsv4_fp8_fast_accum = True
    triton_lowering.lower_jaxpr_to_triton_module = lower
    return True

