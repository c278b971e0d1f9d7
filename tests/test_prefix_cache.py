"""Prefix caching: repeated prefixes reuse KV blocks, outputs never change, stale blocks are never reused."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUESTIONS
from tidyrun import LLM, SamplingParams
from tidyrun.kv_cache import BlockKey, BlockPool, prefix_digest

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def chat_prompts(llm):
    # The default model's chat template puts a ~30-token system prompt in front of every question.
    return [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])}
            for q in QUESTIONS]


def keys(*blocks: tuple[int, ...]) -> list[BlockKey]:
    """The prefix-cache keys of consecutive blocks holding these tokens."""
    out, parent = [], b""
    for tokens in blocks:
        out.append(BlockKey(prefix_digest(parent, tokens), parent, tokens))
        parent = out[-1].digest
    return out


def test_block_pool_reference_counts_and_lru_eviction():
    pool = BlockPool(4)
    k1, k2, k3 = keys((1, 2), (3, 4), (5, 6))
    a = pool.allocate(2)
    pool.register(a[0], k1)
    pool.register(a[1], k2)
    assert pool.lookup([k1, k2, k3]) == a
    pool.free(a)  # unreferenced but still cached
    assert pool.num_free == 4 and pool.lookup([k1, k2]) == a
    pool.share(a[:1])
    assert pool.num_free == 3
    fresh = pool.allocate(2)  # the never-used blocks go first
    assert set(fresh).isdisjoint(a) and pool.lookup([k1, k2]) == a
    evicting = pool.allocate(1)  # now the freed tail block (k2) is evicted, the shared head kept
    assert evicting == [a[1]] and pool.lookup([k1, k2]) == [a[0]]
    pool.free(fresh + evicting + a[:1])
    assert pool.num_free == 4
    pool.reset_prefix_cache()
    assert pool.lookup([k1]) == []


def test_a_colliding_digest_is_never_a_hit():
    """Two different blocks (or the same tokens after a different prefix) under one digest: the pool checks
    the tokens and the parent of what it finds, so neither is served the other's keys and values."""
    pool = BlockPool(4)
    first, = pool.allocate(1)
    [k] = keys((1, 2, 3))
    pool.register(first, k)
    forged_tokens = BlockKey(k.digest, b"", (9, 9, 9))
    forged_parent = BlockKey(k.digest, b"another prefix", (1, 2, 3))
    assert pool.lookup([forged_tokens]) == [] and pool.lookup([forged_parent]) == []
    assert pool.lookup([k]) == [first]
    assert len(k.digest) == 32  # sha256: a chain of 256-bit digests, not a 64-bit hash()


def test_forced_collisions_change_no_output(tiny_llama_dir, monkeypatch):
    """Every block hashed to the same value (the digest replaced by a constant, and on older code Python's
    hash()): a second user's prompt must not be served the first user's cached blocks."""
    import tidyrun.kv_cache
    import tidyrun.sequence

    alice, bob = [list(range(5, 45))], [list(range(100, 140))]  # 40 tokens each: two full blocks
    with LLM(tiny_llama_dir, device="cpu", enable_prefix_caching=False) as plain:
        expected = tokens(plain, bob)
    monkeypatch.setattr(tidyrun.kv_cache, "prefix_digest", lambda parent, toks: b"\0" * 32)
    monkeypatch.setattr(tidyrun.sequence, "hash", lambda value: 7, raising=False)
    with LLM(tiny_llama_dir, device="cpu") as shared:
        tokens(shared, alice)
        assert shared.scheduler.pool.num_cached >= 1
        cached_before = shared.stats()["prefix_cached_tokens"]
        assert tokens(shared, bob) == expected
        assert shared.stats()["prefix_cached_tokens"] == cached_before


def test_shared_system_prompt_is_reused_and_outputs_match_no_cache(default_model, chat_prompts):
    with LLM(default_model, device="cpu", max_model_len=256, enable_prefix_caching=False) as plain:
        expected = tokens(plain, chat_prompts)
        assert plain.stats()["prefix_cached_tokens"] == 0
    with LLM(default_model, device="cpu", max_model_len=256) as cached:
        first = tokens(cached, chat_prompts[:1])
        rest = tokens(cached, chat_prompts[1:])
        again = tokens(cached, chat_prompts)
        stats = cached.stats()
        pool = cached.scheduler.pool
        assert pool.num_free == pool.num_blocks
    assert first + rest == expected and again == expected
    # Every later prompt reused at least the system prompt's full blocks; the repeat reused almost all.
    assert stats["prefix_cached_tokens"] >= 16 * 7 + sum(len(p["prompt_token_ids"]) - 16 for p in chat_prompts)


def test_eviction_under_a_small_kv_budget_keeps_outputs(default_model, chat_prompts, llm):
    expected = tokens(llm, chat_prompts)
    with LLM(default_model, device="cpu", max_model_len=256, num_kv_blocks=20) as small:
        for _ in range(2):
            assert tokens(small, chat_prompts) == expected
        assert small.scheduler.num_preemptions > 0
        pool = small.scheduler.pool
        assert pool.num_free == pool.num_blocks


def test_new_weights_invalidate_the_cache(tiny_llama_dir, tmp_path):
    prompt = [list(range(5, 45))]  # 40 tokens: two full blocks of 16 get cached
    sd = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    new = {k: v * 1.5 if v.dim() == 2 else v for k, v in sd.items()}
    with LLM(tiny_llama_dir, device="cpu") as llm:
        tokens(llm, prompt)
        assert llm.scheduler.pool.num_cached >= 2
        llm.update_weights(new)
        assert llm.scheduler.pool.num_cached == 0
        after = tokens(llm, prompt)
    folder = str(tmp_path / "scaled")
    shutil.copytree(tiny_llama_dir, folder)
    from safetensors.torch import save_file

    save_file(new, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with LLM(folder, device="cpu") as fresh:
        assert tokens(fresh, prompt) == after


def test_sleep_invalidates_the_cache(tiny_llama_dir):
    prompt = [list(range(5, 45))]
    with LLM(tiny_llama_dir, device="cpu") as llm:
        before = tokens(llm, prompt)
        llm.sleep(level=1)
        assert llm.scheduler.pool.num_cached == 0
        llm.wake_up()
        assert tokens(llm, prompt) == before


def test_whole_prompt_cached_still_computes_the_last_token(tiny_llama_dir):
    prompt = [list(range(5, 37))]  # exactly two blocks
    with LLM(tiny_llama_dir, device="cpu") as llm:
        first = tokens(llm, prompt)
        cached_before = llm.stats()["prefix_cached_tokens"]
        assert tokens(llm, prompt) == first
        assert llm.stats()["prefix_cached_tokens"] - cached_before == 16  # block 2 holds the last token
