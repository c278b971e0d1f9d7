"""On CUDA, shutdown returns allocated and reserved bytes exactly, and driver memory within 16 MiB.

The baseline is taken after CUDA *and cuBLAS* are initialised (see
``tidyrun.memory.initialize_cuda``): the cuBLAS handles torch creates at a
process's first GEMM stay until exit whoever ran that GEMM. The test also
prints the reading against the bare-context baseline.
"""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import GPU_TEST_SHAPE
from tidyrun import LLM, OutOfResourcesError, SamplingParams
from tidyrun.memory import MemorySample, initialize_cuda, sample_memory
from tidyrun.synthetic import write_random_checkpoint

pytestmark = pytest.mark.gpu

DRIVER_SLACK = 16 << 20
PROMPTS = ["The quick brown fox", "To be, or not to be", "def main():", "All that glitters"]
PARAMS = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, ignore_eos=True, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gpu_ckpt")), GPU_TEST_SHAPE, dtype=torch.bfloat16)


def baseline() -> MemorySample:
    """Memory after the CUDA context and cuBLAS handles exist (both are the process's, not the engine's)."""
    context, blas = initialize_cuda("cuda")
    print(f"\nbare CUDA context {context}\nwith cuBLAS       {blas}")
    return blas


def assert_back_to(base: MemorySample, after: MemorySample) -> None:
    assert after.allocated == base.allocated, f"allocated {after.allocated} != {base.allocated}"
    assert after.reserved == base.reserved, f"reserved {after.reserved} != {base.reserved}"
    assert abs(after.driver_used - base.driver_used) <= DRIVER_SLACK, f"driver {after.delta(base)}"


def run_cycle(checkpoint: str, **kwargs) -> None:
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    report = llm.shutdown(strict=True)
    assert report.clean and sum(report.released_bytes.values()) > 0


def test_shutdown_returns_every_byte(checkpoint):
    base = baseline()
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16")  # default KV sizing: 90% of the GPU
    during = sample_memory("cuda")
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    report = llm.shutdown(strict=True)
    after = sample_memory("cuda")
    print(f"\nbaseline {base}\nengine   {during}\nafter    {after}\n{report}")
    assert during.allocated - base.allocated > 1 << 30
    assert_back_to(base, after)


def test_fifty_cycles_zero_growth(checkpoint):
    base = baseline()
    readings = []
    for _ in range(50):
        run_cycle(checkpoint, kv_cache_memory=1 << 30)
        readings.append(sample_memory("cuda"))
    print(f"\nbaseline {base}\ncycle 1  {readings[0]}\ncycle 50 {readings[-1]}")
    for r in readings:
        assert_back_to(base, r)
    assert readings[-1].driver_used - readings[0].driver_used <= 0
    assert {r.allocated for r in readings} == {base.allocated}
    assert {r.reserved for r in readings} == {base.reserved}


def test_failed_start_returns_every_byte(checkpoint):
    base = baseline()
    with pytest.raises(OutOfResourcesError, match="KV cache"):
        LLM(checkpoint, device="cuda", dtype="bfloat16", num_kv_blocks=10**8)
    after = sample_memory("cuda")
    print(f"\nfailed start: baseline {base}\nafter {after}")
    assert_back_to(base, after)


def test_planted_reference_is_reported_then_released(checkpoint):
    base = baseline()
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    held = {"qkv": llm.runner.model.model.layers[2].self_attn.qkv_proj.weight}
    report = llm.shutdown()
    assert [s.chain for s in report.survivors] == [
        "frame test_planted_reference_is_reported_then_released() local 'held' -> (dict)['qkv']"]
    # Its own bytes, and the weight arena it views, kept alive whole.
    assert report.survivors[0].nbytes == held["qkv"].numel() * held["qkv"].element_size()
    assert report.survivors[0].storage_nbytes == report.leaked_bytes == held["qkv"].untyped_storage().nbytes()
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()
    assert_back_to(base, sample_memory("cuda"))


def test_shutdown_leaves_other_graphs_working(checkpoint):
    """One engine's shutdown must not break a second engine's graphs, nor a user's own CUDA graph that was
    captured on a stream which had run cuBLAS before (process-wide cuBLAS workspace clearing did)."""
    initialize_cuda("cuda")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    b = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    prompts = PROMPTS * 16  # 64 rows: the decode graphs run cuBLAS products
    expected = [o.outputs[0].token_ids for o in b.generate(prompts, greedy, use_tqdm=False)]
    a.generate(prompts, greedy, use_tqdm=False)

    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (x @ w).sum().item()  # cuBLAS has made this stream's workspace before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = torch.relu(x @ w) @ w
    graph.replay()
    torch.cuda.synchronize()
    want = y.clone()

    assert a.shutdown(strict=True).clean
    sentinels = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]  # 256 MiB of fresh blocks
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    assert all(bool((s == 7.0).all()) for s in sentinels), "the user's graph wrote into memory it does not own"
    assert [o.outputs[0].token_ids for o in b.generate(prompts, greedy, use_tqdm=False)] == expected
    assert b.shutdown(strict=True).clean
    del graph, y, want, sentinels, x, w


def _hold_and_drop(checkpoint, base):
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    held = dict(llm.runner.model.named_parameters())
    refs = [e.ref for e in llm.runner.ledger.entries()]
    report = llm.shutdown()
    assert len(report.survivors) == len(held) and "local 'held'" in str(report)
    assert report.seconds < 2.0, report.seconds
    del held
    assert all(r() is None for r in refs)  # the report itself holds nothing
    torch.cuda.empty_cache()
    assert_back_to(base, sample_memory("cuda", collect=False))


def test_dropping_what_the_report_named_gives_the_memory_back_at_once(checkpoint):
    _hold_and_drop(checkpoint, baseline())


def _rss() -> int:
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pinned_host_copy_goes_back_to_the_os(checkpoint):
    base = baseline()
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    weights = llm.runner.arena.nbytes
    awake = _rss()
    llm.sleep(level=1)
    assert llm.runner.ledger.bytes_by_owner()["host_weights"] == weights
    asleep = _rss()
    llm.wake_up()
    llm.sleep(level=2)  # the host copy is dropped here
    dropped = _rss()
    llm.wake_up()
    assert llm.shutdown(strict=True).clean
    after = _rss()
    print(f"\nweights {weights / 2**20:.0f} MiB; RSS awake {awake / 2**20:.0f}, level 1 {asleep / 2**20:.0f}, "
          f"level 2 {dropped / 2**20:.0f}, after shutdown {after / 2**20:.0f} MiB")
    assert weights - (64 << 20) <= asleep - awake <= weights + (64 << 20)  # exactly sized, not a power of two
    assert dropped - awake < 64 << 20
    assert after - awake < 64 << 20
    assert_back_to(base, sample_memory("cuda"))


def test_failed_level2_reload_returns_the_device_memory(checkpoint, monkeypatch):
    base = baseline()
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    llm.sleep(level=2)
    real = llm.runner.source.iter_weights

    def broken():
        for i, item in enumerate(real()):
            if i == 20:
                raise OSError("checkpoint shard vanished")
            yield item

    monkeypatch.setattr(llm.runner.source, "iter_weights", broken)
    with pytest.raises(OSError, match="vanished"):
        llm.runner.reload_weights()  # asleep at level 2: wakes the weights reading the checkpoint, all or nothing
    assert llm.is_sleeping and llm.runner.sleeping == {"weights", "kv_cache"}
    assert_back_to(base, sample_memory("cuda"))
    monkeypatch.undo()
    llm.wake_up()
    llm.runner.reload_weights()
    assert len(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == len(PROMPTS)
    assert llm.shutdown(strict=True).clean
