"""Memory readings at three levels: live tensors, the caching allocator, the driver."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemorySample:
    """One reading. On CUDA: allocator-allocated, allocator-reserved and driver-used bytes
    (``total - free`` from ``cudaMemGetInfo``). On the CPU: bytes of live tensors and process RSS."""

    device: str
    allocated: int
    reserved: int
    driver_used: int

    def delta(self, base: MemorySample) -> MemorySample:
        return MemorySample(self.device, self.allocated - base.allocated, self.reserved - base.reserved,
                            self.driver_used - base.driver_used)

    def __str__(self) -> str:
        mib = 2**20
        if self.device.startswith("cuda"):
            return (f"allocated {self.allocated / mib:9.2f} MiB  reserved {self.reserved / mib:9.2f} MiB  "
                    f"driver used {self.driver_used / mib:9.2f} MiB")
        return f"live tensors {self.allocated / mib:9.2f} MiB  rss {self.driver_used / mib:9.2f} MiB"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def sample_memory(device: torch.device | str = "cpu", collect: bool = True) -> MemorySample:
    device = torch.device(device)
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return MemorySample(str(device), torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                            total - free)
    from .audit import live_tensors

    seen: set[int] = set()
    live = 0
    for t in live_tensors():
        if t.device.type == "cpu":
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                live += s.nbytes()
    return MemorySample(str(device), live, live, _rss_bytes())


def initialize_cuda(device: torch.device | str = "cuda") -> tuple[MemorySample, MemorySample]:
    """Create the CUDA context and the process's cuBLAS state; return readings after each.

    The first GEMM of a process creates cuBLAS/cuBLASLt handles and loads
    their kernels (about 86 MiB at the driver on an H200 with torch 2.11),
    and the graph capture stream gets its cuBLAS workspace
    (``resources.capture_stream``). torch keeps those until the process exits
    and offers no safe call to release them, so they belong to the process,
    not to any engine: leftover memory is judged against the second reading.
    Both are returned so the first can be reported too.
    """
    from .resources import capture_stream, free_device_caches, warm_cublas

    device = torch.device(device)
    torch.cuda.init()
    torch.zeros(1, device=device)
    gc.collect()
    torch.cuda.empty_cache()
    context = sample_memory(device)
    warm_cublas(device)
    capture_stream(device)
    free_device_caches(device)
    return context, sample_memory(device)
