"""The output processor on its own (engine/output_processor.py): TextState's stop strings, matched on text and held
back while undecided, and the RequestOutputs each output_kind asks for.

The input processor, scheduler, tokenizer and output processor are the real ones; the model is a script of the
tokens each sequence samples, so every expected text is known in advance.
"""
from __future__ import annotations

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.input_processor import InputProcessor
from ernie_serve.engine.kv_cache_manager import KVCacheManager
from ernie_serve.engine.output_processor import OutputProcessor, TextState
from ernie_serve.engine.request import RequestStatus
from ernie_serve.engine.scheduler import Scheduler
from ernie_serve.engine.step_plan import ModelRunnerOutput
from ernie_serve.outputs import RequestOutputKind
from ernie_serve.sampling_params import SamplingParams
from ernie_serve.tokenizer import ErnieTokenizer

EOS = 2
PROMPT = [5, 6, 7, 8, 9]
DELTA, FINAL_ONLY, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> ErnieTokenizer:
    return ErnieTokenizer.from_pretrained(tiny_model_dir)


class Loop:
    """The engine loop without a model: each step, every sequence that samples takes the next token of its script."""

    def __init__(self, tokenizer: ErnieTokenizer):
        self.tokenizer = tokenizer
        config = EngineConfig(max_model_len=256, max_num_seqs=8, block_size=4)
        self.scheduler = Scheduler(config, KVCacheManager(64, 4, True))
        self.inputs = InputProcessor(config, len(tokenizer), len(tokenizer), tokenizer, [EOS], None)
        self.output = OutputProcessor(self.scheduler)
        self.scripts: dict[str, list[int]] = {}

    def add(self, rid: str, texts: list[str] | str, **params) -> list:
        """A request whose sequence i samples the tokens of texts[i] (one text: every sequence), then EOS."""
        texts = [texts] if isinstance(texts, str) else texts
        scripts = [self.tokenizer.encode(t) + [EOS] for t in texts]
        params.setdefault("max_tokens", max(map(len, scripts)) + 4)
        group = self.inputs.make_group(rid, PROMPT, SamplingParams(temperature=0, **params))
        for i, req in enumerate(group.requests):
            self.scripts[req.request_id] = list(scripts[i % len(scripts)])
        self.output.add(group)
        self.scheduler.add_group(group.requests)
        return group.requests

    def step(self, logprob: float | None = None) -> list:
        so = self.scheduler.schedule()
        ran = ModelRunnerOutput()
        for s in so.scheduled:
            if not s.samples:
                continue
            req = s.request
            for r in [req, *(req.forks if not req.output_token_ids else [])]:
                tok = self.scripts[r.request_id].pop(0)
                ran.sampled[r.request_id] = [tok]
                ran.logprobs[r.request_id] = [None if logprob is None else {tok: (logprob, 1)}]
        return self.output.process(self.scheduler.update_from_output(so, ran))

    def run(self, logprob: float | None = None, max_steps: int = 200) -> dict[str, list]:
        """Every output, by request id, until nothing is left."""
        outs: dict[str, list] = {}
        for _ in range(max_steps):
            if not self.output.requests:
                return outs
            for out in self.step(logprob):
                outs.setdefault(out.request_id, []).append(out)
        raise AssertionError(f"requests left after {max_steps} steps: {sorted(self.output.requests)}")


def _text_state(loop: Loop, **params) -> TextState:
    return loop.inputs.make_group("t", PROMPT, SamplingParams(**params)).texts[0]


def _feed(state: TextState, tokenizer: ErnieTokenizer, text: str, min_new: int = 0) -> tuple[list[str], str | None]:
    """The text's tokens one at a time (the last as final): each step's decided text, and the stop found."""
    ids = tokenizer.encode(text)
    deltas = []
    for k, tok in enumerate(ids):
        delta, stop = state.append([tok], final=k == len(ids) - 1, check_stops=k + 1 >= min_new)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas, None


# ---------------------------------------------------------------- TextState


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_is_decided(tokenizer):
    state = _text_state(Loop(tokenizer), stop=["END"])
    deltas, stop = _feed(state, tokenizer, "Hello world END of story")
    assert stop == "END" and "".join(deltas) == "Hello world " == state.text
    # ' E' and 'N' arrive as their own tokens: neither step hands out any part of the stop string
    assert all("E" not in d and "N" not in d for d in deltas), deltas


def test_held_back_text_is_released_once_it_cannot_be_a_stop_string(tokenizer):
    state = _text_state(Loop(tokenizer), stop=["ENDING"])
    deltas, stop = _feed(state, tokenizer, "Hello world END of story")
    assert stop is None and state.text == "Hello world END of story"
    at_e = tokenizer.encode("Hello world END of story").index(tokenizer.encode(" E")[-1])
    assert "E" not in deltas[at_e], deltas  # 'E' may begin 'ENDING': it waits
    assert "END" in next(d for d in deltas if "E" in d), deltas  # and comes out whole once ' of' decides it


def test_the_last_tokens_flush_a_held_tail_that_never_became_a_stop_string(tokenizer):
    state = _text_state(Loop(tokenizer), stop=["END"])
    deltas, stop = _feed(state, tokenizer, "Hello world EN")
    assert stop is None and deltas[-1].endswith("EN") and state.text == "Hello world EN"


def test_include_stop_str_in_output_hands_out_the_stop_string_whole(tokenizer):
    state = _text_state(Loop(tokenizer), stop=["END"], include_stop_str_in_output=True)
    deltas, stop = _feed(state, tokenizer, "Hello world END of story")
    assert stop == "END" and state.text == "Hello world END"
    assert [d for d in deltas if "E" in d or "N" in d] == ["END"]


def test_the_earliest_stop_string_in_the_text_wins(tokenizer):
    state = _text_state(Loop(tokenizer), stop=["story", "of"])
    _, stop = _feed(state, tokenizer, "Hello world END of story")
    assert stop == "of" and state.text == "Hello world END "


def test_stop_strings_are_not_matched_while_check_stops_is_off(tokenizer):
    # min_tokens: the output processor passes check_stops=False until the request has that many tokens
    state = _text_state(Loop(tokenizer), stop=["wor"])
    text = "Hello world END of story"
    _, stop = _feed(state, tokenizer, text, min_new=len(tokenizer.encode(text)))
    assert stop is None and state.text == text


def test_final_only_without_stop_strings_decodes_once_at_the_end(tokenizer):
    loop = Loop(tokenizer)
    (req,) = loop.add("f", "Hello world", output_kind=FINAL_ONLY)
    state = loop.output.texts["f"]
    assert state.deferred
    assert loop.step() == [] and state.text == "" and req.output_token_ids  # tokens, but no text yet
    (out,) = loop.run()["f"]
    assert out.outputs[0].text == "Hello world" and not state.deferred
    assert _text_state(loop, stop=["x"], output_kind=FINAL_ONLY).deferred is False  # a stop string needs the text


def test_detokenize_false_gives_token_ids_and_no_text(tokenizer):
    loop = Loop(tokenizer)
    loop.add("ids", "Hello world", detokenize=False)
    outs = loop.run()["ids"]
    assert outs[-1].outputs[0].token_ids == tokenizer.encode("Hello world") + [EOS]
    assert all(o.outputs[0].text == "" for o in outs)


# ---------------------------------------------------------------- OutputProcessor, by output_kind


def test_delta_outputs_carry_only_what_each_step_added(tokenizer):
    loop = Loop(tokenizer)
    loop.add("d", "Hello world END of story", output_kind=DELTA, logprobs=1)
    outs = loop.run(logprob=-0.5)["d"]
    ids = tokenizer.encode("Hello world END of story") + [EOS]
    assert [o.outputs[0].token_ids for o in outs] == [[t] for t in ids]
    assert "".join(o.outputs[0].text for o in outs) == "Hello world END of story"
    assert all(len(o.outputs[0].logprobs) == 1 for o in outs)
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(-0.5 * len(ids))
    assert [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    assert all(o.metrics is None for o in outs[:-1]) and outs[-1].metrics.finished_time is not None


def test_cumulative_outputs_carry_everything_so_far_every_step(tokenizer):
    loop = Loop(tokenizer)
    loop.add("c", "Hello world", output_kind=CUMULATIVE)
    outs = loop.run()["c"]
    ids = tokenizer.encode("Hello world") + [EOS]
    assert [o.outputs[0].token_ids for o in outs] == [ids[: k + 1] for k in range(len(ids))]
    assert [o.outputs[0].token_ids_delta for o in outs] == [[t] for t in ids]
    texts = [o.outputs[0].text for o in outs]
    assert texts[-1] == "Hello world" and all(texts[-1].startswith(t) for t in texts)
    assert all(o.metrics is not None for o in outs)


def test_final_only_gives_one_output_when_the_request_ends(tokenizer):
    loop = Loop(tokenizer)
    loop.add("f", "Hello world END of story", output_kind=FINAL_ONLY, stop=["END"])
    (out,) = loop.run()["f"]
    assert out.finished and out.outputs[0].text == "Hello world "
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "END"


def test_a_stop_string_ends_the_request_through_the_scheduler_and_frees_its_blocks(tokenizer):
    loop = Loop(tokenizer)
    (req,) = loop.add("s", "Hello world END of story", output_kind=DELTA, stop=["END"])
    outs = loop.run()["s"]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == "END"
    assert "".join(o.outputs[0].text for o in outs) == "Hello world "
    assert loop.scheduler.kv.num_free_blocks == 64 and not loop.scheduler.running
    assert loop.output.texts == {} and loop.output.requests == {}


def test_n_sequences_come_out_as_one_request_in_index_order(tokenizer):
    loop = Loop(tokenizer)
    loop.add("g", ["Hello world", "The cat sat. STOP here"], n=2, output_kind=CUMULATIVE, stop=["STOP"])
    outs = loop.run()["g"]
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert [c.text for c in final.outputs] == ["Hello world", "The cat sat. "]
    assert [c.finish_reason for c in final.outputs] == ["stop", "stop"] and final.outputs[1].stop_reason == "STOP"
    assert all(len(o.outputs) == 2 for o in outs)


def test_a_request_id_in_use_is_refused(tokenizer):
    loop = Loop(tokenizer)
    loop.add("same", "Hello")
    with pytest.raises(ValueError, match="request_id 'same' is already in use"):
        loop.add("same", "Hello")


def test_an_ended_request_gets_its_final_output_and_an_unknown_id_none(tokenizer):
    loop = Loop(tokenizer)
    (req,) = loop.add("a", "Hello world END of story", output_kind=FINAL_ONLY)
    loop.step()
    loop.step()
    loop.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
    out = loop.output.aborted("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].text == tokenizer.decode(req.output_token_ids)  # the deferred text, decoded now
    assert loop.output.aborted("a") is None and loop.output.aborted("never") is None


def test_a_token_its_detokenizer_cannot_decode_fails_that_request_alone(tokenizer):
    loop = Loop(tokenizer)
    loop.add("bad", "Hello world")
    loop.add("good", "Hello world")
    loop.scripts["bad"].insert(1, len(tokenizer) + 5)  # an id past the tokenizer's vocabulary
    outs = loop.run()
    bad, good = outs["bad"][-1], outs["good"][-1]
    assert bad.outputs[0].finish_reason == "error" and "output processing failed: ValueError" in bad.error
    assert "out of range" in bad.error
    assert good.error is None and good.outputs[0].text == "Hello world"
