"""Tensor-parallel start-up waits for progress, not for a fixed time: the driver fails a rank only when it has
reported nothing (hello, progress, ready) for the start-up timeout, and a rank's queued "ready" always counts,
however long rank 0's own load took. The workers here are fake ranks (fake_rank.py) that load nothing, so the
timeouts can be seconds; rank 0's shard is a stub whose load takes as long as a test says."""
from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ernie_serve.tensor_parallel import workers
from ernie_serve.tensor_parallel.workers import RankFailedError, TensorParallelExecutor

SPEC = dict(model_dir="/nonexistent", num_output_ids=None, quantization=None, num_blocks=4, block_size=16,
            num_host_blocks=0, world_size=2, expert_parallel=False)


class _StubRank0:
    """Rank 0's RankShard without a model: joins no group, and its load takes `load_seconds`."""
    load_seconds = 0.0

    def __init__(self, rank, spec):
        pass

    @staticmethod
    def host_store(backend, framework, world_size):
        return SimpleNamespace(port=0, store=lambda still_starting: None)

    def make_group(self, store=None):
        return None, None

    def load(self, group):
        time.sleep(self.load_seconds)
        cache = SimpleNamespace(num_blocks=4, num_layers=1, block_size=16, head_dim=8)
        return SimpleNamespace(cache=cache, model=SimpleNamespace(config=SimpleNamespace(num_key_value_heads=1)),
                               draft_head=None)


@pytest.fixture
def fake_ranks(monkeypatch, tmp_path):
    """Workers become fake_rank.py; returns a function taking rank 0's load time and the worker's plan."""
    wrapper = tmp_path / "fake-python"
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{Path(__file__).with_name("fake_rank.py")}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(workers, "python_executable", lambda: str(wrapper))
    monkeypatch.setattr(workers, "RankShard", _StubRank0)

    def start(rank0_load: float, progress_every: float, progress_for: float, timeout: float):
        monkeypatch.setattr(_StubRank0, "load_seconds", rank0_load)
        monkeypatch.setenv("FAKE_RANK_PLAN", json.dumps({"progress_every": progress_every,
                                                         "progress_for": progress_for}))
        return TensorParallelExecutor(SPEC, startup_timeout=timeout)
    return start


def test_queued_ready_counts_after_rank0_load_outlasts_the_timeout(fake_ranks):
    # The worker is ready at once; rank 0's own load takes longer than the timeout. Before the fix the deadline
    # ran from before rank 0's load and was checked before the queued "ready" was read: start-up failed.
    executor = fake_ranks(rank0_load=4.0, progress_every=0.0, progress_for=0.0, timeout=2.0)
    executor.shutdown()


def test_a_rank_that_keeps_reporting_progress_may_load_longer_than_the_timeout(fake_ranks):
    executor = fake_ranks(rank0_load=0.0, progress_every=0.25, progress_for=5.0, timeout=2.0)
    executor.shutdown()


def test_a_rank_silent_for_the_timeout_fails_start_up_naming_it(fake_ranks):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank.*\[1\]"):
        fake_ranks(rank0_load=0.0, progress_every=0.0, progress_for=30.0, timeout=1.5)
    assert time.monotonic() - start < 15


def test_a_loading_worker_forwards_its_ticks_about_once_a_second(monkeypatch):
    sent, clock = [], [100.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: clock[0])
    forward = workers._ProgressReports(lambda kind, **extra: sent.append((kind, extra["done"])))
    for done in range(1, 11):
        forward("weights", done, 10)
        clock[0] += 0.3
    assert sent == [("progress", 1), ("progress", 5), ("progress", 9), ("progress", 10)]  # the last one always
