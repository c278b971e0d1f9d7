"""PinnedHostBuffer: one page-locked host buffer, backed by 2 MiB pages, for host<->device copies.

Why it exists: on the H200 VM the wake copy (host to device) of the weights
ran at 27 GB/s inside the engine although a fresh ``torch.empty(...,
pin_memory=True)`` buffer reached 55 GB/s in isolation; the sleep copy
(device to host) was unaffected. The likely cause: in a long-running process
(checkpoint loading having filled the page cache) a pinned buffer's 4 KiB
pages are scattered in guest-physical memory, and the GPU's DMA reads miss
the IOMMU's translation cache; DMA writes are posted and do not wait on it.
A buffer backed by 2 MiB transparent huge pages needs 512 times fewer
translations. Measured there (THP in ``madvise`` mode): an anonymous mmap,
``madvise(MADV_HUGEPAGE)``, every page touched, then ``cudaHostRegister``
gives 55 GB/s both ways, and AnonHugePages grows by the buffer's size.

Owns host memory: the mapping (and its page-locking) lives until ``close()``,
or until the last tensor viewing it is garbage-collected.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import warnings
import weakref

import torch

HUGE_PAGE = 2 << 20  # 2 MiB, the x86-64 / arm64 (4 KiB base page) PMD size
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page in, writable, in one call
_CUDA_HOST_REGISTER_DEFAULT = 0


class PinnedHostBuffer:
    """A 1-D host tensor of ``numel`` elements of ``dtype`` for host<->device copies.

    ``pin=True`` (CUDA present) tries, in order:

    - ``"hugepage-registered"``: an anonymous private mmap rounded up to 2 MiB
      and 2 MiB-aligned, ``madvise(MADV_HUGEPAGE)`` (failure ignored: the
      buffer then simply has base pages), every page faulted in, then
      ``cudaHostRegister``;
    - ``"torch-pinned"``: ``torch.empty(..., pin_memory=True)``, when any step
      above fails (``fallback_reason`` says which and why).

    ``pin=False`` gives ``"pageable"``: a plain ``torch.empty`` tensor.
    ``register=False`` with ``pin=True`` builds the huge-page mapping without
    page-locking it (``"hugepage-unregistered"``); it needs no GPU, which is
    how the mapping path is tested on the CPU.

    Creating a huge-page buffer costs time proportional to its size (every
    page is faulted in, with MADV_POPULATE_WRITE or else ``zero_()``, before
    registration): for 2.5 GB on a 2-core CPU VM, 0.45-0.5 s when the memory
    had been used before, 3-10 s the first time in a fresh process (the
    hypervisor backing guest memory). Make it once and reuse it.

    Lifetime. ``close()`` drops the buffer's own tensor; the memory is freed
    (unregistered, then unmapped) as soon as no tensor or storage views it,
    and ``close()`` says whether that happened. The tensor's storage holds a
    reference to a ``memoryview`` of the mapping, and the release is a
    ``weakref.finalize`` on that memoryview which holds the mmap itself: it
    runs only once the last storage viewing the memory is gone, and it
    unregisters before it unmaps. (``mmap.close()`` cannot serve as the leak
    check: ``torch.frombuffer`` keeps a reference to the object it was given,
    not a buffer export, so ``close()`` would unmap under a live tensor.)
    So a tensor may safely outlive the
    ``PinnedHostBuffer`` (a leak keeps the memory mapped and registered, never
    dangling), and an unclosed buffer is released the same way when it is
    garbage-collected. Nothing is released at interpreter exit (the process's
    end frees it). The caller must synchronize any copy still in flight before
    the last reference goes (nothing here records CUDA events).
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, *, device: torch.device | str | None = None,
                 register: bool = True) -> None:
        self.numel, self.dtype = int(numel), dtype
        self.nbytes = self.numel * torch.empty((), dtype=dtype).element_size()
        self.kind = "pageable"
        self.fallback_reason: str | None = None
        self._tensor: torch.Tensor | None = None
        self._tensor_ref: weakref.ref | None = None
        self._finalizer: weakref.finalize | None = None  # set for the mmap kinds
        if pin and self.numel > 0:
            try:
                self._map(register, device)
            except Exception as exc:  # noqa: BLE001 - any failure falls back to torch's pinned allocator
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                if not register:
                    raise
        if self._tensor is None and pin and self.numel > 0:
            self._tensor, self.kind = _torch_pinned(self.numel, dtype), "torch-pinned"
        elif self._tensor is None:
            self._tensor = torch.empty(self.numel, dtype=dtype)
        self._tensor_ref = weakref.ref(self._tensor)

    def _map(self, register: bool, device: torch.device | str | None) -> None:
        size = -(-self.nbytes // HUGE_PAGE) * HUGE_PAGE
        # One huge page more than needed, to start the buffer on a 2 MiB boundary whatever address
        # the kernel picks; the slack is never touched, so it costs address space only.
        mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mm)
        registered: list[int] = []  # the registered address, once registered (read by the finalizer)
        finalizer = weakref.finalize(view, _release_mapping, mm, registered)
        finalizer.atexit = False
        try:
            base = torch.frombuffer(view, dtype=torch.uint8, count=1).data_ptr()
            offset = (-base) % HUGE_PAGE
            with contextlib.suppress(OSError, ValueError, AttributeError):  # no THP (or not Linux): base pages
                mm.madvise(_MADV_HUGEPAGE, offset, size)
            try:
                mm.madvise(_MADV_POPULATE_WRITE, offset, size)
            except (OSError, ValueError, AttributeError):  # kernel < 5.14: touch every page ourselves
                torch.frombuffer(view, dtype=torch.uint8, count=size, offset=offset).zero_()
            tensor = torch.frombuffer(view, dtype=self.dtype, count=self.numel, offset=offset)
            if register:
                _cuda_host_register(base + offset, size, device)
                registered.append(base + offset)
        except BaseException:
            tensor = None
            view.release()
            finalizer()  # unregisters (if it got that far) and unmaps now
            raise
        self._tensor, self._finalizer = tensor, finalizer
        self.kind = "hugepage-registered" if register else "hugepage-unregistered"

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a 1-D tensor of ``numel`` elements of ``dtype``."""
        if self._tensor is None:
            raise RuntimeError(f"PinnedHostBuffer ({self.kind}) is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def freed(self) -> bool:
        """True once nothing views the memory any more (for the mmap kinds: unregistered and unmapped)."""
        if self._finalizer is not None:
            return not self._finalizer.alive
        return self._tensor_ref() is None

    def close(self) -> bool:
        """Drop this buffer's tensor; True if that freed the memory.

        False means a tensor viewing the buffer is still alive elsewhere (the
        ledger, which tracks the tensor weakly, will show it as a survivor):
        the memory then stays mapped and registered, and is released when that
        last view is garbage-collected. Idempotent; calling it again re-checks.
        """
        self._tensor = None
        return self.freed

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("closed, still referenced" if self.closed else "open")
        return f"PinnedHostBuffer({self.numel}, {self.dtype}, kind={self.kind!r}, {state})"


def _torch_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The fallback: a block of PyTorch's caching pinned-host allocator (4 KiB pages, wherever they fall)."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def _cuda_host_register(ptr: int, nbytes: int, device: torch.device | str | None) -> None:
    cudart = torch.cuda.cudart()
    device = torch.device(device) if device is not None else None
    # Registered in the context of the device the copies go to (the current device's otherwise).
    guard = torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
    with guard:
        err = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_DEFAULT)
    if err != cudart.cudaError.success:
        _clear_cuda_last_error()
        raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed: {_cuda_error_string(cudart, err)}")


def _release_mapping(mm: mmap.mmap, registered: list[int]) -> None:
    """Finalizer of a huge-page buffer: unregister, then unmap (in that order)."""
    if registered:
        ptr = registered.pop()
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostUnregister(ptr)
            ok = err == cudart.cudaError.success
        except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
            ok, err = False, exc
        if not ok:
            # Unregistering fails when the pages are no longer registered (the context was destroyed, the
            # runtime is unloading): the driver holds no pinning then, so unmapping below is still safe.
            _clear_cuda_last_error()
            warnings.warn(f"cudaHostUnregister of the host buffer failed: {err}", ResourceWarning, stacklevel=2)
    try:
        mm.close()
    except BufferError:  # something else exported the mapping: it is unmapped when that lets go (unregistered already)
        pass


def _cuda_error_string(cudart, err) -> str:
    try:
        return f"{int(err)} ({cudart.cudaGetErrorString(err)})"
    except Exception:  # noqa: BLE001
        return str(err)


def _clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's per-thread last error after a failed call.

    A failed runtime call is also recorded as the thread's "last error", and
    PyTorch's kernel-launch checks read it with cudaGetLastError: without this,
    a failed (and handled) cudaHostRegister would surface as an error from an
    unrelated kernel later. torch's ``_cudart`` module has no cudaGetLastError,
    so it is called through ctypes on the libcudart this process already loaded.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # noqa: BLE001 - best effort
        pass
