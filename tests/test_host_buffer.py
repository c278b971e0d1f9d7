"""PinnedHostBuffer on the CPU: the huge-page mapping (unregistered, or with a stand-in cudart) and plain memory."""

from __future__ import annotations

import gc
import mmap
import sys
import weakref

import pytest
import torch

from tidyrun.runner import host_buffer
from tidyrun.runner.host_buffer import HUGE_PAGE, PinnedHostBuffer

needs_mmap = pytest.mark.skipif(not hasattr(mmap, "MAP_ANONYMOUS"), reason="needs anonymous mmap (POSIX)")


def mapping_of(buf: PinnedHostBuffer) -> mmap.mmap:
    """The mmap behind a huge-page buffer (held by its finalizer)."""
    return buf._finalizer.peek()[2][0]


class FakeCudart:
    """Stands in for torch.cuda.cudart(): records register/unregister and whether the mapping was still open."""

    class cudaError:  # noqa: N801 - mirrors the binding's name
        success = 0

    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.calls: list[tuple] = []
        self.mapping: mmap.mmap | None = None

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802
        self.calls.append(("register", ptr, nbytes, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr, None if self.mapping is None else self.mapping.closed))
        return 0

    def cudaGetErrorString(self, err):  # noqa: N802
        return "fake error"


@pytest.fixture
def fake_cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@needs_mmap
@pytest.mark.parametrize("dtype, numel", [(torch.bfloat16, 3 * HUGE_PAGE // 2 + 7), (torch.float32, 1000),
                                          (torch.uint8, HUGE_PAGE)])
def test_hugepage_mapping_shape_alignment_and_round_trip(dtype, numel):
    buf = PinnedHostBuffer(numel, dtype, pin=True, register=False)
    assert buf.kind == "hugepage-unregistered" and buf.fallback_reason is None
    t = buf.tensor
    assert t.dtype == dtype and t.shape == (numel,) and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == buf.nbytes == numel * t.element_size()  # the ledger counts exactly this
    assert len(mapping_of(buf)) >= -(-buf.nbytes // HUGE_PAGE) * HUGE_PAGE
    src = torch.arange(numel, dtype=torch.float32).remainder(251).to(dtype)
    t.copy_(src)
    assert torch.equal(buf.tensor, src)
    t[-1] = 5
    assert buf.tensor[-1].item() == 5
    del t
    assert buf.close() is True


@needs_mmap
def test_close_unmaps_and_the_tensor_dies():
    buf = PinnedHostBuffer(10_000, torch.float16, pin=True, register=False)
    mm, ref = mapping_of(buf), weakref.ref(buf.tensor)
    assert not mm.closed and not buf.freed
    assert buf.close() is True
    assert mm.closed and ref() is None and buf.freed and buf.closed
    with pytest.raises(RuntimeError, match="closed"):
        buf.tensor
    assert buf.close() is True  # idempotent
    assert "freed" in repr(buf)


@needs_mmap
@pytest.mark.parametrize("leak", ["slice", "storage"])
def test_close_with_a_leaked_view_returns_false_and_keeps_the_memory(leak):
    buf = PinnedHostBuffer(4096, torch.float32, pin=True, register=False)
    buf.tensor.fill_(3.0)
    mm = mapping_of(buf)
    if leak == "slice":
        held = buf.tensor[100:200]
    else:  # shares only the storage, not the tensor
        held = torch.empty(0, dtype=torch.float32).set_(buf.tensor.untyped_storage())
    assert buf.close() is False
    assert buf.close() is False  # idempotent, still leaking
    assert not mm.closed and not buf.freed
    assert torch.all(held == 3.0)  # still mapped: reading it is safe
    held.add_(1)
    del held
    gc.collect()
    assert mm.closed and buf.freed
    assert buf.close() is True


@needs_mmap
def test_unclosed_buffer_is_released_by_garbage_collection_and_a_tensor_may_outlive_it():
    buf = PinnedHostBuffer(1000, torch.int32, pin=True, register=False)
    mm = mapping_of(buf)
    del buf
    gc.collect()
    assert mm.closed

    buf = PinnedHostBuffer(1000, torch.int32, pin=True, register=False)
    mm, t = mapping_of(buf), buf.tensor
    t.copy_(torch.arange(1000, dtype=torch.int32))
    del buf
    gc.collect()
    assert not mm.closed and int(t.sum()) == sum(range(1000))
    del t
    gc.collect()
    assert mm.closed


@needs_mmap
def test_registered_path_unregisters_before_unmapping(fake_cudart):
    buf = PinnedHostBuffer(HUGE_PAGE + 1, torch.uint8, pin=True)
    assert buf.kind == "hugepage-registered"
    mm = fake_cudart.mapping = mapping_of(buf)
    (op, ptr, nbytes, flags), = fake_cudart.calls
    assert (op, ptr, nbytes, flags) == ("register", buf.tensor.data_ptr(), 2 * HUGE_PAGE, 0)
    held = buf.tensor[:10]
    assert buf.close() is False
    assert len(fake_cudart.calls) == 1  # a live view: neither unregistered nor unmapped
    del held
    gc.collect()
    assert fake_cudart.calls[1] == ("unregister", ptr, False)  # unregistered while the mapping was still open
    assert mm.closed and buf.close() is True and len(fake_cudart.calls) == 2


@needs_mmap
def test_registration_failure_falls_back_to_torch_pinned_and_unmaps(monkeypatch, fake_cudart):
    fake_cudart.register_error = 3
    unmapped = []
    release = host_buffer._release_mapping
    monkeypatch.setattr(host_buffer, "_release_mapping", lambda mm, reg: (release(mm, reg), unmapped.append(mm.closed)))
    monkeypatch.setattr(host_buffer, "_torch_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    buf = PinnedHostBuffer(5000, torch.bfloat16, pin=True)
    assert buf.kind == "torch-pinned"
    assert "cudaHostRegister" in buf.fallback_reason and "fake error" in buf.fallback_reason
    assert [c[0] for c in fake_cudart.calls] == ["register"]  # never registered, so never unregistered
    assert unmapped == [True]
    assert buf.tensor.shape == (5000,) and buf.tensor.dtype == torch.bfloat16
    ref = weakref.ref(buf.tensor)
    assert buf.close() is True and ref() is None


def test_no_cuda_pin_false_is_a_plain_tensor():
    buf = PinnedHostBuffer(123, torch.float32, pin=False)
    assert buf.kind == "pageable" and buf._finalizer is None
    t = buf.tensor
    assert t.shape == (123,) and t.dtype == torch.float32 and not t.is_pinned()
    t.fill_(2.0)
    assert float(buf.tensor.sum()) == 246.0
    ref = weakref.ref(t)
    del t
    assert buf.close() is True and ref() is None and buf.close() is True


def test_pageable_leak_is_reported():
    buf = PinnedHostBuffer(16, torch.float32, pin=False)
    held = buf.tensor
    assert buf.close() is False and buf.close() is False
    del held
    assert buf.close() is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@needs_mmap
def test_pin_without_cuda_falls_back_then_fails_like_torch():
    # No CUDA: registration fails (recorded), and the fallback is torch's pinned allocator, which needs CUDA too.
    with pytest.raises((RuntimeError, AssertionError)):
        PinnedHostBuffer(100, torch.float32, pin=True)


def test_zero_elements():
    buf = PinnedHostBuffer(0, torch.float32, pin=True)
    assert buf.kind == "pageable"
    assert buf.tensor.numel() == 0
    assert buf.close() is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE is Linux-only")
def test_madvise_failure_is_ignored(monkeypatch):
    # A kernel without THP rejects MADV_HUGEPAGE; the buffer is still made (with base pages).
    monkeypatch.setattr(host_buffer, "_MADV_HUGEPAGE", -1)
    buf = PinnedHostBuffer(1000, torch.float32, pin=True, register=False)
    buf.tensor.fill_(1.0)
    assert buf.kind == "hugepage-unregistered" and float(buf.tensor.sum()) == 1000.0
    assert buf.close() is True


@needs_mmap
def test_failed_unregister_warns_and_still_unmaps(fake_cudart, monkeypatch):
    monkeypatch.setattr(fake_cudart, "cudaHostUnregister", lambda ptr: 1)
    buf = PinnedHostBuffer(100, torch.float32, pin=True)
    mm = mapping_of(buf)
    with pytest.warns(ResourceWarning, match="cudaHostUnregister"):
        assert buf.close() is True
    assert mm.closed
