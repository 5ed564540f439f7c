"""Orbax checkpoints: `dsv4.convert` writes them, `dsv4.load` reads them back onto one device or a mesh.

The source is the quantized fixture `tiny_mixed_fp4` (FP8 weights + FP4 experts), converted dequantized (float32)
and kept quantized. The 8-device part runs in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, since this process initialized jax with one CPU device.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from host_devices import host_devices_env

import dsv4
from dsv4.api import convert
from dsv4.cli import main
from dsv4.quantization import BlockQuantized
from dsv4.weights import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SOURCE = os.path.join(FIXTURES, "tiny_mixed_fp4")


def _params(model) -> dict[str, np.ndarray]:
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        value = var.get_value()
        name = ".".join(map(str, path))
        if isinstance(value, BlockQuantized):
            out[name + ".q"], out[name + ".scale"] = np.asarray(value.q), np.asarray(value.scale)
        else:
            out[name] = np.asarray(value)
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    convert(SOURCE, root / "f32", dtype=jnp.float32)
    convert(SOURCE, root / "kept", dtype=jnp.float32, keep_quantized=True)
    return root


def test_convert_and_load_round_trip_on_one_device(converted, caplog):
    assert sorted(os.listdir(converted / "f32")) == ["config.json", "dsv4_orbax.json", "state"]
    assert "quantization_config" not in json.loads((converted / "f32" / "config.json").read_text())
    kept_config = json.loads((converted / "kept" / "config.json").read_text())
    assert kept_config["quantization_config"]["weight_block_size"] == [16, 16]
    with caplog.at_level(logging.INFO, logger="dsv4"):
        restored = dsv4.load(converted / "f32", dtype=jnp.float32)
    assert "orbax checkpoint" in caplog.text
    _assert_same(_params(restored), _params(dsv4.load(SOURCE, dtype=jnp.float32)))
    # Kept quantized: the same q and scales as a kept load of the safetensors, or dequantized on restore.
    _assert_same(_params(dsv4.load(converted / "kept", dtype=jnp.float32, keep_quantized=True)),
                 _params(dsv4.load(SOURCE, dtype=jnp.float32, keep_quantized=True)))  # fmt: skip
    _assert_same(_params(dsv4.load(converted / "kept", dtype=jnp.float32)), _params(restored))
    # Identical weights, so identical logits; shown through one compiled program (the safetensors model's config
    # differs only in its quantization_config, which would compile anew).
    ids = np.load(os.path.join(SOURCE, "reference.npz"))["input_ids"]
    source = nnx.merge(nnx.graphdef(restored), nnx.state(dsv4.load(SOURCE, dtype=jnp.float32)))
    np.testing.assert_array_equal(np.asarray(restored.logits(ids)), np.asarray(source.logits(ids)))


EIGHT_DEVICES = """
    import sys, numpy as np, jax, jax.numpy as jnp, dsv4
    from flax import nnx
    from jax.sharding import PartitionSpec
    from dsv4.sharding import make_mesh
    from dsv4.quantization import BlockQuantized
    source, f32, kept, expected = sys.argv[1:]
    want = np.load(expected)
    mesh = make_mesh(8)
    assert jax.device_count() == 8
    def check(model, quantized=False):
        experts = model.layers[1].mlp.experts["gate_up_proj"].get_value()
        arrays = (experts.q, experts.scale) if quantized else (experts,)
        for a in arrays:  # routed experts split over the 8 devices (one expert each), no copy of the whole
            assert a.sharding.spec == PartitionSpec("sp", None, None), a.sharding
            assert sorted(s.index[0].start for s in a.addressable_shards) == list(range(8))
            assert all(s.data.shape[0] == 1 for s in a.addressable_shards)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
            value = var.get_value()
            value = value.dequantize() if isinstance(value, BlockQuantized) else value
            got = np.asarray(jax.device_get(value))
            assert got.tobytes() == want[".".join(map(str, path))].tobytes(), path
        return model
    on_mesh = check(dsv4.load(f32, dtype=jnp.float32, mesh=mesh))
    check(dsv4.load(source, dtype=jnp.float32, mesh=mesh))  # safetensors streamed slice by slice
    check(dsv4.load(kept, dtype=jnp.float32, mesh=mesh))
    check(dsv4.load(kept, dtype=jnp.float32, mesh=mesh, keep_quantized=True), quantized=True)
    logits = np.asarray(on_mesh.logits(want["input_ids"]))
    print("max_abs_diff", float(np.abs(logits - want["logits"]).max()))
"""


def test_orbax_restores_onto_eight_host_devices(converted, tmp_path):
    """Weights restored onto an 8-device mesh (experts split) are bit-identical to the 1-device load, from
    orbax (dequantized or kept) and from safetensors alike. Logits computed on the mesh agree to 1e-5:
    identical weights, but XLA's partitioned program adds float32 partial sums in another order (measured
    8e-7 on logits of magnitude 2.5)."""
    model = dsv4.load(converted / "f32", dtype=jnp.float32)
    ids = np.load(os.path.join(SOURCE, "reference.npz"))["input_ids"]
    expected = tmp_path / "expected.npz"
    np.savez(expected, input_ids=ids, logits=np.asarray(model.logits(ids)), **_params(model))
    env = host_devices_env(8)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(EIGHT_DEVICES), SOURCE, str(converted / "f32"),
                          str(converted / "kept"), str(expected)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert float(out.stdout.split("max_abs_diff")[1]) < 1e-5


def test_bad_orbax_checkpoints_name_the_tensor(converted, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(converted / "f32", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "q_lora_rank": 16}))
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.self_attn\.q_a_norm\.weight .* has shape \[32\]; "
                                              r"the config needs \[16\]"):  # fmt: skip
        dsv4.load(bad, dtype=jnp.float32)
    shutil.rmtree(bad / "state")
    with pytest.raises(CheckpointError, match=r"no readable orbax checkpoint"):
        dsv4.load(bad, dtype=jnp.float32)


def test_convert_command_line_with_progress(tmp_path, capsys):
    assert main(["convert", SOURCE, str(tmp_path / "out"), "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "loading tiny_mixed_fp4:" in err and "GB" in err and "converted" in err
    assert (tmp_path / "out" / "dsv4_orbax.json").exists()
    assert main(["convert", SOURCE, str(tmp_path / "out")]) == 2  # refuses to overwrite
    assert "exists" in capsys.readouterr().err
