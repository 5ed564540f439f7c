"""Scheduler: exact grants per step under each policy, chunk boundaries, preemption, cancellation, rejection.

A fake "model" samples token `1000 + position` (position of the token being sampled), so a request's
outputs do not depend on how it was scheduled: a request preempted and resumed must end with exactly the
outputs it would have had without preemption, and the tests check that.
"""

import random
import zlib

import pytest

from dsv4.cache.block_pool import BlockPool
from dsv4.cache.manager import KVCacheManager, PageSpec
from dsv4.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulingPolicy,
)


def make_scheduler(
    *, num_blocks: int = 2000, block_size: int = 16, page_spec: PageSpec | None = None, **config
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(pool, page_spec)), pool


def request(request_id: str, prompt_len: int, max_new_tokens: int, **kwargs) -> Request:
    return Request(request_id, list(range(prompt_len)), max_new_tokens, **kwargs)


def grants(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(chunk.request_id, chunk.num_tokens) for chunk in output.chunks]


def sample(output: SchedulerOutput) -> dict[str, int | list[int]]:
    """The fake model: the token sampled after position p-1 is 1000 + p (a decode burst's steps: p, p + 1, ...)."""
    out = {}
    for c in output.chunks:
        if c.needs_logits:
            p = c.start + c.num_tokens
            out[c.request_id] = 1000 + p if c.num_steps == 1 else [1000 + p + i for i in range(c.num_steps)]
    return out


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, sample(output))
    return output


def run_to_completion(scheduler: Scheduler, pool: BlockPool, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler, pool)


def assert_no_leak(scheduler: Scheduler, pool: BlockPool) -> None:
    assert pool.num_free == pool.num_blocks - 1
    assert list(scheduler.kv_cache.request_ids()) == []


# ----- chunked prefill and the token budget ------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_and_only_the_last_needs_logits():
    scheduler, pool = make_scheduler(max_num_batched_tokens=8192, long_prefill_chunk=8192)
    long = request("long", 20_000, 3)
    scheduler.add_request(long)

    expected = [(0, 8192, False, 512), (8192, 8192, False, 1024), (16384, 3616, True, 1250)]
    for start, num_tokens, needs_logits, num_pages in expected:
        output = step(scheduler)
        (chunk,) = output.chunks
        assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.needs_logits) == (
            "long",
            start,
            num_tokens,
            needs_logits,
        )
        assert chunk.token_ids == tuple(range(start, start + num_tokens))
        assert chunk.block_table == tuple(range(1, num_pages + 1))  # ceil(tokens / 16) pages, ids in order
        assert long.num_computed_tokens == start + num_tokens
    assert long.output_token_ids == [21_000]

    # Decodes: one token each, the last output fed back; a new page at token 20_001.
    output = step(scheduler)
    assert [(c.start, c.num_tokens, c.token_ids, c.needs_logits) for c in output.chunks] == [
        (20_000, 1, (21_000,), True)
    ]
    assert output.chunks[0].block_table == tuple(range(1, 1252))
    output = step(scheduler)
    assert grants(output) == [("long", 1)]
    assert long.output_token_ids == [21_000, 21_001, 21_002]
    assert long.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.schedule().finished_request_ids == ["long"]

    # Freed in reverse: the request's first page is now the last to be reused.
    assert pool.free_block_ids() == list(range(1252, 2000)) + list(range(1251, 0, -1))
    assert_no_leak(scheduler, pool)


def test_budget_goes_to_running_decodes_first_then_the_running_prefill():
    scheduler, pool = make_scheduler(max_num_batched_tokens=8192, long_prefill_chunk=8192)
    for name in ("d1", "d2", "d3"):
        scheduler.add_request(request(name, 10, 50))
    assert grants(step(scheduler)) == [("d1", 10), ("d2", 10), ("d3", 10)]

    scheduler.add_request(request("long", 20_000, 1))
    assert grants(step(scheduler)) == [("d1", 1), ("d2", 1), ("d3", 1), ("long", 8189)]
    assert grants(step(scheduler)) == [("d1", 1), ("d2", 1), ("d3", 1), ("long", 8189)]
    output = step(scheduler)
    assert grants(output) == [("d1", 1), ("d2", 1), ("d3", 1), ("long", 20_000 - 2 * 8189)]
    assert [c.needs_logits for c in output.chunks] == [True, True, True, True]
    assert output.num_scheduled_tokens == 3625
    assert scheduler.schedule().finished_request_ids == ["long"]  # max_new_tokens=1: done after its prefill
    run_to_completion(scheduler, pool)


def test_mixed_prefill_chunk_caps_prefills_only_in_steps_that_carry_decodes():
    scheduler, pool = make_scheduler(max_num_batched_tokens=1000, long_prefill_chunk=800, mixed_prefill_chunk=96)
    scheduler.add_request(request("long", 2000, 2))
    # Alone: whole chunks (prefill priority's TTFT is untouched).
    assert grants(step(scheduler)) == [("long", 800)]
    scheduler.add_request(request("s1", 40, 5))
    scheduler.add_request(request("s2", 40, 5))
    # Nobody decodes yet: the newcomers' prefills share what the budget leaves (200 -> 40 + 40).
    assert grants(step(scheduler)) == [("long", 800), ("s1", 40), ("s2", 40)]
    # s1 and s2 now decode, so all prefills together get 96 tokens; the running long prefill comes first.
    assert grants(step(scheduler)) == [("s1", 1), ("s2", 1), ("long", 96)]
    scheduler.add_request(request("s3", 30, 5))
    assert grants(step(scheduler)) == [("s1", 1), ("s2", 1), ("long", 96)]  # s3 waits: the share is spent
    scheduler.cancel("long")
    assert grants(step(scheduler)) == [("s1", 1), ("s2", 1), ("s3", 30)]
    run_to_completion(scheduler, pool)


def test_several_long_prefills_progress_together_when_the_budget_allows():
    scheduler, pool = make_scheduler(num_blocks=4000, max_num_batched_tokens=16384, long_prefill_chunk=8192)
    scheduler.add_request(request("a", 20_000, 2))
    scheduler.add_request(request("b", 20_000, 2))
    assert grants(step(scheduler)) == [("a", 8192), ("b", 8192)]
    assert grants(step(scheduler)) == [("a", 8192), ("b", 8192)]
    assert grants(step(scheduler)) == [("a", 3616), ("b", 3616)]
    assert grants(step(scheduler)) == [("a", 1), ("b", 1)]
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler, pool)


# ----- policies ----------------------------------------------------------------------------------------

# A long prefill (5000 tokens, chunk 500) starts with two short requests that then decode; two more short
# requests (50 tokens) arrive in step 2. Budget 600 per step. Each policy's grants, step by step:
POLICY_PLANS = {
    # The running long prefill keeps its full 500-token chunk; newcomers get what is left (98 tokens).
    SchedulingPolicy.PREFILL_PRIORITY: [
        [("long", 500), ("d1", 10), ("d2", 10)],
        [("d1", 1), ("d2", 1), ("long", 500), ("s1", 50), ("s2", 48)],
        [("d1", 1), ("d2", 1), ("s1", 1), ("long", 500), ("s2", 2)],
    ],
    # Short prompts overtake the long prefill, which gets the remainder (498 in step 2).
    SchedulingPolicy.DECODE_PRIORITY: [
        [("d1", 10), ("d2", 10), ("long", 500)],
        [("d1", 1), ("d2", 1), ("s1", 50), ("s2", 50), ("long", 498)],
        [("d1", 1), ("d2", 1), ("s1", 1), ("s2", 1), ("long", 500)],
    ],
    # Strict arrival order: the long prefill's chunk is handed out before the older decodes' tokens.
    SchedulingPolicy.FCFS: [
        [("long", 500), ("d1", 10), ("d2", 10)],
        [("long", 500), ("d1", 1), ("d2", 1), ("s1", 50), ("s2", 48)],
        [("long", 500), ("d1", 1), ("d2", 1), ("s1", 1), ("s2", 2)],
    ],
}


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
def test_grant_order_with_a_long_prefill_running_and_short_requests_arriving(policy):
    scheduler, pool = make_scheduler(
        max_num_batched_tokens=600, long_prefill_chunk=500, max_num_seqs=8, policy=policy.value
    )
    assert scheduler.config.policy is policy
    for name, prompt_len in (("long", 5000), ("d1", 10), ("d2", 10)):
        scheduler.add_request(request(name, prompt_len, 20))
    plans = POLICY_PLANS[policy]
    assert grants(step(scheduler)) == plans[0]
    scheduler.add_request(request("s1", 50, 20))
    scheduler.add_request(request("s2", 50, 20))
    output = step(scheduler)
    assert grants(output) == plans[1]
    assert {c.request_id: c.needs_logits for c in output.chunks} == {
        "long": False,
        "d1": True,
        "d2": True,
        "s1": True,
        "s2": dict(plans[1])["s2"] == 50,
    }
    assert grants(step(scheduler)) == plans[2]
    run_to_completion(scheduler, pool)


def test_fcfs_lets_an_older_prefill_take_the_whole_budget():
    scheduler, pool = make_scheduler(max_num_batched_tokens=500, long_prefill_chunk=500, policy="fcfs")
    scheduler.add_request(request("long", 1200, 1))
    scheduler.add_request(request("short", 10, 1))
    assert grants(step(scheduler)) == [("long", 500)]
    assert grants(step(scheduler)) == [("long", 500)]
    assert grants(step(scheduler)) == [("long", 200), ("short", 10)]
    assert_no_leak(scheduler, pool)


def test_max_num_seqs_caps_the_running_requests():
    scheduler, pool = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for name in ("a", "b", "c"):
        scheduler.add_request(request(name, 4, 2))
    assert grants(step(scheduler)) == [("a", 4), ("b", 4)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert grants(step(scheduler)) == [("a", 1), ("b", 1)]  # both reach max_new_tokens=2
    output = step(scheduler)
    assert grants(output) == [("c", 4)]
    assert output.finished_request_ids == ["a", "b"]
    assert grants(step(scheduler)) == [("c", 1)]
    assert_no_leak(scheduler, pool)


# ----- preemption --------------------------------------------------------------------------------------


def test_running_out_of_pages_preempts_the_newest_request_which_resumes_by_recompute():
    # 6 usable pages of 4 tokens; each request needs up to 4 pages (7 + 10 - 1 = 16 tokens).
    scheduler, pool = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = request("a", 7, 10), request("b", 7, 10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    kv = scheduler.kv_cache

    assert grants(step(scheduler)) == [("a", 7), ("b", 7)]
    assert kv.block_tables("a") == ((1, 2),) and kv.block_tables("b") == ((3, 4),)
    assert grants(step(scheduler)) == [("a", 1), ("b", 1)]  # 8 tokens: still 2 pages each
    assert grants(step(scheduler)) == [("a", 1), ("b", 1)]  # 9 tokens: a third page each
    assert kv.block_tables("a") == ((1, 2, 5),) and kv.block_tables("b") == ((3, 4, 6),)
    assert pool.free_block_ids() == []
    for _ in range(3):  # tokens 10..12 fit in 3 pages
        assert grants(step(scheduler)) == [("a", 1), ("b", 1)]
    assert a.output_token_ids == b.output_token_ids == [1007, 1008, 1009, 1010, 1011, 1012]

    # Token 13 needs a fourth page each; none is free. a (older) preempts b (newest): b's pages go back
    # reversed, and a takes the first of them.
    output = step(scheduler)
    assert grants(output) == [("a", 1)]
    assert output.preempted_request_ids == ["b"]
    assert kv.block_tables("a") == ((1, 2, 5, 6),)
    assert kv.block_tables("b") == ((),)
    assert pool.free_block_ids() == [4, 3]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [1007, 1008, 1009, 1010, 1011, 1012]  # kept for the recompute
    assert [r.request_id for r in scheduler.waiting] == ["b"]

    # b needs 4 pages to resume (13 tokens); only 2 are free, so it waits while a finishes.
    for _ in range(3):
        output = step(scheduler)
        assert grants(output) == [("a", 1)]
        assert output.preempted_request_ids == []
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == list(range(1007, 1017))
    assert pool.free_block_ids() == [4, 3, 6, 5, 2, 1]

    # b resumes: one prefill of prompt + its 6 outputs from position 0, on 4 fresh pages.
    output = step(scheduler)
    assert output.finished_request_ids == ["a"]
    (chunk,) = output.chunks
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.needs_logits) == ("b", 0, 13, True)
    assert chunk.token_ids == (0, 1, 2, 3, 4, 5, 6, 1007, 1008, 1009, 1010, 1011, 1012)
    assert chunk.block_table == (4, 3, 6, 5)
    assert b.status is RequestStatus.RUNNING
    run_to_completion(scheduler, pool)
    assert b.output_token_ids == list(range(1007, 1017))  # same as if it had never been preempted
    assert pool.free_block_ids() == [2, 1, 5, 6, 3, 4]


def test_preempting_a_request_already_granted_this_step_hands_its_budget_back():
    # prefill_priority grants d's decode first; then the older long prefill needs pages, and the newest
    # running request is d, already in the plan: d's chunk is dropped and its token refunded.
    scheduler, pool = make_scheduler(
        num_blocks=8, block_size=4, max_num_batched_tokens=16, long_prefill_chunk=8, max_num_seqs=4
    )
    long, d = request("long", 24, 2), request("d", 4, 8)
    scheduler.add_request(long)
    scheduler.add_request(d)
    kv = scheduler.kv_cache

    assert grants(step(scheduler)) == [("long", 8), ("d", 4)]
    assert kv.block_tables("long") == ((1, 2),) and kv.block_tables("d") == ((3,),)
    assert grants(step(scheduler)) == [("d", 1), ("long", 8)]
    assert kv.block_tables("long") == ((1, 2, 5, 6),) and kv.block_tables("d") == ((3, 4),)
    assert pool.free_block_ids() == [7]

    output = step(scheduler)
    assert grants(output) == [("long", 8)]
    assert output.preempted_request_ids == ["d"]
    assert kv.block_tables("long") == ((1, 2, 5, 6, 7, 4),)
    assert pool.free_block_ids() == [3]
    assert (d.status, d.num_computed_tokens, d.output_token_ids) == (RequestStatus.PREEMPTED, 0, [1004, 1005])

    assert grants(step(scheduler)) == [("long", 1)]  # d needs 2 pages to resume; 1 is free
    assert long.status is RequestStatus.FINISHED_LENGTH
    assert pool.free_block_ids() == [3, 4, 7, 6, 5, 2, 1]
    output = step(scheduler)
    assert [(c.request_id, c.start, c.num_tokens, c.token_ids) for c in output.chunks] == [
        ("d", 0, 6, (0, 1, 2, 3, 1004, 1005))
    ]
    assert output.chunks[0].block_table == (3, 4)
    run_to_completion(scheduler, pool)
    assert d.output_token_ids == list(range(1004, 1012))


# ----- decode bursts ------------------------------------------------------------------------------------


def bursts(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start, c.num_steps) for c in output.chunks]


def test_decode_bursts_only_when_every_running_request_decodes_and_none_waits():
    """decode_steps=4: a burst grants each decode min(4, tokens it may still generate) steps and the pages for
    all of them (pages of 4 tokens); a stop token mid-burst drops the rest; an arrival makes the next step an
    ordinary one, then bursts resume."""
    scheduler, pool = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                                     decode_steps=4)  # fmt: skip
    a, b, c = request("a", 5, 10), request("b", 3, 3), request("c", 6, 9, stop_token_ids={1009})
    for r in (a, b, c):
        scheduler.add_request(r)
    kv = scheduler.kv_cache
    first = step(scheduler)  # prefills: ordinary
    assert bursts(first) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 1)]
    assert [r.output_token_ids for r in (a, b, c)] == [[1005], [1003], [1006]]

    output = scheduler.schedule()
    # a: 4 steps from position 5 (tokens 5..8 written: 9 tokens, 3 pages); b: 2 left to generate, so 2 steps
    # (tokens 3, 4: 5 tokens, 2 pages); c: 4 steps (tokens 6..9: 10 tokens, 3 pages)
    assert bursts(output) == [("a", 5, 4), ("b", 3, 2), ("c", 6, 4)]
    assert [ch.num_tokens for ch in output.chunks] == [1, 1, 1]
    assert [ch.token_ids for ch in output.chunks] == [(1005,), (1003,), (1006,)]
    assert [kv.num_tokens(r) for r in "abc"] == [9, 5, 10]
    assert kv.block_tables("a") == ((1, 2, 6),) and kv.block_tables("b") == ((3, 7),)
    assert kv.block_tables("c") == ((4, 5, 8),)
    with pytest.raises(ValueError, match="request 'a' ran 4 decode step\\(s\\); it takes 1 to 4 sampled tokens, got 5"):
        scheduler.update(output, {**sample(output), "a": [1, 2, 3, 4, 5]})
    assert a.num_computed_tokens == 5 and a.output_token_ids == [1005]  # the failed call applied nothing
    finished = scheduler.update(output, sample(output))
    assert finished == [b, c]
    assert (b.status, b.output_token_ids) == (RequestStatus.FINISHED_LENGTH, [1003, 1004, 1005])
    assert (c.status, c.output_token_ids) == (RequestStatus.FINISHED_STOPPED, [1006, 1007, 1008, 1009])  # 1010 dropped
    assert (a.num_computed_tokens, a.output_token_ids) == (9, [1005, 1006, 1007, 1008, 1009])

    scheduler.add_request(request("d", 2, 2))  # an arrival: the next step is an ordinary one
    assert bursts(step(scheduler)) == [("a", 9, 1), ("d", 0, 1)]
    assert bursts(step(scheduler)) == [("a", 10, 4), ("d", 2, 1)]  # a burst again: d has 1 token left to generate
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == list(range(1005, 1015))
    assert_no_leak(scheduler, pool)


def test_a_decode_burst_preempts_by_the_usual_rule():
    """A burst takes its pages up front: with 5 pages of 4 tokens, a's 4 steps (11 tokens) take the last free page,
    b's (8 tokens) need one more, so c, the newest, is preempted (its 1-step grant never made); with c waiting the
    next steps are ordinary ones, and every request ends with the tokens it would have had."""
    scheduler, pool = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                                     decode_steps=4)  # fmt: skip
    a, b, c = request("a", 7, 6), request("b", 4, 5), request("c", 3, 2)
    for r in (a, b, c):
        scheduler.add_request(r)
    assert bursts(step(scheduler)) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 1)]  # pages: a 2, b 1, c 1
    output = scheduler.schedule()
    assert bursts(output) == [("a", 7, 4), ("b", 4, 4)] and output.preempted_request_ids == ["c"]
    assert scheduler.kv_cache.block_tables("a") == ((1, 2, 5),) and scheduler.kv_cache.block_tables("b") == ((3, 4),)
    assert (c.status, c.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert scheduler.update(output, sample(output)) == [b]  # b's 4 tokens were its last
    assert all(chunk.num_steps == 1 for chunk in step(scheduler).chunks)  # c waits: an ordinary step
    run_to_completion(scheduler, pool)
    assert a.output_token_ids == list(range(1007, 1013)) and b.output_token_ids == list(range(1004, 1009))
    assert c.output_token_ids == [1003, 1004]


# ----- cancellation, stop tokens, errors ---------------------------------------------------------------


def test_cancel_frees_pages_at_once_whatever_state_the_request_is_in():
    scheduler, pool = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    scheduler.add_request(request("a", 10, 5))
    scheduler.add_request(request("b", 5, 5))
    assert grants(step(scheduler)) == [("a", 10), ("b", 5)]
    assert pool.free_block_ids() == [6, 7, 8, 9]

    a = scheduler.cancel("a")
    assert a is not None and a.status is RequestStatus.FINISHED_CANCELLED
    assert pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 1]
    assert scheduler.get_request("a") is None
    assert scheduler.cancel("a") is None  # already gone: not an error

    scheduler.add_request(request("c", 3, 5))
    assert scheduler.cancel("c").status is RequestStatus.FINISHED_CANCELLED  # waiting: holds no pages
    output = scheduler.schedule()
    assert grants(output) == [("b", 1)]
    assert output.finished_request_ids == ["a", "c"]

    # Cancelled between schedule and update: its chunk is skipped, the rest is applied.
    scheduler.cancel("b")
    assert scheduler.update(output, sample(output)) == []
    assert_no_leak(scheduler, pool)


def test_stop_token_finishes_the_request_and_is_kept_in_the_output():
    scheduler, pool = make_scheduler()
    r = request("r", 4, 10, stop_token_ids={1005})
    scheduler.add_request(r)
    assert scheduler.update(scheduler.schedule(), {"r": 1004}) == []
    assert scheduler.update(scheduler.schedule(), {"r": 1005}) == [r]
    assert (r.status, r.output_token_ids) == (RequestStatus.FINISHED_STOPPED, [1004, 1005])
    assert_no_leak(scheduler, pool)


def test_update_rejects_a_missing_sample_and_an_output_applied_twice():
    scheduler, _ = make_scheduler()
    scheduler.add_request(request("r", 4, 10))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'r'"):
        scheduler.update(output, {})
    assert scheduler.get_request("r").num_computed_tokens == 0  # the failed call applied nothing
    scheduler.update(output, {"r": 7})
    with pytest.raises(ValueError, match="request 'r' starts at 0 but the request has 4 computed tokens"):
        scheduler.update(output, {"r": 7})


def test_requests_that_can_never_run_are_rejected_naming_the_request_and_the_limit():
    scheduler, pool = make_scheduler(num_blocks=5, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match=r"'too-long'.*\(15 tokens\).*\(6\) = 21 tokens exceeds max_model_len=20"):
        scheduler.add_request(request("too-long", 15, 6))
    # 10 + 8 - 1 = 17 tokens of KV need 5 pages of 4; the pool has 4 usable pages = 16 tokens.
    with pytest.raises(ValueError, match=r"'too-big'.*KV for 17 tokens = 5 pages.*holds 4 pages = 16 tokens"):
        scheduler.add_request(request("too-big", 10, 8))
    # Exactly the whole pool is fine (the last sampled token needs no KV), and runs to the end.
    fits = request("fits", 10, 7)
    scheduler.add_request(fits)
    with pytest.raises(ValueError, match="'fits' is already queued"):
        scheduler.add_request(request("fits", 1, 1))
    run_to_completion(scheduler, pool)
    assert len(fits.output_token_ids) == 7


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Request("r", [], 1), "'r': prompt_token_ids is empty"),
        (lambda: Request("r", [1], 0), "'r': max_new_tokens=0"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (lambda: SchedulerConfig(long_prefill_chunk=0), "long_prefill_chunk=0"),
        (lambda: SchedulerConfig(mixed_prefill_chunk=0), "mixed_prefill_chunk=0"),
        (lambda: SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16), "max_num_seqs=16"),
        (lambda: SchedulerConfig(policy="lifo"), "lifo"),
        (lambda: SchedulerConfig(decode_steps=0), "decode_steps=0"),
    ],
)
def test_bad_requests_and_configs_raise_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ----- randomized soak ---------------------------------------------------------------------------------


def check_invariants(scheduler: Scheduler, pool: BlockPool, output: SchedulerOutput | None) -> None:
    kv = scheduler.kv_cache
    config = scheduler.config
    running_ids = {r.request_id for r in scheduler.running}
    assert set(kv.request_ids()) == running_ids  # only running requests hold pages
    assert len(running_ids) <= config.max_num_seqs
    assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)
    assert [r.arrival_seq for r in scheduler.running] == sorted(r.arrival_seq for r in scheduler.running)

    owned = [block for rid in running_ids for table in kv.block_tables(rid) for block in table]
    free = pool.free_block_ids()
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert len(free) == len(set(free)), "a page is on the free queue twice"
    assert sorted(owned + free) == list(range(1, pool.num_blocks)), "free + owned != all pages"
    assert all(pool.ref_count(block) == 1 for block in owned)
    assert all(pool.ref_count(block) == 0 for block in free)
    for rid in running_ids:
        assert tuple(map(len, kv.block_tables(rid))) == kv.page_spec.pages_per_group(kv.num_tokens(rid))

    if output is None:  # after update: the cache holds exactly the computed tokens
        for r in scheduler.running:
            assert kv.num_tokens(r.request_id) == r.num_computed_tokens
        return
    # The waiting queue only changes shape in schedule (and cancel), so it is checked once per step.
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting)
    assert [r.arrival_seq for r in scheduler.waiting] == sorted(r.arrival_seq for r in scheduler.waiting)
    assert output.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len({c.request_id for c in output.chunks}) == len(output.chunks)
    for chunk in output.chunks:
        r = scheduler.get_request(chunk.request_id)
        assert r.status is RequestStatus.RUNNING
        assert 1 <= chunk.num_tokens <= config.long_prefill_chunk
        assert chunk.start == r.num_computed_tokens
        assert kv.num_tokens(r.request_id) == chunk.start + chunk.num_tokens + chunk.num_steps - 1
        assert 1 <= chunk.num_steps <= config.decode_steps
        if chunk.num_steps > 1:  # a burst: decodes only, each capped by what its request may still generate
            assert chunk.num_tokens == 1 and chunk.needs_logits
            assert chunk.num_steps <= r.max_new_tokens - len(r.output_token_ids)
        assert chunk.block_tables == kv.block_tables(r.request_id)
        assert chunk.needs_logits == (chunk.start + chunk.num_tokens == r.num_tokens)
        assert chunk.token_ids == tuple(
            (r.prompt_token_ids + r.output_token_ids)[chunk.start : chunk.start + chunk.num_tokens]
        )
    for rid in output.preempted_request_ids:
        assert scheduler.get_request(rid).status is RequestStatus.PREEMPTED


def fake_token(request_id: str, position: int) -> int:
    # Deterministic per (request, position), so a recomputed request samples the same tokens, and the same
    # in every run (unlike hash(), which is salted per process).
    return zlib.crc32(f"{request_id}:{position}".encode()) % 50


SOAK_PAGE_SPECS = {
    # 32 usable pages of 4 tokens: 128 tokens for all requests together.
    "tokens": (33, PageSpec.tokens(4)),
    # A ring of 8 tokens (2 pages) plus entries every 4 and every 16 tokens, 4 entries per page; 12 usable
    # pages hold one request of up to 128 tokens, or three small ones (each holds at least 4 pages).
    "deepseek_v4": (13, PageSpec.deepseek_v4(sliding_window=8, compress_rates=[4, 16], entries_per_page=4)),
}


# About 0.25 arrivals per step, in bursts: faster than the tiny pool serves them (about 0.1 per step), so a
# queue of up to ~200 builds and requests are preempted and resumed thousands of times over a run.
ARRIVALS_PER_STEP = [0] * 24 + [1] * 3 + [4]


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize("page_spec_name", list(SOAK_PAGE_SPECS))
@pytest.mark.parametrize("policy", list(SchedulingPolicy))
def test_randomized_soak_keeps_invariants_and_finishes_every_request(policy, page_spec_name, decode_steps):
    rng = random.Random(f"soak-{policy}-{page_spec_name}")
    num_blocks, page_spec = SOAK_PAGE_SPECS[page_spec_name]
    scheduler, pool = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        page_spec=page_spec,
        max_num_batched_tokens=48,
        long_prefill_chunk=16,
        max_num_seqs=4,
        policy=policy,
        mixed_prefill_chunk=5 if page_spec_name == "tokens" else None,  # both ways of granting prefills
        decode_steps=decode_steps,
    )
    stop_token = 7
    accepted: list[Request] = []
    num_rejected = num_cancelled = num_bursts = 0
    num_to_add = 300
    for step_index in range(20_000):
        if num_to_add == 0 and not scheduler.has_unfinished_requests():
            break
        # With decode bursts, arrivals come in waves (100 steps on, 200 off), so the queue drains and bursts run
        # between them, beside preemption and cancellation.
        quiet = decode_steps > 1 and step_index % 300 >= 100
        for _ in range(0 if quiet else min(rng.choice(ARRIVALS_PER_STEP), num_to_add)):
            num_to_add -= 1
            r = Request(
                f"r{num_to_add}",
                [rng.randrange(50) for _ in range(rng.randint(1, 100))],
                max_new_tokens=rng.randint(1, 40),
                stop_token_ids={stop_token},
            )
            try:
                scheduler.add_request(r)
            except ValueError as error:
                assert r.request_id in str(error)
                num_rejected += 1
            else:
                accepted.append(r)
        if scheduler.has_unfinished_requests() and rng.random() < 0.02:
            live = [r for r in accepted if scheduler.get_request(r.request_id) is not None]
            scheduler.cancel(rng.choice(live).request_id)
            num_cancelled += 1
            check_invariants(scheduler, pool, None)

        output = scheduler.schedule()
        check_invariants(scheduler, pool, output)
        if scheduler.has_unfinished_requests():
            assert output.chunks, "no progress with requests pending"
        sampled = {c.request_id: fake_token(c.request_id, c.start + c.num_tokens) if c.num_steps == 1 else
                   [fake_token(c.request_id, c.start + c.num_tokens + i) for i in range(c.num_steps)]
                   for c in output.chunks}  # fmt: skip
        num_bursts += any(c.num_steps > 1 for c in output.chunks)
        scheduler.update(output, sampled)  # every chunk sampled: the ones without needs_logits are ignored
        check_invariants(scheduler, pool, None)
    else:
        pytest.fail("soak did not finish within 20_000 steps")

    assert_no_leak(scheduler, pool)
    assert all(r.status.is_finished for r in accepted)
    for r in accepted:
        if r.status is RequestStatus.FINISHED_CANCELLED:
            continue
        expected = [fake_token(r.request_id, r.num_prompt_tokens + i) for i in range(len(r.output_token_ids))]
        assert r.output_token_ids == expected  # preemption and recompute lost or repeated nothing
        assert stop_token not in r.output_token_ids[:-1]
        if r.status is RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] == stop_token
        else:
            assert len(r.output_token_ids) == r.max_new_tokens
    # The scenario must exercise what it is meant to.
    assert num_rejected > 0 and num_cancelled > 0
    assert sum(r.num_preemptions for r in accepted) > 0
    assert sum(r.status is RequestStatus.FINISHED_STOPPED for r in accepted) > 0
    assert (num_bursts > 0) == (decode_steps > 1)


def test_abort_and_preempt_free_pages_for_the_engines_fault_path():
    """`abort` finishes a request as FINISHED_ERROR from any state; `preempt` sends a running one back to recompute."""
    scheduler, pool = make_scheduler(num_blocks=64, block_size=16)
    for name in ("a", "b", "c"):
        scheduler.add_request(request(name, 40, 4))
    step(scheduler)
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    assert scheduler.preempt("b") and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert not scheduler.preempt("b") and not scheduler.preempt("nope")
    assert scheduler.abort("a") is a and a.status is RequestStatus.FINISHED_ERROR and a.status.is_finished
    assert scheduler.abort("a") is None and scheduler.abort("c").status is RequestStatus.FINISHED_ERROR
    run_to_completion(scheduler, pool)
    assert b.output_token_ids == [1040, 1041, 1042, 1043]
