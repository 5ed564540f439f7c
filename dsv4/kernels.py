"""Which implementation runs each part of the model: one frozen value, resolved once per model.

Every field takes "auto" or a concrete implementation. `Kernels.resolve(dtype)` replaces each "auto" by the fastest
choice measured for the device (docs/BENCHMARKS.md), asking `dsv4.pallas._device` once: a GPU gets the Pallas
kernels, and a Hopper GPU (compute capability 9.x: H100, H200, H800, H20) their Mosaic GPU forms, which the kernels
pick themselves. The model and the engine carry the resolved value; nothing is steered by module state.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dsv4.pallas._device import is_hopper, on_gpu

CHOICES = {
    # the prefill core: the full sequence or a cached chunk of more than one token
    "attention": ("jnp", "pallas", "sp", "sp-pallas"),
    # one-token steps: "jnp" reads the cache densely and runs the jnp core; "pallas" runs the paged decode kernel
    # on the cache as stored where it takes the stores, else the attention core
    "decode": ("jnp", "pallas"),
    # the lightning indexer's scores and top-k (the pallas paths are two passes): "pallas" scores bf16 on the Mosaic
    # GPU kernel on Hopper, on the Triton kernel elsewhere; "pallas-triton" always on the Triton kernel; "pallas-fp8"
    # scores in e4m3 (Mosaic on Hopper)
    "indexer": ("jnp", "pallas", "pallas-triton", "pallas-fp8", "pallas-stream"),
    # one-token steps' indexer: "pallas" scores the keys where the cache stores them, through the block table (bf16
    # pages on the Mosaic GPU kernel on Hopper, the Triton kernel otherwise); "pallas-triton" always on the Triton
    # kernel
    "paged_indexer": ("jnp", "pallas", "pallas-triton"),
    # each refinement level of the exact grouped top-k: XLA's sort and gather, or one Pallas select kernel
    "topk_refine": ("jnp", "pallas"),
    "moe": ("jnp", "pallas"),
    # linear layers whose weights are kept FP8 in 128 × 128 blocks: read dequantized ("jnp"), or W8A8 on the stored
    # values (`dsv4.layers.project`: the grouped-GEMM kernels with one group); weights in the compute dtype take
    # the dot either way
    "dense": ("jnp", "pallas"),
    # cache writes: XLA's quantize + scatter, or the quantize-and-write kernel
    "kv_write": ("jnp", "pallas"),
    # "pallas": on Hopper the Mosaic GPU form (dsv4.layers.SINKHORN_MGPU_CONFIG), elsewhere Triton;
    # "pallas-triton": the Triton kernel; "pallas-mgpu": the Mosaic GPU form with its default config
    "sinkhorn": ("jnp", "pallas", "pallas-triton", "pallas-mgpu"),
    # q's RMS normalization in prefill: "jnp" normalizes q (XLA) before the core; "fold" rotates q in place and hands
    # the core q's inverse RMS per (token, head), which the attention kernels fold into their logit scale (the
    # whole-prompt sequence-parallel core applies it to q); one-token steps always take q normalized. "auto": "fold"
    # under the Pallas core on Hopper.
    "q_norm": ("jnp", "fold"),
    # CSA layers' prefill under the Pallas core: "pallas" the Mosaic kernel's CSA mode on Hopper (each listed row
    # gathered by its own TMA, issued by 4 warps; docs/kernels/attention.md), the Triton kernel elsewhere;
    # "pallas-triton" the Triton kernel. "auto": "pallas" on Hopper.
    "csa": ("pallas", "pallas-triton"),
}
SEQUENCE_PARALLEL_CORES = ("sp", "sp-pallas")
_FAST_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention: str = "auto"
    decode: str = "auto"
    indexer: str = "auto"
    paged_indexer: str = "auto"
    topk_refine: str = "auto"
    moe: str = "auto"
    dense: str = "auto"
    kv_write: str = "auto"
    sinkhorn: str = "auto"
    q_norm: str = "auto"
    csa: str = "auto"

    def __post_init__(self):
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value != "auto" and value not in choices:
                raise ValueError(f"Kernels.{name}={value!r}; choose 'auto' or one of {list(choices)}")

    @classmethod
    def all(cls, impl: str) -> Kernels:
        """Every part on `impl` ("jnp" or "pallas"): the XLA reference, or every Pallas kernel (interpreted off a
        GPU); q's normalization "jnp" either way (it is a route, not a kernel), and CSA's kernel "pallas" (it
        matters only under the Pallas core)."""
        if impl not in ("jnp", "pallas"):
            raise ValueError(f"Kernels.all({impl!r}): 'jnp' or 'pallas'")
        return cls(**{**dict.fromkeys(CHOICES, impl), "q_norm": "jnp", "csa": "pallas"})

    @classmethod
    def parse(cls, spec: str) -> Kernels:
        """"pallas", "jnp", "auto", or comma-separated part=impl pairs ("attention=pallas,moe=jnp")."""
        spec = spec.strip()
        if spec in ("jnp", "pallas"):
            return cls.all(spec)
        if spec in ("", "auto"):
            return cls()
        fields = {}
        for item in spec.split(","):
            name, eq, value = (s.strip() for s in item.partition("="))
            if not eq or name not in CHOICES:
                raise ValueError(f"kernels: {item!r} is not part=impl with part one of {list(CHOICES)}")
            fields[name] = value
        return cls(**fields)

    def resolve(self, dtype, *, gpu: bool | None = None, hopper: bool | None = None) -> Kernels:
        """Every "auto" replaced for a model computing in `dtype` on the default device (`gpu`, `hopper` override
        what the device says).

        On a GPU: the Pallas kernels wherever they are measured faster than XLA, for 16-bit models (a float32
        model keeps XLA's full-precision dots in attention, the indexer and the dense layers); decode steps and cache
        writes stay on XLA, whose step measured as fast as the kernels' (the step is host-bound); on Hopper q's
        normalization folds into the Mosaic attention kernel, whose CSA mode takes the CSA layers too, and linear
        layers whose weights are kept FP8 run W8A8. Off a GPU: jnp everywhere."""
        gpu = on_gpu() if gpu is None else gpu
        hopper = gpu and (is_hopper() if hopper is None else hopper)
        fast = gpu and jnp.dtype(dtype) in _FAST_DTYPES
        indexer = _pick(self.indexer, "pallas" if fast else "jnp")
        attention = _pick(self.attention, "pallas" if fast else "jnp")
        auto = dict(
            attention=attention,
            decode="jnp",
            indexer=indexer,
            paged_indexer=indexer if indexer in ("pallas", "pallas-triton") else "jnp",
            topk_refine="pallas" if hopper else "jnp",  # measured on Hopper only
            moe="pallas" if gpu else "jnp",
            # W8A8 on the stored FP8 values (Mosaic, Hopper): TTFT 512K 1.020x the dequantized route (H100,
            # docs/BENCHMARKS.md, "Dense layers in FP8"); a float32 model keeps the dequantized weights' full dot
            dense="pallas" if hopper and fast else "jnp",
            kv_write="jnp",
            sinkhorn="pallas" if gpu else "jnp",
            # the fold saves the normalized q's write and read: 1.007-1.012x TTFT at 512K (docs/BENCHMARKS.md)
            q_norm="fold" if hopper and attention == "pallas" else "jnp",
            # the Mosaic CSA mode: 1.45x the Triton kernel at 128K, TTFT 512K 1.037x (docs/BENCHMARKS.md)
            csa="pallas" if hopper else "pallas-triton",
        )
        return Kernels(**{name: _pick(getattr(self, name), auto[name]) for name in CHOICES})

    @property
    def resolved(self) -> bool:
        return all(getattr(self, name) != "auto" for name in CHOICES)

    @property
    def sequence_parallel(self) -> bool:
        return self.attention in SEQUENCE_PARALLEL_CORES

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in CHOICES)


def _pick(value: str, auto: str) -> str:
    return auto if value == "auto" else value
