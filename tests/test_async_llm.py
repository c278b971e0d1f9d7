"""vLLM's AsyncLLM / AsyncLLMEngine (``tidyrun.AsyncLLM``): coroutines each ``async for`` their request's
outputs while one engine thread batches them all."""

from __future__ import annotations

import asyncio

import pytest

from tidyrun import (AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineShutdownError, InvalidRequestError,
                     RequestOutputKind, SamplingParams)

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def engine(default_model):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=default_model, device="cpu", dtype="float32",
                                                             max_model_len=1024, disable_log_requests=True))
    yield engine
    report = engine.shutdown()
    assert report is not None and report.clean


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_concurrent_requests_give_what_generate_gives(engine, llm):
    """Three coroutines at once (batched by the engine thread): cumulative outputs, growing by a token a
    step, the last finished and equal to LLM.generate's greedy output."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))

    for i, (prompt, outs) in enumerate(zip(PROMPTS, asyncio.run(main()))):
        assert all(o.request_id == f"r{i}" for o in outs)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 10
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert outs[-1].outputs[0].token_ids == want.token_ids and outs[-1].outputs[0].text == want.text


def test_delta_and_final_only_kinds(engine):
    whole = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(
            collect(engine, PROMPTS[0], whole, "whole"),
            collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       output_kind=RequestOutputKind.DELTA), "delta"),
            collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       output_kind=RequestOutputKind.FINAL_ONLY), "final"))

    full, deltas, final = asyncio.run(main())
    assert "".join(o.outputs[0].text for o in deltas) == full[-1].outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == full[-1].outputs[0].token_ids
    assert len(final) == 1 and final[0].outputs[0].token_ids == full[-1].outputs[0].token_ids


def test_abort_ends_the_stream_and_break_frees_the_request(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def aborted():
        outs = []
        async for out in engine.generate(PROMPTS[1], params, "a"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort(["a", "unknown"])
        return outs

    async def broken():
        async for _ in engine.generate(PROMPTS[1], params, "b"):
            break  # closing the generator aborts the request
        await asyncio.sleep(0)
        return await engine.get_metrics()

    outs = asyncio.run(aborted())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and len(outs) < 50
    asyncio.run(broken())

    async def idle():
        for _ in range(100):  # the aborted request leaves the engine within a few steps
            if not await asyncio.to_thread(lambda: engine._loop.llm.has_unfinished_requests()):
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(idle())


def test_a_reader_whose_event_loop_closed_costs_the_engine_nothing(engine):
    """asyncio.run returning while its request streams (or while a call waits for the engine thread) leaves
    outputs nobody can take: the engine thread drops them and aborts the request, and keeps serving."""
    params = SamplingParams(max_tokens=300, ignore_eos=True)

    async def leave_after_one(i):
        gen = engine.generate(PROMPTS[0], params, f"left{i}")
        await gen.__anext__()  # then asyncio.run closes the loop (and the generator) under the running request

    async def leave_a_call():
        asyncio.get_running_loop().create_task(engine.get_metrics())
        await asyncio.sleep(0)  # the call is queued on the engine thread; the loop closes before or after its answer

    for i in range(5):
        asyncio.run(leave_after_one(i))
        asyncio.run(leave_a_call())
    assert not engine.errored and engine.is_running
    outs = asyncio.run(collect(engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=4), "after"))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_refusals_raise_before_anything_is_yielded(engine):
    async def first(prompt, params, request_id="x", **kw):
        async for out in engine.generate(prompt, params, request_id, **kw):
            return out

    bad = SamplingParams()
    bad.temperature = -1  # mutable, as vLLM's: checked when submitted
    for call, needle in [((PROMPTS[0], bad), "temperature"),
                         (("", SamplingParams()), "empty"),
                         ((PROMPTS[0], SamplingParams(), 7), "request_id must be a str"),
                         ((PROMPTS[0], {"max_tokens": 2}), "takes SamplingParams")]:
        with pytest.raises(InvalidRequestError, match=needle):
            asyncio.run(first(*call))
    with pytest.raises(InvalidRequestError, match="priority"):
        asyncio.run(first(PROMPTS[0], SamplingParams(), priority=1))
    with pytest.raises(InvalidRequestError, match="tokenization_kwargs"):
        asyncio.run(first(PROMPTS[0], SamplingParams(), tokenization_kwargs={"truncation": True}))
    mutated = SamplingParams()
    mutated.output_kind = "delta"  # checked as submitted (a bare ValueError before)
    with pytest.raises(InvalidRequestError, match="output_kind"):
        asyncio.run(first(PROMPTS[0], mutated))

    async def duplicate():
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await gen.__anext__()
        try:
            await first(PROMPTS[0], SamplingParams(), "dup")
        finally:
            await gen.aclose()

    with pytest.raises(InvalidRequestError, match="already running"):
        asyncio.run(duplicate())


def test_engine_calls_between_steps(engine):
    async def main():
        assert await engine.reset_prefix_cache() is True
        await engine.sleep(1)
        assert await engine.is_sleeping() is True
        await engine.wake_up()
        assert await engine.is_sleeping() is False
        config = await engine.get_model_config()
        await engine.check_health()
        tokenizer = await engine.get_tokenizer()
        outs = await collect(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=3), "after")
        return config, tokenizer, outs

    config, tokenizer, outs = asyncio.run(main())
    assert config.max_model_len == 1024 and tokenizer.encode(PROMPTS[0])
    assert outs[-1].finished and engine.is_running and not engine.errored


def test_after_shutdown(default_model):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=default_model, device="cpu", max_model_len=64))
    report = engine.shutdown()
    assert report.clean and engine.shutdown() is report and not engine.is_running

    async def main():
        async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=2), "late"):
            pass

    with pytest.raises(EngineShutdownError):
        asyncio.run(main())
    with pytest.raises(EngineShutdownError):
        asyncio.run(engine.check_health())
