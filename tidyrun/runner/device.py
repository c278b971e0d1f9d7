"""Device and dtype resolution, and the few device calls that differ between backends."""

from __future__ import annotations

import torch

from ..config import DTYPES
from ..errors import InvalidRequestError


def resolve_device(name: str | None) -> torch.device:
    """The requested device, or the current accelerator if there is one, else the CPU."""
    if name is None:
        accel = getattr(torch, "accelerator", None)
        if accel is not None and accel.is_available():
            return torch.device(accel.current_accelerator().type, accel.current_device_index())
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"invalid device {name!r}: {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidRequestError(f"device {name!r} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise InvalidRequestError(f"device type {device.type!r} is not supported (use 'cpu' or 'cuda')")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bf16 on accelerators and fp32 on the CPU unless the user chose."""
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hopper_or_later(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (``kernels.pdl``) and tensor
    descriptors (``kernels.linear``'s many-row launch): compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
