"""The engine loop: add requests, step (schedule -> run -> update -> outputs), abort. Single-threaded;
engine/async_engine.py puts it behind a thread-safe front. Requests come in checked by the input processor, the
scheduler owns their state, the model runner runs each step on the executor, the output processor makes the outputs;
this module wires them and keeps the loop (and the prefill / decode KV hand-off, which touches all of them)."""
from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..config import EngineConfig
from ..model.config import ErnieModelConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import ErnieTokenizer
from .executor_factory import load_executor
from .guided import GrammarCompiler
from .input_processor import InputProcessor, RequestGroup
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVHandoff, KVTransfer
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .spec_decode import draft_limit, make_proposer
from .step_plan import ModelRunnerOutput, RequestUpdate, SchedulerOutput

log = logging.getLogger(__name__)


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


def make_input_processor(config: EngineConfig, model_dir: Path, tokenizer: ErnieTokenizer | None,
                         model_config: ErnieModelConfig) -> InputProcessor:
    """What checks and builds requests for this model: the engine's, and a front's that runs the engine core in
    another process (core_client.py) and answers bad input at once."""
    eos_token_ids = read_eos_token_ids(model_dir, tokenizer, model_config)
    num_output_ids = len(tokenizer) if tokenizer else model_config.vocab_size
    # guided decoding: grammars compiled on the callers' threads, cached per grammar
    grammars = GrammarCompiler(tokenizer, num_output_ids, eos_token_ids) \
        if tokenizer is not None and eos_token_ids else None
    return InputProcessor(config, model_config.vocab_size, num_output_ids, tokenizer, eos_token_ids, grammars)


def _setup_forward_thread(cpu_threads: int) -> None:
    """The forward thread's CPU kernels take the engine's thread count (OpenMP's setting is per thread)."""
    if cpu_threads:
        from .._env import setup_model_process

        setup_model_process(cpu_threads)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = resolve_model_dir(config)
        self.model_dir = model_dir
        self.tokenizer = None if config.skip_tokenizer_init else ErnieTokenizer.from_pretrained(config.tokenizer or model_dir)
        self.model_config = ErnieModelConfig.from_pretrained(model_dir)
        self.inputs = make_input_processor(config, model_dir, self.tokenizer, self.model_config)
        self.eos_token_ids = self.inputs.eos_token_ids
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
        self.num_output_ids = self.inputs.num_output_ids
        self.grammars = self.inputs.grammars
        self.output = OutputProcessor(self.scheduler)
        self.handoff = KVHandoff(config, self.inputs, self.scheduler, self.kv, executor.cache, self.output,
                                 self.wait_for_step)
        # async_scheduling: one thread runs each step's forward and sampling; _inflight holds the steps handed to
        # it, oldest first: the one running and, when it was scheduled ahead, the one queued behind it
        self._forward: ThreadPoolExecutor | None = None
        self._inflight: list[tuple[SchedulerOutput, Future]] = []
        # None: on where the model has no CPU threads of its own (it runs on a device), in a mixed role (a P/D
        # role's KV hand-off waits for the step in flight each time; it runs with it only when asked)
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.cpu_threads == 0 and config.splitwise_role == "mixed"
        # scheduling ahead needs every step's next one to be plannable without its tokens: no drafts (they are
        # proposed from the tokens), and no KV hand-off (a P/D role reads and writes the cache between steps)
        self._ahead_possible = (self.async_scheduling and self.proposer is None and self.runner.drafter is None
                                and config.splitwise_role == "mixed")
        self.num_steps_ahead = 0
        if self.async_scheduling:
            # the thread must hold no reference to the engine (a bound method as initializer would): an engine
            # dropped without close() then goes, and its executor's thread ends with it
            self._forward = ThreadPoolExecutor(1, thread_name_prefix="ernie-forward",
                                               initializer=_setup_forward_thread, initargs=(self.cpu_threads,))
        self.num_steps = 0
        self.num_prompt_tokens = 0
        from .._env import freeze_startup_objects

        freeze_startup_objects()
        log.info("engine ready: %s on the %s backend, %d KV blocks of %d tokens (%d on the CPU tier), "
                 "max_num_seqs=%d, max_num_batched_tokens=%d, prefix caching %s, async scheduling %s%s, "
                 "%d CPU threads", model_dir, loaded.backend, num_blocks,
                 config.block_size, num_host_blocks, config.max_num_seqs, config.max_num_batched_tokens,
                 "on" if config.enable_prefix_caching else "off", "on" if self.async_scheduling else "off",
                 " (steps planned ahead)" if self._ahead_possible else "", self.cpu_threads)

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
        self.output.add(group)
        self.scheduler.add_group(group.requests)
        self.num_prompt_tokens += group.requests[0].num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool. Returns its final output."""
        for req in self.output.requests.get(request_id, ()):
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.output.aborted(request_id)

    # ---------------------------------------------------------------- prefill/decode disaggregation
    def export_kv(self, request_id: str) -> KVTransfer:
        """The computed KV of a finished hold_kv request; its blocks are released afterwards."""
        return self.handoff.export(request_id)

    def add_prefilled_request(self, transfer: KVTransfer, sampling_params: SamplingParams) -> RequestOutput | None:
        """Continue a request whose prompt KV was computed elsewhere (decode role); KVHandoff.admit."""
        req, final = self.handoff.admit(transfer, sampling_params)
        self.num_prompt_tokens += req.num_prompt_tokens
        return final

    @property
    def requests(self) -> dict[str, list[Request]]:
        """The requests callers know by id (each one's n sequences), until their final output."""
        return self.output.requests

    @property
    def num_generation_tokens(self) -> int:
        return self.output.num_generation_tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.requests)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update -> outputs. With async scheduling the forward thread runs the steps, the next
        one planned while one runs, and this one's outputs are made (and whatever the caller does with them)
        while the next forward runs; see _step_async."""
        if self._forward is not None:
            return self._step_async()
        so = self._schedule()
        if so is None:
            return []
        updates = self._update(so, self.runner.execute(so))
        return self.output.process(updates)

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
        """Finish the oldest step in flight, make sure the next one is running, schedule the one after it ahead when
        it can be, then make the finished step's outputs while the forward thread works.

        Scheduling ahead (vLLM v1's async scheduling): while step n+1 runs, step n+2 is planned as if n+1 had
        finished (Scheduler.expect: one placeholder token per request that samples in n+1) and queued behind it, so
        the forward thread goes from one step to the next without waiting for this thread. Its placeholder rows get
        n+1's tokens when it starts (ModelRunner.run). It is done only when every request sampling in n+1 draws
        from its logits alone (Request.schedules_ahead); otherwise n+2 is scheduled after n+1's tokens are
        applied, as in the plain overlap.

        Same tokens as the synchronous loop. A request that ends in step n+1 (eos, a stop token or string, an
        abort) may still have a row in n+2; that row's token is dropped (update_from_output skips finished
        requests). Its blocks go back to the pool at n+1's update, and a step that reuses them runs after n+2 on
        the same forward thread, so n+2's write into them comes first and is overwritten; none of them is in the
        prefix cache (only blocks full of computed tokens are, and n+2 writes past the request's last one). A
        request preempted to make room in n+2 keeps the token it samples in n+1."""
        inflight = self._inflight
        if not inflight:
            so = self._schedule()
            if so is None:
                return []
            inflight.append(self._launch(so))
        so, future = inflight.pop(0)
        updates = self._update(so, future.result())
        if not inflight:
            following = self._schedule()
            if following is not None:
                inflight.append(self._launch(following))
        if len(inflight) == 1 and self._can_schedule_ahead(inflight[0][0]):
            self._schedule_ahead(*inflight[0])
        return self.output.process(updates)

    def _can_schedule_ahead(self, running: SchedulerOutput) -> bool:
        if not self._ahead_possible:
            return False
        for s in running.scheduled:
            r = s.request
            if (not r.schedules_ahead or r.forks) and s.samples:
                return False
            # a prompt's next chunk asks for the logprobs after those its running chunk appends
            if r.prompt_logprobs is not None and r.needs_prompt_logprobs:
                return False
        return True

    def _schedule_ahead(self, running: SchedulerOutput, running_future: Future) -> None:
        """Plan the step after `running` before it ends, and queue it behind it on the forward thread."""
        self.scheduler.expect(running)
        so = self.scheduler.schedule()
        if so.is_empty:
            if so.kv_ops:  # moves with nothing to run: after the running step, on its thread
                self._forward.submit(self.runner.apply_kv_ops, so.kv_ops).result()
            return
        self.num_steps_ahead += 1
        self._inflight.append(self._launch(so, running_future))

    def _launch(self, so: SchedulerOutput, after: Future | None = None) -> tuple[SchedulerOutput, Future]:
        prepared = self.runner.prepare(so)
        if after is None:
            return so, self._forward.submit(self.runner.run, prepared)
        # the forward thread runs its steps in order, so `after` is done when this one starts
        return so, self._forward.submit(lambda: self.runner.run(prepared, after.result()))

    def wait_for_step(self) -> None:
        """Until the steps in flight (async scheduling) have finished running; their results stay for step()."""
        if self._inflight:
            wait([f for _, f in self._inflight])

    def _propose_drafts(self) -> dict[Request, list[int]]:
        """Drafts for every running request that is decoding (prompt fully computed)."""
        limit = self.config.max_model_len
        return {req: self.proposer.propose(req.all_token_ids, draft_limit(req, limit))
                for req in self.scheduler.running
                if req.num_computed_tokens == req.num_tokens - 1 and not req.spec_token_ids}

    # ---------------------------------------------------------------- introspection
    def stats(self) -> dict:
        s = self.kv.stats
        # an executor's figures about its device, where it has some (the simulated backend's modeled step time)
        device = getattr(self.runner.executor, "device_stats", None)
        return ({} if device is None else device()) | {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions, "num_free_blocks": self.kv.num_free_blocks,
            "num_total_blocks": self.kv.pool.num_blocks, "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_query_tokens": s.query_tokens,
            "prefix_cache_hit_tokens": s.hit_tokens, "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_device_hit_tokens": s.device_hit_tokens, "prefix_cache_host_hit_tokens": s.host_hit_tokens,
            "num_steps": self.num_steps, "num_steps_ahead": self.num_steps_ahead, "prompt_tokens": self.num_prompt_tokens,
            "spec_drafts": self.scheduler.spec.num_drafts,
            "spec_draft_tokens": self.scheduler.spec.num_draft_tokens,
            "spec_accepted_tokens": self.scheduler.spec.num_accepted_tokens,
            "spec_acceptance_rate": self.scheduler.spec.acceptance_rate,
            "generation_tokens": self.num_generation_tokens,
        }
