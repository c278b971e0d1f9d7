"""WeightArena: every parameter of a model as a view into one flat device buffer.

One buffer makes sleep and wake one large copy each (instead of one per
tensor), and makes releasing the weights one free. Parameter objects keep
their identity across sleep cycles; only their storage comes and goes.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ..resources import ResourceLedger

# Start every parameter on a 256-byte boundary, which GEMM kernels like.
ARENA_ALIGN_BYTES = 256


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """Elements a parameter of ``numel`` elements takes in the arena, so the next starts on the boundary."""
    align = ARENA_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    return -(-numel // align) * align


class WeightArena:
    """Places a (meta-device) model's parameters in one device buffer.

    Owns device memory: the flat buffer, registered with the ledger as
    ``weights`` (together with every parameter view) each time it is
    materialized. The host copy a level-1 sleep keeps is another owner's
    (``components.HostWeights``).
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, ledger: ResourceLedger) -> None:
        self.device, self.dtype, self._ledger = device, dtype, ledger
        # Modules by weak reference: the model owns them, the arena only knows where their parameters go.
        self._slots: list[tuple[str, weakref.ref, str, tuple[int, ...], int]] = []
        offset = 0
        for mod_name, module in model.named_modules():
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                self._slots.append((f"{mod_name}.{attr}" if mod_name else attr, weakref.ref(module), attr,
                                    tuple(p.shape), offset))
                offset += aligned_numel(math.prod(p.shape), dtype)
        self.numel = offset
        self.flat: torch.Tensor | None = None

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
