"""The V1 scheduler: one token budget per step shared by decodes and (chunked) prefills.

Each step, running requests come first: each gets the tokens it still needs (1 for a decode,
1 + drafts when speculating, the next chunk for a partial prefill) while the budget lasts. If the
pool cannot hold a request's new tokens, the most recently admitted running request is preempted
(LIFO): its blocks go back to the pool (and stay in the prefix cache), its KV is recomputed
later from prompt + output so far. Waiting requests are admitted only in steps without a
preemption, prefix-cache hits first, up to max_num_seqs.

The scheduler owns every request's queue state: `add_group` queues a request's n sequences (the others fork from
the first), `schedule` records when each was first scheduled and how many tokens it ran, `update_from_output`
applies a step's results (computed tokens, draft acceptance, appended tokens and the first token's time, the
token-level stop rules, n > 1 forks, freeing), as vLLM v1's Scheduler.update_from_output and nano-vllm's
postprocess do; `finish` and `fail` end a request for a reason decided outside it (an abort, a stop string
matched on text, a failure).
"""
from __future__ import annotations

import time
from collections import deque

from ..config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .spec_decode import SpecStats
from .step_plan import PLACEHOLDER, ModelRunnerOutput, RequestUpdate, ScheduledRequest, SchedulerOutput


# Prefill tokens a step of a request computing prompt logprobs: its logits are this many rows of the vocabulary
# (512 x 103424 float32 = 212 MB for ERNIE-4.5), where the whole budget (8192 tokens) would be 3.4 GB.
PROMPT_LOGPROBS_CHUNK = 512


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished prefill-role requests whose blocks await export (release_held)
        self.num_preemptions = 0
        self.spec = SpecStats()
        self._lookahead = config.num_lookahead_tokens  # read per running request per step

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_group(self, requests: list[Request]) -> None:
        """A request's n sequences: the first is queued, the others wait for its prompt's KV (then fork)."""
        leader = requests[0]
        leader.forks = requests[1:]
        for child in leader.forks:
            child.status = RequestStatus.WAITING_FOR_FORK
        self.add(leader)

    def add_running(self, req: Request, num_computed_tokens: int) -> bool:
        """A request whose first num_computed_tokens have KV computed elsewhere (prefill/decode
        disaggregation) joins as running, with blocks for them; False if the pool is short."""
        if not self.kv.allocate_slots(req, num_computed_tokens):
            return False
        req.num_computed_tokens = num_computed_tokens
        req.num_cached_tokens = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk_limit = self.config.prefill_chunk_limit

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.ends_ahead:  # its token in the step running now is its last (scheduling ahead)
                i += 1
                continue
            spec = len(req.spec_token_ids)
            needed = req.num_tokens + spec - req.num_computed_tokens
            n = min(needed, budget)
            if needed > spec + 1:  # still prefilling (or recomputing after preemption)
                n = min(n, self._chunk_limit(req, chunk_limit))
                spec = 0 if n < needed else spec
            elif n < needed:  # no room for all drafts: verify fewer of them
                spec = max(0, n - 1)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, self._with_lookahead(req, n)):
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
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
            s.request.num_computed_tokens_total += s.num_tokens
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, chunk_limit: int) -> None:
        # FastDeploy's max_num_partial_prefills: how many prompts may be mid-prefill at once.
        partial = sum(1 for r in self.running if r.num_computed_tokens < r.num_tokens - 1 and not r.output_token_ids)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seats = 1 + len(req.forks)  # n > 1 siblings join as soon as the prompt is computed
            if len(self.running) + seats > self.config.max_num_seqs:
                break
            hits = self.kv.lookup_prefix(req) if req.num_computed_tokens == 0 and not req.needs_prompt_logprobs \
                else []
            remaining = req.num_tokens - req.num_computed_tokens - len(hits) * self.kv.block_size
            n = min(remaining, budget, self._chunk_limit(req, chunk_limit))
            if n < remaining and (not self.config.enable_chunked_prefill
                                  or partial >= self.config.max_num_partial_prefills):
                break
            hit_tokens = len(hits) * self.kv.block_size
            if not self.kv.allocate_slots(req, self._with_lookahead(req, n, hit_tokens), hits):
                break
            req.num_computed_tokens += hit_tokens
            if req.num_cached_tokens < 0:  # the hit of its first scheduling is what the request reports
                req.num_cached_tokens = hit_tokens
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            partial += n < remaining

    def _chunk_limit(self, req: Request, chunk_limit: int) -> int:
        """A prompt computing its prompt logprobs takes at most PROMPT_LOGPROBS_CHUNK tokens a step (with chunked
        prefill on): each of its tokens costs a row of logits, vocabulary-wide."""
        if req.needs_prompt_logprobs and self.config.enable_chunked_prefill:
            return min(chunk_limit, PROMPT_LOGPROBS_CHUNK)
        return chunk_limit

    def _with_lookahead(self, req: Request, n: int, hit_tokens: int = 0) -> int:
        """Slots to cover for n new tokens (after hit_tokens of prefix hits): plus the lookahead that MTP
        drafting writes, within max_model_len."""
        if not self._lookahead:
            return n
        room = self.config.max_model_len - req.num_computed_tokens - hit_tokens
        return max(n, min(n + self._lookahead, room))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_token_probs = [], None
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    # ------------------------------------------------------------ scheduling ahead
    def expect(self, so: SchedulerOutput) -> None:
        """Advance the requests of `so`, the step running now, as if it had finished, so the next step can be
        scheduled before its tokens are known (LLMEngine's scheduling ahead). A request that samples in `so` gets a
        placeholder for its token at the end of all_token_ids (the runner fills that row's input from the step's
        output when the next step starts); one whose token is its last by length is left out of the next step.
        update_from_output(so, ...) undoes all of it before applying the real tokens."""
        end = self.config.max_model_len
        for s in so.scheduled:
            req = s.request
            if req.is_finished:
                continue
            samples = s.samples  # before num_computed_tokens moves
            req.ahead_computed = req.num_computed_tokens
            if samples:
                req.all_token_ids.append(PLACEHOLDER)
                req.num_computed_tokens = len(req.all_token_ids) - 1
                req.ends_ahead = len(req.all_token_ids) >= min(req.length_limit, end)
            else:
                req.num_computed_tokens += s.num_tokens

    @staticmethod
    def _settle(req: Request) -> None:
        """Undo expect() on a request (see there): its step's real tokens are about to be applied."""
        if req.all_token_ids[-1] == PLACEHOLDER:  # a real token is never negative
            req.all_token_ids.pop()
        if req.status is RequestStatus.RUNNING:  # a request preempted meanwhile keeps num_computed_tokens = 0
            req.num_computed_tokens = req.ahead_computed
        req.ahead_computed = None
        req.ends_ahead = False

    # ------------------------------------------------------------ after the forward pass
    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply one step's results; returns the requests that sampled (forked children included)."""
        updates = []
        errors, all_sampled, all_logprobs = out.errors, out.sampled, out.logprobs
        if out.prompt_logprobs:
            self._add_prompt_logprobs(so, out.prompt_logprobs)
        for s in so.scheduled:
            req = s.request
            if req.ahead_computed is not None:
                self._settle(req)
            if req.is_finished:  # ended while the step ran (async scheduling: a stop string, an abort)
                continue
            error = errors.get(req.request_id) if errors else None
            if error is not None:
                for r in [req, *req.forks]:
                    self.fail(r, error)
                updates.append(RequestUpdate(req, []))
                continue
            sampled = all_sampled.get(req.request_id)
            if req.status is RequestStatus.PREEMPTED:  # by the step scheduled ahead, while this one ran
                if sampled is not None:  # its token is kept: it is recomputed from prompt + output, as any other
                    updates.append(RequestUpdate(req, self.append_tokens(req, sampled, all_logprobs[req.request_id])))
                continue
            if sampled is None:  # a prefill chunk that does not reach the end of the prompt yet
                req.num_computed_tokens += s.num_tokens
                self.kv.cache_computed_blocks(req)
                continue
            accepted = 0
            if s.num_spec_tokens:
                drafts = req.spec_token_ids[: s.num_spec_tokens]
                while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
                    accepted += 1
                self.spec.num_drafts += 1
                self.spec.num_draft_tokens += len(drafts)
                self.spec.num_accepted_tokens += accepted
                sampled = sampled[: accepted + 1]
            if req.spec_token_ids:
                req.spec_token_ids, req.spec_token_probs = [], None
            forks = []
            if req.forks:
                forks, req.forks = (req.forks if not req.output_token_ids else []), []
            new = self.append_tokens(req, sampled, all_logprobs[req.request_id])
            # Every token but the newest has its KV now. Rejected drafts (and tokens cut off by a stop)
            # were written to the cache too; they are not part of the sequence, and later tokens overwrite them.
            req.num_computed_tokens = req.num_tokens - 1
            if not req.is_finished:
                self.kv.cache_computed_blocks(req)
            updates.append(RequestUpdate(req, new))
            for child in forks:
                child_error = out.errors.get(child.request_id)
                if child_error is not None:
                    self.fail(child, child_error)
                    updates.append(RequestUpdate(child, []))
                    continue
                self._start_fork(req, child)
                updates.append(RequestUpdate(child, self.append_tokens(child, out.sampled[child.request_id],
                                                                 out.logprobs[child.request_id])))
        return updates

    @staticmethod
    def _add_prompt_logprobs(so: SchedulerOutput, computed: dict[str, list[dict]]) -> None:
        """The prompt logprobs a step computed, appended in prompt order (the runner asks only for those not yet
        there, so a prompt recomputed after a preemption adds none twice)."""
        for s in so.scheduled:
            req = s.request
            new = computed.get(req.request_id)
            if new and req.prompt_logprobs is not None and not req.is_finished:
                req.prompt_logprobs.extend(new)

    def set_drafts(self, drafts: dict[Request, list[int]], probs: dict[Request, list] | None = None) -> None:
        """Speculative tokens to verify next step (from a proposer, for decoding requests); `probs`: the
        distribution each draft was sampled from, for requests whose drafts were sampled."""
        for req, tokens in drafts.items():
            req.spec_token_ids = list(tokens)
            req.spec_token_probs = probs.get(req) if probs else None

    def _start_fork(self, parent: Request, child: Request) -> None:
        if self.kv.fork(parent, child):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:  # no block for the partial copy: it recomputes the prompt like a preempted request
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)

    def append_tokens(self, req: Request, tokens: list[int], logprobs: list) -> list[int]:
        """Append sampled tokens under the token-level stop rules (eos, stop_token_ids, max_tokens,
        max_model_len) and the reasoning budget (engine/reasoning_budget.py); tokens after a stop are dropped. A
        guided request's grammar advances with each token, and a token it rejects fails the request. Returns the
        tokens kept."""
        p = req.sampling_params
        added: list[int] = []
        if tokens and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        outputs, everything = req.output_token_ids, req.all_token_ids  # Request.append_output, inlined (hot)
        stops, end = req.stop_ids, min(req.length_limit, self.config.max_model_len)
        budget = req.reasoning if req.reasoning is not None and req.reasoning.open else None
        for tok, lp in zip(tokens, logprobs):
            forced = False
            if budget is not None:  # reasoning_max_tokens: the reasoning's end in place of a token past it
                kept = budget.take(tok)
                if kept != tok:
                    tok, forced = kept, True
                    lp = None if lp is None else {kept: (0.0, 1)}
            outputs.append(tok)
            everything.append(tok)
            added.append(tok)
            if req.guided is not None and not req.guided.accept(tok):
                self.fail(req, f"guided decoding: token {tok} does not fit the grammar: {req.guided.error}")
                break
            if lp is not None:
                req.logprobs.append(lp)
            if tok in stops and len(outputs) >= p.min_tokens:  # eos (stop_reason None) before a stop token id
                eos = not p.ignore_eos and tok in req.eos_token_ids
                self.finish(req, RequestStatus.FINISHED_STOPPED, None if eos else tok)
                break
            if len(everything) >= end:  # max_tokens or max_model_len
                self.finish(req, RequestStatus.FINISHED_LENGTH)
                break
            if forced:  # later drafts were drawn after the replaced token
                break
        return added

    def fail(self, req: Request, error: str) -> None:
        """This request alone cannot go on: it ends with FINISHED_ERROR and the reason."""
        req.error = error
        self.finish(req, RequestStatus.FINISHED_ERROR)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is and free its blocks (a prefill-role request that completes keeps them, in
        `held`, for export until release_held). On a request that already finished (a stop string found in the
        text of its last tokens) only the reason changes, and a held request that then fails lets its blocks go."""
        already = req.is_finished
        req.status = status
        req.stop_reason = stop_reason
        keep = req.hold_kv and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if already:
            if not keep and self.held.pop(req.request_id, None) is not None:
                self.kv.free(req)
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if keep:
            self.held[req.request_id] = req
        else:
            self.kv.free(req)

    def release_held(self, req: Request) -> None:
        """Free the blocks of a finished hold_kv request once its KV has been exported."""
        self.held.pop(req.request_id, None)
        self.kv.free(req)
