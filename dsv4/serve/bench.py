"""`dsv4 bench serve`: a load generator for any OpenAI-compatible server, over streaming /v1/completions (or
/v1/chat/completions with --endpoint chat).

Requests arrive as a Poisson process at --request-rate per second (inf: a burst, all at t = 0), optionally capped at
--max-concurrency in flight. Prompt lengths are uniform in input_len × [1 - range, 1 + range]; prompts are random
token ids (the server must take token-id prompts, as dsv4 serve and vLLM do; the vocabulary comes from the model
card's vocab_size or --vocab-size) or, with --prompt-kind words, random words (about one token each) for any
server. --long-prompt-len adds one long prompt at t = 0, first measured alone: its TTFT with the load against alone,
and how many tokens the other requests got during its prefill, show whether short requests make progress while a
long prompt prefills (what chunked prefill with prefill priority is for).

Per request: TTFT (send → first streamed token), ITL (gaps between streamed chunks), TPOT ((last - first) /
(tokens - 1)); output tokens from the final usage chunk (stream_options.include_usage). Goodput counts the requests
within every SLO given (--slo-ttft-ms, --slo-tpot-ms). This module imports aiohttp only when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but "
    "one all their they has have been its new who more after also two first other than into some time would "
    "only over such about can out most when there these many may years later city school state world"
).split()


def _count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    try:
        return int(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 1024, 32k or 1m") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    p.add_argument(
        "--endpoint",
        default="completions",
        choices=["completions", "chat"],
        help="/v1/completions (default) or /v1/chat/completions (text prompts)",
    )
    p.add_argument("--model", default=None, help="model id to send (default: the server's first in /v1/models)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrivals per second, Poisson; inf = all at once (default inf)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=_count, default=256, help="mean prompt tokens (default 256)")
    p.add_argument(
        "--input-len-range",
        type=float,
        default=0.0,
        help="uniform spread of prompt lengths, a fraction of --input-len (default 0: all equal)",
    )
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument(
        "--prompt-kind",
        default="token-ids",
        choices=["token-ids", "words"],
        help="token-id prompts (dsv4 serve, vLLM) or random words (any server); default token-ids",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids are drawn from [0, this) (default: the model card's vocab_size)",
    )
    p.add_argument(
        "--long-prompt-len",
        type=_count,
        default=None,
        help="also send one prompt this long at t = 0 (e.g. 131072), measured alone first",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that refuse it; outputs may then end early)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take (default 3600)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times (default 0)")
    p.add_argument("--json-out", default=None, help="also write the results (summary and per request) here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


@dataclass
class Result:
    index: int
    prompt_len: int
    sent: float = 0.0  # perf_counter seconds
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    long: bool = False

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def make_prompt(rng: random.Random, length: int, kind: str, vocab: int | None, chat: bool):
    if kind == "token-ids" and not chat:
        return [rng.randrange(vocab) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))


@dataclass
class Workload:
    """The prompts and arrival gaps of one run: a function of the arguments and the seed alone, so another driver
    (scripts/bench_serve_overhead.py feeds the same requests to the engine in process) replays exactly this."""

    lo: int
    hi: int
    lengths: list[int]
    prompts: list
    gaps: list[float]  # seconds between arrivals; the first request arrives after gaps[0]
    warm_prompt: object
    long_prompt: object | None


def make_workload(args, vocab: int | None, chat: bool) -> Workload:
    rng = random.Random(args.seed)
    lo = max(1, round(args.input_len * (1 - args.input_len_range)))
    hi = max(lo, round(args.input_len * (1 + args.input_len_range)))
    lengths = [rng.randint(lo, hi) for _ in range(args.num_prompts)]
    prompts = [make_prompt(rng, n, args.prompt_kind, vocab, chat) for n in lengths]
    gaps = [0.0 if math.isinf(args.request_rate) else rng.expovariate(args.request_rate) for _ in prompts]
    warm = make_prompt(rng, lo, args.prompt_kind, vocab, chat)
    long = make_prompt(rng, args.long_prompt_len, args.prompt_kind, vocab, chat) if args.long_prompt_len else None
    return Workload(lo, hi, lengths, prompts, gaps, warm, long)


async def _one(http, url: str, body: bytes, result: Result, timeout: float) -> Result:
    import aiohttp

    result.sent = time.perf_counter()
    try:
        async with http.post(url, data=body, headers=_JSON, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                text = await response.text()
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                result.error = f"HTTP {response.status}: {text}"
                return result
            chunks = 0
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message"))
                    return result
                now = time.perf_counter()
                if obj.get("usage"):
                    result.output_tokens = obj["usage"].get("completion_tokens", chunks)
                choices = obj.get("choices") or []
                if not choices:
                    continue
                delta = choices[0].get("delta")
                if delta is not None and set(delta) == {"role", "content"} and not delta["content"] and not chunks:
                    continue  # the chat role chunk carries no token
                chunks += 1
                result.chunk_times.append(now)
                if result.ttft is None:
                    result.ttft = now - result.sent
            result.e2e = time.perf_counter() - result.sent
            if not result.output_tokens:
                result.output_tokens = chunks
            result.ok = result.ttft is not None
            if not result.ok:
                result.error = "no token came back"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


SERVER_GAUGES = ("dsv4_num_requests_running", "dsv4_num_requests_waiting", "dsv4_kv_pages_used")


async def _server_state(http, base: str) -> dict[str, float]:
    """dsv4 serve's gauges once the run is over (nothing running, no KV page held: no leak); {} elsewhere."""
    import aiohttp

    try:
        async with http.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text() if r.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERVER_GAUGES:
            values[name] = float(value)
    return values


_JSON = {"Content-Type": "application/json"}


def _body(args, model: str, prompt) -> bytes:
    """The request's JSON, encoded before its clock starts: a 128K-token prompt's array takes the client tens of
    milliseconds to encode, which is neither the server's time nor the network's (nor would it delay later arrivals)."""
    body = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


def summarize(results: list[Result], duration: float, args) -> dict:
    done = [r for r in results if r.ok]
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    itl = [gap for r in done for gap in r.itl]
    e2e = [r.e2e for r in done]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)

    def good(r: Result) -> bool:
        if args.slo_ttft_ms is not None and r.ttft * 1e3 > args.slo_ttft_ms:
            return False
        return not (args.slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1e3 > args.slo_tpot_ms)

    n_good = sum(1 for r in done if good(r))
    summary = {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "goodput_requests_per_s": n_good / duration,
        "goodput_fraction": n_good / len(results) if results else 0.0,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        summary[f"{name}_mean_ms"] = sum(values) / len(values) * 1e3 if values else None
        for q in (50, 90, 99):
            value = percentile(values, q)
            summary[f"{name}_p{q}_ms"] = None if value is None else value * 1e3
    errors = [r.error for r in results if r.error]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def format_table(summary: dict, long_info: dict | None) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"{'requests completed / sent':<34} {summary['completed']} / {summary['requests']}",
        f"{'duration (s)':<34} {summary['duration_s']:.2f}",
        f"{'input / output tokens':<34} {summary['input_tokens']} / {summary['output_tokens']}",
        f"{'requests/s':<34} {summary['request_throughput']:.2f}",
        f"{'output tokens/s':<34} {summary['output_throughput']:.1f}",
        f"{'total tokens/s':<34} {summary['input_throughput'] + summary['output_throughput']:.1f}",
    ]
    if summary["slo_ttft_ms"] is not None or summary["slo_tpot_ms"] is not None:
        lines.append(
            f"{'goodput (requests/s within SLOs)':<34} {summary['goodput_requests_per_s']:.2f} "
            f"({summary['goodput_fraction']:.0%} of requests)"
        )
    lines += ["", f"{'ms':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        lines.append(
            f"{name.upper():<6} "
            + " ".join(f"{ms(summary[f'{name}_{k}_ms']):>9}" for k in ("mean", "p50", "p90", "p99"))
        )
    if long_info:
        lines += [
            "",
            f"long prompt ({long_info['prompt_len']} tokens): TTFT alone {ms(long_info['ttft_alone_ms'])} "
            f"ms, under load {ms(long_info['ttft_loaded_ms'])} ms "
            f"(x{long_info['ttft_ratio']:.3f}); during its prefill the other requests got "
            f"{long_info['tokens_during_prefill']} tokens, {long_info['finished_during_prefill']} finished",
        ]
    after = summary.get("server_after")
    if after:
        lines += ["", "server after the run (/metrics): " + ", ".join(f"{k} {v:g}" for k, v in after.items())]
    if summary.get("first_error"):
        lines += ["", f"first error: {summary['first_error']}"]
    return "\n".join(lines)


async def run(args) -> dict:
    import aiohttp

    base = args.base_url.rstrip("/")
    url = f"{base}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        card = {}
        try:
            async with http.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status == 200:
                    card = ((await r.json()).get("data") or [{}])[0]
        except aiohttp.ClientError as e:
            raise ValueError(f"cannot reach {base}: {e}") from None
        model = args.model or card.get("id")
        if model is None:
            raise ValueError(f"{base}/v1/models names no model: pass --model")
        vocab = args.vocab_size or card.get("vocab_size")
        chat = args.endpoint == "chat"
        if args.prompt_kind == "token-ids" and not chat and not vocab:
            raise ValueError(
                "token-id prompts need the vocabulary size: the model card has no vocab_size, so pass "
                "--vocab-size, or use --prompt-kind words"
            )
        limit = card.get("max_model_len")
        work = make_workload(args, vocab, chat)
        for length in (work.hi, args.long_prompt_len or 0):
            if limit and length + args.output_len > limit:
                raise ValueError(
                    f"prompts of {length} tokens + {args.output_len} new exceed the server's max_model_len={limit}"
                )
        lo, hi, lengths, prompts, gaps = work.lo, work.hi, work.lengths, work.prompts, work.gaps
        say = (lambda *a: None) if args.quiet else (lambda msg: print(f"bench serve: {msg}", file=sys.stderr))
        say(
            f"{model} at {base}: {args.num_prompts} requests, rate {args.request_rate}/s, prompts {lo}-{hi} tokens, "
            f"{args.output_len} new"
        )

        # warm-up: one short request, so a server that compiles lazily does so outside the numbers
        warm = await _one(
            http,
            url,
            _body(args, model, work.warm_prompt),
            Result(-1, lo),
            args.timeout,
        )
        if not warm.ok:
            raise ValueError(f"the warm-up request failed: {warm.error}")

        long_info = None
        long_body = None
        if args.long_prompt_len:
            long_body = _body(args, model, work.long_prompt)
            alone = await _one(http, url, long_body, Result(-1, args.long_prompt_len, long=True), args.timeout)
            if not alone.ok:
                raise ValueError(f"the long prompt alone failed: {alone.error}")
            say(f"long prompt alone: TTFT {alone.ttft * 1e3:.1f} ms")
            long_info = {"prompt_len": args.long_prompt_len, "ttft_alone_ms": alone.ttft * 1e3}

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(body, result):
            if semaphore is None:
                return await _one(http, url, body, result, args.timeout)
            async with semaphore:
                return await _one(http, url, body, result, args.timeout)

        tasks = []
        long_task = None
        bodies = [_body(args, model, prompt) for prompt in prompts]
        t0 = time.perf_counter()
        if long_body is not None:
            long_task = asyncio.create_task(
                _one(http, url, long_body, Result(-1, args.long_prompt_len, long=True), args.timeout)
            )
        at = 0.0
        for i, (body, n, gap) in enumerate(zip(bodies, lengths, gaps, strict=True)):
            at += gap
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(body, Result(i, n))))
        results = await asyncio.gather(*tasks)
        long_result = await long_task if long_task is not None else None
        duration = time.perf_counter() - t0
        server_after = await _server_state(http, base)

    summary = summarize(list(results), duration, args)
    if server_after:
        summary["server_after"] = server_after
    summary.update(
        model=model,
        base_url=base,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        input_len=args.input_len,
        input_len_range=args.input_len_range,
        output_len=args.output_len,
    )
    if long_result is not None:
        if not long_result.ok:
            summary["long_prompt_error"] = long_result.error
        else:
            first = long_result.sent + long_result.ttft
            during = [t for r in results if r.ok for t in r.chunk_times if t < first]
            long_info.update(
                ttft_loaded_ms=long_result.ttft * 1e3,
                ttft_ratio=long_result.ttft * 1e3 / long_info["ttft_alone_ms"],
                tokens_during_prefill=len(during),
                finished_during_prefill=sum(1 for r in results if r.ok and r.chunk_times[-1] < first),
            )
        summary["long_prompt"] = long_info
    return {"summary": summary, "requests": [asdict(r) | {"itl": r.itl, "tpot": r.tpot} for r in results]}


def main(args) -> int:
    report = asyncio.run(run(args))
    summary = report["summary"]
    print(
        format_table(
            summary, summary.get("long_prompt") if "ttft_ratio" in (summary.get("long_prompt") or {}) else None
        )
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
