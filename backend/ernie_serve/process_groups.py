"""Process groups of an engine's own, for its tensor-parallel ranks: a TCPStore that rank 0 hosts on a port of its own
and a gloo (CPU) or NCCL (GPU) group made on it, in Paddle (the reference backend, the kernels backend in production)
or torch (the kernels backend where torch is the tensor framework).

Never the framework's global group: paddle.distributed.init_parallel_env can run once per process (measured: a
second init in the same process fails), so an engine built on it could never be rebuilt in its process. A fresh
group id per engine keeps a process's groups apart.

The store's port (ports.py). Rank 0 hosts the store before the other ranks are started, and they are told its port
only once it listens there, so no rank can reach a stranger's server on the port. torch's store binds port 0 and
reports the port it got. Paddle's takes a port number: it gets one from free_port, and a port taken in the meantime
fails its bind, after which another is tried. That is Paddle's plain TCP server: its default libuv server aborts the
whole process on a taken port (a libuv assertion), so it is turned off while rank 0's store binds.
"""
from __future__ import annotations

import datetime
import os
import threading
import time

from .ports import free_port, listeners_owned_by

STARTUP_TIMEOUT_SECONDS = 600  # every rank loads its weights before the first collective (and reports ready)
STORE_ATTEMPTS = 8  # Paddle: ports tried for rank 0's store when the picked one was taken before its bind
STORE_BIND_SECONDS = 30.0  # Paddle: how long rank 0's store may take to listen (or fail) on a picked port


class Rendezvous:
    """Rank 0's TCPStore, already listening on `port` (its own): tell the other ranks the port, then `store()`."""

    def __init__(self, port: int, store=None, thread: threading.Thread | None = None, outcome: dict | None = None):
        self.port = port
        self._store, self._thread, self._outcome = store, thread, outcome

    def store(self, still_starting=lambda: None):
        """The store, once every rank has joined it (Paddle's rank-0 store waits for them in its constructor, on a
        thread of its own). `still_starting` runs while waiting, to raise when a rank died before joining."""
        while self._thread is not None and self._thread.is_alive():
            still_starting()
            self._thread.join(0.2)
        if self._outcome is not None:
            if "error" in self._outcome:
                raise self._outcome["error"]
            self._store = self._outcome["store"]
        return self._store


def host_store(framework: str, world_size: int) -> Rendezvous:
    """Rank 0's store for a group of `world_size` ranks, in `framework` ("paddle" or "torch")."""
    if framework == "torch":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=_timeout(), wait_for_workers=False)
        return Rendezvous(store.port, store)
    return _host_paddle_store(world_size)


def _host_paddle_store(world_size: int) -> Rendezvous:
    import paddle
    from paddle.base import core

    flag = "FLAGS_tcp_store_using_libuv"
    libuv = paddle.get_flags([flag])[flag]
    paddle.set_flags({flag: False})
    try:
        for _ in range(STORE_ATTEMPTS):
            port, outcome = free_port(), {}

            def make(port=port, outcome=outcome):
                try:
                    outcome["store"] = core.TCPStore("127.0.0.1", port, True, world_size,
                                                     timeout=STARTUP_TIMEOUT_SECONDS)
                except Exception as e:  # noqa: BLE001 - handed to the caller of Rendezvous.store, or retried
                    outcome["error"] = e

            thread = threading.Thread(target=make, name=f"ernie-tp-store-{port}", daemon=True)
            thread.start()
            deadline = time.monotonic() + STORE_BIND_SECONDS
            while thread.is_alive() and time.monotonic() < deadline:
                if listeners_owned_by(port, [os.getpid()]):
                    return Rendezvous(port, thread=thread, outcome=outcome)
                time.sleep(0.01)
            error = outcome.get("error")
            if error is None or "Bind network on" not in str(error):
                raise RuntimeError(f"rank 0's TCPStore did not listen on port {port}: {error or 'no answer'}")
        raise RuntimeError(f"rank 0's TCPStore found each of {STORE_ATTEMPTS} free ports taken before its bind")
    finally:
        paddle.set_flags({flag: libuv})


def join_store(framework: str, port: int, world_size: int):
    """A rank's connection to rank 0's store on `port` (ranks 1..N-1)."""
    if framework == "torch":
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=_timeout())
    from paddle.base import core

    return core.TCPStore("127.0.0.1", port, False, world_size, timeout=STARTUP_TIMEOUT_SECONDS)


def paddle_group(rank: int, world_size: int, store, group_id: int, on_gpu: bool):
    """A Paddle process group of this engine's own on `store` (which must outlive it)."""
    from paddle.base import core
    from paddle.distributed.communication.group import Group

    os.environ.setdefault("PADDLE_TRAINER_ID", str(rank))  # the C++ process group reads it as the global rank
    make = core.ProcessGroupNCCL.create if on_gpu else core.ProcessGroupGloo.create
    pg = make(store, rank, world_size, group_id)
    return Group(rank, group_id, list(range(world_size)), pg=pg, name=f"ernie_tp_{group_id}")


def torch_group(rank: int, world_size: int, store, on_gpu: bool):
    """A torch process group of this engine's own on `store` (which must outlive it)."""
    import torch.distributed as dist

    if on_gpu:
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, _timeout())


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=STARTUP_TIMEOUT_SECONDS)
