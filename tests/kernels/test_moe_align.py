import numpy as np
import pytest

from ernie_kernels import moe_align_block_size
from ernie_kernels import reference as ref


def test_alignment_groups_slots_by_expert_and_pads_to_block(fw):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(6)[:2] for _ in range(11)]).astype(np.int64)
    ids[ids == 5] = 0  # expert 5 idle, expert 0 busy
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 5, ids[:, 1])
    sorted_ids, expert_ids, num_post = moe_align_block_size(fw.tensor(ids), 6, 4)
    r_sorted, r_experts, r_num = ref.moe_align_block_size(ids, 6, 4)
    n = int(fw.numpy(num_post)[0])
    assert n == r_num
    np.testing.assert_array_equal(fw.numpy(sorted_ids)[:n], r_sorted)  # stable: slot order kept in a group
    np.testing.assert_array_equal(fw.numpy(expert_ids)[: n // 4], r_experts)
    assert (fw.numpy(sorted_ids)[n:] == ids.size).all()


def test_alignment_drops_ids_outside_the_local_experts(fw):
    ids = np.array([[0, -1], [3, 1]], np.int32)  # -1 and 3: experts owned by another rank
    sorted_ids, expert_ids, num_post = moe_align_block_size(fw.tensor(ids), 2, 2)
    assert int(fw.numpy(num_post)[0]) == 4
    np.testing.assert_array_equal(fw.numpy(sorted_ids)[:4], [0, 4, 3, 4])
    np.testing.assert_array_equal(fw.numpy(expert_ids)[:2], [0, 1])


def test_alignment_writes_nothing_past_its_buffers(monkeypatch):
    """Every output lives in a larger buffer whose tail must stay untouched: with one slot a block an expert,
    expert_ids is filled to its last element, which the interpreter once overran (an int32 sum kept as int64)."""
    torch = pytest.importorskip("torch")
    import ernie_kernels.moe_align as align

    tails = []

    def guarded(like, shape, dtype, fill=None):
        n = int(np.prod(shape))
        buf = torch.full([n + 16], -7, dtype=getattr(torch, dtype))
        if fill is not None:
            buf[:n] = fill
        tails.append(buf[n:])
        return buf[:n].view(*[int(s) for s in shape])

    monkeypatch.setattr(align, "new_tensor", guarded)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)  # every expert busy: all 6 blocks of 16 used
    _, expert_ids, num_post = align.moe_align_block_size(ids, 6, 16)
    assert int(num_post[0]) == 96
    assert expert_ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert all((t == -7).all() for t in tails)


def _check_against_reference(fw, ids: np.ndarray, num_experts: int, block_m: int) -> None:
    sorted_ids, expert_ids, num_post = moe_align_block_size(fw.tensor(ids), num_experts, block_m)
    r_sorted, r_experts, r_num = ref.moe_align_block_size(ids, num_experts, block_m)
    n = int(fw.numpy(num_post)[0])
    assert n == r_num
    got_sorted, got_experts = fw.numpy(sorted_ids).astype(np.int64), fw.numpy(expert_ids).astype(np.int64)
    np.testing.assert_array_equal(got_sorted[:n], r_sorted)
    assert (got_sorted[n:] == ids.size).all()  # the unused tail keeps the sentinel
    np.testing.assert_array_equal(got_experts[: n // block_m], r_experts)
    assert (got_experts[n // block_m:] == 0).all()


@pytest.mark.parametrize("tokens,topk,experts,block_m", [
    (0, 2, 4, 16),  # no tokens: nothing but the sentinel
    (7, 1, 1, 16),  # one expert, tokens not a multiple of the block
    (33, 3, 5, 4),  # experts padded to 16 columns, some idle
    (300, 6, 64, 16),  # 21B's experts and top-6 over several tiles
    (1500, 8, 64, 64),  # 300B's experts and top-8: tiles of several chunks, more than the offsets' rows at once
])
def test_alignment_matches_the_reference_on_random_routings(fw, tokens, topk, experts, block_m):
    rng = np.random.default_rng(tokens + experts)
    rows = [rng.permutation(experts)[:topk] if experts >= topk else rng.integers(0, experts, topk)
            for _ in range(tokens)]
    ids = np.array(rows, dtype=np.int64).reshape(tokens, topk)
    if experts > 4:
        ids[ids == 2] = 1  # expert 2 idle
    _check_against_reference(fw, ids, experts, block_m)


def test_alignment_over_many_small_tiles_keeps_slot_order(fw, monkeypatch):
    """Tiles of one chunk each, more tiles than the offsets program reads at once, and more programs writing
    block experts than tiles: each expert's slots still come out in slot order across tiles (a stable sort),
    with ids of other ranks' experts dropped."""
    import ernie_kernels.moe_align as align

    monkeypatch.setattr(align, "TARGET_TILES", 1 << 20)
    monkeypatch.setattr(align, "BLOCKS_A_PROGRAM", 2)
    rng = np.random.default_rng(7)
    ids = rng.integers(-1, 5, size=(2100, 2)).astype(np.int32)  # 4200 slots in tiles of 128: 33 tiles > 16 rows
    assert align.tile_size(ids.size, 128) == 128
    _check_against_reference(fw, ids, 4, 8)


def test_alignment_is_parallel_over_tiles():
    """A long prefill's slots are counted and scattered by many programs, each over a bounded run of chunks."""
    import ernie_kernels.moe_align as align

    numel = 32768 * 8  # 300B at --max-num-batched-tokens 32768
    tile = align.tile_size(numel, 32)
    assert -(-numel // tile) >= align.TARGET_TILES and tile // 32 <= align.MAX_TILE_CHUNKS
    assert align.tile_size(64 * 8, 32) == 32  # a decode batch: one chunk a program
