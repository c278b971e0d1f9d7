"""Logprobs, prompt logprobs, penalties and token controls against transformers' fp32 model (CPU).

The references are computed from transformers' own logits of the same
default model: full forwards over the exact tokens tidyrun produced
(teacher-forced), and transformers' logits processors where one exists.
"""

from __future__ import annotations

import math

import pytest
import torch

from tidyrun import LLM, InvalidRequestError, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOL = 1e-4


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits at every position of ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_logprobs_and_prompt_logprobs_equal_transformers(llm, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        prompt, comp = out.prompt_token_ids, out.outputs[0]
        ref = ref_logprobs(hf_default_model, prompt + comp.token_ids)
        assert len(comp.logprobs) == len(comp.token_ids) == 8
        total = 0.0
        for t, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[len(prompt) - 1 + t]
            assert abs(entry[token].logprob - row[token].item()) <= TOL
            assert entry[token].rank == 1  # greedy: the sampled token is the most likely one
            top = row.topk(3)
            assert list(entry)[:1] == [token] and len(entry) == 3  # the sampled token is among the top 3
            for value, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(entry[tid].logprob - value) <= TOL
            assert entry[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
            total += entry[token].logprob
        assert comp.cumulative_logprob == pytest.approx(total, abs=1e-6)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[i], ref[i - 1]
            assert abs(entry[prompt[i]].logprob - row[prompt[i]].item()) <= TOL
            assert entry[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
            assert len(entry) in (2, 3)  # the prompt token and the top 2


def test_sampled_logprobs_are_the_models_raw_distribution(llm, hf_default_model):
    """Default mode "raw_logprobs": the model's own log-probabilities, whatever temperature and top-k do."""
    params = SamplingParams(n=3, temperature=1.3, top_k=20, seed=7, max_tokens=6, logprobs=0, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    for comp in out.outputs:
        ref = ref_logprobs(hf_default_model, out.prompt_token_ids + comp.token_ids)
        for t, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert list(entry) == [token]  # logprobs=0: the sampled token only
            row = ref[len(out.prompt_token_ids) - 1 + t]
            assert abs(entry[token].logprob - row[token].item()) <= TOL
            assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(comp.logprobs, comp.token_ids)))


def test_no_logprobs_unless_asked(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, seed=0), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_processed_logprobs_are_the_distribution_sampled_from(default_model, hf_default_model):
    """processed_logprobs: after the repetition penalty, temperature and top-k, exactly what was sampled from."""
    from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper

    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, seed=3, max_tokens=6, logprobs=5,
                            ignore_eos=True)
    with LLM(default_model, device="cpu", dtype="float32", max_model_len=256,
             logprobs_mode="processed_logprobs") as engine:
        out = engine.generate(PROMPTS[0], params, use_tqdm=False)[0]
        # At a low temperature most probabilities underflow to 0: the top-k must still be the real next tokens.
        cold = engine.generate(PROMPTS[0], SamplingParams(temperature=0.01, seed=0, max_tokens=1, logprobs=5),
                               use_tqdm=False)[0]
    entry = cold.outputs[0].logprobs[0]
    with torch.no_grad():
        first = hf_default_model(torch.tensor([cold.prompt_token_ids])).logits[0, -1].float()
    ref = (first / 0.01).log_softmax(-1)
    assert set(entry) >= set(ref.topk(5).indices.tolist())
    for tid, lp in entry.items():
        assert math.isfinite(lp.logprob) and abs(lp.logprob - ref[tid].item()) <= 1e-2 * max(1.0, abs(ref[tid].item()))
    prompt, comp = out.prompt_token_ids, out.outputs[0]
    ids = prompt + comp.token_ids
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].float()
    processors = [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    for t, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        pos = len(prompt) - 1 + t
        scores = logits[pos:pos + 1].clone()
        for proc in processors:
            scores = proc(torch.tensor([ids[:pos + 1]]), scores)
        ref = scores[0].log_softmax(-1)
        assert abs(entry[token].logprob - ref[token].item()) <= TOL
        assert math.fsum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-5)
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[tid].item()) <= TOL


def greedy_with(model, ids: list[int], n: int, process) -> list[int]:
    """Greedy continuation where ``process(logits, prompt, output)`` changes the last position's logits."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            out.append(int(process(logits, ids, out).argmax()))
    return out


def test_repetition_penalty_equals_transformers(llm, hf_default_model):
    from transformers import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(1.5)
    ids = llm.tokenizer.encode("one two one two one two one")
    ref = greedy_with(hf_default_model, ids, 10,
                      lambda logits, p, o: proc(torch.tensor([p + o]), logits[None])[0])
    out = llm.generate([ids], SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert plain != out  # the penalty changed something, so the comparison above means something


def test_presence_and_frequency_penalties_follow_vllms_formula(llm, hf_default_model):
    def penalised(logits, prompt, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float() \
            if output else torch.zeros_like(logits)
        return logits - 0.9 * counts - 1.1 * (counts > 0).float()

    ids = llm.tokenizer.encode("Repeat after me: cat cat cat cat")
    ref = greedy_with(hf_default_model, ids, 12, penalised)
    params = SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=1.1, max_tokens=12, ignore_eos=True)
    assert llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_logit_bias_allowed_tokens_and_bad_words(llm):
    prompt = "The capital of France is"
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logit_bias={str(forced): 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [forced] * 3
    allowed = llm.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=8, allowed_token_ids=allowed,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in plain
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, bad_words=["Paris"]),
                          use_tqdm=False)[0].outputs[0].text
    assert "Paris" not in banned


def test_detokenize_false_gives_token_ids_only(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=1, ignore_eos=True)
    text = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    params.detokenize = False
    ids = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert ids.token_ids == text.token_ids and ids.text == "" and text.text
    assert all(lp.decoded_token is None for entry in ids.logprobs for lp in entry.values())


def test_params_are_mutable_and_checked_at_submission(llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    params.max_tokens = 4  # verl sets attributes between rollouts
    assert len(llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    params.top_p = 1.5
    with pytest.raises(InvalidRequestError, match="top_p"):
        llm.generate(PROMPTS[0], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(InvalidRequestError, match="max_logprobs"):
        llm.generate(PROMPTS[0], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_logprobs"):  # -1 is the whole vocabulary, as in vLLM
        llm.generate(PROMPTS[0], SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    assert SamplingParams(n=2, best_of=2).n == 2


def test_request_in_flight_keeps_the_params_it_was_submitted_with(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    request_id = llm.add_request(PROMPTS[0], params)
    params.max_tokens = 1
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [len(o.outputs[0].token_ids) for o in outputs if o.request_id == request_id] == [6]


def test_greedy_logprobs_fast_path_equals_the_general_path(llm):
    """logprobs=0 on greedy requests comes from the argmax pass itself; it equals the general computation."""
    fast = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    general = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True),
                           use_tqdm=False)
    for a, b in zip(fast, general):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        for t, ea, eb in zip(ca.token_ids, ca.logprobs, cb.logprobs):
            assert list(ea) == [t] and ea[t].rank == 1
            assert abs(ea[t].logprob - eb[t].logprob) <= 1e-5


def test_sampled_logprobs_fast_path_equals_the_general_path(llm, hf_default_model):
    """logprobs=0 on sampled requests without top-k/p (TRL's rollouts) comes from the sampling race itself:
    the same tokens as without logprobs and as in a step that processes logits for another request, the
    same log-probabilities and ranks, and those are the model's own."""
    rollout = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=8, logprobs=0, ignore_eos=True)
    silent = rollout.clone()
    silent.logprobs = None
    penalised = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=8, ignore_eos=True)
    fast = llm.generate(PROMPTS[0], rollout, use_tqdm=False)[0]
    plain = llm.generate(PROMPTS[0], silent, use_tqdm=False)[0]
    general = llm.generate(PROMPTS, [rollout, penalised], use_tqdm=False)[0]
    for cf, cp, cg in zip(fast.outputs, plain.outputs, general.outputs):
        assert cf.token_ids == cp.token_ids == cg.token_ids
        assert cp.logprobs is None
        ref = ref_logprobs(hf_default_model, fast.prompt_token_ids + cf.token_ids)
        for t, (token, ef, eg) in enumerate(zip(cf.token_ids, cf.logprobs, cg.logprobs)):
            assert list(ef) == [token] and ef[token].rank == eg[token].rank
            assert abs(ef[token].logprob - eg[token].logprob) <= 1e-5
            row = ref[len(fast.prompt_token_ids) - 1 + t]
            assert abs(ef[token].logprob - row[token].item()) <= TOL
            assert ef[token].rank == int((row > row[token]).sum()) + 1


def test_sampling_without_logprobs_computes_none(llm, monkeypatch):
    """A step where nobody asked for logprobs races without computing them (their cost is only paid when asked)."""
    asked = []
    race = llm.runner.sampler.race

    def spy(logits, noise, scale, want_logprob):
        asked.append(want_logprob)
        return race(logits, noise, scale, want_logprob)

    monkeypatch.setattr(llm.runner.sampler, "race", spy)
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True), use_tqdm=False)
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=3, logprobs=0, ignore_eos=True),
                 use_tqdm=False)
    assert asked == [False] * 3 + [True] * 3


def test_ignore_eos_keeps_a_structured_sequence_going(llm):
    """EOS would end a structured sequence; with ignore_eos (and min_tokens) it continues to max_tokens."""
    import re

    from tidyrun import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="(ab)+"))
    out = llm.generate("Repeat ab:", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert re.fullmatch(r"(ab)*a?", out.text), out.text


def test_flat_logprobs_read_as_the_list_of_dicts(llm):
    """vLLM's flat_logprobs=True: one FlatLogprobs per output (and for the prompt) holding the same entries as
    the list form, read the same way; the first prompt position is empty ({}), as in vLLM."""
    from collections.abc import MutableSequence

    from tidyrun.logprobs import FlatLogprobs, Logprob

    kw = dict(temperature=1.0, seed=3, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True, n=2)
    nested, flat = (llm.generate(PROMPTS[1], SamplingParams(flat_logprobs=f, **kw), use_tqdm=False)[0]
                    for f in (False, True))
    for a, b in zip(nested.outputs, flat.outputs):
        assert isinstance(b.logprobs, FlatLogprobs) and isinstance(b.logprobs, MutableSequence)
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == 6
        assert list(b.logprobs) == a.logprobs and [b.logprobs[t] for t in range(-6, 0)] == a.logprobs
        assert b.logprobs[t := 2][b.token_ids[t]].logprob == a.logprobs[t][a.token_ids[t]].logprob
        assert list(b.logprobs[1:4]) == a.logprobs[1:4] and list(b.logprobs[::-2]) == a.logprobs[::-2]
        assert b.cumulative_logprob == a.cumulative_logprob
        assert len(b.logprobs.token_ids) == sum(len(d) for d in a.logprobs)  # flat lists, no dicts kept
    assert nested.prompt_logprobs[0] is None and flat.prompt_logprobs[0] == {}
    assert list(flat.prompt_logprobs)[1:] == nested.prompt_logprobs[1:]
    with pytest.raises(TypeError, match="append-only"):
        flat.outputs[0].logprobs[0] = {1: Logprob(0.0)}
    with pytest.raises(TypeError, match="append-only"):
        del flat.outputs[0].logprobs[0]
    with pytest.raises(InvalidRequestError, match="flat_logprobs must be a bool"):
        SamplingParams(flat_logprobs=1)


def test_skip_reading_prefix_cache_recomputes_the_prompt(llm):
    prompt = "Once upon a time, in a land far away, there lived a dragon who loved " * 3
    greedy = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate(prompt, greedy, use_tqdm=False)[0]
    cached = llm.generate(prompt, greedy, use_tqdm=False)[0]
    skipped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, skip_reading_prefix_cache=True),
                           use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0 and skipped.num_cached_tokens == 0
    assert first.outputs[0].token_ids == cached.outputs[0].token_ids == skipped.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="skip_reading_prefix_cache must be a bool or None"):
        SamplingParams(skip_reading_prefix_cache="yes")
