"""The engine loop: add requests, step (schedule -> run -> postprocess), abort. Single-threaded;
engine/async_engine.py puts it behind a thread-safe front."""
from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path

import numpy as np

from .._env import use_all_cpu_threads
from ..config import EngineConfig
from ..model.config import ErnieModelConfig
from ..model.kv_cache import PagedKVCache
from ..model.loader import load_model
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..quantization.layers import weight_memory_report
from ..sampling_params import SamplingParams
from ..tokenizer import ErnieTokenizer
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVTransfer
from .model_runner import ModelRunner, ModelRunnerOutput
from .output_processor import TextState
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode import SpecStats, draft_limit, make_proposer

log = logging.getLogger(__name__)
DEFAULT_CPU_KV_BYTES = 1 << 30


class EngineCapacityError(RuntimeError):
    """The KV pool cannot take what was asked right now (e.g. a transferred sequence)."""


def resolve_model_dir(config: EngineConfig) -> Path:
    if config.model:
        return Path(config.model)
    from ..demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


def read_eos_token_ids(model_dir: Path, tokenizer: ErnieTokenizer | None, model_cfg: ErnieModelConfig) -> list[int]:
    """EOS ids from generation_config.json (int or list), the config and the tokenizer, deduplicated."""
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    for source in (json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None,
                   model_cfg.eos_token_id, tokenizer.eos_token_id if tokenizer else None):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.cpu_threads = use_all_cpu_threads()
        model_dir = resolve_model_dir(config)
        self.model_dir = model_dir
        self.tokenizer = None if config.skip_tokenizer_init else ErnieTokenizer.from_pretrained(config.tokenizer or model_dir)
        self.model_config = ErnieModelConfig.from_pretrained(model_dir)
        self.eos_token_ids = read_eos_token_ids(model_dir, self.tokenizer, self.model_config)
        self.model = load_model(model_dir, num_output_ids=len(self.tokenizer) if self.tokenizer else None,
                                show_progress=not config.disable_progress_bar, quantization=config.quantization)
        mem = weight_memory_report(self.model)
        log.info("model weights resident: %.1f MiB (%.1f MiB in quantized layers, %.1f MiB in fp32 would be "
                 "%.1f MiB)", mem["total_bytes"] / 2**20, mem["quantized_bytes"] / 2**20,
                 mem["quantized_fp32_bytes"] / 2**20, mem["fp32_model_bytes"] / 2**20)
        num_blocks, num_host_blocks = self._size_kv_pool()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, num_host_blocks, config.sampling_class)
        self.proposer = make_proposer(config.speculative_config)
        self.spec_stats = SpecStats()
        self.requests: dict[str, list[Request]] = {}  # external id -> its n sequences
        self.texts: dict[str, TextState] = {}
        self.held_kv: dict[str, Request] = {}  # finished prefill-role requests whose blocks await export
        self._seed_counter = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        log.info("engine ready: %s, %d KV blocks of %d tokens (%d on the CPU tier), max_num_seqs=%d, "
                 "max_num_batched_tokens=%d, prefix caching %s, %d CPU threads", model_dir, num_blocks,
                 config.block_size, num_host_blocks, config.max_num_seqs, config.max_num_batched_tokens,
                 "on" if config.enable_prefix_caching else "off", self.cpu_threads)

    # ---------------------------------------------------------------- sizing
    def _size_kv_pool(self) -> tuple[int, int]:
        c, m = self.config, self.model_config
        per_block = PagedKVCache.bytes_per_block(m.num_hidden_layers, c.block_size, m.num_key_value_heads, m.head_dim)
        if c.num_gpu_blocks_override:
            num = c.num_gpu_blocks_override
        else:
            num = int((c.kv_cache_memory or DEFAULT_CPU_KV_BYTES) // per_block)
        min_blocks = -(-c.max_model_len // c.block_size)
        if num < min_blocks:
            raise ValueError(f"KV pool of {num} blocks cannot hold one max_model_len={c.max_model_len} sequence "
                             f"({min_blocks} blocks of {c.block_size}); raise kv_cache_memory or lower max_model_len")
        host = int((c.swap_space or 0) * (1 << 30) // per_block)
        return num, host

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None, hold_kv: bool = False) -> None:
        """Validate and queue; raises ValueError (naming the field) for anything that cannot run."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise ValueError(f"prompt_token_ids must be in [0, {self.model_config.vocab_size}), "
                             f"got {min(ids)}..{max(ids)}")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {limit}: "
                             f"it must leave room for at least one generated token")
        if sampling_params.logprobs is not None and sampling_params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= {self.config.max_logprobs}, got {sampling_params.logprobs}")
        max_tokens = min(sampling_params.max_tokens or limit, limit - len(ids))
        if self.tokenizer is None and (sampling_params.stop or sampling_params.bad_words):
            raise ValueError("stop and bad_words need text: this engine runs with skip_tokenizer_init")
        bad_words = [self.tokenizer.encode(w) for w in sampling_params.bad_words]
        group = []
        for i in range(sampling_params.n):
            rid = request_id if sampling_params.n == 1 else f"{request_id}#{i}"
            seed = sampling_params.seed
            rng = np.random.default_rng([seed, i] if seed is not None else [self.config.seed, next(self._seed_counter), 1])
            req = Request(rid, list(ids), sampling_params, self.eos_token_ids, max_tokens,
                          parent_id=request_id if sampling_params.n > 1 else None, index=i, generator=rng,
                          bad_words_ids=[w for w in bad_words if w], hold_kv=hold_kv)
            self.texts[rid] = TextState(self.tokenizer, req)
            group.append(req)
        leader = group[0]
        leader.forks = group[1:]
        for child in leader.forks:
            child.status = RequestStatus.WAITING_FOR_FORK
        self.requests[request_id] = group
        self.scheduler.add(leader)
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool. Returns its final output."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        for req in group:
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._make_output(request_id, group, {r.request_id: ([], "") for r in group})

    # ---------------------------------------------------------------- prefill/decode disaggregation
    def export_kv(self, request_id: str) -> KVTransfer:
        """The computed KV of a finished hold_kv request; its blocks are released afterwards."""
        request = self.held_kv.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id!r} holds no KV (add it with hold_kv=True and let it finish)")
        n = self.kv.num_blocks_for(request.num_computed_tokens)
        data = self.runner.cache.read_blocks(request.block_ids[:n])
        transfer = KVTransfer(request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                              request.num_computed_tokens, self.config.block_size, data)
        self.kv.free(request)
        return transfer

    def add_prefilled_request(self, transfer: KVTransfer, sampling_params: SamplingParams) -> RequestOutput | None:
        """Continue a request whose prompt KV was computed elsewhere (decode role).

        Returns the final output right away when the transferred tokens already finish it (e.g. the
        first token was EOS); otherwise its outputs come from step() like any other request's."""
        if transfer.block_size != self.config.block_size:
            raise ValueError(f"KV transfer block_size {transfer.block_size} != this engine's {self.config.block_size}")
        if sampling_params.n != 1:
            raise ValueError("n must be 1 for a prefilled request")
        self.add_request(transfer.request_id, transfer.prompt_token_ids, sampling_params)
        req = self.requests[transfer.request_id][0]
        self.scheduler.waiting.remove(req)
        n = transfer.data.shape[2]
        if self.kv.num_free_blocks < n:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            del self.requests[transfer.request_id]
            raise EngineCapacityError(f"no room for {n} transferred KV blocks ({self.kv.num_free_blocks} free)")
        req.block_ids = self.kv.pool.allocate(n)
        self.runner.cache.write_blocks(req.block_ids, transfer.data)
        req.num_computed_tokens = transfer.num_computed_tokens
        req.num_cached_tokens = 0
        new = self._append_tokens(req, transfer.output_token_ids, [None] * len(transfer.output_token_ids),
                                  time.monotonic())
        if req.is_finished:
            return self._make_output(req.request_id, [req], {req.request_id: new})
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            if so.kv_ops:
                self.runner.apply_kv_ops(so.kv_ops)
            return []
        now = time.monotonic()
        for s in so.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
            s.request.num_computed_tokens_total += s.num_tokens
        result = self.runner.execute(so)
        self.num_steps += 1
        return self._postprocess(so, result)

    def _postprocess(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        changed: dict[str, dict[str, tuple[list[int], str]]] = {}
        now = time.monotonic()
        for s in so.scheduled:
            req = s.request
            sampled = result.sampled.get(req.request_id)
            if sampled is None:  # a prefill chunk that does not reach the end of the prompt yet
                req.num_computed_tokens += s.num_tokens
                self.kv.cache_computed_blocks(req)
                continue
            drafts = req.spec_token_ids[: s.num_spec_tokens]
            accepted = 0
            while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
                accepted += 1
            if drafts:
                self.spec_stats.num_drafts += 1
                self.spec_stats.num_draft_tokens += len(drafts)
                self.spec_stats.num_accepted_tokens += accepted
            req.num_computed_tokens += s.num_tokens - (len(drafts) - accepted)
            req.spec_token_ids = []
            self.kv.cache_computed_blocks(req)
            forks = req.forks if req.forks and not req.output_token_ids else []
            new = self._append_tokens(req, sampled[: accepted + 1], result.logprobs[req.request_id], now)
            changed.setdefault(req.external_id, {})[req.request_id] = new
            for child in forks:
                self._start_fork(req, child, result, now, changed)
            req.forks = []
        if self.proposer is not None:
            self._propose_drafts()
        outputs = []
        for ext_id, deltas in changed.items():
            group = self.requests[ext_id]
            outputs.append(self._make_output(ext_id, group, deltas))
        return outputs

    def _propose_drafts(self) -> None:
        """Drafts for every running request that is decoding (prompt fully computed)."""
        for req in self.scheduler.running:
            if req.num_computed_tokens == req.num_tokens - 1 and not req.spec_token_ids:
                req.spec_token_ids = self.proposer.propose(req.all_token_ids,
                                                           draft_limit(req, self.config.max_model_len))

    def _start_fork(self, parent: Request, child: Request, result: ModelRunnerOutput, now: float, changed) -> None:
        if self.kv.fork(parent, child):
            child.status = RequestStatus.RUNNING
            self.scheduler.running.append(child)
        else:  # no block for the partial copy: it recomputes the prompt like a preempted request
            child.status = RequestStatus.WAITING
            self.scheduler.waiting.appendleft(child)
        new = self._append_tokens(child, result.sampled[child.request_id], result.logprobs[child.request_id], now)
        changed.setdefault(child.external_id, {})[child.request_id] = new
        if child.is_finished:
            self.scheduler.finish(child, child.status)

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list, now: float) -> tuple[list[int], str]:
        """Append sampled tokens, applying every stop rule; returns (new ids, new text)."""
        p = req.sampling_params
        added = []
        if req.first_token_time is None:
            req.first_token_time = now
        for tok, lp in zip(tokens, logprobs):
            req.output_token_ids.append(tok)
            added.append(tok)
            if lp is not None:
                req.logprobs.append(lp)
            n = req.num_output_tokens
            if n >= p.min_tokens:
                if not p.ignore_eos and tok in req.eos_token_ids:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
                    break
                if tok in p.stop_token_ids:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                    break
            if n >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
                req.status = RequestStatus.FINISHED_LENGTH
                break
        self.num_generation_tokens += len(added)
        text, stop = self.texts[req.request_id].append(added, final=req.is_finished,
                                                       check_stops=req.num_output_tokens >= p.min_tokens)
        if stop is not None:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if req.is_finished:
            self.scheduler.finish(req, req.status)
            if req.hold_kv:
                self.held_kv[req.request_id] = req
        return added, text

    def _make_output(self, ext_id: str, group: list[Request], deltas: dict) -> RequestOutput:
        comps = []
        for req in group:
            state = self.texts[req.request_id]
            new_ids, new_text = deltas.get(req.request_id, ([], ""))
            comps.append(CompletionOutput(
                index=req.index, text=state.text, token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                logprobs=[{t: Logprob(v, r) for t, (v, r) in d.items()} for d in req.logprobs]
                if req.sampling_params.logprobs is not None else None,
                cumulative_logprob=_cumulative(req) if req.sampling_params.logprobs is not None else None,
                text_delta=new_text, token_ids_delta=list(new_ids)))
        finished = all(r.is_finished for r in group)
        leader = group[0]
        metrics = RequestMetrics(leader.arrival_time, leader.first_scheduled_time, leader.first_token_time,
                                 time.monotonic() if finished else None, sum(r.num_preemptions for r in group))
        out = RequestOutput(ext_id, None, leader.prompt_token_ids, comps, finished,
                            max(leader.num_cached_tokens, 0), metrics)
        if finished:
            del self.requests[ext_id]
            for r in group:
                self.texts.pop(r.request_id, None)
        return out

    # ---------------------------------------------------------------- introspection
    def stats(self) -> dict:
        s = self.kv.stats
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions, "num_free_blocks": self.kv.num_free_blocks,
            "num_total_blocks": self.kv.pool.num_blocks, "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_query_tokens": s.query_tokens,
            "prefix_cache_hit_tokens": s.hit_tokens, "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_device_hit_tokens": s.device_hit_tokens, "prefix_cache_host_hit_tokens": s.host_hit_tokens,
            "num_steps": self.num_steps, "prompt_tokens": self.num_prompt_tokens,
            "spec_draft_tokens": self.spec_stats.num_draft_tokens,
            "spec_accepted_tokens": self.spec_stats.num_accepted_tokens,
            "spec_acceptance_rate": self.spec_stats.acceptance_rate,
            "generation_tokens": self.num_generation_tokens,
        }


def _cumulative(req: Request) -> float:
    total = 0.0
    for tok, d in zip(req.output_token_ids, req.logprobs):
        if tok in d:
            total += d[tok][0]
    return total
