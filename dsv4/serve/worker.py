"""The engine thread: the one thread that touches the `LLM`.

HTTP handlers never call the engine. They `submit` a `Job` and `cancel` request ids through one thread-safe
queue; the thread drains it between steps (so `add_request` / `cancel` happen only between `update` and the next
`schedule`, as the scheduler requires), runs `LLM.step()` while anything is unfinished, and posts each job's
events back through the job's `post` callable (the server makes it `loop.call_soon_threadsafe(queue.put_nowait,
...)`). A step's tokens, one per running request, go out together through `deliver(batch)` when the worker has
one: the server hands the whole batch to its event loop in one wake-up instead of one per stream. "accepted" then
waits for the request's first step and goes out with that step's batch: on a machine whose cores the step's
computation uses, the loop and the client would otherwise do their work (response headers) during the prefill and
slow it. Events, as tuples:

    ("accepted",)                                          queued in the engine
    ("rejected", message)                                  add_request refused it (a 400)
    ("token", token_id, logprob, top_logprobs, finish_reason, output)   one token; output on the last one
    ("finished", finish_reason, output)                    ended without a token: cancelled at shutdown
    ("error", message)                                     the engine failed (a 500)

A long prefill logs its progress every `log_interval_s`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("dsv4.serve")


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: object  # dsv4.generate.SamplingParams
    stop_token_ids: frozenset[int]
    post: Callable[[tuple], None]
    """Hands one event to the job's consumer; called from the engine thread."""
    put: Callable[[tuple], None] | None = None
    """The consumer's own enqueue, for a `deliver` that runs on the consumer's side (the server's event loop)."""
    arrival_time: float = field(default_factory=time.perf_counter)
    # engine-thread bookkeeping
    prefilled: int = 0
    num_tokens: int = 0
    last_log: float = 0.0


class EngineWorker:
    def __init__(self, llm, metrics=None, *, log_interval_s: float = 1.0,
                 deliver: Callable[[list[tuple[Job, tuple]]], None] | None = None) -> None:  # fmt: skip
        self.llm = llm
        self.deliver = deliver
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._held: list[tuple[Job, tuple]] = []  # "accepted" events waiting for the next step's batch
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self.failed: BaseException | None = None

    # ----- any thread --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._inbox.put(("add", job))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Cancels whatever is still live (each job gets a "finished" event), then ends the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ----- the engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain(block=not self.llm.has_unfinished_requests()):
                if self.llm.has_unfinished_requests():
                    self._step()
                self._update_gauges()
        except BaseException as e:  # the loop itself broke: say so to everyone waiting, then stop
            self.failed = e
            log.exception("engine thread failed")
        finally:
            self._send([])
            for request_id in list(self._jobs):
                self._cancel(request_id, notify=True)
            self._update_gauges()

    def _drain(self, *, block: bool) -> bool:
        """Applies queued submissions and cancellations; False once asked to stop."""
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(item)
            elif kind == "cancel":
                self._cancel(item, notify=False)

    def _add(self, job: Job) -> None:
        try:
            self.llm.add_request(
                job.prompt_ids,
                max_new_tokens=job.max_tokens,
                sampling=job.sampling,
                stop_token_ids=job.stop_token_ids,
                request_id=job.request_id,
                arrival_time=job.arrival_time,
            )
        except ValueError as e:
            job.post(("rejected", str(e)))
            return
        self._jobs[job.request_id] = job
        job.last_log = time.perf_counter()
        if self.deliver is not None:
            self._held.append((job, ("accepted",)))
        else:
            job.post(("accepted",))

    def _send(self, posts: list[tuple[Job, tuple]]) -> None:
        """Held "accepted" events first, then `posts`, in order."""
        posts, self._held = self._held + posts, []
        if not posts:
            return
        if self.deliver is not None:
            self.deliver(posts)
            return
        for job, item in posts:
            job.post(item)

    def _cancel(self, request_id: str, *, notify: bool) -> None:
        self._send([])  # a held "accepted" goes before anything else this request hears
        job = self._jobs.pop(request_id, None)
        if job is None:
            return  # finished already, or never admitted
        try:
            self.llm.cancel(request_id)
        except Exception:
            log.exception("cancelling %s failed", request_id)
        output = self.llm.pop_output(request_id)
        self._observe("cancelled", output)
        if notify:
            job.post(("finished", "cancelled", output))

    def _step(self) -> None:
        try:
            events = self.llm.step()
        except Exception as e:
            self._send([])
            log.exception("engine step failed; failing the %d live requests", len(self._jobs))
            for request_id, job in list(self._jobs.items()):
                job.post(("error", f"the engine failed: {type(e).__name__}: {e}"))
                self._cancel(request_id, notify=False)
            return
        if self.metrics is not None:
            self.metrics.steps.inc()
        now = time.perf_counter()
        posts = []  # sent after the gauges are updated, so a client that hears "done" sees the pages freed
        for event in events:
            job = self._jobs.get(event.request_id)
            if job is None:
                continue  # cancelled while its token was in flight
            if event.token_id is None:
                self._jobs.pop(event.request_id)
                self.llm.pop_output(event.request_id)
                error = getattr(event.output, "error", None) or "the engine refused the request"
                posts.append((job, ("error", error)))
                self._observe("error", None)
                continue
            job.num_tokens += 1
            if self.metrics is not None:
                self.metrics.generation_tokens.inc()
                if job.prefilled < len(job.prompt_ids):  # a token means the whole prompt is in the cache
                    self.metrics.prefill_tokens.inc(len(job.prompt_ids) - job.prefilled)
            job.prefilled = len(job.prompt_ids)
            if job.num_tokens == 1 and len(job.prompt_ids) > self.llm.chunk_size:
                log.info(
                    "%s: prefill of %d tokens done, first token after %.3f s",
                    job.request_id,
                    len(job.prompt_ids),
                    now - job.arrival_time,
                )
            logprob = getattr(event, "logprob", None)
            top = getattr(event, "top_logprobs", None)
            output = None
            if event.finish_reason is not None:
                self._jobs.pop(event.request_id)
                output = self.llm.pop_output(event.request_id) or event.output
                self._observe(event.finish_reason, output)
            posts.append((job, ("token", event.token_id, logprob, top, event.finish_reason, output)))
        self._account_prefill(now)
        self._update_gauges()
        self._send(posts)

    def _account_prefill(self, now: float) -> None:
        """Prefill tokens done this step (a counter), and a progress line for long prefills."""
        for job in self._jobs.values():
            progress = self.llm.progress(job.request_id)
            if progress is None:
                continue
            done, total = progress
            if done > job.prefilled and self.metrics is not None:
                self.metrics.prefill_tokens.inc(done - job.prefilled)
            job.prefilled = done
            if total > self.llm.chunk_size and 0 < done < total and now - job.last_log >= self.log_interval_s:
                job.last_log = now
                log.info(
                    "%s: prefill %d/%d tokens (%.0f%%), %.1f s since arrival",
                    job.request_id,
                    done,
                    total,
                    100 * done / total,
                    now - job.arrival_time,
                )

    def _observe(self, finish_reason: str, output) -> None:
        m = self.metrics
        if m is None:
            return
        m.requests.labels(finish_reason=finish_reason).inc()
        if output is None:
            return
        metrics = output.metrics
        if finish_reason != "cancelled" or metrics.first_token_time is not None:
            if metrics.ttft_s is not None:
                m.ttft.observe(metrics.ttft_s)
            if metrics.tpot_s is not None:
                m.tpot.observe(metrics.tpot_s)
        if metrics.e2e_s is not None:
            m.e2e.observe(metrics.e2e_s)
        if metrics.num_preemptions:
            m.preemptions.inc(metrics.num_preemptions)

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        scheduler, pool = self.llm.scheduler, self.llm.pool
        m.running.set(len(scheduler.running))
        m.waiting.set(len(scheduler.waiting))
        m.kv_pages_total.set(pool.num_usable_blocks)
        m.kv_pages_free.set(pool.num_free)
        m.kv_pages_used.set(pool.num_usable_blocks - pool.num_free)
