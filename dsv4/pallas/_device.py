"""Facts about the default device that kernels dispatch on (jax only). The one place that answers "is this a GPU"
and "is this Hopper": by platform and compute capability, never by device name."""

from __future__ import annotations

import jax

# SMs of an H200, used when the device does not say (CPU, interpret runs).
DEFAULT_SM_COUNT = 132


def _default_device():
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def on_gpu() -> bool:
    """Whether the default backend is a GPU (else the kernels run interpreted, or jnp is chosen)."""
    return jax.default_backend() == "gpu"


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the default GPU, or None off a GPU."""
    device = _default_device()
    if device is None or device.platform != "gpu":
        return None
    major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() else None


def is_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x: H100, H200, H800, H20), where the
    Mosaic GPU kernels run."""
    cc = compute_capability()
    return cc is not None and cc[0] == 9


def sm_count() -> int:
    """SMs of the default device (GPU), else `DEFAULT_SM_COUNT`."""
    device = _default_device()
    if device is None or device.platform != "gpu":
        return DEFAULT_SM_COUNT
    return int(getattr(device, "core_count", 0) or DEFAULT_SM_COUNT)
