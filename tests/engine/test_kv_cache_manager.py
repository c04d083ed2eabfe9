"""The block pool and KV cache manager without a model: hit / evict / swap / fork / free orders, and a
randomized operation sequence checked against the invariants after every step.

KV data is simulated: every device block and host slot holds the token ids written into it, and the
manager's KVOps (swap out, swap in, copy) move those labels exactly as the model runner moves real
KV. So "a position reads another's KV" shows up as a block whose label is not its tokens.
"""
from __future__ import annotations

import random

import pytest

from ernie_serve.engine.kv_cache_manager import KVCacheManager
from ernie_serve.engine.request import Request
from ernie_serve.sampling_params import SamplingParams


class SimulatedKV:
    """What the runner would store: per device block / host slot, the tokens whose KV it holds."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.device: list[list[int | None]] = [[None] * kv.block_size for _ in range(kv.pool.num_blocks)]
        self.host: list[list[int | None]] = [[None] * kv.block_size for _ in range(kv.pool.num_host_blocks)]

    def apply_ops(self) -> None:
        for op in self.kv.take_ops():
            if op.kind == "swap_out":
                self.host[op.dst] = list(self.device[op.src])
            elif op.kind == "swap_in":
                self.device[op.dst] = list(self.host[op.src])
            else:
                assert op.kind == "copy", op
                self.device[op.dst] = list(self.device[op.src])

    def compute(self, req: Request, n: int) -> None:
        """Run n more tokens of req through the "model": write their KV, advance, cache full blocks."""
        bs = self.kv.block_size
        tokens = req.all_token_ids
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.device[req.block_ids[pos // bs]][pos % bs] = tokens[pos]
        req.num_computed_tokens += n
        self.kv.cache_computed_blocks(req)

    def assert_kv_matches(self, req: Request) -> None:
        bs = self.kv.block_size
        tokens = req.all_token_ids
        for pos in range(req.num_computed_tokens):
            got = self.device[req.block_ids[pos // bs]][pos % bs]
            assert got == tokens[pos], (f"{req.request_id} position {pos} reads KV of token {got}, "
                                        f"not {tokens[pos]} (blocks {req.block_ids})")


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), eos_token_ids=[], max_tokens=64)


def admit(kv: KVCacheManager, sim: SimulatedKV, req: Request) -> bool:
    """What the scheduler does for a waiting request: look up its prefix, allocate, compute the rest."""
    hits = kv.lookup_prefix(req)
    n = req.num_tokens - req.num_computed_tokens - len(hits) * kv.block_size
    if not kv.allocate_slots(req, n, hits):
        return False
    req.num_computed_tokens += len(hits) * kv.block_size  # the scheduler's part: the hit blocks hold KV
    sim.apply_ops()
    sim.assert_kv_matches(req)  # the hit blocks already hold this prefix's KV
    sim.compute(req, n)
    return True


def assert_invariants(kv: KVCacheManager, live: list[Request]) -> None:
    pool = kv.pool
    owners = [0] * pool.num_blocks
    for req in live:
        assert len(set(req.block_ids)) == len(req.block_ids), f"{req.request_id} holds a block twice: {req.block_ids}"
        assert len(req.block_ids) == kv.num_blocks_for(req.num_computed_tokens) or req.num_computed_tokens == 0
        for bid in req.block_ids:
            owners[bid] += 1
    assert pool.ref_cnt == owners, "refcounts must equal the number of live owners"
    assert set(pool.free) == {b for b in range(pool.num_blocks) if owners[b] == 0}, "free = unowned blocks"
    for h, bid in pool.cached.items():
        assert pool.block_hash[bid] == h, f"cached hash of block {bid} disagrees with its block_hash"
    slots = list(pool.host_cached.values())
    assert len(set(slots)) == len(slots), "a host slot is cached under two hashes"
    assert sorted(slots + pool.host_free) == list(range(pool.num_host_blocks)), "host slots lost or doubled"


def test_host_tier_hits_before_a_free_device_hit_do_not_evict_it():
    """The issue's repro: prefix hits [host, host, device] where the device hit is the oldest free
    cached block. Swapping the host hits in must not evict (and then reuse) that device hit."""
    kv = KVCacheManager(num_blocks=7, block_size=2, enable_caching=True, num_host_blocks=4)
    sim = SimulatedKV(kv)
    p0, p1, p2 = [1, 2], [3, 4], [5, 6]
    r1, r2 = make_request("r1", p0 + p1 + [9]), make_request("r2", p0 + p1 + p2 + [9])
    for r in (r1, r2):  # admitted in the same step: neither hits, r2 alone registers the p2 block
        assert kv.allocate_slots(r, r.num_tokens)
    sim.apply_ops()
    for r in (r1, r2):
        sim.compute(r, r.num_tokens)
    p2_block = r2.block_ids[2]
    kv.free(r1)
    kv.free(r2)
    # Pressure: six blocks of other content evict p1 and p0 (older than p2's block) to the host tier.
    x = make_request("x", list(range(100, 112)))
    assert admit(kv, sim, x)
    assert set(kv.pool.host_cached) == set(r1.block_hashes[:2])
    kv.free(x)
    assert next(iter(kv.pool.free)) == p2_block, "p2's block is the oldest free cached block"

    r3 = make_request("r3", p0 + p1 + p2 + [7])
    hits = kv.lookup_prefix(r3)
    assert [t for t, _, _ in hits] == ["host", "host", "device"]
    assert admit(kv, sim, r3)
    assert_invariants(kv, [r3])
    assert kv.pool.ref_cnt[p2_block] == 1
    kv.free(r3)
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_swap_in_with_every_host_slot_claimed_drops_the_evicted_block():
    """Swapping in as many blocks as the tier holds: the evictions those allocations cause find no
    unclaimed slot; they drop their block rather than fail or overwrite a slot still to be read."""
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True, num_host_blocks=2)
    sim = SimulatedKV(kv)
    a = make_request("a", [1, 2, 3, 4, 9])  # 2 full blocks + 1
    assert admit(kv, sim, a)
    kv.free(a)
    b = make_request("b", [50, 51, 52, 53, 54, 55, 56, 57])  # all 4 blocks: a's prefix goes to the host
    assert admit(kv, sim, b)
    kv.free(b)
    assert len(kv.pool.host_cached) == 2
    c = make_request("c", [1, 2, 3, 4, 8])
    assert [t for t, _, _ in kv.lookup_prefix(c)] == ["host", "host"]
    assert admit(kv, sim, c)
    assert_invariants(kv, [c])
    kv.free(c)


def test_device_hit_shared_by_two_live_requests_counts_both_owners():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    sim = SimulatedKV(kv)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 6])
    assert admit(kv, sim, a)
    assert admit(kv, sim, b)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert_invariants(kv, [a, b])
    kv.free(a)
    assert_invariants(kv, [b])
    sim.assert_kv_matches(b)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_pool_short_of_blocks_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    sim = SimulatedKV(kv)
    a = make_request("a", [1, 2, 3])
    assert admit(kv, sim, a)
    big = make_request("big", list(range(10, 20)))
    before = (list(kv.pool.ref_cnt), list(kv.pool.free))
    assert not kv.allocate_slots(big, big.num_tokens, kv.lookup_prefix(big))
    assert (kv.pool.ref_cnt, list(kv.pool.free)) == before
    assert big.block_ids == [] and big.num_computed_tokens == 0


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    sim = SimulatedKV(kv)
    parent = make_request("p", [1, 2, 3, 4, 5])
    assert admit(kv, sim, parent)
    child = make_request("c", [1, 2, 3, 4, 5])
    assert kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens  # the scheduler's part
    sim.apply_ops()
    assert child.block_ids[:2] == parent.block_ids[:2] and child.block_ids[2] != parent.block_ids[2]
    sim.assert_kv_matches(child)
    assert_invariants(kv, [parent, child])
    child.append_output(7)  # diverging tokens land in the child's own partial block
    assert kv.allocate_slots(child, 1)
    sim.compute(child, 1)
    sim.assert_kv_matches(parent)
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_cached_blocks_are_evicted_least_recently_used_first_and_tails_before_prefixes():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    sim = SimulatedKV(kv)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks cached + 1 partial
    assert admit(kv, sim, a)
    blocks = list(a.block_ids)
    kv.free(a)
    free = list(kv.pool.free)
    assert free[0] == blocks[3], "the uncached partial block is reused first"
    assert free[-3:] == [blocks[2], blocks[1], blocks[0]], "a prefix outlives its extensions"


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_keep_the_invariants(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    kv = KVCacheManager(num_blocks=rng.randint(6, 24), block_size=bs, enable_caching=rng.random() < 0.9,
                        num_host_blocks=rng.choice([0, 2, 5]))
    sim = SimulatedKV(kv)
    prefixes = [[rng.randint(1, 6) for _ in range(rng.randint(1, 10))] for _ in range(4)]
    live: list[Request] = []
    waiting: list[Request] = []
    counter = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.30:  # a new request, usually extending a shared prefix
            counter += 1
            tokens = rng.choice(prefixes) + [rng.randint(1, 6) for _ in range(rng.randint(0, 6))]
            waiting.append(make_request(f"r{counter}", tokens or [1]))
        elif op < 0.50 and waiting:  # admission: prefix hits, swap-ins, prefill
            req = waiting.pop(0)
            if admit(kv, sim, req):
                live.append(req)
            else:
                waiting.insert(0, req)
        elif op < 0.75 and live:  # a decode step: sample a token, grow by one slot
            req = rng.choice(live)
            if kv.allocate_slots(req, 1):
                req.append_output(rng.randint(1, 6))
                sim.apply_ops()
                sim.compute(req, 1)
        elif op < 0.85 and live:  # finish or abort
            req = live.pop(rng.randrange(len(live)))
            kv.free(req)
        elif op < 0.92 and live:  # preemption by recompute: blocks back to the pool, tokens kept
            req = live.pop(rng.randrange(len(live)))
            kv.free(req)
            req.num_computed_tokens = 0
            waiting.insert(0, req)
        elif live:  # n > 1: fork a sibling off a live request
            parent = rng.choice(live)
            counter += 1
            child = make_request(f"r{counter}", parent.all_token_ids)
            if kv.fork(parent, child):
                child.num_computed_tokens = parent.num_computed_tokens
                sim.apply_ops()
                live.append(child)
        for req in live:
            sim.assert_kv_matches(req)
        assert_invariants(kv, live)
    for req in live:
        kv.free(req)
    assert_invariants(kv, [])
    assert kv.num_free_blocks == kv.pool.num_blocks
