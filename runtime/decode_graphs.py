"""Decode steps on fixed device buffers, captured once as CUDA graphs and replayed.

A decode step launches a few hundred small kernels (per layer: norms, linears, rotary,
the KV store, attention); at a few sequences the GPU finishes each before Python has
launched the next. A CUDA graph records the whole forward once per batch size and
replays it with one launch. What makes that possible is that the step's inputs never
move: they live in `StepBuffers` (runtime/step_buffers.py), the attention reads them
through `StaticDecodeMetadata` without a host read, and a batch is padded up to the next
captured size.

The mode is the engine's ExecutionBackend.decode_graphs:
- "off": every step runs eagerly on per-step metadata (the CPU torch backend; CUDA with
  `--enforce-eager`).
- "padded": decode steps run eagerly on the fixed buffers, padded like captured ones:
  the graphs' inputs and kernels without the capture. The Triton interpreter runs this on
  CPU tensors, so the path a graph records is tested where there is no GPU.
- "captured": CUDA graphs at `capture_sizes`, recorded when the engine starts. If the
  model cannot be captured (a host sync in its forward, say), the engine says why and
  runs eagerly ("off").

Only plain decode steps take this path: every sequence one new token, no drafts to
verify, no prompt logprobs, no tapped layers; the others run eagerly.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from .paged_attention_backend import PagedAttentionBackend
from .step_buffers import DecodeRow, StepBuffers

log = logging.getLogger("qserve.engine")

DECODE_GRAPH_MODES = ("off", "padded", "captured")


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs
    (and max_num_seqs itself), so padding wastes at most 7 rows past 8."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: PagedAttentionBackend,
                 buffers: StepBuffers, sizes: Sequence[int], mode: str) -> None:
        if mode not in ("padded", "captured"):
            raise ValueError(f"DecodeGraphs runs mode 'padded' or 'captured', not {mode!r}.")
        if not sizes or max(sizes) > buffers.capacity:
            raise ValueError(f"capture sizes {list(sizes)} must be within the step buffers' "
                             f"capacity {buffers.capacity}.")
        self.model, self.backend, self.buffers = model, backend, buffers
        self.sizes = tuple(sorted(set(sizes)))
        self.mode = mode
        # size -> (graph, its output: the final hidden states [size, hidden] model dtype)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps served by this path (graph or padded)
        self.padding_rows = 0  # rows added to fill captured sizes, over those steps

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs sequences (None: none does)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def fits(self, rows: Sequence[DecodeRow]) -> bool:
        return self.padded_size(len(rows)) is not None and self.buffers.fits(rows)

    def _forward(self, size: int) -> torch.Tensor:  # [size, hidden] model dtype
        b = self.buffers
        return self.model(b.ids[:size], b.positions[:size], b.metadata(size), self.backend)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Record one graph per size (largest first, sharing one memory pool). Returns
        False, with the graphs dropped and the reason logged, if the model cannot be
        captured; the caller then runs eagerly."""
        if self.mode != "captured":
            return False
        pool = None
        try:
            for size in sorted(self.sizes, reverse=True):
                self.buffers.stage([], size)  # padding rows only: nothing is stored
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # Triton compiles, the allocator settles
                    for _ in range(2):
                        self._forward(size)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                pool = graph.pool()
                self._graphs[size] = (graph, out)
            torch.cuda.synchronize()
        except RuntimeError as exc:  # e.g. a host sync inside the forward
            self._graphs.clear()
            log.warning("decode steps run eagerly: the model could not be captured as a CUDA "
                        "graph (%s)", str(exc).splitlines()[0] if str(exc) else type(exc))
            return False
        return True

    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor:  # [len(rows), hidden]
        """One decode step of these rows: stage them, replay (or run) the padded size.
        The result is a copy, so it outlives the next replay."""
        size = self.padded_size(len(rows))
        if size is None:
            raise ValueError(f"a decode step of {len(rows)} sequences is larger than the "
                             f"largest captured size {self.sizes[-1]}.")
        self.buffers.stage(rows, size)
        self.replays += 1
        self.padding_rows += size - len(rows)
        if size in self._graphs:
            graph, out = self._graphs[size]
            graph.replay()
            return out[:len(rows)].clone()
        return self._forward(size)[:len(rows)]
