"""embed()/score(): pooled hidden states equal transformers' on the same weights, KV-free."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tidyrun import LLM, InvalidRequestError, PromptTooLongError, SamplingParams

TEXTS = ["The capital of France is Paris.", "A journey of a thousand miles begins with a single step.", "hi"]


def hf_pooled(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    return {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]


@pytest.fixture(scope="module")
def hf_default(default_model):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_default_model_embeddings_match_transformers(llm, hf_default, pooling):
    pool = llm.scheduler.pool
    free_before = pool.num_free
    ours = llm.embed(TEXTS, pooling=pooling, normalize=False)
    assert pool.num_free == free_before  # KV-free: no block taken
    assert ours.shape == (3, 576) and ours.dtype == torch.float32
    for row, text in zip(ours, TEXTS):
        ref = hf_pooled(hf_default, llm.tokenizer.encode(text), pooling)
        assert F.cosine_similarity(row, ref, dim=0).item() > 0.999


def test_normalized_embeddings_and_score(llm):
    e = llm.embed(TEXTS)
    assert torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    scores = llm.score(TEXTS[0], [TEXTS[0], TEXTS[1]])
    assert scores[0].item() == pytest.approx(1.0, abs=1e-5) and scores[1].item() < 0.999
    assert torch.allclose(llm.embed([TEXTS[2]]), llm.embed(TEXTS)[2:], atol=1e-5)  # batch-independent


def test_embedding_batches_are_split_by_token_budget(tiny_llama_dir):
    with LLM(tiny_llama_dir, device="cpu", max_num_batched_tokens=8, max_model_len=64) as small:
        ids = [list(range(5, 5 + n)) for n in (3, 7, 12, 2)]  # 12 > budget: a group of its own
        together = small.embed(ids)
        alone = torch.cat([small.embed([x]) for x in ids])
        assert torch.allclose(together, alone, atol=1e-5)


def test_embed_bad_input(llm):
    with pytest.raises(InvalidRequestError, match="pooling"):
        llm.embed(["x"], pooling="max")
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]])
    with pytest.raises(PromptTooLongError):
        llm.embed([[5] * 2000])
    with pytest.raises(InvalidRequestError):
        llm.embed([])
    assert llm.generate(["still fine"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_embed_then_shutdown_leaves_nothing(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    llm.embed(["some text", "more text"], pooling="mean")
    refs = [e.ref for e in llm.runner.ledger.entries()]
    assert llm.shutdown().clean and all(r() is None for r in refs)
