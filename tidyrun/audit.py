"""Find tensors: those reachable from an object, and those that outlived a snapshot, with who holds them.

Works on any Python object graph (a tidyrun engine, a transformers model, a
user's trainer), so the same tool that verifies tidyrun's shutdown can audit
another engine's.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .resources import tensor_nbytes

_MAX_DEPTH = 24


@dataclass(frozen=True)
class FoundTensor:
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int  # the tensor's own elements
    storage_nbytes: int  # the whole storage it views (shared by views of one buffer)
    storage_ptr: int


def unique_storage_bytes(tensors) -> int:
    """Bytes held by a list of FoundTensor/Survivor, counting each shared storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.storage_ptr or id(t)] = t.storage_nbytes
    return sum(seen.values())


def _children(obj) -> Iterable[tuple[str, object]]:
    """(label, child) edges of ``obj`` as a user would write them in code."""
    if isinstance(obj, torch.nn.Module):
        for name, p in obj._parameters.items():
            if p is not None:
                yield f".{name}", p
        for name, b in obj._buffers.items():
            if b is not None:
                yield f".{name}", b
        for name, m in obj._modules.items():
            if m is not None:
                yield (f"[{name}]" if name.isdigit() else f".{name}"), m
        skip = {"_parameters", "_buffers", "_modules"}
        for name, v in vars(obj).items():
            if name not in skip:
                yield f".{name}", v
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
        return
    if isinstance(obj, (list, tuple, deque)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
        return
    if isinstance(obj, (set, frozenset)):
        for v in obj:
            yield "{...}", v
        return
    if isinstance(obj, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)):
        return  # do not wander into code and global state
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for name, v in d.items():
            yield f".{name}", v
    for name in getattr(type(obj), "__slots__", ()):
        if isinstance(name, str) and hasattr(obj, name):
            yield f".{name}", getattr(obj, name)


def find_device_tensors(obj, device: str | None = None, root_name: str | None = None) -> list[FoundTensor]:
    """Every tensor reachable from ``obj`` (on ``device``'s type if given), each once, with a path.

    Views of one buffer are listed each; ``unique_storage_bytes`` sums the
    memory they hold. ``device=None`` lists tensors on any device, so the
    same audit runs on CPU.
    """
    root = root_name or type(obj).__name__
    seen: set[int] = {id(obj)}
    found: list[FoundTensor] = []
    queue = deque([(obj, root, 0)])
    while queue:
        node, path, depth = queue.popleft()
        if isinstance(node, torch.Tensor):
            if device is None or node.device.type == torch.device(device).type:
                own = 0 if node.is_meta else node.numel() * node.element_size()
                ptr = 0 if node.is_meta else node.untyped_storage().data_ptr()
                found.append(FoundTensor(path, tuple(node.shape), node.dtype, str(node.device), own,
                                         tensor_nbytes(node), ptr))
            continue
        if depth >= _MAX_DEPTH:
            continue
        for label, child in _children(node):
            if child is None or isinstance(child, (str, bytes, int, float, bool)) or id(child) in seen:
                continue
            seen.add(id(child))
            queue.append((child, path + label, depth + 1))
    return found


# -- survivors -------------------------------------------------------------------------

def live_tensors() -> list[torch.Tensor]:
    """All tensors the garbage collector knows about (parameters included)."""
    out = []
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor):
                    out.append(o)
            except ReferenceError:
                continue
    return out


@dataclass
class Snapshot:
    """Ids (and weak references, so ids are not confused after reuse) of tensors alive at one moment."""

    refs: dict[int, weakref.ref]


def snapshot() -> Snapshot:
    gc.collect()
    return Snapshot({id(t): weakref.ref(t) for t in live_tensors()})


@dataclass(frozen=True)
class Survivor:
    description: str
    nbytes: int  # bytes of the storage it keeps alive
    chain: str
    storage_ptr: int = 0

    @property
    def storage_nbytes(self) -> int:
        return self.nbytes


def _edge_label(holder, target) -> str | None:
    """How ``holder`` refers to ``target``, or None if it does not in a way we can name."""
    if isinstance(holder, dict):
        for k, v in holder.items():
            if v is target:
                return f"[{k!r}]"
        return None
    if isinstance(holder, (list, tuple, deque)):
        for i, v in enumerate(holder):
            if v is target:
                return f"[{i}]"
        return None
    if isinstance(holder, types.FrameType):
        for name, v in holder.f_locals.items():
            if v is target:
                return f"<local {name!r} of {holder.f_code.co_name}()>"
        return None
    for label, child in _children(holder):
        if child is target:
            return label
    return None


def _describe(obj) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name}() at {obj.f_code.co_filename}:{obj.f_lineno}"
    if isinstance(obj, dict) and "__name__" in obj and obj.get("__name__") in sys.modules \
            and vars(sys.modules[obj["__name__"]]) is obj:
        return f"module {obj['__name__']}"
    return type(obj).__name__


def _is_internal_dict(holder, d) -> bool:
    """True if ``d`` is ``holder``'s own __dict__ or one of nn.Module's registries."""
    if not isinstance(d, dict) or isinstance(holder, (dict, list, tuple, types.FrameType)):
        return False
    if d is getattr(holder, "__dict__", None):
        return True
    return isinstance(holder, torch.nn.Module) and any(d is r for r in (holder._parameters, holder._buffers, holder._modules))


def _frame_locals() -> dict[int, str]:
    """id(value) -> "<local 'name' of func()>" for every local of every live frame outside this module.

    Since Python 3.11 running frames are not objects the garbage collector
    lists as referrers, so locals are looked up here directly.
    """
    out: dict[int, str] = {}
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_filename != __file__:
                for name, value in frame.f_locals.items():
                    out.setdefault(id(value), f"frame {frame.f_code.co_name}() local {name!r}")
            frame = frame.f_back
    return out


def _is_module_dict(obj) -> bool:
    return isinstance(obj, dict) and _describe(obj).startswith("module ")


def referrer_chain(target, max_depth: int = 64) -> str:
    """Shortest chain of referrers from a root (a frame's local, a module global, or an
    object nothing else refers to) to ``target``.

    Rendered forward, e.g. ``frame test() local 'held' -> [0].model.layers[3].mlp.up_proj.weight``.
    Instance ``__dict__``s and nn.Module's registries are folded into
    attribute access so the chain reads like code.
    """
    gc.collect()
    frame_locals = _frame_locals()
    nodes = [target]  # visited objects, kept alive during the search; the queue holds indices into it
    parent = {id(target): -1}  # id -> index of the node it refers to (one step closer to target)
    queue = deque([(0, 0)])
    internal = {id(nodes), id(parent), id(queue), id(frame_locals)}
    root_index, root_name = None, None
    while queue:
        index, depth = queue.popleft()
        node = nodes[index]
        if id(node) in frame_locals and index != 0:
            root_index, root_name = index, frame_locals[id(node)]
            break
        if _is_module_dict(node) or depth >= max_depth:
            root_index = index
            break
        referrers = gc.get_referrers(node)
        internal.add(id(referrers))
        holders = [r for r in referrers if id(r) not in internal and not isinstance(r, types.FrameType)]
        del referrers
        if not holders and index != 0:
            root_index = index
            break
        for r in holders:
            if id(r) not in parent:
                parent[id(r)] = index
                nodes.append(r)
                queue.append((len(nodes) - 1, depth + 1))
        del holders
    if root_index is None:
        return "<no referrer chain found>"
    path = []
    i = root_index
    while i != -1:
        path.append(nodes[i])
        i = parent[id(nodes[i])]
    parts = [root_name or _describe(path[0])]
    if root_name:
        parts.append(f" ({type(path[0]).__name__})")
    k = 0
    while k < len(path) - 1:
        holder, child = path[k], path[k + 1]
        j = k + 1
        while j < len(path) - 1 and _is_internal_dict(holder, path[j]):
            j += 1  # skip obj.__dict__ and Module._modules/_parameters/_buffers
        if j > k + 1:
            label = _edge_label(holder, path[j])
            if label is not None:
                parts.append(label)
                k = j
                continue
        label = _edge_label(holder, child)
        if label is not None and _is_module_dict(holder) and label.startswith("['"):
            label = "." + label[2:-2]  # a module global reads as module.name
        parts.append(label if label is not None else f" -> {type(child).__name__}")
        k += 1
    return parts[0] + " -> " + "".join(parts[1:]).strip()


def leaks_since(snap: Snapshot, device: str | None = None) -> list[Survivor]:
    """Tensors alive now that were not alive at ``snap``, with the chain that keeps each alive."""
    gc.collect()
    # Weak references only: a list of the tensors themselves would be the "holder" of every one.
    fresh = [weakref.ref(t) for t in live_tensors()
             if not (snap.refs.get(id(t)) is not None and snap.refs[id(t)]() is t)
             and (device is None or t.device.type == torch.device(device).type)]
    return [s for s in (survivor(ref) for ref in fresh) if s is not None]


def survivor(ref: weakref.ref, nbytes: int | None = None) -> Survivor | None:
    """Describe the tensor behind ``ref`` and who holds it, or None if it has died.

    ``nbytes``: for a tracked object that is not a tensor (CUDA graphs and
    their pool), the bytes the ledger measured when it was tracked.
    """
    t = ref()
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        desc = f"tensor{tuple(t.shape)} {t.dtype} on {t.device}"
        nbytes = tensor_nbytes(t)
        ptr = 0 if t.is_meta else t.untyped_storage().data_ptr()
    else:  # an object holding device memory on the tensors' behalf (CUDA graphs and their pool)
        desc, nbytes, ptr = type(t).__name__, nbytes or 0, id(t)
    del t
    target = ref()
    chain = referrer_chain(target) if target is not None else "<died>"
    return Survivor(desc, nbytes, chain, ptr)
