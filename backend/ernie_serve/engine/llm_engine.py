"""The engine loop: add requests, step (schedule -> run -> postprocess), abort. Single-threaded;
engine/async_engine.py puts it behind a thread-safe front."""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..config import EngineConfig
from ..model.config import ErnieModelConfig
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from ..sampling_params import SamplingParams
from ..tokenizer import ErnieTokenizer
from .executor_factory import load_executor
from .guided import GrammarCompiler
from .input_processor import InputProcessor, RequestGroup
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVTransfer
from .model_runner import ModelRunner
from .output_processor import TextState
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .spec_decode import draft_limit, make_proposer
from .step_plan import ModelRunnerOutput, RequestUpdate, SchedulerOutput

log = logging.getLogger(__name__)
_NO_DELTA: tuple[list[int], str] = ([], "")


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
        model_dir = resolve_model_dir(config)
        self.model_dir = model_dir
        self.tokenizer = None if config.skip_tokenizer_init else ErnieTokenizer.from_pretrained(config.tokenizer or model_dir)
        self.model_config = ErnieModelConfig.from_pretrained(model_dir)
        self.eos_token_ids = read_eos_token_ids(model_dir, self.tokenizer, self.model_config)
        spec = config.speculative_config or {}
        loaded = load_executor(config, model_dir, self.model_config, len(self.tokenizer) if self.tokenizer else None)
        executor, num_host_blocks, self.cpu_threads = loaded.executor, loaded.num_host_blocks, loaded.cpu_threads
        self.model = executor.model
        num_blocks = executor.cache.num_blocks
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(executor, config.block_size, config.sampling_class,
                                  num_speculative_tokens=spec.get("num_speculative_tokens", 1),
                                  max_model_len=config.max_model_len)
        self.proposer = make_proposer(config.speculative_config)
        self.num_output_ids = len(self.tokenizer) if self.tokenizer else self.model_config.vocab_size
        # guided decoding: grammars compiled on the callers' threads, cached per grammar
        self.grammars = GrammarCompiler(self.tokenizer, self.num_output_ids, self.eos_token_ids) \
            if self.tokenizer is not None and self.eos_token_ids else None
        self.inputs = InputProcessor(config, self.model_config.vocab_size, self.num_output_ids, self.tokenizer,
                                     self.eos_token_ids, self.grammars)
        self.requests: dict[str, list[Request]] = {}  # external id -> its n sequences
        self.texts: dict[str, TextState] = {}
        self.held_kv: dict[str, Request] = {}  # finished prefill-role requests whose blocks await export
        # async_scheduling: one thread runs each step's forward and sampling, the step in flight is _inflight
        self._forward: ThreadPoolExecutor | None = None
        self._inflight: tuple[SchedulerOutput, Future] | None = None
        if config.async_scheduling:
            self._forward = ThreadPoolExecutor(1, thread_name_prefix="ernie-forward",
                                               initializer=self._setup_forward_thread)
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        from .._env import freeze_startup_objects

        freeze_startup_objects()
        log.info("engine ready: %s, %d KV blocks of %d tokens (%d on the CPU tier), max_num_seqs=%d, "
                 "max_num_batched_tokens=%d, prefix caching %s, %d CPU threads", model_dir, num_blocks,
                 config.block_size, num_host_blocks, config.max_num_seqs, config.max_num_batched_tokens,
                 "on" if config.enable_prefix_caching else "off", self.cpu_threads)

    def _setup_forward_thread(self) -> None:
        """The forward thread's CPU kernels take the engine's thread count (OpenMP's setting is per thread)."""
        if self.cpu_threads:
            from .._env import setup_model_process

            setup_model_process(self.cpu_threads)

    def close(self) -> None:
        """Stop the forward thread and the worker ranks, if any (they also die with this process), and give the
        objects frozen at start-up back to the garbage collector."""
        if self._forward is not None:
            self.wait_for_step()
            self._forward.shutdown(wait=True)
        shutdown = getattr(self.runner.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
        from .._env import unfreeze_startup_objects

        unfreeze_startup_objects()

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None, hold_kv: bool = False) -> None:
        """Validate and queue; raises ValueError (naming the field) for anything that cannot run."""
        self.add_request_group(self.make_request_group(request_id, prompt_token_ids, sampling_params, hold_kv))

    def make_request_group(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                           hold_kv: bool = False) -> RequestGroup:
        """Validate a request against this engine and build its sequences (InputProcessor); touches no engine
        state, so a server front calls it on its own thread."""
        return self.inputs.make_group(request_id, prompt_token_ids, sampling_params, hold_kv)

    def add_request_group(self, group: RequestGroup) -> None:
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.requests[group.request_id] = group.requests
        for req, text in zip(group.requests, group.texts):
            self.texts[req.request_id] = text
        self.scheduler.add_group(group.requests)
        self.num_prompt_tokens += group.requests[0].num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool. Returns its final output."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        deltas = {}
        for req in group:
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            deltas[req.request_id] = ([], self.texts[req.request_id].finish_deferred(req))
        return self._make_output(request_id, group, deltas)

    # ---------------------------------------------------------------- prefill/decode disaggregation
    def export_kv(self, request_id: str) -> KVTransfer:
        """The computed KV of a finished hold_kv request; its blocks are released afterwards."""
        request = self.held_kv.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id!r} holds no KV (add it with hold_kv=True and let it finish)")
        self.wait_for_step()  # the cache is read below
        n = self.kv.num_blocks_for(request.num_computed_tokens)
        blocks = self.runner.cache.export_blocks(request.block_ids[:n])
        transfer = KVTransfer(request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                              request.num_computed_tokens, self.config.block_size, blocks)
        self.scheduler.release_held(request)
        return transfer

    def add_prefilled_request(self, transfer: KVTransfer, sampling_params: SamplingParams) -> RequestOutput | None:
        """Continue a request whose prompt KV was computed elsewhere (decode role).

        Returns the final output right away when the transferred tokens already finish it (e.g. the
        first token was EOS); otherwise its outputs come from step() like any other request's."""
        if transfer.block_size != self.config.block_size:
            raise ValueError(f"KV transfer block_size {transfer.block_size} != this engine's {self.config.block_size}")
        cache = self.runner.cache
        want = (cache.num_layers, 2, self.kv.num_blocks_for(transfer.num_computed_tokens), transfer.block_size,
                cache.num_kv_heads, cache.head_dim)
        if transfer.blocks.shape != want:
            raise ValueError(f"KV transfer of shape {list(transfer.blocks.shape)} does not fit this engine's cache "
                             f"(expected {list(want)}): the prefill and decode servers must serve the same model "
                             f"and speculative_config")
        if sampling_params.n != 1:
            raise ValueError("n must be 1 for a prefilled request")
        group = self.make_request_group(transfer.request_id, transfer.prompt_token_ids, sampling_params)
        if transfer.request_id in self.requests:
            raise ValueError(f"request_id {transfer.request_id!r} is already in use")
        self.wait_for_step()  # blocks are handed out below: none may still be written by a step in flight
        (req,) = group.requests
        if not self.scheduler.add_running(req, transfer.num_computed_tokens):
            raise EngineCapacityError(f"no room for {transfer.blocks.shape[2]} transferred KV blocks "
                                      f"({self.kv.num_free_blocks} free)")
        self.requests[transfer.request_id] = group.requests
        self.texts[transfer.request_id] = group.texts[0]
        self.num_prompt_tokens += req.num_prompt_tokens
        self.runner.cache.import_blocks(req.block_ids, transfer.blocks)
        tokens = transfer.output_token_ids
        new = self.scheduler.append_tokens(req, tokens, [None] * len(tokens))
        out = self._outputs([RequestUpdate(req, new)])
        return out[0] if req.is_finished else None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update -> outputs. With async_scheduling the next step is scheduled and started
        before this one's outputs are made, so output processing (and whatever the caller does with the outputs)
        overlaps the next forward; see _step_async."""
        if self._forward is not None:
            return self._step_async()
        so = self._schedule()
        if so is None:
            return []
        updates = self._update(so, self.runner.execute(so))
        return self._outputs(updates)

    def _schedule(self) -> SchedulerOutput | None:
        """The next step's plan (None when nothing runs; its KV swaps and copies are applied then)."""
        so = self.scheduler.schedule()
        if so.is_empty:
            if so.kv_ops:
                self.runner.apply_kv_ops(so.kv_ops)
            return None
        return so

    def _update(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        self.num_steps += 1
        updates = self.scheduler.update_from_output(so, result)
        if self.proposer is not None:
            self.scheduler.set_drafts(self._propose_drafts())
        elif self.runner.drafter is not None:
            drafts = self.runner.propose_drafts()
            self.scheduler.set_drafts(drafts.token_ids, drafts.probs)
        return updates

    def _step_async(self) -> list[RequestOutput]:
        """Finish the step in flight, start the next, then make the finished step's outputs while it runs.

        Same tokens as the synchronous loop: step n+1 is scheduled after step n's tokens are applied, as there.
        A request that ends while step n+1 runs (a stop string found in step n's text, an abort between steps)
        has its step n+1 token dropped (update_from_output skips finished requests). Its blocks go back to the
        pool then, but no one else can take them before step n+1 has finished: blocks are handed out only by
        schedule() and add_prefilled_request, which both come after wait_for_step()."""
        inflight = self._inflight
        if inflight is None:
            so = self._schedule()
            if so is None:
                return []
            inflight = self._launch(so)
        so, future = inflight
        self._inflight = None
        updates = self._update(so, future.result())
        following = self._schedule()
        if following is not None:
            self._inflight = self._launch(following)
        return self._outputs(updates)

    def _launch(self, so: SchedulerOutput) -> tuple[SchedulerOutput, Future]:
        return so, self._forward.submit(self.runner.run, self.runner.prepare(so))

    def wait_for_step(self) -> None:
        """Until the step in flight (async scheduling) has finished running; its result stays for step()."""
        if self._inflight is not None:
            wait([self._inflight[1]])

    def _propose_drafts(self) -> dict[Request, list[int]]:
        """Drafts for every running request that is decoding (prompt fully computed)."""
        limit = self.config.max_model_len
        return {req: self.proposer.propose(req.all_token_ids, draft_limit(req, limit))
                for req in self.scheduler.running
                if req.num_computed_tokens == req.num_tokens - 1 and not req.spec_token_ids}

    def _outputs(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """New text (stop strings are matched here, on text) and one RequestOutput per changed request (for a
        final-only request, only once it has finished).

        A failure while handling one request's output (its detokenizer, say) fails that request alone.
        """
        outputs: list[RequestOutput] = []
        groups: dict[str, dict[str, tuple[list[int], str]]] = {}  # n > 1: their sequences' deltas, by parent
        for u in updates:
            req, new_ids = u.request, u.new_token_ids
            self.num_generation_tokens += len(new_ids)
            state = self.texts[req.request_id]
            text = ""
            try:
                if state.detok is None:  # token ids only (skip_tokenizer_init, detokenize=False)
                    pass
                elif not state.deferred:
                    text, stop = state.append(new_ids, final=req.is_finished,
                                              check_stops=req.num_output_tokens >= req.sampling_params.min_tokens)
                    if stop is not None:
                        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop)
                elif req.is_finished:
                    text = state.finish_deferred(req)
            except Exception as e:  # noqa: BLE001 - pinned on this request: it fails, the engine goes on
                log.exception("output processing failed for request %s", req.request_id)
                self.scheduler.fail(req, f"output processing failed: {type(e).__name__}: {e}")
            if req.hold_kv and req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.held_kv[req.request_id] = req
            if req.parent_id is None:
                out = self._single_output(req, state, new_ids, text)
                if out is not None:
                    outputs.append(out)
            else:
                groups.setdefault(req.parent_id, {})[req.request_id] = (new_ids, text)
        for ext_id, deltas in groups.items():
            group = self.requests[ext_id]
            if any(r.status is RequestStatus.FINISHED_ERROR for r in group):  # n > 1: one failed, all end
                for r in group:
                    if not r.is_finished:
                        self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            out = self._make_output(ext_id, group, deltas)
            if out is not None:
                outputs.append(out)
        return outputs

    def _make_output(self, ext_id: str, group: list[Request], deltas: dict) -> RequestOutput | None:
        """An n > 1 group's output as its output_kind asks (None: a final-only request still running)."""
        leader = group[0]
        finished = all(r.is_finished for r in group)
        kind = leader.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        comps = [self._completion(r, self.texts[r.request_id], *deltas.get(r.request_id, _NO_DELTA),
                                  kind is RequestOutputKind.DELTA) for r in group]
        error = next((r.error for r in group if r.error is not None), None)
        return self._request_output(ext_id, group, comps, finished, kind, error)

    def _single_output(self, req: Request, state: TextState, new_ids: list[int], text: str) -> RequestOutput | None:
        """_make_output for the usual request, which is alone in its group (the per-step path: no group dict)."""
        finished = req.is_finished
        kind = req.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        comps = [self._completion(req, state, new_ids, text, kind is RequestOutputKind.DELTA)]
        return self._request_output(req.request_id, [req], comps, finished, kind, req.error)

    @staticmethod
    def _completion(req: Request, state: TextState, new_ids: list[int], new_text: str,
                    delta: bool) -> CompletionOutput:
        logprobs = cumulative = None
        if req.sampling_params.logprobs is not None:
            if delta:
                logprobs, cumulative = state.new_logprobs(req), state.cumulative_logprob
            else:
                logprobs, cumulative = state.logprobs_so_far(req)
        if delta:  # the step's own new-id list (built fresh each step), not a copy of every id so far
            text, ids = new_text, new_ids or []
            new_ids = ids
        else:
            text, ids, new_ids = state.text, list(req.output_token_ids), list(new_ids)
        return CompletionOutput(req.index, text, ids, req.finish_reason, req.stop_reason, logprobs, cumulative,
                                new_text, new_ids)

    def _request_output(self, ext_id: str, group: list[Request], comps: list[CompletionOutput], finished: bool,
                        kind: RequestOutputKind, error: str | None) -> RequestOutput:
        leader = group[0]
        metrics = None
        if finished or kind is not RequestOutputKind.DELTA:  # a delta stream's consumers read them at the end
            metrics = RequestMetrics(leader.arrival_time, leader.first_scheduled_time, leader.first_token_time,
                                     time.monotonic() if finished else None, sum(r.num_preemptions for r in group))
        prompt_logprobs = None
        if leader.prompt_logprobs is not None:
            prompt_logprobs = self.texts[leader.request_id].prompt_logprobs(leader, kind is RequestOutputKind.DELTA)
        out = RequestOutput(ext_id, None, leader.prompt_token_ids, comps, finished,
                            max(leader.num_cached_tokens, 0), metrics, error=error, prompt_logprobs=prompt_logprobs)
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
            "spec_drafts": self.scheduler.spec.num_drafts,
            "spec_draft_tokens": self.scheduler.spec.num_draft_tokens,
            "spec_accepted_tokens": self.scheduler.spec.num_accepted_tokens,
            "spec_acceptance_rate": self.scheduler.spec.acceptance_rate,
            "generation_tokens": self.num_generation_tokens,
        }
