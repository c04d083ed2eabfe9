"""Turns a SchedulerOutput into tensors, runs the model, samples; owns the KV data (device + CPU tier)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from ..model.attention import AttentionMetadata
from ..model.ernie import ErnieForCausalLM
from ..model.kv_cache import PagedKVCache
from .kv_cache_manager import KVOp
from .request import Request
from .guided import GrammarRows
from .sampler import Sampler, SamplingBatch
from .scheduler import SchedulerOutput, ScheduledRequest

MAX_BATCHED_QUERY = 8  # sequences computing at most this many tokens share the batched attention path


@dataclass
class ModelRunnerOutput:
    # Per request id: the sampled token for each sampling position (1, or 1 + drafts when verifying).
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests that failed alone this step, and why


class ModelRunner:
    def __init__(self, model: ErnieForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 sampling_method: str = "base"):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                  quant=getattr(model, "kv_cache_quant", None))
        shape = (num_host_blocks, cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.host_cache = np.zeros(shape, np.float32) if num_host_blocks else None
        self.sampler = Sampler(sampling_method)

    def apply_kv_ops(self, ops: list[KVOp]) -> None:
        """Swaps and copies, in the order the block pool recorded them."""
        for op in ops:
            if op.kind == "swap_out":
                self.host_cache[op.dst] = self.cache.read_blocks([op.src])[:, :, 0]
            elif op.kind == "swap_in":
                self.cache.write_blocks([op.dst], self.host_cache[op.src][:, :, None])
            else:
                self.cache.write_blocks([op.dst], self.cache.read_blocks([op.src]))

    @paddle.no_grad()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.apply_kv_ops(so.kv_ops)
        order = sorted(so.scheduled, key=lambda s: s.num_tokens > MAX_BATCHED_QUERY)
        ids, positions, slots, q_lens, ctx_lens, tables = [], [], [], [], [], []
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
        pos = np.concatenate(positions)
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, bs, np.concatenate(slots), int(pos.max()),
                                       MAX_BATCHED_QUERY)
        hidden = self.model(paddle.to_tensor(np.asarray(ids, dtype=np.int64)), paddle.to_tensor(pos), meta, self.cache)

        rows, batch, owners = [], _BatchBuilder(), []
        offset = 0
        for s in order:
            if s.samples:
                first = offset + s.num_tokens - s.num_spec_tokens - 1
                batch.add_grammar(s.request, len(rows), s.request.spec_token_ids[: s.num_spec_tokens])
                for j in range(s.num_spec_tokens + 1):
                    rows.append(first + j)
                    batch.add(s.request, s.request.spec_token_ids[:j])
                    owners.append(s.request.request_id)
                for child in _forking_children(s):
                    batch.add_grammar(child, len(rows), [])
                    rows.append(first)
                    batch.add(child, [])
                    owners.append(child.request_id)
            offset += s.num_tokens
        out = ModelRunnerOutput()
        if not rows:
            return out
        picked = paddle.index_select(hidden, paddle.to_tensor(np.asarray(rows, dtype=np.int64)))
        logits = self.model.compute_logits(picked)
        result = self.sampler(logits, batch.build())
        for rid, tok, lp in zip(owners, result.token_ids.tolist(), result.logprobs):
            out.sampled.setdefault(rid, []).append(int(tok))
            out.logprobs.setdefault(rid, []).append(lp)
        for row, why in result.errors.items():
            out.errors.setdefault(owners[row], why)
        return out


def _forking_children(s: ScheduledRequest) -> list[Request]:
    r = s.request
    if not r.forks or r.num_computed_tokens + s.num_tokens != r.num_prompt_tokens or r.output_token_ids:
        return []
    return r.forks


class _BatchBuilder:
    def __init__(self):
        self.params, self.gens, self.prompts, self.outputs, self.bad, self.eos = [], [], [], [], [], []
        self.grammars: list[GrammarRows] = []

    def add(self, req: Request, drafts: list[int]) -> None:
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
                             grammars=self.grammars)
