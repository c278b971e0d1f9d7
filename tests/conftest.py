"""Shared fixtures: the default model, tiny random HF checkpoints, transformers references."""

from __future__ import annotations

import os

import pytest
import torch

from tidyrun import LLM
from tidyrun.loader import default_model_path


# Eight different chat questions used by batching tests on CPU and GPU.
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 11?",
    "Name a famous painting.",
    "How many legs does a spider have?",
)
# A 150M-parameter random Llama for GPU memory tests: big enough to show in readings, quick to build.
GPU_TEST_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=4096, vocab_size=32000, max_position_embeddings=4096,
                      tie_word_embeddings=False, rope_theta=10000.0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on the accelerator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def llm(default_model) -> LLM:
    """One CPU fp32 engine on the default model, shared by tests that only generate."""
    engine = LLM(default_model, device="cpu", dtype="float32", max_model_len=1024)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_default_model(default_model):
    """transformers' fp32 model of the same GGUF file: the reference tidyrun is checked against."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, default_model) -> str:
    """The default model's tokenizer saved as a HF tokenizer folder (for tiny checkpoints)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model)
    out = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return str(out)


def write_tiny_checkpoint(out_dir: str, tokenizer_dir: str, arch: str = "llama", max_shard_size: str | None = None,
                          seed: int = 0, perturb_vectors: bool = False, **overrides) -> str:
    """Write a random-weight HF checkpoint (config.json + safetensors + tokenizer) into ``out_dir``.

    ``perturb_vectors``: also draw the 1-D weights (norms, biases) around their init, so that a norm
    loaded into the wrong place, or not applied, changes the logits."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    cfg = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # default init is tiny; widen it so logits are far from uniform
        for p in model.parameters():
            if p.dim() >= 2:  # matrices, and experts stacked [E, out, in]
                p.normal_(0, 0.2)
            elif perturb_vectors:
                p.add_(torch.randn_like(p) * 0.2)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), hf_tokenizer_dir)
