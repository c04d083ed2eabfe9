"""Token-expert sorting for the grouped GEMM: slots (token, j) grouped by expert, each group padded to
a multiple of BLOCK_M so every GEMM tile reads one expert's weights.

One program does a counting sort over the T*k slots in chunks (one-hot counts, cumsum for the
in-chunk rank), so it is launch-once and sync-free; it is serial in T*k, fine for decode and
moderate prefill (a multi-program histogram would be the next step for very long prefills).
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import contiguous, new_tensor, next_pow2, tl, triton


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_blocks,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)

    running = ends - padded
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        valid = (offs < numel) & (ids >= 0) & (ids < num_experts)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot
        pos = tl.sum((running[None, :] + rank) * onehot, axis=1)
        tl.store(sorted_ptr + pos, offs, mask=valid)
        running += tl.sum(onehot, axis=0)

    for b0 in range(0, max_blocks, CHUNK):
        blk = b0 + tl.arange(0, CHUNK)
        eid = tl.sum(((blk * BLOCK_M)[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, eid, mask=blk * BLOCK_M < total)


def moe_align_block_size(topk_ids: Any, num_experts: int, block_m: int) -> tuple[Any, Any, Any]:
    """topk_ids [T, k] (int32/int64; ids outside [0, E) are dropped) ->

    sorted_ids int32 [T*k + E*(block_m-1)]: flat slot indices t*k+j grouped by expert, each group padded
    with the sentinel T*k to a multiple of block_m; expert_ids int32 [len/block_m]: the expert of each
    block (only the first num_post_padded/block_m are written); num_post_padded int32 [1].
    """
    ids = contiguous(topk_ids).reshape([-1])
    numel = int(ids.shape[0])
    cap = numel + num_experts * (block_m - 1)
    max_blocks = triton.cdiv(cap, block_m)
    sorted_ids = new_tensor(ids, [cap], "int32", fill=numel)
    expert_ids = new_tensor(ids, [max_blocks], "int32", fill=0)
    num_post = new_tensor(ids, [1], "int32", fill=0)
    e_pad = max(16, next_pow2(num_experts))
    _moe_align_kernel[(1,)](ids, sorted_ids, expert_ids, num_post, numel, num_experts, max_blocks,
                            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, 2048 // e_pad))  # [CHUNK, E_PAD] tiles in registers
    return sorted_ids, expert_ids, num_post
