"""`dsv4 serve` as a real process on the tiny fixture, driven by the official `openai` client: the same tokens as
`dsv4.LLM.generate`, streaming and not, completions and chat; stop strings and stop ids; 32 concurrent streams; a
disconnected client's pages freed; 400s for bad requests; Prometheus /metrics; `dsv4 bench serve`; SIGTERM.

The fixture directory gets a byte-level tokenizer over the 256-token vocabulary (token i = byte i) and a jinja chat
template, so text and chat work and incremental detokenization meets split UTF-8 characters. One server serves the
whole module; the last test stops it with SIGTERM. Compiled programs go to a shared JAX cache, so the server and
the in-process reference engine compile each shape once.
"""

import asyncio
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
pytest.importorskip("jinja2")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
httpx = pytest.importorskip("httpx")

# one xdist worker for the whole module: its fixtures start a server and an engine, once (scripts/dev --dist loadgroup)
pytestmark = pytest.mark.xdist_group("serve")

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_mixed"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ENGINE = dict(max_slots=4, max_model_len=128, chunk_size=32, width_buckets=[1, 32])
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--max-slots",
    "4",
    "--max-model-len",
    "128",
    "--chunk-size",
    "32",
    "--buckets",
    "1,32",
    "--port",
    "0",
    "--shutdown-timeout",
    "2",
]
NAME = "tiny-chat"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what the ByteLevel pre-tokenizer and decoder use)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("serve") / NAME
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, d / name)
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def _env(jax_cache: str) -> dict:
    return os.environ | {
        "JAX_COMPILATION_CACHE_DIR": jax_cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_PLATFORMS": "cpu",
    }


class Server:
    def __init__(self, proc: subprocess.Popen, log: pathlib.Path) -> None:
        self.proc, self.log = proc, log
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", log.read_text())
            if match:
                self.url = match.group(1)
                return
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"the server did not start:\n{log.read_text()}")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values


@pytest.fixture(scope="module")
def server(model_dir, jax_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsv4.cli", "serve", str(model_dir), *SERVER_ARGS],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_env(jax_cache),
        )
    try:
        yield Server(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def llm(model_dir, jax_cache):
    """The reference: the same engine in this process."""
    import jax

    jax.config.update("jax_compilation_cache_dir", jax_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import dsv4

    return dsv4.LLM(str(model_dir), dtype="float32", **ENGINE)


def _reference(llm, prompt_ids, max_tokens, *, stop=(), **sampling):
    import dsv4

    (out,) = llm.generate(
        [prompt_ids], max_new_tokens=max_tokens, sampling=dsv4.SamplingParams(**sampling), stop_token_ids=stop
    )
    return out.token_ids


def _extra(choice, name):
    return (choice.model_extra or {}).get(name)


def _stream_completion(client, **kwargs):
    text, ids, finish, usage = "", [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            ids += _extra(choice, "token_ids") or []
            finish = choice.finish_reason or finish
    return text, ids, finish, usage


SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=50, seed=7)]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_completions_match_the_engine(server, llm, sampling):
    client = server.client()
    prompt = "héllo, wörld: "
    prompt_ids = llm.tokenizer.encode(prompt, chat_template=False)
    want = _reference(llm, prompt_ids, 12, **sampling)
    top_k = sampling.pop("top_k", None)
    body = dict(model=NAME, max_tokens=12, extra_body={"ignore_eos": True, "return_token_ids": True}, **sampling)
    if top_k is not None:
        body["extra_body"]["top_k"] = top_k

    whole = client.completions.create(prompt=prompt, **body)
    choice = whole.choices[0]
    assert _extra(choice, "token_ids") == want
    assert choice.text == llm.tokenizer.decode(want) and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 12

    text, ids, finish, usage = _stream_completion(client, prompt=prompt, **body)
    assert ids == want and text == llm.tokenizer.decode(want) and finish == "length"
    assert usage.completion_tokens == 12

    by_ids = client.completions.create(prompt=prompt_ids, **body)  # a token-id prompt
    assert _extra(by_ids.choices[0], "token_ids") == want


def test_chat_matches_the_engine(server, llm):
    client = server.client()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me about Ω."},
    ]
    rendered = "<system>Be brief.\n<user>Hi!\n<assistant>Hello.\n<user>Tell me about Ω.\n<assistant>"
    prompt_ids = llm.tokenizer.encode_chat(messages)
    assert prompt_ids == list(rendered.encode())  # the checkpoint's own template, byte tokens
    eos = llm.config.eos_token_id
    want = _reference(llm, prompt_ids, 16, stop=[eos])
    response = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert _extra(choice, "token_ids") == want
    text_ids = want[:-1] if want[-1] == eos else want  # the stop token is not text
    assert choice.message.role == "assistant" and choice.message.content == llm.tokenizer.decode(text_ids)
    assert choice.finish_reason == ("stop" if want[-1] == eos else "length")
    assert response.usage.prompt_tokens == len(prompt_ids)

    content, roles, finish = "", [], None
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            roles += [c.delta.role] if c.delta.role else []
            finish = c.finish_reason or finish
    assert content == choice.message.content and roles == ["assistant"] and finish == choice.finish_reason


def test_stop_strings_and_stop_token_ids(server, llm):
    client = server.client()
    prompt_ids = llm.tokenizer.encode("stop here: ", chat_template=False)
    want = _reference(llm, prompt_ids, 24)
    body = dict(model=NAME, prompt=prompt_ids, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})

    stop_id = want[5]  # the first time that token comes, the engine stops (the token is counted, not written)
    cut = want.index(stop_id)
    by_id = body | {"extra_body": {"ignore_eos": True, "stop_token_ids": [stop_id]}}
    out = client.completions.create(**by_id)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == cut + 1
    assert out.choices[0].text == llm.tokenizer.decode(want[:cut])

    full = llm.tokenizer.decode(want)
    ascii_tokens = [t for t in want[2:] if 32 < t < 127]
    assert ascii_tokens, "the greedy output has no printable ASCII byte to stop at"
    stop = chr(ascii_tokens[0])
    expected = full[: full.index(stop)]
    before = server.metrics()
    out = client.completions.create(**body, stop=[stop, "never appears"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    text, _, finish, _ = _stream_completion(client, **body, stop=stop)
    assert text == expected and finish == "stop"
    assert server.metrics()["dsv4_kv_pages_used"] == 0
    assert server.metrics()["dsv4_generation_tokens_total"] - before["dsv4_generation_tokens_total"] < 2 * 24


def test_32_concurrent_streams_all_finish(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def one(i):
        text, n, finish = "", 0, None
        stream = await client.completions.create(
            model=NAME,
            prompt=[2 + i, 3, 4 + i],
            max_tokens=6,
            temperature=0.5,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return n, finish

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results == [(6, "length")] * 32
    m = server.metrics()
    assert m["dsv4_num_requests_running"] == 0 and m["dsv4_kv_pages_used"] == 0


def test_a_disconnected_client_frees_its_pages(server):
    before = server.metrics()
    body = {
        "model": NAME,
        "prompt": [5, 6, 7, 8],
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one token, then hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        cancelled = m.get("dsv4_requests_total{finish_reason=cancelled}", 0)
        if cancelled > before.get("dsv4_requests_total{finish_reason=cancelled}", 0) and m["dsv4_kv_pages_used"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the request was not cancelled: {m}")
    assert m["dsv4_num_requests_running"] == 0 and m["dsv4_kv_pages_free"] == m["dsv4_kv_pages_total"]
    assert m["dsv4_generation_tokens_total"] - before["dsv4_generation_tokens_total"] < 120


BAD_REQUESTS = [
    ("completions", b'{"prompt": [1, 2', None),  # malformed JSON
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": [1, 2], "max_tokens": 4, "colour": "red"}, "colour"),
    ("completions", {"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": [1, 2], "max_tokens": "4"}, "max_tokens"),
    ("completions", {"prompt": 3.5}, "prompt"),
    ("completions", {"prompt": [1, 2], "stream": "yes"}, "stream"),
    ("completions", {"prompt": [1, 2], "temperature": 2.5}, "temperature"),
    ("completions", {"prompt": [1, 2], "temperature": -0.1}, "temperature"),
    ("completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [1, 2], "max_tokens": 127}, "max_tokens"),  # 2 + 127 > max_model_len 128
    ("completions", {"prompt": list(range(2, 200)), "max_tokens": 1}, "prompt"),  # longer than the model's limit
    ("completions", {"prompt": [7] * 40_000, "max_tokens": 1}, "prompt"),  # > 64 KiB: parsed off the event loop
    ("completions", b'{"prompt": [' + b"7, " * 40_000, None),  # the same, malformed
    ("completions", {"prompt": [1, 999]}, "prompt"),
    ("completions", {"prompt": [1, True]}, "prompt"),  # ids are checked by the engine's add_request
    ("completions", {"prompt": [1, 2.5]}, "prompt"),
    ("completions", {"prompt": [1, 10**30]}, "prompt"),
    ("completions", {"prompt": [1, 2], "n": 2}, "n"),
    ("completions", {"prompt": [1, 2], "stop": [""]}, "stop"),
    ("completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": [1, 2], "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": [1, 2], "model": "gpt-4"}, "model"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
]


def test_bad_requests_get_a_400_naming_the_field(server, llm):
    for path, body, param in BAD_REQUESTS:
        if isinstance(body, bytes):
            response = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"Content-Type": "application/json"})
        else:
            response = httpx.post(f"{server.url}/v1/{path}", json=body)
        expected = 404 if param == "model" else 400
        assert response.status_code == expected, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error"
    # other requests are not disturbed
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt=[1, 2], temperature=3)
    out = client.completions.create(model=NAME, prompt=[1, 2], max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert server.metrics()["dsv4_requests_rejected_total{status=400}"] >= len(BAD_REQUESTS) - 1


def test_logprobs_or_a_clear_400(server, llm):
    from dsv4.serve.protocol import logprobs_supported

    client = server.client()
    if not logprobs_supported():
        with pytest.raises(openai.BadRequestError, match="not supported"):
            client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2, logprobs=2)
        return
    import dsv4

    (ref,) = llm.generate([[1, 2, 3]], max_new_tokens=4, sampling=dsv4.SamplingParams(logprobs=2))
    out = client.completions.create(
        model=NAME, prompt=[1, 2, 3], max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    got = out.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(list(ref.logprobs), abs=1e-4)
    assert all(len(top) <= 2 for top in got.top_logprobs)
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_models_health_and_metrics(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == 128 and card["vocab_size"] == 256
    assert [m.id for m in server.client().models.list()] == [NAME]
    before = server.metrics()
    server.client().completions.create(model=NAME, prompt=[9, 8, 7], max_tokens=5, extra_body={"ignore_eos": True})
    after = server.metrics()
    for name, grew_by in [
        ("dsv4_generation_tokens_total", 5),
        ("dsv4_prefill_tokens_total", 3),
        ("dsv4_time_to_first_token_seconds_count", 1),
        ("dsv4_e2e_request_latency_seconds_count", 1),
        ("dsv4_time_per_output_token_seconds_count", 1),
        ("dsv4_requests_total{finish_reason=length}", 1),
    ]:
        assert after[name] - before.get(name, 0) == grew_by, name
    for name in (
        "dsv4_num_requests_running",
        "dsv4_num_requests_waiting",
        "dsv4_kv_pages_used",
        "dsv4_kv_pages_free",
        "dsv4_num_preemptions_total",
    ):
        assert name in after
    assert after["dsv4_kv_pages_free"] + after["dsv4_kv_pages_used"] == after["dsv4_kv_pages_total"] == 4


def test_bench_serve(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "8",
            "--request-rate",
            "inf",
            "--input-len",
            "12",
            "--input-len-range",
            "0.5",
            "--output-len",
            "4",
            "--long-prompt-len",
            "96",
            "--slo-ttft-ms",
            "60000",
            "--json-out",
            str(out),
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TTFT" in result.stdout and "long prompt (96 tokens)" in result.stdout
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["completed"] == 8 and s["failed"] == 0 and s["output_tokens"] == 32
    assert s["ttft_p50_ms"] > 0 and s["goodput_fraction"] == 1.0 and len(report["requests"]) == 8
    assert s["server_after"] == {
        "dsv4_num_requests_running": 0,
        "dsv4_num_requests_waiting": 0,
        "dsv4_kv_pages_used": 0,
    }
    assert s["long_prompt"]["prompt_len"] == 96 and s["long_prompt"]["ttft_loaded_ms"] > 0


def test_sigterm_drains_and_exits_cleanly(server):
    """Last: stops the module's server. An in-flight stream ends cleanly (finished, or cancelled after the
    shutdown timeout), new requests get 503 meanwhile, and the process exits 0."""
    body = {"model": NAME, "prompt": [3, 4, 5], "max_tokens": 120, "temperature": 0, "stream": True, "ignore_eos": True}
    lines = []
    started = threading.Event()

    def read():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                started.set()
                if line:
                    lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    if server.proc.poll() is None:
        try:
            late = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=5)
            assert late.status_code == 503
        except httpx.TransportError:
            pass  # already closed
    assert server.proc.wait(timeout=30) == 0, server.log.read_text()
    reader.join(10)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]"
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "cancelled")
    assert "stopped" in server.log.read_text()
