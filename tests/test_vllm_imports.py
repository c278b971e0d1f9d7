"""The helpers vLLM users import besides LLM and SamplingParams, at vLLM's import paths (lm-eval's vLLM backend
imports get_tokenizer, get_open_port, LoRARequest and resolve_hf_chat_template): each does what vLLM's does."""

from __future__ import annotations

import os
import socket

import pytest

from tidyrun import InvalidRequestError, ModelLoadError, SamplingParams
from tidyrun.entrypoints.chat_utils import resolve_hf_chat_template
from tidyrun.lora.request import LoRARequest
from tidyrun.transformers_utils.tokenizer import get_tokenizer
from tidyrun.utils import get_open_port


def test_get_tokenizer_gives_the_models_tokenizer(llm, default_model, hf_tokenizer_dir):
    text = "The capital of France is Paris."
    want = llm.get_tokenizer().encode(text)
    assert get_tokenizer(default_model).encode(text) == want  # the GGUF file's own
    folder = get_tokenizer(hf_tokenizer_dir, add_bos_token=False)  # a transformers folder, with a keyword
    assert folder.encode(text) == want and folder.eos_token_id == llm.get_tokenizer().eos_token_id
    assert get_tokenizer(hf_tokenizer_dir, tokenizer_mode="slow").encode(text) == want  # use_fast=False
    with pytest.raises(InvalidRequestError, match="tokenizer_mode='mistral' is not supported"):
        get_tokenizer(hf_tokenizer_dir, tokenizer_mode="mistral")
    with pytest.raises(InvalidRequestError, match="a path or a Hugging Face id, got NoneType"):
        get_tokenizer(None)
    with pytest.raises(ModelLoadError, match="does not exist"):
        get_tokenizer(os.path.join(hf_tokenizer_dir, "missing"))
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        get_tokenizer(os.path.dirname(hf_tokenizer_dir))  # a folder with no tokenizer in it


def test_get_tokenizer_refuses_a_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(ModelLoadError, match="cannot build the tokenizer from GGUF file"):
        get_tokenizer(str(bad))


def test_get_open_port_is_free():
    port = get_open_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))  # nobody holds it


def test_a_lora_request_is_refused_by_generate(llm):
    request = LoRARequest("finetuned", 1, "/adapters/finetuned")
    with pytest.raises(InvalidRequestError, match="no LoRA adapters"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), lora_request=request, use_tqdm=False)
    assert llm.generate(["hello"], SamplingParams(max_tokens=2), lora_request=None, use_tqdm=False)


def test_resolve_hf_chat_template(llm):
    tok = llm.get_tokenizer()
    assert resolve_hf_chat_template(tok, "{{ messages }}", None) == "{{ messages }}"
    assert resolve_hf_chat_template(tokenizer=tok, chat_template=None, tools=None, model_config=object(),
                                    trust_remote_code=False) == tok.chat_template
    assert resolve_hf_chat_template(object(), None) is None


def test_the_engine_imports_without_the_server_stack():
    """``import tidyrun`` (LLM, AsyncLLM, LLMEngine) needs no fastapi: an offline or RL process, or a GPU box with
    only torch and transformers, never serves HTTP. AsyncLLM's engine thread once lived in the server package,
    whose import pulls in fastapi."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = sys.modules['uvicorn'] = None\n"
            "import tidyrun; from tidyrun import LLM, AsyncLLM, LLMEngine, SamplingParams\n"
            "from tidyrun.v1.engine.async_llm import AsyncLLM as A; assert A is AsyncLLM\n"
            "assert 'fastapi' not in [m for m in sys.modules if sys.modules[m] is not None]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
