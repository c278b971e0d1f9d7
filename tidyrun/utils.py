"""``tidyrun.utils``: the helpers vLLM's users import from ``vllm.utils`` (its offline examples' parser; the
free port lm-eval's data-parallel workers meet on)."""

from __future__ import annotations

import socket

from .arg_utils import FlexibleArgumentParser


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it), as vLLM's ``get_open_port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


__all__ = ("FlexibleArgumentParser", "get_open_port")
