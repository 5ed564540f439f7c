"""`dsv4 serve`: an OpenAI-compatible HTTP server over one `dsv4.LLM` (aiohttp).

    POST /v1/completions, POST /v1/chat/completions   whole responses, or SSE with "stream": true
    GET /v1/models, GET /health, GET /metrics (Prometheus)

Threads: the asyncio loop (HTTP) and the engine thread (`EngineWorker`), which alone touches the engine. A handler
validates the body (`protocol`), submits a `Job` whose events come back through an asyncio queue, and writes them
out. A client that goes away (aiohttp's handler cancellation, or a failed write) cancels its request: its pages are
freed at the engine's next step boundary. SIGTERM / SIGINT: stop taking requests (503), let the running ones finish
for up to --shutdown-timeout seconds, cancel the rest (their streams end with finish_reason "cancelled"), exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

from aiohttp import web

from dsv4.memory_plan import default_chunk_size, default_max_model_len
from dsv4.serve import protocol
from dsv4.serve.metrics import ServerMetrics
from dsv4.serve.protocol import OutputBuilder, RequestError, ServeContext
from dsv4.serve.worker import EngineWorker, Job

log = logging.getLogger("dsv4.serve")

STATE = web.AppKey("state", object)
PARSE_INLINE_MAX_BYTES = 64 * 1024
"""Bodies above this are parsed (JSON, validation, tokenization) on a worker thread: a 128K-token prompt takes tens
of milliseconds, which on the event loop would hold back every stream's next chunk."""
MIXED_CHUNK_DIVISOR = 4
"""`dsv4 serve`'s default --mixed-chunk-size is the chunk size over this."""


class ServerState:
    def __init__(self, worker: EngineWorker, ctx: ServeContext, metrics: ServerMetrics) -> None:
        self.worker, self.ctx, self.metrics = worker, ctx, metrics
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())


def _error(status: int, message: str, *, param=None, type="invalid_request_error", code=None) -> web.Response:
    return web.json_response(protocol.error_body(message, param=param, type=type, code=code), status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    state: ServerState = request.app[STATE]
    try:
        response = await handler(request)
    except RequestError as e:
        response = web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:  # 404 / 405 from routing, 413 from the body limit
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        response = _error(e.status, f"{e.reason}: {request.method} {request.path}", type=kind)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        response = _error(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
    if response.status >= 400 and isinstance(response, web.Response):
        state.metrics.rejected.labels(status=str(response.status)).inc()
    return response


def _parse(raw: bytes, parse, ctx: ServeContext):
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    return parse(body, ctx)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    if state.draining:
        return _error(503, "the server is shutting down", type="server_error", code="shutting_down")
    raw = await request.read()
    parse = protocol.parse_chat if kind == "chat" else protocol.parse_completion
    if len(raw) > PARSE_INLINE_MAX_BYTES:  # a long prompt: decode, check and tokenize it without stalling the streams
        req = await asyncio.to_thread(_parse, raw, parse, state.ctx)
    else:
        req = _parse(raw, parse, state.ctx)

    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def post(item: tuple) -> None:  # called from the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    request_id = protocol.new_id(kind)
    job = Job(request_id, req.prompt_ids, req.max_tokens, req.sampling_params(), req.stop_token_ids, post,
              put=events.put_nowait)  # fmt: skip
    out = OutputBuilder(req, state.ctx.tokenizer)
    state.in_flight += 1
    done = False
    try:
        state.worker.submit(job)
        first = await events.get()
        if first[0] == "rejected":
            done = True
            return _error(400, first[1], param="prompt" if kind == "completion" else "messages")
        if first[0] == "error":
            done = True
            return _error(500, first[1], type="server_error")
        if req.stream:
            try:
                response = await _stream(request, state, request_id, req, out, events)
            except ConnectionResetError:  # the client went away mid-stream
                log.debug("%s: client disconnected", request_id)
                return web.Response(status=499)
        else:
            while not out.finished:
                _apply(out, await events.get())
            response = _whole(state, request_id, req, out)
        done = True
        return response
    finally:
        state.in_flight -= 1
        if not done or out.stop_hit:
            state.worker.cancel(request_id)  # the client left, or a stop string ended it: free its slot and pages


def _apply(out: OutputBuilder, item: tuple) -> None:
    kind = item[0]
    if kind == "token":
        _, token_id, logprob, top, finish_reason, _output = item
        out.add_token(token_id, logprob, top, finish_reason)
    elif kind == "finished":
        out.finish(item[1])
    elif kind == "error":
        raise RuntimeError(item[1])


def _whole(state: ServerState, request_id: str, req, out: OutputBuilder) -> web.Response:
    build = protocol.chat_response if req.kind == "chat" else protocol.completion_response
    return web.json_response(build(request_id, state.ctx.model_name, protocol.now(), out, state.ctx.tokenizer))


async def _stream(
    request, state: ServerState, request_id: str, req, out: OutputBuilder, events: asyncio.Queue
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    model, created, tok = state.ctx.model_name, protocol.now(), state.ctx.tokenizer

    async def send(obj) -> None:
        await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    first = True
    if req.kind == "chat":  # the role first, as OpenAI does
        await send(protocol.stream_chunk(request_id, model, created, out, tok, first=True))
        first = False
    while not out.finished:
        item = await events.get()
        try:
            _apply(out, item)
            while not out.finished and not events.empty():  # a slow reader gets several tokens per chunk
                _apply(out, events.get_nowait())
        except RuntimeError as e:  # the engine failed mid-stream: say so in the stream, then end it
            await send(protocol.error_body(str(e), type="server_error"))
            out.finish("error")
            break
        await send(protocol.stream_chunk(request_id, model, created, out, tok, first=first))
        first = False
    if req.include_usage:
        await send(protocol.usage_chunk(request_id, model, created, out))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def handle_models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    ctx = state.ctx
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "dsv4",
        "max_model_len": ctx.max_model_len,
        "vocab_size": ctx.vocab_size,
    }
    return web.json_response({"object": "list", "data": [card]})


async def handle_health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    if state.draining or not state.worker.alive:
        return web.json_response({"status": "unavailable"}, status=503)
    return web.json_response({"status": "ok"})


async def handle_metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def make_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors_as_json], client_max_size=256 * 1024**2)
    app[STATE] = state
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    return app


def context_for(llm, model_name: str) -> ServeContext:
    eos = llm.config.eos_token_id
    eos_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
    return ServeContext(
        model_name=model_name,
        max_model_len=llm.max_model_len,
        vocab_size=llm.config.vocab_size,
        tokenizer=llm.tokenizer,
        eos_token_ids=eos_ids,
        logprobs_supported=protocol.logprobs_supported(),
    )


def _deliver_on(loop: asyncio.AbstractEventLoop):
    """A step's events, handed to the loop in one wake-up (called from the engine thread)."""

    def dispatch(batch) -> None:
        for job, item in batch:
            job.put(item)

    def deliver(batch) -> None:
        try:
            loop.call_soon_threadsafe(dispatch, batch)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    return deliver


async def serve(llm, *, host: str, port: int, model_name: str, shutdown_timeout: float = 30.0) -> None:
    """Serves until SIGTERM / SIGINT, then shuts down gracefully."""
    metrics = ServerMetrics()
    worker = EngineWorker(llm, metrics, deliver=_deliver_on(asyncio.get_running_loop()))
    state = ServerState(worker, context_for(llm, model_name), metrics)
    worker.start()
    runner = web.AppRunner(make_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    log.info("serving %s on http://%s:%d (OpenAI API under /v1; /health, /metrics)", model_name, bound[0], bound[1])

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    state.draining = True
    log.info("shutting down: %d request(s) in flight, waiting up to %.0f s for them", state.in_flight, shutdown_timeout)
    deadline = loop.time() + shutdown_timeout
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.info("cancelling %d request(s) still in flight", state.in_flight)
    await loop.run_in_executor(None, worker.stop, 30.0)  # cancels what is left; its streams end "cancelled"
    deadline = loop.time() + 5
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)
    await runner.cleanup()
    log.info("stopped")


def build_llm(args):
    """The engine `dsv4 serve` runs for these arguments (also what scripts/bench_serve_overhead.py compares it with)."""
    from dsv4.config import Config

    config = Config.from_hf(args.model) if os.path.isdir(args.model) else Config.preset(args.model)
    max_model_len = default_max_model_len(config)
    if args.chunk_size is None:
        args.chunk_size = default_chunk_size(args.max_model_len or max_model_len, args.devices)
    if args.mixed_chunk_size is None:
        # Clients stream tokens: while one of them decodes, a long prompt prefills in quarter chunks, so the others'
        # inter-token latency stays near a quarter chunk's step (docs/BENCHMARKS.md, "Serving").
        args.mixed_chunk_size = max(1, args.chunk_size // MIXED_CHUNK_DIVISOR)
    return args.make_llm(args, max_slots=8, max_model_len=max_model_len)


def cmd_serve(args) -> int:
    """`dsv4 serve MODEL ...`; args come from `dsv4.serve.add_serve_arguments` and args.make_llm builds the engine
    (dsv4.cli's `_make_llm`: the engine options, --devices N as a mesh)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing is not news
    t0 = time.perf_counter()
    llm = build_llm(args)
    log.info(
        "loaded %s in %.1f s: %d slots of %d tokens, chunk %d, mixed-step prefill %d, %d KV pages of %d tokens%s",
        args.model,
        time.perf_counter() - t0,
        llm.runner.max_slots,
        llm.max_model_len,
        llm.chunk_size,
        args.mixed_chunk_size,
        llm.pool.num_usable_blocks,
        llm.page_size,
        f", mesh of {args.devices} devices" if llm.mesh is not None else "",
    )
    if not args.no_warmup:
        seconds = llm.warmup(widths=llm.runner.width_buckets)
        log.info("compiled %d chunk widths in %.1f s", len(llm.runner.width_buckets), seconds)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    asyncio.run(serve(llm, host=args.host, port=args.port, model_name=name, shutdown_timeout=args.shutdown_timeout))
    return 0
