"""tidyrun's logits and greedy tokens equal transformers' on the same weights (CPU, fp32)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import write_tiny_checkpoint
from tidyrun import LLM, SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NUM_TOKENS = 32


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with plain full forwards: no cache, no generate() heuristics."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def assert_matches_reference(engine: LLM, ref, ids: list[int]) -> None:
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    ours = engine.compute_logits(ids).cpu()
    assert ours.shape == ref_logits.shape
    diff = (ours.softmax(-1) - ref_logits.softmax(-1)).abs().max().item()
    assert diff < 1e-3, f"softmax max abs diff {diff}"
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, NUM_TOKENS)


def test_default_gguf_matches_transformers(llm, hf_default_model):
    ids = llm.tokenizer.apply_chat_template(CHAT)
    assert_matches_reference(llm, hf_default_model, ids)
    text = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS), use_tqdm=False)[0].outputs[0].text
    assert text.startswith("The capital of France is Paris.")


def test_default_gguf_raw_prompt_matches_transformers(llm, hf_default_model):
    assert_matches_reference(llm, hf_default_model, llm.tokenizer.encode("The quick brown fox jumps over"))


@pytest.mark.parametrize("arch,overrides,shard", [
    ("llama", {}, None),                                   # untied head, single file
    ("llama", {"tie_word_embeddings": True}, "3MB"),       # tied head, sharded index
    ("qwen2", {"tie_word_embeddings": True}, None),        # q/k/v biases
    ("mistral", {"sliding_window": None}, None),
    # sliding windows shorter than the prompt plus its output: every layer (Mistral), the upper one (Qwen2)
    ("mistral", {"sliding_window": 8}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, None),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 500000.0}, None),
    # yarn: every frequency changes and cos/sin are scaled (transformers' own arithmetic, through the loader)
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
               "max_position_embeddings": 128}, None),
])
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, hf_tokenizer_dir, arch, overrides, shard):
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, arch=arch, max_shard_size=shard, **overrides)
    if shard:
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path, device="cpu", dtype="float32") as engine:
        ids = engine.tokenizer.encode("Hello there, how are you doing today? I am fine.")
        assert_matches_reference(engine, ref, ids)


@pytest.mark.parametrize("model_type,fields,expected", [
    ("mistral", {}, (4096,) * 4),  # transformers' default window when the key is missing
    ("mistral", {"sliding_window": None}, ()),
    ("mistral", {"sliding_window": 64, "layer_types": ["full_attention"] * 4}, (64,) * 4),  # Mistral ignores them
    ("mixtral", {}, ()),
    ("phi3", {"sliding_window": 64}, (64,) * 4),
    ("qwen2", {"sliding_window": 64}, ()),  # no use_sliding_window: transformers drops the window
    ("qwen2", {"sliding_window": 64, "layer_types": ["sliding_attention"] * 4}, ()),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 2}, (0, 0, 4096, 4096)),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64,
               "layer_types": ["sliding_attention", "full_attention"] * 2}, (64, 0, 64, 0)),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4}, (64,) * 4),
    ("llama", {"sliding_window": 64}, ()),
])
def test_sliding_windows_read_as_transformers_reads_them(model_type, fields, expected):
    """Each family's windowed layers and window from config.json fields, as transformers' configuration and
    attention classes (transformers 5) read them."""
    from tidyrun.loader.hf import _sliding_windows

    raw = dict(model_type=model_type, num_hidden_layers=4, **fields)
    assert _sliding_windows(raw, model_type, 1 << 20) == expected
