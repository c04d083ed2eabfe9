"""Start-up progress of this process, for whoever waits on it.

Long start-up work ticks it (model/checkpoint_map.py: each checkpoint tensor read); a tensor-parallel worker forwards
the ticks to its driver (tensor_parallel/workers.py), whose wait for the ranks is an inactivity timeout, not a fixed
deadline: a rank reading a 300B checkpoint for half an hour is fine as long as it keeps reading.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

Listener = Callable[[str, int, int], None]  # (phase, done, total)
_listeners: list[Listener] = []


def tick(phase: str, done: int, total: int) -> None:
    """Report that `done` of `total` units of `phase` are finished (bytes of the checkpoint, for loading)."""
    for listener in list(_listeners):
        listener(phase, done, total)


@contextmanager
def reporting_to(listener: Listener) -> Iterator[None]:
    """Call `listener` with every tick made inside the block (in the ticking thread)."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
