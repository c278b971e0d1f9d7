"""Small host-to-device uploads that do not make the host wait for the device.

Without ``non_blocking=True`` torch follows a host-to-device copy with a stream
synchronize, so ``torch.tensor(rows, device="cuda")`` (and a plain
``x.to("cuda")``, and indexing a CUDA tensor with a Python list) in a step's
sampling waits for the forward pass launched just before it: the host cannot
book or prepare anything while that step runs, and the device idles while the
host then does it (async scheduling's whole gain). With ``non_blocking=True``
the driver stages a small pageable source and returns at once (H100: 0.09 ms
for a [64, 2] float32 copy queued behind ~50 ms of device work,
docs/BENCHMARKS.md), and the source may be dropped after the call. Mask-sized
uploads go through a pinned staging buffer instead (``StepInputs.send_mask``).
"""

from __future__ import annotations

import torch


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` (a list of numbers: indices, per-row settings) without
    waiting for the work queued on ``device``."""
    host = torch.tensor(data, dtype=dtype)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
