"""Block accounting for the paged KV cache: a block pool with prefix caching and a CPU tier.

Only ids and metadata live here. Data movement (swap out to the CPU tier, swap back in, copies
for forked sequences) is recorded as an ordered list of `KVOp`s that the model runner executes
before the next forward pass, so the scheduler never touches tensors (vLLM v1's split).

Prefix caching follows FastDeploy / vLLM: a full block's key is a chained hash of its tokens and
the previous block's key; partial blocks are never shared; blocks with refcount 0 stay cached in
LRU order until their id is needed, then (with swap_space) their data moves to the CPU tier.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..step_contract import KVOp
from .request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # requests looked up
    hits: int = 0  # requests with at least one cached block
    query_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, num_host_blocks: int = 0):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order: uncached ones at the front (reused first), cached ones
        # appended at the back when released (least recently used evicted first).
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> device block id
        self.num_host_blocks = num_host_blocks
        self.host_cached: OrderedDict[int, int] = OrderedDict()  # hash -> host slot, LRU first
        self.host_free = list(range(num_host_blocks))
        self.ops: list[KVOp] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            self._evict(bid)
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def _evict(self, bid: int) -> None:
        h = self.block_hash[bid]
        if h is None:
            return
        self.block_hash[bid] = None
        if self.cached.get(h) == bid:
            del self.cached[h]
            if self.num_host_blocks:
                self._swap_out(bid, h)

    def _swap_out(self, bid: int, h: int) -> None:
        if h in self.host_cached:
            return
        if not self.host_free:
            if not self.host_cached:  # every slot is claimed by a swap-in in progress: drop the block
                return
            _, slot = self.host_cached.popitem(last=False)
            self.host_free.append(slot)
        slot = self.host_free.pop()
        self.host_cached[h] = slot
        self.ops.append(KVOp("swap_out", bid, slot))

    def touch(self, bid: int) -> None:
        if self.ref_cnt[bid] == 0:
            del self.free[bid]
        self.ref_cnt[bid] += 1

    def release(self, bids: list[int]) -> None:
        for bid in reversed(bids):  # tail blocks first, so a prefix outlives its extensions
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] == 0:
                self.free[bid] = None
                if self.block_hash[bid] is None:
                    self.free.move_to_end(bid, last=False)

    def register(self, bid: int, h: int) -> None:
        if h not in self.cached:
            self.cached[h] = bid
            self.block_hash[bid] = h

    def swap_in(self, hashes: list[int]) -> list[int]:
        """Bring host-tier blocks back into fresh device blocks (each referenced once).

        Every slot is claimed before the first allocation: an allocation evicts a cached device block
        to the host tier, and with the tier full that would push out the LRU slot, possibly one of
        these. The swap-outs those evictions record come first in `ops`, so a reused device block is
        read out before its swapped-in data lands on it.
        """
        slots = [self.host_cached.pop(h) for h in hashes]
        bids = self.allocate(len(hashes))
        for h, slot, bid in zip(hashes, slots, bids):
            self.ops.append(KVOp("swap_in", slot, bid))
            self.host_free.append(slot)
            self.register(bid, h)
        return bids

    def take_ops(self) -> list[KVOp]:
        ops, self.ops = self.ops, []
        return ops


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, num_host_blocks if enable_caching else 0)
        self.stats = PrefixCacheStats()
        self._registered: dict[str, int] = {}  # request id -> number of its blocks registered in the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request) -> list[int]:
        tokens = req.all_token_ids
        bs = self.block_size
        hashes = req.block_hashes
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return hashes

    def lookup_prefix(self, req: Request) -> list[tuple[str, int, int]]:
        """Longest run of cached full blocks at the start of the request: (tier, id, hash) each.

        Only blocks entirely within the first num_tokens - 1 tokens count, so the last token is
        always computed and produces logits, even on a full-prompt hit.
        """
        if not self.enable_caching:
            return []
        hashes = self._update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:limit]:
            if h in self.pool.cached:
                hits.append(("device", self.pool.cached[h], h))
            elif h in self.pool.host_cached:
                hits.append(("host", self.pool.host_cached[h], h))
            else:
                break
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       prefix_hits: list[tuple[str, int, int]] | None = None) -> bool:
        """Make the request's blocks cover num_computed_tokens + num_new_tokens; False if the pool is short.

        With prefix_hits (at admission, from lookup_prefix) the hit blocks join the request first: its KV now
        covers len(prefix_hits) * block_size tokens more, which the scheduler (the one writer of a request's
        num_computed_tokens) applies.
        """
        covered = len(req.block_ids) * self.block_size
        if prefix_hits is None and req.num_computed_tokens + num_new_tokens <= covered:
            return True  # a decode inside its last block: the common case, nothing to allocate
        hits = prefix_hits or []
        n_hit_tokens = len(hits) * self.block_size
        total = req.num_computed_tokens + n_hit_tokens + num_new_tokens
        need_new = max(0, self.num_blocks_for(total) - len(req.block_ids) - len(hits))
        reuse_free = sum(1 for tier, bid, _ in hits if tier == "device" and self.pool.ref_cnt[bid] == 0)
        need_swap = sum(1 for tier, _, _ in hits if tier == "host")
        if need_new + need_swap > self.pool.num_free - reuse_free:
            return False
        # Touch every device hit before allocating anything (vLLM v1's order): a free cached hit is the
        # next eviction candidate, and a swap-in's allocation would otherwise take it from under us.
        for tier, bid, _ in hits:
            if tier == "device":
                self.pool.touch(bid)
        swapped = iter(self.pool.swap_in([h for tier, _, h in hits if tier == "host"]))
        req.block_ids.extend(bid if tier == "device" else next(swapped) for tier, bid, _ in hits)
        if prefix_hits is not None:  # an admission looked the prefix up
            self._record_lookup(req, hits)
        req.block_ids.extend(self.pool.allocate(need_new))
        return True

    def _record_lookup(self, req: Request, hits: list[tuple[str, int, int]]) -> None:
        """Every admission is one query (a recompute after preemption looks up again, and its hits save
        real work), so hit_rate = hit_tokens / query_tokens stays a true ratio."""
        n = len(hits) * self.block_size
        self.stats.queries += 1
        self.stats.query_tokens += req.num_tokens
        self.stats.hits += bool(hits)
        self.stats.hit_tokens += n
        self.stats.device_hit_tokens += sum(self.block_size for t, _, _ in hits if t == "device")
        self.stats.host_hit_tokens += sum(self.block_size for t, _, _ in hits if t == "host")

    def cache_computed_blocks(self, req: Request) -> None:
        """Offer the request's newly completed full blocks to the prefix cache."""
        if not self.enable_caching:
            return
        done = self._registered.get(req.request_id, 0)
        if req.num_computed_tokens // self.block_size <= done:
            return  # no block completed since the last call
        hashes = self._update_hashes(req)
        full = min(req.num_computed_tokens // self.block_size, len(hashes))
        for i in range(done, full):
            self.pool.register(req.block_ids[i], hashes[i])
        self._registered[req.request_id] = max(done, full)

    def free(self, req: Request) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []
        self._registered.pop(req.request_id, None)

    def fork(self, parent: Request, child: Request) -> bool:
        """Share the parent's full blocks with the child; copy its partial last block. False if no block. The child's
        KV then covers the parent's num_computed_tokens (the scheduler sets it)."""
        full = parent.num_computed_tokens // self.block_size
        partial = parent.num_computed_tokens % self.block_size
        if partial and self.pool.num_free < 1:
            return False
        for bid in parent.block_ids[:full]:
            self.pool.touch(bid)
        child.block_ids = list(parent.block_ids[:full])
        if partial:
            (dst,) = self.pool.allocate(1)
            self.pool.ops.append(KVOp("copy", parent.block_ids[full], dst))
            child.block_ids.append(dst)
        child.block_hashes = list(parent.block_hashes[:full])
        self._registered[child.request_id] = min(full, self._registered.get(parent.request_id, 0))
        return True

    def take_ops(self) -> list[KVOp]:
        return self.pool.take_ops()
