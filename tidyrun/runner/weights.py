"""WeightArena: every parameter of a model as a view into one flat device buffer.

One buffer makes sleep and wake one large copy each (instead of one per
tensor), and makes releasing the weights one free. Parameter objects keep
their identity across sleep cycles; only their storage comes and goes.
"""

from __future__ import annotations

import math
import time
import weakref

import torch
from torch import nn

from ..resources import ResourceLedger

# Start every parameter on a 256-byte boundary, which GEMM kernels like.
_ALIGN_BYTES = 256


class WeightArena:
    """Places a (meta-device) model's parameters in one device buffer.

    Owns device memory: the flat buffer, registered with the ledger as
    ``weights`` (together with every parameter view) each time it is
    materialized. Owns host memory while offloaded: the pinned copy, ledger
    owner ``host_weights``.
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, ledger: ResourceLedger,
                 keep_host_buffer: bool = True) -> None:
        self.device, self.dtype, self._ledger = device, dtype, ledger
        self.keep_host_buffer = keep_host_buffer
        align = _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
        # Modules by weak reference: the model owns them, the arena only knows where their parameters go.
        self._slots: list[tuple[str, weakref.ref, str, tuple[int, ...], int]] = []
        offset = 0
        for mod_name, module in model.named_modules():
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                self._slots.append((f"{mod_name}.{attr}" if mod_name else attr, weakref.ref(module), attr,
                                    tuple(p.shape), offset))
                offset += -(-math.prod(p.shape) // align) * align
        self.numel = offset
        self.flat: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.last_copy_s = 0.0  # duration of the last host<->device copy alone (for bandwidth reports)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def materialize(self) -> None:
        """Allocate the buffer and point every parameter at its slice (contents undefined)."""
        flat = self._ledger.track("weights", "weights.arena",
                                  torch.empty(self.numel, dtype=self.dtype, device=self.device))
        for name, module_ref, attr, shape, offset in self._slots:
            module = module_ref()
            view = flat[offset:offset + math.prod(shape)].view(shape)
            p = module._parameters[attr]
            if p.is_meta:  # first placement: meta tensors cannot take device data, so swap the Parameter
                p = module._parameters[attr] = nn.Parameter(view, requires_grad=False)
                self._ledger.track("weights", name, p)
            else:
                p.data = view
        self.flat = flat

    def release(self) -> None:
        """Free the buffer; parameters become empty tensors on the same device."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for _, module_ref, attr, _, _ in self._slots:
            module_ref()._parameters[attr].data = empty
        self.flat = None

    def offload(self) -> None:
        """Copy the weights to (pinned) host memory in one non-blocking copy, then release the device buffer.

        The host buffer is allocated on first use and reused by later sleeps.
        """
        if self.host is None:
            pin = self.device.type == "cuda"
            self.host = self._ledger.track("host_weights", "weights.host",
                                           torch.empty(self.numel, dtype=self.dtype, pin_memory=pin))
        start = time.perf_counter()
        self.host.copy_(self.flat, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_copy_s = time.perf_counter() - start
        self.release()

    def restore(self) -> None:
        """Materialize and fill from the host copy in one non-blocking copy and a single synchronisation."""
        self.materialize()
        start = time.perf_counter()
        self.flat.copy_(self.host, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_copy_s = time.perf_counter() - start
        if not self.keep_host_buffer:
            self.host = None
