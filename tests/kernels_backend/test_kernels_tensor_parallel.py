"""The kernels backend across ranks: tensor and expert parallelism over gloo, each rank's kernels in triton's
interpreter, rank 0 in the test's process and the others in worker processes (tensor_parallel/workers.py).

The oracle is outside this project where it can be: HF transformers' greedy tokens on checkpoints transformers
wrote (GQA, one KV head replicated over the ranks, a dense model with head_dim != hidden / heads). MTP and
prefill/decode transfer under tensor parallelism are held to the single-rank kernels engine."""
from __future__ import annotations

import pytest

from ernie_serve import SamplingParams
from ernie_serve.config import EngineConfig
from ernie_serve.demo.tiny_model import random_mtp_weights, random_weights
from ernie_serve.kernels_backend.loading import check_runtime
from ernie_serve.model.checkpoint_writer import write_checkpoint
from kb_helpers import SHAPES, engine, greedy, prefill_then_decode, prompts

TOKENS = 10


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """name -> (directory, the transformers model that wrote it), made on first use."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import hf_model

    made = {}

    def get(name: str):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            model = hf_model(name)
            model.save_pretrained(d)
            made[name] = d, model
        return made[name]
    return get


def _hf_greedy(model, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(ids)[None], max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name,framework_name,expert_parallel", [
    ("moe_tied_shared", "torch", False),  # torch + gloo: the tensor framework of the borrowed GPU box
    ("moe_one_kv_head", "paddle", False),  # one KV head, replicated on both ranks
    ("dense_one_kv_head_headdim", "paddle", False),
    ("moe_untied_noshared_interval2", "paddle", True),  # each rank holds 3 of the 6 experts whole
])
def test_two_ranks_give_transformers_greedy_tokens(hf_checkpoints, monkeypatch, name, framework_name,
                                                   expert_parallel):
    pytest.importorskip(framework_name)
    monkeypatch.setenv("ERNIE_TENSOR_FRAMEWORK", framework_name)  # the workers inherit it
    d, hf = hf_checkpoints(name)
    ids = prompts(4096, (7, 26))
    llm = engine(d, "kernels", tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    executor = llm.engine.runner.executor
    assert executor.shard.ops.name == framework_name and len(executor.worker_pids) == 1
    assert executor.model.num_heads == 2 and executor.model.layout.world_size == 2
    got = greedy(llm, ids, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    assert got == [_hf_greedy(hf, p) for p in ids], name


def test_mtp_under_tensor_parallelism_gives_plain_decodings_tokens(tmp_path):
    config = SHAPES["moe_one_kv_head"]
    write_checkpoint(tmp_path, config, {**random_weights(config, seed=3), **random_mtp_weights(config, seed=4)})
    ids = prompts(config["vocab_size"], (9, 32))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = greedy(engine(tmp_path, "kernels"), ids, params)
    llm = engine(tmp_path, "kernels", tensor_parallel_size=2,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert greedy(llm, ids, params) == plain
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_prefill_on_two_ranks_hands_its_kv_to_a_decode_engine_on_two(tiny_model_dir):
    """The exported blocks hold every KV head (each rank's heads, gathered); each decode rank keeps the heads it
    holds. (Different sizes a side run the same layout code: tests/tensor_parallel/test_tensor_parallel.py.)"""
    ids = prompts(4096, (45,))[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = greedy(engine(tiny_model_dir, "kernels"), [ids], params)[0]
    prefill = engine(tiny_model_dir, "kernels", tensor_parallel_size=2)
    decode = engine(tiny_model_dir, "kernels", tensor_parallel_size=2, enable_prefix_caching=False)
    assert prefill_then_decode(prefill, decode, ids, params) == want

class _OneGpu:
    name, on_gpu = "torch", True

    def device_count(self) -> int:
        return 1


def test_more_ranks_than_gpus_is_refused_naming_both_numbers():
    config = EngineConfig(execution_backend="kernels", tensor_parallel_size=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs .* sees 1"):
        check_runtime(_OneGpu(), config)


def test_a_model_the_ranks_cannot_split_is_refused_before_any_worker_starts(tmp_path):
    write_checkpoint(tmp_path, SHAPES["moe_odd_sizes"], random_weights(SHAPES["moe_odd_sizes"], seed=1))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's num_attention_heads=3"):
        engine(tmp_path, "kernels", tensor_parallel_size=2)
