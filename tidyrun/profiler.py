"""``LLM.start_profile`` / ``stop_profile``: a trace of what the engine runs between the two calls.

vLLM takes ``LLM(profiler_config={"profiler": "torch", "torch_profiler_dir": DIR, ...})`` (its older releases:
the ``VLLM_TORCH_PROFILER_DIR`` environment variable, which ported scripts still set) and refuses
``start_profile()`` without one; tidyrun takes the same keys and the same variable. "torch" records a
``torch.profiler`` trace of this process (host ops and, on CUDA, kernels and copies) and writes it at
``stop_profile()`` as ``<prefix>.<pid>.<ns>.pt.trace.json[.gz]``, which Perfetto, chrome://tracing and
TensorBoard read; "cuda" only brackets the span with cudaProfilerStart/Stop, for Nsight Systems'
``--capture-range=cudaProfilerApi``. With tensor parallelism only the driver's process is traced.
"""

from __future__ import annotations

import os
import time
from dataclasses import fields

import torch

from .config import ProfilerConfig
from .errors import InvalidRequestError


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "")


def profiler_config(value) -> ProfilerConfig:
    """``LLM(profiler_config=)``: None (then ``VLLM_TORCH_PROFILER_DIR`` and its ``..._RECORD_SHAPES``,
    ``..._WITH_PROFILE_MEMORY``, ``..._WITH_STACK``, ``..._WITH_FLOPS``, ``..._USE_GZIP`` flags, if set), a dict of
    ProfilerConfig's keys, or an object with those attributes (vLLM's own ProfilerConfig)."""
    if value is None:
        folder = os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not folder:
            return ProfilerConfig()
        return ProfilerConfig("torch", folder, _env_flag("VLLM_TORCH_PROFILER_RECORD_SHAPES", False),
                              _env_flag("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", False),
                              _env_flag("VLLM_TORCH_PROFILER_WITH_STACK", True),
                              _env_flag("VLLM_TORCH_PROFILER_WITH_FLOPS", False),
                              _env_flag("VLLM_TORCH_PROFILER_USE_GZIP", True))
    if isinstance(value, ProfilerConfig):
        return value
    names = [f.name for f in fields(ProfilerConfig)]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise InvalidRequestError(f"profiler_config: unknown key(s) {unknown}; tidyrun takes {names}")
        return ProfilerConfig(**value)
    if all(hasattr(value, n) for n in ("profiler", "torch_profiler_dir")):
        return ProfilerConfig(**{n: getattr(value, n) for n in names if hasattr(value, n)})
    raise InvalidRequestError(f"profiler_config must be a dict (or a ProfilerConfig), got {type(value).__name__}")


class Profile:
    """One ``start_profile()`` .. ``stop_profile()`` span. Owns no device memory: torch's profiler keeps its
    events in host memory until ``stop`` writes them out."""

    def __init__(self, config: ProfilerConfig, device: torch.device, prefix: str | None) -> None:
        if config.profiler is None:
            raise InvalidRequestError(
                "start_profile(): profiling is off; pass LLM(profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': FOLDER}) or set VLLM_TORCH_PROFILER_DIR before building the engine")
        if config.profiler == "cuda" and device.type != "cuda":
            raise InvalidRequestError(f"start_profile(): profiler 'cuda' needs a CUDA device; this engine runs on "
                                      f"{device}; use profiler 'torch'")
        if prefix is not None and (not isinstance(prefix, str) or not prefix or os.sep in prefix
                                   or (os.altsep and os.altsep in prefix) or prefix in (".", "..")):
            raise InvalidRequestError(f"start_profile(profile_prefix={prefix!r}): a file name's start, without "
                                      "path separators (the trace goes to torch_profiler_dir)")
        self.config, self.device, self.prefix = config, device, prefix or "tidyrun"
        self._torch = None
        if config.profiler == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.profiler.start()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(config.torch_profiler_dir, exist_ok=True)  # an unwritable folder fails now, not at stop
        self._torch = torch.profiler.profile(
            activities=activities, record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory, with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops)
        self._torch.start()

    def stop(self) -> str | None:
        """End the span; the trace's path ("torch"), or None ("cuda": Nsight Systems writes its own)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the span's kernels end inside it
        if self._torch is None:
            torch.cuda.profiler.stop()
            return None
        prof, self._torch = self._torch, None
        prof.stop()
        suffix = ".pt.trace.json.gz" if self.config.torch_profiler_use_gzip else ".pt.trace.json"
        path = os.path.join(self.config.torch_profiler_dir, f"{self.prefix}.{os.getpid()}.{time.time_ns()}{suffix}")
        prof.export_chrome_trace(path)
        return path
