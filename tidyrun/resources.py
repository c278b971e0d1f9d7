"""ResourceLedger: who owns which device allocation.

Every tensor the runner allocates for its own use is recorded here with an
owner (``"weights"``, ``"kv_cache"``, ``"rope"``...), a human name and its byte
count. The ledger keeps only weak references, so it never keeps memory alive
itself; after a component is released, a reference that is still alive is a
leak, and the ledger can say which one.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sysconfig
import traceback
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import OutOfResourcesError


@dataclass(frozen=True)
class LedgerEntry:
    owner: str
    name: str
    device: str
    ref: weakref.ref
    fixed_nbytes: int | None = None  # for objects that are not tensors (a CUDA-graph pool): measured at creation

    @property
    def alive(self) -> bool:
        return self.ref() is not None

    @property
    def nbytes(self) -> int:
        """Bytes the tensor holds now (0 once dead, or while its storage is released for sleep)."""
        t = self.ref()
        if t is None:
            return 0
        return self.fixed_nbytes if self.fixed_nbytes is not None else tensor_nbytes(t)


def tensor_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t``, or None for meta and sparse tensors (they hold none of their own)."""
    if t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except RuntimeError:  # sparse tensors have no single storage
        return None


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (a view counts its whole storage)."""
    storage = tensor_storage(t)
    return 0 if storage is None else storage.nbytes()


class ResourceLedger:
    """Weak-reference registry of the device allocations one runner made.

    It records and proves; it releases nothing. Who releases what, and in
    which order, is the runner's lifecycle table (runner/lifecycle.py).
    """

    def __init__(self) -> None:
        self._entries: dict[str, list[LedgerEntry]] = {}

    def track(self, owner: str, name: str, tensor: torch.Tensor | object, nbytes: int | None = None,
              device: str | None = None):
        """Record ``tensor`` under ``owner``; returns it so allocation sites stay one line.

        Objects that are not tensors but hold device memory (a CUDA graph and
        its pool) are tracked the same way, with the bytes measured when they
        were made (``nbytes``) and their ``device``.
        """
        entries = self._entries.setdefault(owner, [])
        # Re-allocation after sleep replaces dead records; tracking an object again replaces its record.
        entries[:] = [e for e in entries if e.alive and e.ref() is not tensor]
        where = device if device is not None else str(tensor.device)
        entries.append(LedgerEntry(owner, name, where, weakref.ref(tensor), nbytes))
        return tensor

    def entries(self, owner: str | None = None) -> Iterator[LedgerEntry]:
        for o, entries in self._entries.items():
            if owner is None or o == owner:
                yield from entries

    def live_entries(self) -> list[LedgerEntry]:
        return [e for e in self.entries() if e.alive]

    def bytes_by_owner(self) -> dict[str, int]:
        """Live bytes per owner; storages shared between entries are counted once."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for e in self.entries():
            t = e.ref()
            if t is None or e.nbytes == 0:
                continue
            key = t.untyped_storage().data_ptr() if e.fixed_nbytes is None else ("object", id(t))
            if key in seen:
                continue
            seen.add(key)
            out[e.owner] = out.get(e.owner, 0) + e.nbytes
        return out

    def report(self) -> str:
        """A table of live resources by owner: entries, bytes, devices."""
        rows = []
        by_owner = self.bytes_by_owner()
        for owner in self._entries:
            live = [e for e in self._entries[owner] if e.alive]
            if live and by_owner.get(owner, 0):
                devices = ",".join(sorted({e.device for e in live}))
                rows.append((owner, len(live), by_owner.get(owner, 0), devices))
        if not rows:
            return "ResourceLedger: no live resources"
        lines = [f"{'owner':<20} {'tensors':>8} {'MiB':>10}  device", "-" * 50]
        for owner, n, nbytes, devices in rows:
            lines.append(f"{owner:<20} {n:>8} {nbytes / 2**20:>10.2f}  {devices}")
        lines.append(f"{'total':<20} {sum(r[1] for r in rows):>8} {sum(r[2] for r in rows) / 2**20:>10.2f}")
        return "\n".join(lines)


def drop_traceback_locals(exc: BaseException, user_frames: bool = True) -> None:
    """Clear the locals of finished frames in ``exc``'s traceback (and its causes).

    A half-built model referenced by a local of a frame that raised would stay
    alive for as long as the caller holds the exception; clearing those frames
    lets a failed start give its memory back at once.

    ``user_frames=False`` is for an exception that goes back to the user
    (Ctrl-C mid-generate, a step that failed mid-forward): it clears only the
    frames of the failed call into tidyrun, from the first tidyrun frame
    inward, tidyrun's own and those of the libraries it called (torch's
    ``Module.__call__`` holds its module as ``self``). The caller's frames,
    and user code that tidyrun called back, keep their locals for debugging.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if user_frames:
            traceback.clear_frames(exc.__traceback__)
        else:
            _clear_call_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _clear_call_frames(tb) -> None:
    """Clear the frames of ``tb`` from its first tidyrun frame inward, except those of user code."""
    package = os.path.join(os.path.dirname(os.path.realpath(__file__)), "")
    paths = sysconfig.get_paths()
    libraries = tuple(os.path.join(os.path.realpath(paths[k]), "")
                      for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    inside = False
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        path = os.path.realpath(filename)
        ours = path.startswith(package)
        inside = inside or ours
        # "<string>"-like names inside the call are generated code (dataclass methods), not a user's file.
        if inside and (ours or filename.startswith("<") or path.startswith(libraries)):
            try:
                tb.tb_frame.clear()
            except RuntimeError:  # still executing (the frame handling the exception)
                pass
        tb = tb.tb_next


def pinned_host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An exactly sized page-locked host tensor whose pages go back to the OS (``unpin_host_buffer``, then drop it).

    Why not ``torch.empty(..., pin_memory=True)``: torch's host allocator
    rounds up to a power of two (a 2.4 GiB weight copy took 4.0 GiB of RSS on
    the H200 machine) and keeps freed blocks cached until the process exits.
    Here the pages come from an anonymous mapping of their own (page-aligned,
    shared with no other allocation, unmapped when the tensor dies) and are
    registered with CUDA: the same ~55 GB/s both ways, measured.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about non-writable buffers; an mmap is writable
        t = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise OutOfResourcesError(f"cannot page-lock {nbytes / 2**20:.0f} MiB of host memory (cudaHostRegister: {err})")
    return t


def unpin_host_buffer(t: torch.Tensor) -> None:
    """Unregister a ``pinned_host_buffer`` (no copy from or to it may be in flight); its pages go when it dies."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream CUDA graphs are captured on: torch's process-wide ``torch.cuda.graph.default_capture_stream``.

    Why one stream for the process, and why its cuBLAS workspace is made here:
    cuBLAS keeps a 32 MiB workspace per (handle, stream) until the process
    exits. A workspace first made during a capture lands in that graph's
    private pool and pins it; one made per engine on a fresh stream stays
    behind after the engine. Freeing them all (``_cuda_clearCublasWorkspaces``)
    is process-wide and corrupts memory through other code's live graphs
    (measured on the H200: a user's graph then wrote 522,839 bytes into
    tensors allocated afterwards). So every capture uses torch's own capture
    stream, whose workspace is made once, outside any capture, and belongs to
    the process like cuBLAS's handles. If torch has none yet, one is made with
    cuStreamCreate: the first ``torch.cuda.Stream()`` of a process creates
    torch's stream pool, 70 MiB at the driver that torch never frees.
    """
    device = torch.device(device)
    if device.index is None:  # "cuda" means the current device; compare streams by index
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.graph.default_capture_stream
    if stream is None:
        stream = torch.cuda.graph.default_capture_stream = _new_stream(device)
    if stream.device != device:  # torch's capture stream lives on another GPU: this engine needs its own
        stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        warm_cublas(device)
    torch.cuda.current_stream(device).wait_stream(stream)
    return stream


def warm_cublas(device: torch.device) -> None:
    """Make the current stream's cuBLAS and cuBLASLt workspaces now (products with and without a bias, in
    every dtype the engine runs), so none is first made inside an engine or a capture."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a = torch.ones(16, 16, device=device, dtype=dtype)
        bias = torch.ones(16, device=device, dtype=dtype)
        a @ a
        torch.nn.functional.linear(a, a, bias)
        torch.nn.functional.linear(a[:1], a)
        del a, bias


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking stream of the driver's (0 MiB), or torch's pooled one if libcuda cannot be called."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return torch.cuda.Stream(device)
    with torch.cuda.device(device):
        torch.zeros(1, device=device)  # the primary context is current on this thread
        handle = ctypes.c_void_p()
        if libcuda.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(1)) != 0:  # 1: CU_STREAM_NON_BLOCKING
            return torch.cuda.Stream(device)
    return torch.cuda.ExternalStream(handle.value, device=device)


def free_device_caches(device: torch.device) -> None:
    """Return the caching allocator's unused blocks to the driver.

    cuBLAS workspaces are left alone on purpose: clearing them is process-wide
    and breaks other code's CUDA graphs (see ``capture_stream``).
    """
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
