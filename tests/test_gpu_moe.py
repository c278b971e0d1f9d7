"""On CUDA: a mixture-of-experts model on the grouped Triton experts (bf16 agreement with transformers for
Mixtral, Qwen3-MoE and OLMoE: test_gpu_reference.py).

- CUDA graphs (the routing sorted on the device, no host read) change no greedy token;
- sleep at both levels and shutdown return every byte of a MoE model, and it wakes identical.
"""

from __future__ import annotations

import pytest
import torch

from test_gpu_graphs import assert_graphs_change_no_token
from tidyrun import LLM, SamplingParams
from tidyrun.memory import initialize_cuda, sample_memory
from tidyrun.synthetic import write_random_checkpoint

pytestmark = pytest.mark.gpu

DRIVER_SLACK = 16 << 20
PROMPTS = ["The quick brown fox", "To be, or not to be", "def main():", "All that glitters"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# ~0.5B parameters, 32 experts of which 4 run per token: large enough to show in memory readings.
MOE_GPU_SHAPE = dict(model_type="olmoe", hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=16, intermediate_size=512, num_experts=32, num_experts_per_tok=4,
                     vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gpu_moe")), MOE_GPU_SHAPE, dtype=torch.bfloat16,
                                   std=0.05)


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_moe_graphs_do_not_change_greedy_output(checkpoint):
    assert_graphs_change_no_token(checkpoint, batches=(1, 8, 3))


def test_moe_sleep_and_shutdown_return_every_byte(checkpoint):
    _, base = initialize_cuda("cuda")
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=2 << 30)
    before = tokens(llm)
    awake = sample_memory("cuda")
    assert awake.allocated - base.allocated > 1 << 30
    for level in (1, 2):
        freed = llm.sleep(level=level)
        asleep = sample_memory("cuda")
        print(f"\nMoE level {level}: awake {awake}\n  asleep {asleep}\n  freed {freed}")
        assert asleep.allocated == base.allocated and asleep.reserved == base.reserved, asleep.delta(base)
        assert abs(asleep.driver_used - base.driver_used) <= DRIVER_SLACK, asleep.delta(base)
        llm.wake_up()
        if level == 2:
            llm.collective_rpc("reload_weights")
        assert tokens(llm) == before
    report = llm.shutdown(strict=True)
    after = sample_memory("cuda")
    print(f"after shutdown {after}\n{report}")
    assert report.clean
    assert after.allocated == base.allocated and after.reserved == base.reserved
    assert abs(after.driver_used - base.driver_used) <= DRIVER_SLACK, after.delta(base)
