"""FP8 / FP4 checkpoints: reading them as released, keeping them quantized, and rejecting bad ones.

Fixtures `tiny_mixed_fp8` / `tiny_mixed_fp4` (scripts/make_reference_fixtures.py --quantized) hold
`tiny_mixed`'s weights quantized by torch in DeepSeek's released layout (e4m3 + ue8m0 `.scale` in 16×16
blocks; FP4 e2m1 experts packed in int8 with per-32 scales) and the logits transformers computes from those
very files. Same files, same float32 math → the same 1e-4 relative tolerance as tests/test_parity.py.
"""

import functools
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dsv4
from dsv4 import weights
from dsv4.quantization import (
    E2M1_VALUES,
    BlockQuantized,
    dequantize_np,
    e2m1_decode,
    fp4_to_fp8_blocks,
    quantize_fp4,
    quantize_fp8,
)
from dsv4.weights import RELEASED_EXPERT, RELEASED_FP8, CheckpointError, checkpoint_index, read_tensor, save

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-4  # vs transformers on the same quantized files: float32 reordering only (see tests/test_parity.py)


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def _tensors(path) -> dict[str, np.ndarray]:
    return {name: np.array(read_tensor(e)) for name, e in checkpoint_index(str(path)).items()}


def _copy_fixture(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


@functools.cache
def _base_graphdef():
    return nnx.graphdef(dsv4.load(os.path.join(FIXTURES, "tiny_mixed"), dtype=jnp.float32))


def tiny_mixed_logits(model, ids) -> np.ndarray:
    """Logits of a model with tiny_mixed's shapes through tiny_mixed's own graph, so that every such model
    shares one compiled program (a config that differs only in quantization_config would compile anew)."""
    return np.asarray(nnx.merge(_base_graphdef(), nnx.state(model)).logits(ids))


def _fails_before_devices(path, match):
    before = len(jax.live_arrays())
    with pytest.raises(CheckpointError, match=match):
        dsv4.load(path, dtype=jnp.float32)
    assert len(jax.live_arrays()) <= before


def test_auto_re_blocks_fp4_experts_where_the_device_has_the_room(monkeypatch):
    """`fp4_experts="auto"` on a device that reports its memory (the CPU device behind a stand-in with memory_stats):
    re-blocked when the FP8 copy and the plan's runtime fit the limit, kept as stored when they do not."""
    from dsv4.random_weights import random_model

    cfg = dsv4.Config.preset("tiny").replace(moe_intermediate_size=128, hidden_size=128)
    real = jax.local_devices()[0]

    class Reporting:  # the real device, reporting `limit` bytes of which 1 MiB in use
        def __init__(self, limit):
            self.limit = limit

        def __getattr__(self, name):
            return getattr(real, name)

        def memory_stats(self):
            return {"bytes_limit": self.limit, "bytes_in_use": 1 << 20}

        def __eq__(self, other):
            return other is self or other == real

        __hash__ = object.__hash__

    for limit, want in ((1 << 40, "fp8"), (2 << 20, "fp4")):
        model = random_model(cfg, 3, dtype=jnp.float32, kernels="moe=pallas", weights="fp8-fp4-experts")
        with monkeypatch.context() as m:
            m.setattr(jax, "local_devices", lambda limit=limit: [Reporting(limit)])
            llm = dsv4.LLM(model, max_slots=1, max_model_len=64, chunk_size=32, warmup=False)
        assert llm.fp4_experts == want
        fmts = {v.fmt for v in jax.tree.leaves(nnx.state(llm.model), is_leaf=lambda x: isinstance(x, BlockQuantized))
                if isinstance(v, BlockQuantized) and v.ndim == 3}  # fmt: skip
        assert fmts == {want}


def test_fp8_experts_fit_by_hand():
    """"auto" re-blocks FP4 experts when, with the weights placed, the device keeps room for the re-blocked copy plus
    the plan's non-weight lines (its transient buffers included) and the other slots' caches, all × the headroom."""
    from dsv4.engine import fp8_experts_fit
    from dsv4.memory_plan import plan_memory

    cfg = dsv4.Config.preset("tiny")
    plan = plan_memory(cfg, context=1024, devices=1, kv_format="bf16", weights="fp8", chunk_size=256)
    lines = {line.name: line.bytes_per_device for line in plan.lines}
    runtime = sum(v for k, v in lines.items() if k.startswith(("KV cache", "activations", "communication")))
    runtime += lines["weights: dequantized layer (transient)"] + 3 * plan.kv_bytes_per_token * 1024  # 4 slots
    assert runtime > 0 and plan.headroom == 1.2
    need = 1000 + (5000 + runtime) * 1.2
    fit = dict(plan=plan, extra_bytes=5000, in_use=1000, max_slots=4)
    assert fp8_experts_fit(**fit, limit=int(need) + 1) and not fp8_experts_fit(**fit, limit=int(need) - 1)


# ---------------------------------------------------------------------------------------------
# The formats themselves.
# ---------------------------------------------------------------------------------------------
def test_fp4_nibble_order_and_e8m0_scales():
    """Even column in the low nibble; bit 3 of a code is the sign; e8m0 stored as float8_e8m0fnu or as raw
    exponent bytes (2 ** (byte - 127))."""
    packed = np.array([[0x21, 0x9F]], np.uint8)  # codes 1, 2 | 15 (-6), 9 (-0.5)
    for scale in (np.array([[2.0]], np.float32).astype(ml_dtypes.float8_e8m0fnu), np.array([[128]], np.uint8)):
        got = dequantize_np(packed, scale, "fp4", (1, 32), np.float32)
        np.testing.assert_array_equal(got, [[1.0, 2.0, -12.0, -1.0]])


def test_quantizers_are_exact_on_representable_values_and_use_ceil_grids():
    rng = np.random.default_rng(0)
    # 40 × 24 with 16 × 16 blocks: partial blocks on both edges → a 3 × 2 grid.
    codes = rng.integers(0, 256, (40, 24), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes[~np.isfinite(codes)] = 448.0
    scales = np.exp2(rng.integers(-12, -4, (3, 2))).astype(np.float32)
    w = codes * np.repeat(np.repeat(scales, 16, 0), 16, 1)[:40, :24]
    q, s = quantize_fp8(w, (16, 16))
    assert q.shape == (40, 24) and s.shape == (3, 2)
    np.testing.assert_array_equal(dequantize_np(q, s, "fp8", (16, 16), np.float32), w)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    group_scales = np.repeat(np.exp2(rng.integers(-9, -3, (8, 2))), 32, 1)
    v = rng.choice(e2m1, (8, 64)) * rng.choice([-1, 1], (8, 64)) * group_scales
    packed, s4 = quantize_fp4(v)
    assert packed.shape == (8, 32) and packed.dtype == np.int8 and s4.shape == (8, 2)
    np.testing.assert_array_equal(dequantize_np(packed, s4, "fp4", (1, 32), np.float32), v)


def test_e2m1_decode_matches_the_code_table():
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(e2m1_decode(codes)), E2M1_VALUES)


def _fp4(w, scale_fmt="ue8m0"):
    q, s = quantize_fp4(w, scale_fmt=scale_fmt)
    return q, s, BlockQuantized(jnp.asarray(q), jnp.asarray(s), "fp4", (1, 32), w.shape, "float32")


def test_fp4_reblocked_as_fp8_blocks_is_exact_for_ue8m0_scales():
    """Against the host decoder: group scales spread over 2^11 within a block convert exactly; a group 2^-24 below
    its block's largest rounds to e4m3's subnormal steps (≤ 2^-16 of that scale); other scales round each value
    to e4m3 (≤ 2^-4 relative)."""
    rng = np.random.default_rng(7)
    e, rows, cols = 2, 256, 384  # 2 × 3 blocks of 128 × 128, 4 groups a block row
    w = rng.standard_normal((e, rows, cols)).astype(np.float32)
    w *= np.repeat(np.exp2(-rng.integers(0, 12, (e, rows, cols // 32))), 32, axis=-1)
    q, s, fp4 = _fp4(w)
    fp8 = jax.jit(fp4_to_fp8_blocks)(fp4)
    assert (fp8.fmt, fp8.block, fp8.shape, fp8.dtype_name) == ("fp8", (128, 128), w.shape, "float32")
    assert fp8.q.dtype == jnp.float8_e4m3fn and fp8.q.shape == w.shape and fp8.scale.shape == (e, 2, 3)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize()), dequantize_np(q, s, "fp4", (1, 32), np.float32))

    tiny = w.copy()
    tiny[1, 130, 64:96] *= 2.0**-24  # one group of block (1, 1, 0), far below its neighbours
    q, s, fp4 = _fp4(tiny)
    err = np.abs(np.asarray(fp4_to_fp8_blocks(fp4).dequantize()) - dequantize_np(q, s, "fp4", (1, 32), np.float32))
    assert err[1, 130, 64:96].max() <= 2.0**-16 * s[1, 128:256, 0:4].max()
    err[1, 130, 64:96] = 0
    assert err.max() == 0

    q, s, fp4 = _fp4(w, scale_fmt=None)
    want = dequantize_np(q, s, "fp4", (1, 32), np.float32)
    err = np.abs(np.asarray(fp4_to_fp8_blocks(fp4).dequantize()) - want)
    assert (err <= 2.0**-4 * np.abs(want) + 2.0**-16 * s.max()).all()

    for bad in (BlockQuantized(fp4.q[:, :100], fp4.scale[:, :100], "fp4", (1, 32), (e, 100, cols), "float32"),
                fp4_to_fp8_blocks(fp4)):  # fmt: skip
        with pytest.raises(ValueError, match="FP4 BlockQuantized weight"):
            fp4_to_fp8_blocks(bad)


def test_fp4_experts_run_the_fp8_kernel_as_their_fp8_image():
    """The model's MoE (Pallas, interpret mode on a CPU) with FP4 experts gives what it gives with the same values
    stored as FP8 blocks by the host quantizer (exact images of each other under ue8m0 scales): W8A8 both ways."""
    from dsv4.config import SLIDING, Config
    from dsv4.moe import MoE

    cfg = Config.from_hf({"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 4,
                          "num_experts_per_tok": 2, "num_hidden_layers": 1, "layer_types": [SLIDING],
                          "mlp_layer_types": ["moe"]})  # fmt: skip
    moe = MoE(cfg, "moe", rngs=np.random.default_rng(3), dtype=jnp.bfloat16, moe_impl="pallas")
    images = {}
    for name in ("gate_up_proj", "down_proj"):
        w = np.asarray(moe.experts[name].get_value(), np.float32)
        q, s, _ = _fp4(w)
        values = dequantize_np(q, s, "fp4", (1, 32), np.float32)
        q8, s8 = quantize_fp8(values, (128, 128))
        assert np.array_equal(dequantize_np(q8, s8, "fp8", (128, 128), np.float32), values)  # an exact image
        images[name] = (BlockQuantized(jnp.asarray(q), jnp.asarray(s), "fp4", (1, 32), w.shape, "bfloat16"),
                        BlockQuantized(jnp.asarray(q8), jnp.asarray(s8), "fp8", (128, 128), w.shape, "bfloat16"))
    x = jax.random.normal(jax.random.key(4), (1, 13, 256), jnp.bfloat16)
    tok = jnp.arange(13, dtype=jnp.int32)[None]
    outs = []
    for i in (0, 1):
        for name, pair in images.items():
            moe.experts[name].set_value(pair[i])
        assert moe.expert_weights()[0].dtype == jnp.float8_e4m3fn
        outs.append(np.asarray(nnx.jit(lambda m, a, t: m(a, t))(moe, x, tok), np.float32))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_the_engine_re_blocks_fp4_experts_once_when_asked():
    """`LLM(fp4_experts="fp8")` under the Pallas MoE: every FP4 expert weight becomes its FP8 image (the same values,
    ue8m0 scales), the rest untouched; "fp4", the jnp MoE, and "auto" on a device that reports no memory limit (the
    CPU) keep them as stored; a bad value is named."""
    from flax import nnx

    from dsv4.random_weights import random_model

    cfg = dsv4.Config.preset("tiny").replace(moe_intermediate_size=128, hidden_size=128)

    def leaves(model):
        return {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    for moe, mode, want in (("pallas", "fp8", "fp8"), ("pallas", "fp4", "fp4"), ("jnp", "fp8", "fp4"),
                            ("pallas", "auto", "fp4")):  # fmt: skip
        model = random_model(cfg, 3, dtype=jnp.float32, kernels=f"moe={moe}", weights="fp8-fp4-experts")
        before = leaves(model)
        llm = dsv4.LLM(model, max_slots=1, max_model_len=64, chunk_size=32, warmup=False, fp4_experts=mode)
        after = leaves(llm.model)
        assert llm.fp4_experts == want
        experts = [p for p, v in before.items() if isinstance(v, BlockQuantized) and v.fmt == "fp4"]
        assert len(experts) == 2 * cfg.num_hidden_layers
        for path, value in after.items():
            if path in experts:
                assert value.fmt == want, (moe, mode, path)
                np.testing.assert_array_equal(np.asarray(value.dequantize()), np.asarray(before[path].dequantize()))
            else:
                assert type(value) is type(before[path]), path
                assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(before[path]),
                                                                  strict=True)), path  # fmt: skip
    with pytest.raises(ValueError, match="fp4_experts='int4'.*'auto'"):
        dsv4.LLM(model, max_slots=1, max_model_len=64, warmup=False, fp4_experts="int4")


# ---------------------------------------------------------------------------------------------
# Released checkpoints against the reference.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny_mixed_fp8", "tiny_mixed_fp4"])
def test_quantized_fixture_matches_reference_and_stays_within_quantization_error(name):
    ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
    logits = tiny_mixed_logits(dsv4.load(os.path.join(FIXTURES, name), dtype=jnp.float32), ref["input_ids"])
    assert rel_err(logits, ref["logits"]) < TOL
    # Against the unquantized model: e4m3 rounds each weight by at most 2^-4 relative (3 mantissa bits), e2m1
    # by up to 1/3 (1 bit); over dot products of 32-256 terms the errors partly cancel. Measured relative RMS
    # logit error: 0.035 (FP8), 0.063 (FP4 experts); the bounds leave 2x headroom and still catch a wrong
    # scale grid or nibble order, which moves logits by O(1).
    float_logits = np.load(os.path.join(FIXTURES, "tiny_mixed", "reference.npz"))["logits"]
    rms = float(np.sqrt(((logits - float_logits) ** 2).mean()) / float_logits.std())
    assert 1e-3 < rms < (0.07 if name.endswith("fp8") else 0.13)


def test_keep_quantized_holds_fp8_and_fp4_and_gives_the_same_logits():
    path = os.path.join(FIXTURES, "tiny_mixed_fp4")
    ref = np.load(os.path.join(path, "reference.npz"))
    model = dsv4.load(path, dtype=jnp.float32, keep_quantized=True)
    experts = model.layers[1].mlp.experts["gate_up_proj"].get_value()
    attn = model.layers[1].self_attn.q_b_proj["weight"].get_value()
    assert isinstance(experts, BlockQuantized) and experts.fmt == "fp4"
    assert experts.q.dtype == jnp.uint8 and experts.q.shape == (8, 64, 32) and experts.scale.shape == (8, 64, 2)
    assert isinstance(attn, BlockQuantized) and attn.fmt == "fp8" and attn.q.dtype == jnp.float8_e4m3fn
    assert attn.scale.shape == (8, 2) and attn.scale.dtype == jnp.float32 and attn.block == (16, 16)
    assert model.layers[1].self_attn.o_a_proj["weight"][...].dtype == jnp.float32  # stored unquantized
    dequantized = dsv4.load(path, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(experts[...]),
                                  np.asarray(dequantized.layers[1].mlp.experts["gate_up_proj"][...]))  # fmt: skip
    # The kept model runs as it is (dequantizing where it reads a weight): one more compiled program.
    np.testing.assert_allclose(np.asarray(model.logits(ref["input_ids"])),
                               tiny_mixed_logits(dequantized, ref["input_ids"]), rtol=0, atol=1e-6)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Bit-identical weights when every value is exactly a code times a power-of-two scale.
# ---------------------------------------------------------------------------------------------
def _exact(name, shape, rng, fp4):
    """A weight that is exactly representable: (stored tensors, float32 values)."""
    if fp4:
        codes = rng.integers(0, 16, shape, dtype=np.uint8)
        scale = np.exp2(rng.integers(-10, -3, (shape[0], shape[1] // 32))).astype(np.float32)
        from dsv4.quantization import E2M1_VALUES

        values = E2M1_VALUES[codes] * np.repeat(scale, 32, 1)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
        return packed, scale.astype(ml_dtypes.float8_e8m0fnu), values
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN patterns
    grid = (-(-shape[0] // 16), -(-shape[1] // 16))
    scale = np.exp2(rng.integers(-14, -6, grid)).astype(np.float32)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(np.repeat(scale, 16, 0), 16, 1)[
        : shape[0], : shape[1]
    ]
    return codes.view(ml_dtypes.float8_e4m3fn), scale.astype(ml_dtypes.float8_e8m0fnu), values


def _write_raw(path, tensors):
    """A safetensors file from (dtype string, shape, bytes) triples: for torch's F4 dtype, which numpy lacks."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.fixture(scope="module")
def exact_checkpoints(tmp_path_factory):
    """One tiny model as float32 (DeepSeek layout) and as FP8 + FP4 experts in three spellings: DeepSeek's
    `.scale` with int8 experts, the same with torch's native F4 dtype, and transformers' `weight_scale_inv`
    names with stacked experts (`gate_up_proj_scale_inv`)."""
    root = tmp_path_factory.mktemp("exact")
    rng = np.random.default_rng(7)
    model = dsv4.init_random("tiny", seed=5)
    save(model, str(root / "base"), layout="deepseek")
    floats, ds, f4 = {}, {}, {}
    for name, value in _tensors(root / "base").items():
        if not RELEASED_FP8.search(name):
            floats[name] = ds[name] = value
            dtype = {"float32": "F32", "int32": "I32", "int64": "I64"}[value.dtype.name]
            f4[name] = (dtype, value.shape, value.tobytes())
            continue
        fp4 = bool(RELEASED_EXPERT.search(name))
        q, scale, values = _exact(name, value.shape, rng, fp4)
        floats[name] = values
        ds[name], ds[name.removesuffix(".weight") + ".scale"] = q, scale
        f4[name] = ("F4" if fp4 else "F8_E4M3", value.shape, q.tobytes())
        f4[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", scale.shape, scale.tobytes())
    qc = {"quant_method": "fp8", "weight_block_size": [16, 16], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    config = json.loads((root / "base" / "config.json").read_text())
    dirs = {}
    for kind, write in (("float", lambda p: save_file(floats, p)), ("deepseek", lambda p: save_file(ds, p)),
                        ("f4", lambda p: _write_raw(p, f4))):  # fmt: skip
        dirs[kind] = root / kind
        dirs[kind].mkdir()
        write(str(dirs[kind] / "model.safetensors"))
        cfg = config if kind == "float" else {**config, "quantization_config": qc}
        (dirs[kind] / "config.json").write_text(json.dumps(cfg))
    # transformers' names: the float model's canonical tensors, quantized where the DeepSeek copy was.
    reference = dsv4.load(dirs["float"], dtype=jnp.float32)
    hf = {}
    for path, var in nnx.to_flat_state(nnx.state(reference, nnx.Variable)):
        name = ".".join(map(str, path))
        key = name if name.startswith("lm_head.") else f"model.{name}"
        value = np.asarray(var[...])
        if ".mlp.experts." in name:
            q, s = quantize_fp4(value)
            hf[key], hf[key + "_scale_inv"] = q, s
        elif any(p in name for p in ("q_a_proj", "q_b_proj", "o_b_proj", "shared_experts")) or (
            name.endswith("self_attn.kv_proj.weight")
        ):
            q, s = quantize_fp8(value, (16, 16))
            hf[key], hf[key.removesuffix(".weight") + ".weight_scale_inv"] = q, s
        else:
            hf[key] = value
    dirs["transformers"] = root / "transformers"
    dirs["transformers"].mkdir()
    save_file(hf, str(dirs["transformers"] / "model.safetensors"))
    (dirs["transformers"] / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dirs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exactly_representable_weights_load_bit_identical(exact_checkpoints, dtype):
    want = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(
        dsv4.load(exact_checkpoints["float"], dtype=dtype), nnx.Variable))}  # fmt: skip
    for kind in ("deepseek", "f4", "transformers"):
        got = dsv4.load(exact_checkpoints[kind], dtype=dtype)
        for path, var in nnx.to_flat_state(nnx.state(got, nnx.Variable)):
            value = np.asarray(var[...])
            assert value.dtype == want[path].dtype and value.tobytes() == want[path].tobytes(), (kind, path)


def test_large_shards_go_to_the_device_in_row_slices(monkeypatch):
    """With a tiny slice size the larger tensors are assembled on the device from row slices (whole FP8 row
    blocks, single experts); the result is the same model."""
    path = os.path.join(FIXTURES, "tiny_mixed_fp4")
    model = dsv4.load(path, dtype=jnp.float32)
    want = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Variable))}
    monkeypatch.setattr(weights, "CHUNK_BYTES", 6000)
    for keep in (False, True):
        got = dsv4.load(path, dtype=jnp.float32, keep_quantized=keep)
        for p, v in nnx.to_flat_state(nnx.state(got, nnx.Variable)):
            assert np.asarray(v[...]).tobytes() == want[p].tobytes(), p


def test_slices_that_cut_through_scale_blocks_read_the_same_values():
    """A sharding may cut a quantized weight mid-block: the host path then reads the covering blocks."""
    entries = checkpoint_index(os.path.join(FIXTURES, "tiny_mixed_fp4"))
    sources = weights.canonical_sources(entries, weights.QuantSpec(block=(16, 16)))
    fp8 = sources["layers.1.self_attn.q_b_proj.weight"]  # [128, 32], 16 × 16 blocks
    full = fp8.read(np.float32)
    for index in ((slice(5, 37), slice(None)), (slice(16, 48), slice(None)), (slice(16, 128), slice(3, 30)),
                  (slice(120, 128), slice(0, 16))):
        np.testing.assert_array_equal(fp8.read(np.float32, index), full[index])
        got = fp8.read_for_device(np.float32, index)
        assert isinstance(got, np.ndarray) == (index[0].start % 16 != 0 or index[1] != slice(None))
    fp4 = sources["layers.2.mlp.experts.gate_up_proj"]  # [8, 64, 64] from 16 experts' w1 and w3
    full = fp4.read(np.float32)
    index = (slice(2, 5), slice(30, 40), slice(None))
    np.testing.assert_array_equal(fp4.read(np.float32, index), full[index])
    np.testing.assert_array_equal(dequantize_np(fp4.read_q(), fp4.read_scale(), "fp4", (1, 32), np.float32), full)


# ---------------------------------------------------------------------------------------------
# Bad input: errors name the tensor(s) and file, and come before anything reaches a device.
# ---------------------------------------------------------------------------------------------
def test_scale_of_the_wrong_grid(tmp_path):
    path = _copy_fixture("tiny_mixed_fp8", tmp_path)
    tensors = _tensors(path)
    tensors["layers.1.attn.wq_b.scale"] = tensors["layers.1.attn.wq_b.scale"][:, :1].copy()
    save_file(tensors, str(path / "model.safetensors"))
    _fails_before_devices(path, r"scale tensor layers\.1\.attn\.wq_b\.scale in .*model\.safetensors has shape "
                                r"\[8, 1\], but its weight layers\.1\.attn\.wq_b\.weight in .*model\.safetensors "
                                r"\(FP8, logical shape \[128, 32\], blocks \[16, 16\]\) needs \[8, 2\]")  # fmt: skip


def test_fp4_scale_of_the_wrong_grid(tmp_path):
    path = _copy_fixture("tiny_mixed_fp4", tmp_path)
    tensors = _tensors(path)
    tensors["layers.2.ffn.experts.3.w2.scale"] = tensors["layers.2.ffn.experts.3.w2.scale"][:32].copy()
    save_file(tensors, str(path / "model.safetensors"))
    _fails_before_devices(path, r"scale tensor layers\.2\.ffn\.experts\.3\.w2\.scale .* shape \[32, 1\].*"
                                r"w2\.weight .*FP4, logical shape \[64, 32\].* needs \[64, 1\]")  # fmt: skip


def test_fp8_weight_without_its_scale(tmp_path):
    path = _copy_fixture("tiny_mixed_fp8", tmp_path)
    tensors = _tensors(path)
    del tensors["layers.3.ffn.shared_experts.w2.scale"]
    save_file(tensors, str(path / "model.safetensors"))
    _fails_before_devices(path, r"tensor layers\.3\.ffn\.shared_experts\.w2\.weight in .*model\.safetensors is FP8 "
                                r"\(F8_E4M3\) but has no scale tensor")  # fmt: skip


def test_scale_without_weight_and_scale_on_a_float_weight(tmp_path):
    path = _copy_fixture("tiny_mixed_fp8", tmp_path)
    tensors = _tensors(path)
    save_file(tensors | {"layers.0.attn.extra.weight_scale_inv": np.ones((1, 1), np.float32)},
              str(path / "model.safetensors"))  # fmt: skip
    _fails_before_devices(path, r"scale tensor layers\.0\.attn\.extra\.weight_scale_inv in .*model\.safetensors has no "
                                r"weight: layers\.0\.attn\.extra\.weight is missing")  # fmt: skip
    save_file(tensors | {"layers.0.attn.wo_a.scale": np.ones((2, 4), np.float32)}, str(path / "model.safetensors"))
    _fails_before_devices(path, r"tensor layers\.0\.attn\.wo_a\.weight in .*model\.safetensors is F32 but has a scale "
                                r"tensor layers\.0\.attn\.wo_a\.scale")  # fmt: skip


def test_scale_of_an_unusable_dtype(tmp_path):
    path = _copy_fixture("tiny_mixed_fp8", tmp_path)
    tensors = _tensors(path)
    tensors["layers.0.attn.wq_a.scale"] = np.ones(tensors["layers.0.attn.wq_a.scale"].shape, np.int32)
    save_file(tensors, str(path / "model.safetensors"))
    _fails_before_devices(path, r"scale tensor layers\.0\.attn\.wq_a\.scale in .*model\.safetensors is I32")


def test_truncated_quantized_file(tmp_path):
    path = _copy_fixture("tiny_mixed_fp4", tmp_path)
    file = path / "model.safetensors"
    os.truncate(file, os.path.getsize(file) - 10)
    _fails_before_devices(path, r"tensor .* in .*model\.safetensors: file truncated")


def test_engine_keeps_a_checkpoint_quantized_and_refuses_it_for_a_preset():
    from dsv4.engine import _resolve_model

    path = os.path.join(FIXTURES, "tiny_mixed_fp8")
    model, where = _resolve_model(path, dtype="float32", seed=0, kernels="jnp", keep_quantized=True)
    assert where == path
    assert isinstance(model.layers[1].mlp.experts["gate_up_proj"].get_value(), BlockQuantized)
    with pytest.raises(ValueError, match="'tiny' is a preset"):
        _resolve_model("tiny", dtype=None, seed=0, kernels="jnp", keep_quantized=True)
