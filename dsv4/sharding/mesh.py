"""Device meshes and placing a model's parameters on one."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dsv4.sharding.rules import SEQUENCE_PARALLEL, ShardingRules, named_sharding


def make_mesh(sp: int | None = None, *, devices=None) -> Mesh:
    """A 1-D mesh with axis "sp" over `sp` devices (default: all, across every process)."""
    devices = list(devices if devices is not None else jax.devices())
    sp = sp or len(devices)
    if sp > len(devices) or sp < 1:
        raise ValueError(f"sp={sp} but {len(devices)} devices are available")
    return Mesh(np.asarray(devices[:sp]), ("sp",))


def param_sharding(mesh: Mesh, rules: ShardingRules = SEQUENCE_PARALLEL):
    """`sharding_for(path, var)` for the checkpoint loader: each parameter by its logical `axes`."""

    def sharding_for(path, var):
        return named_sharding(mesh, rules, var.get_metadata().get("axes", (None,) * len(var.shape)), var.shape)

    return sharding_for


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules = SEQUENCE_PARALLEL) -> nnx.Module:
    """Moves every parameter of `model` onto `mesh` as its logical axes say (in place; returns it)."""
    sharding_for = param_sharding(mesh, rules)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        # Through the host: a committed single-device array cannot be device_put onto a mesh that spans
        # processes, but every process can hand in its own shards. (For big checkpoints pass
        # `param_sharding(mesh)` to the loader instead, which never builds the unsharded model.)
        host = np.asarray(var[...])
        sharding = sharding_for(path, var)
        var.set_value(jax.make_array_from_callback(host.shape, sharding, lambda index, h=host: h[index]))
    return model


def check_mesh(mesh: Mesh, num_experts: int) -> None:
    """Refuses a mesh the engine cannot lay the model out on, naming the cause: it must be one "sp" axis (the
    sequence and the routed experts split over it), whose size divides the routed experts."""
    if tuple(mesh.axis_names) != ("sp",):
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)}: the engine runs on a 1-D mesh with axis 'sp' "
                         "(dsv4.sharding.make_mesh)")  # fmt: skip
    n = mesh.shape["sp"]
    if num_experts % n:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"a mesh of {n} devices cannot split the model's {num_experts} routed experts evenly; use a "
                         f"device count that divides {num_experts}: {divisors}")  # fmt: skip


def on_mesh(model: nnx.Module, mesh: Mesh) -> bool:
    """Whether every parameter of `model` already lives on `mesh`."""
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        sharding = getattr(var[...], "sharding", None)
        if getattr(sharding, "mesh", None) != mesh:
            return False
    return True
