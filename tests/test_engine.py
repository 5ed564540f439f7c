"""The engine end to end on a tiny fixture model: scheduler + KV pages + runner + sampling.

One engine (module fixture) serves most tests, with its shapes chosen so it compiles four functions: the
slot reset, a [4, 1] and a [4, 8] packed call, and a [1, 32] single-slot call (chunks of up to 32 tokens;
anything wider than 8 runs alone). Its cache is paged, 16 tokens a page (the tiny rates are 4 and 16), and
the pool's size is part of those shapes: the preemption test's engine (a 5-page pool) compiles its own four,
and so does the FP8 engine, which keeps the dense cache (`paged=False`) so that mode stays covered. Three
compilation sets in all. Greedy tokens are compared exactly: the fixtures' reference tokens have logit gaps
above 1e-3 (tests/fixtures/README.md), and "alone" runs go through the same shapes.

Every test leaves the shared engine idle: no request, every page and slot back (checked after each test).
"""

import dataclasses
import json
import os

import numpy as np
import pytest

import dsv4
from dsv4.engine import LLM
from dsv4.generate import SamplingParams

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


@pytest.fixture(autouse=True)
def _shared_engine_left_idle(request):
    yield
    if "llm" in request.fixturenames:
        assert_idle(request.getfixturevalue("llm"))


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
