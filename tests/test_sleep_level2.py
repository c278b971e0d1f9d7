"""Level-2 sleep the vLLM way: waking the weights allocates only; pushes (or a reload) fill them; until then
the engine refuses to run the model instead of computing with uninitialised memory."""

from __future__ import annotations

import pytest
import torch

from test_sleep import GREEDY, PROMPTS, greedy, perturbed, state_dict
from tidyrun import LLM, EngineSleepingError, InvalidRequestError, WeightsNotLoadedError
from tidyrun.synthetic import write_random_checkpoint


@pytest.fixture
def engine(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    yield llm
    llm.shutdown()


@pytest.fixture
def reads(engine, monkeypatch) -> list[int]:
    """Counts the times the engine's model source is asked for its weights (a read of the checkpoint)."""
    source, count = engine.runner.source, []
    real = source.iter_weights

    def counted():
        count.append(1)
        return real()

    monkeypatch.setattr(source, "iter_weights", counted)
    return count


def num_weights(llm: LLM) -> int:
    return len(llm.runner.weights.names)


def test_waking_the_weights_allocates_without_reading_them(engine, reads):
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    assert reads == []
    assert engine.runner.ledger.bytes_by_owner()["weights"] == engine.runner.arena.nbytes
    assert engine.runner.sleeping == {"kv_cache"}
    engine.wake_up(["kv_cache"])
    assert reads == [] and not engine.is_sleeping
    n = num_weights(engine)
    assert len(engine.runner.missing_weights) == n > 0


def test_generating_with_weights_not_loaded_is_refused_saying_what_to_call(engine):
    engine.sleep(level=2)
    engine.wake_up()
    n = num_weights(engine)
    message = (rf"{n} of the {n} weight tensors are not loaded .*discarded by sleep\(level=2\) and woken "
               r"without loading; push them with load_weights\(\)/update_weights\(\) or call "
               r"collective_rpc\('reload_weights'\)")
    with pytest.raises(WeightsNotLoadedError, match=message):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    for call in (lambda: engine.embed(["a b"]), lambda: engine.compute_logits("a b"),
                 lambda: engine.add_request("a b", GREEDY)):
        with pytest.raises(EngineSleepingError):  # WeightsNotLoadedError is one: waiting code catches both
            call()
    assert not engine.has_unfinished_requests()


def test_weights_pushed_one_tensor_per_call_match_a_fresh_engine(engine, tiny_llama_dir, tmp_path):
    """TRL's loop: sleep(2), wake the weights, push them one by one, wake the KV cache, generate."""
    folder, new = perturbed(tiny_llama_dir, str(tmp_path / "perturbed"))
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    items = list(new.items())
    n = num_weights(engine)
    assert len(items) == n
    for i, (name, tensor) in enumerate(items):
        if i == n - 3:
            engine.wake_up(["kv_cache"])
            with pytest.raises(WeightsNotLoadedError, match=rf"\b3 of the {n} weight tensors"):
                engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        # a dict, a list of pairs and a generator: every form a push can take
        push = [{name: tensor}, [(name, tensor)], ((k, v) for k, v in [(name, tensor)])][i % 3]
        assert engine.update_weights(push) == 1
        assert len(engine.runner.missing_weights) == n - i - 1
    with LLM(folder, device="cpu") as fresh:
        assert greedy(engine) == greedy(fresh)


def test_pushing_the_same_tensor_twice_does_not_count_twice(engine, tiny_llama_dir):
    sd = state_dict(tiny_llama_dir)
    engine.sleep(level=2)
    engine.wake_up()
    name = "model.norm.weight"
    engine.update_weights({name: sd[name]})
    engine.update_weights({name: sd[name]})
    assert len(engine.runner.missing_weights) == num_weights(engine) - 1
    engine.update_weights({k: v for k, v in sd.items() if k != name})
    assert engine.runner.missing_weights == []


def test_reload_weights_restores_the_checkpoint(engine, tiny_llama_dir, tmp_path, reads):
    before = greedy(engine)
    _, new = perturbed(tiny_llama_dir, str(tmp_path / "perturbed"))
    engine.update_weights(new)
    assert greedy(engine) != before
    assert engine.runner.reload_weights() == num_weights(engine)  # awake: a full reload of the original checkpoint
    assert reads == [1]
    assert greedy(engine) == before
    engine.sleep(level=2)
    engine.wake_up()
    engine.runner.reload_weights()  # after a level-2 wake: fills what the wake allocated
    assert reads == [1, 1]
    assert greedy(engine) == before
    engine.sleep(level=2)
    engine.runner.reload_weights()  # the weights asleep: wakes them from the checkpoint, the KV cache sleeps on
    assert engine.runner.sleeping == {"kv_cache"} and engine.runner.missing_weights == []
    engine.wake_up()
    assert greedy(engine) == before


def test_reload_weights_at_level_1_is_refused(engine, reads):
    engine.sleep(level=1)
    with pytest.raises(EngineSleepingError, match=r"level 1; call wake_up\(\['weights'\]\) before reload_weights"):
        engine.runner.reload_weights()
    assert reads == [] and engine.runner.sleeping == {"weights", "kv_cache"}
    engine.wake_up()


def test_failed_pushes_change_nothing(engine, tiny_llama_dir):
    sd = state_dict(tiny_llama_dir)
    engine.sleep(level=2)
    engine.wake_up()
    n = num_weights(engine)
    good = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(InvalidRequestError, match="shape"):  # a dict is checked before anything is copied
        engine.update_weights({good: sd[good], "model.norm.weight": torch.zeros(3)})
    assert len(engine.runner.missing_weights) == n
    # An iterable is streamed: the tensor copied before the bad one counts as loaded (the model reports each
    # copy), the bad one and the rest do not, and the engine still refuses.
    with pytest.raises(InvalidRequestError, match="unexpected weight"):
        engine.update_weights(iter([(good, sd[good]), ("model.bogus.weight", torch.zeros(3))]))
    assert good not in engine.runner.missing_weights and len(engine.runner.missing_weights) == n - 1
    with pytest.raises(WeightsNotLoadedError, match=rf"{n - 1} of the {n}"):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_failed_allocate_only_wake_stays_asleep(engine, monkeypatch, reads):
    before = greedy(engine)
    engine.sleep(level=2)

    def fail():
        raise MemoryError("no device memory for the weights")

    monkeypatch.setattr(engine.runner.arena, "materialize", fail)
    with pytest.raises(MemoryError, match="weights"):
        engine.wake_up()
    assert engine.runner.sleeping == {"weights", "kv_cache"} and engine.runner.ledger.bytes_by_owner() == {}
    monkeypatch.undo()
    engine.wake_up()
    engine.runner.reload_weights()
    assert greedy(engine) == before


def test_failed_kv_wake_after_the_weights_rolls_back_only_this_call(engine, monkeypatch):
    engine.sleep(level=2)
    engine.wake_up(["weights"])

    def fail():
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(engine.runner.kv, "acquire", fail)
    with pytest.raises(RuntimeError, match="KV cache"):
        engine.wake_up(["kv_cache"])
    assert engine.runner.sleeping == {"kv_cache"} and "weights" in engine.runner.ledger.bytes_by_owner()
    monkeypatch.undo()
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping


def test_a_second_sleep_while_partly_asleep_releases_what_is_awake(engine, reads):
    before = greedy(engine)
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    engine.runner.reload_weights()  # stands in for the trainer's push
    freed = engine.sleep(level=1)  # the KV cache still sleeps at level 2; the weights go to the host
    assert {"weights", "rope"} <= set(freed) and "kv_cache" not in freed
    assert engine.runner.sleeping == {"weights", "kv_cache"}
    assert engine.runner.lifecycle.level_of("weights") == 1 and engine.runner.lifecycle.level_of("kv_cache") == 2
    assert engine.runner.sleep_level == 2  # the deepest level anything sleeps at
    assert set(engine.runner.ledger.bytes_by_owner()) == {"host_weights"}
    with pytest.raises(InvalidRequestError, match="already asleep"):  # nothing is awake any more
        engine.sleep(level=2)
    engine.wake_up()  # each row at its own level: the weights from the host copy, no read
    assert reads == [1]
    assert greedy(engine) == before

    engine.sleep(level=2)
    engine.wake_up(["kv_cache"])
    engine.sleep(level=1)  # only the KV cache was awake; the weights stay discarded (level 2)
    assert engine.runner.lifecycle.level_of("weights") == 2 and engine.runner.lifecycle.level_of("kv_cache") == 1
    engine.wake_up()
    with pytest.raises(WeightsNotLoadedError):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.runner.reload_weights()
    assert greedy(engine) == before


def test_weights_not_loaded_stay_not_loaded_across_a_level1_sleep(engine):
    engine.sleep(level=2)
    engine.wake_up()
    engine.sleep(level=1)  # the host copy holds the same uninitialised memory
    engine.wake_up()
    with pytest.raises(WeightsNotLoadedError):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.runner.reload_weights()
    assert engine.runner.missing_weights == []


def test_update_weights_while_asleep_at_level_2_still_refills_all_or_nothing(engine, tiny_llama_dir, reads):
    before = greedy(engine)
    sd = state_dict(tiny_llama_dir)
    engine.sleep(level=2)
    with pytest.raises(InvalidRequestError, match="missing"):
        engine.update_weights(dict(list(sd.items())[:3]))
    assert engine.runner.sleeping == {"weights", "kv_cache"}
    assert engine.update_weights(sd) == len(sd)
    assert engine.runner.sleeping == {"kv_cache"} and engine.runner.missing_weights == []
    engine.wake_up()
    assert reads == [] and greedy(engine) == before


def test_shutdown_with_weights_not_loaded_is_clean(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    llm.sleep(level=2)
    llm.wake_up()
    refs = [e.ref for e in llm.runner.ledger.entries()]
    assert llm.shutdown().clean
    assert all(r() is None for r in refs)


TP_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False,
                rope_theta=10000.0)


def test_tensor_parallel_level2_push_and_reload(tmp_path):
    """Two ranks: the allocate-only wake, one-tensor pushes and reload_weights reach every rank."""
    folder = write_random_checkpoint(str(tmp_path / "tp"), TP_SHAPE, dtype=torch.float32, std=0.1)
    with LLM(folder, device="cpu", tensor_parallel_size=2, max_num_seqs=4) as llm:
        before = greedy(llm)
        full = dict(llm.source.iter_weights())
        llm.sleep(2)
        llm.wake_up()
        with pytest.raises(WeightsNotLoadedError):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for name, tensor in full.items():
            llm.update_weights({name: tensor})
        assert greedy(llm) == before
        llm.sleep(2)
        llm.wake_up(["weights"])
        llm.runner.reload_weights()
        llm.wake_up(["kv_cache"])
        assert greedy(llm) == before


def model_load_weights(worker, pairs):
    """vLLM's spelling inside a ``collective_rpc`` function: the model's own ``load_weights``."""
    return len(worker.model_runner.model.load_weights(pairs))


def test_a_collective_rpc_function_that_loads_through_the_model_fills_the_weights(engine, tiny_llama_dir, tmp_path):
    """TRL's and verl's weight sync call ``model.load_weights`` from a worker function; after a level-2 sleep
    the engine refused to generate afterwards (WeightsNotLoadedError) because only pushes through the runner
    were counted."""
    expected = greedy(engine)
    pairs = list(state_dict(tiny_llama_dir).items())
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    half = len(pairs) // 2
    assert engine.collective_rpc(model_load_weights, args=(pairs[:half],)) == [half]
    assert len(engine.runner.missing_weights) == len(pairs) - half
    assert engine.collective_rpc(model_load_weights, args=(pairs[half:],)) == [len(pairs) - half]
    assert engine.runner.missing_weights == []
    engine.wake_up(["kv_cache"])
    assert greedy(engine) == expected


def test_loading_through_the_model_while_the_weights_sleep_is_a_clear_error(engine, tiny_llama_dir):
    """The weights' memory is gone at level 1 and 2: a copy into them was a bare RuntimeError from torch."""
    pairs = list(state_dict(tiny_llama_dir).items())
    for level in (1, 2):
        engine.sleep(level=level)
        with pytest.raises(EngineSleepingError, match=r"the weights sleep \(level %d\).*wake_up\(\['weights'\]\)"
                           % level):
            engine.collective_rpc(model_load_weights, args=(pairs,))
        engine.wake_up()
        if level == 2:
            engine.collective_rpc("reload_weights")
    assert engine.generate(PROMPTS, GREEDY, use_tqdm=False)
