"""Guided decoding without a model: grammars, each request's matcher, the sampler's grammar mask, the
scheduler advancing it, and the SamplingParams field (real llguidance on the demo tokenizer)."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.guided import GrammarCompiler, GrammarRows, token_bytes
from ernie_serve.engine.guided_grammar import GrammarError
from ernie_serve.engine.kv_cache_manager import KVCacheManager
from ernie_serve.engine.request import Request, RequestStatus
from ernie_serve.engine.sampler import Sampler, SamplingBatch
from ernie_serve.engine.scheduler import Scheduler
from ernie_serve.sampling_params import GuidedDecodingParams, SamplingParams
from ernie_serve.tokenizer import ErnieTokenizer

EOS = [2, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> ErnieTokenizer:
    return ErnieTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), EOS)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def allowed_after(compiler, params, prefix: list[int]) -> set[int]:
    state = compiler.new_state(params)
    for t in prefix:
        assert state.accept(t)
    _, bias = _masks(compiler, [GrammarRows(state, 0, [])], 1)
    return set(np.flatnonzero(bias[0] == 0).tolist())


def _masks(compiler, grammars, rows):
    from ernie_serve.engine.guided import grammar_masks

    return grammar_masks(grammars, rows, compiler.vocab_size)


def sample(rows: int, grammars: list[GrammarRows], logits: np.ndarray | None = None, vocab: int = 4096):
    logits = np.zeros((rows, vocab), np.float32) if logits is None else logits
    params = [SamplingParams(temperature=0, max_tokens=8)] * rows
    batch = SamplingBatch(params=params, generators=[None] * rows, prompt_token_ids=[[1]] * rows,
                          output_token_ids=[[] for _ in range(rows)], eos_token_ids=[EOS] * rows,
                          bad_words_ids=[[] for _ in range(rows)], grammars=grammars)
    return Sampler()(logits, batch)


# ------------------------------------------------------------------ the tokenizer as llguidance sees it
def test_token_bytes_make_literal_tokens_special_and_byte_pieces_single_bytes(tokenizer):
    vocab = token_bytes(tokenizer)
    assert len(vocab) == len(tokenizer)
    assert vocab[tokenizer.token_to_id("</think>")] == b"\xff</think>"
    assert vocab[tokenizer.token_to_id("<|im_end|>")] == b"\xff<|im_end|>"
    assert vocab[tokenizer.token_to_id("<0x41>")] == b"A"
    spaced = next(i for i in range(len(tokenizer)) if tokenizer.id_to_token(i).startswith("\u2581")
                  and not tokenizer.is_literal(i))
    assert vocab[spaced] == tokenizer.decode([spaced]).encode("utf-8")  # the space kept, as decoded


# ------------------------------------------------------------------ eos and the grammar's end
def test_eos_is_allowed_only_where_the_grammar_is_complete(compiler, tokenizer):
    choice = GuidedDecodingParams(choice=["yes", "no"])
    start = allowed_after(compiler, choice, [])
    assert not start & set(EOS)
    done = allowed_after(compiler, choice, ids_of(tokenizer, "yes"))
    assert done == set(EOS)


def test_special_tokens_never_appear_inside_a_json_string(compiler, tokenizer):
    schema = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                        "required": ["a"]})
    inside = allowed_after(compiler, schema, ids_of(tokenizer, '{"a": "x'))
    literal = {i for i in range(len(tokenizer)) if tokenizer.is_literal(i)}
    assert inside and not inside & literal


# ------------------------------------------------------------------ speculative positions
def test_a_draft_the_grammar_forbids_is_masked_at_its_position_and_later_rows_stay_samplable(compiler, tokenizer):
    state = compiler.new_state(GuidedDecodingParams(regex="[0-9]+"))
    digit, letter = ids_of(tokenizer, "7")[-1], ids_of(tokenizer, "x")[-1]
    # row 0 samples the first token, row 1 after draft `digit`, row 2 after `digit letter`, row 3 after all
    logits = np.zeros((4, 4096), np.float32)
    logits[:, letter] = 10.0  # the model wants the forbidden letter everywhere
    out = sample(4, [GrammarRows(state, 0, [digit, letter, digit])], logits)
    assert not out.errors  # rows past the forbidden draft are never accepted; they must not fail the request
    assert out.token_ids[1] != letter  # the draft `letter` cannot be what row 1 samples: it is rejected
    assert tokenizer.decode([int(out.token_ids[0])]).isdigit()
    assert int(out.token_ids[1]) in EOS or tokenizer.decode([int(out.token_ids[1])]).isdigit()
    assert state.matcher.validate_tokens([digit]) == 1  # the drafts were followed and rolled back


def test_rows_before_the_start_token_are_free_and_rows_after_it_are_constrained(compiler, tokenizer):
    think_end = tokenizer.token_to_id("</think>")
    state = compiler.new_state(GuidedDecodingParams(choice=["yes"], start_after_token_id=think_end))
    letter = ids_of(tokenizer, "q")[-1]
    logits = np.zeros((3, 4096), np.float32)
    logits[:, letter] = 10.0
    out = sample(3, [GrammarRows(state, 0, [letter, think_end])], logits)
    assert out.token_ids[0] == letter and out.token_ids[1] == letter  # still reasoning at rows 0 and 1
    assert tokenizer.decode([int(out.token_ids[2])]) in ("y", "ye", "yes")  # after </think>: the grammar
    assert state.waiting_for == think_end  # drafts never move the state


def test_the_output_cannot_end_before_the_constrained_part_begins(compiler, tokenizer):
    think_end = tokenizer.token_to_id("</think>")
    state = compiler.new_state(GuidedDecodingParams(choice=["yes"], start_after_token_id=think_end))
    logits = np.zeros((1, 4096), np.float32)
    logits[0, EOS] = 10.0  # the model wants to stop while still reasoning
    out = sample(1, [GrammarRows(state, 0, [])], logits)
    assert int(out.token_ids[0]) not in EOS and not out.errors


def test_scheduler_fails_a_request_whose_appended_token_the_grammar_rejects(compiler, tokenizer):
    config = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=4)
    sched = Scheduler(config, KVCacheManager(16, 4, True))
    params = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
    req = Request("r", [5, 6], params, EOS, 8, guided=compiler.new_state(params.guided_decoding))
    sched.add(req)
    digit, letter = ids_of(tokenizer, "7")[-1], ids_of(tokenizer, "x")[-1]
    assert sched.append_tokens(req, [digit, letter, digit], [None] * 3) == [digit, letter]
    assert req.status is RequestStatus.FINISHED_ERROR and "does not fit the grammar" in req.error


# ------------------------------------------------------------------ compiling
def test_one_compile_per_distinct_grammar_and_independent_states(compiler, tokenizer):
    params = GuidedDecodingParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    before = len(compiler._compiled)
    a, b = compiler.new_state(params), compiler.new_state(GuidedDecodingParams(json=dict(params.json)))
    assert len(compiler._compiled) == before + 1
    for t in ids_of(tokenizer, '{"k": 1'):
        assert a.accept(t)
    assert b.matcher.validate_tokens(ids_of(tokenizer, "}")) == 0  # b is still at the start


@pytest.mark.parametrize("params, field", [
    (GuidedDecodingParams(regex="(unclosed"), "guided_decoding.regex"),
    (GuidedDecodingParams(json={"type": "strin"}), "guided_decoding.json"),
    (GuidedDecodingParams(json={"$ref": "#/definitions/missing"}), "guided_decoding.json"),
    (GuidedDecodingParams(grammar='start: "a" undefined_rule'), "guided_decoding.grammar"),
    (GuidedDecodingParams(grammar="start: <no_such_token>"), "guided_decoding.grammar"),
])
def test_a_grammar_that_does_not_compile_is_a_value_error_naming_the_field(compiler, params, field):
    with pytest.raises(GrammarError) as e:
        compiler.new_state(params)
    assert str(e.value).startswith(f"{field}: ") and e.value.field == field
    assert isinstance(e.value, ValueError)


def test_gbnf_and_llguidance_lark_with_special_tokens_compile(compiler, tokenizer):
    assert allowed_after(compiler, GuidedDecodingParams(grammar='root ::= "ok"'), ids_of(tokenizer, "ok")) \
        == set(EOS)
    first = allowed_after(compiler, GuidedDecodingParams(grammar='start: <response> "x"'), [])
    assert first == {tokenizer.token_to_id("<response>")}


# ------------------------------------------------------------------ the SamplingParams field
@pytest.mark.parametrize("value, message", [
    ({}, "guided_decoding must set exactly one of json, regex, choice, grammar, json_object, got none"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"json": "{not json"}, "guided_decoding.json is not valid JSON"),
    ({"json": [1]}, "guided_decoding.json must be a JSON schema object"),
    ({"choice": []}, "guided_decoding.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "guided_decoding.choice must be a list of non-empty strings"),
    ({"regex": 5}, "guided_decoding.regex must be a non-empty string"),
    ({"json_object": "yes"}, "guided_decoding.json_object must be true or false"),
    ({"regex": "a", "start_after_token_id": -1}, "guided_decoding.start_after_token_id must be an integer"),
    ({"regex": "a", "backend": "xgrammar"}, "guided_decoding has unknown field(s) backend"),
    ("a+", "guided_decoding must be an object"),
])
def test_guided_decoding_field_errors_name_the_field(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(guided_decoding=value)


def test_guided_decoding_round_trips_through_json_and_takes_a_schema_as_text():
    p = SamplingParams(guided_decoding={"json": '{"type": "object"}'})
    assert p.guided_decoding == GuidedDecodingParams(json={"type": "object"})
    assert SamplingParams.from_dict(asdict(p)) == p


def test_ignore_eos_with_guided_decoding_is_refused():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with guided_decoding"):
        SamplingParams(ignore_eos=True, guided_decoding=GuidedDecodingParams(choice=["a"]))
