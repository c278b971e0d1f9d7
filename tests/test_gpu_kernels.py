"""On CUDA: the Triton kernels equal plain-torch references over random shapes (bf16 and fp32)."""

from __future__ import annotations

import random

import pytest
import torch

import kernel_checks as kc

pytestmark = pytest.mark.gpu


def random_attention_cases(n: int, seed: int = 0):
    """Random block sizes, GQA ratios and lengths, with 1 and the block boundaries over-represented."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        kv_heads = rng.choice([1, 2, 3, 8])
        heads = kv_heads * rng.choice([1, 3, 4, 8])
        block = rng.choice([8, 16, 32])
        seqs = rng.randint(1, 6)
        q_lens = [rng.choice([1, 1, 2, 5, block, block + 1, rng.randint(1, 300)]) for _ in range(seqs)]
        ctx = [rng.choice([0, 1, block - 1, block, rng.randint(0, 700)]) for _ in range(seqs)]
        cases.append((heads, kv_heads, rng.choice([64, 128]), block, q_lens, ctx))
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_matches_reference(dtype):
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    kc.check_attention("cuda", dtype, kc.ATTENTION_CASES, atol=atol, splits=(1, 2, 16))
    kc.check_attention("cuda", dtype, random_attention_cases(12), seed=1, atol=atol, splits=(1, 8))
    kc.check_attention("cuda", dtype, kc.WINDOW_CASES + tuple(random_attention_cases(6)), seed=2, atol=atol,
                       splits=(1, 8), windows=(1, 7, 64, 512))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padding_rows_are_inert(dtype):
    kc.check_padding_rows("cuda", dtype)
    kc.check_padding_rows("cuda", dtype, splits=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_match_reference(dtype):
    kc.check_fused("cuda", dtype, kc.FUSED_SHAPES + ((256, 2048, 32, 8, 64), (7, 4096, 32, 8, 128)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_row_equals_prefill_row(dtype):
    kc.check_attention_invariance("cuda", dtype)


def test_linear_kernel_is_batch_invariant_and_matches_torch():
    """bf16, with the many-row tiles the runner uses; float32 runs the same code with ieee dots (interpreter test)."""
    shapes = kc.LINEAR_SHAPES + ((16, 3072, 2048), (2, 49152, 576), (300, 2048, 2048))
    kc.check_linear("cuda", torch.bfloat16, shapes, [(64, 128, 8, 3), (32, 512, 2, 4)],
                    tiles=((64, 64, 4, 4), (128, 128, 8, 3)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_race_sampling_kernel_matches_torch(dtype):
    """The sampling race: same tokens, logprobs and ranks as the torch reference on the same noise, at the
    vocabulary widths of Llama 3 (128256) and SmolLM2 (49152), with the runner's slice width."""
    kc.check_race("cuda", dtype, shapes=((1, 128256), (64, 49152), (3, 700)), block=4096)
    kc.check_race("cuda", dtype, block=512)
    kc.check_masked_race("cuda", dtype, shapes=((64, 49152), (3, 128256)), block=4096)
    kc.check_masked_race("cuda", dtype, block=512)
    kc.check_race_keyed("cuda", dtype, vocab=128256, block=4096)
    kc.check_race_keyed("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_experts_kernel_matches_torch(dtype):
    """Experts 8-128, top-k 1-8, routing skewed so that most experts get nothing, up to 300 tokens."""
    kc.check_moe("cuda", dtype, kc.MOE_CASES + kc.random_moe_cases(24, seed=3))


def test_take_pending_kernel_matches_torch():
    kc.check_take_pending("cuda")
