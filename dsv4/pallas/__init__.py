"""Pallas kernels for dsv4 (see README.md here). Import the kernel modules directly, e.g. `dsv4.pallas.attention`.

This package imports jax only, never the model, cache, scheduler or engine; wiring a kernel into the model
(e.g. registering it as an attention implementation) is done on the model's side.
"""
