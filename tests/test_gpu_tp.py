"""Tensor parallelism over NCCL on two GPUs: outputs equal to one GPU, every byte back on both GPUs.

Run on a machine with 2 GPUs: ``pytest -m gpu tests/test_gpu_tp.py -s``.
Rank 1 lives in a worker process; its memory is read on GPU 1 at the driver
level (``cudaMemGetInfo``), which counts every process on that GPU.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from conftest import GPU_TEST_SHAPE, QUESTIONS
from tidyrun import LLM, SamplingParams
from tidyrun.memory import initialize_cuda, sample_memory
from tidyrun.synthetic import write_random_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

DRIVER_SLACK = 16 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gpu_tp")), GPU_TEST_SHAPE, dtype=torch.bfloat16)


def test_fp32_greedy_equal_to_one_gpu(default_model):
    """fp32 reference kernels: the split model (3 KV heads as 2 + 1) decodes the same tokens as one GPU."""
    with LLM(default_model, device="cuda", dtype="float32", kernels="torch", max_model_len=512) as one:
        prompts = [{"prompt_token_ids": one.tokenizer.apply_chat_template([{"role": "user", "content": q}], True)}
                   for q in QUESTIONS[:4]]
        expected = greedy(one, prompts)
    with LLM(default_model, device="cuda", dtype="float32", kernels="torch", max_model_len=512,
             tensor_parallel_size=2) as two:
        assert greedy(two, prompts) == expected


def test_bf16_triton_logits_close_to_one_gpu(checkpoint):
    prompt = list(range(10, 200))
    with LLM(checkpoint, device="cuda", dtype="bfloat16", max_model_len=1024) as one:
        expected = one.compute_logits(prompt)
        tokens = greedy(one, [prompt])
    with LLM(checkpoint, device="cuda", dtype="bfloat16", max_model_len=1024, tensor_parallel_size=2) as two:
        torch.testing.assert_close(two.compute_logits(prompt), expected, atol=0.15, rtol=0.05)
        same = sum(a == b for a, b in zip(greedy(two, [prompt])[0], tokens[0]))
        print(f"\nbf16 greedy: {same}/{len(tokens[0])} tokens equal to one GPU")


def test_shutdown_returns_every_byte_on_both_gpus(checkpoint):
    initialize_cuda("cuda:0")
    torch.zeros(1, device="cuda:1")  # the driver's own context on GPU 1 exists before the baseline
    base = [sample_memory(f"cuda:{i}") for i in range(2)]
    llm = LLM(checkpoint, device="cuda:0", dtype="bfloat16", tensor_parallel_size=2)
    during = [sample_memory(f"cuda:{i}") for i in range(2)]
    llm.generate([[5, 6, 7, 8]] * 8, SamplingParams(temperature=0.8, max_tokens=16, seed=0), use_tqdm=False)
    llm.sleep(1)
    llm.wake_up()
    report = llm.shutdown(strict=True)
    after = [sample_memory(f"cuda:{i}") for i in range(2)]
    for i in range(2):
        print(f"\nGPU {i}: base {base[i]}\n       running {during[i]}\n       after {after[i]}")
    assert report.clean and len(report.ranks) == 2
    assert all(sum(r.released_bytes.values()) > 0 for r in report.ranks)
    assert after[0].allocated == base[0].allocated and after[0].reserved == base[0].reserved
    for i in range(2):
        assert abs(after[i].driver_used - base[i].driver_used) <= DRIVER_SLACK, f"GPU {i}: {after[i].delta(base[i])}"
    assert not multiprocessing.active_children()
