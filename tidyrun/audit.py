"""Find tensors: those reachable from an object, and those that outlived a snapshot, with who holds them.

Works on any Python object graph (a tidyrun engine, a transformers model, a
user's trainer), so the same tool that verifies tidyrun's shutdown can audit
another engine's.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import sys
import time
import traceback
import types
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .resources import tensor_nbytes, tensor_storage

_MAX_DEPTH = 24
_MAX_CHAIN = 64  # referrer levels searched from a survivor before its chain is reported as partial
# No level of the survivor search starts after this many seconds: a level is one pass over the heap
# (60 ms with 400k objects) and the chain down to a weight of a model someone holds is 14 levels.
_TIME_LIMIT_S = 2.0
_SCAN_ABOVE = 256  # frontier size from which one scan of the heap beats gc.get_referrers (see _referrers)
_BLOCK = 64  # heap objects whose references one scan step tests together
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # f_locals of a function frame is a dict cached on the frame


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


def _own_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` itself views (a view of a large buffer counts only its part)."""
    return 0 if t.is_meta else min(t.numel() * t.element_size(), tensor_nbytes(t))


def _storage_ptr(t: torch.Tensor) -> int:
    """Address of the storage behind ``t``, which identifies it among views; 0 when it has none."""
    storage = tensor_storage(t)
    return 0 if storage is None else storage.data_ptr()


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
                found.append(FoundTensor(path, tuple(node.shape), node.dtype, str(node.device), _own_nbytes(node),
                                         tensor_nbytes(node), _storage_ptr(node)))
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
    """An object alive after it should have died, and the references that keep it alive.

    The root that holds it (``holder``, of type ``holder_type``) is kept apart
    from the way down to it (``path``) so survivors can be grouped by holder;
    the storage is identified so views of one buffer are counted once.
    """

    description: str
    nbytes: int  # its own elements (a view of a 538 MB buffer counts only its part); measured bytes for non-tensors
    storage_nbytes: int  # the whole storage it keeps alive, shared by the views of one buffer
    storage_ptr: int  # which storage (the object's id for non-tensors)
    holder: str  # "frame train() local 'held'", "module app global 'CACHE'", "object with no referrers"
    holder_type: str  # type of the object at the root, e.g. "dict"
    path: str  # from that object down to the survivor, e.g. "['model.norm.weight']"
    partial: bool = False  # the search stopped on its time or depth bound before reaching a root

    @property
    def held_by(self) -> str:
        return f"{self.holder} ({self.holder_type})"

    @property
    def chain(self) -> str:
        """The whole chain as one line: ``frame train() local 'held' -> (list)[0].model.norm.weight``."""
        return f"{self.holder} -> ({self.holder_type}){self.path}"


def trace_survivors(refs: Iterable[tuple[weakref.ref, int | None]], max_depth: int = _MAX_CHAIN,
                    time_limit: float = _TIME_LIMIT_S) -> list[Survivor]:
    """Describe the objects behind ``refs`` that are still alive, each with the chain of references that holds it.

    ``refs`` pairs a weak reference with the bytes measured when the object was
    tracked (for objects that are not tensors, e.g. a CUDA graph pool) or None,
    as a ResourceLedger's entries do. One backward search from all survivors
    together finds their roots (one pass over the heap per level, after one
    ``gc.collect()``); no level starts after ``time_limit`` seconds or past
    ``max_depth``, and chains cut short are marked ``partial``. Nothing the
    search touched keeps a survivor alive afterwards, even if it raises.
    """
    try:
        return _trace(list(refs), max_depth, time_limit)
    except BaseException as exc:
        # The search's frames, and the closures of their comprehensions, hold every survivor: the
        # exception leaves with where it happened written down, but without those frames.
        where = "".join(traceback.format_tb(exc.__traceback__))
        exc.add_note(f"raised in the survivor search (its frames, which held the survivors, are dropped):\n{where}")
        exc.__traceback__ = None
        raise


def _trace(refs: list[tuple[weakref.ref, int | None]], max_depth: int, time_limit: float) -> list[Survivor]:
    gc.collect()
    objs = [ref() for ref, _ in refs]
    alive = [k for k, obj in enumerate(objs) if obj is not None]
    search = _ReverseSearch([objs[k] for k in alive])
    del objs  # from here on only the search's own list holds them, and it never counts as a referrer
    search.run(_running_frame_labels(), max_depth, time_limit)
    return [search.describe(i, refs[k][1]) for i, k in enumerate(alive)]


class _ReverseSearch:
    """A breadth-first search from many objects at once back to what holds them.

    Objects met are kept in ``nodes`` (so their ids stay valid) and named by
    their index everywhere else. A node is *rooted* once a chain from a root
    to it is known: ``up[i]`` is the next node on that chain (-1 at a root,
    None while unknown). Roots are where a branch stops: a frame's local, a
    module global, an object nothing refers to.
    """

    def __init__(self, targets: list) -> None:
        self.n_targets = len(targets)
        self.nodes = targets  # targets first, then their referrers as found
        self.index = {id(o): i for i, o in enumerate(targets)}
        self.referents: list[list[int]] = [[] for _ in targets]  # i -> nodes found referred to by i
        self.up: list[int | None] = [None] * len(targets)
        self.roots: dict[int, tuple[str, bool]] = {}  # root node -> (holder, partial)
        self.edge_labels: dict[int, dict[int, str]] = {}  # id(holder) -> id(child) -> how it refers to the child

    def run(self, local_labels: dict[int, str], max_depth: int, time_limit: float) -> None:
        """Expand level by level until every target is rooted or a bound is hit."""
        for i in range(self.n_targets):
            if id(self.nodes[i]) in local_labels:
                self._root(i, local_labels[id(self.nodes[i])])
        frontier, depth, start = list(range(self.n_targets)), 0, time.perf_counter()
        while True:
            frontier = [i for i in frontier if self.up[i] is None]
            if not frontier or all(u is not None for u in self.up[:self.n_targets]):
                break
            elapsed = time.perf_counter() - start
            if depth >= max_depth or elapsed > time_limit:
                stop = f"at depth {depth}" if depth >= max_depth else f"after {elapsed:.2f} s"
                for i in frontier:  # chains end where the search stopped
                    self._root(i, f"unknown (search stopped {stop})", partial=True)
                break
            frontier = self._expand(frontier, local_labels)
            depth += 1
        for i in range(self.n_targets):  # only in cycles with no outside referrer, kept by C code
            if self.up[i] is None:
                self._root(i, "reference cycle with no other referrer")
        self._settle()

    def _expand(self, frontier: list[int], local_labels: dict[int, str]) -> list[int]:
        """One level: the referrers of all frontier nodes, from one pass over the heap; returns the new nodes."""
        objs = [self.nodes[i] for i in frontier]
        where = {id(o): i for o, i in zip(objs, frontier)}
        referred: set[int] = set()
        found: list[int] = []
        for r in _referrers(objs, {id(objs), id(self.nodes)}):
            hits = [where[id(x)] for x in gc.get_referents(r) if id(x) in where]
            referred.update(hits)
            if isinstance(r, types.FrameType):  # a finished frame (a traceback keeps it): its locals are roots
                labels: dict[int, str] = {}
                _local_labels(r, labels)
                for i in hits:
                    self._root(i, labels.get(id(self.nodes[i]), f"frame {r.f_code.co_name}()"))
            elif (module := _module_name(r)) is not None:
                for name, value in r.items():
                    if id(value) in where:
                        self._root(where[id(value)], f"module {module} global {name!r}")
            else:
                i = self.index.get(id(r))
                if i is None:
                    i = self._add(r)
                    found.append(i)
                for j in hits:
                    self._edge(i, j)
                if id(r) in local_labels:
                    self._root(i, local_labels[id(r)])
        for i in frontier:
            if i not in referred:
                self._root(i, "object with no referrers")
        return found

    def _add(self, obj) -> int:
        self.index[id(obj)] = len(self.nodes)
        self.nodes.append(obj)
        self.referents.append([])
        self.up.append(None)
        return len(self.nodes) - 1

    def _edge(self, holder: int, child: int) -> None:
        self.referents[holder].append(child)
        if self.up[holder] is not None and self.up[child] is None:
            self.up[child] = holder
            self._spread([child])

    def _root(self, i: int, holder: str, partial: bool = False) -> None:
        self.roots.setdefault(i, (holder, partial))
        if self.up[i] is None:
            self.up[i] = -1
            self._spread([i])

    def _spread(self, starts: list[int]) -> None:
        """Root every unrooted node found below ``starts`` (rooted) through them, breadth first: no cycles."""
        queue = deque(starts)
        while queue:
            k = queue.popleft()
            for j in self.referents[k]:
                if self.up[j] is None:
                    self.up[j] = k
                    queue.append(j)

    def _settle(self) -> None:
        """Point every node along a shortest chain to a root found, complete chains before partial ones.

        While searching, a node takes the first root that reaches it; a nearer
        one found in the same pass (a user's list next to the runner holding
        the same model) makes the chain a reader expects.
        """
        self.up = [None] * len(self.nodes)
        for partial in (False, True):
            starts = [i for i, (_, cut) in self.roots.items() if cut == partial and self.up[i] is None]
            for i in starts:
                self.up[i] = -1
            self._spread(starts)

    def describe(self, i: int, fixed_nbytes: int | None) -> Survivor:
        """Target ``i`` as a Survivor: its bytes and its chain, rendered from the settled search."""
        chain = [i]
        while self.up[chain[-1]] != -1:
            chain.append(self.up[chain[-1]])
        holder, partial = self.roots[chain[-1]]
        path = _render_path([self.nodes[k] for k in reversed(chain)], self.edge_labels)
        obj = self.nodes[i]
        if isinstance(obj, torch.Tensor):
            return Survivor(f"tensor{tuple(obj.shape)} {obj.dtype} on {obj.device}", _own_nbytes(obj),
                            tensor_nbytes(obj), _storage_ptr(obj), holder, type(self.nodes[chain[-1]]).__name__,
                            path, partial)
        nbytes = fixed_nbytes or 0  # an object holding device memory for tensors (CUDA graphs and their pool)
        return Survivor(type(obj).__name__, nbytes, nbytes, id(obj), holder, type(self.nodes[chain[-1]]).__name__,
                        path, partial)


def _referrers(objs: list, internal: set[int]) -> list:
    """Every object that refers to one of ``objs``, from one pass over the heap.

    gc.get_referrers compares each reference in the heap with each of its
    arguments in turn, so for a wide frontier one scan that looks each
    reference's id up in a set is faster. ``internal``: ids of the search's
    own containers, never reported, like this module's frames.
    """
    if len(objs) > _SCAN_ABOVE:
        found = _scan_referrers({id(o) for o in objs})
    else:
        args = tuple(objs)
        internal = internal | {id(args)}  # CPython leaves its varargs tuple out; be sure
        found = gc.get_referrers(*args)
    return [r for r in found if id(r) not in internal
            and not (isinstance(r, types.FrameType) and r.f_code.co_filename == __file__)]


def _scan_referrers(ids: set[int]) -> list:
    """Objects of the heap with a reference to one of ``ids``, testing blocks of objects at a time."""
    heap = gc.get_objects()
    found = []
    for start in range(0, len(heap), _BLOCK):
        block = heap[start:start + _BLOCK]
        if not ids.isdisjoint(map(id, gc.get_referents(*block))):
            found += [o for o in block if not ids.isdisjoint(map(id, gc.get_referents(o)))]
    return found


def _module_name(obj) -> str | None:
    """The name of the module whose globals ``obj`` is, or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return name if module is not None and getattr(module, "__dict__", None) is obj else None


def _running_frame_labels() -> dict[int, str]:
    """id(value) -> "frame f() local 'name'" for the locals of every running frame outside this module.

    Since Python 3.11 running frames are not objects the garbage collector
    lists as referrers, so their locals are looked up here as roots.
    """
    labels: dict[int, str] = {}
    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code  # a module body's locals are its globals, named as such by the search
            if code.co_filename != __file__ and (code.co_flags & inspect.CO_OPTIMIZED or frame.f_locals is not frame.f_globals):
                _local_labels(frame, labels)
            frame = frame.f_back
    return labels


def _local_labels(frame: types.FrameType, labels: dict[int, str]) -> None:
    """Add id(value) -> "frame f() local 'name'" for ``frame``'s locals to ``labels``, holding none of them.

    Before Python 3.13 reading a function frame's ``f_locals`` stores a
    snapshot dict on the frame that keeps every local alive until the frame
    exits, even after the function deletes the name. The snapshot is emptied
    again and the frame told it is written back (writing back skips the
    missing names), so a trace function does not refill it either. Left
    alone: a snapshot someone else holds (``ns = locals()``), the real
    namespace of a module or class body, and 3.13's write-through proxy.
    """
    code = frame.f_code
    names = frame.f_locals
    for name, value in names.items():
        labels.setdefault(id(value), f"frame {code.co_name}() local {name!r}")
    if _SNAPSHOT_LOCALS and code.co_flags & inspect.CO_OPTIMIZED and sys.getrefcount(names) <= 3:
        names.clear()  # 3: the frame, ``names`` and getrefcount's argument
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def _render_path(objs: list, cache: dict[int, dict[int, str]]) -> str:
    """How ``objs[0]`` reaches ``objs[-1]``, written like code: ``[0].model.layers[1].mlp.up_proj.weight``.

    Instance ``__dict__``s and nn.Module's registries are folded into
    attribute access; a step that cannot be named shows the type it reaches.
    """
    parts = []
    k = 0
    while k < len(objs) - 1:
        labels = _labels(objs[k], cache)
        j = k + 1
        while j < len(objs) - 1 and _is_internal_dict(objs[k], objs[j]):
            j += 1  # obj.__dict__['_modules'] -> the submodule, read as obj.name
        k = j if j > k + 1 and id(objs[j]) in labels else k + 1
        parts.append(labels.get(id(objs[k]), f" -> {type(objs[k]).__name__}"))
    return "".join(parts)


def _labels(holder, cache: dict[int, dict[int, str]]) -> dict[int, str]:
    """id(child) -> how ``holder`` refers to it, computed once per holder (a dict of 1000 survivors is read once)."""
    labels = cache.get(id(holder))
    if labels is None:
        labels = cache[id(holder)] = {}
        for label, child in _edges(holder):
            labels.setdefault(id(child), label)
    return labels


def _edges(holder) -> Iterable[tuple[str, object]]:
    """(label, child) edges of ``holder`` for naming a chain: those of ``_children``, plus class attributes and closures."""
    if isinstance(holder, type):
        for name, v in vars(holder).items():
            yield f".{name}", v
    elif isinstance(holder, types.FunctionType):
        yield ".__closure__", holder.__closure__
        yield ".__defaults__", holder.__defaults__
    elif isinstance(holder, types.CellType):
        try:
            yield ".cell_contents", holder.cell_contents
        except ValueError:  # an empty cell
            return
    else:
        yield from _children(holder)


def _is_internal_dict(holder, d) -> bool:
    """True if ``d`` is ``holder``'s own attribute dict or one of nn.Module's registries."""
    if not isinstance(d, dict) or isinstance(holder, (dict, list, tuple, types.FrameType)):
        return False
    if isinstance(holder, type):  # vars() of a class is a proxy of the dict it refers to
        return any(x is d for x in gc.get_referents(vars(holder)))
    if d is getattr(holder, "__dict__", None):
        return True
    return isinstance(holder, torch.nn.Module) and any(d is r for r in (holder._parameters, holder._buffers, holder._modules))


def leaks_since(snap: Snapshot, device: str | None = None) -> list[Survivor]:
    """Tensors alive now that were not alive at ``snap``, with the chain that keeps each alive."""
    # Weak references only: a list of the tensors themselves would be the "holder" of every one.
    fresh = [(weakref.ref(t), None) for t in live_tensors()
             if not (snap.refs.get(id(t)) is not None and snap.refs[id(t)]() is t)
             and (device is None or t.device.type == torch.device(device).type)]
    return trace_survivors(fresh)
