"""Facts about the default device that kernels dispatch on (jax only)."""

from __future__ import annotations

import jax

# SMs of an H200, used when the device does not say (CPU, interpret runs).
DEFAULT_SM_COUNT = 132


def is_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where the Mosaic GPU kernels run."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def sm_count() -> int:
    """SMs of the default device (GPU), else `DEFAULT_SM_COUNT`."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_SM_COUNT
    if device.platform != "gpu":
        return DEFAULT_SM_COUNT
    return int(getattr(device, "core_count", 0) or DEFAULT_SM_COUNT)
