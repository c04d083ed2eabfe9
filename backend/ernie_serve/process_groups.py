"""Process groups of an engine's own, for its tensor-parallel ranks: a TCPStore on a port the driver chose and a
gloo (CPU) or NCCL (GPU) group made on it, in Paddle (the reference backend, the kernels backend in production) or
torch (the kernels backend where torch is the tensor framework).

Never the framework's global group: paddle.distributed.init_parallel_env can run once per process (measured: a
second init in the same process fails), so an engine built on it could never be rebuilt in its process. A fresh
group id per engine keeps a process's groups apart.
"""
from __future__ import annotations

import datetime
import os

STARTUP_TIMEOUT_SECONDS = 600  # every rank loads its weights before the first collective (and reports ready)


def paddle_group(rank: int, world_size: int, store_port: int, group_id: int, on_gpu: bool):
    """A Paddle process group of this engine's own: (Group, its TCPStore, which must outlive it)."""
    from paddle.base import core
    from paddle.distributed.communication.group import Group

    os.environ.setdefault("PADDLE_TRAINER_ID", str(rank))  # the C++ process group reads it as the global rank
    store = core.TCPStore("127.0.0.1", store_port, rank == 0, world_size, timeout=STARTUP_TIMEOUT_SECONDS)
    make = core.ProcessGroupNCCL.create if on_gpu else core.ProcessGroupGloo.create
    pg = make(store, rank, world_size, group_id)
    return Group(rank, group_id, list(range(world_size)), pg=pg, name=f"ernie_tp_{group_id}"), store


def torch_group(rank: int, world_size: int, store_port: int, on_gpu: bool):
    """A torch process group of this engine's own: (ProcessGroup, its TCPStore)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_SECONDS)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, rank == 0, timeout=timeout)
    if on_gpu:
        return dist.ProcessGroupNCCL(store, rank, world_size), store
    return dist.ProcessGroupGloo(store, rank, world_size, timeout), store
