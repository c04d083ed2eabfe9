"""The collectives a tensor-parallel kernels rank needs, over the tensor framework it computes in.

Megatron's three: the all-reduce that sums row-parallel partial results (after attention's o_proj, after the MLP /
MoE block, after the vocab-parallel embedding), the all-gather of the vocab-parallel lm_head's logit columns,
and a host-side all-gather for start-up agreements (the KV pool's size) and whole-block KV reads.

The group is the engine's own (process_groups.py). Paddle: paddle.distributed's collectives on it; torch (the
borrowed GPU box has no Paddle): the ProcessGroup's own calls. NCCL collectives are stream-ordered, so they are
captured by CUDA graphs like the kernels around them (not yet run on a GPU).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .framework import TensorOps, dtype_name


class Collectives:
    """One rank's collectives; with world_size 1 every one is the identity (no group exists)."""

    def __init__(self, ops: TensorOps, rank: int = 0, world_size: int = 1):
        self.ops, self.rank, self.world_size = ops, rank, world_size

    def all_reduce_(self, t: Any) -> Any:
        """Sum over the ranks, in place."""
        return t

    def all_gather(self, t: Any) -> list[Any]:
        """Every rank's `t` (same shape everywhere), in rank order."""
        return [t]

    def all_gather_columns(self, t: Any) -> Any:
        """[R, N] on each rank -> [R, world_size * N], the ranks' columns side by side in rank order."""
        if self.world_size == 1:
            return t
        return self.ops.concat_columns(self.all_gather(t))

    def all_gather_host(self, a: np.ndarray) -> list[np.ndarray]:
        """The ranks' host arrays (same shape and dtype everywhere), through the device."""
        if self.world_size == 1:
            return [a]
        return [self.ops.to_host(t, keep_dtype=True) for t in self.all_gather(self.ops.tensor(a))]


class PaddleCollectives(Collectives):
    def __init__(self, ops: TensorOps, rank: int, world_size: int, group: Any):
        super().__init__(ops, rank, world_size)
        import paddle.distributed as dist

        self.dist, self.group = dist, group

    def all_reduce_(self, t):
        self.dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t):
        parts: list = []
        self.dist.all_gather(parts, t, group=self.group)
        return parts


class TorchCollectives(Collectives):
    def __init__(self, ops: TensorOps, rank: int, world_size: int, group: Any):
        super().__init__(ops, rank, world_size)
        self.group = group

    def all_reduce_(self, t):
        self.group.allreduce([t]).wait()
        return t

    def all_gather(self, t):
        t = t.contiguous()
        parts = [self.ops.empty(list(t.shape), dtype_name(t)) for _ in range(self.world_size)]
        self.group.allgather([parts], [t]).wait()
        return parts


def make_collectives(ops: TensorOps, rank: int, world_size: int, group: Any) -> Collectives:
    """The collectives of `ops`' framework over `group` (paddle_group's or torch_group's)."""
    if world_size == 1:
        return Collectives(ops)
    return (PaddleCollectives if ops.name == "paddle" else TorchCollectives)(ops, rank, world_size, group)
