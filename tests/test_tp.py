"""Tensor parallelism on the CPU (gloo, 2 ranks): same greedy outputs as one rank, clean teardown, crash handling."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

from conftest import QUESTIONS
from tidyrun import LLM, InvalidRequestError, SamplingParams, WorkerDiedError, WorkerError
from tidyrun.model.sharding import TPShard, split_range
from tidyrun.synthetic import write_random_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Every split is uneven over 2 ranks: 3 KV heads (2 + 1), 301 intermediate channels, 1001 vocabulary rows.
UNEVEN = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
              intermediate_size=301, vocab_size=1001, max_position_embeddings=512, tie_word_embeddings=False,
              rope_theta=10000.0)


def greedy(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def chats(llm: LLM, n: int) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], True)}
            for q in QUESTIONS[:n]]


def worker_pids(llm: LLM) -> list[int]:
    return [w.process.pid for w in llm.runner.pool.workers]


def gone(pids: list[int]) -> bool:
    """No child process with one of ``pids`` is left, nor any process at all with such a pid."""
    if any(p.pid in pids for p in multiprocessing.active_children()):
        return False
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("uneven")), UNEVEN, dtype=torch.float32, std=0.1)


@pytest.fixture(scope="module")
def tp_default(default_model):
    """The default model (3 KV heads: split 2 + 1) over 2 ranks, fp32."""
    llm = LLM(default_model, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,
              tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_split_range_covers_uneven_dimensions():
    assert [split_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 1)]
    assert [split_range(301, 2, r) for r in range(2)] == [(0, 151), (151, 150)]
    assert [split_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    from tidyrun.config import ModelConfig

    cfg = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 2048, True)
    ranks = [TPShard.of(cfg, r, 2) for r in range(2)]
    assert [s.kv_heads for s in ranks] == [(0, 2), (2, 1)] and [s.heads for s in ranks] == [(0, 6), (6, 3)]


def test_greedy_outputs_match_one_rank(llm, tp_default):
    """The default model split 2 + 1 by KV head gives the same greedy tokens as the unsplit model."""
    prompts = chats(tp_default, 4)
    assert greedy(tp_default, prompts) == greedy(llm, prompts)
    single = llm.compute_logits(prompts[0])
    split = tp_default.compute_logits(prompts[0])
    assert split.shape == single.shape
    torch.testing.assert_close(split, single, atol=2e-3, rtol=1e-4)


def test_sleep_wake_and_update_weights_keep_outputs(tp_default):
    prompts = chats(tp_default, 2)
    before = greedy(tp_default, prompts)
    for level in (1, 2):
        freed = tp_default.sleep(level)
        assert {"weights", "kv_cache"} <= set(freed)
        tp_default.wake_up()
        if level == 2:  # woken without loading: every rank reads its slice again
            tp_default.runner.reload_weights()
        assert greedy(tp_default, prompts) == before, f"level {level}"
    full = dict(tp_default.source.iter_weights())  # full tensors: every rank keeps its slice
    assert tp_default.update_weights(full) == len(full)
    assert greedy(tp_default, prompts) == before
    tp_default.sleep(2)
    tp_default.update_weights(full)  # refills the released weights on every rank
    tp_default.wake_up(["kv_cache"])
    assert greedy(tp_default, prompts) == before
    with pytest.raises(InvalidRequestError, match="unexpected weight"):
        tp_default.update_weights({"model.bogus.weight": torch.zeros(3)})
    assert greedy(tp_default, prompts[:1]) == before[:1]  # a rejected update reaches no rank


def test_uneven_splits_and_speculation_match_one_rank(uneven_dir):
    prompts = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300], [9, 9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(uneven_dir, device="cpu", dtype="float32") as single:
        expected = greedy(single, prompts, params)
    with LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
             speculative={"num_speculative_tokens": 3}) as tp:
        assert greedy(tp, prompts, params) == expected
        assert tp.stats()["spec_draft_tokens"] > 0
        with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
            tp.embed("hello")


def test_shutdown_leaves_no_process_and_no_group(uneven_dir):
    """Two TP engines live side by side (no process-global group); shutdown joins the workers, destroys the
    groups and reports every rank clean."""
    engines = [LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2) for _ in range(2)]
    assert not torch.distributed.is_initialized()  # the default group stays the user's
    outs = [greedy(llm, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4)) for llm in engines]
    assert outs[0] == outs[1]
    pids = [pid for llm in engines for pid in worker_pids(llm)]
    groups = [weakref.ref(llm.runner.tp_group.pg) for llm in engines]
    stores = [weakref.ref(llm.runner.tp_group.store) for llm in engines]
    for llm in engines:
        watcher = llm.runner.pool._watcher
        report = llm.shutdown(strict=True)
        assert not watcher.is_alive()
        assert len(report.ranks) == 2 and report.clean
        assert all(r.released_bytes.get("weights", 0) > 0 for r in report.ranks), [str(r) for r in report.ranks]
    gc.collect()
    assert gone(pids)
    assert all(ref() is None for ref in groups + stores)


def test_a_group_kept_alive_is_reported_by_shutdown(uneven_dir):
    """The process group is in the ledger: a reference that outlives shutdown is named like a leaked tensor."""
    llm = LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    held = llm.runner.tp_group.pg
    with pytest.warns(ResourceWarning, match="ProcessGroupGloo"):
        report = llm.shutdown()
    assert [s.description for s in report.survivors] == [type(held).__name__]
    assert report.ranks[1].clean  # the worker's group is gone


def test_killed_worker_is_a_clear_error_and_leaves_no_orphan(uneven_dir, monkeypatch):
    from tidyrun.distributed.group import TPGroup

    aborted = []  # the pool's watcher aborts the group's collectives (a no-op on gloo) the moment a worker dies
    monkeypatch.setattr(TPGroup, "abort", lambda group: aborted.append(group.rank))
    llm = LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=4)
    greedy(llm, [[1, 2, 3]], params)
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted == [0]
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        greedy(llm, [[1, 2, 3]], params)
    assert time.monotonic() - start < 30
    assert gone([pid])
    with pytest.raises(WorkerError, match="has stopped"):
        greedy(llm, [[1, 2, 3]], params)
    report = llm.shutdown()
    assert report.clean and llm.runner is None


def test_worker_killed_during_a_step_fails_it(uneven_dir, monkeypatch):
    """A worker killed after it was sent a step, while the driver runs its part: the step fails fast, naming it."""
    llm = LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    (pid,) = worker_pids(llm)
    pool = llm.runner.pool
    send = pool.send

    def send_then_kill(msg):
        send(msg)
        if msg[0] == "step":
            os.kill(pid, signal.SIGKILL)

    monkeypatch.setattr(pool, "send", send_then_kill)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        greedy(llm, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert time.monotonic() - start < 30
    assert gone([pid])
    assert llm.shutdown().clean


@pytest.mark.parametrize("size, match", [(0, ">= 1"), (True, ">= 1"), (4, "exceeds the model's 3 KV heads")])
def test_bad_tensor_parallel_size(default_model, size, match):
    before = multiprocessing.active_children()
    with pytest.raises(InvalidRequestError, match=match):
        LLM(default_model, device="cpu", tensor_parallel_size=size)
    assert multiprocessing.active_children() == before  # refused before any worker started


def test_tensor_parallel_size_must_fit_the_gpus():
    from tidyrun.config import ModelConfig
    from tidyrun.distributed.driver import check_tensor_parallel_size

    cfg = ModelConfig("llama", 1000, 64, 128, 2, 8, 8, 8, 1e-5, 1e4, 512, False)
    check_tensor_parallel_size(8, cfg, torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="one per rank"):
        check_tensor_parallel_size(torch.cuda.device_count() + 1, cfg, torch.device("cuda", 0))


def test_worker_start_failure_is_reported_by_the_driver(uneven_dir, monkeypatch):
    """A worker that cannot start (here: a device that does not exist) fails the engine's start with its reason."""
    from tidyrun.distributed import driver

    monkeypatch.setattr(driver, "_rank_device", lambda device, rank: "cuda:7")
    before = multiprocessing.active_children()
    with pytest.raises(WorkerError, match="worker rank 1 failed to start"):
        LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    assert multiprocessing.active_children() == before


def test_config_refused_by_the_driver_leaves_no_worker(uneven_dir):
    """A setting the driver's runner refuses before it owns anything (here max_model_len) still ends the
    workers it had already started."""
    before = multiprocessing.active_children()
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        LLM(uneven_dir, device="cpu", dtype="float32", tensor_parallel_size=2, max_model_len=100_000)
    assert multiprocessing.active_children() == before


_ORPHAN_SCRIPT = """
import os, signal, sys
from tidyrun import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
    print(llm.runner.pool.workers[0].process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the driver dies without any cleanup
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited (its reaper may be slow)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_workers_exit_when_the_driver_dies(uneven_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script), uneven_dir], capture_output=True, text=True, timeout=300,
                          env=env)
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 15
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pid)
