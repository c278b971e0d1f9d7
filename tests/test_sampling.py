"""SamplingParams behaviour on the default model (CPU fp32, shared ``llm`` fixture)."""

from __future__ import annotations

import pytest
import torch

from tidyrun import SamplingParams

PROMPT = "The quick brown fox"
STORY = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run(llm, prompt, params):
    """The single completion of one prompt."""
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == 1
    return out.outputs[0]


@pytest.fixture(autouse=True)
def _engine_is_idle(llm):
    """Every test starts and ends with no request in flight and every KV block free."""
    pool = llm.scheduler.pool
    assert not llm.has_unfinished_requests()
    yield
    assert not llm.has_unfinished_requests()
    assert pool.num_free == pool.num_blocks


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """24 greedy tokens of PROMPT, without stop conditions."""
    out = run(llm, PROMPT, greedy(24, ignore_eos=True))
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    return out


@pytest.fixture(scope="module")
def chat_ref(llm):
    [out] = llm.chat(CHAT, greedy(24), use_tqdm=False)
    return out.outputs[0]


def test_greedy_is_deterministic(llm, greedy_ref):
    again = run(llm, PROMPT, greedy(24, ignore_eos=True))
    assert again.token_ids == greedy_ref.token_ids
    assert again.text == greedy_ref.text
    assert again.text == llm.tokenizer.decode(again.token_ids)


def test_top_k_1_is_greedy(llm, greedy_ref):
    out = run(llm, PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True))
    assert out.token_ids == greedy_ref.token_ids


def test_tiny_top_p_is_greedy(llm, greedy_ref):
    out = run(llm, PROMPT, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=24, ignore_eos=True, seed=3))
    assert out.token_ids == greedy_ref.token_ids


def test_sampling_differs_from_greedy(llm, greedy_ref):
    """Control for the tests above: temperature 1 without filters does not simply reproduce greedy."""
    out = run(llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3))
    assert out.token_ids != greedy_ref.token_ids


SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True)


def test_seed_reproducible_alone_and_in_batch(llm):
    alone = run(llm, STORY, SEEDED).token_ids
    assert len(alone) == 24
    assert run(llm, STORY, SEEDED).token_ids == alone
    prompts = ["Hello, my name is", STORY, "def fibonacci(n):", "The capital of Japan"]
    params = [SamplingParams(temperature=1.0, max_tokens=20),
              SEEDED,
              SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=1.2, top_p=0.9, top_k=50, seed=7, max_tokens=24, n=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert outs[1].outputs[0].token_ids == alone


def test_different_seeds_differ(llm):
    a = run(llm, STORY, SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)).token_ids
    b = run(llm, STORY, SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)).token_ids
    assert len(a) == len(b) == 24
    assert a != b


def test_n_samples(llm):
    [out] = llm.generate([STORY], SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) >= 2
    assert all(c.text == llm.tokenizer.decode(c.token_ids) for c in out.outputs)


def test_max_tokens(llm):
    out = run(llm, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7, seed=5))
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"
    assert out.stop_reason is None


def _pick_stop_string(text: str) -> tuple[str, int]:
    """Two consecutive words of ``text`` (so the stop string spans a token boundary) and where they first occur,
    a few characters in."""
    words = text.split()
    for first, second in zip(words, words[1:]):
        phrase = f"{first} {second}"
        at = text.find(phrase)
        if len(first) >= 3 and at >= 5:
            return phrase, at
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string(llm, greedy_ref):
    full = greedy_ref.text
    stop, at = _pick_stop_string(full)
    out = run(llm, PROMPT, greedy(24, stop=[stop, "no such string zq"]))
    assert out.text == full[:at]
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < len(greedy_ref.token_ids)
    assert greedy_ref.token_ids[: len(out.token_ids)] == out.token_ids

    kept = run(llm, PROMPT, greedy(24, stop=stop, include_stop_str_in_output=True))
    assert kept.text == full[: at + len(stop)]
    assert kept.text.endswith(stop)
    assert kept.finish_reason == "stop" and kept.stop_reason == stop
    assert kept.token_ids == out.token_ids


def test_stop_string_not_found_runs_to_length(llm, greedy_ref):
    out = run(llm, PROMPT, greedy(24, stop=["no such string zq"], ignore_eos=True))
    assert out.text == greedy_ref.text
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_ids(llm, greedy_ref):
    ids = greedy_ref.token_ids
    stop_id = ids[2]
    end = ids.index(stop_id) + 1  # the first occurrence (index 2 unless it also came earlier)
    out = run(llm, PROMPT, greedy(24, stop_token_ids=[stop_id]))
    assert out.token_ids == ids[:end]
    assert out.token_ids[-1] == stop_id
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert greedy_ref.text.startswith(out.text)


def test_eos_stops_chat(llm, chat_ref):
    assert chat_ref.text.startswith(PARIS)
    assert chat_ref.finish_reason == "stop"
    assert chat_ref.stop_reason is None
    assert chat_ref.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert len(chat_ref.token_ids) < 24


def test_ignore_eos(llm, chat_ref):
    [out] = llm.chat(CHAT, greedy(24, ignore_eos=True), use_tqdm=False)
    out = out.outputs[0]
    assert len(out.token_ids) == 24
    assert out.finish_reason == "length"
    n = len(chat_ref.token_ids)
    assert out.token_ids[:n] == chat_ref.token_ids  # the EOS is sampled, then generation goes on


def test_min_tokens(llm, chat_ref):
    assert len(chat_ref.token_ids) < 10  # so min_tokens=10 really changes the outcome
    [out] = llm.chat(CHAT, greedy(24, min_tokens=10), use_tqdm=False)
    out = out.outputs[0]
    assert len(out.token_ids) >= 10
    eos = llm.tokenizer.eos_token_ids
    assert not any(t in eos for t in out.token_ids[:10])
    assert out.token_ids[: len(chat_ref.token_ids) - 1] == chat_ref.token_ids[:-1]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in eos
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24


def test_min_tokens_delays_stop_token_ids(llm, greedy_ref):
    ids = greedy_ref.token_ids
    stop_id = ids[2]
    if stop_id in ids[:2]:
        pytest.skip("the 3rd greedy token also occurs earlier")
    out = run(llm, PROMPT, greedy(24, stop_token_ids=[stop_id], min_tokens=6, ignore_eos=True))
    assert out.token_ids[:2] == ids[:2]
    assert stop_id not in out.token_ids[:6]  # banned until 6 tokens exist
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_id and out.stop_reason == stop_id and len(out.token_ids) > 6
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24


def test_stream_matches_generate(llm, greedy_ref):
    params = greedy(24, ignore_eos=True)
    chunks = list(llm.stream(PROMPT, params))
    assert len(chunks) > 1
    assert all(chunks)
    assert "".join(chunks) == greedy_ref.text


def test_stream_with_stop_string(llm, greedy_ref):
    stop, at = _pick_stop_string(greedy_ref.text)
    params = greedy(24, stop=[stop])
    expected = run(llm, PROMPT, params).text
    chunks = list(llm.stream(PROMPT, params))
    streamed = "".join(chunks)
    assert streamed == expected == greedy_ref.text[:at]
    assert stop not in streamed


def test_stream_closed_early_aborts(llm):
    it = llm.stream(PROMPT, greedy(24, ignore_eos=True))
    next(it)
    assert llm.has_unfinished_requests()
    it.close()
    assert not llm.has_unfinished_requests()


def test_abort_request(llm):
    pool = llm.scheduler.pool
    request_id = llm.add_request(STORY, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0),
                                 request_id="abort-me")
    assert request_id == "abort-me"
    outs = llm.step() + llm.step()
    assert outs == []
    assert llm.has_unfinished_requests()
    assert pool.num_free < pool.num_blocks
    llm.abort_request(request_id)
    assert pool.num_free == pool.num_blocks  # blocks come back at once
    while llm.has_unfinished_requests():
        outs += llm.step()
    # The aborted request's output is surfaced by the next step() call.
    outs += llm.step()
    assert [o.request_id for o in outs] == ["abort-me"]
    [completion] = outs[0].outputs
    assert completion.finish_reason == "abort"
    assert len(completion.token_ids) == 2  # one token from the prefill step, one from the decode step
    assert llm.step() == []
    assert not llm.has_unfinished_requests()
    assert pool.num_free == pool.num_blocks
    # The engine still works, and the id is free again.
    assert len(run(llm, PROMPT, greedy(4)).token_ids) == 4
    llm.abort_request(llm.add_request(PROMPT, greedy(4), request_id="abort-me"))
    llm.step()


def test_race_and_sort_paths_sample_the_same_distribution():
    """Unfiltered rows take the exponential race, filtered rows the sorted path (top_k = vocab filters
    nothing, so both must give softmax(x / T)): 20000 draws each, every token's frequency within 0.015."""
    from tidyrun.sampling import Sampler

    torch.manual_seed(0)
    x = torch.randn(1, 20) * 2
    want = torch.softmax(x[0] / 0.7, -1)
    sampler = Sampler()
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=20)):
        rows = x.repeat(4000, 1)
        counts = sum(torch.bincount(sampler(rows, [params] * 4000, [None] * 4000), minlength=20) for _ in range(5))
        assert (counts / counts.sum() - want).abs().max().item() < 0.015, params


def test_noise_drawn_ahead_gives_the_same_tokens():
    """``draw_race`` before the logits are final (the runner draws it while a grammar mask is filled) makes
    the draws ``__call__`` would: same tokens from equally seeded generators, racing, filtered and greedy
    rows mixed; a batch without racing rows draws nothing."""
    from tidyrun.sampling import Sampler

    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(top_k=7),
              SamplingParams(temperature=1.3), SamplingParams(top_p=0.5)]
    sampler = Sampler()
    for _ in range(3):
        seeds = [torch.Generator().manual_seed(i) for i in range(5)]
        ahead = [torch.Generator().manual_seed(i) for i in range(5)]
        race = sampler.draw_race(logits, params, ahead)
        assert race.rows == [0, 3]
        assert torch.equal(sampler(logits, params, ahead, race), sampler(logits, params, seeds))
        logits = torch.randn(5, 300)
    assert sampler.draw_race(logits, [params[1], params[2]], [None, None]).noise is None


def test_min_p_filters_before_top_p_as_vllm_does():
    """vLLM applies min-p to the whole tempered distribution, then top-k/top-p to what is left. With
    probabilities 0.4, 0.3, 0.2, 0.1, min_p=0.3 drops 0.1 (below 0.12); top_p=0.75 on the renormalised
    rest then drops 0.2 (the mass before it, 0.7 / 0.9 = 0.78, reaches 0.75). The other order keeps 0.2:
    top_p on the original sees 0.7 before it, and min-p's bar is then 0.3 * 0.4 / 0.9 = 0.13."""
    from tidyrun.sampling import Sampler

    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = Sampler().probabilities(logits, [SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75)])[0]
    assert torch.allclose(probs, torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7, atol=1e-6)
