"""The model runner on its own (engine/model_runner.py): a SchedulerOutput made into one StepInput (tokens, positions,
sampled rows, prompt-logprob rows), run on the real reference executor of the tiny model, and its rows' tokens and
logprobs handed back to the request that owns each row.

The steps come from the real scheduler, as the engine makes them; each test checks the runner's tokens against the
executor's own full logits for the same StepInput."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.executor_factory import load_executor
from ernie_serve.engine.input_processor import InputProcessor
from ernie_serve.engine.kv_cache_manager import KVCacheManager
from ernie_serve.engine.model_runner import ModelRunner, PromptRows
from ernie_serve.engine.request import Request
from ernie_serve.engine.sampler import ArgmaxRows, SamplingBatch
from ernie_serve.engine.scheduler import Scheduler
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.sampling_params import SamplingParams
from ernie_serve.step_contract import MAX_BATCHED_QUERY

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def executor(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, block_size=BLOCK, execution_backend="reference",
                          kv_cache_memory=8 << 20, disable_progress_bar=True)
    model_cfg = ErnieModelConfig.from_pretrained(tiny_model_dir)
    return load_executor(config, tiny_model_dir, model_cfg, None).executor, model_cfg


class Setup:
    """A runner on the shared executor, with its own scheduler and KV pool (the pool is the executor's)."""

    def __init__(self, executor, **config):
        executor, model_cfg = executor
        self.config = EngineConfig(max_model_len=128, block_size=BLOCK, max_num_seqs=8, **config)
        self.scheduler = Scheduler(self.config, KVCacheManager(executor.cache.num_blocks, BLOCK, False))
        self.runner = ModelRunner(executor, BLOCK, max_model_len=128)
        self.inputs = InputProcessor(self.config, model_cfg.vocab_size, model_cfg.vocab_size, None, [2], None)

    def add(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[Request]:
        group = self.inputs.make_group(rid, prompt, params)
        self.scheduler.add_group(group.requests)
        return group.requests

    def full_logits(self, prepared) -> np.ndarray:
        """The executor's logits of every computed row of the prepared step (not the argmax shortcut)."""
        _, logits = self.runner.executor.execute(dataclasses.replace(prepared.step, argmax_only=False))
        return np.asarray(logits, dtype=np.float32)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 4000, n).tolist()


def test_a_mixed_step_puts_decodes_first_and_samples_each_request_at_its_last_token(executor):
    s = Setup(executor, max_num_batched_tokens=64)
    (a,) = s.add("a", _prompt(5, 0))
    s.scheduler.update_from_output(so := s.scheduler.schedule(), s.runner.execute(so))  # a's prompt: a decodes next
    (b,) = s.add("b", _prompt(12, 1))
    so = s.scheduler.schedule()
    assert [(x.request.request_id, x.num_tokens) for x in so.scheduled] == [("a", 1), ("b", 12)]
    prepared = s.runner.prepare(so)
    step = prepared.step
    assert step.token_ids.tolist() == [a.output_token_ids[-1], *b.prompt_token_ids]
    assert step.positions.tolist() == [5, *range(12)]
    assert step.sample_rows.tolist() == [0, 12] and prepared.owners == ["a", "b"]
    assert step.num_decodes == 1 and type(prepared.batch) is ArgmaxRows and step.argmax_only
    expected = s.full_logits(prepared).argmax(axis=-1).tolist()
    out = s.runner.run(prepared)
    assert out.sampled == {"a": [expected[0]], "b": [expected[1]]} and not out.errors


def test_a_long_prefill_sorts_after_the_short_queries_whatever_the_scheduling_order(executor):
    s = Setup(executor, max_num_batched_tokens=64)
    s.add("long", _prompt(MAX_BATCHED_QUERY + 5, 2))
    s.add("short", _prompt(3, 3))
    so = s.scheduler.schedule()
    assert [x.request.request_id for x in so.scheduled] == ["long", "short"]
    prepared = s.runner.prepare(so)
    assert prepared.owners == ["short", "long"]
    assert prepared.step.query_start_loc.tolist() == [0, 3, 3 + MAX_BATCHED_QUERY + 5]


def test_a_prefill_chunk_short_of_the_prompts_end_samples_nothing(executor):
    s = Setup(executor, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    (r,) = s.add("r", _prompt(20, 4))
    so = s.scheduler.schedule()
    assert so.scheduled[0].num_tokens == 8
    prepared = s.runner.prepare(so)
    assert prepared.batch is None and prepared.owners == [] and len(prepared.step.sample_rows) == 0
    out = s.runner.run(prepared)
    assert out.sampled == {} and out.logprobs == {}


def test_sampling_params_beyond_the_argmax_build_a_sampling_batch_with_logprobs(executor):
    s = Setup(executor)
    s.add("g", _prompt(6, 5))
    s.add("lp", _prompt(7, 6), SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))
    prepared = s.runner.prepare(s.scheduler.schedule())
    assert type(prepared.batch) is SamplingBatch and not prepared.step.argmax_only
    logits = s.full_logits(prepared)
    out = s.runner.run(prepared)
    assert out.sampled == {"g": [int(logits[0].argmax())], "lp": [int(logits[1].argmax())]}
    (lp,) = out.logprobs["lp"]
    shifted = logits[1] - logits[1].max()
    reference = shifted - np.log(np.exp(shifted).sum())
    assert set(lp) >= {out.sampled["lp"][0]} and len(lp) >= 2
    for tok, (value, rank) in lp.items():
        assert value == pytest.approx(reference[tok], abs=1e-4)
        assert rank == 1 + int((reference > reference[tok]).sum())


def test_n_sequences_sample_their_first_tokens_from_the_leaders_last_prompt_row(executor):
    s = Setup(executor)
    s.add("g", _prompt(6, 7), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4))
    prepared = s.runner.prepare(s.scheduler.schedule())
    assert prepared.owners == ["g#0", "g#1", "g#2"] and prepared.step.sample_rows.tolist() == [5, 5, 5]
    out = s.runner.run(prepared)
    assert sorted(out.sampled) == ["g#0", "g#1", "g#2"]


def test_prompt_logprobs_come_from_the_rows_after_the_sampled_ones_chunk_by_chunk(executor):
    prompt = _prompt(14, 8)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    s = Setup(executor, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    (r,) = s.add("p", prompt, params)
    first = s.runner.prepare(so := s.scheduler.schedule())
    assert first.prompt.targets == prompt[1:9] and first.step.sample_rows.tolist() == list(range(8))
    logits = s.full_logits(first)
    out = s.runner.run(first)
    entries = out.prompt_logprobs["p"]
    assert len(entries) == 8 and all(prompt[k + 1] in e for k, e in enumerate(entries))
    shifted = logits[0] - logits[0].max()
    assert entries[0][prompt[1]][0] == pytest.approx(shifted[prompt[1]] - np.log(np.exp(shifted).sum()), abs=1e-4)
    s.scheduler.update_from_output(so, out)
    second = s.runner.prepare(s.scheduler.schedule())
    assert second.prompt.targets == prompt[9:] and second.owners == ["p"]
    assert second.step.sample_rows.tolist() == [5, 0, 1, 2, 3, 4]  # the sampled row first, then the prompt's
    assert len(s.runner.run(second).prompt_logprobs["p"]) == 5 and len(r.prompt_logprobs) == 8


def test_prompt_logprobs_refuse_a_chunk_that_skipped_positions(executor):
    s = Setup(executor)
    (r,) = s.add("p", _prompt(10, 9), SamplingParams(prompt_logprobs=1))
    rows: list[int] = []
    with pytest.raises(RuntimeError, match=r"request p: prompt logprobs 0.. were skipped \(this chunk starts at 4\)"):
        PromptRows([], [], []).add(r, 4, 4, 0, rows)
