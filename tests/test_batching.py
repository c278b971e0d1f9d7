"""Continuous batching gives each request the output it would get alone."""

from __future__ import annotations

import pytest

from conftest import QUESTIONS
from tidyrun import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llm):
    return [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])}
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batched_equals_alone(llm, prompts, alone):
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert all(len(t) == 32 for t in alone)
    assert len({tuple(t) for t in alone}) == len(alone)


def test_outputs_come_back_in_prompt_order(llm, prompts, alone):
    params = [SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts[::-1], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, alone[::-1])):
        assert out.outputs[0].token_ids == ref[: 4 + 4 * i]


def test_preemption_under_tiny_kv_budget(default_model, prompts, alone):
    # 20 blocks x 16 = 320 token slots for 8 sequences of ~80 tokens each: preemption is unavoidable.
    with LLM(default_model, device="cpu", max_model_len=256, num_kv_blocks=20, block_size=16) as small:
        outs = small.generate(prompts, GREEDY, use_tqdm=False)
        assert small.scheduler.num_preemptions > 0
        assert small.scheduler.pool.num_free == small.scheduler.pool.num_blocks
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_chunked_prefill(default_model, prompts, alone):
    with LLM(default_model, device="cpu", max_model_len=256, max_num_batched_tokens=24) as chunked:
        outs = chunked.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone[:3]


def test_finished_requests_free_their_blocks(llm, prompts):
    pool = llm.scheduler.pool
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert pool.num_free == pool.num_blocks
    assert not llm.has_unfinished_requests()
