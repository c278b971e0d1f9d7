"""sleep / wake_up / update_weights: same outputs after a round trip, new outputs after new weights."""

from __future__ import annotations

import gc
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidyrun import LLM, EngineSleepingError, InvalidRequestError, SamplingParams, WeightsNotLoadedError
from tidyrun.audit import leaks_since, snapshot

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello world", "The quick brown fox", "one two three four"]


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def state_dict(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def perturbed(folder: str, out: str, scale: float = 0.5) -> tuple[str, dict[str, torch.Tensor]]:
    """A copy of the checkpoint with every matrix perturbed; returns (folder, state dict)."""
    shutil.copytree(folder, out)
    sd = state_dict(folder)
    gen = torch.Generator().manual_seed(7)
    new = {k: (v + scale * torch.randn(v.shape, generator=gen) * v.std()) if v.dim() == 2 else v.clone()
           for k, v in sd.items()}
    save_file(new, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out, new


@pytest.fixture
def engine(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_outputs_identical_after_sleep_and_wake(engine, level):
    before = greedy(engine)
    freed = engine.sleep(level=level)
    assert engine.is_sleeping
    assert {"weights", "kv_cache", "rope"} <= set(freed)
    remaining = engine.runner.ledger.bytes_by_owner()
    assert remaining == ({"host_weights": engine.runner.arena.nbytes} if level == 1 else {})
    engine.wake_up()
    assert not engine.is_sleeping
    if level == 2:  # woken without loading (vLLM's level 2): the checkpoint is read again only on request
        with pytest.raises(WeightsNotLoadedError, match="reload_weights"):
            greedy(engine)
        engine.runner.reload_weights()
    assert greedy(engine) == before


def test_level2_on_the_default_gguf_wakes_without_reading_and_reloads_on_request(default_model):
    with LLM(default_model, device="cpu", max_model_len=256) as llm:
        before = greedy(llm)
        llm.sleep(level=2)
        assert llm.runner.ledger.bytes_by_owner() == {}
        llm.wake_up()
        wake_s = llm.runner.last_transfer["wake_s"]
        with pytest.raises(WeightsNotLoadedError):
            greedy(llm)
        start = time.perf_counter()
        llm.runner.reload_weights()
        reload_s = time.perf_counter() - start
        print(f"\nlevel-2 wake (allocate only) {wake_s:.3f} s; reload of the checkpoint {reload_s:.2f} s")
        assert wake_s < reload_s / 5
        assert greedy(llm) == before


def test_calls_while_asleep_raise_and_partial_wake(engine):
    before = greedy(engine)
    engine.sleep()
    with pytest.raises(EngineSleepingError, match="wake_up"):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(EngineSleepingError):
        engine.add_request("x", GREEDY)
    with pytest.raises(InvalidRequestError, match="already asleep"):
        engine.sleep()
    with pytest.raises(InvalidRequestError, match="tags"):
        engine.wake_up(["everything"])
    with pytest.raises(EngineSleepingError, match="level 1"):
        engine.update_weights({})
    engine.wake_up(["weights"])
    assert engine.is_sleeping and set(engine.runner.ledger.bytes_by_owner()) >= {"weights", "rope"}
    assert "kv_cache" not in engine.runner.ledger.bytes_by_owner()
    with pytest.raises(EngineSleepingError, match="kv_cache"):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping
    assert greedy(engine) == before


def test_sleep_refused_with_requests_in_flight(engine):
    engine.add_request("still running", SamplingParams(max_tokens=50))
    engine.step()
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.sleep()
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.update_weights({})
    assert not engine.is_sleeping
    while engine.has_unfinished_requests():
        engine.step()
    engine.sleep()
    engine.wake_up()


def test_bad_sleep_level(engine):
    for level in (0, 3, "1"):
        with pytest.raises(InvalidRequestError, match="level"):
            engine.sleep(level=level)


def test_update_with_same_weights_keeps_outputs(engine, tiny_llama_dir):
    before = greedy(engine)
    assert engine.update_weights(state_dict(tiny_llama_dir)) == len(state_dict(tiny_llama_dir))
    assert greedy(engine) == before
    engine.update_weights(iter(state_dict(tiny_llama_dir).items()))  # an iterator works too
    assert greedy(engine) == before


def test_update_with_perturbed_weights_matches_a_fresh_engine(engine, tiny_llama_dir, tmp_path):
    before = greedy(engine)
    folder, new = perturbed(tiny_llama_dir, str(tmp_path / "perturbed"))
    engine.update_weights(new)
    after = greedy(engine)
    assert after != before
    with LLM(folder, device="cpu") as fresh:
        assert greedy(fresh) == after


def test_update_weights_while_asleep_at_level_2(engine, tiny_llama_dir, tmp_path):
    folder, new = perturbed(tiny_llama_dir, str(tmp_path / "perturbed"))
    engine.sleep(level=2)
    partial = dict(list(new.items())[:3])
    with pytest.raises(InvalidRequestError, match="missing"):
        engine.update_weights(partial)
    assert engine.is_sleeping and "weights" not in engine.runner.ledger.bytes_by_owner()
    engine.update_weights(new)
    assert engine.runner.sleeping == {"kv_cache"}
    engine.wake_up()
    with LLM(folder, device="cpu") as fresh:
        assert greedy(engine) == greedy(fresh)


def test_partial_update_while_awake(engine, tiny_llama_dir):
    before = greedy(engine)
    name = "model.layers.1.mlp.down_proj.weight"
    sd = state_dict(tiny_llama_dir)
    engine.update_weights({name: torch.zeros_like(sd[name])})
    assert greedy(engine) != before
    engine.update_weights({name: sd[name]})
    assert greedy(engine) == before


@pytest.mark.parametrize("bad, match", [
    ({"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}, "unexpected weight"),
    ({"model.embed_tokens.weight": torch.zeros(10, 64)}, "shape"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, "dtype"),
    ({"lm_head.bias": torch.zeros(49152)}, "unexpected weight"),
])
def test_bad_updates_are_rejected_and_change_nothing(engine, tiny_llama_dir, bad, match):
    before = greedy(engine)
    good = state_dict(tiny_llama_dir)
    good = {k: torch.zeros_like(v) for k, v in good.items()}  # would change outputs if applied
    with pytest.raises(InvalidRequestError, match=match):
        engine.update_weights({**good, **bad})
    assert greedy(engine) == before


def test_twenty_sleep_wake_cycles_without_growth(engine):
    before = greedy(engine)
    engine.sleep()
    engine.wake_up()
    entries = len(list(engine.runner.ledger.entries()))
    snap = snapshot()
    objects = sum(1 for o in gc.get_objects() if str(getattr(type(o), "__module__", "")).startswith("tidyrun"))
    for i in range(20):
        engine.sleep(level=1 if i % 2 else 2)
        engine.wake_up()
        if i % 2 == 0:
            engine.runner.reload_weights()
    assert len(list(engine.runner.ledger.entries())) == entries
    gc.collect()
    assert sum(1 for o in gc.get_objects() if str(getattr(type(o), "__module__", "")).startswith("tidyrun")) <= objects
    survivors = leaks_since(snap)
    # Whatever is new is the re-allocated weights/KV/RoPE/host buffer: the same bytes as before the cycles.
    assert sum(s.nbytes for s in survivors) <= sum(engine.runner.ledger.bytes_by_owner().values())
    assert greedy(engine) == before


def test_host_buffer_is_reused_across_level1_sleeps(engine):
    engine.sleep()
    first = engine.runner.host_weights.host
    engine.wake_up()
    engine.sleep()
    assert engine.runner.host_weights.host is first
    engine.wake_up()


def test_keep_host_buffers_false_frees_the_host_copy(tiny_llama_dir):
    with LLM(tiny_llama_dir, device="cpu", keep_host_buffers=False) as llm:
        before = greedy(llm)
        llm.sleep()
        assert "host_weights" in llm.runner.ledger.bytes_by_owner()
        llm.wake_up()
        assert "host_weights" not in llm.runner.ledger.bytes_by_owner()
        assert greedy(llm) == before


def test_shutdown_while_asleep_is_clean(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    llm.sleep()
    refs = [e.ref for e in llm.runner.ledger.entries()]
    assert llm.shutdown().clean
    assert all(r() is None for r in refs)


def test_failed_sleep_leaves_the_engine_awake_and_usable(engine, monkeypatch):
    before = greedy(engine)

    def fail(transition):
        raise MemoryError("no pinned host memory left")

    monkeypatch.setattr(engine.runner.host_weights, "sleep", fail)
    with pytest.raises(MemoryError):
        engine.sleep(level=1)
    monkeypatch.undo()
    assert not engine.is_sleeping
    assert greedy(engine) == before


def test_failed_wake_stays_asleep_and_can_be_retried(engine, monkeypatch):
    before = greedy(engine)
    engine.sleep(level=1)

    def fail():
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(engine.runner.kv, "acquire", fail)
    with pytest.raises(RuntimeError, match="KV cache"):
        engine.wake_up()
    # All or nothing: the weights that came back in this call went again; only the host copy holds memory.
    assert engine.is_sleeping and engine.runner.sleeping == {"weights", "kv_cache"}
    assert set(engine.runner.ledger.bytes_by_owner()) == {"host_weights"}
    with pytest.raises(EngineSleepingError):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    engine.wake_up()
    assert greedy(engine) == before


def test_failed_level2_reload_gives_the_weights_back(tiny_llama_dir, monkeypatch):
    """A checkpoint that breaks half-way through a level-2 reload: back to a clean level-2 sleep, not stuck."""
    llm = LLM(tiny_llama_dir, device="cpu")
    before = greedy(llm)
    llm.sleep(level=2)
    source = llm.runner.source
    real = source.iter_weights

    def broken():
        for i, item in enumerate(real()):
            if i == 5:
                raise OSError("checkpoint shard vanished")
            yield item

    monkeypatch.setattr(source, "iter_weights", broken)
    with pytest.raises(OSError, match="vanished"):
        llm.runner.reload_weights()
    assert llm.is_sleeping and llm.runner.sleeping == {"weights", "kv_cache"}
    assert llm.runner.ledger.bytes_by_owner() == {}  # the half-filled weight buffer is gone
    monkeypatch.undo()
    llm.runner.reload_weights()  # asleep at level 2: wakes the weights from the checkpoint
    assert llm.runner.sleeping == {"kv_cache"}
    llm.wake_up()
    assert greedy(llm) == before
    llm.sleep(level=2)
    llm.wake_up()
    llm.runner.reload_weights()
    assert greedy(llm) == before
    refs = [e.ref for e in llm.runner.ledger.entries()]
    assert llm.shutdown().clean
    assert all(r() is None for r in refs)
