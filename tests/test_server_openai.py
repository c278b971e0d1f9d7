"""OpenAI's sampling and output options end to end: a real `tidyrun serve` on the default model (CPU),
driven by the official openai client.

Logprobs, echo with logprobs, penalties, logit_bias and response_format need
the engine to honour the SamplingParams the server builds; the refusals
(400 naming the field) are the server's own.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server_utils import openai_client, smol_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
BANANA, PARIS = 21285, 7042  # " banana" and " Paris" in SmolLM2's vocabulary


server = pytest.fixture(scope="module")(smol_server)
client = pytest.fixture(scope="module")(openai_client)


def complete(client, **kw):
    return client.completions.create(model="smol", **{"prompt": PROMPT, "temperature": 0, **kw})


# -- completions: logprobs and echo ------------------------------------------------------------


def test_completion_logprobs_shape_and_values(client):
    r = complete(client, max_tokens=8, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens).startswith(choice.text)
    for i, (token, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert value <= 0.0
        assert 1 <= len(top) <= 3  # the 2 most likely plus the chosen one
        assert top[token] == pytest.approx(value)
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # temperature 0 picks the most likely
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    only_chosen = complete(client, max_tokens=8, logprobs=0).choices[0].logprobs
    assert [list(t) for t in only_chosen.top_logprobs] == [[t] for t in lp.tokens]
    assert only_chosen.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_echo_with_logprobs_scores_the_prompt_first(client):
    r = complete(client, max_tokens=4, logprobs=1, echo=True)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == pytest.approx(value)


def test_generated_logprobs_match_the_same_tokens_scored_as_a_prompt(client):
    """Sampling's logprobs and the prompt's (one prefill) agree, token by token and summed."""
    gen = complete(client, max_tokens=8, logprobs=1)
    text, lp = gen.choices[0].text, gen.choices[0].logprobs
    scored = complete(client, prompt=PROMPT + text, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == PROMPT + text and scored.usage.completion_tokens == 0
    tail = scored.choices[0].logprobs
    n = len(lp.tokens)
    assert tail.tokens[-n:] == lp.tokens
    assert tail.token_logprobs[-n:] == pytest.approx(lp.token_logprobs, abs=2e-3)
    assert sum(tail.token_logprobs[-n:]) == pytest.approx(sum(lp.token_logprobs), abs=1e-2)


def test_streamed_completion_logprobs_add_up_to_the_whole(client):
    whole = complete(client, max_tokens=8, logprobs=2, echo=True).choices[0]
    tokens, values, offsets, text = [], [], [], ""
    for chunk in complete(client, max_tokens=8, logprobs=2, echo=True, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)


def test_prompt_logprobs_extra(server):
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": "smol", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    steps = r.json()["choices"][0]["prompt_logprobs"]
    assert steps[0] is None and len(steps) == r.json()["usage"]["prompt_tokens"]
    for step in steps[1:]:
        assert 1 <= len(step) <= 2 and all(v["logprob"] <= 0.0 and v["rank"] >= 1 for v in step.values())


# -- chat: logprobs ----------------------------------------------------------------------------


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
    for e in content:
        assert e.logprob <= 0.0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(values[0])  # greedy
    plain = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=12, temperature=0,
                                           logprobs=True)
    assert [e.token for e in plain.choices[0].logprobs.content] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None


def test_chat_streaming_carries_logprobs(client):
    kw = dict(model="smol", messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)


# -- structured outputs ------------------------------------------------------------------------

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model="smol", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Name the capital of France and its country, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "country"} and all(isinstance(v, str) for v in value.values())


def test_response_format_json_object_and_vllm_guided_fields(client):
    r = client.chat.completions.create(
        model="smol", max_tokens=64, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Answer in JSON: what is the capital of France?"}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    choice = complete(client, max_tokens=8, extra_body={"guided_choice": ["Lyon", "Marseille"]}).choices[0].text
    assert choice in ("Lyon", "Marseille")
    digits = complete(client, max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(digits.choices[0].text) == 3 and digits.choices[0].text.isdigit()
    schema = complete(client, max_tokens=8, extra_body={"guided_json": {"type": "integer"}})
    assert isinstance(json.loads(schema.choices[0].text), int)


# -- penalties, logit_bias ---------------------------------------------------------------------

LOVE = "I love you, I love you, I love you,"  # greedy goes on " I love you, I love you, ..."


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 1.8}}])
def test_penalties_stop_a_repetition(client, penalty):
    """Checked against vLLM's definitions by hand on this model: each penalty breaks the loop."""
    base = complete(client, prompt=LOVE, max_tokens=16).choices[0].text
    penalized = complete(client, prompt=LOVE, max_tokens=16, **penalty).choices[0].text
    assert base.count("love") >= 3
    assert penalized.count("love") <= 1


def test_logit_bias_forces_and_forbids_tokens(client):
    def text_of(token_id: int) -> str:  # echo of a token-id prompt is its text
        return complete(client, prompt=[token_id], max_tokens=0, echo=True).choices[0].text

    assert (text_of(BANANA), text_of(PARIS)) == (" banana", " Paris")
    assert complete(client, max_tokens=5, logit_bias={str(BANANA): 100}).choices[0].text == " banana" * 5
    assert complete(client, max_tokens=1).choices[0].text == " Paris"  # greedy, unbiased
    banned = complete(client, max_tokens=1, logit_bias={str(PARIS): -100}).choices[0].text
    assert banned and banned != " Paris"


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("route, extra, needle", [
    ("completions", {"logit_bias": {"5": 200}}, "logit_bias"),
    ("completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999999": 1}, "stream": True}, "logit_bias"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("completions", {"response_format": {"type": "json_schema"}}, "json_schema"),
    ("completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ("completions", {"suffix": "!"}, "suffix"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools are not supported"),
    ("chat/completions", {"tool_choice": "auto"}, "tools are not supported"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "tools are not supported"),
    ("chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat/completions", {"logit_bias": {"1": -101}}, "logit_bias"),
    ("chat/completions", {"echo": True}, "echo"),
    ("chat/completions", {"chat_template": "{{ messages }}"}, "--trust-request-chat-template"),
    ("chat/completions", {"continue_final_message": True}, "add_generation_prompt=False"),
    ("chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set"),
    # a template slipped in through the template's variables, which override the named arguments
    ("chat/completions", {"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "--trust-request-chat-template"),
    ("chat/completions", {"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "tools are not supported"),
    ("chat/completions", {"chat_template_kwargs": {"continue_final_message": True}}, "add_generation_prompt=False"),
])
def test_unsupported_or_invalid_options_are_400_naming_the_field(server, route, extra, needle):
    body = {"model": "smol", "max_tokens": 2, **extra}
    body.update({"messages": QUESTION} if route.startswith("chat") else {"prompt": "hi"})
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")  # refused before any stream starts
    assert needle in r.json()["error"]["message"]


def test_harmless_openai_fields_are_accepted(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, user="u1", seed=3,
                                       tool_choice="none", parallel_tool_calls=False, metadata={"k": "v"},
                                       service_tier="auto", response_format={"type": "text"}, n=2, logit_bias={})
    assert len(r.choices) == 2
    bias_free = complete(client, max_tokens=4, best_of=1, presence_penalty=0, frequency_penalty=0, seed=1)
    assert bias_free.choices[0].text == complete(client, max_tokens=4).choices[0].text


def test_vllm_chat_template_extras(client):
    """vLLM's chat extras through the openai client's extra_body: template variables (Qwen3 users send
    enable_thinking; SmolLM2's template ignores it) and a reply that continues the last assistant message."""
    plain = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0)
    thinking_off = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off.choices[0].message.content == plain.choices[0].message.content
    opened = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    continued = client.chat.completions.create(model="smol", messages=opened, max_tokens=3, temperature=0,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False})
    assert continued.choices[0].message.content.startswith(" Paris")
    assert continued.usage.prompt_tokens > plain.usage.prompt_tokens  # the open message is in the prompt


def test_return_token_ids_and_tokens_as_token_ids(client):
    """vLLM's return_token_ids (prompt and generated ids beside the text; streamed: the prompt's with the
    first chunk, each chunk's new ids) and return_tokens_as_token_ids (logprob entries named "token_id:<id>")."""
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = complete(client, max_tokens=6, logprobs=1, extra_body=extra)
    choice = r.choices[0]
    assert len(choice.prompt_token_ids) == r.usage.prompt_tokens and len(choice.token_ids) == 6
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs for k in top)
    assert complete(client, max_tokens=6).choices[0].text == choice.text  # the text is unchanged
    chunks = list(complete(client, max_tokens=6, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:] if c.choices)
    assert [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", None) or []] == choice.token_ids

    chat = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=1, extra_body=extra)
    ids = chat.choices[0].token_ids
    assert len(chat.prompt_token_ids) == chat.usage.prompt_tokens and len(ids) == chat.usage.completion_tokens
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    assert list(chat.choices[0].logprobs.content[0].bytes) == list(f"token_id:{ids[0]}".encode())
    stream = list(client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == chat.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in stream[1:])
    assert [t for c in stream if c.choices for t in getattr(c.choices[0], "token_ids", None) or []] == ids


def test_add_special_tokens_defaults_per_route_as_in_vllm(tmp_path):
    """vLLM's add_special_tokens: on by default for a completion's text (the tokenizer's BOS), off for a
    rendered chat (its template writes such tokens); either can be turned. A tiny checkpoint whose tokenizer
    prepends BOS shows it (the default model's adds nothing)."""
    from fastapi.testclient import TestClient

    from tidyrun import LLM
    from tidyrun.server.app import create_app
    from tidyrun.engine_loop import EngineLoop
    from tidyrun.synthetic import write_random_checkpoint

    folder = write_random_checkpoint(str(tmp_path / "tiny"), "llama-tiny")
    with open(tmp_path / "tiny" / "tokenizer.json") as f:
        spec = json.load(f)
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<s>")
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
    with open(tmp_path / "tiny" / "tokenizer.json", "w") as f:
        json.dump(spec, f)
    loop = EngineLoop(LLM(folder, device="cpu", max_model_len=64))
    loop.start()
    try:
        http = TestClient(create_app(loop, "tiny", trust_request_chat_template=True))
        text = "the quick brown fox"

        def prompt_tokens(route: str, **kw) -> int:
            body = {"model": "tiny", "max_tokens": 1, **kw}
            body.update({"prompt": text} if route == "completions" else {
                "messages": [{"role": "user", "content": text}], "add_generation_prompt": False,
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
            r = http.post(f"/v1/{route}", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        bare = prompt_tokens("completions", add_special_tokens=False)
        assert prompt_tokens("completions") == prompt_tokens("completions", add_special_tokens=True) == bare + 1
        assert prompt_tokens("chat/completions") == bare
        assert prompt_tokens("chat/completions", add_special_tokens=True) == bare + 1
    finally:
        assert loop.stop().clean


def test_tokenize_and_detokenize_routes(server, client):
    """vLLM's /tokenize (a text prompt, or chat messages through the template) and /detokenize, counted as the
    generation routes count the same inputs; /version and /ping answer too."""
    post = lambda path, **body: httpx.post(f"{server.url}{path}", json={"model": "smol", **body}, timeout=60)  # noqa: E731
    text = post("/tokenize", prompt=PROMPT, return_token_strs=True).json()
    assert text["count"] == len(text["tokens"]) == complete(client, max_tokens=1).usage.prompt_tokens
    assert text["max_model_len"] == 512 and len(text["token_strs"]) == text["count"]
    assert post("/detokenize", tokens=text["tokens"]).json() == {"prompt": PROMPT}
    chat = post("/tokenize", messages=QUESTION).json()
    used = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used and chat["token_strs"] is None
    assert post("/tokenize", messages=QUESTION, add_generation_prompt=False).json()["count"] < used
    for bad, needle in [({"prompt": PROMPT, "messages": QUESTION}, "exactly one"), ({}, "exactly one"),
                        ({"messages": QUESTION, "chat_template": "{{ 1 }}"}, "--trust-request-chat-template")]:
        r = post("/tokenize", **bad)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = post("/detokenize", tokens=[10 ** 9])
    assert r.status_code == 400 and "token ids must be in" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/ping").status_code == httpx.post(f"{server.url}/ping").status_code == 200


def test_stream_usage_at_the_end_or_in_every_chunk(client):
    """stream_options.include_usage: one last chunk with no choices and the usage; vLLM's
    continuous_usage_stats adds the usage so far to every chunk (never falling, ending at the total)."""
    full = complete(client, max_tokens=6)
    chunks = list(complete(client, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    chat = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=6, temperature=0)
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    for whole, stream in ((full, complete(client, max_tokens=6, stream=True, stream_options=continuous)),
                          (chat, client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=6,
                                                                temperature=0, stream=True, stream_options=continuous))):
        usages = [c.usage for c in stream]
        seen = [u.completion_tokens for u in usages]
        assert seen == sorted(seen) and seen[-1] == whole.usage.completion_tokens and len(seen) > 2
        assert all(u.prompt_tokens == whole.usage.prompt_tokens for u in usages)


def test_a_refused_prompt_refuses_the_whole_request(server):
    """The engine accepts the first prompt and refuses the second: the answer is a 400 and the first,
    already queued, is aborted (nothing keeps running for a request that failed)."""
    body = {"model": "smol", "prompt": ["Tell me a long story.", ""], "max_tokens": 300, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    m = server.wait_idle(timeout=5)
    assert (m["tidyrun_requests_running"], m["tidyrun_requests_waiting"], m["tidyrun_kv_cache_usage_ratio"]) == (0, 0, 0)
