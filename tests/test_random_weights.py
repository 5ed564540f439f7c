"""Random weights made on the devices in the released formats (`dsv4.random_weights`): the quantized leaves are what
the checkpoint writer and loader make of the same bf16 draw (host quantizers, ue8m0 scales), leaf inits follow the
model's declarations, and on a mesh of 8 host devices every leaf is laid out as the engine lays it out, with the same
values and the same greedy tokens as the unsharded model."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from host_devices import host_devices_env
from opt_in import slow_opt_in

import dsv4
from dsv4 import random_weights as rw
from dsv4.quantization import BlockQuantized, quantize_fp4, quantize_fp8
from dsv4.weights import module_name, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def test_device_quantizers_match_the_host_quantizers_bit_for_bit():
    """Fresh bf16 draws in shapes that are no block multiple, plus every e2m1 rounding tie and amax exactly on a power
    of two times the format's top (where a log2 a hair off would double the scale)."""
    rng = np.random.default_rng(11)
    for shape in [(3, 200, 130), (77, 45 * 2)]:
        w = (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)
        w.reshape(-1)[:4] = [448 * 2.0**-12, -6 * 2.0**-9, 0.0, -0.0]
        q, s = jax.jit(rw.quantize_fp8)(jnp.asarray(w))
        q_ref, s_ref = quantize_fp8(np.asarray(w, np.float32), (128, 128))
        assert np.array_equal(_bits(q), _bits(q_ref)) and np.array_equal(np.asarray(s), s_ref)
        q, s = jax.jit(rw.quantize_fp4)(jnp.asarray(w))
        q_ref, s_ref = quantize_fp4(np.asarray(w, np.float32))
        assert np.array_equal(_bits(q), _bits(q_ref)) and np.array_equal(np.asarray(s), s_ref)
    # one group of 32 whose scale is 1 (amax 6): every tie between e2m1 neighbours, both signs
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.1, 0.3, 5.5, 2.9], np.float32)
    x = np.concatenate([ties, -ties, np.zeros(8, np.float32)])[None]
    q, s = rw.quantize_fp4(jnp.asarray(x))
    q_ref, s_ref = quantize_fp4(x)
    assert np.asarray(s).tolist() == [[1.0]] and np.array_equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("weights,expert_dtype", [("fp8", None), ("fp8-fp4-experts", "fp4")])
def test_quantized_leaves_are_what_a_release_of_the_same_draw_loads_as(tmp_path, weights, expert_dtype):
    """The bf16 model written as a release quantizes it (dsv4.weights.save: host quantizers, e8m0 scales) and loaded
    kept quantized gives, leaf for leaf, the values `random_model(weights=...)` makes on the device. The expert width
    is a multiple of 128, as V4's: a release's w1 and w3 then share the fused gate_up's block grid."""
    config = dsv4.Config.preset("tiny").replace(moe_intermediate_size=128)
    plain = rw.random_model(config, 5)
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    if expert_dtype:
        quantization["expert_dtype"] = expert_dtype
    save(plain, str(tmp_path), layout="deepseek", quantization=quantization)
    loaded = dsv4.load(str(tmp_path), dtype=jnp.bfloat16, keep_quantized=True)
    made = rw.random_model(config, 5, weights=weights)
    want = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Variable)))
    formats = {}
    for path, var in nnx.to_flat_state(nnx.state(made, nnx.Variable)):
        got, ref = var.get_value(), want[path].get_value()
        name = module_name(path)
        assert type(got) is type(ref), name
        if isinstance(got, BlockQuantized):
            formats[got.fmt] = formats.get(got.fmt, 0) + 1
            assert (got.fmt, got.block, got.shape, got.dtype_name) == (ref.fmt, ref.block, ref.shape, ref.dtype_name)
            assert np.array_equal(_bits(got.q), _bits(ref.q)), name
        assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))), name
    experts = 2 * config.num_hidden_layers  # gate_up and down of every layer
    assert formats == ({"fp8": 38} if weights == "fp8" else {"fp8": 38 - experts, "fp4": experts})
    # quantizing the bf16 model in place gives the same leaves
    info = rw.quantize_released(plain, weights)
    assert info["quantized"] == formats
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(plain)), nnx.to_flat_state(nnx.state(made))):
        assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(jax.tree.leaves(a.get_value()),
                                                                      jax.tree.leaves(b.get_value())))  # fmt: skip


def test_leaf_inits_follow_the_declarations_and_bad_formats_are_named():
    """Ones and zeros exactly where `init_random` (the declarations' own init) puts them; the rest random."""
    config = dsv4.Config.preset("tiny")
    ref = dict(nnx.to_flat_state(nnx.state(dsv4.init_random(config, 0), nnx.Variable)))
    made = dict(nnx.to_flat_state(nnx.state(rw.random_model(config, 0, dtype=jnp.float32), nnx.Variable)))
    assert set(made) == set(ref)
    for path, var in ref.items():
        want, got = np.asarray(var.get_value()), np.asarray(made[path].get_value())
        kind = rw.leaf_init(module_name(path))
        if kind in ("ones", "zeros"):
            assert np.all(want == (kind == "ones")) and np.all(got == (kind == "ones")), module_name(path)
        elif kind == "hash":  # distinct experts per token
            assert got.dtype == np.int32 and all(len(set(row)) == got.shape[1] for row in got.tolist())
        else:
            assert got.std() > 0.01 and abs(got.std() - 0.02) < 0.01, module_name(path)
    with pytest.raises(ValueError, match="weights='fp16'"):
        rw.random_model(config, 0, weights="fp16")


MESH_SCRIPT = """
    import json, sys, numpy as np, jax, dsv4
    from flax import nnx
    from dsv4.config import CSA, HCA
    from dsv4.quantization import BlockQuantized
    from dsv4.sharding import make_mesh
    from dsv4.weights import module_name

    # two layers (CSA with hash routing, HCA) keep the two engines' compilations short
    config = dsv4.Config.preset("tiny").replace(num_hidden_layers=2, layer_types=(CSA, HCA),
                                                mlp_layer_types=("hash_moe", "moe"))
    mesh = make_mesh(8)
    alone = dsv4.init_random(config, 2, weights="fp8-fp4-experts")
    spread = dsv4.init_random(config, 2, weights="fp8-fp4-experts", mesh=mesh)
    ref = dict(nnx.to_flat_state(nnx.state(alone, nnx.Variable)))
    same, on_mesh, split, quantized = True, True, {}, 0
    for path, var in nnx.to_flat_state(nnx.state(spread, nnx.Variable)):
        value, name = var.get_value(), module_name(path)
        quantized += isinstance(value, BlockQuantized)
        for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(ref[path].get_value())):
            same &= bool(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)))
            on_mesh &= x.sharding.mesh == mesh
            split[name] = split.get(name, []) + [[list(x.sharding.spec), list(x.addressable_shards[0].data.shape)]]
    row = dict(same=same, on_mesh=on_mesh, split=split, quantized=quantized)
    if "engine" in sys.argv:
        kw = dict(max_slots=2, max_model_len=64, chunk_size=16, width_buckets=(1, 16), max_packed_width=1,
                  page_size=16)
        prompts = [np.arange(3, 40).tolist(), np.arange(90, 101).tolist()]
        row["tokens"] = [[o.token_ids for o in dsv4.LLM(m, mesh=mesh_, **kw).generate(prompts, max_new_tokens=5)]
                         for m, mesh_ in ((alone, None), (spread, mesh))]
        row["quantized_after"] = sum(isinstance(v.get_value(), BlockQuantized)
                                     for _, v in nnx.to_flat_state(nnx.state(spread, nnx.Variable)))
    print(json.dumps(row))
"""


def _on_8_devices(*argv) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(MESH_SCRIPT), *argv], env=host_devices_env(8),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# 7 dense FP8 matrices a layer (q_a, q_b, kv, o_b, shared gate / up / down), CSA's indexer q_b, the 2 experts a layer
QUANTIZED = 7 + 1 + 7 + 2 * 2


def test_on_a_mesh_of_8_host_devices_each_device_makes_its_slice_of_the_same_values():
    row = _on_8_devices()
    assert row["same"] and row["on_mesh"] and row["quantized"] == QUANTIZED
    # the routed experts (q and scales) and the router split over the 8 devices, one expert (row) each
    split = {name: [(tuple(spec), tuple(shape)) for spec, shape in v] for name, v in row["split"].items()}
    assert split["layers.1.mlp.experts.gate_up_proj"] == [(("sp", None, None), (1, 64, 32)),
                                                          (("sp", None, None), (1, 64, 2))]  # fmt: skip
    assert split["layers.1.mlp.experts.down_proj"][0] == (("sp", None, None), (1, 64, 16))
    assert split["layers.1.mlp.gate.weight"] == [(("sp", None), (1, 64))]
    assert split["embed_tokens.weight"] == [((None, None), (256, 64))]  # replicated


@slow_opt_in("two engines, ~25 s on 2 cores")
def test_the_engine_on_the_mesh_gives_the_unsharded_models_tokens():
    """`dsv4.LLM(model, mesh=)` takes the model as made (already on the mesh: nothing moves, the weights stay
    quantized) and generates the greedy tokens of the same model on one device."""
    row = _on_8_devices("engine")
    assert row["same"] and row["quantized"] == row["quantized_after"] == QUANTIZED
    alone, spread = row["tokens"]
    assert alone == spread and all(len(t) == 5 for t in alone)
