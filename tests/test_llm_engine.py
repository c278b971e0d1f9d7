"""vLLM's LLMEngine (``tidyrun.LLMEngine``): requests added by id and stepped by hand, as vLLM's
llm_engine_example.py drives it, each step returning what it advanced in the request's output kind."""

from __future__ import annotations

import pytest

from tidyrun import EngineArgs, InvalidRequestError, LLMEngine, PoolingParams, RequestOutputKind, SamplingParams

PROMPT = "Hello, my name is"


@pytest.fixture()
def engine(llm):
    """An LLMEngine over the session's shared LLM (not shut down here: the session owns it)."""
    yield LLMEngine(llm)
    assert not llm.has_unfinished_requests()


def run(engine: LLMEngine) -> dict[str, list]:
    """Every output each request got, by id, stepping until nothing is left."""
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def test_llm_engine_example_flow(llm, engine):
    """vLLM's example: one request added per step while earlier ones run; CUMULATIVE outputs every step
    (each one longer), the finished one equal to what LLM.generate gives."""
    prompts = [("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1,
                                                                      max_tokens=12)),
               ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, seed=3,
                                                      max_tokens=10)),
               ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=4,
                                                               frequency_penalty=0.1, max_tokens=8))]
    got: dict[str, list] = {}
    pending, request_id = list(prompts), 0
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, params = pending.pop(0)
            assert engine.add_request(str(request_id), prompt, params) == str(request_id)
            request_id += 1
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    assert sorted(got) == ["0", "1", "2"]
    for rid, (prompt, params) in zip("012", prompts):
        outs = got[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)  # one more token each step
        whole = llm.generate(prompt, params, use_tqdm=False)[0]
        assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in whole.outputs]
        assert [c.text for c in outs[-1].outputs] == [c.text for c in whole.outputs]
    assert len(got["2"][-1].outputs) == 2
    assert got["0"][-1].prompt_logprobs == llm.generate(*prompts[0], use_tqdm=False)[0].prompt_logprobs


def test_delta_outputs_add_up_to_the_whole_and_hold_back_stop_text(llm, engine):
    whole_params = SamplingParams(temperature=0, max_tokens=14, logprobs=2, stop=[" coach"])
    whole = llm.generate(PROMPT, whole_params, use_tqdm=False)[0].outputs[0]
    assert whole.finish_reason == "stop"  # the stop string was met: the held-back text is dropped, not sent
    engine.add_request("d", PROMPT, SamplingParams(temperature=0, max_tokens=14, logprobs=2, stop=[" coach"],
                                                   output_kind=RequestOutputKind.DELTA))
    deltas = [o.outputs[0] for o in run(engine)["d"]]
    assert len(deltas) > 2
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == whole.logprobs
    assert " coach" not in "".join(d.text for d in deltas)  # held back while undecided, then dropped
    assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_n_completions_stream_each_finish_once(llm, engine, kind):
    """n=3 with a stop that ends completions at different steps: a finished completion is shown finished
    once and then left out (as vLLM streams children); a request reads finished only at its end."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24, stop=[" "], output_kind=kind)
    engine.add_request("n", "Once upon a time", params)
    outs = run(engine)["n"]
    finishes = [c.index for o in outs for c in o.outputs if c.finish_reason is not None]
    assert sorted(finishes) == [0, 1, 2]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    whole = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24,
                                                            stop=[" "]), use_tqdm=False)[0]
    for c in whole.outputs:
        mine = [d for o in outs for d in o.outputs if d.index == c.index]
        if kind == RequestOutputKind.DELTA:
            assert "".join(d.text for d in mine) == c.text and [t for d in mine for t in d.token_ids] == c.token_ids
        else:
            assert mine[-1].text == c.text and mine[-1].token_ids == c.token_ids


def test_final_only_gives_one_output(llm, engine):
    params = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("f", PROMPT, params)
    engine.add_request("c", PROMPT, SamplingParams(temperature=0, max_tokens=6))
    got = run(engine)
    assert len(got["f"]) == 1 and got["f"][0].finished and len(got["c"]) == 6
    assert got["f"][0].outputs[0].token_ids == got["c"][-1].outputs[0].token_ids


def test_abort_one_or_several_ids(engine):
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(["a", "b"])
    engine.abort_request("c")
    engine.abort_request("unknown")  # as vLLM: nothing to abort is no error
    last = {o.request_id: o for o in engine.step()}
    assert sorted(last) == ["a", "b", "c"] and all(o.outputs[0].finish_reason == "abort" for o in last.values())
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("call, needle", [
    (lambda e: e.add_request(0, PROMPT, SamplingParams()), "request_id must be a str"),
    (lambda e: e.add_request("p", PROMPT, PoolingParams()), "takes SamplingParams"),
    (lambda e: e.add_request("p", PROMPT, SamplingParams(), priority=2), "priority=2"),
    (lambda e: e.add_request("p", PROMPT, SamplingParams(), lora_request=object()), "lora_request"),
    (lambda e: e.add_request("p", PROMPT, SamplingParams(), tokenization_kwargs={"truncation": True}),
     "tokenization_kwargs"),
    (lambda e: e.add_request("p", PROMPT, SamplingParams(temperature=-1)), "temperature"),
    (lambda e: LLMEngine.from_engine_args(EngineArgs(), stat_loggers=[object()]), "stat_loggers"),
    (lambda e: LLMEngine("model"), "wraps a tidyrun.LLM"),
])
def test_refusals_name_the_problem(engine, call, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        call(engine)
    assert not engine.has_unfinished_requests()


def test_duplicate_id_refused_while_in_flight(engine):
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request("x", PROMPT, SamplingParams(max_tokens=2))
    assert list(run(engine)) == ["x"]


def test_from_engine_args_builds_and_shuts_down_its_engine(default_model):
    engine_args = EngineArgs(model=default_model, device="cpu", max_model_len=128, block_size=None)  # vLLM's default
    with LLMEngine.from_engine_args(engine_args) as engine:
        engine.add_request("0", PROMPT, SamplingParams(temperature=0, max_tokens=3))
        assert len(run(engine)["0"]) == 3
        assert engine.model_config.max_model_len == 128 and engine.get_tokenizer() is not None
    assert engine.llm.is_shut_down and engine.shutdown().clean  # idempotent: the same verified report
