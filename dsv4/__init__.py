"""dsv4: a JAX/Flax inference engine for DeepSeek-V4 models, built for long-prompt time to first token.

The names below load on first use, so that the host-side modules (`dsv4.scheduler`, `dsv4.cache`) import no JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "dsv4.config",
    "DeepseekV4": "dsv4.model",
    "Kernels": "dsv4.kernels",
    "LLM": "dsv4.engine",
    "RequestOutput": "dsv4.engine",
    "SamplingParams": "dsv4.generate",
    "convert": "dsv4.api",
    "init_random": "dsv4.api",
    "load": "dsv4.api",
    "num_params": "dsv4.api",
}
__all__ = sorted(_EXPORTS)


_SUBMODULES = ("attention", "cache", "engine", "kernels", "pallas", "sharding")


def __getattr__(name: str):
    if name in _SUBMODULES:  # dsv4.sharding.make_mesh() after a bare `import dsv4`
        return importlib.import_module(f"dsv4.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
