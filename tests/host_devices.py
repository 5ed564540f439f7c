"""The environment for a test subprocess that needs several CPU host devices (this process has initialized jax
with one): the caller's XLA_FLAGS kept (e.g. `scripts/dev test`'s --xla_backend_optimization_level=0), with
--xla_force_host_platform_device_count set to `n`."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_devices_env(n: int) -> dict[str, str]:
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    flags = " ".join([*kept, f"--xla_force_host_platform_device_count={n}"])
    return {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": ROOT}
