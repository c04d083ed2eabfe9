"""The input processor on its own (engine/input_processor.py): what a request may ask of this engine, refused with the
field named before anything is queued, and the n sequences it builds (ids, clamped max_tokens, random streams).

No engine is built: the processor reads only the configuration, the vocabulary and the (real) tokenizer."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.input_processor import InputProcessor
from ernie_serve.sampling_params import GuidedDecodingParams, SamplingParams
from ernie_serve.tokenizer import ErnieTokenizer

EOS = 2
MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> ErnieTokenizer:
    return ErnieTokenizer.from_pretrained(tiny_model_dir)


def processor(tokenizer: ErnieTokenizer | None, num_output_ids: int | None = None, **config) -> InputProcessor:
    vocab = len(tokenizer) if tokenizer is not None else 4096
    return InputProcessor(EngineConfig(max_model_len=MAX_LEN, block_size=4, **config), vocab,
                          num_output_ids or vocab, tokenizer, [EOS], None)


REFUSED = [
    ([], {}, {}, "prompt is empty"),
    ([5, 4096], {}, {}, r"prompt_token_ids must be in \[0, 4096\), got 5..4096"),
    ([-1, 5], {}, {}, r"prompt_token_ids must be in \[0, 4096\), got -1..5"),
    ([5] * MAX_LEN, {}, {}, f"prompt has {MAX_LEN} tokens but max_model_len is {MAX_LEN}"),
    ([5], {"logprobs": 1}, {"enable_logprob": False}, "logprobs: logprobs are off on this server"),
    ([5], {"prompt_logprobs": 1}, {"enable_logprob": False}, "prompt_logprobs: logprobs are off"),
    ([5], {"logprobs": 3}, {"max_logprobs": 2}, "logprobs must be <= 2, got 3"),
    ([5], {"prompt_logprobs": 1}, {"splitwise_role": "decode", "innode_prefill_ports": "9000"},
     "prompt_logprobs are not computed in a prefill/decode"),
    ([5], {"stop_token_ids": [7, 5000]}, {}, r"stop_token_ids must be token ids in \[0, 4096\), got \[5000\]"),
    ([5], {"logit_bias": {4096: 1.0}}, {}, r"logit_bias keys must be token ids in \[0, 4096\), got \[4096\]"),
    ([5], {"guided_decoding": GuidedDecodingParams(regex="a+")}, {"guided_decoding_backend": "off"},
     "guided_decoding is off on this server"),
    ([5], {"guided_decoding": GuidedDecodingParams(regex="a+")}, {}, "guided_decoding needs the tokenizer"),
    ([5], {"reasoning_max_tokens": 4, "reasoning_end_token_id": 4096}, {},
     r"reasoning_end_token_id must be a token id in \[0, 4096\), got 4096"),
    ([5], {"reasoning_max_tokens": 4}, {}, "reasoning_max_tokens needs reasoning_end_token_id"),
]


@pytest.mark.parametrize("prompt, params, config, message", REFUSED)
def test_a_request_this_engine_cannot_run_is_refused_naming_the_field(tokenizer, prompt, params, config, message):
    with pytest.raises(ValueError, match=message):
        processor(tokenizer, **config).make_group("r", prompt, SamplingParams(**params))


def test_prompt_logprobs_are_refused_for_a_request_that_holds_its_kv_for_a_decode_server(tokenizer):
    with pytest.raises(ValueError, match="prompt_logprobs are not computed"):
        processor(tokenizer).make_group("r", [5], SamplingParams(prompt_logprobs=1), hold_kv=True)


def test_min_tokens_with_every_token_a_stop_token_leaves_nothing_to_generate(tokenizer):
    small = processor(tokenizer, num_output_ids=4)
    with pytest.raises(ValueError, match="min_tokens=1 with stop_token_ids covering every one of the 4 tokens"):
        small.make_group("r", [5], SamplingParams(min_tokens=1, stop_token_ids=[0, 1, 3]))  # and eos, 2
    assert small.make_group("r", [5], SamplingParams(min_tokens=1, stop_token_ids=[0, 1, 3], ignore_eos=True))


def test_stop_strings_and_bad_words_need_a_tokenizer():
    ids_only = processor(None)
    for params in (dict(stop=["x"]), dict(bad_words=["x"])):
        with pytest.raises(ValueError, match="stop and bad_words need text: this engine runs with skip_tokenizer_init"):
            ids_only.make_group("r", [5], SamplingParams(**params))
    assert ids_only.make_group("r", [5], SamplingParams()).texts[0].detok is None


def test_max_tokens_is_clamped_to_what_max_model_len_leaves(tokenizer):
    p = processor(tokenizer)
    assert p.make_group("a", [5] * 10, SamplingParams(max_tokens=1000)).requests[0].max_tokens == MAX_LEN - 10
    assert p.make_group("b", [5] * 10, SamplingParams(max_tokens=None)).requests[0].max_tokens == MAX_LEN - 10
    assert p.make_group("c", [5] * 10, SamplingParams(max_tokens=7)).requests[0].max_tokens == 7


def test_n_sequences_share_the_id_the_caller_knows_and_only_the_first_computes_prompt_logprobs(tokenizer):
    group = processor(tokenizer).make_group("g", [5, 6, 7], SamplingParams(n=3, prompt_logprobs=1))
    assert group.request_id == "g" and len(group.texts) == 3
    assert [r.request_id for r in group.requests] == ["g#0", "g#1", "g#2"]
    assert [(r.parent_id, r.index) for r in group.requests] == [("g", 0), ("g", 1), ("g", 2)]
    assert [r.prompt_logprobs for r in group.requests] == [[], None, None]
    (alone,) = processor(tokenizer).make_group("one", [5], SamplingParams()).requests
    assert alone.request_id == "one" and alone.parent_id is None


def test_bad_words_are_encoded_once_with_the_tokenizer(tokenizer):
    (req,) = processor(tokenizer).make_group("r", [5], SamplingParams(bad_words=["Hello", "world"])).requests
    assert req.bad_words_ids == [tokenizer.encode("Hello"), tokenizer.encode("world")]


def _draws(group) -> list[list[float]]:
    return [r.generator.random(4).tolist() for r in group.requests]


def test_seeded_sequences_draw_the_same_streams_on_any_processor_and_differ_from_each_other(tokenizer):
    params = SamplingParams(n=2, seed=11)
    first = _draws(processor(tokenizer).make_group("a", [5], params))
    again = _draws(processor(tokenizer, seed=99).make_group("b", [5], params))
    assert first == again and first[0] != first[1]


def test_unseeded_requests_draw_distinct_streams_reproducible_from_the_engine_seed(tokenizer):
    p, q = processor(tokenizer, seed=3), processor(tokenizer, seed=3)
    a = [_draws(p.make_group(f"r{i}", [5], SamplingParams())) for i in range(3)]
    b = [_draws(q.make_group(f"r{i}", [5], SamplingParams())) for i in range(3)]
    assert a == b and len({str(x) for x in a}) == 3
    other = [_draws(processor(tokenizer, seed=4).make_group("r0", [5], SamplingParams()))]
    assert other[0] != a[0]


def test_the_prompt_is_copied_as_ints_so_the_callers_list_and_numpy_ids_are_not_kept(tokenizer):
    ids = np.array([5, 6, 7], dtype=np.int64)
    (req,) = processor(tokenizer).make_group("r", ids, SamplingParams()).requests
    assert req.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in req.prompt_token_ids)
    prompt = [5, 6, 7]
    (req,) = processor(tokenizer).make_group("r", prompt, SamplingParams()).requests
    prompt.append(8)
    assert req.prompt_token_ids == [5, 6, 7]
