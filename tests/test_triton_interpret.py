"""On the CPU: the Triton kernels run under Triton's interpreter and equal the torch references (fp32).

Runs in a subprocess because TRITON_INTERPRET must be set before Triton
compiles anything in the process. Skipped where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = """
import torch, kernel_checks as kc
kc.check_padding_rows("cpu", torch.float32)
kc.check_padding_rows("cpu", torch.float32, splits=4)
kc.check_fused("cpu", torch.float32, kc.FUSED_SHAPES)
kc.check_attention("cpu", torch.float32, kc.ATTENTION_CASES, atol=1e-4)
print("kernels ok")
"""


def test_kernels_under_interpreter():
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernels ok" in proc.stdout
