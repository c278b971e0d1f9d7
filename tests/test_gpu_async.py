"""Async scheduling on CUDA (graphs, Triton kernels, pinned token copies): the same tokens as synchronous
steps, and nothing left behind.

A step launched ahead still holds the rows of sequences that finished in the step before it, so batches
differ from the synchronous engine's at the step after a finish: without ``batch_invariant`` a row's bf16
logits may then differ (test_gpu_invariance.py says why). With every output the same length nothing
finishes early and the batches are the same; with ``batch_invariant=True`` any lengths must agree.
"""

from __future__ import annotations

import pytest

from conftest import QUESTIONS
from tidyrun import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def outputs(default_model, params, modes=(False, True), **kw) -> dict:
    """Per async_scheduling value in ``modes``: each request's (tokens, finish reason, logprob records)."""
    got = {}
    for a in modes:
        with LLM(default_model, device="cuda", dtype="bfloat16", max_model_len=512, async_scheduling=a,
                 **kw) as engine:
            prompts = [{"prompt_token_ids": engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])}
                       for q in QUESTIONS]
            counts = {"launched": 0}
            launch = engine._pipeline._launch
            engine._pipeline._launch = lambda *args: counts.__setitem__("launched", counts["launched"] + 1) or launch(*args)
            got[a] = [[(c.token_ids, c.finish_reason, None if c.logprobs is None else
                        [[(t, v.rank, v.logprob) for t, v in d.items()] for d in c.logprobs]) for c in o.outputs]
                      for o in engine.generate(prompts, params, use_tqdm=False)]
            assert (counts["launched"] > 0) == a, counts  # the async engine ran its steps ahead
            assert engine._pipeline._in_flight is None
        assert engine.shutdown().clean
    return got


def assert_same(got: dict) -> None:
    """Async (``got[True]``) equals sync (``got[False]``); else fail naming the first request, sample and token
    where they part, short enough to survive a log's tail (one such failure was seen once and not explained)."""
    for i, (ahead, sync) in enumerate(zip(got[True], got[False])):
        for j, ((a_tok, a_why, a_rec), (s_tok, s_why, s_rec)) in enumerate(zip(ahead, sync)):
            if (a_tok, a_why, a_rec) != (s_tok, s_why, s_rec):
                t = next((k for k, (x, y) in enumerate(zip(a_tok, s_tok)) if x != y), min(len(a_tok), len(s_tok)))
                raise AssertionError(f"request {i} sample {j}: async {len(a_tok)} tokens ({a_why}), sync "
                                     f"{len(s_tok)} ({s_why}); tokens part at {t}: {a_tok[t:t + 3]} vs {s_tok[t:t + 3]}; "
                                     f"records equal: {a_rec == s_rec}")
    assert len(got[True]) == len(got[False]) and got[True] == got[False]


def test_cuda_async_equals_sync_at_equal_lengths(default_model):
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)] * 4
    got = outputs(default_model, params)
    assert_same(got)


def test_cuda_async_equals_sync_batch_invariant(default_model):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 50, 17, 64)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=n) for s, n in ((1, 9), (2, 40), (3, 1), (4, 30))]
    got = outputs(default_model, params, batch_invariant=True)
    assert_same(got)


def test_cuda_rollout_logprobs_ahead_equal_sync(default_model):
    """An RL rollout (logprobs=0, greedy and sampled from the whole distribution, n=2): launched ahead, the
    same tokens, ranks and log-probabilities (bit for bit: batch-invariant, so any lengths)."""
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0) for n in (5, 40, 23, 64)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=n, logprobs=0, n=2) for s, n in ((1, 30), (2, 12))]
    params += [SamplingParams(temperature=1.0, seed=9, max_tokens=20), SamplingParams(temperature=0, max_tokens=33)]
    got = outputs(default_model, params, batch_invariant=True)
    assert_same(got)
    assert all(c[2] is not None for o in got[True][:6] for c in o) and got[True][6][0][2] is None



def test_cuda_processed_steps_sampled_after_booking_equal_sync(default_model):
    """Grammars, penalties, bans and min_tokens (with logprobs=0): the forward launched ahead, the step
    sampled once the step before is booked; bit for bit the synchronous engine's tokens and records."""
    from tidyrun import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, logprobs=0,
                             structured_outputs=StructuredOutputsParams(json=schema)) for s in range(3)]
    params += [SamplingParams(temperature=1.0, seed=7, max_tokens=30, repetition_penalty=1.2, logprobs=0),
               SamplingParams(temperature=0, max_tokens=25, min_tokens=20, presence_penalty=0.4),
               SamplingParams(temperature=1.0, seed=8, max_tokens=12, n=2,
                              structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"])),
               # plain rollout rows that outlive the processed ones: their steps' records as execute takes them
               SamplingParams(temperature=0, max_tokens=90, logprobs=0),
               SamplingParams(temperature=0.8, seed=2, max_tokens=80, logprobs=0)]
    got = outputs(default_model, params, batch_invariant=True)
    assert_same(got)


def test_cuda_masked_race_gives_the_processed_paths_tokens(default_model, monkeypatch):
    """Grammar rows whose mask is their only processing: the masked race (Triton, bf16 logits read as they
    are) gives the processed path's tokens and ranks, raw log-probabilities within 1e-4 (two kernels'
    logsumexps), synchronous and ahead (the CPU test checks the outputs' validity)."""
    from test_async_scheduling import MASKED, count_calls, masked_params
    from tidyrun.runner.model_runner import ModelRunner

    params = masked_params(MASKED) + [SamplingParams(temperature=0, max_tokens=20)]  # a row per question
    calls = count_calls(monkeypatch, ModelRunner, "_masked_race")
    got = outputs(default_model, params, batch_invariant=True)
    assert calls["_masked_race"] >= 30, calls  # both engines, sync and ahead
    monkeypatch.setattr(ModelRunner, "_masked_one_pass", lambda self, seqs: False)
    processed = outputs(default_model, params, modes=(False,), batch_invariant=True)
    for a in (False, True):
        for mine, theirs in zip(got[a], processed[False]):
            for (tokens, reason, recs), (want_tokens, want_reason, want_recs) in zip(mine, theirs):
                assert tokens == want_tokens and reason == want_reason
                assert (recs is None) == (want_recs is None)
                if recs is not None:
                    assert [[(t, r) for t, r, _ in d] for d in recs] == [[(t, r) for t, r, _ in d] for d in want_recs]
                    assert max(abs(v - w) for d, e in zip(recs, want_recs) for (_, _, v), (_, _, w) in zip(d, e)) <= 1e-4
    assert_same(got)


def test_cuda_steps_sampled_ahead_never_wait_for_the_device(default_model, monkeypatch):
    """Launching a step and sampling a deferred one happen while the forward pass before runs: nothing in them
    may synchronize the stream. A blocking upload (``torch.tensor(rows, device=...)``, a pageable ``.to(dev)``,
    a list index or a Python scalar assigned into a CUDA tensor) made the host wait for that forward pass and
    the device then idle while the host booked and launched: ~1 ms a JSON step on the 8B shape
    (docs/BENCHMARKS.md). torch's sync debug mode raises on each such call. Four groups, one per way a step is
    run ahead: plain rows sampled at launch (greedy, the race, the filtered sampler), the RL rollout's one-pass
    records, grammar rows through the masked race, and processed rows (penalties, bans, bias, allowed ids)."""
    import torch

    from test_async_scheduling import MASKED, count_calls, masked_params
    from tidyrun.runner.model_runner import ModelRunner

    def no_sync(method):
        def checked(self, *args, **kwargs):
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(before)
        return checked

    calls = count_calls(monkeypatch, ModelRunner, "_plain_tokens", "_one_pass_records", "_masked_race", "_draw_rows")
    for name in ("launch", "sample_launched"):
        monkeypatch.setattr(ModelRunner, name, no_sync(getattr(ModelRunner, name)))
    plain = [SamplingParams(temperature=0, max_tokens=n) for n in (9, 30)]
    plain += [SamplingParams(temperature=1.0, seed=s, max_tokens=n) for s, n in ((1, 25), (2, 7))]
    plain += [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=s, max_tokens=n)
              for s, n in ((3, 20), (4, 33), (5, 12), (6, 28))]
    rollout = [SamplingParams(temperature=t, seed=s, max_tokens=n, logprobs=0, n=2)
               for t, s, n in ((1.0, 1, 30), (0, None, 20), (1.0, 2, 12), (1.0, 3, 25))] * 2
    masked = masked_params(MASKED) + [SamplingParams(temperature=0, max_tokens=20)]
    processed = [SamplingParams(temperature=1.0, seed=1, max_tokens=30, repetition_penalty=1.2,
                                presence_penalty=0.3, frequency_penalty=0.2, logprobs=0),
                 SamplingParams(temperature=0.7, top_p=0.8, seed=2, max_tokens=25, min_tokens=10,
                                logit_bias={5: 2.0}, bad_words=["the"]),
                 SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=list(range(100, 2000))),
                 SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5)] * 2
    for name, params, ran in (("plain", plain, "_plain_tokens"), ("rollout", rollout, "_one_pass_records"),
                              ("masked", masked, "_masked_race"), ("processed", processed, "_draw_rows")):
        calls.update(dict.fromkeys(calls, 0))
        got = outputs(default_model, params, modes=(True,))
        assert all(reason in ("stop", "length") for o in got[True] for _, reason, _ in o), (name, got)
        assert calls[ran] >= 5, (name, calls)  # the group's own path ran ahead, step after step
