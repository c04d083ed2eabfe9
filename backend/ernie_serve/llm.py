"""The offline API (FastDeploy's / vLLM's): LLM(model=..., **engine_flags).generate / .chat."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .model_source import resolve_model
from .outputs import RequestOutput, RequestOutputKind
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        # a model id (FastDeploy's --model) becomes its local directory before the engine loads it
        self.config = EngineConfig.from_kwargs(model=resolve_model(model), **kwargs)
        if self.config.engine_core_process:
            raise ValueError("engine_core_process=True is a server's setting (ernie_moe's engine in a process of its "
                             "own, apart from its response threads); the offline LLM steps the engine in the "
                             "caller's process: leave engine_core_process unset")
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompt_token_ids is None:
            prompt_token_ids = [self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        texts = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        if len(texts) != len(prompt_token_ids):
            raise ValueError("prompts and prompt_token_ids must have the same length")
        params = [self._budgeted(p, ids) for p, ids in zip(_per_prompt(sampling_params, len(prompt_token_ids)),
                                                            prompt_token_ids)]
        return self._run(list(zip(texts, prompt_token_ids, params)), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render the model's chat template, generate, and parse reasoning / tool calls if configured."""
        from .chat import parse_chat_output, render_chat_prompt
        from .engine.guided_grammar import answer_constraint
        from .parsers import get_reasoning_parser

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params = _per_prompt(sampling_params, len(conversations))
        items = []
        for conv, p in zip(conversations, params):
            text, ids = render_chat_prompt(self.tokenizer, conv, tools, chat_template_kwargs,
                                           chat_template or self.config.chat_template)
            p = self._budgeted(p, ids)
            if p.guided_decoding is not None and self.config.reasoning_parser:
                # the constraint goes where the reasoning parser reads the answer, after the reasoning
                rp = get_reasoning_parser(self.config.reasoning_parser)(self.tokenizer)
                p = replace(p, guided_decoding=answer_constraint(p.guided_decoding, rp, rp.get_model_status(ids)))
            items.append((text, ids, p))
        outs = self._run(items, use_tqdm)
        for out in outs:
            parse_chat_output(self.tokenizer, self.config, out, tools)
        return outs

    def _budgeted(self, p: SamplingParams, ids: Sequence[int]) -> SamplingParams:
        """reasoning_max_tokens placed for this prompt by the configured reasoning parser
        (engine/reasoning_budget.py)."""
        if p.reasoning_max_tokens is None or p.reasoning_end_token_id is not None:
            return p
        from .engine.reasoning_budget import resolve_reasoning_budget
        from .parsers import get_reasoning_parser

        if not self.config.reasoning_parser or self.tokenizer is None:
            return resolve_reasoning_budget(p, None, False)  # refused: nothing says where the reasoning ends
        rp = get_reasoning_parser(self.config.reasoning_parser)(self.tokenizer)
        return resolve_reasoning_budget(p, getattr(rp, "think_end_token_id", None),
                                        rp.get_model_status(list(ids)) == "think_start")

    def _run(self, items: list[tuple[str | None, list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        order, results = {}, {}
        for i, (text, ids, p) in enumerate(items):
            rid = f"offline-{next(self._ids)}"
            order[rid] = i
            # only finished outputs are read here: no per-step output, and text decoded once where no stop
            # string needs it earlier
            self.engine.add_request(rid, list(ids), replace(p, output_kind=RequestOutputKind.FINAL_ONLY), prompt=text)
        bar = tqdm(total=len(items), desc="Generating", unit="req",
                   disable=not use_tqdm or self.config.disable_progress_bar)
        try:
            while len(results) < len(items):
                for out in self.engine.step():
                    if out.finished:
                        out.prompt = items[order[out.request_id]][0]
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in order:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[rid] for rid in order]


def _per_prompt(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
    return list(sp)
