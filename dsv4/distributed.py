"""Multi-process runs under `jax.distributed`: one process per host (or per GPU), one global mesh.

The engine runs SPMD over the processes: requests enter at process 0 and are broadcast (`broadcast_prompts`), and
then every process executes the same steps. The host scheduler is deterministic given the same requests, and the
logits each step samples from are replicated on every device, so every process samples the same tokens from the same
seeded generators; nothing else needs to travel between the hosts.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, cpu_devices: int | None = None, heartbeat_timeout_s: int = 30) -> None:  # fmt: skip
    """Joins the job; call before anything touches a device.

    Arguments default to $DSV4_COORDINATOR ("host:port"), $DSV4_NUM_PROCESSES, $DSV4_PROCESS_ID; with none
    of them, jax's own auto-detection (SLURM, Open MPI, ...) decides. `cpu_devices` fakes that many host
    devices per process (CPU tests). On CPU the processes talk through gloo. A peer silent for
    `heartbeat_timeout_s` counts as dead: jax's coordination service then fails the others with an error naming
    the task ("Task 1 heartbeat timeout"), so a crashed process never leaves the rest waiting in a collective.
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
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)  # fmt: skip


def broadcast_prompts(prompts: list[list[int]] | None) -> list[list[int]]:
    """Process 0's prompts (token ids) on every process; the others pass None. One process: returned as they are."""
    if jax.process_count() == 1:
        return prompts
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(prompts).encode(), np.uint8) if jax.process_index() == 0 else None
    size = multihost_utils.broadcast_one_to_all(np.int64(0 if payload is None else payload.size))
    buffer = np.zeros(int(size), np.uint8) if payload is None else payload
    data = multihost_utils.broadcast_one_to_all(buffer)
    return json.loads(np.asarray(data).tobytes().decode())
