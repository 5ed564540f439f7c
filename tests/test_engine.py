"""The engine end to end on a tiny fixture model: scheduler + KV pages + runner + sampling.

One engine (module fixture) serves most tests, with its shapes chosen so it compiles four functions: the
slot reset, a [4, 1] and a [4, 8] packed call, and a [1, 32] single-slot call (chunks of up to 32 tokens;
anything wider than 8 runs alone). Its cache is paged, 16 tokens a page (the tiny rates are 4 and 16), and
the pool's size is part of those shapes: the preemption test's engine (a 5-page pool) compiles its own four,
and so does the FP8 engine, which keeps the dense cache (`paged=False`) so that mode stays covered. Three
compilation sets in all. Greedy tokens are compared exactly: the fixtures' reference tokens have logit gaps
above 1e-3 (tests/fixtures/README.md), and "alone" runs go through the same shapes.

Every test leaves the shared engine idle: no request, every page and slot back (checked after each test).

Decode bursts (`decode_steps=4`) run on a second module engine over the same model and shapes: it shares the four
compiled calls and adds two (the burst loop and the single steps' device sampler).
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_devices import ROOT, host_devices_env
from opt_in import slow_opt_in

import dsv4
from dsv4.engine import LLM
from dsv4.generate import (
    DevicePick,
    SamplingParams,
    check_logits,
    device_sampling_arrays,
    logprobs,
    logprobs_on_device,
    pick_rows,
    sample,
    sample_on_device,
    sampling_mode,
)
from dsv4.memory_plan import default_chunk_size, default_max_model_len
from dsv4.runner import BurstTokens

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MODEL_DIR = os.path.join(FIXTURES, "tiny_mixed")  # tiny_short has the same weights (same safetensors blob)
SHAPES = dict(dtype="float32", max_slots=4, max_model_len=128, chunk_size=32, width_buckets=(1, 8, 32),
              max_packed_width=8, page_size=16)  # fmt: skip


def reference_cases() -> list[tuple[list[int], list[int]]]:
    """(prompt, the reference's greedy continuation) for each row of tiny_mixed (37 tokens) and tiny_short (3)."""
    cases = []
    for name in ("tiny_mixed", "tiny_short"):
        ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
        s = ref["input_ids"].shape[1]
        cases += [(row.tolist(), gen[s:].tolist()) for row, gen in zip(ref["input_ids"], ref["generated"])]
    return cases


def random_prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 256, length).tolist()


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL_DIR, **SHAPES)


def assert_idle(engine: LLM) -> None:
    """Nothing running, every page back in the pool, every slot free."""
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_usable_blocks
    assert engine.runner.num_free_slots == engine.runner.max_slots
    assert list(engine.kv_cache.request_ids()) == []


@pytest.fixture(scope="module")
def bursts(llm):
    """The module engine's model and shapes with decode bursts of up to 4 steps."""
    return LLM(llm.model, **SHAPES, decode_steps=4)


@pytest.fixture(autouse=True)
def _shared_engine_left_idle(request):
    yield
    for name in ("llm", "bursts"):
        if name in request.fixturenames:
            assert_idle(request.getfixturevalue(name))


def test_paged_cache_layout(llm):
    """The fixture's cache is paged: a pool of 4 slots × ceil(128 / 16) = 32 pages plus the null page, one
    block table row of 8 pages per slot. The default page is 256 tokens (a multiple of both rates), and a
    page size that is not a multiple of every rate is refused before anything is built."""
    assert llm.page_size == 16 and llm.pool.num_blocks == 33 and llm.pool.block_size == 16
    assert llm.runner.page_tokens == 16 and llm.runner.num_pages == 33
    assert llm.runner.cache.block_table.shape == (4, 8)
    default = LLM(llm.model, max_slots=1, max_model_len=64, warmup=False)
    assert default.page_size == 256 and default.pool.num_usable_blocks == 1
    assert default.runner.cache.block_table.shape == (1, 1)
    with pytest.raises(ValueError, match="page_size=24"):
        LLM(llm.model, max_slots=1, max_model_len=64, page_size=24)


def test_default_chunk_is_32k_tokens_a_device_where_it_fits_else_16k_at_most_max_model_len(llm, monkeypatch):
    """By hand: 32768 tokens a device where `fits` accepts it, else (or with no `fits`) 16384; never past
    max_model_len. The engine asks the device (the two sizes scaled to 1024 and 512 for the tiny model's 4096
    positions): the CPU reports no memory limit (the short chunk); a stand-in reporting a large limit gets the long
    one, one with room for the plan's runtime lines at the short chunk but not at the long one the short chunk."""
    assert LLM(llm.model, max_slots=1, max_model_len=64, warmup=False).chunk_size == 64
    assert default_chunk_size(100_000) == 16384 and default_chunk_size(100_000, devices=8) == 100_000
    assert default_chunk_size(1 << 20, devices=8) == 131072 and default_chunk_size(1 << 20, devices=3) == 49152
    asked = []
    assert default_chunk_size(100_000, fits=lambda c: asked.append(c) or True) == 32768 and asked == [32768]
    assert default_chunk_size(100_000, fits=lambda c: False) == 16384
    assert default_chunk_size(20_000, fits=lambda c: True) == 20_000 and default_chunk_size(16384, fits=None) == 16384
    assert default_chunk_size(1 << 20, devices=8, fits=lambda c: c <= 200_000) == 131072

    import dsv4.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "LONG_CHUNK_TOKENS_PER_DEVICE", 1024)
    monkeypatch.setattr(memory_plan, "CHUNK_TOKENS_PER_DEVICE", 512)
    real = jax.local_devices()[0]
    model_len = 4000
    plan, small = (memory_plan.plan_memory(llm.model.config, context=model_len, devices=1, kv_format="bf16",
                                           weights="fp8", chunk_size=chunk) for chunk in (1024, 512))  # fmt: skip
    runtime = {n: sum(line.bytes_per_device for line in p.lines if not line.name.startswith("weights:")
                      or "transient" in line.name) for n, p in (("long", plan), ("short", small))}  # fmt: skip
    assert runtime["long"] > runtime["short"]
    between = int(1.2 * (runtime["long"] + runtime["short"]) / 2)  # room for the short chunk's runtime only

    class Reporting:  # the real device, reporting `limit` bytes, none in use
        def __init__(self, limit):
            self.limit = limit

        def __getattr__(self, name):
            return getattr(real, name)

        def memory_stats(self):
            return {"bytes_limit": self.limit, "bytes_in_use": 0}

        def __eq__(self, other):
            return other is self or other == real

        __hash__ = object.__hash__

    assert LLM(llm.model, max_slots=1, max_model_len=model_len, kv_format="bf16", warmup=False).chunk_size == 512
    for limit, want in ((1 << 40, 1024), (between, 512)):
        with monkeypatch.context() as m:
            m.setattr(jax, "local_devices", lambda limit=limit: [Reporting(limit)])
            got = LLM(llm.model, max_slots=1, max_model_len=model_len, kv_format="bf16", warmup=False).chunk_size
        assert got == want, (limit, got)


def test_default_max_model_len_is_32k_at_most_the_model_positions(llm):
    """By hand: 32768, or the model's max_position_embeddings if fewer; the engine takes it when given none."""
    config = llm.model.config
    assert default_max_model_len(dataclasses.replace(config, max_position_embeddings=1 << 20)) == 32768
    assert default_max_model_len(dataclasses.replace(config, max_position_embeddings=100)) == 100
    assert LLM(llm.model, max_slots=1, warmup=False).max_model_len == min(config.max_position_embeddings, 32768)


def test_concurrent_requests_reproduce_the_reference(llm):
    cases = reference_cases()
    outputs = llm.generate([prompt for prompt, _ in cases], max_new_tokens=6)
    assert [o.token_ids for o in outputs] == [want for _, want in cases]
    for output, (prompt, _) in zip(outputs, cases):
        m = output.metrics
        assert output.finish_reason == "length" and output.error is None
        assert output.prompt_token_ids == prompt and m.num_prompt_tokens == len(prompt)
        assert 0 < m.ttft_s <= m.e2e_s and len(m.token_times) == 6 and len(m.itl_s) == 5
        assert m.tpot_s == pytest.approx(sum(m.itl_s) / 5)
    assert_idle(llm)


def test_concurrent_mixed_lengths_equal_each_alone(llm):
    """Six requests (more than the 4 slots: some wait, slots are reused) of lengths that exercise packed and
    single-slot calls and split chunks, streamed: each gives the tokens it gives alone."""
    lengths = [70, 5, 33, 1, 20, 96]
    prompts = [random_prompt(n, seed) for seed, n in enumerate(lengths)]
    alone = [llm.generate([p], max_new_tokens=8)[0].token_ids for p in prompts]
    streamed: dict[str, list[int]] = {}
    finals = {}
    for request_id, token, finish_reason, output, *_ in llm.stream(prompts, max_new_tokens=8):
        assert request_id not in finals, "no event after a request's last one"
        streamed.setdefault(request_id, []).append(token)
        if finish_reason is not None:
            finals[request_id] = output
            assert output.token_ids == streamed[request_id]
    assert len(finals) == len(prompts)
    assert sorted(streamed.values()) == sorted(alone)
    together = llm.generate(prompts, max_new_tokens=8)
    assert [o.token_ids for o in together] == alone
    assert_idle(llm)


def test_mixed_chunk_size_splits_prefills_only_while_others_decode(llm, monkeypatch):
    """With a mixed-step prefill share of 8 tokens, the 96-token prompt arriving behind two short ones advances 8
    tokens a step while they decode, and whole chunks once they are done; every request gives its tokens alone."""
    prompts = [random_prompt(n, 40 + seed) for seed, n in enumerate([5, 3, 96])]
    alone = [llm.generate([p], max_new_tokens=6)[0].token_ids for p in prompts]
    monkeypatch.setattr(llm.scheduler, "config", dataclasses.replace(llm.scheduler.config, mixed_prefill_chunk=8))
    steps = []
    schedule = llm.scheduler.schedule

    def recorded():
        plan = schedule()
        steps.append([(c.request_id, c.start, c.num_tokens) for c in plan.chunks])
        return plan

    monkeypatch.setattr(llm.scheduler, "schedule", recorded)
    outputs = llm.generate(prompts, max_new_tokens=6)
    assert [o.token_ids for o in outputs] == alone
    prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outputs}
    long_id = outputs[2].request_id
    pieces = []  # (long prompt's piece, did the step carry a decode)
    for step in steps:
        decoding = any(start >= prompt_len[rid] for rid, start, _ in step)
        pieces += [(n, decoding) for rid, start, n in step if rid == long_id and start < prompt_len[rid]]
    assert sum(n for n, _ in pieces) == 96
    assert all(n <= 8 for n, decoding in pieces if decoding) and any(decoding for _, decoding in pieces)
    assert any(n > 8 for n, decoding in pieces if not decoding)  # alone again: whole chunks
    assert_idle(llm)


def test_prefill_steps_without_logits_run_one_step_ahead(llm, monkeypatch):
    """A step that returns no logits (a prompt's chunks before its last) is left running on the device: the next
    step dispatches its own call first, then waits for it; a step with logits waits for itself. The tokens are the
    reference's (greedy, exact)."""
    (prompt, want), *_ = reference_cases()  # 37 tokens: a 32-token chunk without logits, then 5 with them
    runner, events = llm.runner, []
    for name in ("slot_step", "packed_step"):
        def call(*args, _fn=getattr(runner._programs, name)):
            logits, cache = _fn(*args)
            events.append(("dispatch", id(logits)))
            return logits, cache

        monkeypatch.setattr(runner._programs, name, call)
    block = jax.block_until_ready

    def wait(x):
        events.append(("wait", {id(leaf) for leaf in jax.tree.leaves(x)}))
        return block(x)

    monkeypatch.setattr(jax, "block_until_ready", wait)
    rid = llm.add_request(prompt, max_new_tokens=3)
    steps = [llm.step()]
    after_first = list(events)
    steps.append(llm.step())
    after_second = list(events)
    while llm.has_unfinished_requests():
        llm.step()
    assert steps[0] == [] and after_first[-1][0] == "dispatch"  # the first chunk's call returned unwaited
    first = after_first[-1][1]
    dispatches = [i for i, (kind, _) in enumerate(after_second) if kind == "dispatch"]
    waits_first = [i for i, (kind, ids) in enumerate(after_second) if kind == "wait" and first in ids]
    assert len(dispatches) == 2 and waits_first and dispatches[1] < waits_first[0]
    assert [e.request_id for e in steps[1]] == [rid] and llm.pop_output(rid).token_ids == want[:3]
    assert_idle(llm)


def test_cancel_frees_pages_and_slot(llm):
    running = llm.add_request(random_prompt(90, 1), max_new_tokens=4)
    other = llm.add_request(random_prompt(10, 2), max_new_tokens=3)
    queued = [llm.add_request(random_prompt(40, 3 + i), max_new_tokens=2) for i in range(4)]  # 6 > 4 slots
    llm.step()
    assert llm.progress(running) == (32, 90)  # mid-prefill
    assert llm.runner.slot_of(running) is not None and llm.pool.num_free < llm.pool.num_usable_blocks
    assert llm.cancel(running) and llm.cancel(queued[-1])
    assert llm.runner.slot_of(running) is None
    assert not llm.cancel(running) and not llm.cancel("no-such-request")
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.pop_output(running).finish_reason == "cancelled"
    assert llm.pop_output(queued[-1]).finish_reason == "cancelled"
    assert llm.pop_output(other).finish_reason == "length"
    for request_id in queued[:-1]:
        assert llm.pop_output(request_id).num_tokens == 2
    assert_idle(llm)


def test_closing_a_stream_early_cancels_its_requests(llm):
    stream = llm.stream([random_prompt(12, 7), random_prompt(50, 8)], max_new_tokens=5)
    next(stream)
    stream.close()
    assert_idle(llm)


def test_refused_prompts_get_an_error_and_the_others_finish(llm):
    (prompt, want), *_ = reference_cases()
    outputs = llm.generate([random_prompt(125, 9), prompt, [3, 300, 4], []], max_new_tokens=6)
    too_long, ok, bad_id, empty = outputs
    assert too_long.finish_reason == "error" and "exceeds max_model_len=128" in too_long.error
    assert ok.token_ids == want and ok.error is None
    assert bad_id.finish_reason == "error" and "token id 300 at position (1,)" in bad_id.error
    assert "empty" in empty.error
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.add_request(random_prompt(100, 1), max_new_tokens=30)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.add_request("some text")
    assert_idle(llm)


def test_preemption_with_a_tiny_page_pool_gives_identical_tokens(llm):
    """Pages of 16 tokens, 5 of them (80 tokens); a request of N tokens holds ceil(N / 16) pages, and at
    its longest holds prompt + 6 - 1 tokens (the last sampled token is never fed back). A 37-token prompt
    then holds ceil(42 / 16) = 3 pages, a 3-token one ceil(8 / 16) = 1, the 60-token one ceil(65 / 16) = 5
    (the whole pool): 13 pages wanted, so the two 37-token requests (6) cannot grow side by side, nor the
    60-token one beside anything. The newest is preempted and recomputes from scratch in a reset slot, on
    whatever pages are free then. The same model object, but a pool of another size: its own compilations."""
    small = LLM(llm.model, **SHAPES, num_kv_pages=5)
    cases = reference_cases()
    extra = random_prompt(60, 11)
    prompts = [prompt for prompt, _ in cases] + [extra]
    extra_alone = llm.generate([extra], max_new_tokens=6)[0].token_ids
    outputs = small.generate(prompts, max_new_tokens=6)
    assert [o.token_ids for o in outputs] == [want for _, want in cases] + [extra_alone]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_idle(small)
    # 100 + 20 - 1 = 119 tokens: ceil(119 / 16) = 8 pages > 5
    with pytest.raises(ValueError, match="needs KV for 119 tokens = 8 pages, but the whole KV pool holds 5 pages "
                                         "= 80 tokens"):  # fmt: skip
        small.add_request(random_prompt(100, 3), max_new_tokens=20)


def test_requests_on_interleaved_shuffled_pages_equal_each_alone(llm):
    """Two requests whose pages interleave in the pool, in no order, give the tokens each gives alone. Every
    free page is first allocated and freed again in a shuffled order, so page ids come out of the queue
    neither contiguous nor sorted (and they hold stale entries of earlier requests). The two 60-token
    requests then grow side by side (prefill chunks in alternate steps, decodes crossing the page boundaries
    at 64 and 80 tokens in the same steps), so their pages alternate in the queue. After each step, every
    running request's row of the device block table is its host table, zero-padded."""
    prompts = [random_prompt(60, 21), random_prompt(60, 22)]
    alone = [llm.generate([p], max_new_tokens=24)[0].token_ids for p in prompts]
    taken = llm.pool.allocate(llm.pool.num_free)
    np.random.default_rng(0).shuffle(taken)
    llm.pool.free(taken)
    queue = {page: i for i, page in enumerate(llm.pool.free_block_ids())}
    request_ids = [llm.add_request(p, max_new_tokens=24) for p in prompts]
    tables: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        llm.step()
        device = np.asarray(llm.runner.cache.block_table)
        for request_id in request_ids:
            table, slot = llm.kv_cache.block_table(request_id), llm.runner.slot_of(request_id)
            if slot is not None:
                tables[request_id] = table
                assert device[slot, : len(table)].tolist() == table and not device[slot, len(table) :].any()
    first, second = (tables[request_id] for request_id in request_ids)
    assert len(first) == len(second) == 6  # ceil((60 + 24 - 1) / 16)
    assert not set(first) & set(second) and first != sorted(first) and second != sorted(second)
    owner = [page in first for page in sorted(first + second, key=queue.__getitem__)]
    assert sum(a != b for a, b in zip(owner, owner[1:])) >= 3, "allocations alternate between the two"
    assert [llm.pop_output(request_id).token_ids for request_id in request_ids] == alone


def test_sampling_is_per_request_and_reproducible(llm):
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    prompt = random_prompt(6, 4)
    first, second = llm.generate([prompt, prompt], max_new_tokens=5, sampling=sampling)
    assert first.token_ids == second.token_ids  # same seed, same prompt: same draws, batched or not
    assert llm.generate([prompt], max_new_tokens=5, sampling=sampling)[0].token_ids == first.token_ids
    assert_idle(llm)


def test_stop_token_ends_a_request(llm):
    (prompt, want), *_ = reference_cases()
    (output,) = llm.generate([prompt], max_new_tokens=6, stop_token_ids=[want[2]])
    assert output.token_ids == want[:3] and output.finish_reason == "stop"


def test_text_prompts_through_a_tokenizer_json(llm, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = dsv4.tokenizer.load_tokenizer(tmp_path)
    assert dsv4.tokenizer.load_tokenizer(FIXTURES) is None
    (prompt, want), *_ = reference_cases()
    text = " ".join(f"w{t}" for t in prompt)
    saved, llm.tokenizer = llm.tokenizer, tokenizer
    try:
        (output,) = llm.generate([text], max_new_tokens=6)
    finally:
        llm.tokenizer = saved
    assert output.prompt_token_ids == prompt and output.token_ids == want
    assert output.text == " ".join(f"w{t}" for t in want)

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<{{ messages[0].content }}>"}))
    templated = dsv4.tokenizer.load_tokenizer(tmp_path)
    assert templated.encode("w5", chat_template=False) == [5]
    try:
        import jinja2  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="jinja2"):
            templated.encode("w5")
    else:
        assert templated.encode("w5 w6") == tokenizer.tokenizer.encode("<w5 w6>", add_special_tokens=False).ids


def test_runner_rejects_a_chunk_wider_than_every_bucket(llm):
    with pytest.raises(ValueError, match="largest width bucket 32"):
        llm.runner.bucket(33)
    assert llm.runner.bucket(1) == 1 and llm.runner.bucket(2) == 8 and llm.runner.bucket(9) == 32
    assert llm.runner.is_packed(8) and not llm.runner.is_packed(9)


def test_fp8_cache_engine_requests_equal_each_alone(llm):
    """The engine with its cache stored in FP8 (per-channel scales shared by every slot: the packed and the
    single-slot calls must both keep them, and a slot reset must not touch them): concurrent requests give the
    tokens each gives alone, and every page and slot comes back."""
    fp8 = LLM(llm.model, **{k: v for k, v in SHAPES.items() if k != "dtype"}, kv_format="fp8-channel",
              paged=False)  # fmt: skip
    assert fp8.runner.kv_format == "fp8-channel"
    assert fp8.runner.page_tokens is None and fp8.runner.cache.block_table is None  # the dense mode
    prompts = [random_prompt(n, 40 + n) for n in (45, 3, 12)]
    alone = [fp8.generate([p], max_new_tokens=5)[0].token_ids for p in prompts]
    assert [o.token_ids for o in fp8.generate(prompts, max_new_tokens=5)] == alone
    assert_idle(fp8)


# ----- decode bursts ---------------------------------------------------------------------------------------


def record_plans(engine: LLM, monkeypatch) -> list[list[tuple[str, int, int, int]]]:
    """Every plan the engine's scheduler makes from now on: (request id, start, tokens, steps) per chunk."""
    plans, schedule = [], engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append([(c.request_id, c.start, c.num_tokens, c.num_steps) for c in plan.chunks])
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    return plans


def run_events(engine: LLM) -> dict[str, list]:
    """Steps the engine until idle; → request id → its events, in order."""
    events: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return events


def test_decode_bursts_give_the_single_step_greedy_tokens(llm, bursts, monkeypatch):
    """Four requests of different lengths (one prefilled in two chunks) on the 4-step engine give exactly the
    single-step engine's tokens and finish reasons: one stops on a stop token in the middle of a burst (the burst's
    later tokens dropped), one reaches max_new_tokens with its burst capped below 4 steps while the others run 4.
    Events: one per token, in order, the last one finishing the request; a burst's tokens share one time."""
    prompts = [random_prompt(n, 50 + n) for n in (5, 20, 3, 37)]
    max_new = [11, 5, 9, 7]
    single = [llm.generate([p], max_new_tokens=n)[0].token_ids for p, n in zip(prompts, max_new)]
    # The 3-token prompt stops on its 4th token: tokens 1-2 come from single steps while the 37-token prompt
    # prefills (two steps), tokens 3-6 from the first burst, so it stops at that burst's second step.
    stop = single[2][3]
    assert stop not in single[2][:3]
    want = [single[0], single[1], single[2][:4], single[3]]
    plans = record_plans(bursts, monkeypatch)
    for engine in (llm, bursts):
        ids = [engine.add_request(p, max_new_tokens=n, stop_token_ids=[stop] if i == 2 else [],
                                  request_id=f"r{i}") for i, (p, n) in enumerate(zip(prompts, max_new))]  # fmt: skip
        events = run_events(engine)
        outputs = [events[i][-1].output for i in ids]
        assert [o.token_ids for o in outputs] == want
        assert [o.finish_reason for o in outputs] == ["length", "length", "stop", "length"]
        for request_id, output in zip(ids, outputs):
            assert [e.token_id for e in events[request_id]] == output.token_ids
            assert all(e.finish_reason is None for e in events[request_id][:-1])
            assert len(output.metrics.token_times) == output.num_tokens and output.metrics.tpot_s > 0
        assert_idle(engine)
    steps = [max(n for *_, n in plan) for plan in plans]
    assert steps[:2] == [1, 1] and steps[2] == 4  # two prefill steps, then bursts
    assert ("r1", 21, 1, 3) in plans[2]  # r1 has 3 tokens left to generate: its burst is capped at 3 steps
    r0 = outputs[0].metrics.token_times
    assert r0[2] == r0[3] == r0[4] == r0[5] and r0[1] < r0[2]  # one burst: one arrival time


def test_an_arrival_mid_stream_falls_back_to_single_steps(llm, bursts, monkeypatch):
    """Two requests decode in bursts; a third arrives: every step while it waits or prefills (40 tokens: two
    chunks) is an ordinary one, then bursts resume. Every request gives its single-step tokens."""
    prompts = [random_prompt(n, 60 + n) for n in (6, 10, 40)]
    single = [llm.generate([p], max_new_tokens=14)[0].token_ids for p in prompts]
    plans = record_plans(bursts, monkeypatch)
    ids = [bursts.add_request(p, max_new_tokens=14) for p in prompts[:2]]
    while not any(n > 1 for *_, n in (plans[-1] if plans else [])):
        bursts.step()
    arrival = len(plans)
    ids.append(bursts.add_request(prompts[2], max_new_tokens=14))
    run_events(bursts)
    assert [bursts.pop_output(i).token_ids for i in ids] == single
    after = plans[arrival:]
    prefill_steps = [plan for plan in after if any(rid == ids[2] and start < 40 for rid, start, *_ in plan)]
    assert len(prefill_steps) == 2 and all(n == 1 for plan in prefill_steps for *_, n in plan)
    first_burst = next(i for i, plan in enumerate(after) if any(n > 1 for *_, n in plan))
    assert after[first_burst - 1] == prefill_steps[-1]  # bursts resume right after the prefill's last chunk


def test_seeded_sampling_with_bursts_is_reproducible(llm, bursts):
    """temperature / top-k / top-p requests on the 4-step engine: two runs give the same tokens, as do single steps
    (the 1-step engine); a request gives the same tokens alone and beside another that arrives mid-stream (its steps
    grouped differently: the draws depend on seed and position only); another seed gives other tokens, and they are
    not the greedy ones."""
    sampling = SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=11)
    prompts = [random_prompt(7, 80), random_prompt(12, 81)]
    first = [o.token_ids for o in bursts.generate(prompts, max_new_tokens=10, sampling=sampling)]
    assert [o.token_ids for o in bursts.generate(prompts, max_new_tokens=10, sampling=sampling)] == first
    assert [o.token_ids for o in llm.generate(prompts, max_new_tokens=10, sampling=sampling)] == first
    assert bursts.generate(prompts[:1], max_new_tokens=10, sampling=sampling)[0].token_ids == first[0]
    lone = bursts.add_request(prompts[0], max_new_tokens=10, sampling=sampling)
    bursts.step(), bursts.step()  # its prefill, then a burst
    late = bursts.add_request(prompts[1], max_new_tokens=10, sampling=sampling)
    run_events(bursts)
    assert bursts.pop_output(lone).token_ids == first[0] and bursts.pop_output(late).token_ids == first[1]
    other = bursts.generate(prompts, max_new_tokens=10, sampling=dataclasses.replace(sampling, seed=12))
    greedy = [o.token_ids for o in llm.generate(prompts, max_new_tokens=10)]
    assert [o.token_ids for o in other] != first and first != greedy


def test_a_burst_fault_or_cancellation_hits_only_its_request(bursts, monkeypatch):
    """Non-finite logits at one request's third burst step fail it there (its first two burst tokens kept, as
    single steps would have emitted them); a request cancelled while its burst runs gets no more events; a burst
    whose call raises fails its plan's requests and the engine goes on. Pages and slots all come back."""
    prompts = [random_prompt(n, 90 + n) for n in (4, 9, 6)]
    alone = [o.token_ids for o in bursts.generate(prompts, max_new_tokens=9)]
    execute = bursts.runner.execute_burst
    calls = [0]

    def faulty(plan, sampling, max_steps):
        calls[0] += 1
        out = execute(plan, sampling, max_steps)
        if calls[0] == 1:  # the first burst: "cancelled" is cancelled while it runs, "nan" goes bad at step 2
            bursts.cancel("cancelled")
            bad = out["nan"]
            out["nan"] = BurstTokens(bad.tokens, np.where(np.arange(len(bad.tokens)) == 2, 7, bad.non_finite))
        return out

    monkeypatch.setattr(bursts.runner, "execute_burst", faulty)
    names = ("nan", "ok", "cancelled")
    ids = [bursts.add_request(p, max_new_tokens=9, request_id=name) for p, name in zip(prompts, names)]
    events = run_events(bursts)
    nan, ok, cancelled = (bursts.pop_output(i) for i in ids)
    assert nan.finish_reason == "error" and "not finite (7 of 256 NaN or +inf)" in nan.error
    assert nan.token_ids == alone[0][:3] and events["nan"][-1].token_id is None  # prefill's token + 2 burst tokens
    assert ok.token_ids == alone[1] and ok.finish_reason == "length"
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == alone[2][:1]
    assert [e.token_id for e in events["cancelled"]] == alone[2][:1]

    def raising(plan, sampling, max_steps):
        raise RuntimeError("injected burst fault")

    monkeypatch.setattr(bursts.runner, "execute_burst", raising)
    failed = bursts.generate(prompts[:2], max_new_tokens=9)
    assert all(o.finish_reason == "error" and "injected burst fault" in o.error for o in failed)
    monkeypatch.undo()
    assert [o.token_ids for o in bursts.generate(prompts[:2], max_new_tokens=9)] == alone[:2]


def host_keep_mask(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The tokens `sample` can draw, and their probabilities, as the host computes them (float64)."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k > 0:
        z = np.where(z < np.sort(z)[-params.top_k], -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        keep = np.zeros(probs.size, bool)
        keep[order[np.cumsum(probs[order]) - probs[order] < params.top_p]] = True
        probs = np.where(keep, probs, 0) / probs[keep].sum()
    return probs


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.6),
                                    SamplingParams(temperature=0.9, top_k=5, top_p=0.8)], ids=str)  # fmt: skip
def test_device_sampling_draws_the_host_distribution(params):
    """4000 draws of one 12-token distribution (one row per position, one seed): each token's frequency is its
    probability under the host's `sample` (temperature, top-k, top-p) within 4.5 sigma, tokens the host never
    draws never appear; the same seed and positions draw the same tokens, another seed others. Greedy rows
    beside them take the argmax, the lowest id among ties."""
    n, logits = 4000, np.array([2.0, 1.5, 1.5, 0.2, -1.0, 0.9, 3.1, -2.0, 0.0, 1.1, 2.9, -0.5], np.float32)
    want = host_keep_mask(logits, params)
    rows = np.broadcast_to(logits, (n, logits.size)).copy()
    rows[0] = [5.0, 1.0, 5.0] + [0.0] * 9  # a greedy row with a tie
    args = device_sampling_arrays([SamplingParams()] + [params] * (n - 1))
    draw = jax.jit(sample_on_device)
    tokens = np.asarray(draw(rows, *args, np.arange(n, dtype=np.int32)))
    assert tokens[0] == 0
    counts = np.bincount(tokens[1:], minlength=logits.size) / (n - 1)
    sigma = np.sqrt(want * (1 - want) / (n - 1))
    assert np.all(np.abs(counts - want) <= 4.5 * sigma + 1e-9), (counts, want)
    assert not counts[want == 0].any()
    assert np.array_equal(np.asarray(draw(rows, *args, np.arange(n, dtype=np.int32))), tokens)
    reseeded = device_sampling_arrays([SamplingParams()] + [dataclasses.replace(params, seed=1)] * (n - 1))
    assert not np.array_equal(np.asarray(draw(rows, *reseeded, np.arange(n, dtype=np.int32))), tokens)


def test_device_picks_are_the_hosts_argmax_the_device_draws_and_the_check():
    """`pick_rows` on random rows with ties (the first wins), a masked token (-inf is fine), NaN and +inf: greedy
    rows give `np.argmax` and count what `check_logits` refuses; a sampled row gives `sample_on_device`'s draw; with
    num_top, the host's logprobs within 1e-5; `sample` returns a pick's token, or fails it as the row would."""
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 3, (6, 300)).astype(np.float32)
    logits[0, [17, 203]] = logits[0].max() + 1.0  # a tie at the top
    logits[1, 4] = -np.inf
    logits[2, [5, 90]] = np.nan
    logits[3, 11] = np.inf
    params = [SamplingParams()] * 5 + [SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    arrays, positions = device_sampling_arrays(params), np.arange(6, dtype=np.int32)
    tokens, bad = (np.asarray(x) for x in pick_rows(jnp.asarray(logits), *arrays, positions))
    drawn = np.asarray(jax.jit(sample_on_device)(logits, *arrays, positions))
    for row in range(6):
        pick = DevicePick(int(tokens[row]), int(bad[row]), 300)
        if row in (2, 3):
            with pytest.raises(ValueError, match="not finite"):
                check_logits(logits[row])
            with pytest.raises(ValueError, match=f"not finite \\({2 if row == 2 else 1} of 300"):
                sample(pick, params[row], np.random.default_rng(0))
        else:
            want = drawn[row] if row == 5 else np.argmax(logits[row])
            assert bad[row] == 0 and tokens[row] == want
            assert sample(pick, params[row], np.random.default_rng(0)) == want
    assert tokens[0] == 17
    _, _, chosen, ids, values = (np.asarray(x) for x in pick_rows(jnp.asarray(logits), *arrays, positions, 4))
    for row in (0, 1, 4, 5):
        want_lp, want_top = logprobs(logits[row], int(tokens[row]), 4)
        assert chosen[row] == pytest.approx(want_lp, abs=1e-5) and ids[row].tolist() == [t for t, _ in want_top]
        assert values[row] == pytest.approx([v for _, v in want_top], abs=1e-5)


def test_sampling_mode_decided_on_the_host_draws_what_the_device_conditionals_draw():
    """`sampling_mode` by hand (greedy: no row samples; restrict: a row limits top_k or top_p, even a greedy one, as
    the device conditional tests it; else sample), and `pick_rows` with that mode gives the tokens of the
    conditionals' path (mode None) on rows with ties and a masked token, and the restricted rows' tokens are among
    their 5 largest logits (a flat distribution, so an unrestricted draw would leave them); an unknown mode is
    refused."""
    greedy, plain = SamplingParams(), SamplingParams(temperature=0.7, seed=2)
    top5 = dataclasses.replace(plain, top_k=5)
    n = 40
    cases = {
        "greedy": [greedy] * (n - 1) + [None],
        "sample": [greedy, plain] * (n // 2 - 1) + [plain, None],
        "restrict": [plain] + [top5] * (n - 2) + [None],
    }
    assert sampling_mode(*device_sampling_arrays([greedy, SamplingParams(top_p=0.5)])[:3]) == "greedy"
    assert sampling_mode(*device_sampling_arrays([plain, SamplingParams(top_p=0.5)])[:3]) == "restrict"
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 0.3, (n, 257)).astype(np.float32)
    logits[:, [3, 200]] = logits.max() + 0.1  # a tie at the top of every row
    logits[1, 7] = -np.inf
    positions = np.arange(n, dtype=np.int32) + 40
    for mode, params in cases.items():
        arrays = device_sampling_arrays(params)
        assert sampling_mode(*arrays[:3]) == mode
        on_host = [np.asarray(x) for x in pick_rows(jnp.asarray(logits), *arrays, positions, 0, mode)]
        on_device = [np.asarray(x) for x in pick_rows(jnp.asarray(logits), *arrays, positions)]
        assert all(np.array_equal(a, b) for a, b in zip(on_host, on_device)), mode
    top = np.argsort(-logits, axis=1, kind="stable")[:, :5]
    assert all(on_host[0][row] in top[row] for row in range(1, n - 1))
    with pytest.raises(ValueError, match="mode='topp'"):
        sample_on_device(jnp.asarray(logits), *device_sampling_arrays(cases["sample"]), positions, "topp")


def test_steps_draw_tokens_on_the_device(llm, monkeypatch):
    """A step returns `DevicePick`s (the token, the row's NaN / +inf count, the logprobs asked for), not [vocab]
    rows, for greedy, sampled and logprobs requests alike. Greedy tokens equal the reference's, with logprobs too;
    a seeded sampled request gives the same tokens beside a logprobs request as alone."""
    (prompt, want), *_ = reference_cases()
    rows, execute = [], llm.runner.execute

    def recording(plan):
        out = execute(plan)
        rows.extend((request_id, type(row).__name__) for request_id, row in out.items())
        return out

    monkeypatch.setattr(llm.runner, "execute", recording)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=4)
    greedy = llm.add_request(prompt, max_new_tokens=3)
    sampled = llm.add_request(random_prompt(5, 3), max_new_tokens=3, sampling=sampling)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.pop_output(greedy).token_ids == want[:3]
    alone = llm.pop_output(sampled).token_ids
    with_logprobs = llm.add_request(prompt, max_new_tokens=3, sampling=SamplingParams(logprobs=2))
    beside = llm.add_request(random_prompt(5, 3), max_new_tokens=3, sampling=sampling)
    while llm.has_unfinished_requests():
        llm.step()
    out = llm.pop_output(with_logprobs)
    assert out.token_ids == want[:3] and len(out.logprobs) == 3 and all(len(top) == 2 for top in out.top_logprobs)
    assert llm.pop_output(beside).token_ids == alone
    assert {kind for _, kind in rows} == {"DevicePick"}
    assert_idle(llm)


def test_device_logprobs_are_the_hosts():
    """`logprobs_on_device` (float32) against the host's `logprobs` (float64) on random logits with ties and a
    masked token: the same top ids in the same order (ties by id), log-probabilities within 1e-5."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 3, (6, 50)).astype(np.float32)
    logits[:, 7] = logits[:, 3]  # ties
    logits[2, 9] = -np.inf
    tokens = rng.integers(0, 50, 6).astype(np.int32)
    chosen, ids, values = (np.asarray(x) for x in jax.jit(logprobs_on_device, static_argnums=2)(logits, tokens, 8))
    for row in range(6):
        want, top = logprobs(logits[row], int(tokens[row]), 8)
        assert chosen[row] == pytest.approx(want, abs=1e-5)
        assert ids[row].tolist() == [t for t, _ in top]
        assert values[row] == pytest.approx([v for _, v in top], abs=1e-5)


@slow_opt_in("one more compiled burst (with logprobs), ~6 s on 2 cores")
def test_burst_logprobs_equal_the_single_steps(llm, bursts):
    """A request asking for logprobs in bursts: its tokens, log-probabilities (device float32 against host
    float64) and top alternatives equal the single-step engine's."""
    prompt = random_prompt(9, 600)
    sampling = SamplingParams(logprobs=3)
    (want,) = llm.generate([prompt], max_new_tokens=9, sampling=sampling)
    (got,) = bursts.generate([prompt], max_new_tokens=9, sampling=sampling)
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    for a, b in zip(got.top_logprobs, want.top_logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-5)


MESH_BURSTS = """
    import json, os, numpy as np, dsv4
    from dsv4.sharding import make_mesh

    shapes = dict(dtype="float32", max_slots=4, max_model_len=128, chunk_size=32, width_buckets=(1, 32),
                  max_packed_width=1, page_size=16)
    cases = []
    for name in ("tiny_mixed", "tiny_short"):
        ref = np.load(os.path.join("tests/fixtures", name, "reference.npz"))
        s = ref["input_ids"].shape[1]
        cases += [(row.tolist(), gen[s:].tolist()) for row, gen in zip(ref["input_ids"], ref["generated"])]
    llm = dsv4.LLM("tests/fixtures/tiny_mixed", **shapes, decode_steps=4, mesh=make_mesh(2))
    outputs = llm.generate([p for p, _ in cases], max_new_tokens=6)
    print(json.dumps(dict(tokens=[o.token_ids for o in outputs], reference=[w for _, w in cases])))
"""


@slow_opt_in("a 2-device mesh engine compiled in a subprocess, 17-23 s on 2 cores")
def test_decode_bursts_on_a_mesh_reproduce_the_reference():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(MESH_BURSTS)], env=host_devices_env(2), cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["tokens"] == row["reference"]
