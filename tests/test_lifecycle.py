"""Shutdown gives back everything the runner took, proves it, and names whoever kept something."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_tiny_checkpoint
from tidyrun import (LLM, EngineShutdownError, ModelLoadError, OutOfResourcesError, ResourceLeakError,
                     SamplingParams)
from tidyrun.audit import find_device_tensors, leaks_since, snapshot, unique_storage_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def runner_refs(llm: LLM) -> list[weakref.ref]:
    refs = [e.ref for e in llm.runner.ledger.entries()]
    assert refs and all(r() is not None for r in refs)
    return refs


def tidyrun_object_count() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if str(getattr(type(o), "__module__", "")).startswith("tidyrun"))


def test_shutdown_leaves_no_runner_tensor(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    llm.generate(["hello world"], GREEDY, use_tqdm=False)
    owners = set(llm.runner.ledger.bytes_by_owner())
    assert {"weights", "rope", "kv_cache"} <= owners
    refs = runner_refs(llm)
    report = llm.shutdown()
    assert report.clean, str(report)
    assert set(report.released_bytes) == owners and all(v > 0 for v in report.released_bytes.values())
    assert all(r() is None for r in refs)


def test_planted_reference_is_found_with_its_chain(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    held = [llm.runner.model]
    report = llm.shutdown()
    assert not report.clean
    chains = [s.chain for s in report.survivors]
    assert all(c.startswith("frame test_planted_reference_is_found_with_its_chain() local 'held' -> (list)[0].")
               for c in chains), chains
    assert any(c.endswith("[0].model.layers[1].mlp.gate_up_proj.weight") for c in chains), chains
    # The KV cache was not held, and the RoPE tables are dropped from the model by their own row.
    assert report.leaked_bytes == report.released_bytes["weights"]
    del held


def test_strict_shutdown_raises_with_the_chain(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    stash = {"layer": llm.runner.model.model.layers[0].self_attn}
    with pytest.raises(ResourceLeakError) as info:
        llm.shutdown(strict=True)
    assert "['layer'].qkv_proj.weight" in str(info.value)
    assert "survived shutdown" in str(info.value)
    stash.clear()


def test_twenty_cycles_no_growth(tiny_llama_dir):
    def cycle():
        llm = LLM(tiny_llama_dir, device="cpu")
        llm.generate(["one", "two three"], GREEDY, use_tqdm=False)
        refs = runner_refs(llm)
        assert llm.shutdown().clean
        assert all(r() is None for r in refs)

    cycle()  # warm-up: first-use caches of torch/transformers are not ours
    snap = snapshot()
    objects = tidyrun_object_count()
    for _ in range(20):
        cycle()
    assert leaks_since(snap) == []
    assert tidyrun_object_count() <= objects


def test_two_engines_side_by_side(tiny_llama_dir, hf_tokenizer_dir, tmp_path):
    other_dir = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, arch="qwen2", seed=3)
    a = LLM(tiny_llama_dir, device="cpu")
    b = LLM(other_dir, device="cpu")
    expected_b = b.generate(["side by side"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    a.generate(["side by side"], GREEDY, use_tqdm=False)
    refs_a = runner_refs(a)
    assert a.shutdown().clean
    assert all(r() is None for r in refs_a)
    with pytest.raises(EngineShutdownError):
        a.generate(["x"], GREEDY, use_tqdm=False)
    assert b.generate(["side by side"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected_b
    assert b.shutdown().clean


def test_failed_kv_allocation_releases_the_weights(tiny_llama_dir):
    snap = snapshot()
    with pytest.raises(OutOfResourcesError, match="KV cache"):
        LLM(tiny_llama_dir, device="cpu", num_kv_blocks=10**9)
    assert leaks_since(snap) == []


def test_bad_shard_found_after_some_weights_loaded_releases_everything(tmp_path, hf_tokenizer_dir):
    path = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, max_shard_size="3MB")
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 2
    last = os.path.join(path, shards[-1])
    tensors = load_file(last)
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3)  # wrong shape, found only when that shard is read
    save_file(tensors, last, metadata={"format": "pt"})
    snap = snapshot()
    with pytest.raises(ModelLoadError, match="shape"):
        LLM(path, device="cpu")
    assert leaks_since(snap) == []


def test_shutdown_is_idempotent_and_context_managers_call_it(tiny_llama_dir):
    with LLM(tiny_llama_dir, device="cpu") as llm:
        refs = runner_refs(llm)
    assert llm.is_shut_down and all(r() is None for r in refs)
    first = llm.shutdown()
    assert llm.shutdown() is first and llm.close() is first
    closed = LLM(tiny_llama_dir, device="cpu")
    refs = runner_refs(closed)
    closed.close()
    assert all(r() is None for r in refs)


def test_shutdown_aborts_in_flight_requests(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    rid = llm.add_request("a long one", SamplingParams(max_tokens=100, ignore_eos=True))
    llm.step()
    llm.step()
    report = llm.shutdown()
    assert [o.request_id for o in report.aborted] == [rid]
    assert report.aborted[0].outputs[0].finish_reason == "abort"
    assert len(report.aborted[0].outputs[0].token_ids) == 2
    with pytest.raises(EngineShutdownError):
        llm.step()


def test_dropping_the_engine_shuts_the_runner_down(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    refs = runner_refs(llm)
    runner = weakref.ref(llm.runner)
    del llm
    gc.collect()
    assert runner() is None and all(r() is None for r in refs)


def test_interpreter_exit_shuts_live_engines_down(tiny_llama_dir):
    # finalizers run at exit in reverse order of creation: the check runs after the engine's.
    script = (
        "import weakref, tidyrun\n"
        "class Probe: pass\n"
        "probe = Probe()\n"
        "state = {}\n"
        "weakref.finalize(probe, lambda: print('runner closed at exit:', state['runner'].closed, flush=True))\n"
        f"llm = tidyrun.LLM({tiny_llama_dir!r}, device='cpu')\n"
        "state['runner'] = llm.runner\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "runner closed at exit: True" in out.stdout, out.stdout + out.stderr


def test_find_device_tensors_names_paths(tiny_llama_dir):
    with LLM(tiny_llama_dir, device="cpu") as llm:
        found = find_device_tensors(llm, root_name="llm")
        paths = {f.path for f in found}
        assert "llm.runner.weights.model.model.layers[0].mlp.gate_up_proj.weight" in paths
        assert "llm.runner.kv.cache.tensor" in paths
        # Everything reachable is in the ledger, except RoPE's inverse frequencies: a host-side constant.
        device_side = [f for f in found if not f.path.endswith("rotary._inv_freq")]
        assert unique_storage_bytes(device_side) == sum(llm.runner.ledger.bytes_by_owner().values())


def test_find_device_tensors_on_a_transformers_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    found = find_device_tensors(model, device="cpu", root_name="model")
    paths = {f.path for f in found}
    assert "model.model.layers[1].mlp.up_proj.weight" in paths
    assert sum(f.nbytes for f in found) >= sum(p.numel() * 4 for p in model.parameters())


def test_leaks_since_reports_a_transformers_model_kept_alive(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    snap = snapshot()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    keeper = {"kept": model.model.layers[0]}
    del model
    survivors = leaks_since(snap)
    assert survivors and all("['kept']" in s.chain for s in survivors), [s.chain for s in survivors]
    keeper.clear()
    assert leaks_since(snap) == []


def test_no_module_level_mutable_state():
    """Top-level assignments in the package are constants: no dict/list/set literals or calls."""
    import ast

    import tidyrun

    root = os.path.dirname(tidyrun.__file__)
    offenders = []
    for folder, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, f), encoding="utf-8").read())
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    v = node.value
                    mutable = isinstance(v, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name):
                        mutable |= v.func.id in {"dict", "list", "set", "defaultdict", "deque", "OrderedDict"}
                    if mutable:
                        offenders.append(f"{os.path.relpath(os.path.join(folder, f), root)}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize("engine", ["tidyrun", "transformers"])
def test_audit_cli(tiny_llama_dir, capsys, engine):
    from tidyrun.cli import main

    assert main(["audit", "--engine", engine, "--model", tiny_llama_dir, "--device", "cpu", "--cycles", "2",
                 "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count(" shutdown ") == 2 and "no survivors" in out and "baseline" in out
