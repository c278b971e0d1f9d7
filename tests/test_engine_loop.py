"""The server's engine loop: what it costs per step, and what it reports when its thread is gone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tidyrun import LLM, SamplingParams
from tidyrun.server import EngineLoop
from tidyrun.synthetic import write_random_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("loop")), "llama-tiny", dtype=torch.float32)


async def _generate(loop: EngineLoop, n: int):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    sub = loop.submit({"prompt_token_ids": [5, 6, 7]}, params, stream=False)
    await sub.accepted()
    async for out in sub:
        last = out
    return last


def test_the_loop_does_not_walk_the_ledger_every_step(folder):
    """The memory figures change only at lifecycle transitions; the loop used to read them from the ledger
    after every step (515 us of a ~1.1 ms batch-1 step on the H200)."""
    loop = EngineLoop(LLM(folder, device="cpu", max_model_len=128))
    ledger = loop.llm.runner.ledger
    walks = []
    original = ledger.bytes_by_owner
    ledger.bytes_by_owner = lambda: walks.append(1) or original()
    loop.start()
    try:
        asyncio.run(_generate(loop, 40))
        steps_walks = len(walks)
        assert steps_walks <= 2, f"{steps_walks} ledger walks for a 40-step request"
        assert loop.stats.values["device_memory_bytes"]["weights"] > 0
        asyncio.run(loop.call(lambda e: e.sleep(level=1)))
        assert "weights" not in loop.stats.values["device_memory_bytes"]  # a transition refreshes them
        asyncio.run(loop.call(lambda e: e.wake_up()))
        assert loop.stats.values["device_memory_bytes"]["weights"] > 0
    finally:
        del ledger.bytes_by_owner
        loop.stop()


def test_a_dead_loop_says_why(folder):
    """/health answers 503 with the reason, the server is told to stop (so `tidyrun serve` exits 1), and the
    engine is still shut down."""
    from fastapi.testclient import TestClient

    from tidyrun.server import create_app

    deaths = []
    loop = EngineLoop(LLM(folder, device="cpu", max_model_len=128), on_death=deaths.append)
    client = TestClient(create_app(loop, "tiny"), raise_server_exceptions=False)  # no lifespan: we start it
    assert loop.unhealthy == "the engine thread is not running"
    loop.start()
    assert loop.unhealthy is None and client.get("/health").status_code == 200

    def fail() -> bool:
        raise RuntimeError("boom")

    loop.llm.has_unfinished_requests = fail  # the loop calls it first thing after each batch of commands
    out = asyncio.run(_generate(loop, 4))
    assert out.outputs[0].finish_reason == "abort"  # the request in flight ends, it does not hang
    loop._thread.join(10)
    assert loop.unhealthy == "the engine thread died: RuntimeError: boom" and deaths == ["RuntimeError: boom"]
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["error"]["message"] == "engine is not serving: the engine thread died: RuntimeError: boom"
    assert loop.shutdown_report is not None and loop.shutdown_report.clean  # the engine was still shut down
    assert loop.stop() is loop.shutdown_report  # stopping a dead loop is safe and ordered


def test_stop_before_start_shuts_the_engine_down(folder):
    """`tidyrun serve` whose port is taken never starts the loop; stopping it used to join an unstarted thread."""
    loop = EngineLoop(LLM(folder, device="cpu", max_model_len=128))
    report = loop.stop()
    assert report is not None and report.clean and loop.llm.is_shut_down
