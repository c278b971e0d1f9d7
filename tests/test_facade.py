"""The LLM facade's own rules: how it is built from options or a config, and request intake without an engine."""

from __future__ import annotations

import dataclasses

import pytest

from tidyrun import LLM, InvalidRequestError, PromptTooLongError, SamplingParams
from tidyrun.config import EngineConfig
from tidyrun.intake import Prompt, RequestIntake


def test_options_besides_a_config_are_refused(tiny_llama_dir, tmp_path):
    cfg = EngineConfig(model=tiny_llama_dir, device="cpu")
    with pytest.raises(InvalidRequestError, match=r"also got device='cuda', max_num_seqs=8;") as info:
        LLM(config=cfg, max_num_seqs=8, device="cuda")
    assert "model=" not in str(info.value)
    other = str(tmp_path / "other")
    with pytest.raises(InvalidRequestError, match=rf"model='{other}' \(the config says '{tiny_llama_dir}'\)"):
        LLM(other, config=cfg)
    with pytest.raises(InvalidRequestError, match="keep_host_buffers=False"):
        LLM(config=cfg, keep_host_buffers=False)


def test_a_config_alone_or_with_its_own_model_builds(tiny_llama_dir):
    cfg = EngineConfig(model=tiny_llama_dir, device="cpu", max_model_len=64, max_num_seqs=2)
    for llm in (LLM(config=cfg), LLM(tiny_llama_dir, config=cfg)):
        with llm:
            assert llm.config is cfg and llm.max_model_len == 64


def test_keep_host_buffers_is_a_checked_config_field():
    assert EngineConfig().keep_host_buffers is True
    assert dataclasses.replace(EngineConfig(), keep_host_buffers=False).keep_host_buffers is False
    with pytest.raises(InvalidRequestError, match="keep_host_buffers must be a bool"):
        EngineConfig(keep_host_buffers="no")


class Letters:
    """A tokenizer whose text is one token per character (ord - 97)."""

    eos_token_ids = frozenset({2})

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]


INTAKE = RequestIntake(Letters(), vocab_size=26, max_model_len=8)


def test_intake_tokenizes_and_checks_prompts():
    assert INTAKE.prompt("abc") == Prompt("abc", [0, 1, 2])
    assert INTAKE.prompt([3, 4]) == Prompt(None, [3, 4])
    assert INTAKE.prompt({"prompt": "x", "prompt_token_ids": [5]}) == Prompt("x", [5])
    with pytest.raises(PromptTooLongError, match="8 tokens"):
        INTAKE.prompt("abcdefgh")
    with pytest.raises(InvalidRequestError, match=r"ints in \[0, 26\)"):
        INTAKE.prompt([1, 26])
    with pytest.raises(InvalidRequestError, match="list of int"):
        INTAKE.prompt({"prompt_token_ids": 5})


def test_intake_checks_a_whole_generate_call():
    requests = INTAKE.requests(["ab", [1]], None)
    assert [p.token_ids for p, _ in requests] == [[0, 1], [1]]
    assert all(sp == SamplingParams() for _, sp in requests)
    assert INTAKE.requests([4, 5], None)[0][0] == Prompt(None, [4, 5])  # one prompt of token ids
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be below the vocabulary size"):
        INTAKE.requests(["ab", "cd"], [SamplingParams(), SamplingParams(stop_token_ids=[26])])
    with pytest.raises(InvalidRequestError, match="2 sampling params for 1 prompts"):
        INTAKE.requests(["ab"], [SamplingParams(), SamplingParams()])
    with pytest.raises(InvalidRequestError, match="n=1 only"):
        INTAKE.stream_request("ab", SamplingParams(n=2))
