"""dsv4.pallas.indexer_mgpu: the Mosaic GPU FP8 scores kernel against the indexer's jnp reference.

CPU (not gpu-marked):
- the kernel lowers for CUDA at V4 shapes (Hi = 64, Di = 128, 512 queries × 32K keys, per-row scales) inside an
  abstract H200 mesh (Pallas/Mosaic lowering, layouts and the SMEM budget; not miscompiles);
- the Mosaic GPU interpreter runs it on integer-valued e4m3 inputs with power-of-two scales, where every product and
  sum is exact in float32 in any order: the scores must equal `index_scores_reference` bit for bit (-inf pattern
  included), and `index_topk_two_pass(scores_impl="mgpu")` must pick exactly `index_topk_reference`'s indices.
  Shapes are not block multiples: 13 queries (CTAs of 4), 150 keys (tiles of 64, spans of 128), one batch row
  whose first queries see nothing. It runs in a subprocess with XLA:CPU's multi-threaded Eigen off: the
  interpreter runs the three warpgroups as threads that block inside host callbacks, and on a 2-core machine they
  can hold every thread of XLA:CPU's intra-op pool (found here: the same run hangs with it on, passes with it off);
- input errors.
GPU (`-m gpu`): Gaussian e4m3 inputs against the reference, after a NaN-input run of the same shape (so a recycled
output buffer holds NaN where the kernel fails to write).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.pallas.indexer import index_scores_reference, index_topk_reference, index_topk_two_pass
from dsv4.pallas.indexer_mgpu import MgpuScoreConfig, index_scores_mgpu

FP8 = jnp.float8_e4m3fn
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a Hopper GPU (Mosaic GPU kernel)")


def integer_inputs(seed, *, batch=2, seq=13, entries=150, offsets=(0, 500), span=3, rate=4):
    """Integer q [B, S, 64, 128] and keys [B, C, 128] in [-span, span] as e4m3, weights in [-2, 2], power-of-two
    scales (per (token, head) for q, per row for keys): every score is exact in float32."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-span, span + 1, (batch, seq, 64, 128))
    keys = rng.integers(-span, span + 1, (batch, entries, 128))
    weights = rng.integers(-2, 3, (batch, seq, 64)).astype(np.float32)
    q_scale = 2.0 ** rng.integers(-3, 2, (batch, seq, 64))
    k_scale = 2.0 ** rng.integers(-3, 2, (batch, entries))
    positions = (np.asarray(offsets)[:, None] + np.arange(seq)).astype(np.int32)
    return dict(q=jnp.asarray(q, FP8), keys=jnp.asarray(keys, FP8), weights=jnp.asarray(weights),
                positions=jnp.asarray(positions), q_scale=jnp.asarray(q_scale, jnp.float32),
                k_scale=jnp.asarray(k_scale, jnp.float32))  # fmt: skip


def _interpreter_case() -> None:
    """Run in a subprocess (see the module docstring): exact scores and exact top-k in the interpreter."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    inputs = integer_inputs(0)
    kw = dict(rate=4, softmax_scale=0.25)
    config = MgpuScoreConfig(tokens=4, span=128, num_slots=2)
    with _abstract_gpu_mesh("NVIDIA H100 80GB HBM3", 8):
        got = np.asarray(index_scores_mgpu(**inputs, **kw, config=config, interpret=InterpretGPUParams()))
        picks = np.asarray(index_topk_two_pass(**inputs, **kw, k=20, interpret=True, scores_impl="mgpu",
                                               mgpu_config=config))  # fmt: skip
    want = np.asarray(index_scores_reference(**inputs, **kw))
    assert np.isneginf(want).any() and np.isfinite(want).any()  # the case has both
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(picks, np.asarray(index_topk_reference(**inputs, **kw, k=20)))
    print("interpreter case: OK")


def _abstract_gpu_mesh(kind="NVIDIA H200", cores=132):
    from jax._src.mesh import AbstractDevice, AbstractMesh

    return jax.sharding.use_abstract_mesh(
        AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=kind, platform="gpu", num_cores=cores))
    )


def test_interpreter_matches_reference_exactly():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()}  # fmt: skip
    run = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0 and "interpreter case: OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_lowers_for_h200():
    b, s, c = 1, 512, 32768
    sds = jax.ShapeDtypeStruct
    args = (sds((b, s, 64, 128), FP8), sds((b, c, 128), FP8), sds((b, s, 64), jnp.float32), sds((b, s), jnp.int32),
            sds((b, s, 64), jnp.float32), sds((b, c), jnp.float32))  # fmt: skip

    def f(q, keys, weights, positions, q_scale, k_scale):
        return index_scores_mgpu(q, keys, weights, positions, rate=4, softmax_scale=0.1, q_scale=q_scale,
                                 k_scale=k_scale)  # fmt: skip

    with _abstract_gpu_mesh():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((1, 8, 32, 128), FP8), weights=jnp.zeros((1, 8, 32), jnp.float32),
          q_scale=jnp.ones((1, 8, 32), jnp.float32)), "Hi = 64"),
    (dict(q=jnp.zeros((1, 8, 64, 128), jnp.bfloat16), q_scale=None), "float8_e4m3fn q and keys"),
])  # fmt: skip
def test_input_errors(change, match):
    inputs = dict(q=jnp.zeros((1, 8, 64, 128), FP8), keys=jnp.zeros((1, 70, 128), FP8),
                  weights=jnp.zeros((1, 8, 64), jnp.float32), positions=jnp.arange(8, dtype=jnp.int32)[None],
                  q_scale=jnp.ones((1, 8, 64), jnp.float32), k_scale=jnp.ones((1, 70), jnp.float32))  # fmt: skip
    inputs.update(change)
    with pytest.raises(ValueError, match=match):
        index_scores_mgpu(**inputs, rate=4, softmax_scale=0.1)


def test_config_errors():
    with pytest.raises(ValueError, match="tokens=3"):
        MgpuScoreConfig(tokens=3)
    with pytest.raises(ValueError, match="span=100"):
        MgpuScoreConfig(span=100)


@gpu
@requires_gpu
@pytest.mark.parametrize("seq, entries, offset", [(300, 4100, 16000), (77, 1000, 0)])
def test_gpu_matches_reference(seq, entries, offset):
    keys_ = jax.random.split(jax.random.key(seq), 4)
    q = jax.random.normal(keys_[0], (1, seq, 64, 128), jnp.float32)
    kv = jax.random.normal(keys_[1], (1, entries, 128), jnp.float32)
    q_scale = jnp.max(jnp.abs(q), axis=-1) / 448.0
    k_scale = jnp.max(jnp.abs(kv), axis=-1) / 448.0
    inputs = dict(q=(q / q_scale[..., None]).astype(FP8), keys=(kv / k_scale[..., None]).astype(FP8),
                  weights=jax.random.normal(keys_[2], (1, seq, 64), jnp.float32),
                  positions=(offset + jnp.arange(seq, dtype=jnp.int32) * 13)[None], q_scale=q_scale,
                  k_scale=k_scale)  # fmt: skip
    kw = dict(rate=4, softmax_scale=128**-0.5)
    jax.block_until_ready(index_scores_mgpu(**dict(inputs, weights=jnp.full_like(inputs["weights"], jnp.nan)), **kw))
    got = np.asarray(index_scores_mgpu(**inputs, **kw))
    want = np.asarray(index_scores_reference(**inputs, **kw))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert finite.any() and not np.isnan(got).any()
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-4 * np.abs(want[finite]).max())


if __name__ == "__main__":
    _interpreter_case()
