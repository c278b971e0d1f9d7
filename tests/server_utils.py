"""Helpers for tests that run a real `tidyrun serve` process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`tidyrun serve` in a child process; ``stop()`` sends SIGTERM and returns (exit code, stderr)."""

    def __init__(self, *args: str, timeout: float = 180.0, log_to_file: bool = False) -> None:
        """``log_to_file``: the server's output goes to a temporary file instead of pipes (a pipe nobody reads
        fills after ~64 KB of access-log lines, and the server then blocks on its next log write)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = tempfile.TemporaryFile(mode="w+") if log_to_file else None
        out = dict(stdout=self.log, stderr=subprocess.STDOUT) if log_to_file else dict(stdout=subprocess.PIPE,
                                                                                      stderr=subprocess.PIPE)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidyrun.cli", "serve", "--device", "cpu", "--port", str(self.port), *args],
            text=True, env=env, **out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self._output()[1]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError("server did not become healthy in time")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["tidyrun_requests_running"], m["tidyrun_requests_waiting"], m["tidyrun_kv_cache_usage_ratio"])
            if idle == (0, 0, 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self._output(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self._output()
            raise
        return self.proc.returncode, err

    def _output(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the process has ended (with a log file: its whole content as stderr)."""
        if self.log is None:
            return self.proc.communicate(timeout=timeout)
        self.proc.wait(timeout)
        self.log.seek(0)
        return "", self.log.read()


def smol_server(*extra: str):
    """A server on the default model (max_model_len 512, served as "smol", ``extra`` options added) for one test
    module: it must stop cleanly, without a traceback, and its shutdown must prove nothing survived."""
    srv = ServerProcess("--max-model-len", "512", "--served-model-name", "smol", *extra)
    yield srv
    code, err = srv.stop()
    assert code == 0, err
    assert "Traceback" not in err
    assert "nothing survived" in err


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
