"""The OpenAI-compatible request and response formats: validation of request bodies into engine calls, and the
JSON the server writes back (completions and chat completions, whole or as SSE chunks, and errors).

Validation is strict: an unknown field, a wrong type or an out-of-range value is a 400 naming the field
(`RequestError`). Fields OpenAI defines that the engine does not implement are accepted at their neutral value
(penalties 0, no logit_bias, echo false, best_of 1, ...) and refused otherwise. Extensions, as vLLM spells them:
`top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`.

Stopping: the model's eos_token_id ends a request unless `ignore_eos`; `stop` takes strings (matched in the generated
text here, which is then cut before the match) and token ids (ended by the engine: `stop_token_ids`). A stop token
that ends a request is counted in usage but not written into the text.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from dataclasses import dataclass, field

from dsv4.serve.detokenize import IncrementalDetokenizer

MAX_LOGPROBS = 20
MAX_STOP = 16


class RequestError(Exception):
    """An OpenAI-style error: status, message, the offending field (param) and a code."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(
    message: str, *, param: str | None = None, type: str = "invalid_request_error", code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ServeContext:
    """What validation needs to know about the served model."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None = None  # dsv4.tokenizer.TextTokenizer
    eos_token_ids: frozenset[int] = frozenset()
    logprobs_supported: bool = False


@dataclass
class GenerationRequest:
    kind: str  # "completion" or "chat"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """None: no logprobs; k >= 0: each token's logprob and the top k alternatives."""
    return_token_ids: bool = False

    def sampling_params(self):
        from dsv4.generate import SamplingParams

        extra = {} if self.logprobs is None else {"logprobs": self.logprobs}
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed, **extra)


def logprobs_supported() -> bool:
    """Whether this engine reports logprobs: SamplingParams(logprobs=) and TokenEvent.logprob."""
    from dsv4.engine import TokenEvent
    from dsv4.generate import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    return "logprobs" in fields and "logprob" in TokenEvent._fields


# ----- validation ----------------------------------------------------------------------------------------------

_MISSING = object()

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
    "return_token_ids",
    "logprobs",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "tools",
    "tool_choice",
    "response_format",
}
CHAT_ROLES = ("system", "developer", "user", "assistant")


def _type_name(value) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


class _Body:
    def __init__(self, body, allowed: set[str]) -> None:
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, not {_type_name(body)}")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise RequestError(
                f"unknown field {unknown[0]!r} (this server accepts: {', '.join(sorted(allowed))})", param=unknown[0]
            )
        self.body = body

    def get(self, name: str, kind: str, default=None):
        """kind: "int", "number", "bool", "str", "list", "dict" or "any"; null means the default."""
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "list": isinstance(value, list),
            "dict": isinstance(value, dict),
            "any": True,
        }[kind]
        if not ok:
            want = {
                "int": "an integer",
                "number": "a number",
                "bool": "a boolean",
                "str": "a string",
                "list": "an array",
                "dict": "an object",
            }[kind]
            raise RequestError(f"{name} must be {want}, not {_type_name(value)}", param=name)
        return value


def _neutral(b: _Body, name: str, kind: str, neutral, what: str) -> None:
    """An OpenAI field the engine does not implement: fine at its neutral value, refused otherwise."""
    value = b.get(name, kind, neutral)
    if value != neutral and not (neutral is None and value in ({}, [])):
        raise RequestError(f"{name}={value!r} is not supported by this server ({what})", param=name)


def _check_range(name: str, value, lo=None, hi=None, *, lo_open=False) -> None:
    if value is None:
        return
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        raise RequestError(
            f"{name}={value} is out of range: it must be {' and '.join(s for s in (lo_s, hi_s) if s)}", param=name
        )


def _token_ids(value, name: str, vocab_size: int) -> list[int]:
    if not value:
        raise RequestError(f"{name} is empty", param=name)
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestError(f"{name}[{i}] must be an integer token id, not {_type_name(t)}", param=name)
        if not 0 <= t < vocab_size:
            raise RequestError(f"{name}[{i}]={t} is not a token id of this model (vocab_size={vocab_size})", param=name)
    return list(value)


def _common(
    b: _Body, ctx: ServeContext, prompt_ids: list[int], prompt_param: str, kind: str, max_tokens_default: int | None
) -> GenerationRequest:
    model = b.get("model", "str")
    if model is not None and model != ctx.model_name:
        raise RequestError(
            f"model {model!r} does not exist: this server serves {ctx.model_name!r}",
            param="model",
            status=404,
            code="model_not_found",
        )
    n = b.get("n", "int", 1)
    if n != 1:
        raise RequestError(f"n={n} is not supported: this server returns one choice per request (n=1)", param="n")
    b.get("user", "str")
    _neutral(b, "presence_penalty", "number", 0, "no penalties")
    _neutral(b, "frequency_penalty", "number", 0, "no penalties")
    _neutral(b, "logit_bias", "dict", None, "no logit_bias")

    temperature = b.get("temperature", "number", 1.0)
    _check_range("temperature", temperature, 0, 2)
    top_p = b.get("top_p", "number", 1.0)
    _check_range("top_p", top_p, 0, 1, lo_open=True)
    top_k = b.get("top_k", "int", 0)
    _check_range("top_k", top_k, -1)
    seed = b.get("seed", "int")
    if seed is None:
        seed = secrets.randbits(63)
    _check_range("seed", seed, -(2**63), 2**64 - 1)
    seed %= 2**63

    prompt_len = len(prompt_ids)
    room = ctx.max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"this model's maximum context length is {ctx.max_model_len} tokens, and the prompt alone "
            f"is {prompt_len} tokens: shorten it",
            param=prompt_param,
            code="context_length_exceeded",
        )
    max_name = "max_tokens"
    max_tokens = b.get("max_tokens", "int")
    if kind == "chat" and b.get("max_completion_tokens", "int") is not None:
        if max_tokens is not None:
            raise RequestError("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        max_name, max_tokens = "max_completion_tokens", b.get("max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = room if max_tokens_default is None else min(max_tokens_default, room)
    _check_range(max_name, max_tokens, 1)
    if max_tokens > room:
        total = prompt_len + max_tokens
        raise RequestError(
            f"this model's maximum context length is {ctx.max_model_len} tokens, but {total} tokens "
            f"were requested ({prompt_len} in the prompt, {max_tokens} in the completion): lower "
            f"{max_name} or shorten the prompt",
            param=max_name,
            code="context_length_exceeded",
        )

    stop_strings: list[str] = []
    stop_ids: set[int] = set()
    stop = b.get("stop", "any")
    if stop is not None:
        items = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
        if not isinstance(items, list):
            raise RequestError(
                f"stop must be a string or an array of strings / token ids, not {_type_name(stop)}", param="stop"
            )
        if len(items) > MAX_STOP:
            raise RequestError(f"stop has {len(items)} entries; at most {MAX_STOP}", param="stop")
        for item in items:
            if isinstance(item, str) and item:
                stop_strings.append(item)
            elif isinstance(item, int) and not isinstance(item, bool):
                stop_ids.update(_token_ids([item], "stop", ctx.vocab_size))
            else:
                raise RequestError(f"stop entries must be non-empty strings or token ids, not {item!r}", param="stop")
    extra_ids = b.get("stop_token_ids", "list")
    if extra_ids is not None:
        stop_ids.update(_token_ids(extra_ids, "stop_token_ids", ctx.vocab_size) if extra_ids else [])
    if stop_strings and ctx.tokenizer is None:
        raise RequestError("stop strings need a tokenizer, and this model has none: give stop token ids", param="stop")
    if not b.get("ignore_eos", "bool", False):
        stop_ids |= ctx.eos_token_ids

    stream = b.get("stream", "bool", False)
    options = b.get("stream_options", "dict")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
        unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise RequestError(f"unknown field stream_options.{unknown[0]}", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise RequestError("stream_options.include_usage must be a boolean", param="stream_options")

    return GenerationRequest(
        kind,
        prompt_ids,
        max_tokens,
        float(temperature),
        float(top_p),
        0 if top_k == -1 else top_k,
        seed,
        stop_strings,
        frozenset(stop_ids),
        stream,
        include_usage,
        return_token_ids=b.get("return_token_ids", "bool", False),
    )


def _require_logprobs(ctx: ServeContext, param: str) -> None:
    if not ctx.logprobs_supported:
        raise RequestError(
            f"{param} is not supported by this engine version (no logprobs in dsv4.SamplingParams)", param=param
        )


def parse_completion(body, ctx: ServeContext) -> GenerationRequest:
    b = _Body(body, COMPLETION_FIELDS)
    prompt = b.body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required: a string or an array of token ids", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if ctx.tokenizer is None:
            raise RequestError(
                "a text prompt needs a tokenizer, and this model has none (no tokenizer.json): send token ids",
                param="prompt",
            )
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        prompt_ids = ctx.tokenizer.encode(prompt, chat_template=False)
        if not prompt_ids:
            raise RequestError("prompt encodes to no tokens", param="prompt")
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt) and prompt:
        raise RequestError(f"prompt holds {len(prompt)} prompts; this server takes one per request", param="prompt")
    elif isinstance(prompt, list):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        # The ids' types and range are checked once, by the engine's add_request (a refusal is a 400 naming the first
        # bad id's position): checking here too cost a 128K-token prompt ~9 ms more on a 2-core box, all of it
        # inside the request's TTFT.
        prompt_ids = prompt
    else:
        raise RequestError(
            f"prompt must be a string or an array of token ids, not {_type_name(prompt)}", param="prompt"
        )
    _neutral(b, "echo", "bool", False, "no echo")
    _neutral(b, "best_of", "int", 1, "best_of must be 1")
    _neutral(b, "suffix", "str", None, "no suffix")
    request = _common(b, ctx, prompt_ids, "prompt", "completion", max_tokens_default=16)
    logprobs = b.get("logprobs", "int")
    if logprobs is not None:
        _check_range("logprobs", logprobs, 0, MAX_LOGPROBS)
        _require_logprobs(ctx, "logprobs")
        request.logprobs = logprobs
    return request


def parse_chat(body, ctx: ServeContext) -> GenerationRequest:
    b = _Body(body, CHAT_FIELDS)
    messages = b.get("messages", "list")
    if not messages:
        raise RequestError("messages is required: a non-empty array of {role, content}", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object, not {_type_name(m)}", param="messages")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise RequestError(f"messages[{i}] has an unknown field {unknown[0]!r}", param="messages")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, not {role!r}", param="messages"
            )
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string, not {_type_name(content)}", param="messages")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    if ctx.tokenizer is None:
        raise RequestError(
            "chat needs a tokenizer, and this model has none (no tokenizer.json): use /v1/completions with token ids",
            param="messages",
        )
    try:
        prompt_ids = ctx.tokenizer.encode_chat(clean)
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None
    except Exception as e:  # a template error (jinja2.TemplateError and the like)
        raise RequestError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}", param="messages"
        ) from None
    if b.get("tools", "list"):
        raise RequestError("tools are not supported by this server", param="tools")
    if b.get("tool_choice", "any", "none") != "none":
        raise RequestError("tool_choice is not supported by this server (no tools)", param="tool_choice")
    b.get("parallel_tool_calls", "bool")
    fmt = b.get("response_format", "dict")
    if fmt is not None and fmt.get("type") != "text":
        raise RequestError('response_format: only {"type": "text"} is supported', param="response_format")
    b.get("metadata", "dict")
    b.get("store", "bool")
    b.get("service_tier", "str")
    request = _common(b, ctx, prompt_ids, "messages", "chat", max_tokens_default=None)
    logprobs = b.get("logprobs", "bool", False)
    top = b.get("top_logprobs", "int")
    if top is not None:
        _check_range("top_logprobs", top, 0, MAX_LOGPROBS)
        if not logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if logprobs:
        _require_logprobs(ctx, "logprobs")
        request.logprobs = top or 0
    return request


# ----- output --------------------------------------------------------------------------------------------------


class OutputBuilder:
    """One request's tokens → text, logprobs and finish reason, with stop strings applied.

    Text ends where it is stable (`IncrementalDetokenizer`); while stop strings are active, the tail that could
    still become one is held back. `stop_hit` turns True when a stop string matched: the text is cut before it,
    finish_reason is "stop", and the caller cancels the request."""

    def __init__(self, request: GenerationRequest, tokenizer) -> None:
        self.request = request
        self.detok = IncrementalDetokenizer(tokenizer.decode) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, float, tuple]] = []  # (token id, logprob, ((id, logprob), ...))
        self.text = ""
        self.sent = 0  # characters of text handed out by take_text
        self.sent_tokens = 0  # tokens handed out by take_tokens
        self.finish_reason: str | None = None
        self.stop_hit = False
        self._longest_stop = max((len(s) for s in request.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token_id: int, logprob=None, top_logprobs=None, finish_reason: str | None = None) -> None:
        if self.finished:
            return  # tokens in flight after a stop string
        self.token_ids.append(token_id)
        if self.request.logprobs is not None:
            self.logprobs.append((token_id, logprob, tuple(top_logprobs or ())))
        if self.detok is not None:
            ends_on_stop_token = finish_reason == "stop" and token_id in self.request.stop_token_ids
            if not ends_on_stop_token:
                self._append(self.detok.add([token_id]))
            if finish_reason is not None and not self.stop_hit:
                self._append(self.detok.flush())
        if finish_reason is not None and not self.stop_hit:
            self.finish_reason = finish_reason

    def finish(self, reason: str) -> None:
        if not self.finished:
            if self.detok is not None:
                self._append(self.detok.flush())
            if not self.finished:
                self.finish_reason = reason

    def _append(self, piece: str) -> None:
        if not piece or self.stop_hit:
            return
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += piece
        if not self.request.stop:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.request.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stop_hit = True
            self.finish_reason = "stop"

    def take_text(self) -> str:
        """The text not handed out yet that can no longer change."""
        end = len(self.text)
        if not self.finished and self.request.stop:
            for k in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
                tail = self.text[-k:]
                if any(s.startswith(tail) for s in self.request.stop):
                    end -= k
                    break
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece

    def take_tokens(self) -> tuple[list[int], list[tuple]]:
        """Token ids and logprob entries not handed out yet."""
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return self.token_ids[start:], self.logprobs[start:]

    def usage(self) -> dict:
        n = len(self.request.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": len(self.token_ids), "total_tokens": n + len(self.token_ids)}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(entries, tokenizer, text_offset: int = 0) -> dict:
    """The legacy completions format: parallel arrays."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top in entries:
        text = _token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({_token_text(tokenizer, t): lp for t, lp in top})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(entries, tokenizer) -> dict:
    def item(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in top]} for t, lp, top in entries]}


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def completion_response(request_id: str, model: str, created: int, out: OutputBuilder, tokenizer) -> dict:
    req = out.request
    logprobs = completion_logprobs(out.logprobs, tokenizer) if req.logprobs is not None else None
    choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": logprobs}
    return _response(request_id, "text_completion", model, created, choice, out)


def chat_response(request_id: str, model: str, created: int, out: OutputBuilder, tokenizer) -> dict:
    req = out.request
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "finish_reason": out.finish_reason,
        "logprobs": chat_logprobs(out.logprobs, tokenizer) if req.logprobs is not None else None,
    }
    return _response(request_id, "chat.completion", model, created, choice, out)


def _response(request_id: str, kind: str, model: str, created: int, choice: dict, out: OutputBuilder) -> dict:
    """A whole (non-streamed) response around its one choice, with the token ids when the request asked for them."""
    body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice],
            "usage": out.usage()}  # fmt: skip
    if out.request.return_token_ids:
        choice["token_ids"] = out.token_ids
        body["prompt_token_ids"] = out.request.prompt_ids
    return body


def stream_chunk(
    request_id: str, model: str, created: int, out: OutputBuilder, tokenizer, *, first: bool = False
) -> dict:
    """The next SSE chunk: the text and tokens since the last one, finish_reason on the last."""
    req = out.request
    text = out.take_text()
    token_ids, entries = out.take_tokens()
    if req.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {
            "index": 0,
            "delta": delta,
            "finish_reason": out.finish_reason,
            "logprobs": chat_logprobs(entries, tokenizer) if req.logprobs is not None else None,
        }
        obj = "chat.completion.chunk"
    else:
        logprobs = completion_logprobs(entries, tokenizer) if req.logprobs is not None else None
        choice = {"index": 0, "text": text, "finish_reason": out.finish_reason, "logprobs": logprobs}
        obj = "text_completion"
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    chunk = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int, out: OutputBuilder) -> dict:
    obj = "chat.completion.chunk" if out.request.kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": out.usage()}


def now() -> int:
    return int(time.time())
