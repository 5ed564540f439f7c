"""Multi-process runs under `jax.distributed`: one process per host (or per GPU), one global mesh."""

from __future__ import annotations

import os

import jax


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, cpu_devices: int | None = None) -> None:  # fmt: skip
    """Joins the job; call before anything touches a device.

    Arguments default to $DSV4_COORDINATOR ("host:port"), $DSV4_NUM_PROCESSES, $DSV4_PROCESS_ID; with none
    of them, jax's own auto-detection (SLURM, Open MPI, ...) decides. `cpu_devices` fakes that many host
    devices per process (CPU tests). On CPU the processes talk through gloo.
    """
    coordinator = coordinator or os.environ.get("DSV4_COORDINATOR")
    if num_processes is None and "DSV4_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["DSV4_NUM_PROCESSES"])
    if process_id is None and "DSV4_PROCESS_ID" in os.environ:
        process_id = int(os.environ["DSV4_PROCESS_ID"])
    if cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    # CPU arrays need a cross-process collectives backend (GPU ones use NCCL regardless).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)

