"""Token-expert sorting for the grouped GEMM: slots (token, j) grouped by expert, each group padded to
a multiple of BLOCK_M so every GEMM tile reads one expert's weights.

A stable counting sort in three launches, sync-free (every grid follows from the shapes, so it captures in a
CUDA graph): the T*k slots are cut into tiles, and
1. `_align_count_kernel`, one program a tile: the tile's slots per expert;
2. `_align_offsets_kernel`, one program: each expert's padded group and where each tile's slots of it start
   (the groups' prefix sum plus the earlier tiles' counts), the padded total, and the groups' ends;
3. `_align_scatter_kernel`, one program a tile: each slot to its group's next position (in slot order), and the
   expert of each BLOCK_M block.
A program walks its tile in chunks of SUB slots (one-hot [SUB, E_PAD] in registers, cumsum for the rank in
the chunk). One program over all slots did this in 2 * T*k / SUB dependent steps (4096 for 300B's 8192
tokens x top-8); here a program takes at most MAX_TILE_CHUNKS chunks, and the offsets program
2 * tiles / TILE_ROWS.
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import contiguous, new_tensor, next_pow2, tl, triton

TARGET_TILES = 128  # about one program an SM on the GPUs we serve from; decode batches make fewer
MAX_TILE_CHUNKS = 64  # a tile's chunks at most, before tiles outnumber TARGET_TILES
BLOCKS_A_PROGRAM = 64  # expert ids of BLOCK_M blocks the scatter's programs write each


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, numel, tile, E_PAD: tl.constexpr, SUB: tl.constexpr):
    """counts[p, e]: tile p's slots routed to e (ids of another rank's experts count in columns never read)."""
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    start = p * tile
    for s in range(start, tl.minimum(start + tile, numel), SUB):
        offs = s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + p * E_PAD + experts, counts.to(tl.int64))


@triton.jit
def _align_offsets_kernel(counts_ptr, ends_ptr, num_post_ptr, num_tiles, num_experts, BLOCK_M: tl.constexpr,
                    E_PAD: tl.constexpr, TILE_ROWS: tl.constexpr):
    """counts [tiles, E_PAD] -> in place, the position of tile p's first slot of each expert; ends[e]: one past
    expert e's padded group; num_post: the padded total."""
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int64)
    for t0 in range(0, num_tiles, TILE_ROWS):
        rows = t0 + tl.arange(0, TILE_ROWS)
        c = tl.load(counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=(rows < num_tiles)[:, None],
                    other=0)
        totals += tl.sum(c, axis=0)
    totals = tl.where(experts < num_experts, totals, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + experts, ends.to(tl.int64))
    tl.store(num_post_ptr, tl.sum(padded, axis=0).to(tl.int32))
    running = ends - padded
    for t0 in range(0, num_tiles, TILE_ROWS):
        rows = t0 + tl.arange(0, TILE_ROWS)
        ptrs = counts_ptr + rows[:, None] * E_PAD + experts[None, :]
        mask = (rows < num_tiles)[:, None]
        c = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, (running[None, :] + tl.cumsum(c, axis=0) - c).to(tl.int64), mask=mask)
        running += tl.sum(c, axis=0)


@triton.jit
def _align_scatter_kernel(ids_ptr, starts_ptr, ends_ptr, num_post_ptr, sorted_ptr, expert_ids_ptr, numel, num_experts,
                    tile, num_tiles, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr,
                    BLOCKS: tl.constexpr):
    """Program p: tile p's slots to their positions (if p is a tile), and blocks [p*BLOCKS, (p+1)*BLOCKS)'s
    experts (if those blocks are used)."""
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    if p < num_tiles:
        running = tl.load(starts_ptr + p * E_PAD + experts)
        start = p * tile
        for s in range(start, tl.minimum(start + tile, numel), SUB):
            offs = s + tl.arange(0, SUB)
            ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
            valid = (offs < numel) & (ids >= 0) & (ids < num_experts)
            onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
            rank = tl.cumsum(onehot, axis=0) - onehot
            pos = tl.sum((running[None, :] + rank) * onehot, axis=1)
            tl.store(sorted_ptr + pos, offs, mask=valid)
            running += tl.sum(onehot, axis=0)
    blk = p * BLOCKS + tl.arange(0, BLOCKS)
    ends = tl.load(ends_ptr + experts)
    eid = tl.sum(((blk * BLOCK_M)[:, None] >= ends[None, :]).to(tl.int32), axis=1)
    tl.store(expert_ids_ptr + blk, eid, mask=(blk < max_blocks) & (blk * BLOCK_M < tl.load(num_post_ptr)))


def tile_size(numel: int, sub: int) -> int:
    """Slots a program takes: whole chunks of `sub`, enough for about TARGET_TILES tiles, at most
    MAX_TILE_CHUNKS chunks (past that, more tiles)."""
    chunks = -(-numel // (sub * TARGET_TILES))
    return sub * min(MAX_TILE_CHUNKS, max(1, chunks))


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
    sub = max(16, 2048 // e_pad)  # [SUB, E_PAD] one-hot tiles in registers
    tile = tile_size(numel, sub)
    num_tiles = max(1, triton.cdiv(numel, tile))  # no slots: one program still writes the zero counts
    # int64 scratch: triton 3.2's interpreter keeps an int32 cumsum's values in int64 (NumPy's), and a store of them
    # into an int32 buffer writes 8 bytes an element
    starts = new_tensor(ids, [num_tiles, e_pad], "int64")
    ends = new_tensor(ids, [e_pad], "int64")
    _align_count_kernel[(num_tiles,)](ids, starts, numel, tile, E_PAD=e_pad, SUB=sub)
    _align_offsets_kernel[(1,)](starts, ends, num_post, num_tiles, num_experts, BLOCK_M=block_m, E_PAD=e_pad,
                          TILE_ROWS=max(1, 2048 // e_pad))
    grid = max(num_tiles, triton.cdiv(max_blocks, BLOCKS_A_PROGRAM))
    _align_scatter_kernel[(grid,)](ids, starts, ends, num_post, sorted_ids, expert_ids, numel, num_experts, tile,
                             num_tiles, max_blocks, BLOCK_M=block_m, E_PAD=e_pad, SUB=sub, BLOCKS=BLOCKS_A_PROGRAM)
    return sorted_ids, expert_ids, num_post
