"""The runner's lifecycle is one ordered table: every transition is a loop over it, rollbacks included."""

from __future__ import annotations

import pytest

from tidyrun import LLM, SamplingParams
from tidyrun.runner.lifecycle import KV_CACHE, STEP, WEIGHTS, Component, Lifecycle
from tidyrun.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Recorder(Component):
    """A fake row that logs every call into a shared list, and fails on demand."""

    def __init__(self, owner: str, tag: str | None, log: list, fail: set[str] = frozenset()):
        self.owner, self.tag, self.log, self.fail = owner, tag, log, set(fail)

    def _call(self, what: str) -> None:
        self.log.append((what, self.owner))
        if what in self.fail:
            raise RuntimeError(f"{self.owner}.{what} failed")

    def acquire(self):
        self._call("acquire")

    def release(self):
        self._call("release")

    def sleep(self, t):
        self._call(f"sleep{t.level}")

    def wake(self, t):
        self._call(f"wake{t.level}")

    def unwake(self, t):
        self._call(f"unwake{t.level}")

    def woken(self, t):
        self._call("woken")


def table(log, fail=None):
    fail = fail or {}
    return Lifecycle([Recorder(o, tag, log, fail.get(o, ())) for o, tag in
                      (("w", WEIGHTS), ("kv", KV_CACHE), ("pg", None), ("step", STEP))])


def test_every_transition_walks_the_table_in_order():
    log = []
    life = table(log)
    life.start()
    assert log == [("acquire", "w"), ("acquire", "kv"), ("acquire", "pg"), ("acquire", "step")]
    log.clear()
    life.sleep(2)
    assert log == [("sleep2", "step"), ("sleep2", "kv"), ("sleep2", "w")]  # the process group never sleeps
    assert life.sleeping_tags == {WEIGHTS, KV_CACHE} and life.level == 2
    log.clear()
    life.wake([WEIGHTS])
    assert log == [("wake2", "w"), ("woken", "w")]  # step rows wait for the KV cache
    log.clear()
    life.wake([KV_CACHE])
    assert log == [("wake2", "kv"), ("wake2", "step"), ("woken", "kv"), ("woken", "step")]
    assert not life.asleep and life.level is None
    log.clear()
    assert life.shutdown() == []
    assert log == [("release", "step"), ("release", "pg"), ("release", "kv"), ("release", "w")]


def test_a_sleep_while_partly_asleep_sleeps_only_the_awake_rows_at_their_own_level():
    log = []
    life = table(log)
    life.start()
    life.sleep(2)
    life.wake([WEIGHTS])
    log.clear()
    life.sleep(1)
    assert log == [("sleep1", "w")]  # kv and step sleep on, at level 2
    assert life.level_of(WEIGHTS) == 1 and life.level_of(KV_CACHE) == 2 and life.level == 2
    assert life.fully_asleep
    log.clear()
    life.wake([WEIGHTS, KV_CACHE])
    assert log == [("wake1", "w"), ("wake2", "kv"), ("wake2", "step"), ("woken", "w"), ("woken", "kv"),
                   ("woken", "step")]
    assert not life.asleep and life.level is None and not life.fully_asleep


def test_a_failed_partial_sleep_leaves_the_sleeping_rows_as_they_were():
    log = []
    life = table(log, {"w": {"sleep1"}})
    life.start()
    life.sleep(2)
    life.wake([WEIGHTS])
    log.clear()
    with pytest.raises(RuntimeError, match="w.sleep1"):
        life.sleep(1)
    assert log == [("sleep1", "w")]  # nothing else was awake: nothing to wake again, nothing woken by mistake
    assert [(c.owner, level) for c, level in life.asleep.items()] == [("kv", 2), ("step", 2)]
    assert life.level_of(WEIGHTS) is None and not life.fully_asleep


def test_failed_acquire_releases_what_was_acquired_in_reverse():
    log = []
    life = table(log, {"pg": {"acquire"}})
    with pytest.raises(RuntimeError, match="pg.acquire"):
        life.start()
    assert log == [("acquire", "w"), ("acquire", "kv"), ("acquire", "pg"),
                   ("release", "pg"), ("release", "kv"), ("release", "w")]


def test_failed_wake_puts_back_to_sleep_what_it_woke():
    log = []
    life = table(log, {"step": {"wake1"}})
    life.start()
    life.sleep(1)
    log.clear()
    with pytest.raises(RuntimeError, match="step.wake1"):
        life.wake([WEIGHTS, KV_CACHE])
    assert log == [("wake1", "w"), ("wake1", "kv"), ("wake1", "step"),
                   ("unwake1", "step"), ("unwake1", "kv"), ("unwake1", "w")]
    assert life.sleeping_tags == {WEIGHTS, KV_CACHE} and life.level == 1  # as asleep as before the call


def test_failed_sleep_wakes_again_what_it_put_to_sleep():
    log = []
    life = table(log, {"w": {"sleep1"}})
    life.start()
    log.clear()
    with pytest.raises(RuntimeError, match="w.sleep1"):
        life.sleep(1)
    assert log == [("sleep1", "step"), ("sleep1", "kv"), ("sleep1", "w"), ("wake1", "kv"), ("wake1", "step")]
    assert not life.asleep


def test_a_failing_release_does_not_stop_the_others():
    log = []
    life = table(log, {"kv": {"release"}})
    life.start()
    errors = life.shutdown()
    assert [e.split(":")[0] for e in errors] == ["releasing kv failed"]
    assert [o for what, o in log if what == "release"] == ["step", "pg", "kv", "w"]


def test_a_row_added_to_the_runner_table_takes_part_in_every_transition(tiny_llama_dir, monkeypatch):
    """A new component is one more row: start, sleep, wake and shutdown reach it in table order."""
    log = []
    real = ModelRunner._components

    def with_recorder(self, tp):
        rows = real(self, tp)
        for row in rows:  # log the real rows' calls too, to check the order across them
            for what in ("acquire", "release", "sleep", "wake"):
                original = getattr(row, what)

                def logged(*args, _what=what, _row=row, _original=original):
                    log.append((_what, _row.owner))
                    return _original(*args)

                setattr(row, what, logged)
        return rows + [Recorder("fake", STEP, log)]

    monkeypatch.setattr(ModelRunner, "_components", with_recorder)
    llm = LLM(tiny_llama_dir, device="cpu")
    owners = ["weights", "host_weights", "rope", "kv_cache", "fake"]
    assert [o for what, o in log if what == "acquire"] == owners
    before = llm.generate(["a b c"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    log.clear()
    llm.sleep(level=1)
    assert [e for e in log if e[0].startswith("sleep")] == [("sleep1", "fake")] + [("sleep", o) for o in
                                                                                  reversed(owners[:-1])]
    log.clear()
    llm.wake_up()
    assert [o for what, o in log if what.startswith("wake")] == owners
    assert llm.generate(["a b c"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    log.clear()
    assert llm.shutdown().clean
    assert [o for what, o in log if what == "release"] == list(reversed(owners))


def test_a_failing_row_after_the_weights_releases_them(tiny_llama_dir, monkeypatch):
    log = []
    real = ModelRunner._components
    monkeypatch.setattr(ModelRunner, "_components",
                        lambda self, tp: real(self, tp) + [Recorder("fake", STEP, log, {"acquire"})])
    refs = []
    real_start = Lifecycle.start

    def start(self):
        try:
            real_start(self)
        finally:  # by now the failed start has released every row; keep weak references to check
            refs.extend(e.ref for e in self.table[0]._ledger.entries())

    monkeypatch.setattr(Lifecycle, "start", start)
    with pytest.raises(RuntimeError, match="fake.acquire"):
        LLM(tiny_llama_dir, device="cpu")
    assert log == [("acquire", "fake"), ("release", "fake")]
    assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_kv_plan_is_made_before_the_model_and_matches_it(tmp_path, hf_tokenizer_dir, arch, tied):
    """The plan's weight bytes (computed from the config alone) are the arena's, and nothing changes later."""
    from conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, arch=arch, tie_word_embeddings=tied)
    with LLM(path, device="cpu", kv_cache_memory=128 << 10) as llm:
        plan = llm.runner.kv_plan
        assert plan.weight_bytes == llm.runner.arena.nbytes
        # 128 KiB hold fewer tokens than the model's 512 positions: the context shrank before the model was built.
        assert plan.max_model_len == llm.max_model_len == llm.runner.model.model.rotary.max_positions < 512
        assert llm.runner.num_kv_blocks == plan.num_blocks


def test_a_failing_cache_release_is_reported_not_passed_for_clean(tiny_llama_dir, monkeypatch):
    """free_device_caches raising during shutdown: the rest is still released and the report says so."""
    import tidyrun.runner.model_runner as model_runner

    def broken(device):
        raise RuntimeError("driver said no")

    llm = LLM(tiny_llama_dir, device="cpu")
    refs = [e.ref for e in llm.runner.ledger.entries()]
    monkeypatch.setattr(model_runner, "free_device_caches", broken)
    with pytest.warns(ResourceWarning, match="driver said no"):
        report = llm.shutdown()
    assert not report.clean and any("driver said no" in e for e in report.errors)
    assert all(r() is None for r in refs)  # every component was released all the same
    assert llm.shutdown() is report
