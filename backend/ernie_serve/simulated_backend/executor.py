"""The simulated StepExecutor: each step sleeps for the target's modeled step time (x the time scale) and answers
replayed ids. No weights, no KV memory: the pool is a block count, KV ops are accepted and cost only their modeled
transfer time.

It also measures what the host makes of those steps. A GPU kept busy starts a step the moment the last one ends;
the wall time from one step's end to the next one's start is GPU idle time the host caused (step stretch: its sum
over the modeled time of the steps before it). Only gaps into a step that continues a request of the step before
are counted, so an engine idle for want of requests adds nothing. A sleep that wakes late is counted apart
(overshoot_seconds): a simulation artifact, though on a loaded host a real GPU's completion wait wakes late too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kv_blocks import KVBlocks
from ..step_contract import ArgmaxLogits, StepInput
from .logits import ReplayLogits
from .replay import Replay
from .step_model import StepModel
from .targets import Target


@dataclass
class SimulatedKVPool:
    """The engine's view of the target's KV pool (step_contract.KVPoolView) with nothing behind it."""
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def export_blocks(self, block_ids: list[int]) -> KVBlocks:
        raise NotImplementedError("the simulated backend holds no KV to export (splitwise roles are refused)")

    def import_blocks(self, block_ids: list[int], blocks: KVBlocks) -> None:
        raise NotImplementedError("the simulated backend holds no KV to import (splitwise roles are refused)")


@dataclass
class StepCounters:
    """Cumulative figures since start-up (engine stats 'simulated_*', metrics, the benchmark's stats file)."""
    steps: int = 0
    tokens: int = 0
    modeled_seconds: float = 0.0  # the modeled steps, before the time scale
    slept_seconds: float = 0.0  # what the steps were given to take (modeled x time scale)
    execute_seconds: float = 0.0  # wall time inside execute
    overshoot_seconds: float = 0.0  # execute's wall time beyond the scaled modeled time (sleeps waking late)
    host_seconds: float = 0.0  # execute's own host work (replay, model), inside the modeled time
    busy_gaps: int = 0  # step end -> next step start gaps counted for stretch
    busy_gap_seconds: float = 0.0  # their wall time: the host's time between busy steps
    busy_modeled_seconds: float = 0.0  # the scaled modeled time of the steps before them


class SimulatedExecutor:
    model = None  # no model object: the engine keeps it only as an attribute
    draft_head = None

    def __init__(self, target: Target, cache: SimulatedKVPool, replay: Replay, vocab_size: int):
        self.target = target
        self.cache = cache
        self.replay = replay
        self.vocab_size = vocab_size
        self.step_model = StepModel(target)
        self.counters = StepCounters()
        self._last_end: float | None = None
        self._last_scaled = 0.0
        self._last_keys = np.zeros(0, dtype=np.int64)

    def execute(self, step: StepInput) -> tuple[Any, Any]:
        start = time.perf_counter()
        self._count_gap(step, start)
        seconds = self._modeled_seconds(step)
        ids = self.replay.ids(step)
        logits = None
        if ids.size:
            logits = ArgmaxLogits(ids, np.zeros(ids.size, np.float32)) if step.argmax_only \
                else ReplayLogits(ids, self.vocab_size)
        scaled = seconds * self.target.time_scale
        host = time.perf_counter() - start
        if scaled > host:
            time.sleep(scaled - host)
        c = self.counters
        c.steps += 1
        c.tokens += step.num_tokens
        c.modeled_seconds += seconds
        c.slept_seconds += scaled
        c.host_seconds += host
        end = time.perf_counter()
        c.execute_seconds += end - start
        c.overshoot_seconds += max(0.0, end - start - scaled)
        self._last_end, self._last_scaled = end, scaled
        return None, logits

    def _modeled_seconds(self, step: StepInput) -> float:
        swapped = sum(op.kind != "copy" for op in step.kv_ops)
        seconds = self.step_model.swap_seconds(swapped, self.cache.block_size) if swapped else 0.0
        if step.num_tokens:
            seconds += self.step_model.cost(step.num_tokens, int(step.sample_rows.size), step.seq_lens).seconds
        return seconds

    def _count_gap(self, step: StepInput, start: float) -> None:
        """The gap since the last step's end, if this step continues one of its requests (a decode row)."""
        keys = step.row_keys
        if self._last_end is not None and step.num_decodes and (self._last_keys == keys[0]).any():
            c = self.counters
            c.busy_gaps += 1
            c.busy_gap_seconds += start - self._last_end
            c.busy_modeled_seconds += self._last_scaled
        self._last_keys = keys

    def device_stats(self) -> dict[str, float | str]:
        """The counters as engine stats keys, and the stretch so far (host gaps over the modeled time before them)."""
        c = self.counters
        out = {f"simulated_{k}": float(v) for k, v in vars(c).items()}
        out["simulated_time_scale"] = self.target.time_scale
        out["simulated_target"] = self.target.describe()  # a string: metrics.py labels its simulation gauge with it
        out["simulated_step_stretch"] = c.busy_gap_seconds / c.busy_modeled_seconds if c.busy_modeled_seconds else 0.0
        return out
