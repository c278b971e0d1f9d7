"""Ranks started by torchrun on two GPUs (NCCL, distributed_executor_backend="external_launcher").

Run on a machine with 2 GPUs: ``pytest -m gpu tests/test_gpu_launcher.py``. The CPU tests
(tests/test_launcher.py) cover the same code over gloo; here each rank runs on cuda:LOCAL_RANK, its
collectives over NCCL and its per-step fingerprint over the host gloo group.
"""

from __future__ import annotations


import pytest
import torch

from test_launcher import PROMPTS, GREEDY, env_launch, torchrun
from tidyrun import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(autouse=True)
def on_gpus(monkeypatch):
    monkeypatch.setenv("LAUNCHED_DEVICE", "cuda")
    monkeypatch.setenv("TIDYRUN_COLLECTIVE_TIMEOUT_S", "120")


def test_torchrun_ranks_on_two_gpus_equal_one_gpu(default_model, tmp_path):
    """fp32 torch kernels: both ranks decode the one-GPU engine's tokens through sleep, reload and pushes."""
    ranks = torchrun("lifecycle", default_model, tmp_path)
    with LLM(default_model, device="cuda", dtype="float32", kernels="torch", max_model_len=256) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["greedy"] == ranks[0]["after_sleep"] == ranks[0]["after_reload"] == expected
    assert ranks[0]["clean"] and ranks[0]["trainer_group_sum"] == 2.0


def test_a_rank_killed_between_steps_fails_the_other_on_the_host_group(default_model, tmp_path):
    ranks, codes, logs = env_launch("kill", default_model, tmp_path)
    assert codes[1] == -9 and codes[0] == 0, "\n".join(logs)
    assert ranks[0]["error"].startswith("WorkerError: tensor-parallel rank 0 of 2 stopped"), ranks[0]
    assert ranks[0]["seconds"] < 60 and ranks[0]["clean"], ranks[0]
