"""The driver half of the model runner: turns a SchedulerOutput into a StepInput, has the model run it,
samples. It is the only part that reads Requests; the executor runs the StepInput on the model (a
ModelShard in this process, or every tensor-parallel rank at once, tensor_parallel/workers.py) and hands back the
sampled rows' logits, so sampling, penalties and guided decoding never depend on how the model is split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..step_contract import MAX_BATCHED_QUERY, KVOp, StepExecutor, StepInput
from .guided import GrammarRows
from .input_batch import InputBatch
from .request import Request
from .sampler import ArgmaxRows, Sampler, SamplingBatch, prompt_logprobs, split_logits
from .spec_decode import Drafts, StepRow
from .step_plan import PLACEHOLDER, ModelRunnerOutput, ScheduledRequest, SchedulerOutput


@dataclass
class PromptRows:
    """The rows a step computes logits for after its sampled ones, for prompt logprobs: each predicts the prompt
    token in `targets`; `owners` says whose they are, in order: (request id, how many rows)."""
    targets: list[int]
    owners: list[tuple[str, int]]
    counts: list[int]  # each row's top count

    def add(self, req: Request, start: int, num_tokens: int, first_row: int, rows: list[int]) -> None:
        """The positions of a prefill chunk [start, start + num_tokens) whose next token is a prompt token still
        without its logprobs (a prompt recomputed after a preemption asks for none twice)."""
        lo = max(start, len(req.prompt_logprobs))
        hi = min(start + num_tokens, req.num_prompt_tokens - 1)
        if lo > len(req.prompt_logprobs):  # positions skipped (the prefix cache is not read for such a request)
            raise RuntimeError(f"request {req.request_id}: prompt logprobs {len(req.prompt_logprobs)}.. were skipped "
                               f"(this chunk starts at {start})")
        if hi <= lo:
            return
        k = req.sampling_params.prompt_logprobs
        rows.extend(range(first_row + lo - start, first_row + hi - start))
        self.targets.extend(req.prompt_token_ids[lo + 1 : hi + 1])
        self.owners.append((req.request_id, hi - lo))
        self.counts.extend([k] * (hi - lo))

    def logprobs(self, logits) -> dict[str, list[dict]]:
        """ModelRunnerOutput.prompt_logprobs from these rows' logits."""
        entries = prompt_logprobs(logits, np.asarray(self.targets, dtype=np.int64), self.counts)
        out, at = {}, 0
        for rid, n in self.owners:
            out[rid] = entries[at : at + n]
            at += n
        return out


@dataclass
class PreparedStep:
    """A step ready to run: its StepInput, the sampled rows' SamplingBatch (ArgmaxRows when each takes its argmax
    alone; None: nothing samples) and the request id owning each sampled row, the rows after those that are for
    prompt logprobs (None: none), and for the MTP drafter where each request's tokens sit in it."""
    step: StepInput
    batch: SamplingBatch | ArgmaxRows | None
    owners: list[str]
    draft_rows: list[StepRow] | None
    prompt: PromptRows | None = None
    # rows whose input is the token the step before samples (scheduled ahead): (row, request id)
    ahead: list[tuple[int, str]] = field(default_factory=list)


def fill_placeholders(prepared: PreparedStep, previous: ModelRunnerOutput | None) -> None:
    """Put the tokens the step before sampled into the rows that were scheduled before it ended. A request that
    failed in that step has no token: its row runs on token 0 and its output is dropped (it has finished)."""
    if previous is None:
        raise RuntimeError("a step scheduled ahead ran without the output of the step before it")
    sampled, ids = previous.sampled, prepared.step.token_ids
    for row, rid in prepared.ahead:
        tokens = sampled.get(rid)
        ids[row] = tokens[-1] if tokens else 0


_NO_DRAFTS: list[int] = []
_NO_LOGPROB = (None,)  # the logprobs of a one-token row that asked for none (read only)


class ModelRunner:
    def __init__(self, executor: StepExecutor, block_size: int, sampling_method: str = "base",
                 num_speculative_tokens: int = 0, max_model_len: int = 0):
        """An executor with an MTP head (its `draft_head`) drafts num_speculative_tokens per step."""
        self.executor = executor
        self.block_size = block_size
        self.sampler = Sampler(sampling_method)
        self.drafter = None
        head = getattr(executor, "draft_head", None)
        if head is not None:
            from .mtp_drafter import MTPDrafter

            self.drafter = MTPDrafter(head, num_speculative_tokens, max_model_len, MAX_BATCHED_QUERY)
        self._last_step: tuple[Any, list[StepRow]] | None = None  # for the drafter
        self.input_batch = InputBatch(block_size, -(-max_model_len // block_size) if max_model_len else 64)

    @property
    def cache(self) -> Any:
        return self.executor.cache

    def apply_kv_ops(self, ops: list[KVOp]) -> None:
        """Swaps and copies with no forward (a step that scheduled nothing but still moved blocks)."""
        self.executor.execute(StepInput(kv_ops=ops))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.run(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        """Everything the step reads from its Requests, taken now: run() may then go on in another thread while
        the engine updates those Requests (async scheduling)."""
        order = sorted(so.scheduled, key=lambda s: s.num_tokens > MAX_BATCHED_QUERY)
        ids: list[int] = []
        starts, q_lens, keys, tables = [], [], [], []
        rows, batch, owners = [], _BatchBuilder(), []
        prompt, prompt_rows = None, []
        ahead: list[tuple[int, str]] = []
        offset = 0
        # One pass over the step's requests, with a plain decode (one token, no drafts, nothing guided or forking)
        # taking the fewest operations: at hundreds of running requests this loop is the runner's host cost.
        for s in order:
            r, n, spec = s.request, s.num_tokens, s.num_spec_tokens
            start = r.num_computed_tokens
            starts.append(start)
            q_lens.append(n)
            keys.append(r.row_key)
            tables.append(r.block_ids)
            if n == 1 and not spec:
                tok = r.all_token_ids[start]
                if tok == PLACEHOLDER:  # sampled by the step running now (scheduled ahead): filled in by run()
                    ahead.append((len(ids), r.request_id))
                ids.append(tok)
                if r.guided is None and not r.forks and s.samples:
                    rows.append(offset)
                    batch.rows.append((r, _NO_DRAFTS, None))
                    batch.argmax_only = batch.argmax_only and r.takes_argmax
                    owners.append(r.request_id)
                    offset += 1
                    continue
            else:
                ids.extend(r.all_token_ids[start : start + n - spec])
                ids.extend(r.spec_token_ids[:spec])
            if r.prompt_logprobs is not None and r.needs_prompt_logprobs:  # a prefill chunk, one token long or more
                prompt = prompt or PromptRows([], [], [])
                prompt.add(r, start, n - spec, offset, prompt_rows)
            if s.samples:
                first = offset + n - spec - 1
                if spec:
                    drafts = r.spec_token_ids[:spec]
                    batch.add_grammar(r, len(rows), drafts)
                    for j in range(spec + 1):
                        rows.append(first + j)
                        batch.add(r, drafts[:j], verifies=j if j < len(drafts) else None)
                        owners.append(r.request_id)
                else:
                    batch.add_grammar(r, len(rows), [])
                    rows.append(first)
                    batch.add(r)
                    owners.append(r.request_id)
                for child in _forking_children(s):
                    batch.add_grammar(child, len(rows), [])
                    rows.append(first)
                    batch.add(child)
                    owners.append(child.request_id)
            offset += n
        rows_in_batch = self.input_batch.rows_for(keys, tables)
        meta, pos = self.input_batch.attention_metadata(rows_in_batch, np.array(starts, dtype=np.int64),
                                                        np.array(q_lens, dtype=np.int64), MAX_BATCHED_QUERY)
        sampling = batch.build() if rows else None
        step = StepInput.for_tokens(np.asarray(ids, dtype=np.int64), pos, meta,
                                    np.asarray(rows + prompt_rows, dtype=np.int64), so.kv_ops,
                                    np.asarray(keys, dtype=np.int64),
                                    type(sampling) is ArgmaxRows and not prompt_rows)
        return PreparedStep(step, sampling, owners,
                            _step_rows(order, meta) if self.drafter is not None else None,
                            prompt if prompt_rows else None, ahead)

    def run(self, prepared: PreparedStep, previous: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        """The forward and the sampling of a prepared step; reads no Request. A step scheduled ahead gets the
        output of the step before it (`previous`), whose tokens are its placeholder rows' inputs."""
        if prepared.ahead:
            fill_placeholders(prepared, previous)
        hidden, logits = self.executor.execute(prepared.step)
        self._last_step = (hidden, prepared.draft_rows) if self.drafter is not None else None
        out = ModelRunnerOutput()
        if prepared.prompt is not None:
            logits, prompt_logits = split_logits(logits, len(prepared.owners), len(prepared.prompt.targets))
            out.prompt_logprobs = prepared.prompt.logprobs(prompt_logits)
        if prepared.batch is None:
            return out
        result = self.sampler(logits, prepared.batch)
        owners, sampled, logprobs = prepared.owners, out.sampled, out.logprobs
        if type(prepared.batch) is ArgmaxRows:  # one row a request, no logprobs
            out.sampled = {rid: [tok] for rid, tok in zip(owners, result.token_ids.tolist())}
            out.logprobs = dict.fromkeys(owners, _NO_LOGPROB)
            for row, why in result.errors.items():
                out.errors.setdefault(owners[row], why)
            return out
        for rid, tok, lp in zip(owners, result.token_ids.tolist(), result.logprobs):
            if rid in sampled:  # a request verifying drafts samples several rows
                sampled[rid].append(tok)
                logprobs[rid].append(lp)
            else:
                sampled[rid] = [tok]
                logprobs[rid] = [lp]
        for row, why in result.errors.items():
            out.errors.setdefault(owners[row], why)
        return out

    def propose_drafts(self) -> Drafts:
        """MTP drafts from the last step's hidden states; call after its tokens are appended."""
        if self._last_step is None:
            return Drafts({}, {})
        hidden, rows = self._last_step
        self._last_step = None
        return self.drafter.propose(hidden, rows)


def _step_rows(order: list[ScheduledRequest], meta) -> list[StepRow]:
    """Where each request's tokens sit in the step, for the MTP drafter."""
    return [StepRow(s.request, s.request.num_computed_tokens, s.num_tokens, int(offset))
            for s, offset in zip(order, meta.query_start_loc[:-1])]


def _forking_children(s: ScheduledRequest) -> list[Request]:
    r = s.request
    if not r.forks or r.num_computed_tokens + s.num_tokens != r.num_prompt_tokens or r.output_token_ids:
        return []
    return r.forks


class _BatchBuilder:
    """The sampled rows, as (request, drafts before the row, index of the draft it verifies); the SamplingBatch's
    per-row lists are made from them at once in build()."""

    def __init__(self):
        self.rows: list[tuple[Request, list[int], int | None]] = []
        self.grammars: list[GrammarRows] = []
        self.argmax_only = True  # every row so far is its request's only row and takes its argmax (ArgmaxRows)

    def add(self, req: Request, drafts: list[int] = _NO_DRAFTS, verifies: int | None = None) -> None:
        """A row sampling after `drafts` (the request's drafts before it). `verifies`: the index of the draft
        this row checks; with the distribution the draft was sampled from, the sampler applies the
        speculative-sampling rule to it."""
        self.rows.append((req, drafts, verifies))
        # a row verifying drafts shares its request with others: the full pipeline
        self.argmax_only = self.argmax_only and req.takes_argmax and verifies is None and not drafts

    def add_grammar(self, req: Request, first_row: int, drafts: list[int]) -> None:
        """A guided request's rows start at first_row (one more per draft)."""
        if req.guided is not None:
            self.grammars.append(GrammarRows(req.guided, first_row, drafts))

    def build(self) -> SamplingBatch | ArgmaxRows:
        if self.argmax_only:
            return ArgmaxRows(len(self.rows))
        reqs = [r for r, _, _ in self.rows]
        draft_probs = [r.spec_token_probs[v] if v is not None and r.spec_token_probs else None
                       for r, _, v in self.rows] if any(v is not None for _, _, v in self.rows) else None
        sampled_drafts = draft_probs is not None and any(q is not None for q in draft_probs)
        return SamplingBatch(
            params=[r.sampling_params for r in reqs], generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids + d if d else r.output_token_ids for r, d, _ in self.rows],
            eos_token_ids=[r.eos_token_ids for r in reqs], bad_words_ids=[r.bad_words_ids for r in reqs],
            grammars=self.grammars,
            draft_tokens=[r.spec_token_ids[v] if q is not None else None
                          for (r, _, v), q in zip(self.rows, draft_probs)] if sampled_drafts else None,
            draft_probs=draft_probs if sampled_drafts else None)
