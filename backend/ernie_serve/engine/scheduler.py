"""The V1 scheduler: one token budget per step shared by decodes and (chunked) prefills.

Each step, running requests come first: each gets the tokens it still needs (1 for a decode,
1 + drafts when speculating, the next chunk for a partial prefill) while the budget lasts. If the
pool cannot hold a request's new tokens, the most recently admitted running request is preempted
(LIFO): its blocks go back to the pool (and stay in the prefix cache), its KV is recomputed
later from prompt + output so far. Waiting requests are admitted only in steps without a
preemption, prefix-cache hits first, up to max_num_seqs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from .kv_cache_manager import KVCacheManager, KVOp
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step (including speculative drafts)
    num_spec_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens, so it produces a token."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens - self.num_spec_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk_limit = self.config.prefill_chunk_limit

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            spec = len(req.spec_token_ids)
            needed = req.num_tokens + spec - req.num_computed_tokens
            n = min(needed, budget)
            if needed > spec + 1:  # still prefilling (or recomputing after preemption)
                n = min(n, chunk_limit)
                spec = 0 if n < needed else spec
            elif n < needed:  # no room for all drafts: verify fewer of them
                spec = max(0, n - 1)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, spec))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted; everything after it already was

        if not out.preempted:
            self._admit_waiting(out, budget, chunk_limit)
        out.kv_ops = self.kv.take_ops()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, chunk_limit: int) -> None:
        # FastDeploy's max_num_partial_prefills: how many prompts may be mid-prefill at once.
        partial = sum(1 for r in self.running if r.num_computed_tokens < r.num_tokens - 1 and not r.output_token_ids)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seats = 1 + len(req.forks)  # n > 1 siblings join as soon as the prompt is computed
            if len(self.running) + seats > self.config.max_num_seqs:
                break
            hits = self.kv.lookup_prefix(req) if req.num_computed_tokens == 0 else []
            remaining = req.num_tokens - req.num_computed_tokens - len(hits) * self.kv.block_size
            n = min(remaining, budget, chunk_limit)
            if n < remaining and (not self.config.enable_chunked_prefill
                                  or partial >= self.config.max_num_partial_prefills):
                break
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            partial += n < remaining

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks (finished or aborted)."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not (req.hold_kv and status is not RequestStatus.FINISHED_ABORTED):
            self.kv.free(req)
