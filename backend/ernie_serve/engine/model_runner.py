"""The driver half of the model runner: turns a SchedulerOutput into a StepInput, has the model run it,
samples. It is the only part that reads Requests; the executor runs the StepInput on the model (a
ModelShard in this process, or every tensor-parallel rank at once, engine/workers.py) and hands back the
sampled rows' logits, so sampling, penalties and guided decoding never depend on how the model is split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..model.attention_metadata import AttentionMetadata
from .guided import GrammarRows
from .kv_cache_manager import KVOp
from .request import Request
from .sampler import Sampler, SamplingBatch
from .scheduler import ScheduledRequest, SchedulerOutput
from .spec_decode import Drafts, StepRow
from .step_input import MAX_BATCHED_QUERY, StepInput


@dataclass
class ModelRunnerOutput:
    # Per request id: the sampled token for each sampling position (1, or 1 + drafts when verifying).
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests that failed alone this step, and why


class StepExecutor(Protocol):
    """Runs a StepInput on the whole model: engine/model_shard.ModelShard (the reference backend, one rank),
    engine/workers.TensorParallelExecutor (every rank) or kernels_backend/shard.KernelShard (the kernels
    backend). `cache` is this process's KV cache (num_blocks, read_blocks / write_blocks for whole blocks).
    execute returns (the step's final hidden states, the sampled rows' logits as a Paddle tensor or NumPy).
    `draft_head` (engine/mtp_drafter.DraftHead) is its MTP head, or None."""

    cache: Any
    draft_head: Any

    def execute(self, step: StepInput) -> tuple[Any, Any]: ...


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

    @property
    def cache(self) -> Any:
        return self.executor.cache

    def apply_kv_ops(self, ops: list[KVOp]) -> None:
        """Swaps and copies with no forward (a step that scheduled nothing but still moved blocks)."""
        self.executor.execute(StepInput(kv_ops=ops))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        order = sorted(so.scheduled, key=lambda s: s.num_tokens > MAX_BATCHED_QUERY)
        ids, positions, slots, q_lens, ctx_lens, tables, keys = [], [], [], [], [], [], []
        bs = self.block_size
        for s in order:
            r = s.request
            start, n = r.num_computed_tokens, s.num_tokens
            ids.extend(r.all_token_ids[start : start + n - s.num_spec_tokens])
            ids.extend(r.spec_token_ids[: s.num_spec_tokens])
            pos = np.arange(start, start + n)
            positions.append(pos)
            table = np.asarray(r.block_ids, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            q_lens.append(n)
            ctx_lens.append(start + n)
            tables.append(r.block_ids)
            keys.append(r.row_key)
        pos = np.concatenate(positions)
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, bs, np.concatenate(slots), int(pos.max()),
                                       MAX_BATCHED_QUERY)

        rows, batch, owners, step_rows = [], _BatchBuilder(), [], []
        offset = 0
        for s in order:
            step_rows.append(StepRow(s.request, s.request.num_computed_tokens, s.num_tokens, offset))
            if s.samples:
                first = offset + s.num_tokens - s.num_spec_tokens - 1
                drafts = s.request.spec_token_ids[: s.num_spec_tokens]
                batch.add_grammar(s.request, len(rows), drafts)
                for j in range(s.num_spec_tokens + 1):
                    rows.append(first + j)
                    batch.add(s.request, drafts[:j], verifies=j if j < len(drafts) else None)
                    owners.append(s.request.request_id)
                for child in _forking_children(s):
                    batch.add_grammar(child, len(rows), [])
                    rows.append(first)
                    batch.add(child, [])
                    owners.append(child.request_id)
            offset += s.num_tokens
        step = StepInput.for_tokens(np.asarray(ids, dtype=np.int64), pos, meta, np.asarray(rows, dtype=np.int64),
                                    so.kv_ops, np.asarray(keys, dtype=np.int64))
        hidden, logits = self.executor.execute(step)
        self._last_step = (hidden, step_rows) if self.drafter is not None else None
        out = ModelRunnerOutput()
        if not rows:
            return out
        result = self.sampler(logits, batch.build())
        for rid, tok, lp in zip(owners, result.token_ids.tolist(), result.logprobs):
            out.sampled.setdefault(rid, []).append(int(tok))
            out.logprobs.setdefault(rid, []).append(lp)
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


def _forking_children(s: ScheduledRequest) -> list[Request]:
    r = s.request
    if not r.forks or r.num_computed_tokens + s.num_tokens != r.num_prompt_tokens or r.output_token_ids:
        return []
    return r.forks


class _BatchBuilder:
    def __init__(self):
        self.params, self.gens, self.prompts, self.outputs, self.bad, self.eos = [], [], [], [], [], []
        self.grammars: list[GrammarRows] = []
        self.draft_tokens: list[int | None] = []
        self.draft_probs: list[np.ndarray | None] = []

    def add(self, req: Request, drafts: list[int], verifies: int | None = None) -> None:
        """A row sampling after `drafts` (the request's drafts before it). `verifies`: the index of the draft
        this row checks; with the distribution the draft was sampled from, the sampler applies the
        speculative-sampling rule to it."""
        q = req.spec_token_probs[verifies] if verifies is not None and req.spec_token_probs else None
        self.draft_tokens.append(req.spec_token_ids[verifies] if q is not None else None)
        self.draft_probs.append(q)
        self.params.append(req.sampling_params)
        self.gens.append(req.generator)
        self.prompts.append(req.prompt_token_ids)
        self.outputs.append(req.output_token_ids + drafts if drafts else req.output_token_ids)
        self.bad.append(req.bad_words_ids)
        self.eos.append(req.eos_token_ids)

    def add_grammar(self, req: Request, first_row: int, drafts: list[int]) -> None:
        """A guided request's rows start at first_row (one more per draft)."""
        if req.guided is not None:
            self.grammars.append(GrammarRows(req.guided, first_row, drafts))

    def build(self) -> SamplingBatch:
        return SamplingBatch(params=self.params, generators=self.gens, prompt_token_ids=self.prompts,
                             output_token_ids=self.outputs, eos_token_ids=self.eos, bad_words_ids=self.bad,
                             grammars=self.grammars,
                             draft_tokens=self.draft_tokens if any(q is not None for q in self.draft_probs) else None,
                             draft_probs=self.draft_probs if any(q is not None for q in self.draft_probs) else None)
