"""The abstract GPU the CPU tests lower kernels for: `with abstract_gpu_mesh(): jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))` compiles a Pallas kernel for that device (Triton or Mosaic GPU module) without one."""

from __future__ import annotations

import jax


def abstract_gpu_mesh(kind: str = "NVIDIA H200", cores: int = 132):
    """A context manager: an empty abstract mesh whose device is a `kind` GPU with `cores` SMs."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind=kind, platform="gpu", num_cores=cores)
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))
