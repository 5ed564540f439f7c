"""The engine on a mesh: `dsv4.LLM(..., mesh=)` over 1, 2, 4 and 8 CPU host devices gives the greedy tokens of the
1-device engine and of the transformers reference, for the paged cache in float32, bf16 and FP8, with concurrent
requests of lengths that divide neither the chunk nor the device count, preemption under a tiny page pool, and
cancellation; afterwards every page and slot is back. Meshes the model cannot be laid out on are refused, naming
the cause.

The test process has one CPU device, so the mesh runs happen in one subprocess with 8 host devices (one process
shares the compilations of equal programs across cases)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from host_devices import host_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one xdist worker for the whole module: the subprocess fixture takes 1.5-2.5 minutes (scripts/dev --dist loadgroup)
pytestmark = pytest.mark.xdist_group("engine_mesh")

SCRIPT = """
    import json, os, numpy as np, dsv4
    from dsv4.sharding import make_mesh

    FIXTURES = "tests/fixtures"
    MODEL_DIR = os.path.join(FIXTURES, "tiny_mixed")
    # three compiled calls per engine: the slot reset, decode steps [4, 1], chunks [1, 32]
    SHAPES = dict(dtype="float32", max_slots=4, max_model_len=128, chunk_size=32, width_buckets=(1, 32),
                  max_packed_width=1, page_size=16)

    def emit(**row):
        print(json.dumps(row), flush=True)

    def idle(llm):
        return (not llm.has_unfinished_requests() and llm.pool.num_free == llm.pool.num_usable_blocks
                and llm.runner.num_free_slots == llm.runner.max_slots and not list(llm.kv_cache.request_ids()))

    cases = []
    for name in ("tiny_mixed", "tiny_short"):
        ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
        s = ref["input_ids"].shape[1]
        cases += [(row.tolist(), gen[s:].tolist()) for row, gen in zip(ref["input_ids"], ref["generated"])]
    rng = np.random.default_rng(3)
    extra = [rng.integers(2, 256, n).tolist() for n in (45, 70, 13)]  # 45, 70, 13: no multiple of 32 or 8
    prompts = [p for p, _ in cases] + extra

    for fmt, meshes in ((None, (1,)), ("bf16", (2, 8)), ("fp8-channel", (4,))):
        base = dsv4.LLM(MODEL_DIR, **SHAPES, kv_format=fmt)
        alone = [base.generate([p], max_new_tokens=6)[0].token_ids for p in prompts]
        emit(case="base", fmt=fmt, reference=[w for _, w in cases], alone=alone, idle=idle(base))
        for n in meshes:
            llm = dsv4.LLM(MODEL_DIR, **SHAPES, kv_format=fmt, mesh=make_mesh(n))
            together = [o.token_ids for o in llm.generate(prompts, max_new_tokens=6)]
            devices = sorted({d.id for leaf in [llm.runner.cache.num_tokens] for d in leaf.devices()})
            emit(case="mesh", fmt=fmt, n=n, together=together, devices=devices, idle=idle(llm))

    # preemption (5 pages of 16 tokens) and cancellation on a 2-device mesh
    small = dsv4.LLM(MODEL_DIR, **SHAPES, num_kv_pages=5, mesh=make_mesh(2))
    outputs = small.generate(prompts[:4], max_new_tokens=6)
    emit(case="preempt", tokens=[o.token_ids for o in outputs],
         preemptions=sum(o.metrics.num_preemptions for o in outputs), idle=idle(small))
    running = small.add_request(prompts[4], max_new_tokens=4)
    other = small.add_request(prompts[0], max_new_tokens=3)
    small.step()
    cancelled = small.cancel(running)
    while small.has_unfinished_requests():
        small.step()
    emit(case="cancel", cancelled=cancelled, reason=small.pop_output(running).finish_reason,
         other=small.pop_output(other).token_ids, idle=idle(small))

    try:
        dsv4.LLM(MODEL_DIR, **SHAPES, mesh=make_mesh(3))
        emit(case="refuse", error=None)
    except ValueError as e:
        emit(case="refuse", error=str(e))
"""


@pytest.fixture(scope="module")
def rows():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], env=host_devices_env(8), cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_every_mesh_gives_the_one_device_tokens_and_the_reference(rows):
    bases = {row["fmt"]: row for row in rows if row["case"] == "base"}
    n_ref = len(bases[None]["reference"])
    assert bases[None]["alone"][:n_ref] == bases[None]["reference"]  # the 1-device engine is the reference
    meshes = [row for row in rows if row["case"] == "mesh"]
    assert sorted(row["n"] for row in meshes) == [1, 2, 4, 8]
    for row in meshes:
        base = bases[row["fmt"]]
        assert row["together"] == base["alone"], (row["fmt"], row["n"])
        assert row["devices"] == list(range(row["n"])), "the cache lives on every device of the mesh"
        assert row["idle"] and base["idle"], "every page and slot back"
    assert all(len(base["alone"]) == 7 and base["idle"] for base in bases.values())


def test_preemption_and_cancellation_on_a_mesh(rows):
    (base,) = [row for row in rows if row["case"] == "base" and row["fmt"] is None]
    (preempt,) = [row for row in rows if row["case"] == "preempt"]
    assert preempt["tokens"] == base["alone"][:4] and preempt["preemptions"] > 0 and preempt["idle"]
    (cancel,) = [row for row in rows if row["case"] == "cancel"]
    assert cancel["cancelled"] and cancel["reason"] == "cancelled" and cancel["idle"]
    assert cancel["other"] == base["alone"][0][:3]


def test_a_mesh_that_cannot_split_the_experts_is_refused(rows):
    (refuse,) = [row for row in rows if row["case"] == "refuse"]
    assert refuse["error"] is not None
    assert "3 devices" in refuse["error"] and "8 routed experts" in refuse["error"]
    assert "[1, 2, 4, 8]" in refuse["error"]
