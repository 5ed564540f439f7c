"""Orbax checkpoints: writing a model's state, and reading it back onto any mesh (`dsv4.convert` and
`dsv4 convert` write one from any checkpoint).

An orbax checkpoint directory holds
  config.json        the model config (its quantization_config only when weights were kept quantized);
  dsv4_orbax.json    {"format": "dsv4-orbax", "version": 1, "dtype": ..., "quantized": {name: {fmt, block}}};
  state/             an orbax-checkpoint (0.12) PyTree checkpoint: a nested dict that mirrors the module tree
                     (`layers/3/self_attn/q_b_proj/weight`), each array stored sharded with tensorstore;
                     a kept-quantized weight is a {"q", "scale"} pair.
Restoring reads each device's slice of each array from disk, so the checkpoint loads onto a different
mesh (or one device) than it was written from.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import numpy as np
from flax import nnx

from dsv4.quantization import BlockQuantized, fp4_scale_shape, fp8_scale_shape
from dsv4.weights import CheckpointError, module_name

log = logging.getLogger("dsv4.orbax")

MARKER = "dsv4_orbax.json"
FORMAT = "dsv4-orbax"
VERSION = 1


def is_orbax_checkpoint(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, MARKER))


def _tree_key(path: tuple) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def _nest(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return tree


def _leaf(tree: dict, key: tuple[str, ...]):
    for part in key:
        tree = tree[part]
    return tree


def _limit_gb(arrays) -> int:
    """Orbax's in-flight byte limit: just above the largest array, so about one array is on the host at a
    time (orbax refuses an array larger than the limit)."""
    largest = max((int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays), default=0)
    return max(1, math.ceil(largest / 1e9) + 1)


def _checkpointer(limit_gb: int):
    """A synchronous PyTree checkpointer that moves at most `limit_gb` GB between device, host and disk at once
    (orbax's default lets a save copy the whole model to host memory first)."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=limit_gb, restore_concurrent_gb=limit_gb,
                                          save_device_host_concurrent_gb=limit_gb)  # fmt: skip
    return ocp.Checkpointer(handler)


def save_orbax(model: nnx.Module, dst_dir: str) -> None:
    """Writes `model` (plain or with `BlockQuantized` weights) as an orbax checkpoint in `dst_dir`."""
    import orbax.checkpoint as ocp

    dst_dir = os.path.abspath(dst_dir)
    state_dir = os.path.join(dst_dir, "state")
    if os.path.exists(state_dir):
        raise FileExistsError(f"{state_dir} exists; convert into an empty directory")
    os.makedirs(dst_dir, exist_ok=True)
    flat, quantized = {}, {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        value = var.get_value()
        if isinstance(value, BlockQuantized):
            flat[_tree_key(path)] = {"q": value.q, "scale": value.scale}
            quantized[module_name(path)] = {"fmt": value.fmt, "block": list(value.block)}
        else:
            flat[_tree_key(path)] = value
    t0 = time.perf_counter()
    tree = _nest(flat)
    with _checkpointer(_limit_gb(jax.tree.leaves(tree))) as checkpointer:
        checkpointer.save(state_dir, args=ocp.args.PyTreeSave(tree))
    log.info("wrote orbax checkpoint %s in %.1f s", state_dir, time.perf_counter() - t0)
    config = model.config
    if not quantized:
        config = config.replace(quantization_config_json=None)
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
    with open(os.path.join(dst_dir, MARKER), "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "dtype": np.dtype(model.dtype).name, "quantized": quantized},
                  f, indent=2)  # fmt: skip


def load_orbax_into(abstract_model: nnx.Module, model_dir: str, *, sharding_for=None, keep_quantized: bool = False,
                    check_integer=None) -> nnx.Module:  # fmt: skip
    """Fills an abstract model from an orbax checkpoint written by `save_orbax`, each array restored
    straight onto its sharding (`sharding_for(path, var)`, default: the default device). Arrays stored in
    another dtype are cast by orbax; kept-quantized weights are dequantized unless `keep_quantized`.
    """
    with open(os.path.join(model_dir, MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(f"{os.path.join(model_dir, MARKER)}: not a {FORMAT} v{VERSION} checkpoint ({marker})")
    state_dir = os.path.abspath(os.path.join(model_dir, "state"))
    quantized = marker.get("quantized", {})

    if not os.path.isdir(state_dir):
        raise CheckpointError(f"{state_dir}: no readable orbax checkpoint (the directory is missing)")
    with _checkpointer(1) as checkpointer:
        try:
            stored = checkpointer.metadata(state_dir).item_metadata
        except (FileNotFoundError, ValueError) as e:
            raise CheckpointError(f"{state_dir}: no readable orbax checkpoint ({e})") from None
    if stored is None:
        raise CheckpointError(f"{state_dir}: no readable orbax checkpoint (no tree metadata)")
    return _restore(stored, abstract_model, state_dir, quantized, sharding_for, keep_quantized, check_integer)


def _restore(stored, abstract_model, state_dir, quantized, sharding_for, keep_quantized, check_integer):
    import orbax.checkpoint as ocp

    from dsv4.weights import fit_sharding

    graphdef, state = nnx.split(abstract_model)
    flat = nnx.to_flat_state(state)
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    stored_keys = {tuple(str(k.key) for k in p): m for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}

    targets, plan = {}, []
    for path, var in flat:
        name, key = module_name(path), _tree_key(path)
        shape, dtype = tuple(var.shape), np.dtype(var.dtype)
        sharding = (sharding_for(path, var) if sharding_for is not None else None) or default
        q = quantized.get(name)
        if q is not None:
            fmt, block = q["fmt"], tuple(q["block"])
            q_shape = (*shape[:-1], shape[-1] // 2) if fmt == "fp4" else shape
            s_shape = fp8_scale_shape(shape, block) if fmt == "fp8" else fp4_scale_shape(shape)
            expected = {key + ("q",): q_shape, key + ("scale",): s_shape}
        else:
            expected = {key: shape}
        for k, want in expected.items():
            meta = stored_keys.pop(k, None)
            if meta is None:
                raise CheckpointError(f"tensor {name} is missing from the orbax checkpoint {state_dir}")
            if tuple(meta.shape) != want:
                raise CheckpointError(f"tensor {name} ({'/'.join(k)}) in {state_dir} has shape {list(meta.shape)}; "
                                      f"the config needs {list(want)}")  # fmt: skip
            stored_dtype = np.dtype(meta.dtype)
            target_dtype = dtype if q is None else stored_dtype
            if np.issubdtype(stored_dtype, np.integer) != np.issubdtype(target_dtype, np.integer):
                raise CheckpointError(f"tensor {name} in {state_dir} is {stored_dtype}; expected a {target_dtype} "
                                      "tensor")  # fmt: skip
            targets[k] = jax.ShapeDtypeStruct(want, target_dtype, sharding=fit_sharding(sharding, want))
        plan.append((path, var, name, key, q))
    if stored_keys:
        extra = sorted(stored_keys)
        raise CheckpointError(f"{len(extra)} unexpected tensors in the orbax checkpoint {state_dir}, e.g. "
                              f"{'/'.join(extra[0])}: config and checkpoint disagree")  # fmt: skip

    target = _nest(targets)
    with _checkpointer(_limit_gb(targets.values())) as checkpointer:
        restored = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))  # fmt: skip
    values = {}
    for path, var, name, key, q in plan:
        if q is None:
            value = _leaf(restored, key)
            if check_integer is not None and np.issubdtype(np.dtype(value.dtype), np.integer):
                check_integer(name, np.asarray(value), state_dir)
            values[path] = value
            continue
        node = _leaf(restored, key)
        value = BlockQuantized(node["q"], node["scale"], q["fmt"], tuple(q["block"]), tuple(var.shape),
                               np.dtype(var.dtype).name)  # fmt: skip
        if not keep_quantized:
            sharding = (sharding_for(path, var) if sharding_for is not None else None) or default
            value = jax.jit(BlockQuantized.dequantize, out_shardings=sharding)(value)
        values[path] = value
    for path, var in flat:
        var.set_value(values[path])
    return nnx.merge(graphdef, state)
