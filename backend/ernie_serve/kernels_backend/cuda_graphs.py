"""CUDA graphs for decode steps (`--use-cudagraph`, FastDeploy's flag).

A decode-only step (every sequence computes one token and samples it, no KV block moves) is padded up to
the nearest captured batch size and replayed from a graph; every other step runs eagerly. The forward and
the logits of a bucket are captured once at start-up over the persistent step buffers (step_buffers.py),
so a replay only needs the new index data written into them. Padding sequences write no KV (slot -1),
see one key and have their logits dropped.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ..step_contract import StepInput
from .framework import Graph

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8 up to max_num_seqs, and max_num_seqs itself
    (vLLM's default spacing: small batches exact, large ones padded by at most 7 sequences)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return sorted(sizes)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences; None when none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def is_decode_only(step: StepInput) -> bool:
    """One new token per sequence, each sampled in its own row, and no KV block moves before the forward."""
    b = len(step.seq_lens)
    return (b > 0 and not step.kv_ops and step.num_tokens == b and len(step.sample_rows) == b
            and bool((step.sample_rows == np.arange(b)).all()))


class CudaGraphRunner:
    """Captured decode graphs by batch size; `run` replays the step's bucket or says it cannot.

    Every graph captures into one memory pool (new_pool's), largest first: a replay runs one graph at a time, so the
    smaller graphs reuse the largest one's activation memory, and the pool costs about one decode forward at
    max_num_seqs, which kernels_backend/loading.py reserves before it sizes the KV pool."""

    def __init__(self, sizes: list[int], new_graph: Callable[[Any], Graph], new_pool: Callable[[], Any]):
        self.sizes = sizes
        self.new_graph = new_graph
        self.new_pool = new_pool
        self.pool: Any = None
        self.graphs: dict[int, tuple[Graph, Any]] = {}
        self.replays = 0

    def capture(self, size: int, fill: Callable[[int], Any], forward: Callable[[Any], Any]) -> None:
        """fill(size) writes a padding-only decode step of `size` sequences into the buffers and returns its
        StepTensors; forward(step) runs the model over them and returns the tensors the graph keeps writing
        (the hidden states and the logits). The graph is bound to that step's buffer views: a replay reads whatever they hold then."""
        step = fill(size)
        if self.pool is None:
            self.pool = self.new_pool()
        graph = self.new_graph(self.pool)
        out = graph.capture(lambda: forward(step))
        self.graphs[size] = (graph, out)

    def capture_all(self, fill: Callable[[int], Any], forward: Callable[[Any], Any]) -> None:
        for size in sorted(self.sizes, reverse=True):  # largest first: the smaller graphs fit in what it took
            self.capture(size, fill, forward)
        log.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def bucket(self, step: StepInput) -> int | None:
        """The captured size this step replays at, or None when it runs eagerly."""
        if not is_decode_only(step):
            return None
        size = bucket_for(len(step.seq_lens), self.sizes)
        return size if size in self.graphs else None

    def replay(self, size: int) -> Any:
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out
