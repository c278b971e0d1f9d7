"""The engine stays correct and usable when inputs are odd or a step fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidyrun import LLM, InvalidRequestError, ResourceLeakError, SamplingParams
from tidyrun.cli import main as cli_main

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=128, num_kv_blocks=32, block_size=4)
    yield llm
    llm.shutdown()


def test_garbage_in_unwritten_kv_slots_does_not_leak_into_attention(engine):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    ref = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    for garbage in (float("nan"), float("inf"), 1e30):
        engine.runner.kv_cache.tensor.fill_(garbage)  # what torch.empty may hand back
        engine.scheduler.pool.reset_prefix_cache()  # the fill also destroyed the cached blocks' contents
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == ref


def test_stream_keeps_other_requests_outputs(engine):
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    "".join(engine.stream([8, 9], SamplingParams(max_tokens=6, ignore_eos=True)))
    assert engine.has_unfinished_requests()
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].outputs[0].token_ids) == 2


def test_out_of_vocab_stop_token_is_rejected(engine):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.generate([[5, 6]], SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[10**6]), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.generate([[7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_failing_step_aborts_its_batch_and_the_engine_recovers(engine, monkeypatch):
    ref = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    rid = engine.add_request([1, 2, 3], GREEDY)

    def boom(batch):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "execute", boom)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step()
    monkeypatch.undo()
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [(rid, "abort")]
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_blocks
    assert engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_generate_is_all_or_nothing(engine):
    engine.add_request([5, 6], GREEDY, request_id="9")
    engine.add_request([5, 6], GREEDY, request_id="1")  # the auto counter will reach "1"
    outs = engine.generate([[7, 8], [9, 10], [11, 12]], GREEDY, use_tqdm=False)
    assert len(outs) == 3 and len({o.request_id for o in outs}) == 3
    with pytest.raises(InvalidRequestError, match="seed"):
        engine.generate([[7, 8], [9, 10]], [GREEDY, SamplingParams(seed=2**64)], use_tqdm=False)
    left = []
    while engine.has_unfinished_requests():
        left += [o.request_id for o in engine.step()]
    assert sorted(left) == ["1", "9"]


@pytest.mark.parametrize("weights", [5, [torch.ones(4)], {"model.norm.weight": [1.0] * 64},
                                     {"model.norm.weight": np.ones(64, dtype=np.float32)}, "a/path"])
def test_malformed_update_weights_input(engine, weights):
    before = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError):
        engine.update_weights(weights)
    assert engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_strict_shutdown_that_raises_keeps_its_report(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    held = llm.runner.model.model.norm.weight
    with pytest.raises(ResourceLeakError):
        llm.shutdown(strict=True)
    again = llm.shutdown()
    assert not again.clean and again.leaked_bytes > 0 and again.released_bytes
    del held


def test_cli_uses_the_models_own_context_length(tmp_path, capsys):
    from tidyrun.synthetic import write_random_checkpoint

    folder = write_random_checkpoint(str(tmp_path), "llama-tiny", dtype=torch.float32)  # context 2048
    assert cli_main(["generate", "--model", folder, "--device", "cpu", "--raw", "hi", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().err.find("error") == -1
