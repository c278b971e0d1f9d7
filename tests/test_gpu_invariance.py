"""batch_invariant=True on CUDA in bf16: a row's result never depends on what else shares the step.

Without it, cuBLAS picks its algorithm by the number of rows and decode
splits a sequence's keys over more programs when fewer sequences share the
step, so the same prompt's greedy answer changed with the batch (5 of 8
prompts identical over 32 tokens on e1e9383). With it, every product runs
one reduction order per weight and attention never splits the keys, so the
logits, not just the tokens, are equal to the bit.
"""

from __future__ import annotations

import random

import pytest

from conftest import QUESTIONS
from tidyrun import LLM, SamplingParams

pytestmark = pytest.mark.gpu

NUM_TOKENS = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def chat_prompts(engine: LLM) -> list[dict]:
    return [{"prompt_token_ids": engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])}
            for q in QUESTIONS]


def tokens(engine: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def test_cuda_batched_equals_alone(default_model):
    """The 8 prompts batched, then each alone (whose prompt now mostly hits the prefix cache, so only its
    tail is prefilled): 8 of 8 identical over 32 greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(default_model, device="cuda", dtype="bfloat16", max_model_len=512, batch_invariant=True) as engine:
        prompts = chat_prompts(engine)
        batched = tokens(engine, prompts, params)
        alone = [tokens(engine, [p], params)[0] for p in prompts]
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(batched, alone)]
    print(f"\nbatched vs alone identical tokens: {same}")
    assert same == [NUM_TOKENS] * len(prompts), same


def test_ngram_speculation_equals_speculation_off(default_model):
    """Draft verification runs k + 1 query rows per sequence where decoding runs one: with invariance the
    accepted tokens are the ones plain greedy decoding gives, 8 of 8, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=512, batch_invariant=True)
    with LLM(default_model, **kw) as engine:
        plain = tokens(engine, chat_prompts(engine), params)
    with LLM(default_model, speculative=SPEC, **kw) as engine:
        spec = tokens(engine, chat_prompts(engine), params)
        stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0, stats  # verification did run multi-row queries
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(spec, plain)]
    print(f"\nspeculation on vs off identical tokens: {same}; {stats['spec_accepted_tokens']} drafts accepted")
    assert spec == plain, same


def test_random_batch_compositions_give_each_row_its_alone_logits(default_model):
    """Random requests (prompts of 1-300 tokens, 1-12 output tokens) in batches of 1-64, under a token budget
    that chunks long prompts so prefill chunks share steps with decodes: every request's prompt logits and
    the top-2 logits of every generated token equal, to the bit, those of the request run alone."""
    rng = random.Random(0)
    with LLM(default_model, device="cuda", dtype="bfloat16", max_model_len=512, batch_invariant=True,
             max_num_batched_tokens=256, enable_prefix_caching=False, logprobs_mode="raw_logits") as engine:
        vocab = engine.runner.model_config.vocab_size
        requests = [([rng.randrange(vocab) for _ in range(rng.randint(1, 300))],
                     SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True, logprobs=2,
                                    prompt_logprobs=1))
                    for _ in range(64)]

        def run(batch: list[int]) -> list[tuple]:
            outs = engine.generate([{"prompt_token_ids": requests[i][0]} for i in batch],
                                   [requests[i][1] for i in batch], use_tqdm=False)
            return [(o.outputs[0].token_ids,
                     [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
                     [None if step is None else {t: lp.logprob for t, lp in step.items()} for step in o.prompt_logprobs])
                    for o in outs]

        alone = [run([i])[0] for i in range(len(requests))]
        differing = []
        for size in (64, 37, 16, 5, 2):
            batch = rng.sample(range(len(requests)), size)
            for i, got in zip(batch, run(batch)):
                if got != alone[i]:
                    differing.append((size, i))
    assert not differing, f"(batch size, request) whose logits differ from the request alone: {differing}"
