"""The programs in examples/ run as users run them (a fresh interpreter each) and check what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(name: str, *args: str, timeout: float = 900) -> str:
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_grpo_loop_two_iterations():
    """Rollout logprobs equal the trainer's recomputation (fp32 CPU, max |diff| <= 1e-4, also after the pushed
    weights), every policy step moves probability towards the rewarded completions, and shutdown is clean."""
    out = run_example("grpo_loop.py", "--iterations", "2", "--n", "6", "--prompts", "2", "--max-tokens", "8",
                      "--device", "cpu", "--lr", "1e-4")
    lines = re.findall(r"iteration (\d): mean reward ([\d.]+), rollout vs trainer logprobs max \|diff\| ([\d.e+-]+), "
                       r"advantage-weighted logprob gain ([+-][\d.]+)", out)
    assert [int(it) for it, *_ in lines] == [0, 1], out
    assert all(float(diff) <= 1e-4 for _, _, diff, _ in lines), out
    assert all(float(gain) > 0 for *_, gain in lines), out
    assert "mean reward by iteration" in out and "nothing survived" in out.split("shutdown:")[-1], out


def test_colocated_trainer_under_torchrun():
    """Two trainer ranks (gloo) each hold the policy and build one 2-rank engine with the external launcher: the
    ranks sample the same tokens, the trainer's data-parallel step keeps the policies equal, and shutdown is
    clean on both ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), os.path.join(EXAMPLES, "colocate_torchrun.py"), "--iterations", "1",
                           "--max-tokens", "6"],
                          capture_output=True, text=True, timeout=900, env={**env, "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert re.search(r"iteration 0: mean reward [\d.]+, ranks sampled the same tokens: True, policies equal: True, "
                     r"\d+ tensors pushed", out), out
    assert "nothing survived; ranks clean: 2 of 2" in out, out
