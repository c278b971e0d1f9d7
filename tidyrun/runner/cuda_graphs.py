"""CudaGraphManager: decode steps captured as CUDA graphs, one per batch size, replayed with padding.

A decode step of a small model is hundreds of short kernels; launched from
Python one by one, the launches cost more than the arithmetic. A captured
graph replays them in a few calls (a step is captured in pieces, see
``piece_bounds``). Graphs read their inputs from the runner's
``StepInputs`` device buffer at fixed offsets, so a step only writes that
buffer and replays the graph of the next captured size up (padding tokens
write nothing, padding sequences attend to nothing).

A graph is keyed by (sequences, tokens per sequence): plain decode is
``q = 1``; with n-gram speculation, steps that verify up to k drafts are
captured too with ``q = k + 1`` (a sequence with fewer drafts uses fewer of
its rows; its query start is data, not baked in).

Graphs of at most ``LOGITS_MAX_ROWS`` rows go on through the LM head and
the argmax of every row: a small step is bound by the host, and these are
three launches fewer per step. Larger ones stop at the hidden states, so
the pool does not hold [rows, vocab] logits for hundreds of rows.

Owns device memory: one graph memory pool shared by every captured graph
(the activations and output of each), plus the constant tile tensors; all
registered with the ledger as ``cuda_graphs``. Graphs bake in the addresses
of the weights and the KV cache, so they are dropped before either is
released (sleep, shutdown) and captured again when both are back.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..attention import AttentionMetadata, ForwardContext
from ..kv_cache import KVCache
from ..resources import ResourceLedger, capture_stream
from .input_batch import StepInputs

GraphKey = tuple[int, int]  # (sequences, query tokens per sequence)


class GraphOutput(NamedTuple):
    """What a graph leaves in its pool: final hidden states, or logits (model dtype), each row's argmax and
    that token's log-probability (float32; a greedy step's logprobs come out of the graph with its tokens)."""
    hidden: torch.Tensor | None
    logits: torch.Tensor | None
    greedy: torch.Tensor | None
    greedy_logprob: torch.Tensor | None


class _Graphs(dict):
    """Captured steps by (sequences, tokens per sequence), each a list of graph pieces replayed in order
    (a dict subclass, so the ledger can refer to it weakly)."""


def default_capture_sizes(max_num_seqs: int, limit: int = 256) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to min(max_num_seqs, limit)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if top not in sizes:
        sizes.append(top)
    return tuple(sorted(sizes))


class CudaGraphManager:
    """Captures, replays and drops the step graphs of one runner (see the module docstring).

    Owns device memory: the graphs' pool and outputs and its constant
    metadata tensors, all tracked with the ledger as ``cuda_graphs``.
    ``sizes`` maps tokens per sequence (1, and k + 1 when speculating) to
    the batch sizes captured for it.
    """

    LOGITS_MAX_ROWS = 64  # graphs of up to this many rows end with the LM head and argmax (module docstring)

    def __init__(self, sizes: dict[int, tuple[int, ...]], inputs: StepInputs, device: torch.device,
                 ledger: ResourceLedger) -> None:
        self.sizes = {q: tuple(sorted(s)) for q, s in sizes.items()}
        self._inputs, self._device, self._ledger = inputs, device, ledger
        self._graphs = _Graphs()
        self._outputs: dict[GraphKey, GraphOutput] = {}
        self._metas: dict[GraphKey, AttentionMetadata] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def keys(self) -> list[GraphKey]:
        return [(size, q) for q, sizes in self.sizes.items() for size in sizes]

    def key_for(self, batch_size: int, q: int) -> GraphKey | None:
        """The captured graph with the fewest sequences >= ``batch_size`` for ``q`` tokens each, or None."""
        return next(((size, q) for size in self.sizes.get(q, ()) if size >= batch_size and (size, q) in self._graphs),
                    None)

    def _metadata(self, size: int, q: int) -> AttentionMetadata:
        views = self._inputs.graph_views(size, q)
        block_q, block_m, splits = self._inputs.attention_tiles(size, q)
        tiles = -(-q // block_q)  # per sequence; a sequence with fewer rows leaves the last tiles empty
        tile_seq = torch.arange(size, dtype=torch.int64, device=self._device).repeat_interleave(tiles)
        tile_q0 = (torch.arange(tiles, dtype=torch.int64, device=self._device) * block_q).repeat(size)
        for name, t in (("tile_seq", tile_seq), ("tile_q0", tile_q0)):
            self._ledger.track("cuda_graphs", f"cuda_graph.bs={size}.q={q}.{name}", t)
        return AttentionMetadata(slot_mapping=views["slot_mapping"], query_start_loc=views["query_start_loc"],
                                 seq_lens=views["seq_lens"], block_tables=views["block_tables"], max_query_len=q,
                                 max_seq_len=0, tile_seq=tile_seq, tile_q0=tile_q0, block_q=block_q, block_m=block_m,
                                 splits=splits,
                                 counters=self._inputs.counters)

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, kv_cache: KVCache, ctx: ForwardContext, warm_up: bool = True) -> float:
        """Capture every graph, largest first so smaller ones reuse the pool's blocks; returns seconds.

        ``warm_up`` runs each step once before capturing it, so Triton compiles
        and cuBLAS picks its kernels outside the capture; a recapture (after a
        wake) can skip it. ``torch.cuda.graph`` is not used because it runs a
        full ``gc.collect()`` and ``empty_cache()`` per graph, which made
        capture several times slower.
        """
        start = time.perf_counter()
        keys = sorted(self.keys, key=lambda k: k[0] * k[1])
        for key in keys:
            self._metas[key] = self._metadata(*key)
            if warm_up:  # the values matter only here: a captured graph reads them at replay
                # Padding everywhere (each key lays the buffer out differently): no sequence owns a token.
                self._inputs.device_buf.zero_()
                self._inputs.graph_views(*key)["slot_mapping"].fill_(-1)
                with ctx.scope(self._metas[key]):
                    self._run(model, key, kv_cache)
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()  # warm-up activations out of the reading below
        reserved = torch.cuda.memory_reserved(self._device)
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self._device)
        for key in reversed(keys):
            name = f"cuda_graph.bs={key[0]}.q={key[1]}"
            pieces: list[torch.cuda.CUDAGraph] = []
            with ctx.scope(self._metas[key]):
                stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(stream):
                    try:
                        out = self._run(model, key, kv_cache, lambda: self._begin_piece(pieces, pool))
                    except BaseException:
                        try:  # close the capture so the stream is usable; its own error would hide the cause
                            if pieces:
                                pieces[-1].capture_end()
                        except Exception:  # noqa: BLE001 - the original error is re-raised below
                            pass
                        raise
                    pieces[-1].capture_end()
                torch.cuda.current_stream(self._device).wait_stream(stream)
            for i, graph in enumerate(pieces):
                self._ledger.track("cuda_graphs", f"{name}.piece{i}", graph, nbytes=0, device=str(self._device))
            self._graphs[key] = pieces
            self._outputs[key] = GraphOutput(*(None if t is None else self._ledger.track(
                "cuda_graphs", f"{name}.{field}", t) for field, t in zip(GraphOutput._fields, out)))
        torch.cuda.synchronize(self._device)
        # The pool's blocks are not tensors of ours: account them to the graphs that keep the pool alive.
        outputs = sum(t.untyped_storage().nbytes() for out in self._outputs.values() for t in out if t is not None)
        self.pool_bytes = max(0, torch.cuda.memory_reserved(self._device) - reserved - outputs)
        self._ledger.track("cuda_graphs", "cuda_graph.pool", self._graphs, nbytes=self.pool_bytes,
                           device=str(self._device))
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    @staticmethod
    def _begin_piece(pieces: list[torch.cuda.CUDAGraph], pool) -> None:
        """End the capture of the current piece (if any) and begin the next, in the same memory pool."""
        if pieces:
            pieces[-1].capture_end()
        pieces.append(torch.cuda.CUDAGraph())
        pieces[-1].capture_begin(pool=pool)

    @staticmethod
    def piece_bounds(num_layers: int) -> list[int]:
        """Layer indices where a step's graph is cut: 1, 3, 7, ... (pieces of 1, 2, 4, ... layers).

        Why pieces: launching a graph costs the host ~0.4 us per kernel, and
        the GPU starts only when the launch returns. A whole 1B-model step is
        ~150 kernels, ~60 us of idle GPU per step at batch 1. A first piece of
        one layer starts the GPU after a few microseconds; each further piece
        is launched while the one before it runs, and is at most twice as long.
        """
        bounds, n = [], 1
        while n < num_layers:
            bounds.append(n)
            n = 2 * n + 1
        return bounds

    def _run(self, model: torch.nn.Module, key: GraphKey, kv_cache: KVCache, next_piece=None) -> GraphOutput:
        """One decode step through ``model``; ``next_piece`` (capture) is called before each piece."""
        views = self._inputs.graph_views(*key)
        num_layers = len(model.model.layers)
        state, start = None, 0
        for end in self.piece_bounds(num_layers) + [num_layers]:
            if next_piece is not None:
                next_piece()
            if state is None:
                state = model.embed(views["input_ids"], views["positions"])
            state = model.run_layers(state, kv_cache, start, end)
            start = end
        hidden = model.final_norm(state)
        if key[0] * key[1] > self.LOGITS_MAX_ROWS:
            return GraphOutput(hidden, None, None, None)
        logits = model.logits(hidden)
        return GraphOutput(None, logits, *model.ops.argmax_logprob(logits))

    def replay(self, key: GraphKey) -> GraphOutput:
        """Run the captured step ``key`` on what the step inputs hold now; its outputs (padded rows too)."""
        for piece in self._graphs[key]:
            piece.replay()
        return self._outputs[key]

    def release(self) -> None:
        """Drop every graph and its outputs; their pool goes back once the caching allocator is emptied."""
        self._graphs.clear()
        self._outputs.clear()
        self._metas.clear()
