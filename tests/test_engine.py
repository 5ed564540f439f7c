"""The engine end to end on a tiny fixture model: scheduler + KV pages + runner + sampling.

One engine (module fixture) serves most tests, with its shapes chosen so the whole file compiles four
functions: the slot reset, a [4, 1] and a [4, 8] packed call, and a [1, 32] single-slot call (chunks of
up to 32 tokens; anything wider than 8 runs alone). A second engine for preemption reuses the same model
object, so the same compiled functions. Greedy tokens are compared exactly: the fixtures' reference
tokens have logit gaps above 1e-3 (tests/fixtures/README.md), and "alone" runs go through the same shapes.
"""

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
              max_packed_width=8)  # fmt: skip


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
    for request_id, token, finish_reason, output in llm.stream(prompts, max_new_tokens=8):
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
    """Pages of 4 entries, 12 of them: a 37-token request needs 8 pages at its longest (4 for the sliding
    ring, 3 for CSA entries, 1 for HCA), so two cannot grow side by side; the newest is preempted and
    recomputes from scratch in a reset slot. The same model object: the same compiled functions."""
    small = LLM(llm.model, **SHAPES, page_size=4, num_kv_pages=12)
    cases = reference_cases()
    extra = random_prompt(60, 11)
    prompts = [prompt for prompt, _ in cases] + [extra]
    extra_alone = llm.generate([extra], max_new_tokens=6)[0].token_ids
    outputs = small.generate(prompts, max_new_tokens=6)
    assert [o.token_ids for o in outputs] == [want for _, want in cases] + [extra_alone]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_idle(small)
    with pytest.raises(ValueError, match="whole KV pool holds 12 pages"):
        small.add_request(random_prompt(100, 3), max_new_tokens=20)


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
    fp8 = LLM(llm.model, **{k: v for k, v in SHAPES.items() if k != "dtype"}, kv_cache_dtype="fp8-channel")
    assert fp8.runner.kv_format == "fp8-channel"
    prompts = [random_prompt(n, 40 + n) for n in (45, 3, 12)]
    alone = [fp8.generate([p], max_new_tokens=5)[0].token_ids for p in prompts]
    assert [o.token_ids for o in fp8.generate(prompts, max_new_tokens=5)] == alone
    assert_idle(fp8)
