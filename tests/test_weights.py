"""Checkpoint loading: both layouts, sharded files, and bad input that names the tensor and file."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import dsv4
from dsv4.weights import CheckpointError, checkpoint_index, read_tensor, save


@pytest.fixture(scope="module")
def tiny_model():
    return dsv4.init_random("tiny", seed=3)


@pytest.fixture
def ckpt(tmp_path, tiny_model):
    save(tiny_model, str(tmp_path))
    return tmp_path


def _tensors(path):
    return {name: np.array(read_tensor(e)) for name, e in checkpoint_index(str(path)).items()}


def _rewrite(path, tensors):
    save_file(tensors, os.path.join(path, "model.safetensors"))


def test_both_layouts_and_shards_load_to_identical_logits(tmp_path, tiny_model):
    ids = np.random.default_rng(0).integers(0, 256, (1, 23))
    want = np.asarray(tiny_model.logits(ids))
    save(tiny_model, str(tmp_path / "hf"))
    save(tiny_model, str(tmp_path / "ds"), layout="deepseek")
    assert "layers.1.attn.indexer.compressor.ape" in checkpoint_index(str(tmp_path / "ds"))
    assert "model.layers.1.self_attn.compressor.indexer.position_bias" in checkpoint_index(str(tmp_path / "hf"))
    # A sharded copy: two files and an index, plus multi-token-prediction tensors that must be skipped.
    tensors = _tensors(tmp_path / "ds")
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "ds" / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        extra = {"mtp.0.attn.wq_a.weight": np.zeros((2, 2), np.float32)} if i else {}
        save_file({n: tensors[n] for n in part} | extra, str(shard_dir / file))
        weight_map.update({n: file for n in [*part, *extra]})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for d in ("hf", "ds", "sharded"):
        model = dsv4.load(tmp_path / d, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(model.logits(ids)), want)


def test_bfloat16_load_keeps_the_float32_parameters(ckpt):
    model = dsv4.load(ckpt, dtype=jnp.bfloat16)
    assert model.embed_tokens["weight"][...].dtype == jnp.bfloat16
    assert model.layers[0].self_attn.sinks[...].dtype == jnp.float32  # norms, sinks, hc stay float32
    assert model.layers[0].attn_hc.fn[...].dtype == jnp.float32


def test_missing_tensor(ckpt):
    tensors = _tensors(ckpt)
    del tensors["model.layers.2.self_attn.compressor.position_bias"]
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.compressor\.position_bias.*missing"):
        dsv4.load(ckpt)


def test_unexpected_tensor(ckpt):
    tensors = _tensors(ckpt) | {"model.layers.0.self_attn.extra_proj.weight": np.zeros((2, 2), np.float32)}
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"unexpected.*extra_proj.*model\.safetensors"):
        dsv4.load(ckpt)


def test_misshaped_tensor(ckpt):
    tensors = _tensors(ckpt)
    tensors["model.layers.1.self_attn.q_b_proj.weight"] = np.zeros((64, 32), np.float32)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight.*\[64, 32\].*\[128, 32\]"):
        dsv4.load(ckpt)


def test_wrong_dtype_and_bad_expert_table(ckpt):
    tensors = _tensors(ckpt)
    tensors["model.layers.0.mlp.gate.tid2eid"] = tensors["model.layers.0.mlp.gate.tid2eid"].astype(np.float32)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"tid2eid.*F32"):
        dsv4.load(ckpt)
    tensors["model.layers.0.mlp.gate.tid2eid"] = np.full((256, 2), 99, np.int64)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"tid2eid.*outside \[0, 8\)"):
        dsv4.load(ckpt)


def test_truncated_file_fails_before_anything_reaches_a_device(ckpt):
    path = ckpt / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    before = len(jax.live_arrays())
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        dsv4.load(ckpt)
    assert len(jax.live_arrays()) == before  # nothing half-loaded
    (ckpt / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="truncated"):
        dsv4.load(ckpt)


def test_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*model\.norm\.weight.*missing"):
        dsv4.load(ckpt)


def test_missing_expert(tmp_path, tiny_model):
    save(tiny_model, str(tmp_path), layout="deepseek")
    tensors = _tensors(tmp_path)
    del tensors["layers.3.ffn.experts.5.w3.weight"]
    _rewrite(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"layers\.3\.mlp\.experts\.5\.w3\.weight is missing"):
        dsv4.load(tmp_path)


def test_mtp_layers_are_skipped_with_a_log_line(ckpt, caplog):
    _rewrite(ckpt, _tensors(ckpt) | {"mtp.0.attn.wq_a.weight": np.zeros((2, 2), np.float32)})
    with caplog.at_level(logging.INFO, logger="dsv4.weights"):
        dsv4.load(ckpt, dtype=jnp.float32)
    assert "multi-token-prediction" in caplog.text


def test_bad_token_ids(tiny_model):
    with pytest.raises(ValueError, match=r"token id 256 at position \(0, 2\) is out of range \[0, 256\)"):
        tiny_model.logits([[1, 2, 256]])
    with pytest.raises(ValueError, match="token id -1"):
        tiny_model.logits([-1, 3])
    with pytest.raises(ValueError, match="must be int"):
        tiny_model.logits(np.zeros((1, 3), np.float32))
