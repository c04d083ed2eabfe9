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
