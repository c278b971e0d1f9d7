"""start_profile / stop_profile as vLLM's simple_profiling example calls them: a torch.profiler trace written
to the folder ``profiler_config`` (or VLLM_TORCH_PROFILER_DIR) names; clear errors otherwise."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from tidyrun import LLM, EngineShutdownError, InvalidRequestError, SamplingParams
from tidyrun.config import ProfilerConfig
from tidyrun.profiler import profiler_config

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def engine(checkpoint: str, **kw) -> LLM:
    return LLM(checkpoint, device="cpu", max_model_len=64, kv_cache_memory=4 << 20, **kw)


def events(path: str) -> set[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_a_span_writes_a_trace_of_what_ran_in_it(tiny_llama_dir, tmp_path):
    folder = str(tmp_path / "traces")  # made by start_profile
    with engine(tiny_llama_dir, profiler_config={"profiler": "torch", "torch_profiler_dir": folder}) as llm:
        assert llm.start_profile() is None
        llm.generate(["hello"], PARAMS, use_tqdm=False)
        path = llm.stop_profile()
        assert os.path.dirname(path) == folder and os.path.basename(path).startswith("tidyrun.")
        assert path.endswith(".pt.trace.json.gz") and os.listdir(folder) == [os.path.basename(path)]
        assert "aten::mm" in events(path) or "aten::addmm" in events(path)  # the forward's products
        # A second span, named; one left open at shutdown is written then.
        llm.start_profile(profile_prefix="second")
        llm.generate(["again"], PARAMS, use_tqdm=False)
    assert sorted(n.split(".")[0] for n in os.listdir(folder)) == ["second", "tidyrun"]
    with pytest.raises(EngineShutdownError):
        llm.start_profile()


def test_vllms_environment_variable_turns_it_on(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_USE_GZIP", "0")
    monkeypatch.setenv("VLLM_TORCH_PROFILER_WITH_STACK", "0")
    with engine(tiny_llama_dir) as llm:
        llm.start_profile()
        llm.generate(["hello"], PARAMS, use_tqdm=False)
        path = llm.stop_profile()
    assert path.endswith(".pt.trace.json") and "aten::embedding" in events(path)


def test_misuse_is_refused_naming_what_to_do(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with engine(tiny_llama_dir) as llm:
        with pytest.raises(InvalidRequestError, match="profiling is off.*profiler_config.*VLLM_TORCH_PROFILER_DIR"):
            llm.start_profile()
        with pytest.raises(InvalidRequestError, match="no profile is running"):
            llm.stop_profile()
        llm.generate(["still serves"], PARAMS, use_tqdm=False)
    with engine(tiny_llama_dir, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)}) as llm:
        llm.start_profile()
        with pytest.raises(InvalidRequestError, match="already running"):
            llm.start_profile()
        llm.stop_profile()
        for prefix in ("../escape", "", 7):
            with pytest.raises(InvalidRequestError, match="without path separators"):
                llm.start_profile(profile_prefix=prefix)
        assert os.listdir(tmp_path) and not os.path.exists(tmp_path.parent / "escape")
    with engine(tiny_llama_dir, profiler_config={"profiler": "cuda"}) as llm:
        with pytest.raises(InvalidRequestError, match="'cuda' needs a CUDA device"):
            llm.start_profile()


@pytest.mark.parametrize("value, message", [
    ({"profiler": "nsys"}, r"profiler='nsys': use one of \('torch', 'cuda'\)"),
    ({"profiler": "torch"}, "needs torch_profiler_dir"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "max_iterations": 5}, "max_iterations=5 is not supported"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_dir2": 1}, r"unknown key\(s\) \['torch_pro"),
    ("torch", "must be a dict"),
])
def test_bad_configs_fail_at_construction(value, message):
    with pytest.raises(InvalidRequestError, match=message):
        profiler_config(value)
    with pytest.raises(InvalidRequestError, match=message):
        LLM("/nonexistent/model", profiler_config=value)  # before any file is opened


def test_configs_come_as_vllm_passes_them(monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert profiler_config(None) == ProfilerConfig()
    given = ProfilerConfig("torch", "d", torch_profiler_record_shapes=True)
    assert profiler_config(given) is given
    assert profiler_config({"profiler": "torch", "torch_profiler_dir": "d",
                            "torch_profiler_record_shapes": True}) == given

    class VllmStyle:  # vLLM's own ProfilerConfig object: attributes, some tidyrun does not know
        profiler, torch_profiler_dir, torch_profiler_record_shapes, ignored_field = "torch", "d", True, 1

    assert profiler_config(VllmStyle()) == given
