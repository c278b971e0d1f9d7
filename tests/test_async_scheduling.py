"""Async scheduling (``LLM(async_scheduling=True)``, pipeline.py): the next step is launched before the
host reads the last one's tokens. Every test compares against the synchronous engine on the same requests:
the tokens, texts, finish reasons and logprobs must not change, whatever runs ahead, preempts, aborts or
fails; and no launched step may outlive its sequences."""

from __future__ import annotations

import pytest
import torch

from tidyrun import LLM, SamplingParams
from tidyrun.errors import InvalidRequestError

from conftest import QUESTIONS


@pytest.fixture(scope="module")
def engines(default_model):
    """A synchronous and an async engine on the default model (CPU, fp32)."""
    made = {a: LLM(default_model, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16,
                   async_scheduling=a) for a in (False, True)}
    yield made
    for engine in made.values():
        engine.shutdown()


def count_launches(llm: LLM) -> dict:
    """Counts of steps launched ahead and steps run synchronously, by wrapping the pipeline's two paths."""
    pipeline, counts = llm._pipeline, {"launched": 0, "run": 0}
    launch, run = pipeline._launch, pipeline._run

    def counted_launch(*args):
        counts["launched"] += 1
        return launch(*args)

    def counted_run(*args):
        counts["run"] += 1
        return run(*args)

    pipeline._launch, pipeline._run = counted_launch, counted_run
    return counts


def summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [{t: round(v.logprob, 5) for t, v in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outputs]


MIXED = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=1),
         SamplingParams(temperature=1.0, seed=11, max_tokens=30), SamplingParams(temperature=0.7, top_p=0.9, top_k=40,
                                                                                 seed=5, max_tokens=20, n=2),
         SamplingParams(temperature=0, max_tokens=40, stop=[".", "\n"]),
         SamplingParams(temperature=1.0, seed=3, max_tokens=16, stop_token_ids=[13, 28]),
         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=48)]


def test_plain_requests_give_the_same_tokens_and_run_ahead(engines):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    counts = count_launches(engines[True])
    sync = engines[False].chat(prompts, MIXED, use_tqdm=False)
    ahead = engines[True].chat(prompts, MIXED, use_tqdm=False)
    assert summary(ahead) == summary(sync)
    assert counts["launched"] >= 48 and counts["run"] == 0, counts  # every step ran ahead
    assert engines[True]._pipeline._in_flight is None  # the step after the last finish was dropped


def test_steps_with_wide_logprobs_run_synchronously_and_agree(engines):
    """Top-k logprobs and prompt logprobs need more than one record per token on the host: those steps run
    as before (and a batch mixing them with plain requests too), with the same results."""
    params = MIXED[:4] + [SamplingParams(temperature=0, max_tokens=20, logprobs=2),
                          SamplingParams(temperature=1.0, seed=9, max_tokens=12, prompt_logprobs=1)]
    counts = count_launches(engines[True])
    sync = engines[False].generate(list(QUESTIONS[:6]), params, use_tqdm=False)
    ahead = engines[True].generate(list(QUESTIONS[:6]), params, use_tqdm=False)
    assert summary(ahead) == summary(sync)
    assert [o.prompt_logprobs for o in ahead][5] == [o.prompt_logprobs for o in sync][5]
    assert counts["run"] > 0, counts
    # Alone, the plain ones run ahead again.
    counts = count_launches(engines[True])
    assert summary(engines[True].generate(list(QUESTIONS[:4]), params[:4], use_tqdm=False)) == summary(sync[:4])
    assert counts["launched"] > 0 and counts["run"] == 0, counts


def test_processed_steps_launch_ahead_and_sample_after_booking(engines):
    """Penalties, bias, bans, min_tokens, logprobs=0 of processed rows and grammars: the forward pass is
    launched ahead and the step sampled once the step before is booked (``launch(defer=True)``). Same
    tokens as the synchronous engine, logprobs within ``ROUNDING`` (the CPU's BLAS rounds a row by its batch: a
    finished sequence is computed once more ahead), every grammar output valid, every step ahead."""
    from tidyrun import StructuredOutputsParams

    tok = engines[False].get_tokenizer()
    banned = tok.encode(" the", add_special_tokens=False)
    params = MIXED[:3] + [
        SamplingParams(temperature=1.0, seed=9, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=15, logprobs=0),
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3,
                       logprobs=0),
        SamplingParams(temperature=0, max_tokens=16, logit_bias={banned[0]: -100.0}, bad_words=["Paris"]),
        SamplingParams(temperature=0.9, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, n=2,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, logprobs=0,
                       structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}")),
        SamplingParams(temperature=0, max_tokens=60, logprobs=0),  # outlives the processed rows
    ]
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(len(params))]
    counts = count_launches(engines[True])
    sync = engines[False].generate(prompts, params, use_tqdm=False)
    ahead = engines[True].generate(prompts, params, use_tqdm=False)
    assert_same_records(ahead, sync)
    assert [[c.text for c in o.outputs] for o in ahead] == [[c.text for c in o.outputs] for o in sync]
    assert isinstance(__import__("json").loads(ahead[7].outputs[0].text)["a"], int)
    assert all(c.text in ("yes", "no", "maybe") for c in ahead[8].outputs)
    assert __import__("re").fullmatch(r"[0-9]{3}-[a-z]{2,5}", ahead[9].outputs[0].text)
    assert counts["launched"] >= 20 and counts["run"] == 0, counts  # every step ran ahead
    assert engines[True]._pipeline._in_flight is None


def records(outputs) -> list:
    """Per completion: tokens, ranks, log-probabilities and the cumulative sum."""
    return [(c.token_ids, None if c.logprobs is None else [[(t, v.rank, v.logprob) for t, v in d.items()]
                                                           for d in c.logprobs], c.cumulative_logprob)
            for o in outputs for c in o.outputs]


# How far a fp32 log-probability moves on the CPU when its row is computed beside other rows: MKL blocks a
# product by its row count, so a step launched ahead (which may hold a finished sequence's row) rounds each
# row differently. How far depends on the kernels MKL picks for the processor. Measured with
# test_processed_steps_launch_ahead_and_sample_after_booking: at most 1.14e-5 (a logprob of -2.39) on an
# AMD EPYC through MKL's AVX-512 kernels, at most 5e-6 on the same machine with MKL_CBWR=AVX2; tokens and
# ranks were identical in both. 5e-5 leaves room for other processors; a logic error (a stale penalty, a
# wrong mask) moves a logprob by orders of magnitude more, and the tokens and ranks stay compared exactly.
ROUNDING = 5e-5


def assert_same_records(ahead, sync) -> None:
    """The same tokens and ranks, log-probabilities within ``ROUNDING`` (the CPU's BLAS rounds a row by the rows
    beside it, and a step launched ahead may hold a finished sequence's row), cumulative sums their sum."""
    for (tokens, recs, total), (want_tokens, want_recs, want_total) in zip(records(ahead), records(sync)):
        assert tokens == want_tokens
        assert (recs is None) == (want_recs is None)
        if recs is not None:
            assert [[(t, r) for t, r, _ in d] for d in recs] == [[(t, r) for t, r, _ in d] for d in want_recs]
            values = [v for d in recs for _, _, v in d]
            assert max(abs(v - w) for v, w in zip(values, (w for d in want_recs for _, _, w in d))) <= ROUNDING
            assert total == pytest.approx(want_total, abs=1e-4) and total == pytest.approx(sum(values), abs=1e-6)


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0, max_tokens=20, logprobs=0), SamplingParams(temperature=0, max_tokens=9),
     SamplingParams(temperature=0, max_tokens=30, logprobs=0)],  # every row greedy: the argmax pass
    [SamplingParams(temperature=0, max_tokens=20, logprobs=0),
     SamplingParams(temperature=1.0, seed=4, max_tokens=25, logprobs=0, n=2),
     SamplingParams(temperature=0.8, seed=8, max_tokens=18)],  # sampled from the whole distribution: the race
], ids=["greedy", "race"])
def test_rollout_logprobs_run_ahead_with_the_same_records(engines, params):
    """An RL rollout's ``logprobs=0`` (TRL, verl): the record comes from the pass that picks the token, so
    those steps run ahead too, with the same tokens and ranks and the same log-probabilities within ``ROUNDING``:
    a sequence that finished is computed once more ahead, so some steps hold another number of rows, and
    the CPU's BLAS rounds a row's logits by the rows beside it (``batch_invariant`` removes that on CUDA)."""
    counts = count_launches(engines[True])
    sync = engines[False].generate(list(QUESTIONS[:3]), params, use_tqdm=False)
    ahead = engines[True].generate(list(QUESTIONS[:3]), params, use_tqdm=False)
    assert_same_records(ahead, sync)
    longest = max(len(c.token_ids) for o in ahead for c in o.outputs)
    assert counts["launched"] >= longest and counts["run"] == 0, counts  # every step ran ahead
    assert all((c.logprobs is None) == (p.logprobs is None) for o, p in zip(ahead, params) for c in o.outputs)


def step_until_done(llm: LLM, script: dict) -> dict:
    """Drive ``step()`` by hand: ``script`` maps a step number to ("add", key, prompt, params) or
    ("abort", key) actions taken before that step; returns the outputs by key."""
    ids, results, n = {}, {}, 0
    while n in script or llm.has_unfinished_requests() or any(k > n for k in script):
        for action in script.get(n, []):
            if action[0] == "add":
                ids[action[1]] = llm.add_request(action[2], action[3])
            else:
                llm.abort_request(ids[action[1]])
        for out in llm.step():
            results[next(k for k, v in ids.items() if v == out.request_id)] = out
        n += 1
    return results


def test_requests_added_and_aborted_while_a_step_runs_ahead(engines):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    script = {0: [("add", "a", QUESTIONS[0], greedy), ("add", "b", QUESTIONS[1], greedy)],
              5: [("add", "c", QUESTIONS[2], SamplingParams(temperature=1.0, seed=4, max_tokens=25))],
              9: [("abort", "b")], 12: [("add", "d", QUESTIONS[3], SamplingParams(temperature=0, max_tokens=8))]}
    sync, ahead = step_until_done(engines[False], script), step_until_done(engines[True], script)
    assert sorted(ahead) == sorted(sync) == ["a", "b", "c", "d"]
    for key in "acd":
        assert summary([ahead[key]]) == summary([sync[key]]), key
    assert ahead["b"].outputs[0].finish_reason == sync["b"].outputs[0].finish_reason == "abort"
    assert ahead["b"].outputs[0].token_ids == sync["b"].outputs[0].token_ids  # the tokens booked before the abort
    assert engines[True]._pipeline._in_flight is None


def test_aborting_every_request_drops_the_step_in_flight(engines):
    llm = engines[True]
    rid = llm.add_request(QUESTIONS[4], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(4):
        llm.step()
    assert llm._pipeline._in_flight is not None  # a step runs ahead between calls
    llm.abort_request(rid)
    assert llm._pipeline._in_flight is None
    (out,) = llm.step()
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 4


def test_preemption_and_the_context_limit_under_async(default_model):
    """A KV cache too small for the batch (sequences preempted while their next token is pending) and
    outputs running into max_model_len give the same outputs as the synchronous engine."""
    params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=200, ignore_eos=True)] * 3
    prompts = [q * 3 for q in QUESTIONS[:6]]
    results, preemptions = {}, {}
    for a in (False, True):
        llm = LLM(default_model, device="cpu", dtype="float32", max_model_len=96, num_kv_blocks=14,
                  block_size=16, async_scheduling=a)
        try:
            results[a] = summary(llm.generate(prompts, params, use_tqdm=False))
            preemptions[a] = llm.stats()["preemptions"]
        finally:
            llm.shutdown()
    assert results[True] == results[False]
    assert preemptions[True] > 0 and preemptions[False] > 0, preemptions
    assert all(c[2] == "length" for r in results[True] for c in r)


def test_a_failing_launch_aborts_its_requests_and_the_engine_recovers(engines):
    llm = engines[True]
    runner, calls = llm.runner, {"n": 0}
    launch = runner.launch

    def failing(batch, after, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost (simulated)")
        return launch(batch, after, **kw)

    runner.launch = failing
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            llm.generate(list(QUESTIONS[:3]), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
    finally:
        del runner.launch
    assert llm._pipeline._in_flight is None and not llm.scheduler.has_unfinished()
    aborted = llm.step()  # the failed call's requests end with "abort", as a failing synchronous step's do
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"] * 3
    again = llm.generate(list(QUESTIONS[:3]), SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    sync = engines[False].generate(list(QUESTIONS[:3]), SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert summary(again) == summary(sync)


def test_sleep_and_shutdown_with_a_step_launched_ahead(default_model):
    llm = LLM(default_model, device="cpu", dtype="float32", max_model_len=256, async_scheduling=True)
    try:
        llm.generate(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        llm.sleep(1)
        llm.wake_up()
        rid = llm.add_request(QUESTIONS[1], SamplingParams(temperature=0, max_tokens=50))
        llm.step(), llm.step()
        assert llm._pipeline._in_flight is not None
    finally:
        report = llm.shutdown()
    assert report.clean, report
    assert [o.request_id for o in report.aborted] == [rid]


@pytest.mark.parametrize("options, message", [
    (dict(async_scheduling=True, speculative={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
    (dict(async_scheduling="yes"), "async_scheduling must be a bool"),
])
def test_refused_options_are_named(default_model, options, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(default_model, device="cpu", **options)


def test_default_overlaps_steps_only_where_it_applies(default_model):
    """None (vLLM's default): on for a CUDA device with one rank and no speculation; off on the CPU, where
    the "device" computes while the host launches and nothing would overlap; an explicit value wins."""
    from tidyrun.config import EngineConfig, SpeculativeConfig

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert EngineConfig(model="m").overlaps_steps(cuda)
    assert not EngineConfig(model="m").overlaps_steps(cpu)
    assert not EngineConfig(model="m", async_scheduling=False).overlaps_steps(cuda)
    assert EngineConfig(model="m", async_scheduling=True).overlaps_steps(cpu)
    ngram = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2})
    spec = EngineConfig(model="m", speculative=ngram)
    assert not spec.overlaps_steps(cuda)
    assert not EngineConfig(model="m", tensor_parallel_size=2).overlaps_steps(cuda)
    llm = LLM(default_model, device="cpu", dtype="float32", max_model_len=256)
    try:
        assert not llm._pipeline.ahead
    finally:
        llm.shutdown()


MASKED = (  # grammar rows whose mask is their only processing, beside plain rows
    dict(temperature=1.0, seed=3, max_tokens=40, logprobs=0, json={"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}}, "required": ["a", "b"],
        "additionalProperties": False}),
    dict(temperature=0, max_tokens=40, logprobs=0, json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"], "additionalProperties": False}),
    dict(temperature=1.0, seed=4, max_tokens=20, n=2, choice=["yes", "no", "maybe"]),
    dict(temperature=0.7, seed=5, max_tokens=20, regex=r"[0-9]{3}-[a-z]{2,5}"),
    dict(temperature=0, max_tokens=30, logprobs=0),
    dict(temperature=1.0, seed=6, max_tokens=25, logprobs=0),
    dict(temperature=0.9, seed=7, max_tokens=12),
)


def count_calls(monkeypatch, owner, *names) -> dict:
    """Counts of calls of ``owner``'s methods ``names`` (wrapped for the test)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(owner, name)

        def counted(self, *args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


def masked_params(cases) -> list[SamplingParams]:
    from tidyrun import StructuredOutputsParams

    out = []
    for case in cases:
        case = dict(case)
        spec = {k: case.pop(k) for k in ("json", "choice", "regex") if k in case}
        if "json" in spec:
            spec["disable_any_whitespace"] = True
        out.append(SamplingParams(**case, structured_outputs=StructuredOutputsParams(**spec) if spec else None))
    return out


@pytest.mark.parametrize("extra", [None, dict(temperature=1.0, seed=8, max_tokens=10, repetition_penalty=1.2)],
                         ids=["masked", "with-a-penalty-row"])
def test_masked_race_gives_the_processed_paths_tokens_and_records(engines, monkeypatch, extra):
    """Grammar rows with nothing else to process take their tokens from one race that reads the mask
    (``ModelRunner._masked_race``): the same tokens, ranks and raw log-probabilities as the processed path
    (float copy, ``apply_bitmask``, the sampler), synchronous and ahead; a penalty row in the step sends
    the step (until that row finishes) down the processed path."""
    from tidyrun.runner.model_runner import ModelRunner

    params = masked_params(MASKED + ((extra,) if extra else ()))
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(len(params))]
    calls = count_calls(monkeypatch, ModelRunner, "_masked_race", "_draw_rows")
    got = {}
    for a in (False, True):
        got[a] = engines[a].generate(prompts, params, use_tqdm=False)
        # every step while the penalty row runs (10 tokens) takes the processed path, the steps after it the race
        assert calls["_masked_race"] >= (15 if extra is None else 4) and (calls["_draw_rows"] > 0) == bool(extra), calls
        calls.update(_masked_race=0, _draw_rows=0)
    monkeypatch.setattr(ModelRunner, "_masked_one_pass", lambda self, seqs: False)
    processed = engines[False].generate(prompts, params, use_tqdm=False)
    assert calls["_masked_race"] == 0 and calls["_draw_rows"] >= 15, calls
    for a in (False, True):
        assert_same_records(got[a], processed)
        assert [[c.text for c in o.outputs] for o in got[a]] == [[c.text for c in o.outputs] for o in processed]
    assert isinstance(__import__("json").loads(got[True][0].outputs[0].text)["a"], int)
    assert all(c.text in ("yes", "no", "maybe") for c in got[True][2].outputs)
    assert __import__("re").fullmatch(r"[0-9]{3}-[a-z]{2,5}", got[True][3].outputs[0].text)


@pytest.mark.parametrize("change", [dict(min_tokens=20), dict(ignore_eos=True), dict(top_k=20),
                                    dict(logit_bias={13: -5.0}), dict(logprobs=2)],
                         ids=["min_tokens", "ignore_eos", "top_k", "logit_bias", "top-logprobs"])
def test_grammar_rows_with_more_processing_stay_on_the_processed_path(engines, monkeypatch, change):
    """A grammar row with anything besides its mask to process (a stop-token ban below min_tokens, ignore_eos,
    a top-k cut, a bias, top-k logprobs) never takes the masked race: its step goes down the processed path."""
    from tidyrun.runner.model_runner import ModelRunner

    case = dict(MASKED[0], max_tokens=20) | change
    params = masked_params((case, MASKED[4]))
    calls = count_calls(monkeypatch, ModelRunner, "_masked_race", "_draw_rows")
    engines[False].generate(list(QUESTIONS[:2]), params, use_tqdm=False)
    assert calls["_masked_race"] == 0 and calls["_draw_rows"] >= 5, calls


def test_reset_prefix_cache_of_running_requests_with_a_step_in_flight(engines):
    """reset_prefix_cache(reset_running_requests=True) while a step runs ahead: that step is booked first
    (its tokens kept), then the requests are preempted and recompute; the outputs are the synchronous
    engine's, with nothing left to reuse."""
    prompts = [list(range(200, 250)), list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in engines[False].generate(prompts, params, use_tqdm=False)]
    llm = engines[True]
    ids = [llm.add_request(p, params) for p in prompts]
    for _ in range(4):
        llm.step()
    assert not llm._pipeline.idle  # a step is in flight: the path under test
    cached = llm.stats()["prefix_cached_tokens"]
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert llm._pipeline.idle
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update({o.request_id: o for o in llm.step()})
    assert [outputs[i].outputs[0].token_ids for i in ids] == want
    assert llm.stats()["prefix_cached_tokens"] == cached
