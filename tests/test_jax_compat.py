"""dsv4.pallas._jax_compat: the jax private API its lowering patches rely on is still there, in the shape they were
written for, and the installed jax is a version the module knows. A failure here means jax changed under the
patches: read the new source of the symbols below before adding the version to `SUPPORTED_JAX_VERSIONS`."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest
from gpu_mesh import abstract_gpu_mesh
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import dsv4.pallas.moe  # noqa: F401 (installs the patches, as importing the MoE kernels does)
from dsv4.pallas import _jax_compat as compat


def test_installed_jax_is_a_supported_version():
    assert jax.__version__ in compat.SUPPORTED_JAX_VERSIONS, (
        f"jax {jax.__version__} is not one of {compat.SUPPORTED_JAX_VERSIONS}: dsv4.pallas._jax_compat's Triton "
        "lowering patches are off. Check them against this jax and add the version."
    )
    assert compat.JAX_VERSION_SUPPORTED


def test_triton_lowering_symbols_have_the_patched_signatures():
    lowering = compat.triton_lowering
    assert lowering is not None, "jax._src.pallas.triton.lowering is gone"
    offsets = inspect.signature(inspect.unwrap(lowering._compute_offsets_from_indices))
    assert list(offsets.parameters) == ["block_info", "nd_indexer"]
    assert dataclasses.is_dataclass(lowering.BlockInfo)
    assert "full_shape_dtype" in {f.name for f in dataclasses.fields(lowering.BlockInfo)}
    lower = inspect.signature(inspect.unwrap(lowering.lower_jaxpr_to_triton_module))
    assert list(lower.parameters)[:2] == ["jaxpr", "grid_mapping"]


def test_mlir_ir_names_the_fast_accum_pass_uses():
    from jax._src.lib.mlir import ir

    for name in ("RankedTensorType", "IntegerAttr", "IntegerType"):
        assert hasattr(ir, name), name


def test_both_patches_are_installed_once():
    assert compat.install_wide_offsets() and compat.install_fp8_fast_accum(())
    lowering = compat.triton_lowering
    assert getattr(lowering._compute_offsets_from_indices, "_dsv4_wide_offsets", False)
    assert getattr(lowering.lower_jaxpr_to_triton_module, "_dsv4_fp8_fast_accum", False)
    assert inspect.unwrap(lowering._compute_offsets_from_indices) is not lowering._compute_offsets_from_indices
    assert {"grouped_gate_up", "grouped_down"} <= compat._FP8_FAST_ACCUM_KERNELS


def _lowered_text(fn, *avals, name):
    texts = {}
    original = compat.triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(*args, **kwargs):
        result = original(*args, **kwargs)
        texts[str(result.module.operation.attributes["sym_name"]).strip('"')] = str(result.module)
        return result

    with pytest.MonkeyPatch.context() as m:
        m.setattr(compat.triton_lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
        with abstract_gpu_mesh():
            jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
    return texts[name]


def test_wide_offsets_take_i64_past_2_31_elements_only():
    """A 1-byte array of 2^31 + 2^20 elements is addressed with i64 element offsets, one of 2^20 with i32."""

    def copy_block(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = plgpu.load(x_ref.at[pl.ds(pl.program_id(0) * 128, 128)]).astype(jnp.float32)

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(1,),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)], name="copy_block")(x)  # fmt: skip

    def offset_bits(n):
        text = _lowered_text(copy_block, jax.ShapeDtypeStruct((n,), jnp.float8_e4m3fn), name="copy_block")
        return {line.split(",")[-1].strip().split(">")[0] for line in text.splitlines() if "tt.addptr" in line}

    assert any("i64" in t for t in offset_bits(2**31 + 2**20)), "the wide-offset patch no longer takes effect"
    assert not any("i64" in t for t in offset_bits(2**20))


def test_fp8_fast_accum_marks_only_the_named_kernels():
    x = jax.ShapeDtypeStruct((64, 64), jnp.float8_e4m3fn)

    def dot(name):
        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        return lambda a, b: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                                           name=name)(a, b)  # fmt: skip

    assert "maxNumImpreciseAcc = 1073741824" in _lowered_text(dot("grouped_down"), x, x, name="grouped_down")
    assert "maxNumImpreciseAcc = 1073741824" not in _lowered_text(dot("other"), x, x, name="other")


def test_interpret_gpu_params_is_public():
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    InterpretGPUParams()
