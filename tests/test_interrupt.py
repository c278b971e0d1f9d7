"""Ctrl-C, or any exception escaping the engine mid-step, leaves nothing alive and ends at once.

The exception's traceback keeps the frames of the interrupted call; theirs
held the model (a module's ``self``), so shutdown used to find every weight
alive and spend minutes tracing who held each.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
from conftest import write_tiny_checkpoint

import tidyrun
from tidyrun import LLM, SamplingParams

DONE_WITHIN_S = 2.0  # from Ctrl-C until the engine has shut down and the program says so
WAIT_S = 10.0  # how long a child that does not exit in time gets before it is killed and the test fails


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    """A tiny model with many layers and a long context: nearly all of a step's time is spent inside the
    forward, so that is where a Ctrl-C lands (the case that held the model), and generation lasts minutes."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("deep_llama")), hf_tokenizer_dir,
                                 num_hidden_layers=24, max_position_embeddings=4096)


def _start(args: list[str]) -> subprocess.Popen:
    """A Python child that imports this checkout's tidyrun, whatever is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(tidyrun.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "PYTHONFAULTHANDLER": "1"}  # a child that hangs is sent SIGABRT and prints where it was
    # SIGINT back to its default: a test run started in the background by a non-interactive shell ignores
    # SIGINT, the child would inherit that, and Python then installs no KeyboardInterrupt handler at all.
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_output(proc: subprocess.Popen, timeout_s: float = 120.0) -> bytes:
    """The first bytes the child writes to stdout (it has started generating)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    first = os.read(proc.stdout.fileno(), 4096) if ready else b""
    if not first:
        proc.kill()
        pytest.fail(f"the child printed nothing; stderr:\n{proc.communicate()[1].decode()}")
    return first


def _interrupt(proc: subprocess.Popen, stream: str, marker: bytes) -> tuple[float, str, str]:
    """Ctrl-C the child; returns (seconds until ``marker`` appeared on ``stream``, stdout, stderr).

    The marker is written once the engine has shut down; what the interpreter does after it (tearing
    down torch and transformers, ~1 s, more on a loaded machine) is not the engine's and is only
    bounded by WAIT_S.
    """
    time.sleep(0.3)  # well inside generation
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    pipes = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b""}
    watched = (proc.stdout if stream == "stdout" else proc.stderr).fileno()
    open_fds, seconds = set(pipes), None
    while open_fds and time.perf_counter() - start < WAIT_S:
        ready, _, _ = select.select(list(open_fds), [], [], 0.05)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # the child closed it (it is exiting)
                open_fds.discard(fd)
            pipes[fd] += chunk
            if seconds is None and fd == watched and marker in pipes[fd]:
                seconds = time.perf_counter() - start
    try:
        proc.wait(timeout=max(0.1, WAIT_S - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler dumps every thread's stack to stderr
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stderr.fileno()], [], [], 0.05)
            if ready:
                pipes[proc.stderr.fileno()] += os.read(proc.stderr.fileno(), 65536)
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {WAIT_S:.0f} s after Ctrl-C (marker after {seconds} s); stderr:\n"
                    f"{pipes[proc.stderr.fileno()].decode(errors='replace')[-6000:]}")
    out, err = pipes[proc.stdout.fileno()], pipes[proc.stderr.fileno()]
    if seconds is None:
        pytest.fail(f"{marker!r} never appeared; stdout:\n{out.decode()[-2000:]}\nstderr:\n{err.decode()[-3000:]}")
    return seconds, out.decode(), err.decode()


def test_ctrl_c_ends_tidyrun_generate_at_once(deep_llama_dir):
    proc = _start(["-m", "tidyrun.cli", "generate", "--model", deep_llama_dir, "--device", "cpu", "--raw",
                   "--max-tokens", "100000", "hello"])
    _wait_for_output(proc)  # the first streamed text
    seconds, _, err = _interrupt(proc, "stderr", b"tidyrun: interrupted")
    assert proc.returncode == 130, err
    assert err.strip() == "tidyrun: interrupted", err  # one line: no traceback, no survivor report
    assert seconds < DONE_WITHIN_S


SCRIPT = """
import sys
from tidyrun import LLM, SamplingParams

llm = None
try:
    with LLM(sys.argv[1], device="cpu") as llm:
        print("generating", flush=True)
        llm.generate(["hello", "world"], SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0),
                     use_tqdm=False)
except KeyboardInterrupt:
    print("shutdown:", llm.shutdown(), flush=True)  # the report of the shutdown __exit__ ran
"""


def test_ctrl_c_in_a_with_block_shuts_down_clean_at_once(deep_llama_dir):
    proc = _start(["-c", SCRIPT, deep_llama_dir])
    _wait_for_output(proc)
    seconds, out, err = _interrupt(proc, "stdout", b"nothing survived")
    assert proc.returncode == 0, err
    assert "shutdown: released" in out and out.rstrip().endswith("nothing survived"), out + err
    assert seconds < DONE_WITHIN_S


def test_step_failing_mid_forward_keeps_nothing_alive(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu")
    refs = [e.ref for e in llm.runner.ledger.entries()]

    def device_fell_over(x):  # layer 0 and layer 1's attention have run
        raise RuntimeError("the device fell over in layer 1")

    llm.runner.model.model.layers[1].mlp.forward = device_fell_over
    llm.add_request("hello", SamplingParams(max_tokens=4))
    try:
        llm.step()
    except RuntimeError as exc:
        error = exc  # handled and kept, as a caller that reports it later does
    report = llm.shutdown()
    assert report.clean, str(report)
    assert all(r() is None for r in refs)
    assert "fell over" in str(error)
