"""CudaGraphManager: decode steps captured as CUDA graphs, one per batch size, replayed with padding.

A decode step of a small model is hundreds of short kernels; launched from
Python one by one, the launches cost more than the arithmetic. A captured
graph replays them in one call. Graphs read their inputs from the runner's
``StepInputs`` device buffer at fixed offsets, so a step only writes that
buffer and replays the graph of the next captured size up (padding rows
write nothing and attend to nothing).

Owns device memory: one graph memory pool shared by every captured size (the
activations and output of each graph), plus the constant tile and
query-start tensors; all registered with the ledger as ``cuda_graphs``.
Graphs bake in the addresses of the weights and the KV cache, so they are
dropped before either is released (sleep, shutdown) and captured again when
both are back.
"""

from __future__ import annotations

import time

import torch

from ..attention import AttentionMetadata, ForwardContext
from ..attention.metadata import decode_splits, tile_shape
from ..kv_cache import KVCache
from ..resources import ResourceLedger
from .input_batch import StepInputs


class _Graphs(dict):
    """Captured graphs by batch size (a dict subclass, so the ledger can refer to it weakly)."""


def default_capture_sizes(max_num_seqs: int, limit: int = 256) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to min(max_num_seqs, limit)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if top not in sizes:
        sizes.append(top)
    return tuple(sorted(sizes))


class CudaGraphManager:
    """Captures, replays and drops the decode graphs of one runner (see the module docstring).

    Owns device memory: the graphs' pool and outputs and its constant
    metadata tensors, all tracked with the ledger as ``cuda_graphs``.
    """

    def __init__(self, sizes: tuple[int, ...], inputs: StepInputs, group: int, device: torch.device,
                 ledger: ResourceLedger) -> None:
        self.sizes = tuple(sorted(sizes))
        self._inputs, self._group, self._device, self._ledger = inputs, group, device, ledger
        self._graphs = _Graphs()
        self._outputs: dict[int, torch.Tensor] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def size_for(self, batch_size: int) -> int | None:
        """The smallest captured size that holds ``batch_size`` rows, or None."""
        return next((size for size in self.sizes if size >= batch_size and size in self._graphs), None)

    def _metadata(self, size: int) -> AttentionMetadata:
        views = self._inputs.decode_views(size)
        block_q, block_m = tile_shape(self._group, 1)
        arange = torch.arange(size + 1, dtype=torch.int64, device=self._device)
        tile_q0 = torch.zeros(size, dtype=torch.int64, device=self._device)
        for name, t in (("query_start", arange), ("tile_q0", tile_q0)):
            self._ledger.track("cuda_graphs", f"cuda_graph.bs={size}.{name}", t)
        return AttentionMetadata(slot_mapping=views["slot_mapping"], query_start_loc=arange, seq_lens=views["seq_lens"],
                                 block_tables=views["block_tables"], max_query_len=1, max_seq_len=0,
                                 tile_seq=arange[:size], tile_q0=tile_q0, block_q=block_q, block_m=block_m,
                                 splits=decode_splits(size, self._inputs.num_kv_heads))

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, kv_cache: KVCache, ctx: ForwardContext, warm_up: bool = True) -> float:
        """Capture every size, largest first so smaller graphs reuse the pool's blocks; returns seconds.

        ``warm_up`` runs each step once before capturing it, so Triton compiles
        and cuBLAS picks its kernels outside the capture; a recapture (after a
        wake) can skip it. ``torch.cuda.graph`` is not used because it runs a
        full ``gc.collect()`` and ``empty_cache()`` per graph, which made
        capture several times slower.
        """
        start = time.perf_counter()
        for size in self.sizes:
            self._metas[size] = self._metadata(size)
            if warm_up:  # the values matter only here: a captured graph reads them at replay
                # Padding everywhere (each size lays the buffer out differently): rows write nothing, see nothing.
                self._inputs.device_buf.zero_()
                self._inputs.decode_views(size)["slot_mapping"].fill_(-1)
                with ctx.scope(self._metas[size]):
                    self._run(model, size, kv_cache)
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()  # warm-up activations out of the reading below
        reserved = torch.cuda.memory_reserved(self._device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self._device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with ctx.scope(self._metas[size]):
                stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=pool)
                    try:
                        out = self._run(model, size, kv_cache)
                    except BaseException:
                        try:  # close the capture so the stream is usable; its own error would hide the cause
                            graph.capture_end()
                        except Exception:  # noqa: BLE001 - the original error is re-raised below
                            pass
                        raise
                    graph.capture_end()
                torch.cuda.current_stream(self._device).wait_stream(stream)
            self._graphs[size] = self._ledger.track("cuda_graphs", f"cuda_graph.bs={size}", graph, nbytes=0,
                                                    device=str(self._device))
            self._outputs[size] = self._ledger.track("cuda_graphs", f"cuda_graph.bs={size}.output", out)
        torch.cuda.synchronize(self._device)
        # The pool's blocks are not tensors of ours: account them to the graphs that keep the pool alive.
        outputs = sum(t.untyped_storage().nbytes() for t in self._outputs.values())
        self.pool_bytes = max(0, torch.cuda.memory_reserved(self._device) - reserved - outputs)
        self._ledger.track("cuda_graphs", "cuda_graph.pool", self._graphs, nbytes=self.pool_bytes,
                           device=str(self._device))
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    def _run(self, model: torch.nn.Module, size: int, kv_cache: KVCache) -> torch.Tensor:
        views = self._inputs.decode_views(size)
        return model(views["input_ids"], views["positions"], kv_cache)

    def replay(self, size: int) -> torch.Tensor:
        """Run the captured step of ``size`` rows on what the step inputs hold now; final hidden states."""
        self._graphs[size].replay()
        return self._outputs[size]

    def release(self) -> None:
        """Drop every graph and its outputs; their pool goes back once the caching allocator is emptied."""
        self._graphs.clear()
        self._outputs.clear()
        self._metas.clear()
