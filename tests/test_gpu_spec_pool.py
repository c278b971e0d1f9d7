"""On CUDA: an engine that ran n-gram speculation and pooling (embed/score) still shuts down to baseline.

Speculation adds multi-token verification steps and pooling a KV-free prefill
path; neither may leave a device byte behind. Baseline as in
test_gpu_lifecycle.py: after the CUDA context and cuBLAS exist.
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_TEST_SHAPE
from tidyrun import LLM, SamplingParams
from tidyrun.memory import initialize_cuda, sample_memory
from tidyrun.synthetic import write_random_checkpoint

pytestmark = pytest.mark.gpu

DRIVER_SLACK = 16 << 20
# Random weights give flat logits (std ~0.64; the top two often 0-1 bf16 ulp apart, 1 ulp = 0.0156 at
# |logit| ~2.5), so batch shape alone can flip a greedy pick in bf16 (it does on the CPU): each engine's
# output is checked against teacher-forced logits up to TIE rather than compared token for token.
TIE = 0.1
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Repeated token lists; the random model's greedy output soon cycles too, so prompt lookup has drafts to offer.
PROMPTS = [[5, 17, 42, 99, 7, 250, 33, 12] * 4, [300, 301, 302, 303, 304, 305] * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
TEXTS = ["The quick brown fox", "To be, or not to be", "def main():"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gpu_spec_ckpt")), GPU_TEST_SHAPE, dtype=torch.bfloat16)


def engine(checkpoint: str, **kwargs) -> LLM:
    return LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=2 << 30, **kwargs)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


def max_deficit(llm: LLM, prompt: list[int], out: list[int]) -> float:
    """Largest (max logit - logit of the emitted token) over ``out``, teacher-forced through ``prompt + out``."""
    logits = llm.compute_logits(prompt + out)[len(prompt) - 1:-1].float().cpu()
    return (logits.max(-1).values - logits[torch.arange(len(out)), out]).max().item()


def test_speculation_and_pooling_then_shutdown_returns_every_byte(checkpoint):
    _, base = initialize_cuda("cuda")
    with engine(checkpoint) as plain:
        expected = greedy(plain)
    llm = engine(checkpoint, speculative=SPEC)
    got = greedy(llm)
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0, stats
    same = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(g)) for g, e in zip(got, expected)]
    deficits = [max_deficit(llm, p, out) for p, g, e in zip(PROMPTS, got, expected) for out in (g, e)]
    assert [len(g) for g in got] == [GREEDY.max_tokens] * len(PROMPTS)
    assert max(deficits) <= TIE, deficits  # both greedy up to rounding, so any departure is at a near-tie
    embeddings = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS + [PROMPTS[0]], pooling="mean")])
    assert embeddings.shape == (4, GPU_TEST_SHAPE["hidden_size"])
    assert torch.isfinite(embeddings).all()
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS)]
    assert len(scores) == 3 and scores[0] == pytest.approx(1.0, abs=1e-3)
    during = sample_memory("cuda")
    report = llm.shutdown(strict=True)
    after = sample_memory("cuda")
    print(f"\nidentical prefix with / without speculation {same} of {GREEDY.max_tokens}; max logit deficit "
          f"{max(deficits):.4f}; drafts {stats['spec_draft_tokens']}, accepted {stats['spec_accepted_tokens']}"
          f"\nbaseline {base}\nengine   {during}\nafter    {after}\n{report}")
    assert report.clean
    assert after.allocated == base.allocated, after.delta(base)
    assert after.reserved == base.reserved, after.delta(base)
    assert abs(after.driver_used - base.driver_used) <= DRIVER_SLACK, after.delta(base)
