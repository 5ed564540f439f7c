"""Whole-model zigzag order (dsv4/attention/sequence_parallel.py, "Whole-model zigzag").

In process: the block arithmetic worked out by hand, and `pool_windows_zigzag` on a permuted sequence against
`pool_windows` on the sequence in order (fresh random inputs, CSA overlap on and off). In a subprocess with 8 CPU
host devices: the tiny_long fixture model (sliding, CSA and HCA layers) under `SEQUENCE_PARALLEL_ZIGZAG` against its
reference logits, with the jnp SP core on 4 shards and the Pallas one (interpreted; Pallas indexer and MoE too) on 2,
at lengths that need padding; and a clear error for an attention core that cannot run in zigzag order.
"""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from host_devices import host_devices_env

from dsv4.attention import pool_windows, pool_windows_zigzag
from dsv4.sharding import ShardingRules
from dsv4.sharding.sequence import zigzag_order, zigzag_permute, zigzag_row, zigzag_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_block_arithmetic_by_hand():
    assert zigzag_order(2) == [0, 3, 1, 2]
    assert zigzag_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]
    # 83 tokens over 2 shards: ceil(83 / 4) = 21 rows, rounded up to a multiple of 16 → 32 (padded length 128)
    assert zigzag_rows(83, 2, multiple=16, min_rows=15) == 32
    assert zigzag_rows(1000, 4, multiple=4, min_rows=127) == 128  # the window sets the block: 125 → 127 → 128
    assert zigzag_rows(1, 8) == 1
    # S = 16 over 2 shards: blocks of 4 rows in slot order [0, 3, 1, 2]
    assert [zigzag_row(p, 16, 2) for p in (0, 3, 4, 8, 12, 15)] == [0, 3, 8, 12, 4, 7]
    x = jnp.arange(16)[None]
    assert zigzag_permute(x, 2)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_permute(zigzag_permute(x, 2), 2, inverse=True).tolist() == x.tolist()
    with pytest.raises(ValueError, match="seq_order='diagonal'"):
        ShardingRules((("seq", "sp"),), seq_order="diagonal")


@pytest.mark.parametrize("n,rate,overlap", [(1, 4, True), (2, 4, True), (3, 2, True), (2, 8, False)])
def test_pool_windows_zigzag_equals_pooling_in_order(n, rate, overlap):
    rng = np.random.default_rng(1000 * n + rate)
    b, hd, rows = 2, 8, 3 * rate
    s, width = 2 * n * rows, 2 * hd if overlap else hd
    kv = jnp.asarray(rng.normal(size=(b, s, width)), jnp.float32)
    gate = jnp.asarray(rng.normal(size=(b, s, width)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(rate, width)), jnp.float32)
    want = pool_windows(kv, gate, bias, rate, overlap=overlap, head_dim=hd)
    got = pool_windows_zigzag(zigzag_permute(kv, n), zigzag_permute(gate, n), bias, rate, n, overlap=overlap,
                              head_dim=hd)  # fmt: skip
    assert got.shape == want.shape == (b, s // rate, hd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of the rate"):
        pool_windows_zigzag(kv[:, : s - 2 * n], gate[:, : s - 2 * n], bias, rate, n, overlap=overlap, head_dim=hd)


SCRIPT = """
    import numpy as np, jax, jax.numpy as jnp
    import dsv4
    import dsv4.attention.compressor as compressor
    from dsv4.sharding import SEQUENCE_PARALLEL_ZIGZAG, make_mesh, shard_model, use_mesh

    calls = []
    real_pool = compressor.pool_windows_zigzag
    def counting_pool(*args, **kwargs):  # traced once per compressor: shows the zigzag path ran
        calls.append(args[4])
        return real_pool(*args, **kwargs)
    compressor.pool_windows_zigzag = counting_pool

    ref = np.load("tests/fixtures/tiny_long/reference.npz")
    for impl, n, cut, kernels in [("sp", 4, 78, "attention=sp"),
                                  ("sp-pallas", 2, 83, "attention=sp-pallas,indexer=pallas,moe=pallas")]:
        model = dsv4.load("tests/fixtures/tiny_long", dtype=jnp.float32, kernels=kernels)
        mesh = make_mesh(n)
        shard_model(model, mesh)
        calls.clear()
        with use_mesh(mesh, SEQUENCE_PARALLEL_ZIGZAG):
            logits = np.asarray(model.logits(ref["input_ids"][..., :cut]))
        want = ref["logits"][..., :cut, :]
        err = np.abs(logits - want).max() / np.abs(want).max()
        print(f"model:{impl}:sp={n}:S={cut}", err, len(calls), set(calls) == {n})

    model = dsv4.load("tests/fixtures/tiny_long", dtype=jnp.float32, kernels="jnp")
    try:
        with use_mesh(make_mesh(2), SEQUENCE_PARALLEL_ZIGZAG):
            model.logits(ref["input_ids"])
        print("jnp_core_error none")
    except ValueError as e:
        print("jnp_core_error", "'jnp'" in str(e) and "zigzag" in str(e))
"""


def test_model_in_zigzag_order_matches_reference():
    env = host_devices_env(8)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    models = [r for r in rows if r[0].startswith("model:")]
    assert [r[0] for r in models] == ["model:sp:sp=4:S=78", "model:sp-pallas:sp=2:S=83"], out.stdout
    from dsv4.config import Config

    cfg = Config.from_hf(os.path.join(ROOT, "tests/fixtures/tiny_long/config.json"))
    # one compressor per CSA / HCA layer, plus the indexer's keys per CSA layer
    compressors = sum(t != "sliding_attention" for t in cfg.layer_types)
    compressors += cfg.layer_types.count("compressed_sparse_attention")
    for name, err, n_calls, right_n in models:
        assert float(err) < 1e-5, (name, err)
        assert int(n_calls) == compressors and right_n == "True", (name, n_calls, right_n)
    assert ["jnp_core_error", "True"] in rows, out.stdout


def test_zigzag_needs_more_than_one_shard():
    """A zigzag layout over a 1-device sequence axis (or no mesh) leaves the sequence in order."""
    from dsv4.sharding import SEQUENCE_PARALLEL_ZIGZAG, make_mesh, use_mesh
    from dsv4.sharding.sequence import zigzag_shards

    assert zigzag_shards() is None
    with use_mesh(make_mesh(1), SEQUENCE_PARALLEL_ZIGZAG):
        assert zigzag_shards() is None
