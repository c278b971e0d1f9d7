"""The leak report: one search for all survivors, grouped by holder, fast, and never a holder itself."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

from tidyrun import LLM, audit
from tidyrun.audit import trace_survivors
from tidyrun.engine import EngineShutdownReport
from tidyrun.report import ShutdownReport
from tidyrun.resources import ResourceLedger

KEPT = {}  # a module global that keeps tensors alive, for the chain test


class _Cache:
    store = {}  # a class attribute that keeps tensors alive, for the chain test


class _Pool(dict):
    """Stands for the CUDA graph pool: a non-tensor object tracked with the bytes it holds."""


def tracked(n: int) -> tuple[ResourceLedger, dict[str, torch.Tensor]]:
    ledger = ResourceLedger()
    return ledger, {f"t{i}": ledger.track("test", f"t{i}", torch.zeros(4)) for i in range(n)}


def entries(ledger: ResourceLedger) -> list:
    return [(e.ref, e.fixed_nbytes) for e in ledger.entries()]


def all_dead(refs) -> bool:
    gc.collect()
    return all(ref() is None for ref, _ in refs)


# Timings are this process's CPU time: what the search costs, whatever else shares the machine (CI runs on
# two busy cores, where wall time can be several times longer).


THOUSAND = """
import time, torch, transformers  # the heap of a user's process: torch and transformers imported
from tidyrun.audit import trace_survivors
from tidyrun.resources import ResourceLedger

def train():
    ledger = ResourceLedger()
    held = {f"t{i}": ledger.track("test", f"t{i}", torch.zeros(4)) for i in range(1000)}
    start = time.process_time()
    survivors = trace_survivors([(e.ref, e.fixed_nbytes) for e in ledger.entries()])
    print(len(survivors), time.process_time() - start, survivors[0].held_by)

train()
"""


def test_a_thousand_survivors_cost_under_a_second():
    """Timed in a fresh process: each level of the search is one pass over the heap, and this test
    process's heap holds whatever the tests before it built (measured: 0.34 s at 174k objects, 0.80 s
    at 1.17M)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", THOUSAND], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    count, seconds, holder = out.stdout.split(maxsplit=2)
    print(f"\n1000 survivors traced in {float(seconds):.3f} s of CPU")
    assert int(count) == 1000 and float(seconds) < 1.0
    assert holder.strip() == "frame train() local 'held' (dict)"


def test_a_thousand_survivors_are_traced_in_one_search_and_grouped():
    ledger, held = tracked(1000)
    start = time.process_time()
    survivors = trace_survivors(entries(ledger))
    seconds = time.process_time() - start
    assert len(survivors) == 1000
    report = ShutdownReport({"test": 16000}, survivors, seconds)
    holder = "frame test_a_thousand_survivors_are_traced_in_one_search_and_grouped() local 'held'"
    assert list(report.by_holder()) == [f"{holder} (dict)"]
    assert f"1000 tensors, 16.00 KB, held by {holder} (dict)" in str(report)
    assert "survived shutdown" in str(report) and len(str(report).splitlines()) == 4
    assert survivors[7].chain == f"{holder} -> (dict)['t7']" and survivors[7].path == "['t7']"
    assert len(report.details().splitlines()) == 1000


ENGINE = """
import json, sys, time
from tidyrun import LLM
from tidyrun.audit import trace_survivors
from tidyrun.report import ShutdownReport

def rollout(path):
    llm = LLM(path, device="cpu")
    held = dict(llm.runner.model.named_parameters())
    refs = [(e.ref, e.fixed_nbytes) for e in llm.runner.ledger.entries()]
    start = time.process_time()
    report = ShutdownReport(survivors=trace_survivors(refs))
    seconds = time.process_time() - start
    groups = {holder: len(group) for holder, group in report.by_holder().items()}
    chains, count = [s.chain for s in report.survivors], len(held)
    del held, report, refs
    print(json.dumps(dict(seconds=seconds, held=count, groups=groups, chains=chains, clean=llm.shutdown().clean)))

rollout(sys.argv[1])
"""


def test_an_engines_tensors_are_traced_in_one_search(tiny_llama_dir):
    """Timed in a fresh process, like the thousand survivors: the suite's own heap grows with every test."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ENGINE, tiny_llama_dir], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nengine tensors traced in {result['seconds']:.3f} s of CPU: {result['groups']}")
    assert result["seconds"] < 2.0
    here = "frame rollout()"
    assert set(result["groups"]) == {f"{here} local 'held' (dict)", f"{here} local 'llm' (LLM)"}
    assert result["groups"][f"{here} local 'held' (dict)"] == result["held"]
    # The rest (weight arena, RoPE tables, KV cache) is reached through the engine itself.
    assert f"{here} local 'llm' -> (LLM).runner.kv.cache.tensor" in result["chains"]
    assert result["clean"]


@pytest.mark.xfail(not issubclass(EngineShutdownReport, ShutdownReport), run=False,
                   reason="ModelRunner.shutdown still builds its own report with one search per survivor")
def test_shutdown_with_held_parameters_is_fast_and_grouped(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    held = dict(llm.runner.model.named_parameters())
    start = time.process_time()
    report = llm.shutdown()
    seconds = time.process_time() - start
    print(f"\nshutdown with {len(report.survivors)} survivors in {seconds:.3f} s\n{report}")
    assert seconds < 2.0
    holder = "frame test_shutdown_with_held_parameters_is_fast_and_grouped() local 'held' (dict)"
    assert list(report.by_holder()) == [holder] and len(report.survivors) == len(held)
    assert f"{len(held)} tensors" in str(report) and f"held by {holder}" in str(report)


def test_nothing_is_held_once_the_user_lets_go():
    ledger, held = tracked(10)
    refs = entries(ledger)
    report = ShutdownReport(survivors=trace_survivors(refs))
    assert len(report.survivors) == 10
    del held  # the search read this frame's locals; no snapshot of them may outlive it
    assert all_dead(refs)
    assert "10 tensors" in str(report)


def test_survivor_bytes_are_its_own_and_a_shared_storage_counts_once():
    ledger = ResourceLedger()
    buffer = torch.zeros(1000)
    held = {"pool": ledger.track("cuda_graphs", "pool", _Pool(), nbytes=5000, device="cpu"),
            "a": ledger.track("weights", "a", buffer[:100]),
            "b": ledger.track("weights", "b", buffer[100:300].view(10, 20))}
    del buffer
    survivors = trace_survivors(entries(ledger))
    assert [(s.description, s.nbytes, s.storage_nbytes) for s in survivors] == [
        ("_Pool", 5000, 5000), ("tensor(100,) torch.float32 on cpu", 400, 4000),
        ("tensor(10, 20) torch.float32 on cpu", 800, 4000)]
    report = ShutdownReport(survivors=survivors)
    assert report.leaked_bytes == 5000 + 4000
    assert "3 objects, 9.00 KB, held by frame" in str(report)
    assert "(800 B of a 4.00 KB storage)" in report.details()
    del held


def test_a_search_cut_short_by_its_bounds_holds_nothing():
    ledger, held = tracked(20)
    nest = held
    for _ in range(30):
        nest = [nest]
    del held
    refs = entries(ledger)
    for bound, holder in (({"time_limit": 0.0}, "unknown (search stopped after 0.00 s)"),
                          ({"max_depth": 5}, "unknown (search stopped at depth 5)")):
        survivors = trace_survivors(refs, **bound)
        assert len(survivors) == 20 and all(s.partial and s.holder == holder for s in survivors), survivors[0]
    assert "a search bound cut some chains short" in str(ShutdownReport(survivors=survivors))
    del nest
    assert all_dead(refs)


def test_a_search_that_raises_holds_nothing(monkeypatch):
    ledger, held = tracked(5)
    refs = entries(ledger)

    def fail(*args):
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(audit, "_render_path", fail)
    with pytest.raises(RuntimeError, match="rendering failed") as info:
        trace_survivors(refs)
    del held
    assert all_dead(refs)
    assert info.value.__traceback__ is not None  # still held by the caller, without the survivors


def make_hook(t: torch.Tensor):
    return lambda: t


def test_chains_name_module_globals_class_attributes_and_closures():
    ledger = ResourceLedger()
    KEPT["w"] = ledger.track("t", "global", torch.ones(1))
    _Cache.store["w"] = ledger.track("t", "class", torch.ones(2))
    hooks = [make_hook(ledger.track("t", "closure", torch.ones(3)))]
    try:
        chains = [s.chain for s in trace_survivors(entries(ledger))]
    finally:
        KEPT.clear()
        _Cache.store.clear()
    assert chains == [f"module {__name__} global 'KEPT' -> (dict)['w']",
                      f"module {__name__} global '_Cache' -> (type).store['w']",
                      "frame test_chains_name_module_globals_class_attributes_and_closures() local 'hooks'"
                      " -> (list)[0].__closure__[0].cell_contents"]
    del hooks
