"""A real `tidyrun serve` on 127.0.0.1, driven by the official openai client, on the default model (CPU)."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import threading
import time

import httpx
import openai
import pytest

from server_utils import ServerProcess, openai_client, smol_server
from tidyrun.synthetic import write_random_checkpoint

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The smol server with its lifecycle routes on, keyed, and weight updates confined to an empty folder."""
    yield from smol_server("--enable-lifecycle-endpoints", "--admin-key", "admin-key",
                           "--weights-dir", str(tmp_path_factory.mktemp("weights")), "--trust-request-chat-template")


client = pytest.fixture(scope="module")(openai_client)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    import torch

    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny_srv")), "llama-tiny", dtype=torch.float32)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_chat_completion(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=16, temperature=0)
    assert r.choices[0].message.content.startswith("The capital of France is Paris.")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10


def test_request_chat_template_on_a_trusting_server(client):
    """--trust-request-chat-template: a chat request renders with its own template (here the bare contents),
    so its prompt is the question's tokens alone, as a completion of the same text counts them."""
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=1, temperature=0,
                                       extra_body={"chat_template": bare, "add_generation_prompt": False})
    same = client.completions.create(model="smol", prompt=QUESTION[0]["content"], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
    # the template's variables reach it (chat_template_kwargs), and may carry the template itself here
    greeting = "{{ greeting }}" + bare
    for extra in ({"chat_template": greeting, "chat_template_kwargs": {"greeting": "Dear model,"}},
                  {"chat_template_kwargs": {"chat_template": greeting, "greeting": "Dear model,"}}):
        greeted = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=1, temperature=0,
                                                 extra_body={**extra, "add_generation_prompt": False})
        assert greeted.usage.prompt_tokens > r.usage.prompt_tokens


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0,
                                                stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason


def test_completions_and_streaming(client):
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    text = r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length") and text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == text
    many = client.completions.create(model="smol", prompt=["One", "Two"], max_tokens=4, temperature=0, n=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]


def test_stop_string_and_seed(client):
    base = client.completions.create(model="smol", prompt="Count: one, two,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[3:6]
    cut = client.completions.create(model="smol", prompt="Count: one, two,", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    a = client.completions.create(model="smol", prompt="Once", max_tokens=12, temperature=1.0, seed=42)
    b = client.completions.create(model="smol", prompt="Once", max_tokens=12, temperature=1.0, seed=42)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("body, status, needle", [
    ('{"model": "smol", "prompt": ', 400, "JSON"),
    ('[1, 2, 3]', 400, "invalid request"),
    ('{"model": "smol"}', 400, "prompt"),
    ('{"model": "nope", "prompt": "hi"}', 404, "does not exist"),
    ('{"model": "smol", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    ('{"model": "smol", "prompt": "hi", "top_p": 7}', 400, "top_p"),
    ('{"model": "smol", "prompt": "hi", "max_tokens": 100000}', 400, "maximum context length"),
    ('{"model": "smol", "prompt": "hi", "n": 1000}', 400, "n must"),
    ('{"model": "smol", "prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    ('{"model": "smol", "prompt": "hi", "logprob": 2}', 400, "logprob: unknown field"),
    ('{"model": "smol", "prompt": [99999999]}', 400, "token ids"),
    ('{"model": "smol", "prompt": ""}', 400, "empty"),
])
def test_bad_requests_get_openai_errors(server, body, status, needle):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_prompt_too_long_and_client_errors(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="smol", prompt="word " * 600, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="smol", messages=QUESTION, temperature=-2)
    assert client.completions.create(model="smol", prompt="still", max_tokens=2).choices  # still serving


def test_sleep_wake_over_http(server, client):
    before = client.completions.create(model="smol", prompt="Hello", max_tokens=6, temperature=0).choices[0].text
    r = httpx.post(server.url + "/sleep", params={"level": 1}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["sleeping"]
    assert server.metrics()["tidyrun_sleeping"] == 1
    assert httpx.get(server.url + "/is_sleeping", headers=ADMIN).json() == {"is_sleeping": True}
    with pytest.raises(openai.ConflictError, match="asleep"):
        client.completions.create(model="smol", prompt="Hello", max_tokens=6)
    assert httpx.post(server.url + "/sleep", params={"level": 7}, headers=ADMIN).status_code == 400
    assert httpx.post(server.url + "/wake_up", headers=ADMIN).json() == {"sleeping": False}
    after = client.completions.create(model="smol", prompt="Hello", max_tokens=6, temperature=0).choices[0].text
    assert after == before
    m = server.metrics()
    assert m['tidyrun_device_memory_bytes{owner="weights"}'] > 0 and m["tidyrun_sleeping"] == 0


def test_update_weights_from_a_bad_path(server):
    r = httpx.post(server.url + "/update_weights", json={"path": "."}, headers=ADMIN)  # the (empty) weights dir
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/update_weights", json={"path": "/no/such/place"}, headers=ADMIN)
    assert r.status_code == 403 and "weights dir" in r.json()["error"]["message"]


def test_shutdown_endpoint_not_exposed(server):
    assert httpx.post(server.url + "/shutdown").status_code == 404
    assert httpx.post(server.url + "/shutdown", headers=ADMIN).status_code == 404


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"model": "smol", "prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metrics()["tidyrun_requests_running"] == 1
    m = server.wait_idle()
    assert (m["tidyrun_requests_running"], m["tidyrun_kv_cache_usage_ratio"]) == (0, 0)


def test_load_64_concurrent_streaming_clients(server):
    """128 streaming requests, 64 at a time: all answered, nothing left allocated."""
    total, concurrency = 128, 64

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            async def one(i):
                async with sem:
                    t0 = time.perf_counter()
                    text, done = "", False
                    stream = await c.completions.create(model="smol", prompt=f"Request number {i}:", max_tokens=12,
                                                        stream=True, extra_body={"ignore_eos": True})
                    async for chunk in stream:
                        if chunk.choices:
                            text += chunk.choices[0].text
                            done = done or chunk.choices[0].finish_reason is not None
                    return time.perf_counter() - t0, text, done
            return await asyncio.gather(*(one(i) for i in range(total)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    wall = time.perf_counter() - t0
    latencies = sorted(r[0] for r in results)
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\nload: {total} streaming requests, {concurrency} concurrent, {wall:.1f} s wall; "
          f"latency p50 {p50:.2f} s, p99 {p99:.2f} s")
    assert all(done and text for _, text, done in results)
    m = server.wait_idle()
    assert (m["tidyrun_requests_running"], m["tidyrun_requests_waiting"], m["tidyrun_kv_cache_usage_ratio"]) == (0, 0, 0)


def test_api_key(tiny_dir):
    srv = ServerProcess("--model", tiny_dir, "--api-key", "sekret", "--max-model-len", "256",
                        "--enable-lifecycle-endpoints")  # no --admin-key: the API key guards them too
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(srv.url + "/sleep").status_code == 401
        assert httpx.get(srv.url + "/is_sleeping", headers={"authorization": "Bearer sekret"}).json() == {
            "is_sleeping": False}
        assert httpx.get(srv.url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=ok.models.list().data[0].id, prompt="hi", max_tokens=3).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        code, err = srv.stop()
    assert code == 0 and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, "POST /shutdown"])
def test_graceful_stop_during_streaming(tiny_dir, sig):
    """Requests still running when the grace period ends are aborted the way the README promises: a stream's
    last chunk carries finish_reason "abort" and is followed by [DONE]; a non-streaming client gets its 200
    with finish_reason "abort". No 500, no cut stream, no traceback in the log."""
    admin = ("--enable-lifecycle-endpoints", "--admin-key", "k", "--enable-shutdown-endpoint")
    srv = ServerProcess("--model", tiny_dir, "--max-model-len", "2048", "--graceful-timeout", "2",
                        *(admin if sig == "POST /shutdown" else ()))
    outcomes: list[tuple] = []

    def request(i, stream):
        body = {"prompt": f"request {i}", "max_tokens": 2000, "ignore_eos": True, "stream": stream}
        try:
            if not stream:
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
                outcomes.append(("plain", r.status_code, r.json()["choices"][0]["finish_reason"]
                                 if r.status_code == 200 else r.text[:200]))
                return
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line]
            last = json.loads(lines[-2][len("data: "):]) if len(lines) > 1 else {}
            outcomes.append(("stream", lines[-1] if lines else None, last.get("choices", [{}])[0].get("finish_reason")))
        except httpx.HTTPError as exc:
            outcomes.append(("error", type(exc).__name__, None))

    threads = [threading.Thread(target=request, args=(i, i % 3 != 2)) for i in range(6)]  # 4 streams, 2 plain
    for t in threads:
        t.start()
    time.sleep(1.5)
    if sig == "POST /shutdown":
        assert httpx.post(srv.url + "/shutdown", headers={"authorization": "Bearer k"}).status_code == 200
        code, err = srv.proc.wait(60), srv._output()[1]
    else:
        code, err = srv.stop(sig)
    for t in threads:
        t.join(30)
    assert code == 0, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert "engine shut down" in err and "nothing survived" in err
    assert sorted(outcomes) == sorted([("stream", "data: [DONE]", "abort")] * 4 + [("plain", 200, "abort")] * 2), \
        outcomes


def test_embeddings(client, server):
    r = client.embeddings.create(model="smol", input=["The capital of France is Paris.", "hi"])
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 576
    assert abs(sum(x * x for x in r.data[0].embedding) - 1.0) < 1e-4
    import base64

    import numpy as np

    raw = httpx.post(server.url + "/v1/embeddings",
                     json={"model": "smol", "input": "hi", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    assert np.allclose(decoded, r.data[1].embedding, atol=1e-6)
    bad = httpx.post(server.url + "/v1/embeddings", json={"model": "smol", "input": "x", "pooling": "max"})
    assert bad.status_code == 400
