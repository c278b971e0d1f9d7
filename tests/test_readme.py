"""Every README snippet runs as pasted: each ```python block, and each `tidyrun generate` line.

Each Python block is written to ``snippet.py`` in a fresh temporary folder and
run as a script by this interpreter in its own process (a script, not ``-c``,
so the tensor-parallel block's spawned worker can re-import it behind its
``if __name__ == "__main__"`` guard). Each ``tidyrun generate`` line of a
```bash block runs as pasted with ``--max-tokens 8`` appended (argparse keeps
the last value), but only with ``TIDYRUN_README_BASH=1`` in the environment:
each loads the model again (35-45 CPU-seconds apiece here, 115 for the three),
which the CI budget of this file (under 90 s on 2 cores) leaves no room for.
A snippet fails its test if it exits non-zero or runs past ``TIMEOUT_S``. The
other bash lines (make, chat, serve) are set-up, interactive or long-running,
and are not run here.

The snippets' processes are started together, as many at a time as there are
CPU cores, when the first test of this file needs one; each test then waits
for its own. Most of a snippet's time is loading the model (GGUF header,
tokenizer, dequantization), which is single-threaded.

Skip rules, mechanical, from the snippet's code with comments left out:
  - (bash lines) ``TIDYRUN_README_BASH`` is not ``1``;
  - it contains ``cuda`` and no CUDA device is present;
  - it asks for N tensor-parallel ranks (``tensor_parallel_size=N`` or
    ``--tensor-parallel-size N``) and CUDA is present with fewer than N GPUs
    (the engine's default device is then CUDA; on the CPU, gloo runs N ranks).
The README's blocks are written device-agnostic, so on a CPU machine none skips.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
TP_SIZE = re.compile(r"tensor[_-]parallel[_-]size\s*=?\s*(\d+)")
TIMEOUT_S = 300
GENERATE_EXTRA = ["--max-tokens", "8"]
RUN_BASH = os.environ.get("TIDYRUN_README_BASH") == "1"


def fenced_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, body) of every fenced block of ``language``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def python_code(source: str) -> str:
    """The block's tokens with its comments left out."""
    return " ".join(t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type != tokenize.COMMENT)


def skip_reason(code: str, bash: bool = False) -> str | None:
    """Why a snippet does not run here (the module docstring's rules), or None."""
    if bash and not RUN_BASH:
        return "bash lines run only with TIDYRUN_README_BASH=1 (each loads the model again)"
    if "cuda" in code and not torch.cuda.is_available():
        return "its code names cuda and no CUDA device is present"
    ranks = max((int(n) for n in TP_SIZE.findall(code)), default=1)
    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        return f"it asks for {ranks} tensor-parallel ranks and only {torch.cuda.device_count()} GPU(s) are present"
    return None


with open(README, encoding="utf-8") as _f:
    _TEXT = _f.read()
PYTHON_BLOCKS = {f"README.md:{line}": body for line, body in fenced_blocks(_TEXT, "python")}
GENERATE_LINES = {f"README.md:{line + i}": cmd
                  for line, body in fenced_blocks(_TEXT, "bash")
                  for i, cmd in enumerate(body.splitlines(), start=1) if cmd.startswith("tidyrun generate ")}


def tidyrun_exe() -> str:
    exe = shutil.which("tidyrun", path=os.path.dirname(sys.executable)) or shutil.which("tidyrun")
    assert exe, "the tidyrun command is not installed"
    return exe


def run_python(source: str, cwd: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    script = os.path.join(cwd, "snippet.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(source)
    return subprocess.run([sys.executable, script], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_command(command: str, cwd: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    argv = shlex.split(command, comments=True)
    assert argv[0] == "tidyrun"
    return subprocess.run([tidyrun_exe(), *argv[1:], *GENERATE_EXTRA], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """One future per selected, runnable snippet, all submitted at once (longest first)."""
    selected = {item.callspec.id for item in request.session.items
                if item.module is sys.modules[__name__] and hasattr(item, "callspec")}
    jobs = []
    for key, source in PYTHON_BLOCKS.items():
        if key in selected and skip_reason(python_code(source)) is None:
            jobs.append((key, run_python, source))
    for key, command in GENERATE_LINES.items():
        if key in selected and skip_reason(command, bash=True) is None:
            jobs.append((key, run_command, command))
    jobs.sort(key=lambda job: TP_SIZE.search(job[2]) is None)  # tensor-parallel ones (two processes) first
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
    futures: dict[str, Future] = {}
    for key, fn, text in jobs:
        futures[key] = pool.submit(fn, text, str(tmp_path_factory.mktemp("snippet")))
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def check(key: str, text: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"{key}: the snippet exited {proc.returncode}\n--- snippet ---\n{text}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )


def test_readme_has_snippets():
    assert len(PYTHON_BLOCKS) >= 4 and GENERATE_LINES, (PYTHON_BLOCKS.keys(), GENERATE_LINES.keys())


@pytest.mark.parametrize("key", list(PYTHON_BLOCKS), ids=list(PYTHON_BLOCKS))
def test_python_block_runs_as_pasted(key, started):
    source = PYTHON_BLOCKS[key]
    reason = skip_reason(python_code(source))
    if reason:
        pytest.skip(f"{key}: {reason}")
    check(key, source, started[key].result())


@pytest.mark.parametrize("key", list(GENERATE_LINES), ids=list(GENERATE_LINES))
def test_generate_line_runs_as_pasted(key, started):
    command = GENERATE_LINES[key]
    reason = skip_reason(command, bash=True)
    if reason:
        pytest.skip(f"{key}: {reason}")
    proc = started[key].result()
    check(key, command, proc)
    assert proc.stdout.strip(), f"{key}: `{command}` printed nothing"


def test_a_failing_snippet_fails(tmp_path):
    """The runner sees a snippet that raises (a README block that breaks cannot pass)."""
    proc = run_python("from tidyrun import LLM\nLLM('model_folder')\n", str(tmp_path), timeout=60)
    assert proc.returncode != 0 and "ModelLoadError" in proc.stderr
    with pytest.raises(AssertionError, match="README.md:0: the snippet exited"):
        check("README.md:0", "LLM('model_folder')", proc)
