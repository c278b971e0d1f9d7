"""n-gram speculation: greedy output identical to plain decoding, sampling distribution unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import QUESTIONS
from tidyrun import LLM, InvalidRequestError, SamplingParams
from tidyrun.sampling import Sampler
from tidyrun.spec_decode import NgramProposer, verify_drafts

REPETITIVE = [
    "Repeat this exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\nRewrite the function above with type hints.",
    "Quote: 'to be or not to be, that is the question'. Now quote it again: 'to be or not",
]
SPEC = {"num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_ngram_proposer():
    p = NgramProposer(3, prompt_lookup_max=3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], limit=10) == [4, 9, 1]  # longest suffix [1,2,3] seen before
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], limit=2) == [4, 9]
    assert p.propose([5, 6, 7, 8], limit=10) == []  # nothing repeats
    assert p.propose([7, 1, 7, 2, 7], limit=10) == [2, 7]  # latest earlier occurrence of [7]
    assert p.propose([1, 2, 1, 2], limit=0) == []


def test_bad_speculative_config(tiny_llama_dir):
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_max": 0},
                {"prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"bogus": 1}, "ngram"):
        with pytest.raises(InvalidRequestError):
            LLM(tiny_llama_dir, device="cpu", speculative=bad)


def test_rejection_sampling_keeps_the_target_distribution():
    """Emitted tokens follow p exactly: P(t0=j) = p0(j); P(t0=d0, t1=j) = p0(d0) p1(j)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    drafts = [2, 4]
    params = SamplingParams(temperature=0.9, top_k=5)
    sampler = Sampler()
    p = sampler.probabilities(logits, [params] * 3)
    gen = torch.Generator().manual_seed(1)
    trials = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for _ in range(trials):
        out = verify_drafts(sampler, logits, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    expected_first = p[0] * trials
    expected_second = p[0, drafts[0]] * p[1] * trials
    for observed, expected in ((first, expected_first), (second, expected_second)):
        sigma = expected.clamp(min=1).sqrt()
        assert ((observed - expected).abs() / sigma).max() < 5, (observed, expected)
    assert first[p[0] == 0].sum() == 0  # filtered-out tokens are never emitted


@pytest.fixture(scope="module")
def engines(default_model):
    plain = LLM(default_model, device="cpu", max_model_len=512, enable_prefix_caching=False)
    spec = LLM(default_model, device="cpu", max_model_len=512, enable_prefix_caching=False, speculative=SPEC)
    yield plain, spec
    plain.shutdown()
    assert spec.shutdown().clean


def chat(llm: LLM, texts):
    return [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": t}])} for t in texts]


def test_greedy_identical_with_and_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = chat(plain, REPETITIVE + list(QUESTIONS[:3]))
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    before = spec.stats()
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    after = spec.stats()
    assert got == expected
    proposed = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    print(f"\ndrafts proposed {proposed}, accepted {accepted} ({accepted / max(proposed, 1):.0%})")
    assert proposed > 0 and accepted > 0


def test_each_prompt_alone_matches_too(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    for prompt in chat(plain, REPETITIVE):
        a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert b.token_ids == a.token_ids and len(b.token_ids) == 37 and b.text == a.text


def test_stop_string_with_speculation(engines):
    plain, spec = engines
    prompt = chat(plain, REPETITIVE[:1])
    text = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    stop = text[10:16]
    a = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    b = spec.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (b.text, b.finish_reason, b.stop_reason) == (a.text, "stop", stop)


def test_speculation_under_preemption_and_prefix_caching(default_model, engines):
    plain, _ = engines
    prompts = chat(plain, REPETITIVE + list(QUESTIONS[:5]))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(default_model, device="cpu", max_model_len=256, num_kv_blocks=24, speculative=SPEC) as small:
        for _ in range(2):  # the second round also hits the prefix cache
            assert [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)] == expected
        assert small.scheduler.num_preemptions > 0
        assert small.scheduler.pool.num_free == small.scheduler.pool.num_blocks


def test_sampling_with_speculation_respects_limits(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=3, n=4)
    out = spec.generate(chat(spec, REPETITIVE[:1]), params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [30] * 4
