"""On CUDA: while asleep the engine holds no device memory; after waking, outputs are unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_TEST_SHAPE
from tidyrun import LLM, SamplingParams
from tidyrun.memory import initialize_cuda, sample_memory
from tidyrun.synthetic import write_random_checkpoint

pytestmark = pytest.mark.gpu

DRIVER_SLACK = 16 << 20
PROMPTS = ["The quick brown fox", "To be, or not to be", "def main():", "All that glitters"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gpu_sleep_ckpt")), GPU_TEST_SHAPE, dtype=torch.bfloat16)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_asleep_holds_no_device_memory_and_wakes_identical(checkpoint, level):
    _, base = initialize_cuda("cuda")
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=4 << 30)
    before = tokens(llm)
    awake = sample_memory("cuda")
    for cycle in range(3):
        freed = llm.sleep(level=level)
        asleep = sample_memory("cuda")
        print(f"\nlevel {level} cycle {cycle}: awake {awake}\n  asleep {asleep}\n  freed {freed}"
              f"\n  transfer {llm.runner.last_transfer}")
        assert asleep.allocated == base.allocated, asleep.delta(base)
        assert asleep.reserved == base.reserved, asleep.delta(base)
        assert abs(asleep.driver_used - base.driver_used) <= DRIVER_SLACK, asleep.delta(base)
        assert not any(llm.runner.ledger.bytes_by_owner().get(o) for o in ("weights", "kv_cache", "rope"))
        llm.wake_up()
        if level == 2:  # woken without loading: read the checkpoint again (an RL loop pushes its weights)
            llm.runner.reload_weights()
        assert tokens(llm) == before
    assert llm.shutdown(strict=True).clean
    after = sample_memory("cuda")
    assert after.allocated == base.allocated and after.reserved == base.reserved
    assert abs(after.driver_used - base.driver_used) <= DRIVER_SLACK
