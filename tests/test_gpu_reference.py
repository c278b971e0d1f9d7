"""On CUDA in bf16, tidyrun is as close to an fp32 transformers reference as transformers' own bf16 run.

Both bf16 runs are compared with transformers in fp32 on the same weights,
teacher-forced on the fp32 model's greedy tokens. tidyrun's Triton path keeps
attention scores in fp32 and rounds where torch does elsewhere, so it does
not reproduce transformers' bf16 rounding bit for bit; what must hold is
that its error against fp32 is of the same size (or smaller).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import QUESTIONS, write_tiny_checkpoint
from test_architectures import ARCHS
from tidyrun import LLM, SamplingParams

pytestmark = pytest.mark.gpu

NUM_TOKENS = 32
# bf16 rounding through 30 layers moves probabilities by a few 1e-3; 3e-2 still catches a wrong layout or op.
PROB_TOL = 3e-2


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
    return seq[len(ids):]


def compare(engine: LLM, ref32, ref16, prompts: list[list[int]]) -> list[dict]:
    """Per prompt: top-1 agreement with fp32 (ours, transformers bf16) and max probability error vs fp32."""
    results = []
    for ids in prompts:
        full = ids + hf_greedy(ref32, ids, NUM_TOKENS)
        start = len(ids) - 1
        with torch.no_grad():
            p32 = ref32(torch.tensor([full], device="cuda")).logits[0].float().softmax(-1)[start:start + NUM_TOKENS]
            p16 = ref16(torch.tensor([full], device="cuda")).logits[0].float().softmax(-1)[start:start + NUM_TOKENS]
        ours = engine.compute_logits(full).softmax(-1)[start:start + NUM_TOKENS]
        top = p32.argmax(-1)
        results.append(dict(ours_agree=int((ours.argmax(-1) == top).sum()), hf16_agree=int((p16.argmax(-1) == top).sum()),
                            ours_err=(ours - p32).abs().max().item(), hf16_err=(p16 - p32).abs().max().item()))
    return results


def report_and_check(name: str, results: list[dict]) -> None:
    print(f"\n{name}: top-1 agreement with fp32 /{NUM_TOKENS}: tidyrun bf16 {[r['ours_agree'] for r in results]}, "
          f"transformers bf16 {[r['hf16_agree'] for r in results]}; max prob error vs fp32: tidyrun "
          f"{max(r['ours_err'] for r in results):.4f}, transformers bf16 {max(r['hf16_err'] for r in results):.4f}")
    assert sum(r["ours_agree"] for r in results) >= sum(r["hf16_agree"] for r in results) - len(results), results
    assert max(r["ours_err"] for r in results) <= 2 * max(r["hf16_err"] for r in results) + 1e-3, results
    assert max(r["ours_err"] for r in results) < PROB_TOL * 4, results


def test_default_model_bf16_cuda_matches_transformers(default_model):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model)
    ref32 = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).cuda().eval()
    ref16 = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16).cuda().eval()
    with LLM(default_model, device="cuda", dtype="bfloat16", max_model_len=1024) as engine:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        results = compare(engine, ref32, ref16, prompts)
        text = engine.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=16),
                           use_tqdm=False)[0].outputs[0].text
    report_and_check("default model bf16", results)
    assert text.startswith("The capital of France is Paris.")


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_tiny_checkpoint_bf16_cuda_matches_transformers(tmp_path, hf_tokenizer_dir, arch, overrides):
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, arch=arch, **overrides)
    ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ref16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with LLM(path, device="cuda", dtype="bfloat16") as engine:
        prompts = [engine.tokenizer.encode(q) for q in QUESTIONS]
        results = compare(engine, ref32, ref16, prompts)
    report_and_check(f"tiny {arch} bf16", results)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_tiny_architecture_bf16_matches_transformers(tmp_path, hf_tokenizer_dir, name):
    """Qwen3, Phi-3, Gemma 3 (a window shorter than the prompts plus their outputs), Mixtral, Qwen3-MoE, OLMoE."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, perturb_vectors=True, **ARCHS[name])
    ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ref16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with LLM(path, device="cuda", dtype="bfloat16") as engine:
        assert engine.runner.ops.name == "triton"
        results = compare(engine, ref32, ref16, [engine.tokenizer.encode(q) for q in QUESTIONS])
    ours, theirs = sum(r["ours_agree"] for r in results), sum(r["hf16_agree"] for r in results)
    errors = max(r["ours_err"] for r in results), max(r["hf16_err"] for r in results)
    print(f"\ntiny {name} bf16: top-1 agreement with fp32 {ours} (transformers bf16 {theirs}) of "
          f"{NUM_TOKENS * len(results)}; max prob error vs fp32 {errors[0]:.4f} (transformers bf16 {errors[1]:.4f})")
    # As for Llama above: agreement within one token per prompt of transformers bf16's (near-ties of a tiny
    # random model fall either way under different bf16 rounding). With experts the largest probability error
    # is not held to twice transformers': a token whose k-th and (k+1)-th experts nearly tie may be routed
    # differently by two bf16 runs, which moves its output by more than rounding does.
    assert ours >= theirs - len(results), results
    limit = PROB_TOL if "num_experts" in str(ARCHS[name]) or name == "mixtral" else 2 * errors[1] + 1e-3
    assert errors[0] <= limit, results

