"""embed()/score(): pooled hidden states equal transformers' on the same weights, KV-free."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tidyrun import LLM, InvalidRequestError, PoolingParams, PromptTooLongError, SamplingParams

TEXTS = ["The capital of France is Paris.", "A journey of a thousand miles begins with a single step.", "hi"]


def vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


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
    outputs = llm.embed(TEXTS, pooling=pooling, normalize=False)
    assert pool.num_free == free_before  # KV-free: no block taken
    ours = vectors(outputs)
    assert ours.shape == (3, 576) and outputs[0].outputs.hidden_size == 576
    assert [o.prompt_token_ids for o in outputs] == [llm.tokenizer.encode(t) for t in TEXTS]
    assert len({o.request_id for o in outputs}) == 3 and all(o.finished for o in outputs)
    for row, text in zip(ours, TEXTS):
        ref = hf_pooled(hf_default, llm.tokenizer.encode(text), pooling)
        assert F.cosine_similarity(row, ref, dim=0).item() > 0.999


def test_normalized_embeddings_and_score(llm):
    """vLLM's shapes: ``embed`` -> EmbeddingRequestOutput (``.outputs.embedding``), ``score`` ->
    ScoringRequestOutput (``.outputs.score``), one against many (1:N) or two lists pair by pair (N:N)."""
    e = vectors(llm.embed(TEXTS))
    assert torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert torch.allclose(vectors(llm.embed(TEXTS, pooling_params=PoolingParams(normalize=True))), e)
    raw = vectors(llm.embed(TEXTS, pooling_params=PoolingParams(normalize=False)))
    assert torch.allclose(F.normalize(raw, dim=-1), e, atol=1e-5)
    scores = [o.outputs.score for o in llm.score(TEXTS[0], [TEXTS[0], TEXTS[1]])]
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < 0.999
    assert scores[1] == pytest.approx((e[0] @ e[1]).item(), abs=1e-5)
    pairwise = llm.score([TEXTS[0], TEXTS[1]], [TEXTS[1], TEXTS[1]])
    assert [o.outputs.score for o in pairwise] == pytest.approx([(e[0] @ e[1]).item(), 1.0], abs=1e-5)
    pad = llm.get_tokenizer().pad_token_id
    assert pairwise[0].prompt_token_ids == (llm.tokenizer.encode(TEXTS[0]) + ([] if pad is None else [pad])
                                            + llm.tokenizer.encode(TEXTS[1]))
    unnormalized = llm.score(TEXTS[0], TEXTS[1], pooling_params=PoolingParams(normalize=False))
    assert unnormalized[0].outputs.score == pytest.approx(scores[1], abs=1e-6)  # a cosine either way
    assert torch.allclose(vectors(llm.embed([TEXTS[2]])), e[2:], atol=1e-5)  # batch-independent
    last = llm.tokenizer.encode(TEXTS[1])[-3:]
    [cut] = llm.embed(TEXTS[1], truncate_prompt_tokens=3)
    assert cut.prompt_token_ids == last and torch.allclose(vectors([cut]), vectors(llm.embed([last])), atol=1e-5)


def test_encode_is_embed_as_tensors_and_heads_are_refused(llm):
    """vLLM's ``encode(prompts, pooling_params, pooling_task=)``: "embed" (or None) gives ``embed``'s vectors as
    PoolingRequestOutput tensors (``.outputs.data``); tasks that need a classification/reward head or a vector
    per token, and ``classify`` / ``reward``, are refused with InvalidRequestError naming what there is."""
    e = vectors(llm.embed(TEXTS))
    for task in (None, "embed"):
        out = llm.encode(TEXTS, pooling_task=task)
        assert [type(o).__name__ for o in out] == ["PoolingRequestOutput"] * 3
        assert all(o.outputs.data.dtype == torch.float32 and o.outputs.data.shape == (576,) for o in out)
        assert torch.allclose(torch.stack([o.outputs.data for o in out]), e, atol=1e-6)
        assert [o.prompt_token_ids for o in out] == [llm.tokenizer.encode(t) for t in TEXTS]
    raw = llm.encode(TEXTS[:1], PoolingParams(normalize=False), pooling_task="embed")[0].outputs.data
    assert torch.allclose(F.normalize(raw, dim=0), e[0], atol=1e-5) and abs(raw.norm().item() - 1) > 1e-3
    for task, match in (("classify", "classification or reward head"), ("token_classify", "reward head"),
                        ("score", "cosine similarity"), ("token_embed", "a vector per token"),
                        ("encode", "a vector per token"), ("embedding", "must be 'embed'")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.encode(TEXTS, pooling_task=task)
    with pytest.raises(InvalidRequestError, match="tokenization_kwargs"):
        llm.encode(TEXTS, pooling_task="embed", tokenization_kwargs={"truncation": True})
    with pytest.raises(InvalidRequestError, match=r"llm\.classify needs a classification"):
        llm.classify(TEXTS)
    with pytest.raises(InvalidRequestError, match=r"llm\.reward needs"):
        llm.reward(TEXTS)


def test_embedding_batches_are_split_by_token_budget(tiny_llama_dir):
    with LLM(tiny_llama_dir, device="cpu", max_num_batched_tokens=8, max_model_len=64) as small:
        ids = [list(range(5, 5 + n)) for n in (3, 7, 12, 2)]  # 12 > budget: a group of its own
        together = vectors(small.embed(ids))
        alone = torch.cat([vectors(small.embed([x])) for x in ids])
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
    with pytest.raises(InvalidRequestError, match="pairs two lists item by item, but got 2 and 3"):
        llm.score(TEXTS[:2], TEXTS)
    with pytest.raises(InvalidRequestError, match="disagree"):
        llm.embed(TEXTS, normalize=False, pooling_params=PoolingParams(normalize=True))
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=64))
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be"):
        llm.embed(TEXTS, truncate_prompt_tokens=0)
    assert llm.generate(["still fine"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_embed_then_shutdown_leaves_nothing(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    llm.embed(["some text", "more text"], pooling="mean")
    refs = [e.ref for e in llm.runner.ledger.entries()]
    assert llm.shutdown().clean and all(r() is None for r in refs)
