"""Which attention core runs a call: the `Kernels.attention` name → a function with `core_attention_jnp`'s
signature. The one place that maps names to cores; `dsv4.kernels` says which names exist and how "auto" resolves."""

from __future__ import annotations

from collections.abc import Callable

import jax

from dsv4.attention.core import core_attention_jnp
from dsv4.attention.pallas_core import core_attention_pallas
from dsv4.attention.sequence_parallel import core_attention_sp, core_attention_sp_pallas

AttentionFn = Callable[..., jax.Array]
ATTENTION_CORES: dict[str, AttentionFn] = {"jnp": core_attention_jnp, "pallas": core_attention_pallas,
                                           "sp": core_attention_sp, "sp-pallas": core_attention_sp_pallas}  # fmt: skip
# cores that take a cached chunk's ring as its first `kv_prefix` rows (the others mask by position)
PREFIX_LAYOUT = ("pallas",)


def attention_core(name: str) -> AttentionFn:
    try:
        return ATTENTION_CORES[name]
    except KeyError:
        raise ValueError(f"attention core {name!r}; available: {sorted(ATTENTION_CORES)}") from None
