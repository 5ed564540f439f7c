"""Fault injection: a failed step never wedges the engine, one bad request never fails the others.

One engine (the shapes of tests/test_engine.py, so in one process it shares their compiled programs) serves every
test. Faults are injected by wrapping the engine's own pieces (the runner's `execute`, its jitted calls, the
sampler, the tokenizer). Each test checks: every surviving greedy output equals the request run alone (cached by
prompt), every failed request has finish_reason "error" and a message, and afterwards every page and slot is free.
"""

import os
import random

import jax
import numpy as np
import pytest
from test_engine import MODEL_DIR, SHAPES, assert_idle, random_prompt

import dsv4.engine
from dsv4.engine import LLM
from dsv4.generate import SamplingParams

MAX_NEW = 4


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL_DIR, **SHAPES)


_ALONE: dict[tuple[int, ...], list[int]] = {}


def alone(engine: LLM, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    """The greedy tokens of `prompt` run alone (the first n of MAX_NEW: greedy outputs are prefixes)."""
    key = tuple(prompt)
    if key not in _ALONE:
        (out,) = engine.generate([prompt], max_new_tokens=MAX_NEW)
        assert out.finish_reason == "length", out.error
        _ALONE[key] = out.token_ids
    return _ALONE[key][:n]


def run(engine: LLM, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()  # never raises
    raise AssertionError("the engine is wedged: requests left after max_steps")


def check(engine: LLM, prompts: dict[str, list[int]], max_new: dict[str, int] | None = None) -> dict[str, str]:
    """Every request finished: an error with a message, cancelled with a prefix of its alone tokens, or its alone
    tokens. → request id → finish reason. The engine is idle afterwards."""
    reasons = {}
    for request_id, prompt in prompts.items():
        out = engine.pop_output(request_id)
        assert out is not None and out.finished, request_id
        n = (max_new or {}).get(request_id, MAX_NEW)
        want = alone(engine, prompt, n)
        if out.finish_reason == "error":
            assert out.error, request_id
        elif out.finish_reason == "cancelled":
            assert out.token_ids == want[: len(out.token_ids)], request_id
        else:
            assert out.finish_reason == "length" and out.token_ids == want, (request_id, out)
        reasons[request_id] = out.finish_reason
    assert_idle(engine)
    return reasons


def _consume_cache(engine: LLM) -> None:
    """What a failed donated call leaves: the cache's buffers deleted."""
    for x in jax.tree.leaves(engine.runner.cache):
        x.delete()


STAGES = ["before_device", "in_device_call", "after_device", "in_update"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(llm, monkeypatch, stage):
    """Six requests on 4 slots (two wait); the third step fails at `stage`. Its plan's requests fail with the
    exception as their error; the rest, and requests added afterwards, give their alone tokens."""
    prompts = {llm.add_request(p, max_new_tokens=MAX_NEW): p
               for p in [random_prompt(n, 100 + n) for n in (40, 3, 9, 1, 20, 5)]}  # fmt: skip
    llm.step(), llm.step()
    runner, armed = llm.runner, [True]
    execute, timed, update = runner.execute, runner._timed, llm.scheduler.update

    def boom():
        armed[0] = False
        raise RuntimeError(f"injected at {stage}")

    def faulty_execute(plan):
        if armed[0] and stage == "before_device":
            boom()
        out = execute(plan)
        if armed[0] and stage == "after_device":
            boom()
        return out

    def faulty_timed(shape, fn, *args):
        out = timed(shape, fn, *args)
        if armed[0] and stage == "in_device_call":
            _consume_cache(llm)  # the donated cache is gone, as after a failed device call
            boom()
        return out

    def faulty_update(plan, sampled):
        if armed[0] and stage == "in_update":
            boom()
        return update(plan, sampled)

    monkeypatch.setattr(runner, "execute", faulty_execute)
    monkeypatch.setattr(runner, "_timed", faulty_timed)
    monkeypatch.setattr(llm.scheduler, "update", faulty_update)
    events = llm.step()
    failed = [e for e in events if e.finish_reason == "error"]
    assert failed and all(f"injected at {stage}" in e.output.error for e in failed)
    prompts.update({llm.add_request(p, max_new_tokens=MAX_NEW): p for p in (random_prompt(7, 1), random_prompt(33, 2))})
    run(llm)
    reasons = check(llm, prompts)
    assert list(reasons.values()).count("length") >= 4


def test_a_fault_surfacing_from_a_queued_step_fails_the_next_plan(llm, monkeypatch):
    """A step that returns no logits is left running on the device and waited for in the next step
    (`Runner.execute`), so a device fault in it surfaces there: that step's request fails with it, and a request
    added afterwards gives its alone tokens."""
    long_prompt, short = random_prompt(90, 700), random_prompt(6, 701)  # 90 tokens: two chunks without logits
    want = alone(llm, short)
    runner, dispatched = llm.runner, []
    slot_step, block, armed = runner._programs.slot_step, jax.block_until_ready, [True]

    def call(*args):
        logits, cache = slot_step(*args)
        dispatched.append(id(logits))
        return logits, cache

    def wait(x):
        if armed[0] and dispatched and dispatched[0] in {id(leaf) for leaf in jax.tree.leaves(x)}:
            armed[0] = False
            raise RuntimeError("injected device fault")
        return block(x)

    monkeypatch.setattr(runner._programs, "slot_step", call)
    monkeypatch.setattr(jax, "block_until_ready", wait)
    victim = llm.add_request(long_prompt, max_new_tokens=MAX_NEW)
    assert llm.step() == []  # the first chunk, queued
    (event,) = llm.step()  # the second chunk's step waits for the first and meets its fault
    assert event.request_id == victim and event.finish_reason == "error"
    assert "injected device fault" in event.output.error and not armed[0]
    later = llm.add_request(short, max_new_tokens=MAX_NEW)
    run(llm)
    assert llm.pop_output(victim).finish_reason == "error"
    assert llm.pop_output(later).token_ids == want
    assert_idle(llm)


def test_a_fault_granting_one_request_fails_it_alone(llm, monkeypatch):
    """The page pool raises while the scheduler grants one running request more pages (after giving them): that
    request alone fails, with the message and its pages back; the others in its steps give their alone tokens."""
    prompts = {llm.add_request(p, max_new_tokens=MAX_NEW): p
               for p in [random_prompt(n, 300 + n) for n in (12, 3, 30, 1, 6)]}  # fmt: skip
    victim, calls = list(prompts)[2], [0]
    allocate = llm.scheduler.kv_cache.allocate_slots

    def faulty(request_id, num_tokens):
        got = allocate(request_id, num_tokens)
        if request_id == victim:
            calls[0] += 1
            if calls[0] == 2:  # its second grant: it is running and holds pages
                raise RuntimeError("injected in allocate_slots")
        return got

    monkeypatch.setattr(llm.scheduler.kv_cache, "allocate_slots", faulty)
    errors = {}
    while llm.has_unfinished_requests():
        errors.update({e.request_id: e.output.error for e in llm.step() if e.finish_reason == "error"})
    assert calls[0] == 2 and list(errors) == [victim]
    assert errors[victim] == "scheduling failed: RuntimeError: injected in allocate_slots"
    reasons = check(llm, prompts)
    assert [r for r, reason in reasons.items() if reason != "length"] == [victim]


def test_lost_cache_preempts_running_requests_outside_the_plan(llm):
    """The recovery rule itself: a step whose plan holds only A fails with the cache consumed; B, running but not
    in that plan, is preempted and recomputes from scratch: its tokens are still its alone tokens."""
    a, b = random_prompt(12, 5), random_prompt(30, 6)
    ra, rb = llm.add_request(a, max_new_tokens=MAX_NEW), llm.add_request(b, max_new_tokens=MAX_NEW)
    llm.step(), llm.step()
    assert llm.runner.slot_of(rb) is not None
    plan = llm.scheduler.schedule()
    plan.chunks[:] = [c for c in plan.chunks if c.request_id == ra]
    _consume_cache(llm)
    events = llm._fail_step(plan, RuntimeError("device fault"))
    assert [(e.request_id, e.finish_reason) for e in events] == [(ra, "error")]
    assert llm.runner.cache_ok() and llm.runner.slot_of(rb) is None
    run(llm)
    check(llm, {ra: a, rb: b})
    assert llm.get_output(rb) is None


def test_bad_sampling_parameters_are_refused_at_the_door(llm):
    cases = [
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=float("inf")), "temperature=inf"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=float("nan")), "top_p=nan"),
        (dict(top_k=-5), "top_k=-5"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(seed=-1), "seed=-1"),
        (dict(seed=1.5), "seed=1.5"),
        (dict(logprobs=21), "logprobs=21"),
        (dict(logprobs=True), "logprobs=True"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            SamplingParams(**kwargs)
    good = random_prompt(6, 9)
    bad_requests = [
        (dict(prompt=good, max_new_tokens=2.5), "max_new_tokens=2.5"),
        (dict(prompt=good, max_new_tokens=True), "max_new_tokens=True"),
        (dict(prompt=good, max_new_tokens=0), "max_new_tokens=0"),
        (dict(prompt=[1.0, 2.0]), "position 0 is 1.0"),
        (dict(prompt=[5, True]), "position 1 is True"),
        (dict(prompt=[[1, 2], [3, 4]]), "nested"),
        (dict(prompt=np.ones((2, 3), np.int64)), "shape \\(2, 3\\)"),
        (dict(prompt=np.ones(3, np.float32)), "dtype float32"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=[3, 300]), "token id 300"),
        (dict(prompt=[-1]), "token id -1"),
        (dict(prompt=good, sampling=dict(temperature=1.0)), "sampling="),
        (dict(prompt=good, stop_token_ids=[1.5]), "stop_token_ids holds 1.5"),
    ]
    for kwargs, message in bad_requests:
        with pytest.raises(ValueError, match=message):
            llm.add_request(**kwargs)
    # a list of Python ints is copied, not kept; numpy ints (in a list or an array) come back as Python ints
    assert llm.encode(good) == good and llm.encode(good) is not good
    mixed = llm.encode([np.int64(3), 4, np.uint8(5)])
    assert mixed == [3, 4, 5] and {type(t) for t in mixed} == {int}
    assert {type(t) for t in llm.encode(np.asarray(good, np.uint16))} == {int}
    # numpy ints are ints; among bad requests, the good ones run
    outputs = llm.generate([good, [1.0], np.asarray(good, np.int32)], max_new_tokens=MAX_NEW)
    assert outputs[0].token_ids == outputs[2].token_ids == alone(llm, good)
    assert outputs[1].finish_reason == "error" and "1.0" in outputs[1].error
    assert_idle(llm)


def poisoned(row):
    """A request's pick from `ModelRunner.execute` as if its logits were all NaN."""
    return row._replace(non_finite=row.vocab)


def test_nan_logits_and_a_raising_sampler_fail_only_their_request(llm, monkeypatch):
    prompts = {name: random_prompt(n, 200 + n) for name, n in (("nan", 5), ("raise", 7), ("ok", 9), ("ok2", 30))}
    ids = {llm.add_request(p, max_new_tokens=MAX_NEW, request_id=name): p for name, p in prompts.items()}
    execute, sample = llm.runner.execute, dsv4.engine.sample
    poisoned_rng = llm._live["raise"].rng

    def nan_execute(plan):
        out = execute(plan)
        if "nan" in out:
            out["nan"] = poisoned(out["nan"])
        return out

    def raising_sample(logits, params, rng):
        if rng is poisoned_rng:
            raise FloatingPointError("Probabilities contain NaN")
        return sample(logits, params, rng)

    monkeypatch.setattr(llm.runner, "execute", nan_execute)
    monkeypatch.setattr(dsv4.engine, "sample", raising_sample)
    run(llm)
    outputs = {name: llm.get_output(name) for name in ids}
    assert "not finite" in outputs["nan"].error and "Probabilities contain NaN" in outputs["raise"].error
    assert check(llm, ids) == {"nan": "error", "raise": "error", "ok": "length", "ok2": "length"}


class _Tokenizer:
    """Token ids as words; decoding a text that holds `bad` raises, and `hook` runs on every decode."""

    def __init__(self, bad: int, hook=None):
        self.bad, self.hook = bad, hook

    def encode(self, text, chat_template=True):
        return [int(w) for w in text.split()]

    def decode(self, ids):
        if self.hook is not None:
            self.hook()
        if self.bad in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return " ".join(map(str, ids))


def test_a_failing_detokenizer_fails_only_its_request(llm, monkeypatch):
    prompts = [random_prompt(n, 300 + n) for n in (4, 11, 6)]
    bad = alone(llm, prompts[1])[-1]
    assert bad not in alone(llm, prompts[0]) + alone(llm, prompts[2])
    monkeypatch.setattr(llm, "tokenizer", _Tokenizer(bad))
    outputs = llm.generate(prompts, max_new_tokens=MAX_NEW)
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert "decoding the text failed" in outputs[1].error and outputs[1].token_ids == alone(llm, prompts[1])
    assert outputs[0].text == " ".join(map(str, alone(llm, prompts[0])))
    assert_idle(llm)


@pytest.mark.parametrize("phase", ["waiting", "mid_prefill", "in_execute", "in_sampling", "in_detokenize"])
def test_cancel_in_every_phase(llm, monkeypatch, phase):
    """The victim (a 40-token prompt: two prefill chunks) is cancelled in `phase`; the others are unaffected."""
    prompts = {llm.add_request(p, max_new_tokens=MAX_NEW): p for p in [random_prompt(n, 400 + n) for n in (3, 40, 8)]}
    victim = list(prompts)[1]
    done = [False]

    def cancel_once():
        if not done[0] and llm.get_output(victim) is not None and not llm.get_output(victim).finished:
            done[0] = True
            assert llm.cancel(victim)

    execute, sample = llm.runner.execute, dsv4.engine.sample
    if phase == "waiting":
        cancel_once()
    elif phase == "mid_prefill":
        llm.step()
        assert llm.progress(victim) == (32, 40)
        cancel_once()
    elif phase == "in_execute":
        monkeypatch.setattr(llm.runner, "execute", lambda plan: (cancel_once(), execute(plan))[1])
    elif phase == "in_sampling":
        monkeypatch.setattr(dsv4.engine, "sample", lambda *a: (cancel_once(), sample(*a))[1])
    else:
        monkeypatch.setattr(llm, "tokenizer", _Tokenizer(-1, hook=cancel_once))
    run(llm)
    assert done[0]
    assert check(llm, prompts)[victim] == "cancelled"


def test_preemption_under_a_tiny_pool_with_a_fault(llm, monkeypatch):
    """All but 5 pages held outside the engine, so requests preempt each other (recompute); a fault hits a step in
    the middle. Survivors give their alone tokens; every page comes back."""
    held = llm.pool.allocate(llm.pool.num_free - 5)
    try:
        prompts = {llm.add_request(p, max_new_tokens=MAX_NEW): p
                   for p in [random_prompt(n, 500 + n) for n in (37, 30, 20, 3, 12)]}  # fmt: skip
        execute, steps = llm.runner.execute, [0]

        def faulty(plan):
            steps[0] += 1
            if steps[0] == 6:
                raise RuntimeError("injected")
            return execute(plan)

        monkeypatch.setattr(llm.runner, "execute", faulty)
        preemptions = 0
        for _ in range(1000):
            if not llm.has_unfinished_requests():
                break
            for event in llm.step():
                if event.output is not None:
                    preemptions += event.output.metrics.num_preemptions
        assert preemptions > 0
        reasons = {rid: llm.get_output(rid).finish_reason for rid in prompts}
    finally:
        llm.pool.free(held)
    assert "error" in reasons.values() and "length" in reasons.values()
    check(llm, prompts)


def test_logprobs_are_the_log_softmax_of_the_logits(llm, monkeypatch):
    """The chosen token's log-probability and the k most likely, against the float64 log_softmax of the float32
    logits the step's call made (drawn on the device in float32: within 1e-5)."""
    prompt = random_prompt(9, 600)
    want_tokens = alone(llm, prompt, 3)
    rows, programs, rid = [], llm.runner._programs, []

    def recording(step):
        def call(*args):
            logits, cache = step(*args)
            row = 0 if logits.shape[0] == 1 else llm.runner.slot_of(rid[0])  # a packed call's rows are the slots
            rows.append(np.asarray(logits, np.float64)[row])
            return logits, cache

        return call

    for name in ("slot_step", "packed_step"):
        monkeypatch.setattr(programs, name, recording(getattr(programs, name)))
    rid.append(llm.add_request(prompt, max_new_tokens=3, sampling=SamplingParams(logprobs=3)))
    while llm.has_unfinished_requests():
        llm.step()
    out = llm.pop_output(rid[0])
    assert out.token_ids == want_tokens and len(out.logprobs) == len(out.top_logprobs) == len(rows) == 3
    for token, lp, top, row in zip(out.token_ids, out.logprobs, out.top_logprobs, rows):
        want = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert lp == pytest.approx(want[token], abs=1e-5)
        assert [t for t, _ in top] == np.argsort(-want)[:3].tolist() and top[0][0] == token  # greedy: the top one
        assert [v for _, v in top] == pytest.approx(np.sort(want)[::-1][:3], abs=1e-5)
    monkeypatch.undo()
    (none,) = llm.generate([prompt], max_new_tokens=1)
    assert none.logprobs is None and none.top_logprobs is None
    events = list(llm.stream([prompt], max_new_tokens=2, sampling=SamplingParams(logprobs=0)))
    assert all(e.logprob is not None and e.top_logprobs == () for e in events)
    assert events[-1].output.logprobs == [e.logprob for e in events]
    assert_idle(llm)


def test_soak_500_requests_with_faults_and_cancellations(llm, monkeypatch):
    """500 short requests (16 distinct prompts, 1-4 new tokens) arriving over time; 10% poisoned (a step fault
    before or after the device call, a consumed cache, NaN logits or a raising sampler, each once) and 10% cancelled
    at a random moment. 0 wedged steps, 0 leaked pages or slots, every survivor's tokens equal its alone tokens,
    every failure an "error" with a message."""
    rng = random.Random(0)
    pool = [random_prompt(rng.randint(1, 8), 700 + i) for i in range(16)]
    for prompt in pool:
        alone(llm, prompt)
    execute, sample = llm.runner.execute, dsv4.engine.sample
    poison: dict[str, str] = {}  # request id → fault, removed once it has fired
    poisoned_rngs: dict[int, str] = {}

    def faulty_execute(plan):
        ids = [c.request_id for c in plan.chunks]
        kinds = {poison[r]: r for r in ids if r in poison}
        for kind in ("before", "consume"):
            if kind in kinds:
                del poison[kinds[kind]]
                if kind == "consume":
                    _consume_cache(llm)
                raise RuntimeError(f"injected {kind}")
        out = execute(plan)
        if "after" in kinds:
            del poison[kinds["after"]]
            raise RuntimeError("injected after")
        for r in ids:
            if poison.get(r) == "nan" and r in out:
                del poison[r]
                out[r] = poisoned(out[r])
        return out

    def faulty_sample(logits, params, rng_):
        r = poisoned_rngs.pop(id(rng_), None)
        if r is not None and poison.pop(r, None) == "sample":
            raise ValueError("injected sample")
        return sample(logits, params, rng_)

    monkeypatch.setattr(llm.runner, "execute", faulty_execute)
    monkeypatch.setattr(dsv4.engine, "sample", faulty_sample)
    prompts, max_new, steps, cancelled = {}, {}, 0, 0
    while len(prompts) < 500 or llm.has_unfinished_requests():
        for _ in range(rng.choice((0, 1, 1, 2, 3)) if len(prompts) < 500 else 0):
            prompt, n = rng.choice(pool), rng.randint(1, MAX_NEW)
            request_id = llm.add_request(prompt, max_new_tokens=n)
            prompts[request_id], max_new[request_id] = prompt, n
            if rng.random() < 0.1:
                poison[request_id] = rng.choice(("before", "after", "consume", "nan", "sample"))
                if poison[request_id] == "sample":
                    poisoned_rngs[id(llm._live[request_id].rng)] = request_id
        live = [r for r in prompts if llm.get_output(r) is not None and not llm.get_output(r).finished]
        for request_id in live:
            if rng.random() < 0.1 / (MAX_NEW + 1):
                cancelled += llm.cancel(request_id)
        llm.step()
        steps += 1
        assert steps < 5000, "wedged"
    reasons = check(llm, prompts, max_new)
    counts = {reason: list(reasons.values()).count(reason) for reason in set(reasons.values())}
    assert counts["error"] >= 25 and counts["cancelled"] >= 15 and counts["length"] >= 250, counts


def test_low_level_calls_check_their_token_ids(llm):
    """`model.decode` / `prefill_chunk` refuse bad ids before anything runs (no compilation needed to see it)."""
    cache = llm.model.init_cache(batch=2, max_len=32)
    for bad, message in (([300, 1], "token id 300"), ([-1, 1], "token id -1"), ([1.0, 2.0], "dtype float64"),
                         ([[1], [2]], "shape \\[2, 1\\]"), ([1], "the cache has 2 slots")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.model.decode(cache, np.array(bad))
    with pytest.raises(ValueError, match="prefill_chunk: valid lengths"):
        llm.model.prefill_chunk(cache, np.ones((2, 3), np.int32), np.array([4, 1]))


def test_non_finite_weights_are_named(tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    import dsv4

    shutil.copytree(MODEL_DIR, tmp_path / "m")
    (name,) = [f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors")]
    tensors = load_file(tmp_path / "m" / name)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].copy()
    tensors["model.norm.weight"][3] = np.inf
    save_file(tensors, tmp_path / "m" / name)
    with pytest.raises(ValueError, match="tensor model.norm.weight in .* holds 1 non-finite"):
        dsv4.load(tmp_path / "m", dtype="float32")
    dsv4.load(tmp_path / "m", dtype="float32", check_finite_weights=False)
